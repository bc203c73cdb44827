/*
 * Internal interface between the drivers (attention.c) and the kernels
 * (kernel_body.h, compiled once per dtype and ISA in kernels_*.c).
 */
#ifndef FASTATTN_INTERNAL_H
#define FASTATTN_INTERNAL_H

#include "fastattn.h"

#include <string.h>
/* fa_byte_bits by SSE2 (x86-64's baseline); -DFA_PORTABLE_BYTE_BITS takes the
 * multiply that other CPUs take (.ci/byte_bits_check.c checks it on x86-64). */
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(FA_PORTABLE_BYTE_BITS)
#define FA_SSE2_BYTE_BITS 1
#include <emmintrin.h>
#endif

/* Has the call been asked to stop (fa_attention_args.stop)?  Checked between
 * work items and key tiles; a stopped call's output is unspecified. */
static inline int fa_stopped(const volatile int *stop) { return stop && *stop; }

/* Up to 32 bool-mask bytes as bits: bit j is row[j * cs] != 0, j < len <= 32
 * (a tile's bit words in kernel_body.h, the packed mask in attention.c).  32
 * contiguous bytes by SSE2 compares on x86-64, elsewhere 8 at a time by a
 * multiply; a broadcast byte (cs == 0) as its one value. */
static inline uint32_t fa_byte_bits(const uint8_t *row, int64_t cs, int64_t len)
{
    if (len <= 0) return 0;
    if (cs == 0) return row[0] ? 0xffffffffu >> (32 - len) : 0;
    uint32_t bits = 0;
    if (cs == 1 && len == 32) {
#ifdef FA_SSE2_BYTE_BITS
        const __m128i z = _mm_setzero_si128();
        const uint32_t lo = (uint32_t)_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_loadu_si128((const __m128i *)row), z));
        const uint32_t hi = (uint32_t)_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_loadu_si128((const __m128i *)(row + 16)), z));
        bits = ~(lo | (hi << 16));
#else
        for (int b = 0; b < 4; b++) {
            uint64_t x;
            memcpy(&x, row + 8 * b, 8);
            /* nonzero bytes -> 0x01, then gather the 8 low bits with one multiply */
            x = ((((x & 0x7f7f7f7f7f7f7f7fULL) + 0x7f7f7f7f7f7f7f7fULL) | x) >> 7) & 0x0101010101010101ULL;
            bits |= (uint32_t)((x * 0x0102040810204080ULL) >> 56) << (8 * b);
        }
#endif
        return bits;
    }
    for (int64_t j = 0; j < len; j++) bits |= (uint32_t)(row[j * cs] != 0) << j;
    return bits;
}

/* Tile geometry of one attention call (chosen in attention.c). */
typedef struct {
    int64_t bq;   /* query rows per work item */
    int64_t bk;   /* key rows per tile */
    int64_t bqp;  /* bq rounded up to whole vectors of the kernel (a full item's; an
                   * item of fewer rows uses its own bq so rounded) */
    int64_t ld;   /* row stride of the tiled kernel's transposed tiles, >= bqp */
    int64_t q_main; /* query rows [0, q_main) in items of bq; rows [q_main, nq), fewer
                     * than a vector's lanes, one item more (attention.c, run) */
    int fuse;     /* the tiled kernel takes the fused exp (tiled.h, FUSE_LAG) */
    int stream;   /* K and V come from memory (kv_mem_bytes): the row kernel
                   * prefetches the V of a key tile during its scores and the next
                   * tile's K during its P.V (rows.h, item_rows) */
    int far;      /* K and V exceed the tuning's kv_far_bytes: the row kernel prefetches the
                   * K and V rows it reads into L2, further ahead (prefetch_row) */
    int pf_l1;    /* the tiled kernel prefetches its next pass's rows into L1, not L2
                   * (the tuning's tile_pf_l1; prefetch.h, tile_prefetch) */
    int spread;   /* items of one float32 vector of rows on AVX-512 take register tiles
                   * of 16 keys and 16 V columns, their prefetch spread over the
                   * products (the tuning's tile_spread; tiled.h) */
    int decode_pf; /* one row (decoding): the row kernel prefetches the K and V rows it
                   * reads (0: it leaves them to the hardware prefetchers) */
    int inorder;  /* with far, decoding float32 or float64 K and V reads each of its four
                   * rows whole, in address order (the tuning's decode_inorder; rows.h,
                   * decode_step) */
    int pipe_rows; /* up to this many rows (1: decoding only) the row kernel takes
                   * software-pipelined, K and V read together (rows.h, rows_step) */
    int pipe_pf_l2; /* rows_step prefetches K and V into L2, FAR_PF_BYTES ahead, not
                   * into L1 (the tuning's pipe_pf_l2; prefetch.h) */
    int group_touch; /* the group kernel's tiles: the next one read ahead by loads in
                   * address order (group.h, group_touch), not by software prefetch */
    int chunks_rows; /* the group kernel's items of several rows take chunks of keys
                   * (the tuning's group_chunks_rows; group.h, group_chunks) */
    int64_t kv_off, kv_rows; /* 16-bit K and V under the tiled or weights kernel: their
                   * float32 rows in each thread's scratch from element kv_off on (0:
                   * none), kv_rows of them (tiled.h, kv_rows_widened; attention.c
                   * clears its header first) */
    int64_t q_off; /* ... and 16-bit q (q_kv): an item's rows widened, (bq, dk) from
                   * element q_off on (tiled.h, pack_queries) */
    int64_t mt_off; /* a float mask the heads share, under head_turns: its tiles as the
                   * item transposed them, from element mt_off on (0: none), for the next
                   * item on the same mask rows (tiled.h, mask_cache; attention.c clears
                   * its header first) */
} fa_tiles;

