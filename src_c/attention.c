/*
 * Drivers: split the work into items, run them on OpenMP threads, give each
 * thread its own scratch, and report allocation failure as a status.
 * The kernels themselves (kernel_body.h) contain no OpenMP.
 */
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* dladdr */
#endif
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#ifdef __SSE2__
#include <emmintrin.h> /* ABS_MAX_SSE2 */
#endif

#ifdef _OPENMP
#include <omp.h>
#else
/* Built without OpenMP: the pragmas are ignored on purpose, and the same code
 * runs serially. */
#pragma GCC diagnostic ignored "-Wunknown-pragmas"
#endif
#if defined(_OPENMP) && (defined(__linux__) || defined(__APPLE__))
#include <dlfcn.h>
#define FA_HAVE_DLADDR 1
#endif
#if defined(_OPENMP) && (defined(__unix__) || defined(__APPLE__))
#include <pthread.h>
#define FA_HAVE_ATFORK 1
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <signal.h>
#define FA_HAVE_SIGACTION 1
#endif
#ifndef FA_BUILD_CFLAGS
#define FA_BUILD_CFLAGS "unknown"
#endif

/* The team size of the calling thread's last call (diagnostics, tests). */
static _Thread_local int last_team = 0;
int fa_last_threads(void) { return last_team; }

#define RECORD_TEAM()                                                              \
    do {                                                                           \
        if (fa_thread_num() == 0) last_team = fa_num_threads();                    \
    } while (0)

