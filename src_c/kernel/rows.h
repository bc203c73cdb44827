/*
 * The row kernel (included by kernel_body.h): few query rows against many
 * keys (decoding), and the tails past the tiled kernel's whole vectors.
 */

/* ---------------------------------------------------------------------------
 * Few query rows (decode, speculative verification): bq <= rows_max rows
 * (the tuning table in dispatch.c: rows_max; rows_max_big when K and V come from
 * memory, rows_max_dk when dk >= 128; but not from rows_full rows up to one
 * vector's lanes, which fill one vector of the tiled kernel, unless plan.c's
 * exceptions to rows_full apply: rows_full_dk and others) against
 * a long key range; also the few rows past the tiled kernel's last whole
 * vector (attention.c, run: the tail), with the tiled kernel's tiles.
 * Per key tile: scores by dot products along dk (register tiles of up to 4
 * rows x 4 keys: a K vector loaded once serves the rows), the online softmax
 * vectorised along the keys, then A += P . V by register tiles of R rows x
 * PV_ACC / R vectors (AVX-512: 8 x 3, 4 x 6; AVX2: 4 x 2; a V vector loaded
 * once serves the rows).  Memory-bound by design: K and V stream through once.
 * One row (decoding), and up to the tuning's pipe_rows rows from memory, is
 * software-pipelined: the scores of key tile t + 1 are computed beside P . V of
 * tile t, so that K and V stream together (decode_step, rows_step, item_rows).
 * Scratch, in elements of T:
 *   Qs   (bq, dkp)  the rows, times scale, zero-padded to dkp (multiple of L)
 *   S    (bq, bk)   scores of one key tile; then probabilities
 *   A    (bq, dv)   output accumulator: unnormalised; careful: the mean.  A
 *                   block of up to FOLD_KEYS keys (careful: all of them)
 *   As, Ac (bq, dv) the total of the blocks and its compensation (acc_flush)
 *   m, l, lc (bq)   running max, sum and the sum's compensation
 *   Sn   (bq, bk)   the pipelined loop: the next tile's scores
 * ------------------------------------------------------------------------- */

/* Register tiles of the row kernel: RS_MAX query rows x 4 keys of scores and
 * R <= RP_MAX rows x up to PV_ACC / R vectors (at most 8) of P.V, so that a K
 * or V vector loaded once serves several rows (32 vector registers with
 * AVX-512, 16 otherwise): much faster than row by row (docs/tuning.md,
 * RP_MAX, RS_MAX, PV_ACC).
 *   RS_MAX  score rows of a tile: 4 x 4 accumulators with AVX-512, 2 x 4
 *           with 16 registers, beside the four K loads
 *   RP_MAX  P.V rows of a tile: 8 with AVX-512, 4 otherwise
 *   PV_ACC  P.V accumulators: 24 of AVX-512's 32 registers (8 rows x 3 vectors,
 *           faster than 4 x 4 in cache), 8 of 16 */
#if FA_VB == 64
#define RP_MAX 8
#define RS_MAX 4
#define PV_ACC 24
#else
#define RP_MAX 4
#define RS_MAX 2
#define PV_ACC 8
#endif

/* One row's dot product with one K row over the whole vectors [0, dkv) of the
 * head dim, as a vector to sum: two accumulators, the even and odd vectors.
 *   qi (dkv)   kr (dkv) */
INLINE vec dot_row(const T *restrict qi, const KT *restrict kr, int64_t dkv)
{
    vec a = vset1(0), b = a;
    int64_t c = 0;
    for (; c + 2 * L <= dkv; c += 2 * L) {
        a += vload(qi + c) * vload_kv(kr + c);
        b += vload(qi + c + L) * vload_kv(kr + c + L);
    }
    for (; c < dkv; c += L) a += vload(qi + c) * vload_kv(kr + c);
    return a + b;
}

/* s[0..4) += the head dim's columns [c0, dk) past whole vectors of four keys' scores */
INLINE void scores_1x4_tail(T *restrict s, const T *restrict qi, const KT *restrict k0, const KT *restrict k1,
                            const KT *restrict k2, const KT *restrict k3, int64_t c0, int64_t dk)
{
    for (int64_t c = c0; c < dk; c++) {
        s[0] += qi[c] * kv_s(k0[c]); s[1] += qi[c] * kv_s(k1[c]);
        s[2] += qi[c] * kv_s(k2[c]); s[3] += qi[c] * kv_s(k3[c]);
    }
}

/* Scores of one row and four keys, K rows k0..k3: s[0..4) = Qs row . K row.
 * Two accumulators per key: eight independent FMA chains (the decode case). */
INLINE void rows_scores_1x4(T *restrict s, const T *restrict qi, const KT *restrict k0,
                            const KT *restrict k1, const KT *restrict k2, const KT *restrict k3,
                            int64_t dk, int64_t dkv)
{
    vec a0 = vset1(0), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int64_t c = 0;
    for (; c + 2 * L <= dkv; c += 2 * L) {
        const vec x = vload(qi + c), y = vload(qi + c + L);
        a0 += x * vload_kv(k0 + c); b0 += y * vload_kv(k0 + c + L);
        a1 += x * vload_kv(k1 + c); b1 += y * vload_kv(k1 + c + L);
        a2 += x * vload_kv(k2 + c); b2 += y * vload_kv(k2 + c + L);
        a3 += x * vload_kv(k3 + c); b3 += y * vload_kv(k3 + c + L);
    }
    for (; c < dkv; c += L) {
        const vec x = vload(qi + c);
        a0 += x * vload_kv(k0 + c); a1 += x * vload_kv(k1 + c);
        a2 += x * vload_kv(k2 + c); a3 += x * vload_kv(k3 + c);
    }
    hsum4(a0 + b0, a1 + b1, a2 + b2, a3 + b3, s);
    scores_1x4_tail(s, qi, k0, k1, k2, k3, c, dk);
}

/* Scores of R rows (Qs rows i = 0..R, stride dkp) and four keys k0..k3:
 * S[i * ls + 0..4).  R x 4 accumulators; each K vector serves R rows. */
