/*
 * fastattn C core: exact scaled dot-product attention and softmax.
 *
 *     out = softmax(q . k^T * scale + mask) . v
 *
 * The Python layer (fastattn/_validate.py, _prepare.py) validates shapes and dtypes, broadcasts the
 * leading dims and converts dtypes; the Cython binding (fastattn/_core.pyx) fills
 * the argument structs below and calls in with the GIL released.  The C core
 * trusts its arguments: it never exits or aborts, and it reports allocation
 * failure through its return status.
 *
 * Dimension legend (every kernel comment uses these letters):
 *   lead   the broadcast leading dims (batch, heads, ...), flattened to one index
 *   nq     query rows            nk     key/value rows
 *   dk     query/key width       dv     value width
 *   bq     query rows in a tile  bk     key rows in a tile
 *   bqp    bq rounded up to whole SIMD vectors
 *
 * All strides are in elements (not bytes) and may be zero (broadcast) or
 * negative.  The last axis of q, k, v and out is contiguous (stride 1); the
 * Python layer copies an operand whose last axis is not.
 *
 * Files:
 *   fastattn.h        this header: argument structs, status codes, entry points
 *   internal.h        between drivers and kernels: work items, tiles, the tuning table
 *   attention.c       drivers: work split, OpenMP, per-thread scratch
 *   dispatch.c        run-time choice of the SIMD path (CPUID, FASTATTN_ISA)
 *   kernel_body.h     the kernels, written once with GCC vector extensions
 *   kernels_*.c       kernel_body.h compiled per dtype (and 16-bit K and V) and per ISA
 */
#ifndef FASTATTN_H
#define FASTATTN_H

#include <stddef.h>
#include <stdint.h>

#define FA_MAX_DIMS 64
/* The most threads a call starts (fa_thread_cap). */
#define FA_THREADS_MAX 1024

/* Status codes returned by every entry point. */
enum {
    FA_OK = 0,
    FA_ENOMEM = 1,  /* a scratch allocation failed */
    FA_EINVAL = 2,  /* an argument the Python layer should have rejected */
    FA_EINTR = 3,   /* stopped by *stop (Ctrl-C): the output is unspecified */
};

/* Compute dtypes. */
enum { FA_F32 = 0, FA_F64 = 1 };
/* How K and V are stored (fa_attention_args.kv_dtype): in the compute dtype,
 * or (float32 calls only) as 16-bit floats, widened to float32 as they are
 * read: IEEE binary16 or bfloat16. */
enum { FA_KV_SAME = 0, FA_KV_F16 = 1, FA_KV_BF16 = 2 };

/* Mask kinds. */
enum {
    FA_MASK_NONE = 0,
    FA_MASK_BOOL = 1, /* uint8: nonzero = may attend */
    FA_MASK_ADD = 2,  /* compute dtype: added to the scaled score (-inf allowed) */
};

/* Per-call overrides of the plan (plan.c), for the tests and for tuning:
 * fa_attention_args.force.  0 in a size, -1 in a switch: the plan's choice. */
typedef struct {
    int64_t bq, bk;      /* the tiled kernel's query rows per item and keys per tile
                          * (the backward's query rows a block and keys a unit) */
    int64_t rows_max;    /* the most query rows that take the row kernel (at most
                          * FA_ROWS_CAP); set, it also turns off rows_full and the tail */
    int64_t pipe_rows;   /* up to this many rows the row kernel takes its pipelined
                          * loop (1: decoding only) */
    int fuse;            /* the tiled kernel's fused exp: 1 on, 0 off */
    int stream;          /* the row kernel's prefetch across passes (and the far
                          * prefetch, unless far is set) */
    int far;             /* the row kernel's far prefetch into L2 */
    int decode_pf;       /* decoding's (one row's) prefetch of K and V rows */
    int group;           /* the group kernel over interleaved heads: 1 wherever it
                          * can run, 0 never (-1: from memory only) */
    int group_touch;     /* the group kernel's tiles read ahead by loads: 1 on, 0 off */
    int mask_pack;       /* a bool mask packed to bits for the tiled kernel */
    int head_turns;      /* the tiled kernel's items by query block, the heads in turn */
    int mask_cache;      /* ... and a float mask's transposed tiles kept for the next
                          * item on the same mask rows: 1 on (whatever their size), 0 off */
    int64_t split_keys;  /* rows of more keys are split (0: FA_SPLIT_KEYS) */
    int64_t parts_bytes; /* the partials of one wave (0: FA_PARTS_BYTES) */
} fa_overrides;

