/*
 * The backward kernel (included by kernel_body.h): the gradients of
 * sum(dO * out) with respect to q, k and v, FlashAttention-2's algorithm.
 * With P = exp(S - lse - lo) recomputed tile by tile from the forward's lse
 * (lo: 0, but for rows whose lse is too large for that to be exact,
 * fa_bwd_lse_lo) and D_i = sum_c dO[i][c] out[i][c] (those rows: sum_j P dP):
 *   dV += P^T . dO      dP = dO . V^T      dS = P * (dP - D)
 *   dK += dS^T . Q * scale                 dQ += dS . K * scale
 * A work unit is one key block of one leading index: it walks every query
 * block that sees its keys, keeps that key block's dK and dV in scratch and
 * adds to the thread's dQ rows (backward.c sums the threads' dQ in a fixed
 * order, so results are bitwise the same from run to run).  The scores come
 * from tile_scores (tiled.h), so every mask, band, ALiBi and length the
 * forward takes is taken here the same way; through a softcap s = c tanh(x / c)
 * dS is multiplied by ds/dx = 1 - tanh(x / c)^2, x recomputed (one more
 * product, only then).
 * Every product is tile_products (tiled.h) on operands laid out for it:
 *   Qt  (dk, ld)   the query block, times scale, transposed (pack_queries)
 *   dOt (dv, ld)   dO of the block, transposed
 *   Qp  (bq, dkp)  the query block, times scale, rows zero-padded to dkp
 *   dOp (bq, dvp)  dO of the block, rows zero-padded to dvp
 *   Kp  (nb, dkp)  the unit's keys, rows zero-padded
 *   St  (bk, ld)   scores, then P, then dS, transposed (key j, query i at
 *                  St[j * ld + i]);  dPt (bk, ld) likewise
 *   dKb (bk, dkp), dVb (bk, dvp)  the unit's gradients so far
 *   Dl  (3 ld)     D of the block's rows (from D, below), their lse (+inf
 *                  past bq, so that padding lanes get P = 0), then their lo (0
 *                  past bq); fa_bwd_lse_lo's sums of p and p dP in its first and last ld
 *   W   (ceil(bk / 32), ld)  a bool mask tile as bits (tile_scores)
 *   Kw  (nb, dk), Vw (nb, dv)  16-bit K and V (FA_KV): the unit's rows widened
 *                  once, read by every query block in place of K and V
 *   qw  (bq, dk)   16-bit q (a->q_kv): the block's rows widened (pack_queries,
 *                  at tl->q_off), which Qp is packed from
 *   dq  (nq, dkp)  the thread's dQ rows of this leading index (/ scale)
 * dkp and dvp are dk and dv rounded up to whole vectors.
 * ------------------------------------------------------------------------- */

/* acc[r][0..NV L) += sum_x a[r * ars + x * acs] b[x * bs + 0..NV L) for r < R:
 * one R x NV register tile of tile_products, loaded from acc (row stride accs)
 * and stored back. */
INLINE void acc_tile(const int R, const int NV, T *restrict acc, int64_t accs, const T *restrict a, int64_t ars,
                     int64_t acs, const T *restrict b, int64_t bs, int64_t n)
{
    vec a0[RB], a1[RB];
    UNROLL(16) for (int r = 0; r < R; r++)
    {
        a0[r] = vload(acc + r * accs);
        a1[r] = NV == 2 ? vload(acc + r * accs + L) : a0[r];
    }
    tile_products(R, NV, a0, a1, a, ars, acs, b, bs, n);
    UNROLL(16) for (int r = 0; r < R; r++)
    {
        vstore(acc + r * accs, a0[r]);
        if (NV == 2) vstore(acc + r * accs + L, a1[r]);
    }
}

/* The tiles of acc_tile over R rows from r0 and all nc columns (a whole number
 * of vectors): two vectors at a time, then one. */
INLINE void acc_row_tiles(const int R, T *restrict acc, int64_t accs, int64_t nc, const T *restrict a, int64_t ars,
                          int64_t acs, const T *restrict b, int64_t bs, int64_t n)
{
    int64_t c0 = 0;
    for (; c0 + 2 * L <= nc; c0 += 2 * L) acc_tile(R, 2, acc + c0, accs, a, ars, acs, b + c0, bs, n);
    if (c0 < nc) acc_tile(R, 1, acc + c0, accs, a, ars, acs, b + c0, bs, n);
}

