/*
 * Run-time choice of the SIMD path.  This file is compiled for the baseline
 * ISA: it must run on any x86-64 (or aarch64) CPU.  The AVX2 kernels are used
 * only when CPUID reports both AVX2 and FMA (separate bits), the AVX-512 ones
 * only when it reports AVX-512 F, DQ, BW and VL (and AVX2 and FMA); in both
 * cases the OS must save the registers (YMM; ZMM and mask), which the
 * compiler's __builtin_cpu_supports checks through XGETBV.  Preference:
 * avx512, then avx2, then generic.
 * The Python layer reads FASTATTN_ISA at import and calls fa_set_isa.
 */
#include <string.h>

#include "internal.h"

/* The kernels of one ISA, for both dtypes; lanes are filled in from the
 * kernel files at first use (lookup). */
#define FA_KERNELS(isa)                                                                     \
    .attn_item = {fa_attn_item_f32_##isa, fa_attn_item_f64_##isa},                          \
    .attn_item_rows = {fa_attn_item_rows_f32_##isa, fa_attn_item_rows_f64_##isa},           \
    .attn_group_rows = {fa_attn_group_rows_f32_##isa, fa_attn_group_rows_f64_##isa},        \
    .attn_merge = {fa_attn_merge_f32_##isa, fa_attn_merge_f64_##isa},                       \
    .bwd_unit = {fa_bwd_unit_f32_##isa, fa_bwd_unit_f64_##isa},                             \
    .weights_item = {fa_weights_item_f32_##isa, fa_weights_item_f64_##isa},                \
    .softmax_row = {fa_softmax_row_f32_##isa, fa_softmax_row_f64_##isa},                    \
    .exp = {fa_exp_f32_##isa, fa_exp_f64_##isa}, .exp_neg = {fa_exp_neg_f32_##isa, fa_exp_neg_f64_##isa}

/* The tuning of each path, {float32, float64} where there are two
 * (docs/tuning.md has the measurements, by field; plan.c uses them):
 *   rows_max      the most query rows that take the row kernel rather than the tiled
 *                 one, whose query rows fill the SIMD lanes;
 *   rows_max_big  the same when K and V exceed FA_KV_MEM_BYTES: from memory the row
 *                 kernel's prefetch keeps ahead of the tiled kernel for more rows;
 *   rows_max_dk   the same when dk >= FA_ROWS_DK_BIG, K and V in cache: long dot
 *                 products hide the row kernel's horizontal sums;
 *   rows_full     from this many rows up to one vector's lanes, the tiled kernel even
 *                 below rows_max (0: never), since one vector of rows is its best block;
 *   tail_max      the most rows past the tiled kernel's last whole vector (of at least
 *                 16 rows) that the row kernel takes, after that block;
 *   fuse          the tiled kernel's fused exp, where 32 vector registers leave it room;
 *   fold_rows, fold_rows_big, fold_big_bytes  the GQA fold (fa_gqa_fold): a group's
 *                 heads as one item's rows, where the row kernel then reads K and V
 *                 once for them; more rows with large K and V on the SIMD paths. */
static fa_isa_table table_generic = {
    .name = "generic", .rows_max = {10, 10}, .rows_max_big = {10, 10}, .rows_max_dk = {10, 10},
    .rows_full = {0, 0}, .tail_max = {3, 1}, .fuse = 0,
    .fold_rows = 8, .fold_rows_big = 8, .fold_big_bytes = INT64_MAX, FA_KERNELS(generic)};
#ifdef FA_HAVE_AVX2_BUILD
static fa_isa_table table_avx2 = {
    .name = "avx2", .rows_max = {6, 3}, .rows_max_big = {5, 5}, .rows_max_dk = {6, 3},
    .rows_full = {0, 0}, .tail_max = {4, 2}, .fuse = 0,
    .fold_rows = 8, .fold_rows_big = 12, .fold_big_bytes = 4 << 20, FA_KERNELS(avx2)};
#endif
#ifdef FA_HAVE_AVX512_BUILD
static fa_isa_table table_avx512 = {
    .name = "avx512", .rows_max = {12, 12}, .rows_max_big = {24, 20}, .rows_max_dk = {24, 20},
    .rows_full = {14, 0}, .tail_max = {8, 4}, .fuse = 1,
    .fold_rows = 8, .fold_rows_big = 12, .fold_big_bytes = 4 << 20, FA_KERNELS(avx512)};
#endif

static const fa_isa_table *current = NULL;

static int cpu_has_avx2_fma(void)
{
#if defined(FA_HAVE_AVX2_BUILD) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

#ifdef FA_HAVE_AVX512_BUILD
static int cpu_has_avx512(void)
{
#if defined(__GNUC__) || defined(__clang__)
    return cpu_has_avx2_fma() && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
#else
    return 0;
#endif
}
#endif

static const fa_isa_table *lookup(const char *name)
{
    if (table_generic.lanes[0] == 0) {
        table_generic.lanes[0] = fa_lanes_f32_generic;
        table_generic.lanes[1] = fa_lanes_f64_generic;
#ifdef FA_HAVE_AVX2_BUILD
        table_avx2.lanes[0] = fa_lanes_f32_avx2;
        table_avx2.lanes[1] = fa_lanes_f64_avx2;
#endif
#ifdef FA_HAVE_AVX512_BUILD
        table_avx512.lanes[0] = fa_lanes_f32_avx512;
        table_avx512.lanes[1] = fa_lanes_f64_avx512;
#endif
    }
    if (strcmp(name, "generic") == 0) return &table_generic;
#ifdef FA_HAVE_AVX2_BUILD
    if (strcmp(name, "avx2") == 0 && cpu_has_avx2_fma()) return &table_avx2;
#endif
#ifdef FA_HAVE_AVX512_BUILD
    if (strcmp(name, "avx512") == 0 && cpu_has_avx512()) return &table_avx512;
#endif
    return NULL;
}

int fa_isa_available(const char *name) { return lookup(name) != NULL; }

int fa_set_isa(const char *name)
{
    const fa_isa_table *t = lookup(name);
    if (!t) return FA_EINVAL;
    current = t;
    return FA_OK;
}

const fa_isa_table *fa_isa_current(void)
{
    if (!current) {
        const fa_isa_table *t = lookup("avx512");
        if (!t) t = lookup("avx2");
        current = t ? t : lookup("generic");
    }
    return current;
}

const char *fa_isa_name(void) { return fa_isa_current()->name; }

int fa_exp(int dtype, int which, const void *x, void *y, int64_t n)
{
    if (dtype != FA_F32 && dtype != FA_F64) return FA_EINVAL;
    (which ? fa_isa_current()->exp_neg : fa_isa_current()->exp)[dtype](x, y, n);
    return FA_OK;
}