/* What a call ran, for the tests: fa_attention_args.stats (atomic adds). */
typedef struct {
    int64_t group_runs;  /* item groups the group kernel ran */
    int64_t tail_rows;   /* query rows the row kernel ran as the tiled kernel's tails */
    int64_t redo_rows;   /* rows recomputed carefully (a result came out non-finite) */
    int64_t kv_widened;  /* 16-bit key rows the tiled, weights and backward kernels widened */
    int64_t chunk_rows;  /* query rows the group kernel ran in chunks (group_chunks) */
} fa_stats;

/* Arguments of fa_attention.
 *   q     (lead, nq, dk)    compute dtype, or as k (q_kv)
 *   k     (lead, nk, dk)    compute dtype, or 16-bit floats (kv_dtype)
 *   v     (lead, nk, dv)    as k
 *   mask  (lead, nq, nk)    uint8 or compute dtype, any strides, or NULL
 *   out   (lead, nq, dv)    compute dtype, written
 *   lse   (lead, nq)        compute dtype, written, or NULL
 *   slopes (lead)           ALiBi slopes, compute dtype, or NULL
 *   kv_len (lead)           int64 key counts (a padded KV cache), or NULL
 *   q_len  (lead)           int64 query counts, in positions (right-padded
 *                           queries: nq / row_group at most), or NULL
 *   q_start, kv_start (lead) int64 first rows (packed sequences), or NULL
 * fa_attention_weights writes out (lead, nq, nk) = the probabilities instead
 * (dv and v unused); it expects out to be zero-filled.
 *
 * Which keys a query row sees.  With kv = kv_len[lead] (nk when kv_len is
 * NULL), qn = q_len[lead] (nq / G when q_len is NULL), G = row_group and the
 * bottom-right aligned position p = i / G + kv - qn (top_left: p = i / G), row i
 * sees keys j < kv with p - win_left <= j <= p + win_right (a negative bound is
 * unbounded); causal caps win_right at 0.  Scores are
 * s = softcap(q.k * scale) - slope * |p - j| + mask.
 * G = 1: every row its own position.  G > 1 (nq a multiple of G): G consecutive
 * rows share a position, as the query heads of a GQA group folded into the rows
 * of one item, position-major (row i: position i / G, head i % G).  Rows from
 * qn * G on are padding: not computed, their out rows zero and lse -inf
 * (fa_attention_weights leaves their rows as they are: zero).
 *
 * Packed sequences (flash-attn's varlen form).  With q_start, the leading index's
 * query rows begin at row q_start[lead] of q, out and lse; with kv_start, its
 * keys at row kv_start[lead] of k and v.  Its rows from q_len on then belong to
 * other sequences: they are not written.  No mask with either (FA_EINVAL).
 */