/* One work item: query rows [i0, i0 + bq) of one leading index, against the
 * keys [j_lo, j_hi).  Pointers are already offset to the leading index and,
 * for q, mask, out and lse, to row i0.
 *   q     (bq, dk)  row stride a->q_rs
 *   k     (nk, dk)  row stride a->k_rs   (row 0, not j_lo)
 *   v     (nk, dv)  row stride a->v_rs   (row 0, not j_lo)
 *   mask  (bq, nk)  strides a->m_rs, a->m_cs, or NULL
 *   out   (bq, dv)  row stride a->o_rs
 *   lse   (bq)      stride a->lse_rs, or NULL
 *   mbits (bq, ceil(nk / 32) + 1)  the bool mask as bits, row stride mb_rs, or NULL
 * With part != NULL the item writes its partial result instead of out and
 * lse, for a split-key merge:
 *   part  (bq, dv + 2): acc[0..dv) / sum (the mean over its keys), running
 *                       max, running sum
 * next_q, next_k: what the thread reads first for its next item (prefetched by
 * the tiled kernel during its last key tile), or NULL:
 *   next_q  (next_bq, dk)  row stride a->q_rs
 *   next_k  (next_nk, dk)  row stride a->k_rs
 */
typedef struct {
    const void *q, *k, *v, *mask;
    void *out, *lse;
    void *part;
    int64_t i0, bq;
    int64_t pad;          /* padding rows after the bq real ones (q_len): the driver's, not the kernel's */
    int64_t j_lo, j_hi;   /* the keys of this item (a split's share); j_hi <= kv */
    int64_t kv;           /* keys that exist for this leading index */
    int64_t off;          /* kv - qn (q_len, or nq / row_group): row i's aligned position is i / row_group + off */
    double slope;         /* ALiBi slope of this leading index (0: none) */
    const void *next_q, *next_k;
    int64_t next_bq, next_nk;
    const uint32_t *mbits; /* a bool mask packed to bits (mask_pack in attention.c), or NULL:
                            * (bq, ceil(nk / 32) + 1) words, row stride mb_rs (0: rows broadcast) */
    int64_t mb_rs;
} fa_item;

typedef void (*fa_attn_item_fn)(const fa_attention_args *a, const fa_tiles *t,
                                const fa_item *it, void *scratch);
/* The row kernel over n <= FA_GROUP_MAX items whose K and V rows interleave
 * (kernel_body.h, fa_attn_group_rows); scratch: fa_group_scratch_elems. */
typedef void (*fa_attn_group_fn)(const fa_attention_args *a, const fa_tiles *t,
                                 const fa_item *its, int64_t n, void *scratch);