/* acc (nr, nc) row stride accs += the products of tile_products over n:
 * acc[r][c] += sum_x a[r * ars + x * acs] b[x * bs + c], for r < nr and c < nc,
 * nc a whole number of vectors; b's rows hold nc elements.  Rows RB at a time,
 * then 4, then 1 (rb_tiles_end's reason: a single row has too few accumulators). */
static void acc_products(T *restrict acc, int64_t accs, int64_t nr, int64_t nc, const T *restrict a, int64_t ars,
                         int64_t acs, const T *restrict b, int64_t bs, int64_t n)
{
    int64_t r0 = 0;
    for (; r0 + RB <= nr; r0 += RB) acc_row_tiles(RB, acc + r0 * accs, accs, nc, a + r0 * ars, ars, acs, b, bs, n);
    for (; r0 + 4 <= nr; r0 += 4) acc_row_tiles(4, acc + r0 * accs, accs, nc, a + r0 * ars, ars, acs, b, bs, n);
    for (; r0 < nr; r0++) acc_row_tiles(1, acc + r0 * accs, accs, nc, a + r0 * ars, ars, acs, b, bs, n);
}

/* Xt (d, ld) <- x (n, d) row stride xs, transposed, zero past n up to np
 * (a whole number of vectors), unless Xt is NULL; Xp (n, dp) <- x times f,
 * rows zero-padded. */
static void pack_both(const T *x, int64_t xs, int64_t n, int64_t np, int64_t d, int64_t dp, T f, T *Xt,
                      int64_t ld, T *Xp)
{
    for (int64_t c = 0; Xt && c < d; c++) {
        for (int64_t i = 0; i < n; i++) Xt[c * ld + i] = x[i * xs + c];
        for (int64_t i = n; i < np; i++) Xt[c * ld + i] = 0;
    }
    if (!Xp) return;
    for (int64_t i = 0; i < n; i++) {
        for (int64_t c = 0; c < d; c++) Xp[i * dp + c] = x[i * xs + c] * f;
        for (int64_t c = d; c < dp; c++) Xp[i * dp + c] = 0;
    }
}

/* The weight of a score s in a row of log-sum-exp lse, from x = s - lse (and
 * less lo, fa_bwd_lse_lo): a row that sees no key (lse -inf) has none, P = 0;
 * x <= 0 but for rounding, so vexp_neg on x capped at 0 (NaN stays NaN). */
INLINE vec bwd_weight(vec x, vec lse)
{
    return vsel(lse == vset1(-INFINITY), vset1(0), vexp_neg(vsel(x > 0, vset1(0), x)));
}

/* The K and V rows [j0, j0 + n) of the item's leading index as the products
 * read them, row strides *krs and *vrs: in place, or (16-bit K and V) widened
 * into Kw (n, dk) and Vw (n, dv). */
INLINE void bwd_kv_rows(const fa_attention_args *a, const fa_item *it, int64_t j0, int64_t n, T *Kw, T *Vw,
                        const T **K, const T **V, int64_t *krs, int64_t *vrs)
{
#if FA_KV
    for (int64_t j = 0; j < n; j++) {
        widen_row(Kw + j * a->dk, (const KT *)it->k + (j0 + j) * a->k_rs, a->dk);
        widen_row(Vw + j * a->dv, (const KT *)it->v + (j0 + j) * a->v_rs, a->dv);
    }
    *K = Kw, *V = Vw, *krs = a->dk, *vrs = a->dv;
#else
    (void)Kw, (void)Vw, (void)n;
    *K = (const T *)it->k + j0 * a->k_rs, *V = (const T *)it->v + j0 * a->v_rs;
    *krs = a->k_rs, *vrs = a->v_rs;
#endif
}

/* Whether a row's lse is too large for P = exp(s - lse) to be exact enough:
 * s and lse are rounded at their magnitude (half an ulp: 2^-19 at 32 in
 * float32, 2^-45 at 256 in float64, and more above), and the forward's scores
 * round in another order than the unit's; a large |q| then amplifies in dK
 * what the weights lose (fa_bwd_lse_lo).  Where one large finite constant
 * (finfo.min) hides all of a row's keys, lse rounds to that constant and the
 * weights' sum (n_k) is lost altogether. */
INLINE int lse_lossy(T lse)
{
    const T bound = sizeof(T) == 4 ? (T)0x1p5 : (T)0x1p8;
    return (lse >= bound || lse <= -bound) && lse - lse == 0;
}