INLINE void rows_scores_rx4(const int R, T *restrict S, int64_t ls, const T *restrict Qs, int64_t dkp,
                            const KT *restrict k0, const KT *restrict k1, const KT *restrict k2,
                            const KT *restrict k3, int64_t dk, int64_t dkv)
{
    vec acc[RS_MAX][4];
    UNROLL(4) for (int i = 0; i < R; i++)
        UNROLL(4) for (int x = 0; x < 4; x++) acc[i][x] = vset1(0);
    for (int64_t c = 0; c < dkv; c += L) {
        const vec x0 = vload_kv(k0 + c), x1 = vload_kv(k1 + c), x2 = vload_kv(k2 + c), x3 = vload_kv(k3 + c);
        UNROLL(4) for (int i = 0; i < R; i++) {
            const vec qv = vload(Qs + i * dkp + c);
            acc[i][0] += qv * x0; acc[i][1] += qv * x1;
            acc[i][2] += qv * x2; acc[i][3] += qv * x3;
        }
    }
#if FA_HSUM4X4
    if (R >= 3) {
        if (R == 3) acc[3][0] = acc[3][1] = acc[3][2] = acc[3][3] = vset1(0);
        hsum4x4(acc, S, ls, R);
    }
#endif
    UNROLL(4) for (int i = 0; i < R; i++) {
        T *si = S + i * ls;
        const T *qi = Qs + i * dkp;
        if (!FA_HSUM4X4 || R < 3) hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], si);
        for (int64_t c = dkv; c < dk; c++) {
            si[0] += qi[c] * kv_s(k0[c]); si[1] += qi[c] * kv_s(k1[c]);
            si[2] += qi[c] * kv_s(k2[c]); si[3] += qi[c] * kv_s(k3[c]);
        }
    }
}

#if RS_MAX == 2
/* Scores of four rows and two keys, K rows k0, k1: S[i * ls + 0..2) for i < 4.
 * 4 x 2 accumulators, so that each K vector is loaded (16-bit K: widened) once
 * for four rows; two 2 x 4 tiles load it twice, once a row as folded into the
 * FMAs (GQA 32/8 decoding's four rows). */
INLINE void rows_scores_4x2(T *restrict S, int64_t ls, const T *restrict Qs, int64_t dkp, const KT *restrict k0,
                            const KT *restrict k1, int64_t dk, int64_t dkv)
{
    vec acc[4][2];
    UNROLL(4) for (int i = 0; i < 4; i++) acc[i][0] = acc[i][1] = vset1(0);
    for (int64_t c = 0; c < dkv; c += L) {
        const vec x0 = vload_kv(k0 + c), x1 = vload_kv(k1 + c);
        UNROLL(4) for (int i = 0; i < 4; i++) {
            vec qv = vload(Qs + i * dkp + c);
            VREG(qv); /* once for its two FMAs, not folded into each */
            acc[i][0] += qv * x0; acc[i][1] += qv * x1;
        }
    }
    T s[8];
    hsum4(acc[0][0], acc[0][1], acc[1][0], acc[1][1], s);
    hsum4(acc[2][0], acc[2][1], acc[3][0], acc[3][1], s + 4);
    UNROLL(4) for (int i = 0; i < 4; i++) {
        T *si = S + i * ls;
        const T *qi = Qs + i * dkp;
        si[0] = s[2 * i];
        si[1] = s[2 * i + 1];
        for (int64_t c = dkv; c < dk; c++) {
            si[0] += qi[c] * kv_s(k0[c]); si[1] += qi[c] * kv_s(k1[c]);
        }
    }
}
#endif

/* Scores of four keys k0..k3 for the rows i0..bq: S[i * ls + 0..4) = Qs[i] . K
 * row, RS_MAX rows a tile, then the rest (one row: two accumulators per key).
 *   S (bq, ls)   Qs (bq, dkp) zero-padded rows */
INLINE void rows_scores_keys4(T *restrict S, int64_t ls, const T *restrict Qs, int64_t dkp, int64_t i0, int64_t bq,
                              const KT *restrict k0, const KT *restrict k1, const KT *restrict k2,
                              const KT *restrict k3, int64_t dk, int64_t dkv)
{
    int64_t i = i0;
    for (; i + RS_MAX <= bq; i += RS_MAX)
        rows_scores_rx4(RS_MAX, S + i * ls, ls, Qs + i * dkp, dkp, k0, k1, k2, k3, dk, dkv);
    switch (bq - i) {
#if RS_MAX > 3
    case 3: rows_scores_rx4(3, S + i * ls, ls, Qs + i * dkp, dkp, k0, k1, k2, k3, dk, dkv); break;
    case 2: rows_scores_rx4(2, S + i * ls, ls, Qs + i * dkp, dkp, k0, k1, k2, k3, dk, dkv); break;
#endif
    case 1: rows_scores_1x4(S + i * ls, Qs + i * dkp, k0, k1, k2, k3, dk, dkv); break;
    default: break;
    }
}

/* Scores of a key tile for bq rows: S[i][j] = Qs[i] . K[j]   for j < nb
 *   S   (bq, ls)    Qs (bq, dkp) zero-padded rows
 *   K   (nb, dk)    row stride krs
 * Four keys at a time, for RS_MAX rows at a time (one row: two accumulators
 * per key; on 16 registers four rows at a time first where q4 says).  Rows j < npf
 * of K exist and may be prefetched (far: into L2, see prefetch_row); xpf's rows
 * (NULL: none) are prefetched in step with the keys. */
static void rows_scores(T *restrict S, int64_t ls, const T *restrict Qs, int64_t dkp, int64_t bq,
                        const KT *restrict K, int64_t krs, int64_t dk, int64_t nb, int64_t npf, int far,
                        const tile_pf *xpf)
{
    const int64_t dkv = dk / L * L, pf = prefetch_dist(dk, far);
#if RS_MAX == 2
    /* 4 x 2 tiles first where they measured faster (docs/tuning.md,
     * rows_scores_4x2): 16-bit K; float32 on AVX2 at dk >= 128 in whole groups
     * of four rows (d64 and a rest of two rows were slower) */
    const int64_t q4 = FA_KV || (FA_VB == 32 && sizeof(T) == 4 && dk >= 128 && bq % 4 == 0) ? bq / 4 * 4 : 0;
#endif
    int64_t j = 0;
    for (; j + 4 <= nb; j += 4) {
        const KT *k0 = K + j * krs, *k1 = k0 + krs, *k2 = k1 + krs, *k3 = k2 + krs;
        for (int64_t r = j + pf; r < j + pf + 4 && r < npf; r++) prefetch_row(K + r * krs, dk, far, krs != dk);
        if (xpf) tile_prefetch(xpf, j, 4);
        int64_t i = 0;
#if RS_MAX == 2
        for (; i < q4; i += 4) {
            rows_scores_4x2(S + i * ls + j, ls, Qs + i * dkp, dkp, k0, k1, dk, dkv);
            rows_scores_4x2(S + i * ls + j + 2, ls, Qs + i * dkp, dkp, k2, k3, dk, dkv);
        }
#endif
        rows_scores_keys4(S + j, ls, Qs, dkp, i, bq, k0, k1, k2, k3, dk, dkv);
    }
    if (xpf) tile_prefetch(xpf, j, INT64_MAX - j); /* the rest */
    for (; j < nb; j++) {
        const KT *kj = K + j * krs;
        for (int64_t i = 0; i < bq; i++) {
            const T *qi = Qs + i * dkp;
            T s = hsum(dot_row(qi, kj, dkv));
            for (int64_t c = dkv; c < dk; c++) s += qi[c] * kv_s(kj[c]);
            S[i * ls + j] = s;
        }
    }
}

