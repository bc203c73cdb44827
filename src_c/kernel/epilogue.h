/*
 * The epilogue of every attention kernel (included by kernel_body.h): the
 * write-out of a finished item (out = acc / l, lse = m + log l, or the
 * partial (acc / l, m, l) of a key split), the merge of split partials, and
 * the careful redo of rows that came out non-finite (the row kernel in its
 * careful mode: item_rows in rows.h).
 */

/* dst (nr, nc) row stride ds <- src element (i, c) at src[c * ss + i], times
 * 1 / l[i] (0 where l[i] == 0) when l is given: a transposed accumulator turned
 * back, in L x L blocks in registers.  ss is a whole number of vectors >= nr,
 * and l is read in whole vectors too (the tiled kernel's, ld long).  Each
 * loaded vector (rows i0.. of one column) is scaled by the rows' factors, one
 * vector division for L rows, before the transpose: the same products as after
 * it, without a factor broadcast a row (nor a vector loaded from L scalar
 * stores, which stalled on the forwarding). */
static void untranspose_rows(T *dst, int64_t ds, const T *src, int64_t ss, int64_t nr, int64_t nc,
                             const T *l)
{
    for (int64_t i0 = 0; i0 < nr; i0 += L) {
        const int64_t n = nr - i0 < L ? nr - i0 : L;
        const vec one = vset1(1), lv = l ? vload(l + i0) : one;
        const vec fv = l ? vsel(lv == vset1(0), vset1(0), one / lv) : one;
        int64_t c0 = 0;
        for (; c0 + L <= nc; c0 += L) {
            vec r[L];
            const T *s = src + c0 * ss + i0;
            UNROLL(16) for (int x = 0; x < L; x++, s += ss) r[x] = vload(s) * fv;
            transpose_block(r);
            T *d = dst + i0 * ds + c0;
            if (n == L) {
                UNROLL(16) for (int x = 0; x < L; x++, d += ds) vstore(d, r[x]);
            } else {
                for (int64_t x = 0; x < n; x++, d += ds) vstore(d, r[x]);
            }
        }
        for (int64_t x = 0; x < n; x++)
            for (int64_t c = c0; c < nc; c++) dst[(i0 + x) * ds + c] = src[c * ss + i0 + x] * fv[x];
    }
}

/* Write one item's rows from the accumulator, running max and sum:
 * out = acc / l (zeros when l == 0), lse = m + log(l) (-inf when l == 0);
 * or, with it->part, (acc / l, m, l) for a split-key merge.  With normalised,
 * acc already holds acc / l (the careful row kernel and the merge), and is
 * written as it is.
 *   acc  (bq, dv) element (i, c) at acc[i * ai + c * ac]; either rows of dv
 *        (ac == 1) or transposed (ai == 1, ac a whole number of vectors >= bq)
 *   m, l (bq); transposed, l is read up to bq rounded up to whole vectors
 *        (untranspose_rows) */
static void write_rows(const fa_attention_args *a, const fa_item *it, const T *acc, int64_t ai,
                       int64_t ac, const T *m, const T *l, int normalised)
{
    const int64_t bq = it->bq, dv = a->dv;
    T *out = it->part ? it->part : it->out;
    const int64_t os = it->part ? dv + 2 : a->o_rs;
    if (ac != 1) { /* transposed */
        untranspose_rows(out, os, acc, ac, bq, dv, normalised ? NULL : l);
    } else {
        for (int64_t i = 0; i < bq; i++) {
            const T inv = normalised ? 1 : (l[i] == 0) ? 0 : 1 / l[i];
            T *orow = out + i * os;
            for (int64_t c = 0; c < dv; c++) orow[c] = acc[i * ai + c] * inv;
        }
    }
    if (it->part) {
        for (int64_t i = 0; i < bq; i++) {
            out[i * os + dv] = m[i];
            out[i * os + dv + 1] = l[i];
        }
        return;
    }
    if (it->lse) {
        T *lse = it->lse;
        for (int64_t i = 0; i < bq; i++) lse[i * a->lse_rs] = (l[i] == 0) ? -INFINITY : m[i] + log(l[i]);
    }
}

/* Merge the split-key partial results of one item (flash-decoding):
 *   parts  (nparts, bq, dv + 2): acc / l, running max m, running sum l per row
 * M = max_p m_p;  w_p = exp(m_p - M) l_p;  l = sum_p w_p;
 * out = sum_p (w_p / l) (acc / l)_p: a weighted mean of the parts' means, so it
 * cannot overflow where the output itself does not.  Parts that saw no key
 * (l_p == 0) add nothing; a part whose exp(m_p - M) underflows to 0 adds only
 * its inf and NaN (see rows_pv_careful); NaN propagates.  l and out are
 * compensated sums (acc_add), so many splits cost no accuracy.
 * Scratch: 2 dv elements. */