#define FA_GROUP_MAX 64 /* items a group; with several rows an item, rows */
/* Key tile of fa_attn_group_rows for items of one row that group_chunks does
 * not take (masks, softcap, ALiBi, key ranges that differ, float16 K and V;
 * attention.c, run);
 * for items of up to FA_GROUP_ROWS rows, as many keys as hold about the
 * tuning's group_tile_bytes of the group's K and V (8 to group_bk_max). */
#define FA_GROUP_BK 4
#define FA_GROUP_ROWS 8
/* Rows of more keys than this are split into partials of at most this many
 * (attention.c, run: long_splits): no float32 running sum takes more than this
 * many increments, and a work unit stays short enough for Ctrl-C (the row
 * kernels check fa_stopped only between units).  The partials of one wave of
 * items take at most FA_PARTS_BYTES. */
#define FA_SPLIT_KEYS (INT64_C(1) << 20)
#define FA_PARTS_BYTES (INT64_C(256) << 20)
/* fa_attention_weights: it->out is (bq, nk), row stride a->o_rs, zero-filled. */
/* Merge nparts partial results (nparts, bq, dv + 2) of one item into its out
 * and lse.  scratch: 2 dv elements. */
/* One unit of the backward pass (kernel/backward.h, fa_bwd_unit): the keys
 * [j0, j0 + nb) of the leading index of the query blocks its[0..n_qb); D its
 * rows' sum(dO * out) (backward.c, bwd_rows_d) and lo their lse's correction
 * (fa_bwd_lse_lo, which sets D anew where lo is not 0). */
typedef void (*fa_bwd_unit_fn)(const fa_attention_args *a, const fa_tiles *t, const fa_item *its,
                               int64_t n_qb, const void *dout, int64_t do_rs, const void *D, const void *lo,
                               int64_t j0, int64_t nb, void *dk, int64_t dk_rs, void *dv, int64_t dv_rs,
                               void *dq, void *scratch);
/* The lo of one query block's rows (kernel/backward.h, fa_bwd_lse_lo): what
 * their lse lost, over the nk keys of its leading index, for the units; and
 * where lo is not 0, their D from those weights (dout: the block's dO rows). */
typedef void (*fa_bwd_lo_fn)(const fa_attention_args *a, const fa_tiles *t, const fa_item *it, int64_t nk,
                             const void *dout, int64_t do_rs, void *D, void *lo, void *scratch);
/* Work item w of a call as the drivers number them (attention.c). */
void fa_fill_item(const fa_attention_args *a, const fa_tiles *t, const void *mask_pack, int64_t n_qb,
                  int64_t w, size_t esz, size_t msz, fa_item *it);
typedef void (*fa_attn_merge_fn)(const fa_attention_args *a, const fa_item *it,
                                 const void *parts, int64_t nparts, void *scratch);
/* Softmax of one row: x (n) stride xs -> o (n) stride os.  scratch holds
 * fa_softmax_scratch_elems(n) elements of the dtype. */
typedef void (*fa_softmax_row_fn)(const void *x, int64_t xs, void *o, int64_t os,
                                  int64_t n, void *scratch);

/* dst[0..n) = src[0..n), 16-bit floats (FA_KV_F16 or FA_KV_BF16) widened to
 * float32 (fa_kv_widen: the Python layer's conversions and the tests). */
typedef void (*fa_kv_widen_fn)(const void *src, float *dst, int64_t n);
/* Bytes of one stored K or V element, and of one q element. */
static inline int64_t fa_kv_esz(const fa_attention_args *a)
{
    return a->kv_dtype != FA_KV_SAME ? 2 : a->dtype == FA_F32 ? 4 : 8;
}
static inline int64_t fa_q_esz(const fa_attention_args *a)
{
    return a->q_kv ? fa_kv_esz(a) : a->dtype == FA_F32 ? 4 : 8;
}

/* Scalar exp of the same polynomial as the vector kernels (for tests). */
typedef void (*fa_exp_fn)(const void *x, void *y, int64_t n);

/* The tuning of the plan (plan.c) on one CPU: {float32, float64} pairs where
 * there are two.  dispatch.c holds one table an ISA (its default) and the
 * tables of the CPUs measured (keyed by CPUID); fa_tuning_set replaces the
 * one in use (fastattn.tune's saved measurements).  docs/tuning.md has the
 * measurements, by field. */