static int fa_thread_num(void)
{
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static int fa_num_threads(void)
{
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

const char *fa_build_info(void)
{
    static char info[512];
    if (!info[0]) {
#if defined(__clang__)
        const char *cc = "clang " __clang_version__;
#elif defined(__GNUC__)
        const char *cc = "gcc " __VERSION__;
#else
        const char *cc = "unknown compiler";
#endif
#ifdef _OPENMP
        snprintf(info, sizeof info, "%s; flags: %s; OpenMP %d", cc, FA_BUILD_CFLAGS, _OPENMP);
#else
        snprintf(info, sizeof info, "%s; flags: %s; no OpenMP", cc, FA_BUILD_CFLAGS);
#endif
    }
    return info;
}

const char *fa_openmp_library(void)
{
#ifdef FA_HAVE_DLADDR
    Dl_info di;
    if (dladdr((void *)&omp_get_max_threads, &di) && di.dli_fname) return di.dli_fname;
    return "unknown";
#elif defined(_OPENMP)
    return "unknown";
#else
    return "none";
#endif
}

int fa_openmp_enabled(void)
{
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* ---------------------------------------------------------------------------
 * fork.  GNU libgomp cannot run a team in a child forked from a thread that
 * had started one: the child's team waits for the parent's pool threads,
 * which fork did not copy, and never returns.  Any library on the same
 * libgomp can have started that pool (PyTorch's bundled libgomp shares its
 * soname with the system's), so fa_init, at import, registers fork handlers:
 * before the fork, omp_pause_resource_all frees the forking thread's pool
 * (the parent's next team starts new threads; the child starts its own); where
 * that cannot be done (a libgomp before GCC 9, a fork from inside a team) the
 * child runs every call on its calling thread.  LLVM's and Intel's runtimes
 * restart their pools after fork (they have __kmpc_fork_call): with them
 * nothing is registered.
 * ------------------------------------------------------------------------- */
static volatile int fork_serial = 0; /* 1: a child whose parent's pool may be stale; one thread */

int fa_fork_serial(void) { return fork_serial; }

#ifdef FA_HAVE_ATFORK
typedef int (*pause_all_fn)(int);
static pause_all_fn pause_all = NULL; /* libgomp's omp_pause_resource_all, or NULL */
static volatile int pool_freed = 0;   /* the last fork's prepare handler freed the pool */
/* The forking thread's ICVs, set again after the fork in parent and child, so
 * that a threadpoolctl limit or omp_set_num_threads outlives a fork whatever
 * the runtime keeps when its pool is freed (GNU libgomp 12 keeps them). */
static int saved_threads, saved_dynamic, saved_levels;

static void before_fork(void)
{
    saved_threads = omp_get_max_threads();
    saved_dynamic = omp_get_dynamic();
    saved_levels = omp_get_max_active_levels();
    pool_freed = pause_all && pause_all(1 /* omp_pause_soft */) == 0;
}

static void restore_icvs(void)
{
    omp_set_num_threads(saved_threads);
    omp_set_dynamic(saved_dynamic);
    omp_set_max_active_levels(saved_levels);
}

static void after_fork_parent(void)
{
    if (pool_freed) restore_icvs();
}

static void after_fork_child(void)
{
    if (pool_freed)
        restore_icvs();
    else
        fork_serial = 1;
}

static void register_fork_handlers(void)
{
#ifdef FA_HAVE_DLADDR
    void *h = dlopen(fa_openmp_library(), RTLD_LAZY | RTLD_NOLOAD); /* NULL for "unknown" */
    const int restarts = h && dlsym(h, "__kmpc_fork_call");
    if (h && !restarts) pause_all = (pause_all_fn)dlsym(h, "omp_pause_resource_all");
    if (h) dlclose(h); /* the extension links the runtime: it stays loaded */
    if (restarts) return;
#endif
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}
#endif

void fa_init(void)
{
#ifdef FA_HAVE_ATFORK
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, register_fork_handlers);
#endif
}

/* ---------------------------------------------------------------------------
 * Ctrl-C.  Python runs its SIGINT handler only when the call returns to it, so
 * a long call installs, for its duration, a handler that sets stop_flag (which
 * the drivers and kernels read between items and key tiles) and then calls the
 * handler it replaced, so that Python still sees the signal and raises
 * KeyboardInterrupt once the call has stopped.
 * ------------------------------------------------------------------------- */
#ifdef FA_HAVE_SIGACTION
static volatile int stop_flag = 0;
static struct sigaction replaced;

/* The replaced handler first, so that Python has recorded the signal before
 * the call sees the flag and returns to it. */
static void on_sigint(int sig, siginfo_t *info, void *ctx)
{
    if (replaced.sa_flags & SA_SIGINFO) {
        if (replaced.sa_sigaction) replaced.sa_sigaction(sig, info, ctx);
    } else if (replaced.sa_handler != SIG_DFL && replaced.sa_handler != SIG_IGN) {
        replaced.sa_handler(sig);
    }
    stop_flag = 1;
}
#endif

const volatile int *fa_interrupt_begin(void)
{
#ifdef FA_HAVE_SIGACTION
    struct sigaction now, mine;
    if (sigaction(SIGINT, NULL, &now) != 0) return NULL;
    if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigint) { /* still ours (a child forked */
        stop_flag = 0;                                                     /* mid-call): keep its chain */
        return &stop_flag;
    }
    if (!(now.sa_flags & SA_SIGINFO) && (now.sa_handler == SIG_DFL || now.sa_handler == SIG_IGN)) return NULL;
    memset(&mine, 0, sizeof mine);
    mine.sa_sigaction = on_sigint;
    mine.sa_flags = SA_SIGINFO | (now.sa_flags & SA_ONSTACK);
    sigemptyset(&mine.sa_mask);
    stop_flag = 0;
    replaced = now;
    if (sigaction(SIGINT, &mine, NULL) != 0) return NULL;
    return &stop_flag;
#else
    return NULL;
#endif
}

void fa_interrupt_end(void)
{
#ifdef FA_HAVE_SIGACTION
    sigaction(SIGINT, &replaced, NULL);
#endif
}

/* The largest team fastattn starts: a runtime asked for far more threads than
 * CPUs overflows its stack setting them up (libgomp allocates their start
 * data on the caller's stack) or exits the process when it cannot create
 * them, and threads beyond the CPUs only share them.  Four a CPU (at least
 * 8, so that the tests can run teams larger than a small machine's), at most
 * FA_THREADS_MAX and the runtime's thread limit. */
int fa_thread_cap(void)
{
#ifdef _OPENMP
    static int cap = 0;
    if (!cap) {
        int n = 4 * omp_get_num_procs();
        if (n < 8) n = 8;
        if (n > FA_THREADS_MAX) n = FA_THREADS_MAX;
        if (n > omp_get_thread_limit()) n = omp_get_thread_limit();
        cap = n < 1 ? 1 : n;
    }
    return cap;
#else
    return 1;
#endif
}

int fa_max_threads(void)
{
#ifdef _OPENMP
    if (fork_serial) return 1;
    const int n = omp_get_max_threads();
    return n < fa_thread_cap() ? n : fa_thread_cap();
#else
    return 1;
#endif
}

/* Threads for a call: the caller's request (> 0) or the OpenMP default, at
 * most fa_thread_cap; one in a child forked with a stale pool (above). */
static int threads_wanted(int requested)
{
    if (requested <= 0 || fork_serial) return fa_max_threads();
    return requested < fa_thread_cap() ? requested : fa_thread_cap();
}

/* Team size: threads_wanted, no more than the work items, and one thread when
 * the work is too small to pay for a team. */
static int team_size(int requested, int64_t items, double work)
{
    int n = threads_wanted(requested);
    if ((int64_t)n > items) n = (int)items;
    if (work < 1.5e5) n = 1;
    return n < 1 ? 1 : n;
}

/* 64-byte aligned scratch; free with free(raw). */
static void *scratch_alloc(size_t bytes, void **raw)
{
    *raw = malloc(bytes + 64);
    if (!*raw) return NULL;
    return (void *)(((uintptr_t)*raw + 63) & ~(uintptr_t)63);
}

/* A team member's start: its own scratch (NULL, and *status = FA_ENOMEM, when
 * it cannot be allocated; free(*raw) in any case), and the team size recorded
 * for fa_last_threads. */
static void *team_scratch(size_t bytes, void **raw, int *status)
{
    void *scratch = scratch_alloc(bytes, raw);
    RECORD_TEAM();
    if (!scratch) {
#pragma omp atomic write
        *status = FA_ENOMEM;
    }
    return scratch;
}

/* Run body(arg) on a team of nthreads threads, or on the calling thread alone
 * when nthreads is 1: its worksharing loops are then orphaned, so they run
 * serially and their barriers are no-ops.  (A one-thread parallel region
 * still costs libgomp two futex system calls, about a microsecond, which is
 * a fifth of a small call.) */
static void run_parallel(void (*body)(void *), void *arg, int nthreads)
{
    if (nthreads <= 1) {
        body(arg);
        return;
    }
#pragma omp parallel num_threads(nthreads)
    body(arg);
}

/* ---------------------------------------------------------------------------
 * Attention.  Work items are (leading index, block of bq query rows); each
 * thread owns the output rows of its items, so no reduction is needed.
 * Dynamic scheduling evens out causal work (later query blocks see more keys).
 * ------------------------------------------------------------------------- */

/* The long-row split and the partials' budget forced by fa_set_long_split (0:
 * FA_SPLIT_KEYS, FA_PARTS_BYTES), for the tests: the split and its waves
 * on rows and items small enough to check. */
static int64_t forced_split_keys = 0, forced_parts_bytes = 0;

void fa_set_long_split(int64_t keys, int64_t parts_bytes)
{
    forced_split_keys = keys > 0 ? keys : 0;
    forced_parts_bytes = parts_bytes > 0 ? parts_bytes : 0;
}

/* Tile sizes forced by fa_set_tiles (0: the defaults below).  For tuning and
 * for the tests, which check that results do not depend on the tiling. */
static int64_t forced_bq = 0, forced_bk = 0;

void fa_set_tiles(int64_t bq, int64_t bk)
{
    forced_bq = bq > 0 ? bq : 0;
    forced_bk = bk > 0 ? bk : 0;
}

/* The row kernel's limit forced by fa_set_rows_max (0: the ISA's). */
static int64_t forced_rows_max = 0;

void fa_set_rows_max(int64_t n)
{
    forced_rows_max = n <= 0 ? 0 : n < FA_ROWS_CAP ? n : FA_ROWS_CAP;
}

/* The fused exp forced by fa_set_fused (-1: the ISA's choice). */
static int forced_fuse = -1;

void fa_set_fused(int mode) { forced_fuse = mode < 0 ? -1 : mode != 0; }

/* The row kernel's prefetch across passes and its far prefetch (fa_tiles'
 * stream and far) forced by fa_set_stream (-1: by the size of K and V). */
static int forced_stream = -1;

void fa_set_stream(int mode) { forced_stream = mode < 0 ? -1 : mode != 0; }

/* The group row kernel forced by fa_set_group (-1: from memory, where the items interleave). */
static int forced_group = -1;

void fa_set_group(int mode) { forced_group = mode < 0 ? -1 : mode != 0; }

/* Item groups the group row kernel ran (run_group), for the tests. */
static int64_t group_runs = 0;

int64_t fa_take_group_count(void) { return __atomic_exchange_n(&group_runs, 0, __ATOMIC_RELAXED); }

/* The packing of a bool mask into bits forced by fa_set_mask_pack (-1: the default). */
static int forced_mask_pack = -1;

void fa_set_mask_pack(int mode) { forced_mask_pack = mode < 0 ? -1 : mode != 0; }

/* Rows the kernels recomputed carefully (redo_nonfinite_rows), for the tests. */
int64_t fa_redo_rows = 0;

int64_t fa_take_redo_count(void) { return __atomic_exchange_n(&fa_redo_rows, 0, __ATOMIC_RELAXED); }

/* Rows the row kernel ran as tails (run), for the tests. */
static int64_t tail_rows = 0;

int64_t fa_take_tail_count(void) { return __atomic_exchange_n(&tail_rows, 0, __ATOMIC_RELAXED); }

/* Bytes of K and V that a call reads (broadcast leading dims counted once). */
static int64_t kv_bytes(const fa_attention_args *a)
{
    int64_t nk_rows = a->nk, nv_rows = a->nk;
    for (int d = 0; d < a->n_lead; d++) {
        if (a->k_lead[d] != 0) nk_rows *= a->lead_shape[d];
        if (a->v_lead[d] != 0) nv_rows *= a->lead_shape[d];
    }
    return (nk_rows * a->dk + nv_rows * a->dv) * (a->dtype == FA_F32 ? 4 : 8);
}

/* Query rows per item: 128, halved down to 32 while the packed queries Qt
 * (dk, bq) would exceed 32 KiB (so they stay in L1 beside the key tile;
 * measured 4-8 % faster at d = 128, 256 and for float64) and while that leaves
 * fewer than four items per thread. */
static void choose_tiles(const fa_attention_args *a, int lanes, int64_t rows_max, int rows_kernel,
                         int from_memory, int64_t n_lead, int threads, fa_tiles *t)
{
    const int64_t tw = lanes; /* bqp: whole vectors (the micro-kernels take one or two) */
    int64_t bq_max = rows_kernel ? rows_max : 128;
    const int64_t esz = a->dtype == FA_F32 ? 4 : 8;
    while (!rows_kernel && bq_max > 32 && a->dk * bq_max * esz > 32768) bq_max /= 2;
    while (!rows_kernel && bq_max > 32 && n_lead * ((a->nq + bq_max - 1) / bq_max) < 4 * (int64_t)threads)
        bq_max /= 2;
    if (!rows_kernel && a->win_left >= 0 && a->win_left < 1024 && bq_max > 32)
        bq_max = 32; /* a narrow band (sliding window) wastes less at its edges with small
                      * tiles: with 128-key tiles, measured 27 % faster at N8192, window (256, 0) */
    if (forced_bq && !rows_kernel) bq_max = forced_bq;
    t->bq = a->nq < bq_max ? a->nq : bq_max;
    if (t->bq < 1) t->bq = 1;
    t->q_main = a->nq;
    t->bqp = (t->bq + tw - 1) / tw * tw;
    /* Rows of the transposed tiles (St, Qt, Ot) one cache line further apart
     * when bqp would put them a multiple of 128 bytes apart, so that a column
     * slice of them spreads over more sets of the L1 (8-way, 64 sets) than the
     * 8 or 16 sets it hits at 512 or 256 bytes: measured
     * 5-7 % faster at B1 H8 N2048 (d64 and d128, float32 and float64, one and two
     * threads, AVX2 on Zen 3), 2.6 % at B32 H12 N128. */
    t->ld = t->bqp;
    if ((t->bqp * esz) % 128 == 0) t->ld += 64 / esz;
    /* Key tiles.  The row kernel: long ones, fewer switches between the K and
     * V streams: 256 keys for one query row (measured 2-4 % faster than 64 at
     * H32 Nk4096 d128), 128 for more (against 256, from memory at H32 Nk4096
     * d128: 2, 4 and 8 rows 1.02-1.05x, float64 4 rows 1.10x; one row 0.985,
     * float64 1.00).  The tiled kernel: 64 keys, so that a tile's K and V
     * (16-32 KiB each at d64-d128 float32) arrive from memory in time through
     * the prefetch of one pass ahead (tile_pf).  Against the earlier 256
     * (float32) and 128 (float64), AVX2 on Zen 3, two threads: few query rows
     * with K and V from memory 1.08-1.35x (12, 16, 20 and 32 rows, H32 Nk4096
     * d128; float64 1.05x); in cache and with full query blocks 0.995-1.045x
     * (B1 H8 N2048 d32-d256, float64, causal, bool mask, BERT, a window,
     * attention_weights; one thread 0.998-1.03x); 32 keys lost 2-8 % in cache.
     * From memory with up to 32 query rows a block, 32 keys: 8, 12, 16 rows
     * 1.15, 1.05, 1.05x (float64 1.02, 1.08, 1.12x) at H32 Nk4096 d128; 32 rows
     * 1.03x, 64 rows 0.98x. */
    int64_t bk_max = !rows_kernel ? 64 : a->nq == 1 ? 256 : 128;
    if (!rows_kernel && t->bq <= 32 && from_memory) bk_max = 32;
    if (forced_bk) bk_max = forced_bk;
    t->bk = a->nk < bk_max ? a->nk : bk_max;
    if (t->bk < 1) t->bk = 1;
}

/* The real query positions of the leading index whose q_len offset is oql:
 * q_len there, cut to [0, nq / row_group] (nq / row_group without q_len). */
static int64_t real_positions(const fa_attention_args *a, int64_t oql)
{
    const int64_t qn = a->nq / a->row_group;
    if (!a->q_len || a->q_len[oql] >= qn) return qn;
    return a->q_len[oql] < 0 ? 0 : a->q_len[oql];
}

/* ---------------------------------------------------------------------------
 * A bool mask as bits, packed once per call for the tiled kernel
 * (mask_bits in kernel_body.h reads them), in place of each key tile
 * turning the mask's bytes into bit words itself: the heads (or batch entries)
 * that share a mask then read an eighth of its bytes, and a tile's words come
 * from a few cache lines, not one line per query row.
 *   bits  (n_slices, rows, nw) words: bit j % 32 of word j / 32 of row r is
 *         mask[r][j] != 0, 0 past nk; rows = nq, or 1 when the mask's rows
 *         are broadcast (m_rs == 0); nw = ceil(nk / 32) + 1, so that a tile
 *         starting inside a word may read the word after its last
 *   slice s: the mask of the leading indices whose coordinates on the dims
 *         the mask does not broadcast (m_lead != 0) are s's, row-major
 * ------------------------------------------------------------------------- */
typedef struct {
    uint32_t *bits;
    int64_t rows, nw, n_slices;
    int64_t s_lead[FA_MAX_DIMS]; /* slice index strides over the leading dims (0 where broadcast) */
} mask_pack;

/* Row r of slice s of the mask as bits: dst (nw) words <- the mask's bytes. */
static void pack_mask_row(const fa_attention_args *a, const mask_pack *mp, int64_t s, int64_t r)
{
    int64_t om = 0, rest = s;
    for (int d = a->n_lead - 1; d >= 0; d--)
        if (a->m_lead[d] != 0) {
            om += rest % a->lead_shape[d] * a->m_lead[d];
            rest /= a->lead_shape[d];
        }
    const uint8_t *row = (const uint8_t *)a->mask + om + r * a->m_rs;
    uint32_t *dst = mp->bits + (s * mp->rows + r) * mp->nw;
    for (int64_t w = 0; w < mp->nw; w++) { /* the last word's keys past nk (and the spare word): 0 */
        const int64_t len = a->nk - 32 * w < 32 ? a->nk - 32 * w : 32;
        dst[w] = len > 0 ? fa_byte_bits(row + 32 * w * a->m_cs, a->m_cs, len) : 0;
    }
}

/* Work item w -> (leading index, query block): pointers and row range; mp:
 * the packed bool mask, or NULL. */
static void fill_item(const fa_attention_args *a, const fa_tiles *t, const mask_pack *mp, int64_t n_qb,
                      int64_t w, size_t esz, size_t msz, fa_item *it)
{
    int64_t lead = w / n_qb, qb = w % n_qb;
    int64_t oq = 0, ok = 0, ov = 0, oo = 0, om = 0, ol = 0, os = 0, okl = 0, oql = 0, oqs = 0, oks = 0, osl = 0;
    for (int d = a->n_lead - 1; d >= 0; d--) { /* row-major over lead_shape */
        const int64_t i = lead % a->lead_shape[d];
        lead /= a->lead_shape[d];
        if (mp) osl += i * mp->s_lead[d];
        oq += i * a->q_lead[d];
        ok += i * a->k_lead[d];
        ov += i * a->v_lead[d];
        oo += i * a->o_lead[d];
        om += i * a->m_lead[d];
        ol += i * a->lse_lead[d];
        os += i * a->slope_lead[d];
        okl += i * a->kvl_lead[d];
        oql += i * a->qln_lead[d];
        oqs += i * a->qst_lead[d];
        oks += i * a->kst_lead[d];
    }
    if (a->q_start) { /* packed sequences: this one's rows start further on */
        const int64_t r = a->q_start[oqs];
        oq += r * a->q_rs;
        oo += r * a->o_rs;
        ol += r * a->lse_rs;
    }
    if (a->kv_start) {
        const int64_t r = a->kv_start[oks];
        ok += r * a->k_rs;
        ov += r * a->v_rs;
    }
    it->kv = a->kv_len ? a->kv_len[okl] : a->nk;
    if (it->kv > a->nk) it->kv = a->nk;
    if (it->kv < 0) it->kv = 0;
    const int64_t qn = real_positions(a, oql);
    it->off = a->top_left ? 0 : it->kv - qn;
    it->slope = !a->slopes ? 0.0
              : a->dtype == FA_F32 ? (double)((const float *)a->slopes)[os] : ((const double *)a->slopes)[os];
    const int64_t i0 = qb * t->bq < t->q_main ? qb * t->bq : t->q_main, e = (int64_t)esz;
    const int64_t end = i0 == t->q_main ? a->nq : i0 + t->bq < t->q_main ? i0 + t->bq : t->q_main;
    it->i0 = i0;
    it->bq = end - i0;
    const int64_t real = qn * a->row_group - i0; /* rows before the padding */
    it->pad = real >= it->bq ? 0 : real <= 0 ? it->bq : it->bq - real;
    it->bq -= it->pad;
    it->j_lo = 0;
    it->j_hi = it->kv;
    it->q = (const char *)a->q + (oq + i0 * a->q_rs) * e;
    it->k = (const char *)a->k + ok * e;
    it->v = (const char *)a->v + ov * e;
    it->mask = a->mask ? (const char *)a->mask + (om + i0 * a->m_rs) * (int64_t)msz : NULL;
    it->mbits = mp ? mp->bits + (osl * mp->rows + (mp->rows > 1 ? i0 : 0)) * mp->nw : NULL;
    it->mb_rs = mp && mp->rows > 1 ? mp->nw : 0;
    it->out = (char *)a->out + (oo + i0 * a->o_rs) * e;
    it->lse = a->lse ? (char *)a->lse + (ol + i0 * a->lse_rs) * e : NULL;
    it->part = NULL;
    it->next_q = it->next_k = NULL;
    it->next_bq = it->next_nk = 0;
}

/* Do n query rows take the row kernel?  Up to rows_max, but not from full_lo to
 * full_hi (run). */
static int few_rows(int64_t n, int64_t rows_max, int64_t full_lo, int64_t full_hi)
{
    return n <= rows_max && !(n >= full_lo && n <= full_hi);
}

/* One attention call, ready to run (run below fills it). */
typedef struct {
    const fa_attention_args *a;
    const fa_tiles *tiles;
    fa_attn_item_fn item_fn;
    fa_attn_item_fn rows_fn; /* the row kernel: items of few rows (few) and the tails (n_main) */
    int few;      /* packed sequences under the tiled kernel: their items of few rows
                   * (few_rows) take rows_fn */
    int64_t few_max, full_lo, full_hi;
    fa_attn_merge_fn merge_fn;
    fa_attn_group_fn group_fn; /* the row kernel over interleaved items (group > 0) */
    int64_t group, n_groups; /* items per group (the last leading dim's, at most FA_GROUP_MAX;
                              * 0: no groups), and the groups; a unit is then (group, split) */
    size_t esz, msz, scratch_bytes;
    int64_t n_qb, n_items, n_splits, chunk, part_elems;
    int64_t n_main; /* items of each leading index: n_qb, or n_qb - 1 where its last
                     * block is a tail (tiles->q_main < nq), which rows_fn runs after the
                     * block before it (run); item k is then block k % n_main of
                     * leading index k / n_main */
    const int64_t *live; /* packed sequences: item k is live[k] (live_items), or NULL: item k is k */
    const mask_pack *mp; /* the bool mask as bits (the team packs it first), or NULL */
    void *parts;  /* (n_items, n_splits, part_elems) partial results, or NULL */
    int64_t w0;   /* the first item of this wave: items w0 .. w0 + n_items - 1 run (run) */
    int pack;     /* pack mp's bits first (the first wave) */
    int status;   /* FA_ENOMEM when a thread's scratch could not be allocated */
    int weights;  /* fa_attention_weights: padding rows are left as they are (zero) */
    int64_t claimed; /* units claimed from the shared counter so far */
} run_plan;

/* The item's padding rows (q_len), after its bq real ones: out rows zero,
 * lse -inf, as for a row that sees nothing.  Not with packed sequences
 * (q_start): those rows are the next sequence's.
 *   out  (pad, dv) row stride a->o_rs, from row bq of it->out
 *   lse  (pad)     stride a->lse_rs, from row bq of it->lse, or NULL */
static void write_padding(const fa_attention_args *a, const fa_item *it, size_t esz)
{
    const int64_t e = (int64_t)esz;
    for (int64_t i = it->bq; i < it->bq + it->pad; i++) {
        memset((char *)it->out + i * a->o_rs * e, 0, (size_t)a->dv * esz);
        if (!it->lse) continue;
        if (a->dtype == FA_F32)
            ((float *)it->lse)[i * a->lse_rs] = -INFINITY;
        else
            ((double *)it->lse)[i * a->lse_rs] = -INFINITY;
    }
}

/* The next unit from the shared counter (n_units or more when none is left):
 * units [0, team) are the threads' first, one each; the rest go in order. */
static int64_t claim_unit(run_plan *p, int64_t team)
{
    int64_t c;
#pragma omp atomic capture
    c = p->claimed++;
    return team + c;
}

/* Item k of the plan as fill_item's w = lead * n_qb + qb. */
static int64_t item_index(const run_plan *p, int64_t k)
{
    k += p->w0;
    return p->live ? p->live[k] : k / p->n_main * p->n_qb + k % p->n_main;
}

/* Unit u = (item w, split sp): the item, with its share of the keys and its
 * place among the partial results when the keys are split. */
static void fill_unit(const run_plan *p, int64_t u, fa_item *it)
{
    const int64_t w = u / p->n_splits, sp = u % p->n_splits;
    fill_item(p->a, p->tiles, p->mp, p->n_qb, item_index(p, w), p->esz, p->msz, it);
    if (p->parts) {
        it->j_lo = sp * p->chunk;
        it->j_hi = (it->j_lo + p->chunk < it->kv) ? it->j_lo + p->chunk : it->kv;
        it->part = (char *)p->parts + (w * p->n_splits * p->part_elems + sp * it->bq * (p->a->dv + 2)) * (int64_t)p->esz;
    }
}

/* Unit u = (group, split) of the group row kernel: group gi holds the items
 * (leading indices: the row kernel's items are whole) of one index of the
 * other leading dims and up to p->group consecutive indices h0.. of the last;
 * their padding rows are written, and the kernel runs the items that have real rows. */
static void run_group(run_plan *p, int64_t u, void *scratch)
{
    const int64_t gi = u / p->n_splits, sp = u % p->n_splits;
    const int64_t hn = p->a->lead_shape[p->a->n_lead - 1], n_sub = (hn + p->group - 1) / p->group;
    const int64_t h0 = gi % n_sub * p->group, w0 = gi / n_sub * hn + h0;
    const int64_t n = hn - h0 < p->group ? hn - h0 : p->group;
    fa_item its[FA_GROUP_MAX];
    int64_t m = 0;
    for (int64_t g = 0; g < n; g++) {
        fill_unit(p, (w0 + g) * p->n_splits + sp, &its[m]);
        if (its[m].pad && sp == 0) write_padding(p->a, &its[m], p->esz);
        if (its[m].bq > 0) m++;
    }
    if (m > 0) {
        p->group_fn(p->a, p->tiles, its, m, scratch);
        __atomic_fetch_add(&group_runs, 1, __ATOMIC_RELAXED);
    }
}

/* The work of each thread of the team (or of the caller alone): its own
 * scratch, then a share of the (item, split) units; with split keys, after a
 * barrier, a share of the merges.  Each thread starts with the unit of its
 * own number, then claims its next unit from a shared counter before it runs
 * the current one (as schedule(dynamic, 1) does, one unit ahead), so that the
 * kernel can prefetch the next unit's first queries and keys while the current
 * one runs: measured 5-9 % faster at B32 H12 N128 d64, where every item's
 * inputs come from memory. */
static void run_team(void *arg)
{
    run_plan *p = arg;
    const fa_attention_args *a = p->a;
    void *raw;
    void *scratch = team_scratch(p->scratch_bytes, &raw, &p->status);
    const int64_t n_units = (p->group ? p->n_groups : p->n_items) * p->n_splits, team = fa_num_threads();
    if (p->mp && p->pack) { /* the mask's bits, before any item reads them (the loop's closing barrier) */
#pragma omp for schedule(static)
        for (int64_t x = 0; x < p->mp->n_slices * p->mp->rows; x++)
            pack_mask_row(a, p->mp, x / p->mp->rows, x % p->mp->rows);
    }
    int64_t u = scratch ? fa_thread_num() : n_units;
    while (u < n_units && !fa_stopped(a->stop)) {
        const int64_t un = claim_unit(p, team);
        if (p->group) {
            run_group(p, u, scratch);
            u = un;
            continue;
        }
        fa_item it;
        fill_unit(p, u, &it);
        if (un < n_units) {
            fa_item nx;
            fill_unit(p, un, &nx);
            const int64_t e = (int64_t)p->esz;
            const int64_t j_end = nx.j_lo + p->tiles->bk < nx.j_hi ? nx.j_lo + p->tiles->bk : nx.j_hi;
            it.next_q = nx.q;
            it.next_bq = nx.bq;
            it.next_k = (const char *)nx.k + nx.j_lo * a->k_rs * e;
            it.next_nk = j_end > nx.j_lo ? j_end - nx.j_lo : 0;
        }
        if (it.pad && !p->weights && !a->q_start && u % p->n_splits == 0) write_padding(a, &it, p->esz);
        if (it.bq > 0) {
            const int few = p->few && few_rows(it.bq, p->few_max, p->full_lo, p->full_hi);
            (few ? p->rows_fn : p->item_fn)(a, p->tiles, &it, scratch);
        }
        if (p->n_main < p->n_qb && u % p->n_main == p->n_main - 1) { /* the leading index's tail (n_splits 1) */
            fa_item tl;
            fill_item(a, p->tiles, p->mp, p->n_qb, item_index(p, u) + 1, p->esz, p->msz, &tl);
            if (tl.pad) write_padding(a, &tl, p->esz);
            if (tl.bq > 0) {
                p->rows_fn(a, p->tiles, &tl, scratch);
                __atomic_fetch_add(&tail_rows, tl.bq, __ATOMIC_RELAXED);
            }
        }
        u = un;
    }
    if (p->parts) { /* after every split is done: merge each item's splits */
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t w = 0; w < p->n_items; w++) {
            if (!scratch || fa_stopped(a->stop)) continue;
            fa_item it;
            fill_item(a, p->tiles, p->mp, p->n_qb, item_index(p, w), p->esz, p->msz, &it);
            if (it.bq == 0) continue; /* all padding */
            p->merge_fn(a, &it, (char *)p->parts + w * p->n_splits * p->part_elems * (int64_t)p->esz,
                        p->n_splits, scratch);
        }
    }
    free(raw);
}

/* Packed sequences (q_start): the items that hold real rows, as indices
 * w = lead * n_qb + qb, in order, into live (NULL: only count them); the
 * others have nothing to do (their rows are other sequences').  Returns their
 * number; *rows is the real rows in all. */
static int64_t live_items(const fa_attention_args *a, int64_t n_lead_total, int64_t n_qb, int64_t bq,
                          int64_t *live, double *rows)
{
    int64_t n = 0;
    *rows = 0;
    for (int64_t l = 0; l < n_lead_total; l++) {
        int64_t rest = l, oql = 0;
        for (int d = a->n_lead - 1; d >= 0; d--) { /* row-major over lead_shape, as fill_item */
            oql += rest % a->lead_shape[d] * a->qln_lead[d];
            rest /= a->lead_shape[d];
        }
        const int64_t real = real_positions(a, oql) * a->row_group, blocks = (real + bq - 1) / bq;
        if (live)
            for (int64_t qb = 0; qb < blocks; qb++) live[n + qb] = l * n_qb + qb;
        n += blocks;
        *rows += (double)real;
    }
    return n;
}

/* Attention (weights = 0) or its weights (weights = 1: out is (lead, nq, nk),
 * zero-filled; always the tiled kernel, never split). */
static int run(const fa_attention_args *a, int weights)
{
    if (a->dtype != FA_F32 && a->dtype != FA_F64) return FA_EINVAL;
    if (a->n_lead < 0 || a->n_lead > FA_MAX_DIMS) return FA_EINVAL;
    if (a->row_group < 1 || a->nq % a->row_group) return FA_EINVAL;
    if ((a->q_start || a->kv_start) && a->mask_kind != FA_MASK_NONE) return FA_EINVAL;
    int64_t n_lead_total = 1;
    for (int d = 0; d < a->n_lead; d++) n_lead_total *= a->lead_shape[d];
    if (n_lead_total == 0 || a->nq == 0 || (weights && a->nk == 0)) return FA_OK;

    const fa_isa_table *isa = fa_isa_current();
    const int64_t kvb = kv_bytes(a);
    const int from_memory = kvb > FA_KV_MEM_BYTES; /* K and V beyond the L3 */
    const int64_t rows_max = forced_rows_max           ? forced_rows_max
                             : from_memory             ? isa->rows_max_big[a->dtype]
                             : a->dk >= FA_ROWS_DK_BIG ? isa->rows_max_dk[a->dtype]
                                                       : isa->rows_max[a->dtype];
    /* Except that rows_full to lanes rows, which fill (nearly) one vector of the
     * tiled kernel, take that one: it is then faster than the row kernel's dot
     * products (dispatch.c); not where dk > FA_ROWS_DK_BIG with K and V from memory. */
    int64_t full_lo = 1, full_hi = 0; /* (empty) */
    if (!forced_rows_max && isa->rows_full[a->dtype] > 0 && !(from_memory && a->dk > FA_ROWS_DK_BIG)) {
        full_lo = isa->rows_full[a->dtype];
        full_hi = isa->lanes[a->dtype];
    }
    const int rows_kernel = !weights && few_rows(a->nq, rows_max, full_lo, full_hi);
    const fa_attn_item_fn item_fn = weights       ? isa->weights_item[a->dtype]
                                    : rows_kernel ? isa->attn_item_rows[a->dtype]
                                                  : isa->attn_item[a->dtype];
    const fa_attn_merge_fn merge_fn = isa->attn_merge[a->dtype];
    const size_t esz = a->dtype == FA_F32 ? sizeof(float) : sizeof(double);
    const size_t msz = a->mask_kind == FA_MASK_BOOL ? 1 : esz;
    const int want = threads_wanted(a->num_threads);
    fa_tiles tiles;
    choose_tiles(a, isa->lanes[a->dtype], rows_max, rows_kernel, from_memory, n_lead_total, want, &tiles);
    tiles.fuse = forced_fuse >= 0 ? forced_fuse : isa->fuse;
    tiles.stream = forced_stream >= 0 ? forced_stream : from_memory;
    tiles.far = forced_stream >= 0 ? forced_stream : kvb > FA_KV_FAR_BYTES;
    /* The tail: the rows of the last block past its last whole vector (fewer
     * than the lanes, but the tiled kernel pays for the whole vector) take the
     * row kernel, up to the ISA's tail_max of them after at least 16 rows, right
     * after the block before them on the same thread, while K and V are still in
     * its caches (docs/tuning.md: the tail).  Not with packed sequences, the
     * weights, forced rows or tiles, or split keys. */
    /* Rows of more than FA_SPLIT_KEYS keys: split into partials of at most that
     * many keys (merged by the logsumexp rule, fa_attn_merge), since a float32
     * running sum stops taking its increments well before 2^24 of them (all
     * values 3.0 gave 3.33 at 2^25 keys), and so that Ctrl-C (fa_stopped,
     * checked between units) stops a long row soon.  No tail and no groups then. */
    const int64_t split_keys = forced_split_keys ? forced_split_keys : FA_SPLIT_KEYS;
    const int64_t long_splits = !weights && a->nk > split_keys
                                    ? (a->nk + split_keys - 1) / split_keys
                                    : 1;
    int tail = 0;
    if (!rows_kernel && !weights && !a->q_start && !forced_rows_max && !forced_bq && long_splits == 1) {
        const int64_t last = a->nq - (a->nq - 1) / tiles.bq * tiles.bq, r = last % isa->lanes[a->dtype];
        const int64_t blocks = (a->nq - r + tiles.bq - 1) / tiles.bq;
        if (r > 0 && r <= isa->tail_max[a->dtype] && a->nq - r >= 16 && n_lead_total * blocks >= want) {
            tiles.q_main = a->nq - r;
            tail = 1;
        }
    }
    const int64_t n_qb = (tiles.q_main + tiles.bq - 1) / tiles.bq + tail;
    int64_t n_items = n_lead_total * (n_qb - tail);
    double q_rows = (double)n_lead_total * (double)a->nq;
    /* Packed sequences: only the items with real rows (one long sequence among
     * many short ones gives most (lead, block) pairs no row). */
    int64_t *live = NULL;
    if (a->q_start) { /* counted first: the list has the live items' size, not n_items' */
        n_items = live_items(a, n_lead_total, n_qb, tiles.bq, NULL, &q_rows);
        if (n_items == 0) return FA_OK;
        live = malloc((size_t)n_items * sizeof *live);
        if (!live) return FA_ENOMEM;
        live_items(a, n_lead_total, n_qb, tiles.bq, live, &q_rows);
    }

    /* Decoding from a (B, n, H, d) cache: the last leading dim's indices h
     * (the heads) have their K and V rows at h k_lead (v_lead) within key rows
     * that hold all of them (k_rs = H k_lead).  With up to FA_GROUP_ROWS query
     * rows an item and K and V from memory, the group kernel takes the heads of
     * each group together (fa_attn_group_rows), key tile by key tile (FA_GROUP_BK
     * keys for one row; for more, about FA_GROUP_TILE_BYTES of the group's K and
     * V, 8 to 64 keys), so that K and V are read in address order, not in pieces
     * H d elements apart.  Not in cache, where the item-by-item kernel's rows come
     * from the L3 fast enough (docs/tuning.md: the group kernel). */
    int64_t group = 0, n_groups = 0;
    if (rows_kernel && a->nq <= FA_GROUP_ROWS && !a->q_start && !a->kv_start && a->n_lead >= 1 &&
        forced_group != 0 && long_splits == 1) {
        const int d = a->n_lead - 1;
        const int64_t hn = a->lead_shape[d];
        if (hn >= 2 && a->k_lead[d] > 0 && a->k_lead[d] * hn == a->k_rs && a->v_lead[d] > 0 &&
            a->v_lead[d] * hn == a->v_rs && (forced_group == 1 || from_memory)) {
            const int64_t n_sub = (hn * a->nq + FA_GROUP_MAX - 1) / FA_GROUP_MAX; /* rows a group */
            group = (hn + n_sub - 1) / n_sub;
            n_groups = n_lead_total / hn * n_sub;
            int64_t gbk = FA_GROUP_BK;
            const int64_t key_bytes = group * (a->dk + a->dv) * (int64_t)esz; /* 0: d_k = d_v = 0 (forced) */
            if (a->nq > 1) {
                gbk = key_bytes > 0 ? FA_GROUP_TILE_BYTES / key_bytes / 4 * 4 : 64;
                gbk = gbk < 8 ? 8 : gbk > 64 ? 64 : gbk;
            }
            if (!forced_bk) tiles.bk = a->nk < gbk ? (a->nk < 1 ? 1 : a->nk) : gbk;
        }
    }
    const int64_t n_work = group ? n_groups : n_items; /* units before any split */

    /* Split the keys (flash-decoding) when there are fewer items than threads:
     * each (item, split) writes a partial (acc, max, sum), merged afterwards. */
    int64_t n_splits = 1;
    if (!weights && n_work < want && a->nk >= 1024) {
        n_splits = (want + n_work - 1) / n_work;
        if (n_splits > a->nk / 512) n_splits = a->nk / 512;
    }
    /* Groups, few and long: split too where the threads would not get as many
     * each. */
    if (group && n_work >= want && n_work % want != 0 && n_work < 4 * (int64_t)want && a->nk >= 1024) {
        n_splits = want;
        if (n_splits > a->nk / 512) n_splits = a->nk / 512;
    }
    if (n_splits < long_splits) n_splits = long_splits;
    const int64_t chunk = n_splits > 1 ? ((a->nk + n_splits - 1) / n_splits + tiles.bk - 1) / tiles.bk * tiles.bk : a->nk;
    const int64_t part_elems = tiles.bq * (a->dv + 2);
    /* Items run in waves whose partial results fit in FA_PARTS_BYTES (one wave
     * unless long rows are split: see long_splits; groups always one). */
    int64_t wave = n_items;
    void *parts = NULL;
    if (n_splits > 1) {
        const int64_t per_item = n_splits * part_elems * (int64_t)esz;
        const int64_t budget = forced_parts_bytes ? forced_parts_bytes : FA_PARTS_BYTES;
        if (!group && per_item * n_items > budget) wave = budget / per_item > 0 ? budget / per_item : 1;
        parts = malloc((size_t)(wave * per_item));
        if (!parts) {
            free(live);
            return FA_ENOMEM;
        }
    }

    /* Packed sequences under the tiled kernel (the longest has more rows than
     * rows_max): the items of a short one, as few rows as a call of its own
     * would give the row kernel, take the row kernel too. */
    const int few = a->q_start && !weights && !rows_kernel;
    int64_t scratch_elems = rows_kernel ? fa_rows_scratch_elems(&tiles, a->dk, a->dv)
                                        : fa_attn_scratch_elems(&tiles, a->dk, weights ? 0 : a->dv);
    if ((few || tail) && scratch_elems < fa_rows_scratch_elems(&tiles, a->dk, a->dv))
        scratch_elems = fa_rows_scratch_elems(&tiles, a->dk, a->dv);
    if (group && scratch_elems < fa_group_scratch_elems(&tiles, a->dk, a->dv, group))
        scratch_elems = fa_group_scratch_elems(&tiles, a->dk, a->dv, group);
    if (scratch_elems < a->dv + 2) scratch_elems = a->dv + 2;
    { /* the row kernel for one row: redo_nonfinite_rows (kernel_body.h) */
        const fa_tiles one = {.bq = 1, .bk = tiles.bk, .bqp = 1, .ld = 1, .fuse = 0};
        const int64_t row_elems = fa_rows_scratch_elems(&one, a->dk, a->dv);
        if (!weights && scratch_elems < row_elems) scratch_elems = row_elems;
    }
    /* A bool mask under the tiled kernel that two or more leading indices share
     * (its rows broadcast too): packed into bits first (mask_pack), so that each
     * tile reads an eighth of its bytes, unless they cannot be allocated; not a
     * mask of each head's own, whose packing pass would read it all from memory
     * once more (docs/tuning.md: the packed bool mask). */
    mask_pack mpk, *mp = NULL;
    if (a->mask_kind == FA_MASK_BOOL && !rows_kernel && forced_mask_pack != 0) {
        mpk.rows = a->m_rs != 0 ? a->nq : 1;
        mpk.nw = (a->nk + 31) / 32 + 1;
        mpk.n_slices = 1;
        for (int d = a->n_lead - 1; d >= 0; d--) {
            mpk.s_lead[d] = a->m_lead[d] != 0 ? mpk.n_slices : 0;
            if (a->m_lead[d] != 0) mpk.n_slices *= a->lead_shape[d];
        }
        if (forced_mask_pack == 1 || n_lead_total >= 2 * mpk.n_slices || mpk.rows == 1) {
            mpk.bits = malloc((size_t)(mpk.n_slices * mpk.rows * mpk.nw) * sizeof(uint32_t));
            if (mpk.bits) mp = &mpk;
        }
    }
    const double work = q_rows * (double)(a->nk + 1) * (double)(a->dk + a->dv + 8);
    run_plan plan = {.a = a, .tiles = &tiles, .item_fn = item_fn, .rows_fn = isa->attn_item_rows[a->dtype],
                     .few = few, .few_max = rows_max,
                     .full_lo = full_lo, .full_hi = full_hi,
                     .merge_fn = merge_fn, .group_fn = isa->attn_group_rows[a->dtype],
                     .group = group, .n_groups = n_groups,
                     .esz = esz, .msz = msz, .scratch_bytes = (size_t)scratch_elems * esz,
                     .n_qb = n_qb, .n_items = n_items, .n_splits = n_splits, .chunk = chunk,
                     .part_elems = part_elems, .n_main = n_qb - tail, .live = live, .mp = mp, .parts = parts, .status = FA_OK,
                     .weights = weights, .claimed = 0};
    const int nthreads = team_size(a->num_threads, n_work * n_splits, work);
    for (int64_t w0 = 0; w0 < n_items && plan.status == FA_OK && !fa_stopped(a->stop); w0 += wave) {
        plan.w0 = w0;
        plan.n_items = n_items - w0 < wave ? n_items - w0 : wave;
        plan.pack = w0 == 0;
        plan.claimed = 0;
        run_parallel(run_team, &plan, nthreads);
    }
    if (mp) free(mp->bits);
    free(parts);
    free(live);
    return plan.status == FA_OK && fa_stopped(a->stop) ? FA_EINTR : plan.status;
}

int fa_attention(const fa_attention_args *a) { return run(a, 0); }

/* Attention weights (lead, nq, nk): the same items, each writing its rows of
 * probabilities.  out must be zero-filled. */
int fa_attention_weights(const fa_attention_args *a) { return run(a, 1); }

/* ---------------------------------------------------------------------------
 * Softmax along the last axis, parallel over rows.
 * ------------------------------------------------------------------------- */
typedef struct {
    const fa_softmax_args *a;
    fa_softmax_row_fn row_fn;
    size_t esz, scratch_bytes;
    int64_t rows;
    int status;
} softmax_plan;

static void softmax_team(void *arg)
{
    softmax_plan *p = arg;
    const fa_softmax_args *a = p->a;
    void *raw;
    void *scratch = team_scratch(p->scratch_bytes, &raw, &p->status);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < p->rows; r++) {
        if (!scratch || fa_stopped(a->stop)) continue;
        int64_t idx = r, ox = 0, oo = 0;
        for (int d = a->n_lead - 1; d >= 0; d--) {
            const int64_t i = idx % a->lead_shape[d];
            idx /= a->lead_shape[d];
            ox += i * a->x_lead[d];
            oo += i * a->o_lead[d];
        }
        p->row_fn((const char *)a->x + ox * (int64_t)p->esz, a->x_s,
                  (char *)a->out + oo * (int64_t)p->esz, a->o_s, a->n, scratch);
    }
    free(raw);
}

int fa_softmax(const fa_softmax_args *a)
{
    if (a->dtype != FA_F32 && a->dtype != FA_F64) return FA_EINVAL;
    if (a->n_lead < 0 || a->n_lead > FA_MAX_DIMS) return FA_EINVAL;
    int64_t rows = 1;
    for (int d = 0; d < a->n_lead; d++) rows *= a->lead_shape[d];
    if (rows == 0 || a->n == 0) return FA_OK;

    const size_t esz = a->dtype == FA_F32 ? sizeof(float) : sizeof(double);
    softmax_plan plan = {.a = a, .row_fn = fa_isa_current()->softmax_row[a->dtype], .esz = esz,
                         .scratch_bytes = (size_t)fa_softmax_scratch_elems(a->n) * esz,
                         .rows = rows, .status = FA_OK};
    run_parallel(softmax_team, &plan, team_size(a->num_threads, rows, 20.0 * (double)rows * (double)a->n));
    return plan.status == FA_OK && fa_stopped(a->stop) ? FA_EINTR : plan.status;
}

/* ---------------------------------------------------------------------------
 * A float mask as the bool mask it acts as (see _mask_as_bool in
 * fastattn/_api.py): keep[i] = (x[i] == 0), and whether every x[i] is 0
 * (either sign) or at most `floor` (-inf among them) with a 0 in each row
 * that holds a finite x[i] <= floor, in one pass split across the threads
 * (num_threads <= 0: the OpenMP default), where NumPy takes several.  With
 * pad, a row without a 0 may instead be one constant c <= pad_floor (a padding
 * query row of a Hugging Face mask, which attends every key alike): pad[r] = 1
 * for such a row (its keep all 0), else 0.
 *   x     (rows, len) float32 or float64 (dtype), contiguous
 *   keep  (rows, len) bytes, 0 or 1; all written whatever *all_ok
 *   pad   (rows) bytes, 0 or 1, or NULL; all written whatever *all_ok
 * floor = -inf asks for 0 and -inf only (no row then holds a finite one).
 * ------------------------------------------------------------------------- */
typedef struct {
    const void *x;
    uint8_t *keep, *pad;
    int64_t rows, len, rows_per_unit;
    double floor, pad_floor;
    int dtype, ok;
} keep_plan;

enum { KEEP_CHUNK = 1 << 15 }; /* elements per work unit (whole rows, at least one) */

/* For a row whose entries are all 0 or at most floor (keep marking its 0s):
 * whether it holds a 0, which lets it go as bool. */
static int row_has_zero(const uint8_t *keep, int64_t len)
{
    unsigned any = 0;
    for (int64_t i = 0; i < len; i++) any |= keep[i];
    return any != 0;
}

/* For a row without a 0 whose entries are all at most floor: whether they are
 * all -inf (1: it attends nothing, as in bool), or, with pad, all one constant
 * c <= pad_floor (2: it attends every key alike, a padding row), else 0. */
static int row_without_zero(int dtype, const void *x, int64_t len, int pad, double pad_floor)
{
    int finite = 0, same = 1;
    double first;
    if (len == 0) return 1;
    if (dtype == FA_F32) {
        const float *f = x;
        for (int64_t i = 0; i < len; i++) {
            finite |= f[i] != -INFINITY;
            same &= f[i] == f[0];
        }
        first = f[0];
    } else {
        const double *d = x;
        for (int64_t i = 0; i < len; i++) {
            finite |= d[i] != -INFINITY;
            same &= d[i] == d[0];
        }
        first = d[0];
    }
    return !finite ? 1 : pad && same && first <= pad_floor ? 2 : 0;
}

/* keep[i] = x[i] == 0 over one row of len entries; whether each x[i] is 0 or
 * at most floor, and the row holds a 0 if it holds a finite x[i] <= floor
 * (or, with pad, is a padding row: *is_pad = 1).
 * The first loop alone where floor is -inf (as GCC vectorises it: 0.84 ms
 * for a 2048 x 2048 mask on one thread, 1.33 with the row's checks in it). */
static int keep_row_f32(const float *restrict x, uint8_t *restrict keep, int64_t len, float floor, int pad,
                        double pad_floor, uint8_t *is_pad)
{
    int ok = 1;
    for (int64_t i = 0; i < len; i++) {
        keep[i] = x[i] == 0;
        ok &= (x[i] == 0) | (x[i] <= floor);
    }
    if (!ok || floor == -INFINITY || row_has_zero(keep, len)) return ok;
    const int kind = row_without_zero(FA_F32, x, len, pad, pad_floor);
    *is_pad = kind == 2;
    return kind != 0;
}

/* The same for float64, in pairs of lanes: GCC does not vectorise the loop of
 * keep_row_f32 for double (5.4 ms against 2.1 for a 2048 x 2048 mask on one thread). */
static int keep_row_f64(const double *restrict x, uint8_t *restrict keep, int64_t len, double floor, int pad,
                        double pad_floor, uint8_t *is_pad)
{
    typedef double d2 __attribute__((vector_size(16)));
    typedef int64_t i2 __attribute__((vector_size(16)));
    const d2 zero = {0, 0}, fl = {floor, floor};
    i2 ok2 = {-1, -1};
    int64_t i = 0;
    for (; i + 2 <= len; i += 2) {
        d2 v;
        memcpy(&v, x + i, sizeof v);
        const i2 z = v == zero;
        ok2 &= z | (v <= fl);
        keep[i] = (uint8_t)(z[0] & 1);
        keep[i + 1] = (uint8_t)(z[1] & 1);
    }
    int ok = (ok2[0] & ok2[1]) != 0;
    for (; i < len; i++) {
        keep[i] = x[i] == 0;
        ok &= (x[i] == 0) | (x[i] <= floor);
    }
    if (!ok || floor == -INFINITY || row_has_zero(keep, len)) return ok;
    const int kind = row_without_zero(FA_F64, x, len, pad, pad_floor);
    *is_pad = kind == 2;
    return kind != 0;
}

static void mask_keep_team(void *arg)
{
    keep_plan *p = arg;
    const int64_t units = (p->rows + p->rows_per_unit - 1) / p->rows_per_unit;
    int ok = 1;
    RECORD_TEAM();
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; u++) {
        const int64_t r1 = (u + 1) * p->rows_per_unit < p->rows ? (u + 1) * p->rows_per_unit : p->rows;
        for (int64_t r = u * p->rows_per_unit; r < r1; r++) {
            const int64_t at = r * p->len;
            uint8_t is_pad = 0;
            ok &= p->dtype == FA_F32 ? keep_row_f32((const float *)p->x + at, p->keep + at, p->len, (float)p->floor,
                                                    p->pad != NULL, p->pad_floor, &is_pad)
                                     : keep_row_f64((const double *)p->x + at, p->keep + at, p->len, p->floor,
                                                    p->pad != NULL, p->pad_floor, &is_pad);
            if (p->pad) p->pad[r] = is_pad;
        }
    }
#pragma omp atomic
    p->ok &= ok;
}