/* For the item's rows whose lse_lossy(lse), over every key the row sees (all nk
 * of its leading index, blocks of tl->bk; s and dP as the unit computes them,
 * p = exp(s - lse)):
 *   lo (bq)  written: log(sum_j p_j) (0 for the other rows, and where that sum
 *            is not positive), so that the unit's P = exp(s - lse - lo) sums
 *            to 1 over the row again (but for rounding: p caps s - lse at 0,
 *            the unit s - lse - lo);
 *   D  (bq)  replaced for those rows by sum_j p_j dP_j / sum_j p_j, D from the
 *            unit's own P: their scores are large, the weights peaked, and
 *            dP - D cancels, so a D from the forward's output (whose scores
 *            round otherwise) would leave an error that |q| amplifies in dK.
 *   dO (bq, dv) row stride dos: the block's rows.
 * Both sums are compensated (vacc_add of each tile's fresh sum, its error in Cs),
 * as the forward's are (docs/accuracy.md): a long flat row would otherwise
 * round once a key against an ever larger total.
 * Scratch as fa_bwd_unit's (Qt, dOt, St, dPt, Dl and W; 16-bit K and V: Kw, Vw),
 * and Cs (2 ld) where the unit keeps Qp (bq (dkp + dvp) >= 2 ld). */
void FN(fa_bwd_lse_lo)(const fa_attention_args *a, const fa_tiles *tl, const fa_item *it, int64_t nk,
                       const void *dO_, int64_t dos, void *D_, void *lo_, void *scratch)
{
    const T *dO = dO_;
    T *D = D_, *lo = lo_;
    const T *lse = it->lse;
    const int64_t ld = tl->ld, bk = tl->bk, dk = a->dk, dv = a->dv, bq = it->bq, bqp = (bq + L - 1) / L * L;
    const int64_t dkp = (dk + L - 1) / L * L, dvp = (dv + L - 1) / L * L;
    T *Qt = scratch, *dOt = Qt + dk * ld, *St = dOt + dv * ld, *dPt = St + bk * ld, *Dl = dPt + bk * ld;
    T *Cs = Dl + 3 * ld;
    IT *W = (IT *)(Dl + 3 * ld + tl->bq * (dkp + dvp) + bk * (2 * dkp + dvp));
    int any = 0;
    for (int64_t i = 0; i < bq; i++) {
        lo[i] = 0;
        any |= lse_lossy(lse[i * a->lse_rs]);
    }
    if (!any) return;
    const band_t b = item_band(a, it);
    const int64_t jl = b.j_lo > 0 ? b.j_lo : 0, jh = b.j_hi < nk ? b.j_hi : nk;
    pack_queries(a, tl, it, scratch, Qt, ld, bqp);
    pack_both(dO, dos, bq, bqp, dv, dvp, 1, dOt, ld, NULL);
    /* Dl: sum p, then lse, then sum p dP; Cs: the two sums' rounding errors */
    for (int64_t i = 0; i < bqp; i++) {
        Dl[i] = Dl[2 * ld + i] = Cs[i] = Cs[ld + i] = 0;
        Dl[ld + i] = i < bq ? lse[i * a->lse_rs] : (T)INFINITY;
    }
    T qmax = -1, *Kw = (T *)(W + (bk + 31) / 32 * ld), *Vw = Kw + bk * dk; /* (Kw, Vw: 16-bit K and V) */
    key_runs kr;
    for (int64_t j0 = jl; j0 < jh; j0 += bk) {
        const int64_t n = jh - j0 < bk ? jh - j0 : bk;
        const T *K, *V;
        int64_t krs, vrs;
        bwd_kv_rows(a, it, j0, n, Kw, Vw, &K, &V, &krs, &vrs);
        const int bits = tile_scores(a, it, &b, St, Qt, &qmax, W, ld, bqp, j0, n, K, krs, NULL, NULL, NULL, &kr);
        if (bits < 0) continue;
        if (bits) apply_bits(St, W, ld, bqp, n);
        qk_block(dPt, V, vrs, dOt, ld, bqp, dv, n, NULL, NULL, NULL);
        for (int64_t i = 0; i < bqp; i += L) {
            const vec l = vload(Dl + ld + i);
            vec sp = vset1(0), spd = vset1(0);
            for (int64_t j = 0; j < n; j++) { /* as fa_bwd_unit's P, before lo; p dP 0 where p is */
                const vec p = bwd_weight(vload(St + j * ld + i) - l, l);
                sp += p;
                spd += vsel(p == vset1(0), vset1(0), p * vload(dPt + j * ld + i));
            }
            vacc_add(Dl + i, Cs + i, sp);
            vacc_add(Dl + 2 * ld + i, Cs + ld + i, spd);
        }
    }
    for (int64_t i = 0; i < bq; i++) {
        const T sp = Dl[i] + Cs[i], spd = Dl[2 * ld + i] + Cs[ld + i];
        if (lse_lossy(Dl[ld + i]) && sp > 0) {
            lo[i] = (T)log((double)sp);
            D[i] = spd / sp;
        }
    }
}