typedef struct {
    char name[32];                    /* which table: "zen5", "avx512", "tuned" ... */
    int rows_max[2];                  /* n_q up to this takes the row kernel */
    int rows_max_big[2];              /* ... when K and V come from memory
                                       * (beyond kv_mem_bytes) */
    int rows_max_dk[2];               /* ... else when dk >= FA_ROWS_DK_BIG */
    int rows_max_big_dk[2];           /* > 0: in place of rows_max_big when dk >=
                                       * FA_ROWS_DK_BIG (0: rows_max_big) */
    int rows_full[2];                 /* but n_q from this up to one vector's lanes
                                       * takes the tiled kernel (0: never), unless
                                       * dk > FA_ROWS_DK_BIG with K and V from memory */
    int rows_full_dk;                 /* > 0: nor, where K's and V's rows are
                                       * contiguous, from this dk on or with 16-bit K
                                       * and V from memory */
    int rows_max_kv;                  /* > 0: with 16-bit K and V, n_q up to this takes
                                       * the row kernel, in place of the three above */
    int tail_max[2];                  /* the tiled kernel's last rows past whole vectors
                                       * take the row kernel up to this many (plan.c) */
    int tail_mem;                     /* ... also after a single block of whole vectors
                                       * with K and V from memory (0: that block takes
                                       * them, so that K and V are read once) */
    int tile_pf_l1;                   /* the tiled kernel's prefetch one pass ahead
                                       * (tile_pf) into L1, not L2, for items of at most
                                       * 32 rows with K and V from memory */
    int tile_spread;                  /* the tiled kernel's items of one float32 vector of
                                       * rows (AVX-512): register tiles of 16 keys and
                                       * 16 V columns that spread the prefetch over
                                       * their products */
    int decode_pf[2];                 /* decoding (one row, item_rows) prefetches float32
                                       * or float64 K and V rows (16-bit ones: always) */
    int decode_far;                   /* ... float32 and float64 ones into L2, further
                                       * ahead, beyond kv_far_bytes (0: into L1 at any
                                       * size) */
    int decode_inorder;               /* ... and with that far kind reads each K and V
                                       * row whole, in address order (decode_step;
                                       * not 16-bit K and V) */
    int fuse;                         /* the tiled kernel's fused exp */
    int stream;                       /* the row kernel's prefetch across passes, K
                                       * and V from memory (rows.h, item_rows) */
    int bk_tiled, bk_tiled_mem;       /* the tiled kernel's keys a tile; the same
                                       * for blocks of up to 32 rows from memory */
    int bq_tiled;                     /* the tiled kernel's most query rows a block on a
                                       * call without a mask or a band (with one: at
                                       * most 128), a power of two, 32 to FA_BQ_MAX */
    int q_tile_bytes;                 /* the tiled kernel's query block: halved from
                                       * bq_tiled rows (down to 32) while its transposed
                                       * queries (dk bq elements) exceed this many bytes */
    int q_tile_bytes_band;            /* the same under a causal band or a window, whose
                                       * diagonal wastes more of a larger block */
    int bk_rows, bk_decode;           /* the row kernel's keys a tile; the same for
                                       * one row (decoding) */
    int group_bk_max;                 /* the group kernel's keys a tile for items of
                                       * several rows: about group_tile_bytes of */
    int64_t group_tile_bytes;         /* the group's K and V, 8 to group_bk_max keys */
    int group_touch;                  /* the group kernel reads its next tile ahead by
                                       * loads in address order (group.h) */
    int group_chunks_rows;            /* the group kernel's items of several rows take
                                       * chunks of keys, as one row does (group.h) */
    int pipe_rows[2];                 /* K and V from memory: up to this many query rows
                                       * (1: decoding only) take the row kernel's
                                       * pipelined loop, K and V read together (rows.h,
                                       * rows_step) */
    int pipe_pf_l2;                   /* ... which prefetches them into L2, further
                                       * ahead, not into L1 */
    int group_rows[2];                /* > 0: up to this many query rows (at most
                                       * FA_GROUP_ROWS) take the group kernel over the
                                       * heads of a (B, n, H, d) cache from memory, past
                                       * rows_max_big (0: rows_max_big decides) */
    int fold_rows, fold_rows_big;     /* GQA: up to fold_rows query rows a head (or up
                                       * to fold_rows_big with K and V of at least */
    int64_t fold_big_bytes;           /* fold_big_bytes), a group's heads fold into the
                                       * rows of one item (fa_gqa_fold) */
    int64_t kv_mem_bytes;             /* K and V beyond this come from memory (the
                                       * plan's from_memory) */
    int64_t kv_far_bytes;             /* K and V beyond this: the row kernel's far
                                       * prefetch into L2 (INT64_MAX: never) */
    int bwd_bq, bwd_bk;               /* the backward's query rows a block and keys
                                       * a work unit (backward.c) */
} fa_tuning;