int fa_mask_keep(int dtype, const void *x, int64_t rows, int64_t len, double floor, uint8_t *keep,
                 double pad_floor, uint8_t *pad, int num_threads, int *all_ok)
{
    if ((dtype != FA_F32 && dtype != FA_F64) || rows < 0 || len < 0 || !(floor <= 0) || !(pad_floor <= 0))
        return FA_EINVAL;
    keep_plan plan = {.x = x, .keep = keep, .pad = pad, .rows = rows, .len = len, .floor = floor,
                      .pad_floor = pad_floor, .dtype = dtype, .ok = 1,
                      .rows_per_unit = len >= KEEP_CHUNK ? 1 : KEEP_CHUNK / (len > 0 ? len : 1)};
    const int64_t n = rows * len, units = (rows + plan.rows_per_unit - 1) / plan.rows_per_unit;
    run_parallel(mask_keep_team, &plan, team_size(num_threads, units, 2.0 * (double)n));
    *all_ok = plan.ok;
    return FA_OK;
}

/* ---------------------------------------------------------------------------
 * max |x[i]| of a contiguous float32 or float64 x of n entries (0 when n is 0;
 * NaN when some x[i] is NaN), in one pass split across the threads
 * (num_threads <= 0: the OpenMP default): the bound on the scores that the
 * float mask conversion needs (_abs_max in fastattn/_api.py), where NumPy's
 * max and min take two passes on one thread.
 *   x  (n) float32 or float64 (dtype), contiguous
 * ------------------------------------------------------------------------- */