/* The keys [0, nb) of rows_pv_tile into its accumulators acc (arguments as
 * its own); PF 0: no prefetch at all, so that the loop carries no prefetch
 * tests (npf and kp unused) */
INLINE void rows_pv_keys(const int R, const int NV, const int PF, vec (*acc)[8], const T *restrict S, int64_t ls,
                         const KT *restrict V, int64_t vrs, int64_t nb, int64_t npf, int64_t pf, int64_t pfn,
                         int far, int tail, const tile_pf *kp)
{
    for (int64_t j = 0; j < nb; j++) {
        const KT *vj = V + j * vrs;
        if (PF && j + pf < npf) prefetch_row(vj + pf * vrs, pfn, far, tail);
        if (PF && kp) tile_prefetch(kp, j, 1);
        vec vv[8];
        UNROLL(8) for (int x = 0; x < NV; x++) vv[x] = vload_kv(vj + x * L);
        UNROLL(8) for (int i = 0; i < R; i++) {
            const T p = S[i * ls + j]; /* scalar x vector: a broadcast (vset1 would add 0 first) */
            UNROLL(8) for (int x = 0; x < NV; x++) acc[i][x] += p * vv[x];
        }
    }
}

/* A[i][0..NV*L) += sum_j S[i][j] * V[j][0..NV*L)   for i < R, the sum formed
 * fresh, then added (one rounding a tile against A: see FOLD_KEYS):
 *   A (R, lda)   S (R, ls)   V (nb, NV*L) row stride vrs
 * An R x NV register tile: each V vector, loaded once, serves R rows.
 * Rows j < npf of V exist and may be prefetched: pfn elements of the row pf
 * rows ahead (far: into L2; tail: see prefetch_lines); and kp's row j with key j
 * (NULL: none).  A tile with nothing to prefetch (npf 0 and no kp: the column
 * tiles after the first of a row group) takes a loop without the prefetch
 * tests (docs/tuning.md, rows_pv_keys). */
INLINE void rows_pv_tile(const int R, const int NV, T *restrict A, int64_t lda, const T *restrict S,
                         int64_t ls, const KT *restrict V, int64_t vrs, int64_t nb, int64_t npf, int64_t pf,
                         int64_t pfn, int far, int tail, const tile_pf *kp)
{
    vec acc[RP_MAX][8];
    UNROLL(8) for (int i = 0; i < R; i++)
        UNROLL(8) for (int x = 0; x < NV; x++) acc[i][x] = vset1(0);
    if (npf > 0 || kp)
        rows_pv_keys(R, NV, 1, acc, S, ls, V, vrs, nb, npf, pf, pfn, far, tail, kp);
    else
        rows_pv_keys(R, NV, 0, acc, S, ls, V, vrs, nb, npf, pf, pfn, far, tail, kp);
    UNROLL(8) for (int i = 0; i < R; i++)
        UNROLL(8) for (int x = 0; x < NV; x++) vstore(A + i * lda + x * L, vload(A + i * lda + x * L) + acc[i][x]);
}

/* rows_pv for R rows: the whole vectors of dv by tiles of NVM vectors (R x NVM
 * accumulators: PV_ACC, at most 8 vectors; one row takes 8, a single pass
 * over each V row, as decoding streams V from memory) and one narrower tile,
 * then the last dv % L columns.  The first tile prefetches whole V rows (the
 * later ones find them in cache); xpf's rows (NULL: none) are prefetched in
 * step with the tiles, or with xpf->per_key key by key in the first tile. */
#define PV_TILE(NV) rows_pv_tile(R, NV, A + c, lda, S, ls, V + c, vrs, nb, (R == 1 || c == 0) ? npf : 0, pf, R == 1 ? NV * L : dv, far, vrs != dv, \
                                 (xpf && xpf->per_key && c == 0) ? xpf : NULL)
INLINE void rows_pv_r(const int R, T *restrict A, int64_t lda, const T *restrict S, int64_t ls,
                      const KT *restrict V, int64_t vrs, int64_t dv, int64_t nb, int64_t npf, int far,
                      const tile_pf *xpf)
{
    const int NVM = PV_ACC / R > 8 ? 8 : PV_ACC / R;
    const int64_t nvec = dv / L, pf = prefetch_dist(dv, far);
    int64_t c = 0;
    for (; c + NVM * L <= nvec * L; c += NVM * L) {
        if (xpf && !xpf->per_key) prefetch_in_step(xpf, c, c + NVM * L, dv);
        PV_TILE(NVM);
    }
    if (xpf && !xpf->per_key) prefetch_in_step(xpf, c, dv, dv); /* the rest */
    switch (nvec - c / L) { /* < NVM: the tests below are constants */
    case 7: if (7 < NVM) PV_TILE(7); break;
    case 6: if (6 < NVM) PV_TILE(6); break;
    case 5: if (5 < NVM) PV_TILE(5); break;
    case 4: if (4 < NVM) PV_TILE(4); break;
    case 3: if (3 < NVM) PV_TILE(3); break;
    case 2: if (2 < NVM) PV_TILE(2); break;
    case 1: PV_TILE(1); break;
    default: break;
    }
    for (int i = 0; i < R; i++)
        for (c = nvec * L; c < dv; c++) {
            T s = 0;
            for (int64_t j = 0; j < nb; j++) s += S[i * ls + j] * kv_s(V[j * vrs + c]);
            A[i * lda + c] += s;
        }
}
#undef PV_TILE

/* A (bq, dv) += S (bq, nb; row stride ls) . V (nb, dv; row stride vrs), rows
 * RP_MAX at a time.  Rows j < npf of V may be prefetched (0: none; far: into
 * L2), and xpf's rows (NULL: none); only the first group of rows prefetches
 * (the others find V in cache). */