/* P (in St) and dS (in dPt) of a tile, n keys (rows) by bqp queries, from its
 * scores (St), dP (dPt) and its rows' D, lse and, with_lo, lo (Dl): P = exp(s -
 * lse - lo), dS = P (dP - D).  (Without lo, one subtraction fewer.) */
INLINE void weights_and_ds(const int with_lo, T *restrict St, T *restrict dPt, const T *restrict Dl, int64_t ld,
                           int64_t n, int64_t bqp)
{
    for (int64_t j = 0; j < n; j++)
        for (int64_t i = 0; i < bqp; i += L) {
            const vec lse = vload(Dl + ld + i), s = vload(St + j * ld + i) - lse;
            /* where P = 0 (a hidden key) dS = 0, even if V's row holds inf or NaN */
            const vec p = bwd_weight(with_lo ? s - vload(Dl + 2 * ld + i) : s, lse);
            vstore(St + j * ld + i, p);
            vstore(dPt + j * ld + i, vsel(p == vset1(0), vset1(0), p * (vload(dPt + j * ld + i) - vload(Dl + i))));
        }
}

/* One work unit: the keys [j0, j0 + nb) of the leading index whose query
 * blocks are its[0..n_qb) (fill_item's items: q, mask and lse offset to
 * their rows), nb <= tl->bk.
 *   dO    (nq, dv) of the leading index, row stride dos
 *   D     (nq) of the leading index: D_i = sum_c dO[i][c] out[i][c] (backward.c,
 *         bwd_rows_d: computed once a leading index, not by every unit)
 *   lo    (nq) of the leading index: fa_bwd_lse_lo's, for P = exp(s - lse - lo)
 *   dk    (nb, dk) and dv (nb, dv), row strides dkrs, dvrs: the unit's rows of
 *         the gradients, written
 *   dq    (nq, dkp): the thread's dQ of the leading index, added to (/ scale) */