typedef struct {
    int n_lead;                         /* number of leading dims, 0..FA_MAX_DIMS */
    int64_t lead_shape[FA_MAX_DIMS];
    int64_t q_lead[FA_MAX_DIMS], k_lead[FA_MAX_DIMS], v_lead[FA_MAX_DIMS];
    int64_t o_lead[FA_MAX_DIMS], m_lead[FA_MAX_DIMS], lse_lead[FA_MAX_DIMS];
    int64_t nq, nk, dk, dv;
    int64_t q_rs, k_rs, v_rs, o_rs;     /* row strides */
    int64_t m_rs, m_cs;                 /* mask strides along nq and nk */
    int64_t lse_rs;                     /* lse stride along nq */
    const void *q, *k, *v, *mask;
    void *out, *lse;
    int dtype;                          /* FA_F32 or FA_F64 */
    int kv_dtype;                       /* FA_KV_*: how k and v are stored (16-bit:
                                         * FA_F32 only; the backward pass too) */
    int q_kv;                           /* q stored as k and v (16-bit kv_dtype only) */
    int mask_kind;                      /* FA_MASK_* */
    int causal;                         /* key j visible to query i iff j <= p (above) */
    int top_left;                       /* positions aligned top-left: p = i / G (above) */
    int64_t row_group;                  /* G >= 1: rows per position (above) */
    double scale;
    double softcap;                     /* > 0: s -> softcap * tanh(s / softcap); 0: off */
    int64_t win_left, win_right;        /* sliding window; < 0: unbounded */
    const void *slopes;                 /* ALiBi slopes, or NULL */
    int64_t slope_lead[FA_MAX_DIMS];
    const int64_t *kv_len;              /* keys per leading index, or NULL */
    int64_t kvl_lead[FA_MAX_DIMS];
    const int64_t *q_len;               /* real query positions per leading index, or NULL */
    int64_t qln_lead[FA_MAX_DIMS];
    const int64_t *q_start;             /* first query row per leading index, or NULL */
    int64_t qst_lead[FA_MAX_DIMS];
    const int64_t *kv_start;            /* first key row per leading index, or NULL */
    int64_t kst_lead[FA_MAX_DIMS];
    int num_threads;                    /* <= 0: the OpenMP default */
    const volatile int *stop;           /* nonzero: stop soon, return FA_EINTR; NULL: never */
    const fa_overrides *force;          /* the plan's choices overridden (tests, tuning), or NULL */
    fa_stats *stats;                    /* what the call ran, counted, or NULL */
} fa_attention_args;

/* Arguments of fa_softmax: softmax along the last axis.
 *   x     (lead, n)   compute dtype, any strides
 *   out   (lead, n)   compute dtype, any strides; may be x itself (same strides)
 */
typedef struct {
    int n_lead;
    int64_t lead_shape[FA_MAX_DIMS];
    int64_t x_lead[FA_MAX_DIMS], o_lead[FA_MAX_DIMS];
    int64_t n, x_s, o_s;                /* length and strides of the softmax axis */
    const void *x;
    void *out;
    int dtype;
    int num_threads;
    const volatile int *stop;           /* as fa_attention_args' */
} fa_softmax_args;

int fa_attention(const fa_attention_args *a);
int fa_attention_weights(const fa_attention_args *a);

/* Arguments of fa_attention_backward beside the forward's (fa_attention_args,
 * whose out and lse are then the forward's result, read: lse is required;
 * out in the compute dtype, or as k with o_kv).
 *   dout  (lead, nq, dv)  compute dtype, or as k (do_kv): the gradient of the output
 *   dq    (lead, nq, dk)  written (padding rows: zeros)
 *   dk    (lead, nk, dk)  written (keys no row sees: zeros)
 *   dv    (lead, nk, dv)  written
 * each with any leading strides (*_lead, elements) and row stride (*_rs),
 * unit stride along its last axis; the rows of dq, dk and dv that distinct
 * leading indices write must not overlap.  The gradients of sum(dout * out)
 * with respect to q, k and v, every leading index on its own (the Python
 * layer sums those of broadcast inputs).  Packed sequences (q_start,
 * kv_start: fa_attention_args above): dout's and dq's rows start at q_start
 * as q's do, dk's and dv's at kv_start as k's, and only a sequence's own rows
 * (q_len, kv_len) are read and written.  Not with row_group > 1 (FA_EINVAL). */
typedef struct {
    const void *dout;
    void *dq, *dk, *dv;
    int64_t do_lead[FA_MAX_DIMS], dq_lead[FA_MAX_DIMS], dk_lead[FA_MAX_DIMS], dv_lead[FA_MAX_DIMS];
    int64_t do_rs, dq_rs, dk_rs, dv_rs;
    int do_kv, o_kv;  /* dout, out stored as k and v (16-bit kv_dtype only) */
} fa_backward_args;
int fa_attention_backward(const fa_attention_args *a, const fa_backward_args *b);
int fa_softmax(const fa_softmax_args *a);

/* SIMD path.  fa_isa_name() is the path in use; fa_set_isa() chooses one by
 * name ("generic", "avx2", "avx512") and returns FA_EINVAL when this CPU or build cannot
 * run it; fa_isa_available() tells whether a name can be chosen. */