static void rows_pv(T *restrict A, const T *restrict S, int64_t ls, int64_t bq, const KT *restrict V,
                    int64_t vrs, int64_t dv, int64_t nb, int64_t npf, int far, const tile_pf *xpf)
{
    int64_t i = 0;
    for (; i + RP_MAX <= bq; i += RP_MAX, npf = 0, xpf = NULL)
        rows_pv_r(RP_MAX, A + i * dv, dv, S + i * ls, ls, V, vrs, dv, nb, npf, far, xpf);
    switch (bq - i) {
#if RP_MAX == 8
    case 7: rows_pv_r(7, A + i * dv, dv, S + i * ls, ls, V, vrs, dv, nb, npf, far, xpf); break;
    case 6: rows_pv_r(6, A + i * dv, dv, S + i * ls, ls, V, vrs, dv, nb, npf, far, xpf); break;
    case 5: rows_pv_r(5, A + i * dv, dv, S + i * ls, ls, V, vrs, dv, nb, npf, far, xpf); break;
    case 4: rows_pv_r(4, A + i * dv, dv, S + i * ls, ls, V, vrs, dv, nb, npf, far, xpf); break;
#elif RP_MAX != 4
#error "rows_pv: a case for each remainder below RP_MAX"
#endif
    case 3: rows_pv_r(3, A + i * dv, dv, S + i * ls, ls, V, vrs, dv, nb, npf, far, xpf); break;
    case 2: rows_pv_r(2, A + i * dv, dv, S + i * ls, ls, V, vrs, dv, nb, npf, far, xpf); break;
    case 1: rows_pv_r(1, A + i * dv, dv, S + i * ls, ls, V, vrs, dv, nb, npf, far, xpf); break;
    default: break;
    }
}

/* rows_pv over the key ranges of kr (all nb keys when n < 0), pointers as
 * rows_pv's; off the common path (noinline: inlined, it slowed item_rows,
 * mask or not: docs/tuning.md, rows_pv_runs) */
static __attribute__((noinline)) void rows_pv_runs(const key_runs *kr, T *restrict A, const T *restrict S,
                                                   int64_t ls, int64_t bq, const KT *restrict V, int64_t vrs,
                                                   int64_t dv, int64_t nb, int64_t npf, int far,
                                                   const tile_pf *xpf)
{
    if (kr->n < 0) {
        rows_pv(A, S, ls, bq, V, vrs, dv, nb, npf, far, xpf);
        return;
    }
    for (int r = 0; r < kr->n; r++) {
        const int64_t j = kr->run[r][0];
        rows_pv(A, S + j, ls, bq, V + j * vrs, vrs, dv, kr->run[r][1] - j, npf - j, far,
                r == 0 ? xpf : NULL);
    }
}

/* P . V for the rows that redo_nonfinite_rows recomputes, where the weight
 * of a key the query does not see is -0 (item_rows, careful): such a value
 * row adds nothing even when it holds inf or NaN.  A (dv) += S (nb) . V (nb, dv). */
static void rows_pv_careful(T *restrict A, const T *restrict S, const KT *restrict V, int64_t vrs,
                            int64_t dv, int64_t nb)
{
    for (int64_t j = 0; j < nb; j++) {
        const T p = S[j];
        const KT *vj = V + j * vrs;
        if (p == 0) {
            /* -0: a hidden key, which adds nothing.  +0: a key the row sees
             * whose weight underflowed; its true weight is positive, so its
             * inf and NaN values still count (inf * tiny = inf), its finite
             * ones add nothing. */
            if (!signbit(p))
                for (int64_t c = 0; c < dv; c++)
                    if (!isfinite(kv_s(vj[c]))) A[c] += kv_s(vj[c]);
            continue;
        }
        for (int64_t c = 0; c < dv; c++) A[c] += p * kv_s(vj[c]);
    }
}

/* The online softmax of the rows over the key tile [j0, j0 + nb), whose
 * scores are in S: the score modifiers and masks, each row's max,
 * S <- exp(S - max) (the probabilities), m and l updated, A rescaled (for
 * careful, see item_rows).
 *   S (bq, bk)   A, As, Ac (bq, dv)   m, l, lc (bq), As, Ac after A and lc after l */
static void rows_softmax(const fa_attention_args *a, const fa_item *it, const band_t *band, T *S,
                         int64_t bk, T *A, T *m, T *l, int64_t j0, int64_t nb, int careful)
{
    const int64_t bq = it->bq, dv = a->dv;
    const band_t b = *band;
    for (int64_t i = 0; i < bq; i++) {
        T *si = S + i * bk;
        const int64_t pos = band_pos(&b, i); /* the row's aligned position */
        if (a->softcap > 0) {
            const T c = (T)a->softcap, ic = 1 / c;
            int64_t j = 0;
            for (; j + L <= nb; j += L) vstore(si + j, vtanh(vload(si + j) * ic) * c);
            for (; j < nb; j++) {
                T buf[L] = {0};
                buf[0] = si[j] * ic;
                const vec t = vtanh(vload(buf));
                memcpy(buf, &t, sizeof buf);
                si[j] = buf[0] * c;
            }
        }
        if (it->slope != 0)
            for (int64_t j = 0; j < nb; j++) {
                const int64_t d = pos - (j0 + j);
                si[j] -= (T)it->slope * (T)(d < 0 ? -d : d);
            }
        if (a->mask_kind == FA_MASK_BOOL) {
            const uint8_t *mk = (const uint8_t *)it->mask + i * a->m_rs + j0 * a->m_cs;
            for (int64_t j = 0; j < nb; j++)
                if (!mk[j * a->m_cs]) si[j] = -INFINITY;
        } else if (a->mask_kind == FA_MASK_ADD) {
            const T *mk = (const T *)it->mask + i * a->m_rs + j0 * a->m_cs;
            for (int64_t j = 0; j < nb; j++) si[j] += mk[j * a->m_cs];
        }
        if (b.has_right) /* key j0 + j is hidden iff j0 + j > pos + right */
            for (int64_t j = (pos + b.right + 1 - j0 > 0) ? pos + b.right + 1 - j0 : 0; j < nb; j++)
                si[j] = -INFINITY;
        if (b.has_left) /* ... or j0 + j < pos - left */
            for (int64_t j = 0; j < nb && j0 + j < pos - b.left; j++) si[j] = -INFINITY;
        /* online softmax of row i over this tile */
        const T mo = m[i], mn = max_nan(mo, row_max_nan(si, nb)), mu = step_shift(mn);
        T sum = 0;
        {
            vec vs = vset1(0);
            int64_t j = 0;
            /* careful: a hidden key (score -inf) gets weight -0, told apart from
             * a weight that underflowed to +0 (rows_pv_careful) */
            const vec hid = -vset1(0);
            for (; j + L <= nb; j += L) { /* arguments <= 0 (or NaN): the attention exp */
                const vec x = vload(si + j);
                const vec p = vexp_neg(x - mu);
                vstore(si + j, careful ? vsel(x == vset1(-INFINITY), hid, p) : p);
                vs += p;
            }
            if (j < nb) {
                T buf[L];
                for (int r = 0; r < L; r++) buf[r] = (j + r < nb) ? si[j + r] : -INFINITY;
                const vec x = vload(buf);
                const vec p = vexp_neg(x - mu);
                vs += p;
                const vec ps = careful ? vsel(x == vset1(-INFINITY), hid, p) : p;
                memcpy(buf, &ps, sizeof buf);
                for (int r = 0; j + r < nb; r++) si[j + r] = buf[r];
            }
            sum = hsum(vs);
        }
        const T alpha = exp_neg1(mo - mu), lo = l[i];
        if (careful) {
            l[i] = lo * alpha + sum;
        } else {
            l[i] = lo * alpha;
            l[bq + i] *= alpha;
            acc_add(l + i, l + bq + i, sum);
        }
        m[i] = mn;
        T f = alpha;
        if (careful) { /* A holds the mean so far: A <- A lo alpha / l + P . V / l */
            const T inv = l[i] == 0 ? 0 : 1 / l[i];
            f = lo * alpha * inv;
            for (int64_t j = 0; j < nb; j++) si[j] *= inv; /* keeps the sign of -0 */
        }
        /* f is 0 exactly when alpha is (vexp_neg gives no subnormals, lo >= 1 and
         * l <= lo alpha + bk), and then inf * 0 would be NaN: the old terms weigh 0, */
        if (careful && f == 0) {
            for (int64_t c = 0; c < dv; c++) /* but their inf and NaN stay (see rows_pv_careful) */
                if (isfinite(A[i * dv + c])) A[i * dv + c] = 0;
        } else if (f != 1) {
            for (int x = 0; x < 3; x++) /* A, As, Ac */
                for (int64_t c = 0; c < dv; c++) A[(x * bq + i) * dv + c] *= f;
        }
    }
}