/* The tuning in use (dispatch.c): the table of this CPU if one was measured,
 * else the ISA's default, unless fa_tuning_set replaced it. */
const fa_tuning *fa_tuning_current(void);
/* Replace the tuning in use (FA_EINVAL if a field is out of range: nothing
 * changes); fa_tuning_reset goes back to the built-in table; fa_tuning_builtin
 * copies the built-in table of the ISA in use. */
int fa_tuning_set(const fa_tuning *t);
int fa_tuning_check(const fa_tuning *t); /* FA_OK if every field is in range */
void fa_tuning_reset(void);
void fa_tuning_builtin(fa_tuning *out);

/* What CPUID says about the CPU (dispatch.c): the key of the tuning tables. */
typedef struct {
    char vendor[16];                  /* "AuthenticAMD", "GenuineIntel", "" (not x86) */
    char brand[64];
    int family, model, stepping;      /* with the extended family and model folded in */
    int64_t l2_bytes, l3_bytes;       /* one core's L2, the L3 (0: unknown) */
} fa_cpu;
void fa_cpu_info(fa_cpu *out);

typedef struct {
    const char *name;
    int lanes[2];                     /* SIMD lanes for FA_F32, FA_F64 */
    fa_tuning tune;                   /* the default tuning of this ISA */
    fa_attn_item_fn attn_item[2];      /* tiled: many query rows */
    fa_attn_item_fn attn_item_rows[2]; /* few query rows (decode) */
    fa_attn_group_fn attn_group_rows[2]; /* ... over interleaved items (a (B, n, H, d) cache) */
    /* the float32 kernels over K and V stored as FA_KV_F16, FA_KV_BF16 (index kv_dtype - 1) */
    fa_attn_item_fn attn_item_kv[2], attn_item_rows_kv[2], weights_item_kv[2];
    fa_attn_group_fn attn_group_rows_kv[2];
    fa_kv_widen_fn kv_widen[2];        /* ... and their widening to float32 */
    fa_attn_merge_fn attn_merge[2];
    fa_bwd_unit_fn bwd_unit[2];        /* the backward kernel (kernel/backward.h) */
    fa_bwd_unit_fn bwd_unit_kv[2];     /* ... float32 over 16-bit K and V (index kv_dtype - 1) */
    fa_bwd_lo_fn bwd_lse_lo[2];        /* its lo of lossy lse rows (kernel/backward.h) */
    fa_bwd_lo_fn bwd_lse_lo_kv[2];     /* ... over 16-bit K and V */
    fa_attn_item_fn weights_item[2];   /* probabilities (attention_weights) */
    fa_softmax_row_fn softmax_row[2];
    fa_exp_fn exp[2];
    fa_exp_fn exp_neg[2];
} fa_isa_table;

/* The table in use (dispatch.c). */
const fa_isa_table *fa_isa_current(void);

/* Per-thread scratch, in elements of the dtype. */
#define FA_SOFTMAX_CHUNK 1024
static inline int64_t fa_attn_scratch_elems(const fa_tiles *t, int64_t dk, int64_t dv)
{
    return t->ld * (dk + t->bk + 3 * dv + 4 + (t->bk + 31) / 32);
}
/* ... and after it (from kv_off), with 16-bit K and V, a header of FA_KV_HEAD
 * elements and kv_rows rows of K and V widened (tiled.h, kv_rows_widened): all
 * of an item's keys (its window's span, with one) where FA_KV_CACHE_BYTES hold
 * them as float32 (8 MiB a thread: 8,192 keys at d128, 16,384 at d64), so that
 * the items of one leading index widen its keys once, else a key tile. */