typedef struct {
    const void *x;
    int64_t n;
    double max;
    int dtype, nan;
} abs_max_plan;

enum { ABS_MAX_CHUNK = 1 << 14 }; /* elements per work unit */

/* max |x[i]| of n entries into *max, and whether one is NaN into *nan: SSE2
 * (the x86-64 baseline) four vectors at a time, a plain loop elsewhere and for
 * the tail.  maxps and maxpd keep their second operand where the first is NaN,
 * so NaN is counted apart (cmpunord).  ABS_MAX_SSE2 is the vector loop of both
 * types: V the vector, S the intrinsics' suffix (ps, pd), W its lanes. */
#ifdef __SSE2__
#define ABS_MAX_SSE2(T, V, S, W)                                                        \
    const V sign = _mm_set1_##S(-0.0);                                                  \
    V m0 = _mm_setzero_##S(), m1 = m0, m2 = m0, m3 = m0, u = m0;                       \
    for (; i + 4 * (W) <= n; i += 4 * (W)) {                                            \
        const V a0 = _mm_andnot_##S(sign, _mm_loadu_##S(x + i));                        \
        const V a1 = _mm_andnot_##S(sign, _mm_loadu_##S(x + i + (W)));                  \
        const V a2 = _mm_andnot_##S(sign, _mm_loadu_##S(x + i + 2 * (W)));              \
        const V a3 = _mm_andnot_##S(sign, _mm_loadu_##S(x + i + 3 * (W)));              \
        m0 = _mm_max_##S(a0, m0);                                                       \
        m1 = _mm_max_##S(a1, m1);                                                       \
        m2 = _mm_max_##S(a2, m2);                                                       \
        m3 = _mm_max_##S(a3, m3);                                                       \
        u = _mm_or_##S(u, _mm_or_##S(_mm_cmpunord_##S(a0, a1), _mm_cmpunord_##S(a2, a3))); \
    }                                                                                   \
    T lanes[W];                                                                         \
    _mm_storeu_##S(lanes, _mm_max_##S(_mm_max_##S(m0, m1), _mm_max_##S(m2, m3)));      \
    for (int l = 0; l < (W); l++) m = lanes[l] > m ? lanes[l] : m;                      \
    bad = _mm_movemask_##S(u) != 0;