/* One row's A (dv) += p0 v0 + p1 v1 + p2 v2 + p3 v3 for four V rows v0..v3 (dv),
 * dvv = dv rounded down to whole vectors (decode_step, group_step); the four
 * keys' sum formed fresh, then added (FOLD_KEYS). */
INLINE void pv_1x4(T *restrict A, T p0, T p1, T p2, T p3, const KT *restrict v0, const KT *restrict v1,
                   const KT *restrict v2, const KT *restrict v3, int64_t dv, int64_t dvv)
{
    for (int64_t c = 0; c < dvv; c += L) {
        vec acc = p0 * vload_kv(v0 + c);
        acc += p1 * vload_kv(v1 + c);
        acc += p2 * vload_kv(v2 + c);
        acc += p3 * vload_kv(v3 + c);
        vstore(A + c, vload(A + c) + acc);
    }
    for (int64_t c = dvv; c < dv; c++)
        A[c] += (p0 * kv_s(v0[c]) + p1 * kv_s(v1[c])) + (p2 * kv_s(v2[c]) + p3 * kv_s(v3[c]));
}

/* rows_scores_1x4 and pv_1x4 with each K or V row read whole, one row after
 * the other in address order, rather than the four rows' vectors in turn:
 * decode_step from memory where the tuning's decode_inorder says so (docs/tuning.md,
 * decode_inorder).  Pointers as theirs. */
INLINE void rows_scores_1x4_inorder(T *restrict s, const T *restrict qi, const KT *restrict k0,
                                    const KT *restrict k1, const KT *restrict k2, const KT *restrict k3,
                                    int64_t dk, int64_t dkv)
{
    const vec d0 = dot_row(qi, k0, dkv), d1 = dot_row(qi, k1, dkv);
    const vec d2 = dot_row(qi, k2, dkv), d3 = dot_row(qi, k3, dkv);
    hsum4(d0, d1, d2, d3, s);
    scores_1x4_tail(s, qi, k0, k1, k2, k3, dkv, dk);
}

enum { PV_IN_VECS = 8 }; /* pv_1x4_inorder's columns a block, in registers: 8 of the 16 of AVX2 */
INLINE void pv_1x4_inorder(T *restrict A, T p0, T p1, T p2, T p3, const KT *restrict v0, const KT *restrict v1,
                           const KT *restrict v2, const KT *restrict v3, int64_t dv, int64_t dvv)
{
    const vec w0 = vset1(p0), w1 = vset1(p1), w2 = vset1(p2), w3 = vset1(p3);
    int64_t c = 0;
    for (; c + PV_IN_VECS * L <= dvv; c += PV_IN_VECS * L) {
        vec acc[PV_IN_VECS];
        UNROLL(8) for (int x = 0; x < PV_IN_VECS; x++) acc[x] = w0 * vload_kv(v0 + c + x * L);
        UNROLL(8) for (int x = 0; x < PV_IN_VECS; x++) acc[x] += w1 * vload_kv(v1 + c + x * L);
        UNROLL(8) for (int x = 0; x < PV_IN_VECS; x++) acc[x] += w2 * vload_kv(v2 + c + x * L);
        UNROLL(8) for (int x = 0; x < PV_IN_VECS; x++) acc[x] += w3 * vload_kv(v3 + c + x * L);
        UNROLL(8) for (int x = 0; x < PV_IN_VECS; x++) vstore(A + c + x * L, vload(A + c + x * L) + acc[x]);
    }
    if (c < dv) pv_1x4(A + c, p0, p1, p2, p3, v0 + c, v1 + c, v2 + c, v3 + c, dv - c, dvv - c);
}

/* decode_step under fa_tiles.inorder for dv = NV whole vectors: one key at a
 * time, its K row then its V row, each read whole, in a loop kept rolled, with
 * no software prefetch.  Rolled, the loop has one load instruction a vector of
 * one row, not of four rows, which the hardware prefetchers stream faster
 * (docs/tuning.md, decode_inorder).  The sums of rows_scores_1x4_inorder and
 * pv_1x4_inorder (the four keys' fresh sum, from -0, then added to A), but the
 * compiler may fuse another product first, so the last bit can differ.
 * Pointers as decode_step's; n4 keys of both K and V, a multiple of 4. */
INLINE void decode_step_rolled(const int NV, T *restrict Sn, const T *restrict Qs, const KT *restrict K, int64_t krs,
                               int64_t dk, T *restrict A, const T *restrict P, const KT *restrict V, int64_t vrs,
                               int64_t n4)
{
    const int64_t dkv = dk / L * L;
    for (int64_t j = 0; j < n4; j += 4) {
        vec s[4], t[16];
        UNROLL(16) for (int x = 0; x < NV; x++) t[x] = vset1(-(T)0);
        NO_UNROLL for (int r = 0; r < 4; r++) {
            const KT *kr = K + (j + r) * krs, *vr = V + (j + r) * vrs;
            s[r] = dot_row(Qs, kr, dkv);
            const vec w = vset1(P[j + r]);
            UNROLL(16) for (int x = 0; x < NV; x++) t[x] += w * vload_kv(vr + x * L);
        }
        hsum4(s[0], s[1], s[2], s[3], Sn + j);
        const KT *k0 = K + j * krs;
        scores_1x4_tail(Sn + j, Qs, k0, k0 + krs, k0 + 2 * krs, k0 + 3 * krs, dkv, dk);
        UNROLL(16) for (int x = 0; x < NV; x++) vstore(A + x * L, vload(A + x * L) + t[x]);
    }
}

