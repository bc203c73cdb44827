/*
 * The online softmax step, written once for every kernel (included by
 * kernel_body.h).  Each query row keeps a running max m of the scores seen so
 * far, a running sum l = sum_j exp(s_j - shift(m)) and an accumulator
 * A = sum_j exp(s_j - shift(m)) v_j.  A block of new scores with max bm:
 *
 *   m'    = max(m, bm)
 *   shift = m', or 0 where m' is -inf: a row that has seen only -inf (every
 *           key hidden so far) gets weights exp(-inf - 0) = 0, never NaN
 *   alpha = exp(m - shift), which rescales l and A (alpha = 1: no change)
 *   p_j   = exp(s_j - shift);   l' = l alpha + sum_j p_j;   A' = A alpha + P.V
 *
 * The rules for non-finite scores: a NaN score makes its p, and so l, the
 * row's output and its lse, NaN; -inf (a hidden key) weighs exactly 0.  The
 * vector step across query rows (the tiled kernel) may take a max that drops
 * NaN (vmax), as the NaN reaches l through p anyway; the scalar steps (the row
 * kernels, the merges) carry NaN in m itself (max_nan), since their m feeds
 * the merge of split partials, and so does group_chunks' vector step across
 * items (vnanmax).
 */

/* The max of a and b, NaN when either is NaN. */
INLINE T max_nan(T a, T b) { return (b > a || b != b) ? b : a; }

/* The max of x[0..n), NaN when any is NaN; -inf for n = 0. */
INLINE T row_max_nan(const T *x, int64_t n)
{
    vec vm = vset1(-INFINITY);
    int64_t j = 0;
    for (; j + L <= n; j += L) vm = vnanmax(vm, vload(x + j));
    T mx[L];
    memcpy(mx, &vm, sizeof mx);
    T m = -INFINITY;
    for (int r = 0; r < L; r++) m = max_nan(m, mx[r]);
    for (; j < n; j++) m = max_nan(m, x[j]);
    return m;
}

/* What the scores of a row with running max m are shifted by: m, or 0 where
 * m is -inf (see above). */
INLINE T step_shift(T m) { return m == -INFINITY ? 0 : m; }
INLINE vec vstep_shift(vec m) { return vsel(m == vset1(-INFINITY), vset1(0), m); }

/* exp(x) for one x <= 0 (or NaN) by the kernels' vector exp, so that scalar
 * and vector steps round alike. */
INLINE T exp_neg1(T x)
{
    const vec e = vexp_neg(vset1(x));
    T t[L];
    memcpy(t, &e, sizeof t);
    return t[0];
}

/* The start of a step for one vector of query rows: their old max mo and the
 * block's max bm give the new max, the shift and alpha (vmax: see above). */
typedef struct {
    vec mn, mu, alpha;
} vstep_t;
INLINE vstep_t vstep_begin(vec mo, vec bm)
{
    vstep_t s;
    s.mn = vmax(bm, mo);
    s.mu = vstep_shift(s.mn);
    s.alpha = vexp_neg(mo - s.mu);
    return s;
}

/* x[r * stride + 0..L) *= alpha for r < n: one query vector of Ot or St */
INLINE void scale_rows(T *x, int64_t stride, int64_t n, vec alpha)
{
    for (int64_t r = 0; r < n; r++) vstore(x + r * stride, vload(x + r * stride) * alpha);
}

/* ---------------------------------------------------------------------------
 * Compensated running sums, so that a row's float32 error does not grow with
 * its number of keys.  A running total is a pair (s, c): s the rounded sum, c
 * the rounding errors of its additions (Knuth's TwoSum: s + x = t + e exactly,
 * for finite s and x).  The row sum l takes each key tile's fresh sum of p
 * this way.  The output accumulator, d values a row, takes its P . V in two
 * levels, since a TwoSum per tile costs the products' inner loop measurably
 * (docs/tuning.md, FOLD_KEYS): a block accumulator F gathers up to FOLD_KEYS keys (plainly),
 * then acc_flush adds F to the compensated total (S, C) and clears it.  F, S
 * and C lie n apart in that order, and are rescaled together.
 * s alone is what a plain sum of the partials gives, so inf and NaN reach it
 * as before; c is added back at the end only where it is finite (acc_fold):
 * an inf in s makes c NaN (inf - inf), and s is then the answer.
 * FOLD_KEYS (1024): a block short enough that its own rounding (a few per key
 * tile against at most FOLD_KEYS keys' sum) stays far below the target, long
 * enough that the flush is rare.
 * ------------------------------------------------------------------------- */
#define FOLD_KEYS 1024
INLINE vec vtwo_sum(vec s, vec x, vec *e)
{
    const vec t = s + x, z = t - s;
    *e = (s - (t - z)) + (x - z);
    return t;
}

/* (s, c) += x for one vector: s[0..L), c[0..L) */
INLINE void vacc_add(T *s, T *c, vec x)
{
    vec e;
    vstore(s, vtwo_sum(vload(s), x, &e));
    vstore(c, vload(c) + e);
}

/* (s, c) += x for one element */
INLINE void acc_add(T *s, T *c, T x)
{
    const T t = *s + x, z = t - *s;
    *c += (*s - (t - z)) + (x - z);
    *s = t;
}

/* s + c, c counted only where finite (see above) */
INLINE vec vacc_fold(vec s, vec c) { return s + vsel(c - c == vset1(0), c, vset1(0)); }
INLINE T acc_fold(T s, T c) { return c - c == 0 ? s + c : s; }

/* (S, C) += F, F <- 0, for n elements: F[0..n), S = F + n, C = F + 2 n.
 * first: S and C are not yet set, and become (F, 0). */
INLINE void acc_flush(T *F, int64_t n, int first)
{
    T *S = F + n, *C = F + 2 * n;
    if (first) {
        memcpy(S, F, (size_t)n * sizeof(T));
        memset(F, 0, (size_t)n * sizeof(T));
        memset(C, 0, (size_t)n * sizeof(T));
        return;
    }
    int64_t i = 0;
    for (; i + L <= n; i += L) {
        vacc_add(S + i, C + i, vload(F + i));
        vstore(F + i, vset1(0));
    }
    for (; i < n; i++) {
        acc_add(S + i, C + i, F[i]);
        F[i] = 0;
    }
}

/* The end of a two-level sum: F[0..n) <- the total, S + C (acc_fold) after a
 * last flush; nothing to do when S and C were never set (first). */
INLINE void acc_result(T *F, int64_t n, int first)
{
    if (first) return;
    acc_flush(F, n, 0);
    const T *S = F + n, *C = F + 2 * n;
    int64_t i = 0;
    for (; i + L <= n; i += L) vstore(F + i, vacc_fold(vload(S + i), vload(C + i)));
    for (; i < n; i++) F[i] = acc_fold(S[i], C[i]);
}

/* (l, lc) for n rows, lc = l + n: l <- l + lc (acc_fold) */
INLINE void sum_result(T *l, int64_t n)
{
    for (int64_t i = 0; i < n; i++) l[i] = acc_fold(l[i], l[n + i]);
}
