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
#include <stdint.h>
#include <string.h>
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif

#include "internal.h"

/* The kernels of one ISA, for both dtypes; lanes are filled in from the
 * kernel files at first use (lookup). */
#define FA_KERNELS(isa)                                                                     \
    .attn_item = {fa_attn_item_f32_##isa, fa_attn_item_f64_##isa},                          \
    .attn_item_rows = {fa_attn_item_rows_f32_##isa, fa_attn_item_rows_f64_##isa},           \
    .attn_group_rows = {fa_attn_group_rows_f32_##isa, fa_attn_group_rows_f64_##isa},        \
    .attn_item_kv = {fa_attn_item_h16_##isa, fa_attn_item_b16_##isa},                      \
    .weights_item_kv = {fa_weights_item_h16_##isa, fa_weights_item_b16_##isa},             \
    .attn_item_rows_kv = {fa_attn_item_rows_h16_##isa, fa_attn_item_rows_b16_##isa},        \
    .attn_group_rows_kv = {fa_attn_group_rows_h16_##isa, fa_attn_group_rows_b16_##isa},     \
    .kv_widen = {fa_kv_widen_h16_##isa, fa_kv_widen_b16_##isa},                              \
    .attn_merge = {fa_attn_merge_f32_##isa, fa_attn_merge_f64_##isa},                       \
    .bwd_unit = {fa_bwd_unit_f32_##isa, fa_bwd_unit_f64_##isa},                             \
    .bwd_unit_kv = {fa_bwd_unit_h16_##isa, fa_bwd_unit_b16_##isa},                          \
    .bwd_lse_lo = {fa_bwd_lse_lo_f32_##isa, fa_bwd_lse_lo_f64_##isa},                       \
    .bwd_lse_lo_kv = {fa_bwd_lse_lo_h16_##isa, fa_bwd_lse_lo_b16_##isa},                    \
    .weights_item = {fa_weights_item_f32_##isa, fa_weights_item_f64_##isa},                \
    .softmax_row = {fa_softmax_row_f32_##isa, fa_softmax_row_f64_##isa},                    \
    .exp = {fa_exp_f32_##isa, fa_exp_f64_##isa}, .exp_neg = {fa_exp_neg_f32_##isa, fa_exp_neg_f64_##isa}

/* The default tuning of each ISA, for a CPU without a table of its own
 * (docs/tuning.md has the measurements, by field; plan.c uses them).  The
 * fields (internal.h, fa_tuning):
 *   rows_max      the most query rows that take the row kernel rather than the tiled
 *                 one, whose query rows fill the SIMD lanes;
 *   rows_max_big  the same when K and V exceed kv_mem_bytes, where both kernels
 *                 stream them from memory and the balance moves (more rows with
 *                 AVX-512, fewer for float32 on AVX2: docs/tuning.md);
 *   rows_max_dk   the same when dk >= FA_ROWS_DK_BIG, K and V in cache: long dot
 *                 products hide the row kernel's horizontal sums;
 *   rows_max_big_dk  > 0: in place of rows_max_big when dk >= FA_ROWS_DK_BIG (0:
 *                 rows_max_big), where the row kernel's pipelined loop (pipe_rows)
 *                 keeps up with memory for more rows than at shorter dot products
 *                 (the Xeon of xeon-a7: 10 float32 rows);
 *   rows_full     from this many rows up to one vector's lanes, the tiled kernel even
 *                 below rows_max (0: never), since one vector of rows is its best block;
 *   rows_full_dk  > 0: not so from this dk on, nor for 16-bit K and V from memory,
 *                 where K's and V's rows are contiguous (Zen 5's row kernel is the
 *                 faster there; over rows at the heads' stride it is not);
 *   rows_max_kv   > 0: in place of rows_max, rows_max_big and rows_max_dk for 16-bit K and
 *                 V, which the row kernel reads as stored and the tiled kernel widens
 *                 into its scratch first (0: those three);
 *   tail_max      the most rows past the tiled kernel's last whole vector (of at least
 *                 16 rows) that the row kernel takes, after that block;
 *   tail_mem      0: none after a single block with K and V from memory, where the tail
 *                 would read them a second time;
 *   tile_pf_l1    the tiled kernel's prefetch one pass ahead (tile_pf) into L1, not L2,
 *                 for items of at most 32 rows with K and V from memory;
 *   tile_spread   the tiled kernel's items of one float32 vector of rows (AVX-512) take
 *                 register tiles of 16 keys and 16 V columns that spread that prefetch
 *                 over their products, where a burst of it fills the L1's miss buffers;
 *   decode_pf     decoding's software prefetch of float32 and float64 K and V rows
 *                 (one row: item_rows, decode_step), where the hardware's alone falls behind;
 *   decode_far    ... into L2 and further ahead (the far kind, prefetch_row) where K and V
 *                 exceed kv_far_bytes, as for more rows (0: the near kind at any size; 16-bit
 *                 K and V: far);
 *   decode_inorder with that far kind, decode_step reads each of its four float32 or
 *                 float64 K and V rows whole, in address order, not the rows' vectors in turn;
 *   fuse          the tiled kernel's fused exp, where 32 vector registers leave it room;
 *   stream        the row kernel's prefetch across passes with K and V from memory;
 *   bk_tiled, bk_tiled_mem  the tiled kernel's keys a tile (from memory, blocks of at
 *                 most 32 rows: short tiles arrive in time through the prefetch);
 *   bq_tiled      the tiled kernel's most query rows a block without a mask or a band
 *                 (with one, at most 128), a power of two from 32 to FA_BQ_MAX: each K
 *                 and V element read for more of them (the Xeon of xeon-a7: 512;
 *                 elsewhere 128, unmeasured);
 *   q_tile_bytes  the tiled kernel's query rows a block: halved from bq_tiled while its
 *                 transposed queries exceed this (the L1 on Zen 4; more rows a block
 *                 read each K and V element for more of them);
 *   q_tile_bytes_band  the same under a causal band or a window, where a larger
 *                 block also computes more of the scores that the band hides;
 *   bk_rows, bk_decode  the row kernel's keys a tile (one row: bk_decode), long (fewer
 *                 switches between the K and V streams);
 *   group_tile_bytes, group_bk_max  the group kernel's key tiles for items of several
 *                 rows: about that many bytes of the group's K and V, 8 to group_bk_max keys;
 *   group_touch   the group kernel reads its next tile ahead by loads in address order,
 *                 where software prefetch at the heads' stride falls behind (Zen 3);
 *   group_chunks_rows  the group kernel's items of several rows (GQA's folded heads,
 *                 a few tokens) take chunks of keys as one-row items do, where they
 *                 keep up with memory better than key tiles (the Xeon of xeon-a7);
 *   pipe_rows     K and V from memory: up to that many query rows take the row kernel's
 *                 pipelined loop, which reads K and V together in steps of four keys
 *                 (1: decoding only; the Xeon of xeon-a7: 10, Zen 4: 12);
 *   pipe_pf_l2    that loop prefetches K and V into L2, further ahead, not into L1,
 *                 where the L1 kind waits on its prefetches (Zen 4);
 *   group_rows    > 0: up to that many query rows of a (B, n, H, d) cache from memory
 *                 take the group kernel even past rows_max_big, where the tiled kernel
 *                 reads each head's rows in pieces H d apart (float64 on the Xeon of
 *                 xeon-a7, whose rows_max_big is 2);
 *   fold_rows, fold_rows_big, fold_big_bytes  the GQA fold (fa_gqa_fold): a group's
 *                 heads as one item's rows, where the row kernel then reads K and V
 *                 once for them; more rows with large K and V on the SIMD paths;
 *   kv_mem_bytes  K and V beyond this come from memory (1.5 L3: the L3 holds them
 *                 no longer); kv_far_bytes  beyond this the far prefetch (L3 / 2);
 *   bwd_bq, bwd_bk  the backward's query rows a block and keys a unit: the query
 *                 side's packing and the dQ rows' loads are repeated once a unit, so
 *                 the 16-register paths take long units.
 * The two sizes of an ISA's default follow this CPU's L3 (builtin_for). */
#define TUNE_GENERIC(nm)                                                                                   \
    {.name = nm, .rows_max = {10, 10}, .rows_max_big = {10, 10}, .rows_max_dk = {10, 10},                  \
     .rows_max_big_dk = {0, 0}, .tile_spread = 0, .pipe_pf_l2 = 0,                                         \
     .rows_full = {0, 0}, .tail_max = {3, 1}, .decode_pf = {1, 1}, .fuse = 0, .stream = 1, .bk_tiled = 64, \
     .bk_tiled_mem = 32, .q_tile_bytes = 32768, .q_tile_bytes_band = 32768, .bk_rows = 128,               \
     .bq_tiled = 128,                                                                                     \
     .bk_decode = 256, .group_bk_max = 64, .group_tile_bytes = 256 << 10, .group_touch = 0,                \
     .group_chunks_rows = 0, .pipe_rows = {1, 1}, .group_rows = {0, 0},                                    \
     .fold_rows = 8, .fold_rows_big = 8,                                                                   \
     .fold_big_bytes = INT64_MAX, .kv_mem_bytes = (int64_t)48 << 20, .kv_far_bytes = (int64_t)16 << 20,    \
     .bwd_bq = 64, .bwd_bk = 256, .rows_full_dk = 0, .rows_max_kv = 0, .tail_mem = 1, .tile_pf_l1 = 0,     \
     .decode_far = 1, .decode_inorder = 0}
/* The avx2 default is Zen 3's table but for q_tile_bytes (docs/tuning.md, "Zen 3"). */
#define TUNE_AVX2(nm) TUNE_AVX2_Q(nm, 32768)
#define TUNE_AVX2_Q(nm, qtile)                                                                            \
    {.name = nm, .rows_max = {6, 3}, .rows_max_big = {4, 5}, .rows_max_dk = {6, 3}, .rows_full = {0, 0},  \
     .rows_max_big_dk = {0, 0}, .tile_spread = 0, .pipe_pf_l2 = 0,                                        \
     .tail_max = {4, 2}, .decode_pf = {1, 1}, .fuse = 0, .stream = 1, .bk_tiled = 64, .bk_tiled_mem = 32, \
     .q_tile_bytes = qtile, .q_tile_bytes_band = 32768, .bk_rows = 128, .bk_decode = 256,                 \
     .bq_tiled = 128,                                                                                     \
     .group_bk_max = 64,                                                                                  \
     .group_tile_bytes = 256 << 10, .group_touch = 1, .group_chunks_rows = 0,                             \
     .pipe_rows = {1, 1}, .group_rows = {0, 0}, .fold_rows = 8, .fold_rows_big = 12,                      \
     .fold_big_bytes = 4 << 20, .kv_mem_bytes = (int64_t)48 << 20, .kv_far_bytes = (int64_t)16 << 20,     \
     .bwd_bq = 64, .bwd_bk = 256, .rows_full_dk = 0, .rows_max_kv = 12, .tail_mem = 1, .tile_pf_l1 = 0,   \
     .decode_far = 1, .decode_inorder = 0}
#define TUNE_AVX512(nm)                                                                                     \
    {.name = nm, .rows_max = {12, 12}, .rows_max_big = {24, 20}, .rows_max_dk = {24, 20},                   \
     .rows_max_big_dk = {0, 0}, .tile_spread = 0, .pipe_pf_l2 = 0,                                          \
     .rows_full = {14, 0}, .tail_max = {8, 4}, .decode_pf = {1, 1}, .fuse = 1, .stream = 1, .bk_tiled = 64, \
     .bk_tiled_mem = 32, .q_tile_bytes = 32768, .q_tile_bytes_band = 32768, .bk_rows = 128,                \
     .bq_tiled = 128,                                                                                      \
     .bk_decode = 256, .group_bk_max = 64,                                                                  \
     .group_tile_bytes = 256 << 10, .group_touch = 0, .group_chunks_rows = 0,                               \
     .pipe_rows = {1, 1}, .group_rows = {0, 0}, .fold_rows = 8, .fold_rows_big = 12,                        \
     .fold_big_bytes = 4 << 20, .kv_mem_bytes = (int64_t)48 << 20, .kv_far_bytes = (int64_t)16 << 20,       \
     .bwd_bq = 32, .bwd_bk = 64, .rows_full_dk = 0, .rows_max_kv = 0, .tail_mem = 1, .tile_pf_l1 = 0,       \
     .decode_far = 1, .decode_inorder = 0}

static fa_isa_table table_generic = {.name = "generic", .tune = TUNE_GENERIC("generic"), FA_KERNELS(generic)};
#ifdef FA_HAVE_AVX2_BUILD
static fa_isa_table table_avx2 = {.name = "avx2", .tune = TUNE_AVX2("avx2"), FA_KERNELS(avx2)};
#endif
#ifdef FA_HAVE_AVX512_BUILD
static fa_isa_table table_avx512 = {.name = "avx512", .tune = TUNE_AVX512("avx512"), FA_KERNELS(avx512)};
#endif

/* Zen 5, retuned (docs/tuning.md, "Zen 5"). */
#define TUNE_ZEN5                                                                                           \
    {.name = "zen5", .rows_max = {12, 10}, .rows_max_big = {24, 20}, .rows_max_dk = {24, 12},               \
     .rows_max_big_dk = {0, 0}, .tile_spread = 0, .pipe_pf_l2 = 0,                                          \
     .rows_full = {14, 0}, .tail_max = {8, 4}, .decode_pf = {0, 0}, .fuse = 1, .stream = 0, .bk_tiled = 64, \
     .bk_tiled_mem = 16, .q_tile_bytes = 131072, .q_tile_bytes_band = 131072, .bk_rows = 512,             \
     .bq_tiled = 128,                                                                                     \
     .bk_decode = 1024, .group_bk_max = 256,                                                                \
     .group_tile_bytes = 1 << 20, .group_touch = 0, .group_chunks_rows = 0,                                 \
     .pipe_rows = {1, 1}, .group_rows = {0, 0}, .fold_rows = 8, .fold_rows_big = 12,                        \
     .fold_big_bytes = 4 << 20, .kv_mem_bytes = (int64_t)48 << 20, .kv_far_bytes = INT64_MAX, .bwd_bq = 64, \
     .bwd_bk = 256, .rows_full_dk = 128, .rows_max_kv = 0, .tail_mem = 1, .tile_pf_l1 = 0,                  \
     .decode_far = 1, .decode_inorder = 0}

/* Zen 4, the avx512 default but for the row kernel's key tiles, the backward's
 * tiles, the tiled kernel's spread tiles and its key tiles of few rows from
 * memory (64 keys), the group kernel's items of several rows
 * in chunks of keys, and up to 12 float32 rows (float64: 8) from memory in the row
 * kernel's pipelined loop, its prefetch into L2; decoding from memory reads its
 * K and V rows in address order (docs/tuning.md, "Zen 4"). */
#define TUNE_ZEN4                                                                                           \
    {.name = "zen4", .rows_max = {12, 12}, .rows_max_big = {24, 20}, .rows_max_dk = {24, 20},               \
     .rows_max_big_dk = {0, 0}, .tile_spread = 1, .pipe_pf_l2 = 1,                                          \
     .rows_full = {14, 0}, .tail_max = {8, 4}, .decode_pf = {1, 1}, .fuse = 1, .stream = 1, .bk_tiled = 64, \
     .bk_tiled_mem = 64, .q_tile_bytes = 32768, .q_tile_bytes_band = 32768, .bk_rows = 512,                \
     .bq_tiled = 128,                                                                                      \
     .bk_decode = 256, .group_bk_max = 64,                                                                  \
     .group_tile_bytes = 256 << 10, .group_touch = 0, .group_chunks_rows = 1,                               \
     .pipe_rows = {12, 8}, .group_rows = {0, 0}, .fold_rows = 8, .fold_rows_big = 12,                       \
     .fold_big_bytes = 4 << 20, .kv_mem_bytes = (int64_t)48 << 20, .kv_far_bytes = (int64_t)16 << 20,       \
     .bwd_bq = 64, .bwd_bk = 256, .rows_full_dk = 0, .rows_max_kv = 0, .tail_mem = 1, .tile_pf_l1 = 0,      \
     .decode_far = 1, .decode_inorder = 1}

/* An Intel Xeon that KVM reports as family 6 model 167 with a 480 MiB L3, AMX
 * and AVX512-FP16 (Granite Rapids by those; docs/tuning.md, "Intel Xeon, model
 * 167"): the avx512 default but for K and V from memory beyond 48 MiB (not 1.5
 * times the socket's L3, of which two cores of a VM hold far less), no
 * prefetch across passes, longer key tiles for the row kernel, shorter ones
 * for the tiled kernel from memory, larger query tiles (without a mask up
 * to 512 rows), prefill's and the
 * backward's; from memory the tiled kernel from 9 rows (float32 at dk >= 128:
 * 11; float64: 3), without
 * a tail after a single block; float64 from 13 rows at d128 in cache, and its
 * decoding without software prefetch; the group kernel's items of several rows
 * in chunks of keys, up to 8 float64 rows of a (B, n, H, d) cache from
 * memory in the group kernel, and up to 10 float32 rows (float64: 8) from
 * memory in the row kernel's pipelined loop.  The same table, as `xeon-cf`,
 * for Emerald Rapids (model 207), where it beat the avx512 default from
 * memory by as much, but for no far prefetch (far: kv_far_bytes; there
 * decoding 16-bit K and V without it was faster; docs/tuning.md, "Intel
 * Xeon, model 207"). */
#define TUNE_XEON(nm, far)                                                                                   \
    {.name = nm, .rows_max = {12, 12}, .rows_max_big = {8, 2}, .rows_max_dk = {24, 12},                      \
     .rows_max_big_dk = {10, 0}, .tile_spread = 1, .pipe_pf_l2 = 0,                                         \
     .rows_full = {14, 0}, .tail_max = {8, 4}, .decode_pf = {1, 0}, .fuse = 1, .stream = 0, .bk_tiled = 64, \
     .bk_tiled_mem = 16, .q_tile_bytes = 131072, .q_tile_bytes_band = 32768, .bk_rows = 512,               \
     .bq_tiled = 512,                                                                                       \
     .bk_decode = 256, .group_bk_max = 64,                                                                  \
     .group_tile_bytes = 256 << 10, .group_touch = 0, .group_chunks_rows = 1,                               \
     .pipe_rows = {10, 8}, .group_rows = {8, 8}, .fold_rows = 8, .fold_rows_big = 12,                       \
     .fold_big_bytes = 4 << 20, .kv_mem_bytes = (int64_t)48 << 20, .kv_far_bytes = far,                     \
     .bwd_bq = 64, .bwd_bk = 256, .rows_full_dk = 0, .rows_max_kv = 0, .tail_mem = 0, .tile_pf_l1 = 1,      \
     .decode_far = 0, .decode_inorder = 0}

/* The CPUs with tables of their own, by CPUID vendor, family and model ranges
 * (as Linux's arch/x86/kernel/cpu/amd.c names them) and an L3 of at least
 * l3_min bytes (0: any), for one ISA: the defaults above were measured on
 * these CPUs (Zen 3 for avx2, Zen 4 for avx512), with their measured cache
 * sizes; Zen 3, 4 and 5 since retuned. */
typedef struct {
    const char *vendor;
    int family, model_lo, model_hi;
    int64_t l3_min;
    const char *isa;
    fa_tuning tune;
} cpu_table;
static const cpu_table cpu_tables[] = {
    {"AuthenticAMD", 0x19, 0x00, 0x0f, 0, "avx2", TUNE_AVX2_Q("zen3", 65536)},
    {"AuthenticAMD", 0x19, 0x20, 0x5f, 0, "avx2", TUNE_AVX2_Q("zen3", 65536)},
    {"AuthenticAMD", 0x19, 0x10, 0x1f, 0, "avx512", TUNE_ZEN4},
    {"AuthenticAMD", 0x19, 0x60, 0xaf, 0, "avx512", TUNE_ZEN4},
    {"AuthenticAMD", 0x1a, 0x00, 0x4f, 0, "avx512", TUNE_ZEN5},
    {"AuthenticAMD", 0x1a, 0x60, 0x7f, 0, "avx512", TUNE_ZEN5},
    /* not Rocket Lake, the desktop CPU of that model (16 MiB L3) */
    {"GenuineIntel", 0x06, 0xa7, 0xa7, (int64_t)256 << 20, "avx512", TUNE_XEON("xeon-a7", (int64_t)16 << 20)},
    /* Granite Rapids as it reports itself outside such a VM (0xad, 0xae; not measured) */
    {"GenuineIntel", 0x06, 0xad, 0xae, 0, "avx512", TUNE_XEON("xeon-a7", (int64_t)16 << 20)},
    /* Sapphire Rapids (0x8f, not measured) and Emerald Rapids (0xcf): the same cores */
    {"GenuineIntel", 0x06, 0x8f, 0x8f, 0, "avx512", TUNE_XEON("xeon-cf", INT64_MAX)},
    {"GenuineIntel", 0x06, 0xcf, 0xcf, 0, "avx512", TUNE_XEON("xeon-cf", INT64_MAX)},
};

static void read_cpu(fa_cpu *out);

/* CPUID once: a VM traps each CPUID instruction, and every table lookup asks. */
void fa_cpu_info(fa_cpu *out)
{
    static fa_cpu cpu;
    static int known = 0;
    if (!__atomic_load_n(&known, __ATOMIC_ACQUIRE)) {
        fa_cpu c;
        read_cpu(&c);
        cpu = c; /* the same bytes from any thread that gets here */
        __atomic_store_n(&known, 1, __ATOMIC_RELEASE);
    }
    *out = cpu;
}

/* What CPUID says: vendor, family and model (extended ones folded in), brand,
 * and the L2 and L3 sizes. */
static void read_cpu(fa_cpu *out)
{
    memset(out, 0, sizeof *out);
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return;
    const unsigned max_leaf = a;
    memcpy(out->vendor, &b, 4);
    memcpy(out->vendor + 4, &d, 4);
    memcpy(out->vendor + 8, &c, 4);
    if (__get_cpuid(1, &a, &b, &c, &d)) {
        int fam = (a >> 8) & 0xf, model = (a >> 4) & 0xf;
        if (fam == 0xf) fam += (a >> 20) & 0xff;
        if (fam == 0x6 || fam >= 0xf) model += ((a >> 16) & 0xf) << 4;
        out->family = fam, out->model = model, out->stepping = a & 0xf;
    }
    unsigned ext = __get_cpuid_max(0x80000000, NULL);
    if (ext >= 0x80000004) {
        unsigned r[12];
        for (unsigned i = 0; i < 3; i++) __get_cpuid(0x80000002 + i, &r[4 * i], &r[4 * i + 1], &r[4 * i + 2], &r[4 * i + 3]);
        memcpy(out->brand, r, 48);
        out->brand[48] = 0;
    }
    /* the cache parameters: Intel's leaf 4, AMD's 0x8000001d (the same layout:
     * one L3 of one core complex, where 0x80000006 may count the whole package) */
    const int amd = strcmp(out->vendor, "AuthenticAMD") == 0 || strcmp(out->vendor, "HygonGenuine") == 0;
    const unsigned leaf = amd ? 0x8000001d : 4;
    if (amd ? ext >= 0x8000001d : max_leaf >= 4) {
        for (unsigned i = 0; i < 16; i++) {
            __cpuid_count(leaf, i, a, b, c, d);
            const unsigned type = a & 0x1f, level = (a >> 5) & 0x7;
            if (type == 0) break;
            if (type == 2) continue; /* instruction cache */
            const int64_t bytes =
                (int64_t)((b >> 22) + 1) * (((b >> 12) & 0x3ff) + 1) * ((b & 0xfff) + 1) * ((int64_t)c + 1);
            if (level == 2) out->l2_bytes = bytes;
            if (level == 3) out->l3_bytes = bytes;
        }
    }
    if (amd && out->l2_bytes == 0 && ext >= 0x80000006 && __get_cpuid(0x80000006, &a, &b, &c, &d)) {
        out->l2_bytes = (int64_t)(c >> 16) << 10;
        out->l3_bytes = (int64_t)(d >> 18) << 19;
    }
#endif
}

static const fa_isa_table *current = NULL;

#if defined(FA_HAVE_AVX2_BUILD) && (defined(__GNUC__) || defined(__clang__))
static int cpu_has_f16c(void)
{
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
}
#endif

static int cpu_has_avx2_fma(void)
{
#if defined(FA_HAVE_AVX2_BUILD) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    /* F16C (every AVX2 CPU has it) for the float16 K and V kernels */
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
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

/* The tuning in use: two slots, so that a call that copies the table while
 * fa_tuning_set writes the other still reads a whole one (fa_attention_plan
 * copies it first; setting it is for import time and fastattn.tune, not for
 * while other threads run calls). */
static fa_tuning tunings[2];
static const fa_tuning *tuning = NULL;

/* The built-in tuning of table t's ISA on this CPU: its own table if one was
 * measured, else the ISA's default with sizes from this CPU's L3, counted as at
 * most L3_CAP: a larger L3 is a server socket's, shared by dozens of cores (a
 * VM's two cores hold far less of it: docs/tuning.md, kv_mem_bytes). */
#define L3_CAP ((int64_t)32 << 20)
static void builtin_for(const fa_isa_table *t, fa_tuning *out)
{
    fa_cpu cpu;
    fa_cpu_info(&cpu);
    for (size_t i = 0; i < sizeof cpu_tables / sizeof cpu_tables[0]; i++) {
        const cpu_table *c = &cpu_tables[i];
        if (strcmp(c->vendor, cpu.vendor) == 0 && c->family == cpu.family && cpu.model >= c->model_lo &&
            cpu.model <= c->model_hi && cpu.l3_bytes >= c->l3_min && strcmp(c->isa, t->name) == 0) {
            *out = c->tune;
            return;
        }
    }
    *out = t->tune;
    if (cpu.l3_bytes >= ((int64_t)4 << 20)) {
        const int64_t l3 = cpu.l3_bytes < L3_CAP ? cpu.l3_bytes : L3_CAP;
        out->kv_mem_bytes = l3 / 2 * 3;
        out->kv_far_bytes = l3 / 2;
    }
}

static void use_tuning(const fa_tuning *t)
{
    fa_tuning *slot = &tunings[tuning == &tunings[0]];
    *slot = *t;
    slot->name[sizeof slot->name - 1] = 0;
    __atomic_store_n(&tuning, slot, __ATOMIC_RELEASE);
}

int fa_set_isa(const char *name)
{
    const fa_isa_table *t = lookup(name);
    if (!t) return FA_EINVAL;
    current = t;
    fa_tuning_reset();
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

void fa_tuning_builtin(fa_tuning *out) { builtin_for(fa_isa_current(), out); }

void fa_tuning_reset(void)
{
    fa_tuning t;
    fa_tuning_builtin(&t);
    use_tuning(&t);
}

const fa_tuning *fa_tuning_current(void)
{
    if (!__atomic_load_n(&tuning, __ATOMIC_ACQUIRE)) fa_tuning_reset();
    return __atomic_load_n(&tuning, __ATOMIC_ACQUIRE);
}

static int in(int64_t x, int64_t lo, int64_t hi) { return x >= lo && x <= hi; }

int fa_tuning_check(const fa_tuning *t)
{
    for (int dt = 0; dt < 2; dt++)
        if (!in(t->rows_max[dt], 1, FA_ROWS_CAP) || !in(t->rows_max_big[dt], 1, FA_ROWS_CAP) ||
            !in(t->rows_max_dk[dt], 1, FA_ROWS_CAP) || !in(t->rows_max_big_dk[dt], 0, FA_ROWS_CAP) ||
            !in(t->rows_full[dt], 0, FA_LANES_MAX) ||
            !in(t->tail_max[dt], 0, FA_LANES_MAX - 1) || !in(t->decode_pf[dt], 0, 1) ||
            !in(t->group_rows[dt], 0, FA_GROUP_ROWS) || !in(t->pipe_rows[dt], 1, FA_ROWS_CAP))
            return FA_EINVAL;
    if (!in(t->fuse, 0, 1) || !in(t->stream, 0, 1) || !in(t->bk_tiled, 8, 512) || !in(t->bk_tiled_mem, 8, 512) ||
        !in(t->bq_tiled, 32, FA_BQ_MAX) || (t->bq_tiled & (t->bq_tiled - 1)) != 0 ||
        !in(t->q_tile_bytes, 4096, 1 << 22) || !in(t->q_tile_bytes_band, 4096, 1 << 22) ||
        !in(t->bk_rows, 8, 4096) || !in(t->bk_decode, 8, 4096) || !in(t->group_bk_max, 8, 1024) ||
        !in(t->group_tile_bytes, 1, (int64_t)1 << 30) || !in(t->group_touch, 0, 1) ||
        !in(t->group_chunks_rows, 0, 1) ||
        !in(t->rows_full_dk, 0, 1 << 16) || !in(t->rows_max_kv, 0, FA_ROWS_CAP) || !in(t->tail_mem, 0, 1) ||
        !in(t->tile_pf_l1, 0, 1) || !in(t->tile_spread, 0, 1) || !in(t->pipe_pf_l2, 0, 1) ||
        !in(t->decode_far, 0, 1) || !in(t->decode_inorder, 0, 1) ||
        !in(t->fold_rows, 0, 1024) || !in(t->fold_rows_big, 0, 1024) || t->fold_big_bytes < 0 ||
        t->kv_mem_bytes < 0 || t->kv_far_bytes < 0 || !in(t->bwd_bq, 8, 256) || !in(t->bwd_bk, 16, 1024))
        return FA_EINVAL;
    return FA_OK;
}

int fa_tuning_set(const fa_tuning *t)
{
    if (fa_tuning_check(t) != FA_OK) return FA_EINVAL;
    use_tuning(t);
    return FA_OK;
}

const char *fa_isa_name(void) { return fa_isa_current()->name; }

int fa_kv_widen(int kv_dtype, const void *x, float *y, int64_t n)
{
    if (kv_dtype != FA_KV_F16 && kv_dtype != FA_KV_BF16) return FA_EINVAL;
    fa_isa_current()->kv_widen[kv_dtype - 1](x, y, n);
    return FA_OK;
}

int fa_exp(int dtype, int which, const void *x, void *y, int64_t n)
{
    if (dtype != FA_F32 && dtype != FA_F64) return FA_EINVAL;
    (which ? fa_isa_current()->exp_neg : fa_isa_current()->exp)[dtype](x, y, n);
    return FA_OK;
}