const char *fa_isa_name(void);
int fa_set_isa(const char *name);
int fa_isa_available(const char *name);

/* keep[i] = (x[i] == 0) for a contiguous (rows, len) float32 or float64
 * (dtype) x, and *all_ok = whether every x[i] is 0 or at most floor (<= 0;
 * -inf: 0 and -inf only) with a 0 in each row that holds a finite x[i] <=
 * floor (a float mask that acts as the bool mask keep: _mask_as_bool in
 * fastattn/_float_mask.py), on num_threads threads (<= 0: the default).  pad (rows
 * bytes, or NULL) lets a row without a 0 be one constant <= pad_floor (<= 0)
 * instead, and marks such rows with 1 (the others 0). */
int fa_mask_keep(int dtype, const void *x, int64_t rows, int64_t len, double floor, uint8_t *keep,
                 double pad_floor, uint8_t *pad, int num_threads, int *all_ok);

/* The float-mask-as-bool check of one call in one team (scans.c): the
 * largest |q|, |k| (and |v|), then fa_mask_keep's pass with floor -inf
 * (try_neginf) or, where allowed, a finite floor from the score bound.
 * *mode: 0 the mask stays float, 1 keep holds it (0 and -inf only), 2 keep
 * and pad hold it (a finite floor). */
int fa_mask_as_bool(int dtype, const void *q, int64_t nq_el, const void *k, int64_t nk_el, const void *v,
                    int64_t nv_el, double dk_scale, double slope_term, int try_neginf, int allow_finite,
                    double margin, double pad_absorb, int mask_dtype, const void *x, int64_t rows, int64_t len,
                    uint8_t *keep, uint8_t *pad, int num_threads, int *mode);

/* *out = max |x[i]| over a contiguous float32 or float64 (dtype) x of n
 * entries: 0 when n is 0, NaN when some x[i] is NaN; on num_threads threads
 * (<= 0: the default). */
int fa_abs_max(int dtype, const void *x, int64_t n, int num_threads, double *out);

/* merge_attention's rule over n_parts partial results (merge.c): outs[p]
 * (rows, d) and lses[p] (rows), float32 or float64 (dtype), contiguous, into
 * out (rows, d) and lse (rows) of the same dtype; the sums in float64,
 * compensated; on num_threads threads (<= 0: the default). */
int fa_merge(int dtype, int n_parts, const void *const *outs, const void *const *lses, int64_t rows, int64_t d,
             void *out, void *lse, int num_threads);

/* OpenMP: 1 when built with it; the default team size (1 without OpenMP);
 * the team size of the calling thread's last call; the path of the OpenMP
 * runtime library.  fa_build_info: compiler, flags, OpenMP version. */
int fa_openmp_enabled(void);
/* Benchmark helper: a plain streaming read of n bytes (a multiple of 64, 16-byte
 * aligned) on num_threads threads (<= 0: the default); returns a checksum. */
uint64_t fa_stream_read(const void *x, int64_t n, int num_threads);
int fa_max_threads(void);
/* The team size of the calling thread's last call; 0 when it ran no team
 * (nothing to compute). */
int fa_last_threads(void);
/* 1 in a process forked where GNU libgomp's pool could not be freed before
 * the fork (it would hang there): every call then runs on one thread. */
int fa_fork_serial(void);
/* Once, at import: the fork handlers (attention.c). */
void fa_init(void);
/* Ctrl-C for long calls, from the main thread: fa_interrupt_begin installs a
 * SIGINT handler that sets the flag it returns and then runs the handler it
 * replaced (Python's), and returns NULL where SIGINT is ignored or default;
 * fa_interrupt_end puts the replaced handler back.  Not nested. */
const volatile int *fa_interrupt_begin(void);
void fa_interrupt_end(void);
/* The most threads a call starts: 4 a CPU, at least 8, at most FA_THREADS_MAX
 * and the runtime's thread limit. */
int fa_thread_cap(void);
const char *fa_openmp_library(void);
const char *fa_build_info(void);

#endif /* FASTATTN_H */