/* One decode step, K and V read side by side: the scores of the next key
 * tile (Sn[j] = Qs . K[j], j < nk) and A += P . V over this tile (j < nv),
 * four keys of each at a time.  Two streams at once, in small chunks, keep
 * memory busier than one tile after the other: faster than the tile-by-tile
 * loop, from memory and in the L3 (docs/tuning.md, decode_step).
 *   Sn (nk)        Qs (dkp) the row, times scale, zero-padded
 *   K  (nk, dk)    row stride krs; rows j < npk exist (prefetched ahead)
 *   P  (nv)        probabilities of this tile
 *   V  (nv, dv)    row stride vrs; rows j < npv exist
 *   A  (dv)        accumulator
 * far: K and V come from memory (prefetch_row); npk = npv = 0: no prefetch
 * (fa_tiles.decode_pf off: the hardware prefetchers alone).  inorder
 * (fa_tiles.inorder, from memory; never 16-bit K and V, which the plan keeps
 * off it): each K and V row read whole, in address order (the _inorder products),
 * and where dv is 4, 8 or 16 whole vectors one key at a time without software
 * prefetch (decode_step_rolled). */
static void decode_step(T *restrict Sn, const T *restrict Qs, const KT *restrict K, int64_t krs, int64_t dk,
                        int64_t nk, int64_t npk, T *restrict A, const T *restrict P, const KT *restrict V,
                        int64_t vrs, int64_t dv, int64_t nv, int64_t npv, int far, int inorder)
{
    const int64_t dkv = dk / L * L, dvv = dv / L * L, ahead = far ? FAR_PF_BYTES : DECODE_PF_BYTES;
    const int64_t pfk = prefetch_dist_bytes(dk, ahead), pfv = prefetch_dist_bytes(dv, ahead);
    const int64_t n = nk > nv ? nk : nv;
    /* the rolled loop's V vectors a row (0: dv does not fit it); it takes the
     * whole fours of both K and V, the loop below the rest */
    const int rolled = FA_KV || !inorder ? 0 : FA_VB == 64 && dv == 16 * L ? 16 : dv == 8 * L ? 8 : dv == 4 * L ? 4 : 0;
    int64_t j = rolled ? (nk < nv ? nk : nv) / 4 * 4 : 0;
    if (rolled == 16)     decode_step_rolled(16, Sn, Qs, K, krs, dk, A, P, V, vrs, j);
    else if (rolled == 8) decode_step_rolled(8, Sn, Qs, K, krs, dk, A, P, V, vrs, j);
    else if (rolled == 4) decode_step_rolled(4, Sn, Qs, K, krs, dk, A, P, V, vrs, j);
    for (; j < n; j += 4) {
        if (j + 4 <= nk) {
            const KT *k0 = K + j * krs;
            for (int64_t r = j + pfk; r < j + pfk + 4 && r < npk; r++) prefetch_row(K + r * krs, dk, far, krs != dk);
            if (!FA_KV && inorder) rows_scores_1x4_inorder(Sn + j, Qs, k0, k0 + krs, k0 + 2 * krs, k0 + 3 * krs, dk, dkv);
            else                   rows_scores_1x4(Sn + j, Qs, k0, k0 + krs, k0 + 2 * krs, k0 + 3 * krs, dk, dkv);
        } else if (j < nk) { /* the last 1-3 keys: rows_scores' one-key loop */
            rows_scores(Sn + j, 0, Qs, 0, 1, K + j * krs, krs, dk, nk - j, 0, 0, NULL);
        }
        if (j + 4 <= nv) {
            const KT *v0 = V + j * vrs, *v1 = v0 + vrs, *v2 = v1 + vrs, *v3 = v2 + vrs;
            for (int64_t r = j + pfv; r < j + pfv + 4 && r < npv; r++) prefetch_row(V + r * vrs, dv, far, vrs != dv);
            if (!FA_KV && inorder) pv_1x4_inorder(A, P[j], P[j + 1], P[j + 2], P[j + 3], v0, v1, v2, v3, dv, dvv);
            else                   pv_1x4(A, P[j], P[j + 1], P[j + 2], P[j + 3], v0, v1, v2, v3, dv, dvv);
        } else if (j < nv) { /* the last 1-3 keys */
            rows_pv(A, P + j, 0, 1, V + j * vrs, vrs, dv, nv - j, 0, 0, NULL);
        }
    }
}

/* decode_step's work where a bool mask hides some keys of this tile from every
 * row of the item: the next tile's scores, then P . V over kr's ranges (rows_pv_runs).
 * Pointers as decode_step's (rows_step's for bq rows); Sn and P have row stride bk. */
static __attribute__((noinline)) void decode_step_runs(const key_runs *kr, T *Sn, const T *Qs, int64_t dkp,
                                                       int64_t bq, const KT *K, int64_t krs, int64_t dk,
                                                       int64_t nk, int64_t npk, T *A, const T *P, int64_t bk,
                                                       const KT *V, int64_t vrs, int64_t dv, int64_t nv,
                                                       int64_t npv, int far)
{
    rows_scores(Sn, bk, Qs, dkp, bq, K, krs, dk, nk, npk, far, NULL);
    rows_pv_runs(kr, A, P, bk, bq, V, vrs, dv, nv, npv, far, NULL);
}

/* R rows' A[i] (dv) += P[i][0] v0 + P[i][1] v1 + P[i][2] v2 + P[i][3] v3 for
 * four V rows v0..v3 (dv), i < R <= PV4_ROWS (rows_step); each row's four keys'
 * sum formed fresh, then added, as pv_1x4's.
 *   A (R, lda)   P (R, ls)   dvv = dv rounded down to whole vectors */