void FN(fa_attn_merge)(const fa_attention_args *a, const fa_item *it, const void *parts_,
                       int64_t nparts, void *scratch)
{
    const T *parts = parts_;
    const int64_t bq = it->bq, dv = a->dv, ps = bq * (dv + 2);
    T *acc = scratch, *accc = acc + dv; /* out and its compensation */
    fa_item row = *it;
    for (int64_t i = 0; i < bq; i++) {
        T M = -INFINITY;
        for (int64_t p = 0; p < nparts; p++) {
            const T mp = parts[p * ps + i * (dv + 2) + dv];
            const T lp = parts[p * ps + i * (dv + 2) + dv + 1];
            if (lp != 0 || lp != lp) M = max_nan(M, mp);
        }
        T lsum = 0, lc = 0;
        for (int64_t p = 0; p < nparts; p++) {
            const T *pr = parts + p * ps + i * (dv + 2);
            if (pr[dv + 1] != 0) acc_add(&lsum, &lc, (T)exp(pr[dv] - M) * pr[dv + 1]);
        }
        lsum = acc_fold(lsum, lc);
        for (int64_t c = 0; c < dv; c++) acc[c] = accc[c] = 0;
        for (int64_t p = 0; p < nparts; p++) {
            const T *pr = parts + p * ps + i * (dv + 2);
            if (pr[dv + 1] == 0) continue;
            const T e = (T)exp(pr[dv] - M);
            if (e == 0) { /* underflowed: only its inf and NaN count (see rows_pv_careful) */
                for (int64_t c = 0; c < dv; c++)
                    if (!isfinite(pr[c])) acc[c] += pr[c];
                continue;
            }
            const T w = e * pr[dv + 1] / lsum;
            for (int64_t c = 0; c < dv; c++) acc_add(acc + c, accc + c, w * pr[c]);
        }
        for (int64_t c = 0; c < dv; c++) acc[c] = acc_fold(acc[c], accc[c]);
        row.bq = 1;
        row.out = it->out ? (T *)it->out + i * a->o_rs : NULL;
        row.lse = it->lse ? (T *)it->lse + i * a->lse_rs : NULL;
        row.part = NULL;
        write_rows(a, &row, acc, 0, 1, &M, &lsum, 1);
    }
}

static void item_rows(const fa_attention_args *a, const fa_tiles *tl, const fa_item *it, void *scratch,
                      int careful); /* rows.h */

/* ---------------------------------------------------------------------------
 * Zero weights against inf and NaN.  A key that a row does not see (mask,
 * causal, window) has weight exactly 0 there, but when its tile is visited for
 * the item's other rows, P . V adds 0 * inf or 0 * NaN = NaN to the row.
 * Rather than test every product in the hot loops, each row whose result (or
 * split-key partial accumulator) came out non-finite is recomputed by the row
 * kernel in its careful mode.  Only non-finite inputs or an overflow make a
 * row non-finite, so the common cost is one check of each written value.
 * A row that does see a non-finite value comes out the same again.
 * Scratch: the row kernel's for one row (fa_rows_scratch_elems, bq = 1).
 * ------------------------------------------------------------------------- */
/* Whether nr rows of n (row stride rs) are all finite, with one test at the
 * end (x - x: 0, or NaN for inf and NaN): an item whose rows all are, the common
 * case, pays one test, not one a row. */
INLINE int all_finite(const T *r, int64_t rs, int64_t nr, int64_t n)
{
    vec z0 = vset1(0), z1 = z0;
    T zs = 0;
    for (int64_t i = 0; i < nr; i++) {
        const T *ri = r + i * rs;
        int64_t c = 0;
        for (; c + 2 * L <= n; c += 2 * L) {
            z0 += vload(ri + c) - vload(ri + c);
            z1 += vload(ri + c + L) - vload(ri + c + L);
        }
        for (; c + L <= n; c += L) z0 += vload(ri + c) - vload(ri + c);
        for (; c < n; c++) zs += ri[c] - ri[c];
    }
    return zs == 0 && vall(z0 + z1 == vset1(0));
}

static void redo_nonfinite_rows(const fa_attention_args *a, const fa_tiles *tl, const fa_item *it,
                                void *scratch)
{
    const int64_t dv = a->dv;
    const size_t msz = a->mask_kind == FA_MASK_BOOL ? 1 : sizeof(T);
    const T *rows = it->part ? (const T *)it->part : (const T *)it->out;
    const int64_t rs = it->part ? dv + 2 : a->o_rs;
    if (all_finite(rows, rs, it->bq, dv)) return;
    for (int64_t i = 0; i < it->bq; i++) {
        if (all_finite(rows + i * rs, rs, 1, dv)) continue;
        if (a->stats) __atomic_fetch_add(&a->stats->redo_rows, 1, __ATOMIC_RELAXED);
        fa_item row = *it;
        row.bq = 1;
        row.i0 = it->i0 + i;
        row.q = (const char *)it->q + i * a->q_rs * fa_q_esz(a);
        row.mask = it->mask ? (const char *)it->mask + i * a->m_rs * (int64_t)msz : NULL;
        row.mbits = it->mbits ? it->mbits + i * it->mb_rs : NULL; /* (the row kernel reads the bytes) */
        row.out = (T *)it->out + i * a->o_rs;
        row.lse = it->lse ? (T *)it->lse + i * a->lse_rs : NULL;
        row.part = it->part ? (T *)it->part + i * (dv + 2) : NULL;
        const fa_tiles t1 = {.bq = 1, .bk = tl->bk, .bqp = 1, .ld = 1, .fuse = 0};
        item_rows(a, &t1, &row, scratch, 1);
    }
}
