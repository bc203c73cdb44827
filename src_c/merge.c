/*
 * fastattn.merge_attention's kernel: attention results over disjoint key sets
 * combined into the result over their union by the logsumexp rule, row by
 * row, parallel over rows.
 *   outs[p]  (rows, d) float32 or float64 (dtype), contiguous, for p < n_parts
 *   lses[p]  (rows)    the same dtype, contiguous
 *   out      (rows, d) the same dtype, contiguous; may not alias an input
 *   lse      (rows)    the same dtype
 * For each row, with m = max_p lse[p] (NaN if any is NaN) and M = m, or 0
 * where m = -inf:  w[p] = exp(lse[p] - M),  s = sum_p w[p],
 *   out = sum_p w[p] out[p] / s  (0 where s = 0: no part saw a key),
 *   lse = M + log(s).
 * A part with lse = -inf adds nothing, even where it holds NaN; one whose
 * weight underflowed to 0 (or is NaN) adds only its inf and NaN, as the
 * attention kernels' own split merge does.  The sums run in float64,
 * compensated (TwoSum), so that merging many parts costs no accuracy; this is
 * the rule fastattn/_merge.py documents, in one pass over the parts.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "internal.h"
#include "runtime.h"

typedef struct {
    const void *const *outs, *const *lses;
    void *out, *lse;
    int64_t rows, d;
    int n_parts, dtype, status;
} merge_plan;

/* (s, c) += x by TwoSum: s + c holds the sum with the rounding errors kept. */
static inline void two_sum_add(double *s, double *c, double x)
{
    const double t = *s + x, z = t - *s;
    *c += (*s - (t - z)) + (x - z);
    *s = t;
}

static inline double part_at(const merge_plan *p, const void *x, int64_t i)
{
    return p->dtype == FA_F32 ? (double)((const float *)x)[i] : ((const double *)x)[i];
}

/* One row r; acc and cmp are the thread's d doubles each. */
static void merge_row(const merge_plan *p, int64_t r, double *acc, double *cmp)
{
    const int64_t d = p->d;
    double m = -INFINITY;
    for (int q = 0; q < p->n_parts; q++) {
        const double l = part_at(p, p->lses[q], r);
        if (isnan(l) || l > m) m = isnan(m) ? m : l;            /* NaN wins */
    }
    const double M = isinf(m) && m < 0 ? 0.0 : m;
    double s = 0, sc = 0;
    for (int64_t j = 0; j < d; j++) acc[j] = cmp[j] = 0;
    for (int q = 0; q < p->n_parts; q++) {
        const double l = part_at(p, p->lses[q], r), w = exp(l - M);
        two_sum_add(&s, &sc, w);
        if (isinf(l) && l < 0) continue;                     /* saw no key */
        /* w x; where w underflowed to 0 (or is NaN), only the part's inf and NaN */
        for (int64_t j = 0; j < d; j++) {
            const double x = part_at(p, p->outs[q], r * d + j);
            two_sum_add(&acc[j], &cmp[j], w > 0 ? w * x : isfinite(x) ? 0.0 : x);
        }
    }
    s += isfinite(sc) ? sc : 0;
    for (int64_t j = 0; j < d; j++) {
        const double x = s == 0 ? 0.0 : (acc[j] + (isfinite(cmp[j]) ? cmp[j] : 0)) / s;
        if (p->dtype == FA_F32)
            ((float *)p->out)[r * d + j] = (float)x;
        else
            ((double *)p->out)[r * d + j] = x;
    }
    if (p->dtype == FA_F32)
        ((float *)p->lse)[r] = (float)(M + log(s));
    else
        ((double *)p->lse)[r] = M + log(s);
}

static void merge_team(void *arg)
{
    merge_plan *p = arg;
    void *raw;
    double *acc = fa_team_scratch((size_t)(2 * p->d + 1) * sizeof(double), &raw, &p->status); /* + 1: d = 0 */
#pragma omp for schedule(static)
    for (int64_t r = 0; r < p->rows; r++)
        if (acc) merge_row(p, r, acc, acc + p->d);
    free(raw);
}

int fa_merge(int dtype, int n_parts, const void *const *outs, const void *const *lses, int64_t rows, int64_t d,
             void *out, void *lse, int num_threads)
{
    fa_team_none();
    if ((dtype != FA_F32 && dtype != FA_F64) || n_parts < 1 || rows < 0 || d < 0) return FA_EINVAL;
    if (rows == 0) return FA_OK;
    merge_plan plan = {.outs = outs, .lses = lses, .out = out, .lse = lse, .rows = rows, .d = d,
                       .n_parts = n_parts, .dtype = dtype, .status = FA_OK};
    fa_run_parallel(merge_team, &plan,
                    fa_team_size(num_threads, rows, 4.0 * (double)rows * (double)(d + 1) * n_parts));
    return plan.status;
}