#define FA_KV_HEAD 16
#define FA_KV_CACHE_BYTES (INT64_C(8) << 20)
static inline int64_t fa_kv_cache_elems(const fa_tiles *t, int64_t dk, int64_t dv)
{
    return FA_KV_HEAD + t->kv_rows * (dk + dv);
}
/* ... and after that (from mt_off), a float mask's cache: a header of 64 bytes, a
 * record of at most 128 bytes a key tile (its key runs, whether the mask hides it all),
 * then the tiles transposed, bk ld elements each (tiled.h, mask_cache); only
 * where that is at most FA_MT_CACHE_BYTES, so that a thread's scratch stays a
 * few MiB (7,000 keys at d64 float32). */
#define FA_MT_CACHE_BYTES (INT64_C(4) << 20)
#define FA_MT_HEAD_BYTES 64
#define FA_MT_REC_BYTES 128
static inline int64_t fa_mt_cache_elems(const fa_tiles *t, int64_t nk, int64_t esz)
{
    const int64_t tiles = (nk + t->bk - 1) / t->bk;
    return (FA_MT_HEAD_BYTES + FA_MT_REC_BYTES * tiles) / esz + tiles * t->bk * t->ld;
}
/* The row kernel takes n_q <= rows_max query rows (the tuning's rows_max,
 * rows_max_big when the call's K and V exceed the tuning's kv_mem_bytes (or
 * rows_max_big_dk, where set, when dk is at least FA_ROWS_DK_BIG), else
 * rows_max_dk when dk is at least FA_ROWS_DK_BIG; or the override
 * fa_overrides.rows_max, at most FA_ROWS_CAP); dk is padded to a whole number of
 * vectors (at most FA_LANES_MAX lanes: float32 in 64 bytes). */
#define FA_ROWS_CAP 24
#define FA_ROWS_DK_BIG 128
#define FA_LANES_MAX 16
#define FA_BQ_MAX 512 /* the most query rows of a tiled item (fa_tuning.bq_tiled) */
static inline int64_t fa_rows_scratch_elems(const fa_tiles *t, int64_t dk, int64_t dv)
{
    return t->bq * (dk + FA_LANES_MAX + 2 * t->bk + 3 * dv + 3); /* with the pipelined loop's Sn */
}
static inline int64_t fa_group_scratch_elems(const fa_tiles *t, int64_t dk, int64_t dv, int64_t n)
{
    const int64_t dkp = (dk + FA_LANES_MAX - 1) / FA_LANES_MAX * FA_LANES_MAX;
    return n * t->bq * (dkp + 3 * dv + 3) + t->bq * t->bk;
}
/* The backward kernel's scratch (kernel/backward.h), without the dQ rows and
 * a 16-bit q's widened rows (after these, at t->q_off); widened: K and V of 16
 * bits, the unit's rows widened (Kw, Vw). */
static inline int64_t fa_bwd_scratch_elems(const fa_tiles *t, int64_t dk, int64_t dv, int widened)
{
    const int64_t dkp = (dk + FA_LANES_MAX - 1) / FA_LANES_MAX * FA_LANES_MAX;
    const int64_t dvp = (dv + FA_LANES_MAX - 1) / FA_LANES_MAX * FA_LANES_MAX;
    return t->ld * (dk + dv + 2 * t->bk + 3 + (t->bk + 31) / 32) + t->bq * (dkp + dvp) + t->bk * (2 * dkp + dvp) +
           (widened ? t->bk * (dk + dv) : 0);
}
static inline int64_t fa_softmax_scratch_elems(int64_t n)
{
    return FA_SOFTMAX_CHUNK + (n + FA_SOFTMAX_CHUNK - 1) / FA_SOFTMAX_CHUNK + 1;
}

