/*
 * One-pass scans of an array, split across the threads: a float mask's zeros
 * (fa_mask_keep), the largest magnitude (fa_abs_max), both in one team for
 * the float-mask-as-bool check (fa_mask_as_bool), and the benchmark's
 * streaming read (fa_stream_read).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "runtime.h"
#ifdef __SSE2__
#include <emmintrin.h> /* ABS_MAX_SSE2 */
#endif

/* ---------------------------------------------------------------------------
 * A float mask as the bool mask it acts as (see _mask_as_bool in
 * fastattn/_float_mask.py): keep[i] = (x[i] == 0), and whether every x[i] is 0
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
static int64_t keep_rows_per_unit(int64_t len) { return len >= KEEP_CHUNK ? 1 : KEEP_CHUNK / (len > 0 ? len : 1); }

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
 * The first loop alone where floor is -inf, as GCC vectorises it (the row's
 * checks inside it cost half as much again: docs/tuning.md, keep_row_f32). */
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
 * keep_row_f32 for double (docs/tuning.md, keep_row_f32). */
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

/* The pass of fa_mask_keep over the plan's rows, shared by the threads of the
 * team that calls it (a worksharing loop; p->ok ends as the AND of every row's). */
static void keep_rows(keep_plan *p)
{
    const int64_t units = (p->rows + p->rows_per_unit - 1) / p->rows_per_unit;
    int ok = 1;
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
#pragma omp barrier
}

static void mask_keep_team(void *arg)
{
    fa_record_team();
    keep_rows(arg);
}

int fa_mask_keep(int dtype, const void *x, int64_t rows, int64_t len, double floor, uint8_t *keep,
                 double pad_floor, uint8_t *pad, int num_threads, int *all_ok)
{
    fa_team_none();
    if ((dtype != FA_F32 && dtype != FA_F64) || rows < 0 || len < 0 || !(floor <= 0) || !(pad_floor <= 0))
        return FA_EINVAL;
    keep_plan plan = {.x = x, .keep = keep, .pad = pad, .rows = rows, .len = len, .floor = floor,
                      .pad_floor = pad_floor, .dtype = dtype, .ok = 1, .rows_per_unit = keep_rows_per_unit(len)};
    const int64_t n = rows * len, units = (rows + plan.rows_per_unit - 1) / plan.rows_per_unit;
    fa_run_parallel(mask_keep_team, &plan, fa_team_size(num_threads, units, 2.0 * (double)n));
    *all_ok = plan.ok;
    return FA_OK;
}

/* ---------------------------------------------------------------------------
 * max |x[i]| of a contiguous float32 or float64 x of n entries (0 when n is 0;
 * NaN when some x[i] is NaN), in one pass split across the threads
 * (num_threads <= 0: the OpenMP default): the bound on the scores that the
 * float mask conversion needs (_abs_max in fastattn/_float_mask.py), where NumPy's
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

/* The largest |x| over p's array, shared by the threads of the team that calls
 * it (a worksharing loop; p->max and p->nan merged from each thread's). */
static void abs_max_pass(abs_max_plan *p)
{
    const int64_t units = (p->n + ABS_MAX_CHUNK - 1) / ABS_MAX_CHUNK;
    double m = 0;
    int nan = 0;
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
#pragma omp barrier
}

static void abs_max_team(void *arg)
{
    fa_record_team();
    abs_max_pass(arg);
}

int fa_abs_max(int dtype, const void *x, int64_t n, int num_threads, double *out)
{
    fa_team_none();
    if ((dtype != FA_F32 && dtype != FA_F64) || n < 0) return FA_EINVAL;
    abs_max_plan plan = {.x = x, .n = n, .max = 0, .dtype = dtype, .nan = 0};
    const int64_t units = (n + ABS_MAX_CHUNK - 1) / ABS_MAX_CHUNK;
    fa_run_parallel(abs_max_team, &plan, fa_team_size(num_threads, units, 0.5 * (double)n));
    *out = plan.nan ? NAN : plan.max;
    return FA_OK;
}