#else
#define ABS_MAX_SSE2(T, V, S, W)
#endif

/* abs_max_f32 and abs_max_f64: the vector loop, then the rest one by one */
#define ABS_MAX_FN(NAME, T, FABS, V, S, W)                                              \
    static void NAME(const T *x, int64_t n, double *max, int *nan)                      \
    {                                                                                   \
        int64_t i = 0;                                                                  \
        T m = 0;                                                                        \
        int bad = 0;                                                                    \
        ABS_MAX_SSE2(T, V, S, W)                                                        \
        for (; i < n; i++) {                                                            \
            const T a = FABS(x[i]);                                                     \
            m = a > m ? a : m;                                                          \
            bad |= a != a;                                                              \
        }                                                                               \
        *max = m;                                                                       \
        *nan = bad;                                                                     \
    }
ABS_MAX_FN(abs_max_f32, float, fabsf, __m128, ps, 4)
ABS_MAX_FN(abs_max_f64, double, fabs, __m128d, pd, 2)

static void abs_max_team(void *arg)
{
    abs_max_plan *p = arg;
    const int64_t units = (p->n + ABS_MAX_CHUNK - 1) / ABS_MAX_CHUNK;
    double m = 0;
    int nan = 0;
    RECORD_TEAM();
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; u++) {
        const int64_t at = u * ABS_MAX_CHUNK, len = p->n - at < ABS_MAX_CHUNK ? p->n - at : ABS_MAX_CHUNK;
        double um;
        int un;
        if (p->dtype == FA_F32)
            abs_max_f32((const float *)p->x + at, len, &um, &un);
        else
            abs_max_f64((const double *)p->x + at, len, &um, &un);
        m = um > m ? um : m;
        nan |= un;
    }