/* Kernel tables defined in kernels_*.c */
#define FA_DECLARE_ISA(isa)                                                           \
    void fa_attn_item_f32_##isa(const fa_attention_args *, const fa_tiles *,          \
                                const fa_item *, void *);                             \
    void fa_attn_item_f64_##isa(const fa_attention_args *, const fa_tiles *,          \
                                const fa_item *, void *);                             \
    void fa_attn_item_rows_f32_##isa(const fa_attention_args *, const fa_tiles *,     \
                                     const fa_item *, void *);                        \
    void fa_attn_item_rows_f64_##isa(const fa_attention_args *, const fa_tiles *,     \
                                     const fa_item *, void *);                        \
    void fa_attn_group_rows_f32_##isa(const fa_attention_args *, const fa_tiles *,    \
                                      const fa_item *, int64_t, void *);              \
    void fa_attn_group_rows_f64_##isa(const fa_attention_args *, const fa_tiles *,    \
                                      const fa_item *, int64_t, void *);              \
    void fa_weights_item_f32_##isa(const fa_attention_args *, const fa_tiles *,       \
                                   const fa_item *, void *);                          \
    void fa_weights_item_f64_##isa(const fa_attention_args *, const fa_tiles *,       \
                                   const fa_item *, void *);                          \
    void fa_attn_merge_f32_##isa(const fa_attention_args *, const fa_item *,          \
                                 const void *, int64_t, void *);                      \
    void fa_attn_merge_f64_##isa(const fa_attention_args *, const fa_item *,          \
                                 const void *, int64_t, void *);                      \
    void fa_bwd_unit_f32_##isa(const fa_attention_args *, const fa_tiles *,           \
                               const fa_item *, int64_t, const void *, int64_t,       \
                               const void *, const void *,                            \
                               int64_t, int64_t, void *, int64_t, void *, int64_t,    \
                               void *, void *);                                       \
    void fa_bwd_unit_f64_##isa(const fa_attention_args *, const fa_tiles *,           \
                               const fa_item *, int64_t, const void *, int64_t,       \
                               const void *, const void *,                            \
                               int64_t, int64_t, void *, int64_t, void *, int64_t,    \
                               void *, void *);                                       \
    void fa_bwd_lse_lo_f32_##isa(const fa_attention_args *, const fa_tiles *,         \
                                 const fa_item *, int64_t, const void *, int64_t,     \
                                 void *, void *, void *);                             \
    void fa_bwd_lse_lo_f64_##isa(const fa_attention_args *, const fa_tiles *,         \
                                 const fa_item *, int64_t, const void *, int64_t,     \
                                 void *, void *, void *);                             \
    void fa_softmax_row_f32_##isa(const void *, int64_t, void *, int64_t, int64_t,    \
                                  void *);                                            \
    void fa_softmax_row_f64_##isa(const void *, int64_t, void *, int64_t, int64_t,    \
                                  void *);                                            \
    void fa_exp_f32_##isa(const void *, void *, int64_t);                             \
    void fa_exp_f64_##isa(const void *, void *, int64_t);                             \
    void fa_exp_neg_f32_##isa(const void *, void *, int64_t);                         \
    void fa_exp_neg_f64_##isa(const void *, void *, int64_t);                         \
    extern const int fa_lanes_f32_##isa, fa_lanes_f64_##isa;                          \
    FA_DECLARE_KV(h16, isa)                                                           \
    FA_DECLARE_KV(b16, isa)
/* The 16-bit K and V kernels (kernels_h16_*.c, kernels_b16_*.c). */
#define FA_DECLARE_KV(kv, isa)                                                        \
    void fa_attn_item_##kv##_##isa(const fa_attention_args *, const fa_tiles *,       \
                                   const fa_item *, void *);                          \
    void fa_weights_item_##kv##_##isa(const fa_attention_args *, const fa_tiles *,    \
                                      const fa_item *, void *);                       \
    void fa_attn_item_rows_##kv##_##isa(const fa_attention_args *, const fa_tiles *,  \
                                        const fa_item *, void *);                     \
    void fa_attn_group_rows_##kv##_##isa(const fa_attention_args *, const fa_tiles *, \
                                         const fa_item *, int64_t, void *);           \
    void fa_bwd_unit_##kv##_##isa(const fa_attention_args *, const fa_tiles *,        \
                                  const fa_item *, int64_t, const void *, int64_t,    \
                                  const void *, const void *,                         \
                                  int64_t, int64_t, void *, int64_t, void *, int64_t, \
                                  void *, void *);                                    \
    void fa_bwd_lse_lo_##kv##_##isa(const fa_attention_args *, const fa_tiles *,      \
                                    const fa_item *, int64_t, const void *, int64_t,  \
                                    void *, void *, void *);                          \
    void fa_kv_widen_##kv##_##isa(const void *, float *, int64_t);

FA_DECLARE_ISA(generic)
#if defined(__x86_64__) || defined(_M_X64)
#define FA_HAVE_AVX2_BUILD 1
FA_DECLARE_ISA(avx2)
#ifndef FA_NO_AVX512 /* -DFA_NO_AVX512: built without the AVX-512 kernels */
#define FA_HAVE_AVX512_BUILD 1
FA_DECLARE_ISA(avx512)
#endif
#endif