void FN(fa_bwd_unit)(const fa_attention_args *a, const fa_tiles *tl, const fa_item *its, int64_t n_qb,
                     const void *dO_, int64_t dos, const void *D_, const void *lo_, int64_t j0, int64_t nb, void *dk_,
                     int64_t dkrs, void *dv_, int64_t dvrs, void *dq_, void *scratch)
{
    const T *dO = dO_, *D = D_, *lo = lo_;
    T *dkout = dk_, *dvout = dv_, *dq = dq_;
    const int64_t ld = tl->ld, bk = tl->bk, dk = a->dk, dv = a->dv;
    const int64_t dkp = (dk + L - 1) / L * L, dvp = (dv + L - 1) / L * L;
    T *Qt = scratch, *dOt = Qt + dk * ld, *St = dOt + dv * ld, *dPt = St + bk * ld, *Dl = dPt + bk * ld;
    T *Qp = Dl + 3 * ld, *dOp = Qp + tl->bq * dkp, *Kp = dOp + tl->bq * dvp, *dKb = Kp + bk * dkp;
    T *dVb = dKb + bk * dkp;
    IT *W = (IT *)(dVb + bk * dvp);
    /* the unit's K and V rows (key j0 first) as the products read them, row strides krs and vrs */
    const T *K, *V;
    int64_t krs, vrs;
    T *Kw = (T *)(W + (bk + 31) / 32 * ld);
    bwd_kv_rows(a, &its[0], j0, nb, Kw, Kw + bk * dk, &K, &V, &krs, &vrs);
#if FA_KV
    if (a->stats) __atomic_fetch_add(&a->stats->kv_widened, nb, __ATOMIC_RELAXED);
#endif
    /* the unit's nb rows only: packed sequences' units are far shorter than bk */
    memset(dKb, 0, (size_t)(nb * dkp) * sizeof(T));
    memset(dVb, 0, (size_t)(nb * dvp) * sizeof(T));
    /* K for dQ += dS . K: inf and NaN as 0, so that a key hidden from a row
     * (dS = 0 there) adds nothing to it even where a padded cache holds NaN
     * (a row that sees such a key has a NaN score, lse and dS already) */
    for (int64_t j = 0; j < nb; j++) {
        for (int64_t c = 0; c < dk; c++) {
            const T x = K[j * krs + c];
            Kp[j * dkp + c] = x - x == 0 ? x : 0;
        }
        for (int64_t c = dk; c < dkp; c++) Kp[j * dkp + c] = 0;
    }
    for (int64_t qb = 0; qb < n_qb && !fa_stopped(a->stop); qb++) {
        const fa_item *it = &its[qb];
        if (it->bq <= 0) continue;
        const band_t b = item_band(a, it);
        /* the keys of the unit that some row of the block sees: [jl, jh) */
        const int64_t jl = b.j_lo > j0 ? b.j_lo : j0, jh = b.j_hi < j0 + nb ? b.j_hi : j0 + nb;
        if (jl >= jh) continue;
        const int64_t bq = it->bq, bqp = (bq + L - 1) / L * L, o = jl - j0, n = jh - jl;
        pack_queries(a, tl, it, scratch, Qt, ld, bqp);
        T qmax = -1;
        key_runs kr;
        const int bits = tile_scores(a, it, &b, St, Qt, &qmax, W, ld, bqp, jl, n, K + o * krs, krs, NULL, NULL, NULL, &kr);
        if (bits < 0) continue;
        if (bits) apply_bits(St, W, ld, bqp, n);
        /* dO of the block, its rows' D, lse and lo */
        int with_lo = 0;
        pack_both(dO + it->i0 * dos, dos, bq, bqp, dv, dvp, 1, dOt, ld, dOp);
        for (int64_t i = 0; i < bqp; i++) {
            Dl[i] = i < bq ? D[it->i0 + i] : 0;
            Dl[ld + i] = i < bq ? ((const T *)it->lse)[i * a->lse_rs] : (T)INFINITY;
            Dl[2 * ld + i] = i < bq ? lo[it->i0 + i] : 0;
            with_lo |= Dl[2 * ld + i] != 0;
        }
        /* dP = V . dO^T (transposed: key rows), then P and dS in place */
        qk_block(dPt, V + o * vrs, vrs, dOt, ld, bqp, dv, n, NULL, NULL, NULL);
        if (with_lo) weights_and_ds(1, St, dPt, Dl, ld, n, bqp);
        else         weights_and_ds(0, St, dPt, Dl, ld, n, bqp);
        /* dV += P^T . dO;  dK += dS^T . (Q scale);  dQ += dS . K */
        acc_products(dVb + o * dvp, dvp, n, dvp, St, ld, 1, dOp, dvp, bq);
        if (a->softcap > 0) { /* x = K . Qt (Qt: the queries times scale), dS *= 1 - tanh(x / c)^2 */
            const T ic = 1 / (T)a->softcap;
            qk_block(St, K + o * krs, krs, Qt, ld, bqp, dk, n, NULL, NULL, NULL);
            for (int64_t j = 0; j < n; j++)
                for (int64_t i = 0; i < bqp; i += L) {
                    const vec t = vtanh(vload(St + j * ld + i) * ic);
                    vstore(dPt + j * ld + i, vload(dPt + j * ld + i) * (vset1(1) - t * t));
                }
        }
#if FA_KV
        /* 16-bit q: the rows pack_queries widened into the scratch (tl->q_off) */
        const T *qr = a->q_kv ? (const T *)scratch + tl->q_off : (const T *)it->q;
        const int64_t qrs = a->q_kv ? dk : a->q_rs;
#else
        const T *qr = (const T *)it->q;
        const int64_t qrs = a->q_rs;
#endif
        pack_both(qr, qrs, bq, bqp, dk, dkp, (T)a->scale, NULL, ld, Qp);
        acc_products(dKb + o * dkp, dkp, n, dkp, dPt, ld, 1, Qp, dkp, bq);
        acc_products(dq + it->i0 * dkp, dkp, bq, dkp, dPt, 1, ld, Kp + o * dkp, dkp, n);
    }
    for (int64_t j = 0; j < nb; j++) {
        memcpy(dkout + j * dkrs, dKb + j * dkp, (size_t)dk * sizeof(T));
        memcpy(dvout + j * dvrs, dVb + j * dvp, (size_t)dv * sizeof(T));
    }
}
