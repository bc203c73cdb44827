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

/* rows_max, rows_max_big and rows_max_dk for float32 (r..32) and float64 (r..64);
 * full32 and full64: rows_full; tail32 and tail64: tail_max */
#define FA_TABLE(isa, r32, r64, big32, big64, dk32, dk64, full32, full64, tail32, tail64, fuse) \
    {                                                                              \
        #isa,                                                                      \
        {0, 0}, /* lanes are filled in from the kernel files at first use */      \
        {r32, r64},                                                                \
        {big32, big64},                                                            \
        {dk32, dk64},                                                              \
        {full32, full64},                                                          \
        {tail32, tail64},                                                          \
        fuse,                                                                      \
        {fa_attn_item_f32_##isa, fa_attn_item_f64_##isa},                          \
        {fa_attn_item_rows_f32_##isa, fa_attn_item_rows_f64_##isa},                \
        {fa_attn_group_rows_f32_##isa, fa_attn_group_rows_f64_##isa},              \
        {fa_attn_merge_f32_##isa, fa_attn_merge_f64_##isa},                        \
        {fa_weights_item_f32_##isa, fa_weights_item_f64_##isa},                    \
        {fa_softmax_row_f32_##isa, fa_softmax_row_f64_##isa},                      \
        {fa_exp_f32_##isa, fa_exp_f64_##isa},                                      \
        {fa_exp_neg_f32_##isa, fa_exp_neg_f64_##isa},                              \
    }

/* rows_max: the most query rows that take the row kernel rather than the tiled
 * one (whose query rows fill the SIMD lanes: 9 rows cost as much as 16).  Measured
 * with fa_set_rows_max, tiled time / row-kernel time at 9, 10, 11, 12, 13 rows,
 * float32 (float64): AVX-512 from memory (H32 Nk4096 d128) 1.35 1.33 1.21 1.48
 * 1.29 (1.32 1.20 1.20 1.28 1.20), in cache (H8 Nk512 d64) 1.20 1.09 1.00 1.05
 * 0.92 (1.18 1.06 0.95 1.01 0.90); AVX2 from memory 1.21 1.11 1.02 0.99 0.84
 * (1.17 1.13 1.05 0.99 1.09), in cache 1.25 1.13 1.05 1.02 0.94 (1.12 0.99 0.92
 * 0.88 0.96); portable from memory 1.30 1.19 1.08 1.01, in cache 1.27 1.16 1.04
 * 0.98.
 * rows_max_big: the same when the call's K and V exceed FA_KV_MEM_BYTES (48 MiB,
 * more than this machine's 32 MiB L3), so that both kernels stream them from
 * memory, where the row kernel's software prefetch keeps ahead of the tiled
 * kernel for more rows.  Tiled / row-kernel time at 13, 16, 20, 24, 32 rows,
 * AVX-512, 2 threads, d128: float32 48-128 MiB 1.26-1.30, 1.17-1.22, 1.33-1.47,
 * 1.24-1.33, 1.02 (32 MiB: 0.89-1.30, noisy; 16-24 MiB, in cache: 0.87-0.99 at
 * 13 to 16 rows); float64 64-128 MiB 1.11-1.28, 1.11-1.19, 1.07-1.24,
 * 0.94-1.09.
 * rows_max_dk: the same when dk >= FA_ROWS_DK_BIG (128), K and V in cache:
 * the row kernel's horizontal sums cost the same per score at any dk, so long
 * dot products hide them; and its P.V tile of 8 rows x 3 vectors (kernel_body.h;
 * the 0.87-0.99 in cache above was measured with 4 x 4) lifted it past the
 * tiled kernel there.  AVX-512, 2 threads, K and V 8-16 MiB, tiled /
 * row-kernel time at 13, 14, 15, 16, 17, 20, 24 rows: float32 d128 1.09-1.20,
 * 0.99-1.10, 0.97, 1.00-1.08, 1.40, 1.21-1.26, 1.07-1.14 (one thread: 1.07,
 * 0.99, 0.90, 0.95, 1.39, 1.28, 1.07); d256 1.20 at 13, 1.02 at 16, 1.31 at 20;
 * float64 d128 1.07, 0.98, 0.89, 0.92, 1.19, 1.12, 0.95.  Below d128 the tiled
 * kernel wins from 13 rows on (d64 and d96: 0.75-0.92 at 13-16 and 24 rows,
 * d112 0.84-1.06).
 * AVX2, since the tiled kernel's 64-key tiles (attention.c, choose_tiles),
 * which keep it fed from memory with few query rows: tiled / row-kernel time
 * at 2, 3, 4, 5, 6, 7, 8, 10 rows, 2 threads.  float32 from memory (H32
 * Nk4096 d128) 1.28 1.33 1.29 1.15 1.05 1.02 1.00 0.89; in cache (H8 Nk1024
 * d64 and d128) 1.62-1.80, 1.52-1.67, 1.36-1.38, 1.10-1.13, 1.00, 0.95-0.97,
 * 0.82-0.87, 0.96-1.04: 6.  float64 from memory 1.24 1.21 1.13 1.12 1.02
 * 1.00 0.94 1.01; in cache (d64 and d128) 1.11-1.13, 1.06-1.09, 0.92-0.94,
 * 0.94, 0.83, 0.75-0.77, 0.70, 0.82: 3.  From memory the tiled kernel then
 * took 32-key tiles for blocks of up to 32 rows (choose_tiles), after which
 * tiled / row kernel at 4, 5, 6, 7 rows: float32 1.12 1.02 0.94 0.92,
 * float64 1.05 1.07 0.92 0.90: 5 for both.  Before them the row kernel kept
 * up to 10 rows (the tiled kernel was as fast or faster from 11 rows on).
 * The portable path: tiled / row kernel at 3, 5, 7, 9 rows
 * 1.09-1.36, 1.12-1.33, 0.97-1.19, 1.01-1.30 (float32 and float64, in cache
 * and from memory), so it keeps 10. */
/* rows_full: from this many query rows up to one vector's lanes, the tiled
 * kernel even below rows_max (not where dk > 128 with K and V from memory).
 * With AVX-512, float32 (16 lanes), tiled / row-kernel time at 13, 14, 15, 16
 * rows (of H32 Nk4096 d128 and H32 Nk8192 d64 from memory, H8 Nk2048 d128 and
 * H8 Nk1024 d256 in cache; two threads, then one): from memory d128 1.03, 1.00,
 * 0.92, 0.94 (one thread 1.11, 1.00, 0.93, 0.95), d64 0.88, 0.82, 0.73, 0.74;
 * in cache d128 1.03, 0.94, 0.83, 0.85, d256 1.00, 0.88, 0.83, 0.88; d256 from
 * memory (H16 Nk4096) 1.27, 1.12, 1.10, 1.15, hence not there.  Then in one
 * process against the build before, 14, 15 and 16 rows: 0.99-1.23x, 1.10-1.37x
 * and 1.09-1.37x (those shapes, one and two threads), GQA H32/8 d128 four rows
 * (16 a group) 1.06-1.14x.  float64 (8 lanes): the row kernel as fast or faster
 * at 7, 8 and 14-16 rows (0.73-1.13), so 0.  On AVX2 the row kernel stops below
 * one vector's lanes (8 float32, 4 float64), except for float64 from memory (5),
 * where it was the faster at 4 rows (1.05 above): 0. */
/* tail_max: the most rows past the tiled kernel's last whole vector (of at
 * least 16 rows) that the row kernel takes, after that block (attention.c,
 * run: the tail).  In one process against the build before, 2 threads, B1 H8
 * Nk1024 d64 in cache unless noted, rows = 16 + r (AVX2: also 8 + r):
 * AVX-512 float32 r = 1, 4, 8, 9, 10, 12: 1.49-1.55x, 1.28-1.33x, 1.13x, 1.08x,
 * 1.00x, 0.93x; 33 and 100 rows 1.31x and 1.08x; from memory (H32 Nk4096
 * d128) 33, 36, 38, 40, 42, 26 rows 1.22x, 1.14x, 1.07x, 1.03x, 0.96-0.99x,
 * 0.89-0.99x: 8.  float64 r = 1, 2, 3, 4, 5, 6: 1.22x, 1.13x, 1.06x, 1.08x
 * (8 + 4: 1.00x), 1.00x, 0.99x: 4.  AVX2 float32 16 + r, r = 1, 2, 3, 4:
 * 1.31-1.34x, 1.22x, 1.14x, 1.07-1.11x; 8 + r: 1.11x, 0.98x, 0.91x, 0.90x
 * (one vector is the tiled kernel's least efficient block: hence at least 16
 * rows before the tail on every path); 35 and 100 rows 1.08x and 1.05x: 4.
 * float64 16 + 1, 2, 3: 1.14x, 1.03x, 0.96x: 2.  Portable path float32 16 + 1,
 * 2, 3: 1.19x, 1.13x, 1.03x (35: 1.02x), float64 16 + 1: 1.05x. */
/* fuse: the tiled kernel's fused exp (kernel_body.h, FUSE_LAG) takes the exp
 * out of the Q.K^T accumulator registers.  With the 32 registers of AVX-512 it
 * measured 2-4 % faster (B1 H8 N2048 d64).  With 16 registers the 12
 * accumulators leave the exp no room and it spills: unfused was faster on
 * Zen 3 (AVX2, one thread, B1 H8 N2048): float32 d64 1.00-1.01x, d128 1.01x,
 * float64 1.05x; portable path (B1 H4 N1024) 1.05x and 1.07x. */
static fa_isa_table table_generic = FA_TABLE(generic, 10, 10, 10, 10, 10, 10, 0, 0, 3, 1, 0);
#ifdef FA_HAVE_AVX2_BUILD
static fa_isa_table table_avx2 = FA_TABLE(avx2, 6, 3, 5, 5, 6, 3, 0, 0, 4, 2, 0);
#endif
#ifdef FA_HAVE_AVX512_BUILD
static fa_isa_table table_avx512 = FA_TABLE(avx512, 12, 12, 24, 20, 24, 20, 14, 0, 8, 4, 1);
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