#define PV4_ROWS (FA_VB == 64 ? 4 : 2)
INLINE void pv_rx4(const int R, T *restrict A, int64_t lda, const T *restrict P, int64_t ls,
                   const KT *restrict v0, const KT *restrict v1, const KT *restrict v2, const KT *restrict v3,
                   int64_t dv, int64_t dvv)
{
    vec p[4][4]; /* the weights, broadcast once for every column */
    UNROLL(4) for (int i = 0; i < R; i++)
        UNROLL(4) for (int x = 0; x < 4; x++) p[i][x] = vset1(P[i * ls + x]);
    for (int64_t c = 0; c < dvv; c += L) {
        const vec x0 = vload_kv(v0 + c), x1 = vload_kv(v1 + c), x2 = vload_kv(v2 + c), x3 = vload_kv(v3 + c);
        UNROLL(4) for (int i = 0; i < R; i++) {
            vec acc = p[i][0] * x0;
            acc += p[i][1] * x1;
            acc += p[i][2] * x2;
            acc += p[i][3] * x3;
            vstore(A + i * lda + c, vload(A + i * lda + c) + acc);
        }
    }
    for (int i = 0; i < R; i++) {
        const T *pi = P + i * ls;
        for (int64_t c = dvv; c < dv; c++)
            A[i * lda + c] += (pi[0] * kv_s(v0[c]) + pi[1] * kv_s(v1[c])) + (pi[2] * kv_s(v2[c]) + pi[3] * kv_s(v3[c]));
    }
}

/* pv_rx4 for R rows known only at run time, 1 <= R <= PV4_ROWS: one copy of
 * pv_rx4 for each R, so that each keeps its weights in registers (the rows
 * past a whole PV4_ROWS in rows_step, an item's rows in group_chunks). */
INLINE void pv_rx4_rows(int64_t R, T *restrict A, int64_t lda, const T *restrict P, int64_t ls,
                        const KT *restrict v0, const KT *restrict v1, const KT *restrict v2,
                        const KT *restrict v3, int64_t dv, int64_t dvv)
{
    switch (R) {
#if PV4_ROWS > 3
    case 4: pv_rx4(4, A, lda, P, ls, v0, v1, v2, v3, dv, dvv); break;
    case 3: pv_rx4(3, A, lda, P, ls, v0, v1, v2, v3, dv, dvv); break;
#endif
    case 2: pv_rx4(2, A, lda, P, ls, v0, v1, v2, v3, dv, dvv); break;
    case 1: pv_rx4(1, A, lda, P, ls, v0, v1, v2, v3, dv, dvv); break;
    default: break;
    }
}

/* decode_step for bq > 1 rows (the tuning's pipe_rows): the next tile's scores
 * Sn (bq, ls) and A (bq, dv) += P (bq, ls) . V over this tile, four keys of
 * each at a time, so that K and V stream together as in decoding; K and V rows
 * prefetched into L1 PIPE_PF_BYTES ahead, or with far (the tuning's pipe_pf_l2)
 * into L2 FAR_PF_BYTES ahead (docs/tuning.md, pipe_rows and pipe_pf_l2).
 *   Qs (bq, dkp)   P (bq, ls)   other pointers as decode_step's */
static void rows_step(T *restrict Sn, int64_t ls, const T *restrict Qs, int64_t dkp, int64_t bq,
                      const KT *restrict K, int64_t krs, int64_t dk, int64_t nk, int64_t npk, T *restrict A,
                      const T *restrict P, const KT *restrict V, int64_t vrs, int64_t dv, int64_t nv, int64_t npv,
                      int far)
{
    const int64_t dkv = dk / L * L, dvv = dv / L * L, ahead = far ? FAR_PF_BYTES : PIPE_PF_BYTES;
    const int64_t pfk = prefetch_dist_bytes(dk, ahead), pfv = prefetch_dist_bytes(dv, ahead);
    const int64_t n = nk > nv ? nk : nv;
    for (int64_t j = 0; j < n; j += 4) {
        if (j + 4 <= nk) {
            const KT *k0 = K + j * krs;
            for (int64_t r = j + pfk; r < j + pfk + 4 && r < npk; r++) prefetch_row(K + r * krs, dk, far, krs != dk);
            rows_scores_keys4(Sn + j, ls, Qs, dkp, 0, bq, k0, k0 + krs, k0 + 2 * krs, k0 + 3 * krs, dk, dkv);
        } else if (j < nk) { /* the last 1-3 keys */
            rows_scores(Sn + j, ls, Qs, dkp, bq, K + j * krs, krs, dk, nk - j, 0, 0, NULL);
        }
        if (j + 4 <= nv) {
            const KT *v0 = V + j * vrs, *v1 = v0 + vrs, *v2 = v1 + vrs, *v3 = v2 + vrs;
            for (int64_t r = j + pfv; r < j + pfv + 4 && r < npv; r++) prefetch_row(V + r * vrs, dv, far, vrs != dv);
            int64_t i = 0;
            for (; i + PV4_ROWS <= bq; i += PV4_ROWS)
                pv_rx4(PV4_ROWS, A + i * dv, dv, P + i * ls + j, ls, v0, v1, v2, v3, dv, dvv);
            if (i < bq) pv_rx4_rows(bq - i, A + i * dv, dv, P + i * ls + j, ls, v0, v1, v2, v3, dv, dvv);
        } else if (j < nv) { /* the last 1-3 keys */
            rows_pv(A, P + j, ls, bq, V + j * vrs, vrs, dv, nv - j, 0, 0, NULL);
        }
    }
}

/* The row kernel; careful = 1 (one row, from redo_nonfinite_rows) marks the
 * weights of hidden keys -0, takes the P . V above, and when the accumulator's
 * scale underflows to 0 keeps only its inf and NaN entries.  It also keeps A
 * as the mean so far (P / l before P . V, A rescaled by l_old alpha / l), not
 * the sum: a sum of many values near the dtype's limit overflows where their
 * mean does not, and such a row comes here after the fast kernels overflow. */
/* The row kernel's start on an item: Qs (bq, dkp) <- its rows times scale,
 * zero-padded; A, As, Ac (bq, dv) <- 0; m, l, lc (bq) <- -inf, 0, 0 (As, Ac
 * after A, lc after l).  Returns the keys its
 * rows may see (item_band), less the ends a mask hides from all (mask_trim). */
static band_t rows_begin(const fa_attention_args *a, const fa_item *it, T *restrict Qs, int64_t dkp,
                         T *restrict A, T *restrict m, T *restrict l)
{
    const int64_t bq = it->bq, dk = a->dk;
    const T *q = it->q, scale = (T)a->scale;
    for (int64_t i = 0; i < bq; i++) {
#if FA_KV
        if (a->q_kv) { /* 16-bit q: widened, then scaled */
            widen_row(Qs + i * dkp, (const KT *)it->q + i * a->q_rs, dk);
            for (int64_t c = 0; c < dk; c++) Qs[i * dkp + c] *= scale;
        } else
#endif
            for (int64_t c = 0; c < dk; c++) Qs[i * dkp + c] = q[i * a->q_rs + c] * scale;
        for (int64_t c = dk; c < dkp; c++) Qs[i * dkp + c] = 0;
        m[i] = -INFINITY;
        l[i] = l[bq + i] = 0;
    }
    memset(A, 0, (size_t)(3 * bq * a->dv) * sizeof(T));
    band_t b = item_band(a, it);
    mask_trim(&b, a, it, Qs, dkp);
    return b;
}

