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
 * the merge of split partials.
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