#pragma omp critical(fa_abs_max)
    {
        p->max = m > p->max ? m : p->max;
        p->nan |= nan;
    }
}

int fa_abs_max(int dtype, const void *x, int64_t n, int num_threads, double *out)
{
    if ((dtype != FA_F32 && dtype != FA_F64) || n < 0) return FA_EINVAL;
    abs_max_plan plan = {.x = x, .n = n, .max = 0, .dtype = dtype, .nan = 0};
    const int64_t units = (n + ABS_MAX_CHUNK - 1) / ABS_MAX_CHUNK;
    run_parallel(abs_max_team, &plan, team_size(num_threads, units, 0.5 * (double)n));
    *out = plan.nan ? NAN : plan.max;
    return FA_OK;
}

/* ---------------------------------------------------------------------------
 * The benchmark's memory ceiling: read n bytes of x once, split across the
 * threads (num_threads <= 0: the OpenMP default), as a plain streaming read
 * with 16-byte loads and four independent XOR chains.  Returns the XOR of the
 * 8-byte words (so that the reads cannot be optimised away).
 *   x  (n) bytes, n a multiple of 64, 16-byte aligned
 * ------------------------------------------------------------------------- */
uint64_t fa_stream_read(const void *x, int64_t n, int num_threads)
{
    typedef uint64_t u2 __attribute__((vector_size(16)));
    const u2 *p = x;
    const int64_t nv = n / 16;
    const int nthreads = threads_wanted(num_threads);
    (void)nthreads; /* unused without OpenMP */
    uint64_t total = 0;
#pragma omp parallel num_threads(nthreads) reduction(^ : total)
    {
        const int t = fa_thread_num(), nt = fa_num_threads();
        const int64_t lo = nv * t / nt / 4 * 4, hi = t == nt - 1 ? nv : nv * (t + 1) / nt / 4 * 4;
        u2 a = {0, 0}, b = a, c = a, d = a;
        for (int64_t i = lo; i < hi; i += 4) {
            a ^= p[i];
            b ^= p[i + 1];
            c ^= p[i + 2];
            d ^= p[i + 3];
        }
        a ^= b ^ c ^ d;
        total ^= a[0] ^ a[1];
    }
    return total;
}