/* The plan of one attention call (plan.c), which attention.c carries out. */
enum { FA_KERNEL_TILED = 0, FA_KERNEL_ROWS = 1, FA_KERNEL_WEIGHTS = 2 };
typedef struct {
    int kernel;            /* FA_KERNEL_*: what runs the items */
    fa_tiles tiles;
    int64_t lanes;         /* SIMD lanes of the dtype */
    int64_t rows_max;      /* n_q up to this takes the row kernel (the table's, or forced) */
    int64_t full_lo, full_hi; /* ... but not n_q in [full_lo, full_hi] (rows_full; empty: lo > hi) */
    int64_t tail_max;      /* the most rows a tail may have (the table's) */
    int64_t kv_bytes;      /* K and V bytes the call reads */
    int from_memory;       /* kv_bytes > the tuning's kv_mem_bytes */
    int tail;              /* each leading index's rows [tiles.q_main, nq) run on the row
                            * kernel right after its last block */
    int few;               /* packed sequences under the tiled kernel: items of few rows
                            * (fa_few_rows) take the row kernel */
    int64_t group, n_groups; /* the group kernel: items a group (0: not used), groups */
    int64_t n_lead;        /* leading indices */
    int64_t n_qb;          /* query blocks of each leading index, the tail's included */
    int64_t n_items;       /* work items (packed sequences: the live ones); 0: nothing to do */
    int64_t n_splits;      /* key splits of each item (1: none) */
    int64_t long_splits;   /* ... at least, for rows of more than FA_SPLIT_KEYS keys */
    int64_t chunk;         /* keys a split */
    int64_t part_elems;    /* elements of one split's partials: bq (dv + 2) */
    int64_t wave;          /* items a wave (their partials within FA_PARTS_BYTES) */
    int mask_pack;         /* pack a bool mask into bits first */
    int64_t head_turns;    /* > 0: the items go query block by query block, the last
                            * leading dim's head_turns indices in turn (plan.c) */
    int threads;           /* the team */
    int64_t scratch_elems; /* each thread's scratch, in elements of the dtype */
    double q_rows, work;   /* real query rows; the work estimate behind the team size */
} fa_plan;
int fa_attention_plan(const fa_attention_args *a, int weights, fa_plan *p);
/* GQA: whether a group's query heads, n_q rows each, become the rows of one
 * item over their K and V (kv_bytes in all): the row kernel then reads K and
 * V once for the group (the Python layer folds the arrays). */
int fa_gqa_fold(int64_t n_q, int64_t kv_bytes);
/* Do n query rows take the row kernel?  Up to rows_max, but not from full_lo
 * to full_hi. */
static inline int fa_few_rows(int64_t n, int64_t rows_max, int64_t full_lo, int64_t full_hi)
{
    return n <= rows_max && !(n >= full_lo && n <= full_hi);
}
/* The real query positions of the leading index whose q_len offset is oql:
 * q_len there, cut to [0, nq / row_group] (nq / row_group without q_len). */
static inline int64_t fa_real_positions(const fa_attention_args *a, int64_t oql)
{
    const int64_t qn = a->nq / a->row_group;
    if (!a->q_len || a->q_len[oql] >= qn) return qn;
    return a->q_len[oql] < 0 ? 0 : a->q_len[oql];
}
/* Packed sequences (q_start): the items that hold real rows, as indices
 * w = lead * n_qb + qb, in order, into live (NULL: only count them); the
 * others have nothing to do (their rows are other sequences').  Returns their
 * number; *rows is the real rows in all. */
int64_t fa_live_items(const fa_attention_args *a, int64_t n_lead_total, int64_t n_qb, int64_t bq, int64_t *live,
                      double *rows);

/* Exposed for the tests: the chosen path's vector exp (which = 0) and the
 * attention kernels' exp for arguments <= 0 (which = 1). */
int fa_exp(int dtype, int which, const void *x, void *y, int64_t n);
/* ... and the chosen path's widening of 16-bit K and V (kv_dtype: FA_KV_F16
 * or FA_KV_BF16) to float32. */
int fa_kv_widen(int kv_dtype, const void *x, float *y, int64_t n);

#endif /* FASTATTN_INTERNAL_H */