/* ---------------------------------------------------------------------------
 * The float-mask-as-bool check of one attention call (_mask_as_bool in
 * fastattn/_float_mask.py), in one team where it took up to four: the largest
 * |q| and |k|, the bound on |score| they give, then the mask pass of
 * fa_mask_keep with the floor that acts as a False: -inf first (try_neginf),
 * then, where that pass fails and finite floors are allowed (allow_finite: no
 * causal, window or lengths, which could hide a row's 0s), with v finite,
 * floor = -(2 bound + margin) and padding rows of one constant at most
 * min(floor, -pad_absorb bound).  Returns in *mode 0 (the mask stays float),
 * 1 (0 and -inf only: keep holds the bool mask) or 2 (finite floor: keep and
 * pad hold it).
 *   q (nq_el), k (nk_el), v (nv_el)  contiguous, dtype
 *   x (rows, len) the mask, contiguous, mask_dtype; keep (rows, len); pad (rows)
 * |score| <= bound = dk_scale max|q| max|k|, which must be at most half the
 * dtype's largest number (no score can then be NaN or +inf); ALiBi adds at
 * most slope_term to it for the finite floor.
 * ------------------------------------------------------------------------- */
typedef struct {
    abs_max_plan q, k, v;
    keep_plan keep;
    uint8_t *pad;
    double dk_scale, slope_term, margin, pad_absorb, limit;
    double bound; /* dk_scale max|q| max|k| */
    int try_neginf, allow_finite;
    int go, mode; /* shared between the passes */
} bool_plan;

static void mask_as_bool_team(void *arg)
{
    bool_plan *p = arg;
    fa_record_team();
    abs_max_pass(&p->q);
    abs_max_pass(&p->k);
#pragma omp single
    {
        p->bound = p->dk_scale * p->q.max * p->k.max;
        p->go = !p->q.nan && !p->k.nan && p->bound <= p->limit; /* (false for a NaN bound) */
        p->keep.floor = p->keep.pad_floor = -INFINITY;
        p->keep.pad = NULL;
        p->keep.ok = 1;
    }
    if (!p->go) return;
    if (p->try_neginf) {
        keep_rows(&p->keep);
        if (p->keep.ok) {
#pragma omp single
            p->mode = 1;
            return;
        }
    }
    if (!p->allow_finite) return;
    abs_max_pass(&p->v);
#pragma omp single
    {
        const double bound = p->bound + p->slope_term; /* ALiBi moves a score by at most slope_term */
        p->go = !p->v.nan && p->v.max <= DBL_MAX && bound < INFINITY;
        p->keep.floor = -(2.0 * bound + p->margin);
        p->keep.pad_floor = fmin(p->keep.floor, -p->pad_absorb * bound);
        p->keep.pad = p->pad;
        p->keep.ok = 1;
    }
    if (!p->go) return;
    keep_rows(&p->keep);
#pragma omp single
    p->mode = p->keep.ok ? 2 : 0;
}

int fa_mask_as_bool(int dtype, const void *q, int64_t nq_el, const void *k, int64_t nk_el, const void *v,
                    int64_t nv_el, double dk_scale, double slope_term, int try_neginf, int allow_finite,
                    double margin, double pad_absorb, int mask_dtype, const void *x, int64_t rows, int64_t len,
                    uint8_t *keep, uint8_t *pad, int num_threads, int *mode)
{
    fa_team_none();
    if ((dtype != FA_F32 && dtype != FA_F64) || (mask_dtype != FA_F32 && mask_dtype != FA_F64) || rows < 0 ||
        len < 0 || nq_el < 0 || nk_el < 0 || nv_el < 0)
        return FA_EINVAL;
    bool_plan plan = {.q = {.x = q, .n = nq_el, .dtype = dtype}, .k = {.x = k, .n = nk_el, .dtype = dtype},
                      .v = {.x = v, .n = nv_el, .dtype = dtype},
                      .keep = {.x = x, .keep = keep, .rows = rows, .len = len, .dtype = mask_dtype,
                               .rows_per_unit = keep_rows_per_unit(len)},
                      .pad = pad, .dk_scale = dk_scale, .slope_term = slope_term, .margin = margin,
                      .pad_absorb = pad_absorb, .limit = 0.5 * (dtype == FA_F32 ? FLT_MAX : DBL_MAX),
                      .try_neginf = try_neginf, .allow_finite = allow_finite, .go = 0, .mode = 0};
    const double n = (double)(nq_el + nk_el + nv_el) + 2.0 * (double)(rows * len);
    const int64_t units = (rows + plan.keep.rows_per_unit - 1) / plan.keep.rows_per_unit;
    fa_run_parallel(mask_as_bool_team, &plan, fa_team_size(num_threads, units, n));
    *mode = plan.mode;
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
    fa_team_none();
    typedef uint64_t u2 __attribute__((vector_size(16)));
    const u2 *p = x;
    const int64_t nv = n / 16;
    const int nthreads = fa_threads_wanted(num_threads);
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