/* The row kernel's end on an item: A and l <- their compensated totals. */
INLINE void rows_end(T *A, T *l, int64_t bq, int64_t dv)
{
    acc_result(A, bq * dv, 0);
    sum_result(l, bq);
}

static void item_rows(const fa_attention_args *a, const fa_tiles *tl, const fa_item *it, void *scratch,
                      int careful)
{
    const int64_t bq = it->bq, bk = tl->bk, dk = a->dk, dv = a->dv;
    const int64_t dkp = (dk + L - 1) / L * L;
    const KT *k = it->k, *v = it->v;
    T *Qs = scratch, *S = Qs + bq * dkp, *A = S + bq * bk, *m = A + 3 * bq * dv, *l = m + bq;
    const int far = tl->far; /* K and V from memory: prefetch into L2, further ahead */
    band_t b = rows_begin(a, it, Qs, dkp, A, m, l);
    int64_t block = 0; /* keys in A's block (FOLD_KEYS) */
    if (bq <= tl->pipe_rows && !careful && b.j_lo < b.j_hi) {
        /* Decoding, and up to pipe_rows rows: software-pipelined over the key
         * tiles, so that the scores of tile t + 1 and P . V of tile t read K and
         * V together (decode_step, rows_step); Sn (bq, bk), after lc, holds the
         * next tile's scores. */
        T *Sn = l + 2 * bq;
        const int pf = bq > 1 || tl->decode_pf; /* 0: decoding without software prefetch of K and V */
        int64_t j0 = b.j_lo, nb = (b.j_hi - j0 < bk) ? b.j_hi - j0 : bk;
        rows_scores(S, bk, Qs, dkp, bq, k + j0 * a->k_rs, a->k_rs, dk, nb, pf ? b.j_hi - j0 : 0, far, NULL);
        rows_softmax(a, it, &b, S, bk, A, m, l, j0, nb, 0);
        for (;;) {
            const int64_t j1 = j0 + nb, nb1 = (b.j_hi - j1 < bk) ? b.j_hi - j1 : bk;
            key_runs kr; /* keys a mask hides (padding): P . V skips them */
            mask_runs(&kr, a, it, j0, nb);
            if (nb1 <= 0) {
                rows_pv_runs(&kr, A, S, bk, bq, v + j0 * a->v_rs, a->v_rs, dv, nb, pf ? b.j_hi - j0 : 0, far, NULL);
                break;
            }
            if (!runs_whole(&kr, nb)) /* the two passes one after the other */
                decode_step_runs(&kr, Sn, Qs, dkp, bq, k + j1 * a->k_rs, a->k_rs, dk, nb1, pf ? b.j_hi - j1 : 0, A,
                                 S, bk, v + j0 * a->v_rs, a->v_rs, dv, nb, pf ? b.j_hi - j0 : 0, far);
            else if (bq == 1)
                decode_step(Sn, Qs, k + j1 * a->k_rs, a->k_rs, dk, nb1, pf ? b.j_hi - j1 : 0, A, S,
                            v + j0 * a->v_rs, a->v_rs, dv, nb, pf ? b.j_hi - j0 : 0, far, tl->inorder);
            else
                rows_step(Sn, bk, Qs, dkp, bq, k + j1 * a->k_rs, a->k_rs, dk, nb1, b.j_hi - j1, A, S,
                          v + j0 * a->v_rs, a->v_rs, dv, nb, b.j_hi - j0, tl->pipe_pf_l2);
            if ((block += nb) >= FOLD_KEYS) { /* the block joins the total (FOLD_KEYS) */
                acc_flush(A, bq * dv, 0);
                block = 0;
            }
            rows_softmax(a, it, &b, Sn, bk, A, m, l, j1, nb1, 0);
            T *t = S;
            S = Sn;
            Sn = t;
            j0 = j1;
            nb = nb1;
        }
        rows_end(A, l, bq, dv);
        write_rows(a, it, A, dv, 1, m, l, 0);
        return;
    }
    for (int64_t j0 = b.j_lo; j0 < b.j_hi && !fa_stopped(a->stop); j0 += bk) {
        const int64_t nb = (b.j_hi - j0 < bk) ? b.j_hi - j0 : bk;
        /* K and V from memory (tl->stream): this tile's V rows prefetched during
         * its scores, the next tile's K rows during its P . V, so that memory
         * streams through both passes.  Faster than each pass prefetching only
         * its own rows from memory, slower in cache, hence only from memory
         * (docs/tuning.md, item_rows). */
        const int64_t nb_next = b.j_hi - (j0 + nb) < bk ? b.j_hi - (j0 + nb) : bk;
        const tile_pf pf_v = {.v = v + j0 * a->v_rs, .nv = nb, .vrs = a->v_rs, .dv = dv};
        const tile_pf pf_k = {.k = k + (j0 + nb) * a->k_rs, .nk = nb_next > 0 ? nb_next : 0,
                              .krs = a->k_rs, .dk = dk};
        const int stream = tl->stream && !careful;
        rows_scores(S, bk, Qs, dkp, bq, k + j0 * a->k_rs, a->k_rs, dk, nb, b.j_hi - j0, far,
                    stream ? &pf_v : NULL);
        rows_softmax(a, it, &b, S, bk, A, m, l, j0, nb, careful);
        /* A += P . V_tile */
        if (careful)
            rows_pv_careful(A, S, v + j0 * a->v_rs, a->v_rs, dv, nb);
        else {
            key_runs kr; /* keys a mask hides from every row (padding): skipped */
            mask_runs(&kr, a, it, j0, nb);
            if (runs_whole(&kr, nb))
                rows_pv(A, S, bk, bq, v + j0 * a->v_rs, a->v_rs, dv, nb, b.j_hi - j0, far,
                        stream ? &pf_k : NULL);
            else
                rows_pv_runs(&kr, A, S, bk, bq, v + j0 * a->v_rs, a->v_rs, dv, nb, b.j_hi - j0, far,
                             stream ? &pf_k : NULL);
            if ((block += nb) >= FOLD_KEYS) { /* the block joins the total (FOLD_KEYS) */
                acc_flush(A, bq * dv, 0);
                block = 0;
            }
        }
    }
    rows_end(A, l, bq, dv);
    write_rows(a, it, A, dv, 1, m, l, careful);
}

void FN(fa_attn_item_rows)(const fa_attention_args *a, const fa_tiles *tl, const fa_item *it,
                           void *scratch)
{
    item_rows(a, tl, it, scratch, 0);
    redo_nonfinite_rows(a, tl, it, scratch);
}
