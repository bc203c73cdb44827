/*
 * The tiled kernel (included by kernel_body.h): many query rows, one work item
 * at a time, with its queries packed transposed so that every softmax step is
 * a vertical SIMD operation across query rows (see kernel_body.h), and the
 * attention-weights kernel built from the same tiles.
 */

/* ---------------------------------------------------------------------------
 * Register-blocked micro-kernels.  R rows of one operand times NV = 2 vectors
 * (TW query columns) of the other: 2R accumulators.  R is at most RB: 6 with
 * 16 registers (12 accumulators, plus two loads and a broadcast: 15 of the 16
 * AVX2 registers), FA_RB64 (12: 24 accumulators and the same three, 27 of 32)
 * with the 32 registers of AVX-512.  NV = 1 (L query columns) serves a last
 * odd vector of query rows, so that bqp is a multiple of L, not of TW: few
 * query rows waste less (5 rows on AVX-512 pad to 16, not 32).  One loop over
 * the head dim serves every d: copies specialised for d = 64 and 128, or the
 * dk loop unrolled by 4, were no faster (docs/tuning.md, RB).  On AVX-512,
 * qk_block has copies for K's row stride 64 and 128 (QK_CONST_KRS): with a
 * constant stride the 12 rows' broadcasts take one base register, where a
 * variable one needs 12 index registers and spills the loop's others.
 * ------------------------------------------------------------------------- */
#ifndef FA_RB64
#define FA_RB64 12
#endif

/* Items of one query vector (bqp == L) under the tuning's tile_spread, float32
 * on AVX-512: register tiles of RBS keys in Q.K^T and of RBS columns of V in
 * P.V (RBS accumulators, no 4-row tail to cover the FMA latency), each issuing
 * its share of the tile's prefetch (tile_pf) an equal part every SPREAD_STEP
 * steps of its products rather than all at once: from memory, a burst of
 * prefetches fills the L1's miss buffers and the products wait behind it
 * (docs/tuning.md, tile_spread). */
#ifndef FA_RBS
#define FA_RBS 16
#endif
enum { RB = FA_VB == 64 ? FA_RB64 : 6, RBS = FA_VB == 64 && !FA_IS_F64 ? FA_RBS : RB, SPREAD_STEP = 8 };

/* The fused exp (pass 4 in fa_attn_item).  A key tile with no score modifier
 * takes its probabilities p = exp(s - m) straight from the accumulator
 * registers of Q.K^T, so that St is written once and never read back for the
 * max and the exp.  m is a reference max per query row, which may lag the true
 * running max by up to FUSE_LAG: the online softmax is exact for any reference
 * (l, Ot and lse all refer to m), and p <= e^24 = 2.6e10 cannot overflow l.
 * Each register tile checks its column max first; where one exceeds
 * m + FUSE_LAG (the first keys of a row, or a score far above all before it),
 * fuse_regrow raises m to the max in every lane that rose and rescales l, Ot and
 * the tile's rows already written.  Scores that keep rising steeply (a ramp of
 * 100 per 256 keys) would rescale at every few register tiles: after 2 such
 * calls per query vector the item goes on unfused.  A row's Ot can overflow
 * only where n_k |v| is within a factor e^24 of the dtype's limit; such a row
 * comes out non-finite and is redone carefully (redo_nonfinite_rows).
 * FUSE_LAG (24): the lag that makes rescaling rare while p <= e^24 keeps l and
 * Ot far from overflow; the unfused pass lags by the same (vstep_begin_lag).
 * The fused exp is faster with the 32 registers of AVX-512; with 16 the exp
 * has no room beside the accumulators and it was slower, so only AVX-512
 * takes it (tl->fuse, from the tuning table in dispatch.c; the tests force it
 * on and off; docs/tuning.md, FUSE_LAG). */
#define FUSE_LAG 24
typedef struct {
    T *m;            /* (bqp) reference max of the item's rows */
    T *l;            /* (bqp) the key tile's row sums, fresh each tile */
    T *lr;           /* (bqp) the running row sums, their compensation at lr + ld */
    T *Ot;           /* (dv, bqp) the output accumulator, its total and compensation after it */
    T *St;           /* (nb, ld) the tile's first row */
    int64_t ld;      /* row stride of Ot and St */
    int64_t arows;   /* rows of Ot to rescale: dv, or 3 dv with its total and compensation */
    int64_t regrows; /* rescaling calls of fuse_regrow in the item so far */
} fuse_t;

/* Called when some lane of bm (the max of a register tile's rows [j, j + R) in
 * the query columns [i, i + L)) exceeds the reference max by more than
 * FUSE_LAG: raise the reference to bm in every lane where bm is above it (so
 * that lanes do not call one by one), and rescale their l, Ot and the
 * probabilities of the tile's rows [0, j) already written.  A row that has
 * seen no finite score (m = -inf) has nothing to rescale: l = 0, and Ot = 0
 * (or NaN from 0 * NaN, which a multiply keeps). */
static __attribute__((noinline)) void fuse_regrow(fuse_t *f, int64_t i, int64_t j, vec bm)
{
    const vec mo = vload(f->m + i);
    const ivec grow = bm > mo;
    vstore(f->m + i, vsel(grow, bm, mo));
    if (!vany(grow & (mo > -INFINITY))) return;
    f->regrows++;
    const vec alpha = vsel(grow, vexp_neg(mo - bm), vset1(1));
    vstore(f->l + i, vload(f->l + i) * alpha);
    scale_rows(f->lr + i, f->ld, 2, alpha);
    scale_rows(f->Ot + i, f->ld, f->arows, alpha);
    scale_rows(f->St + i, f->ld, j, alpha);
}

/* The fused exp of R rows of one query vector (columns [i, i + L)), rows
 * [j, j + R) of the tile: st[r * ld] <- exp(a[r] - m), their sum added to l.
 * Each probability goes straight to St rather than back into a[r], which
 * shortens the registers' lives while the exps of a register tile overlap:
 * a little faster than the write-back (docs/tuning.md, fuse_exp). */
INLINE void fuse_exp(const int R, vec *a, fuse_t *f, int64_t i, int64_t j, T *st, int64_t ld)
{
    vec bm = vset1(-INFINITY);
    UNROLL(16) for (int r = 0; r < R; r++) bm = vmax(a[r], bm);
    if (vany(bm > vload(f->m + i) + (T)FUSE_LAG)) fuse_regrow(f, i, j, bm);
    const vec m = vload(f->m + i);
    const vec mu = vstep_shift(m);
    vec sum = vset1(0);
    UNROLL(16) for (int r = 0; r < R; r++)
    {
        const vec e = vexp_neg(a[r] - mu);
        vstore(st + r * ld, e);
        sum += e;
    }
    vstore(f->l + i, vload(f->l + i) + sum);
}

/* a0[r] (and a1[r] when NV == 2) += sum_c x(r, c) b[c * bs + 0..NV*L) for r < R,
 * x(r, c) = a[r * ars + c * acs]: the rank-one updates of an R x NV register
 * tile, each x broadcast once against one or two vectors of b.  Both products
 * of the tiled kernel: Q.K^T (a: K rows, ars = krs, acs = 1; b: Qt) and P.V (a:
 * V columns, ars = 1, acs = vrs; b: Pt). */
INLINE void tile_products(const int R, const int NV, vec *a0, vec *a1, const T *restrict a, int64_t ars,
                          int64_t acs, const T *restrict b, int64_t bs, int64_t n)
{
    for (int64_t c = 0; c < n; c++) {
        const vec b0 = vload(b + c * bs), b1 = NV == 2 ? vload(b + c * bs + L) : b0;
        UNROLL(16) for (int r = 0; r < R; r++)
        {
            const T x = a[r * ars + c * acs];
            a0[r] += x * b0;
            if (NV == 2) a1[r] += x * b1;
        }
    }
}

/* tile_products with NV = 1, meanwhile the lines of [p, p_end) prefetched (into
 * L1 with l1, else L2), an equal share of them before every SPREAD_STEP steps */
INLINE void tile_products_spread(const int R, vec *a0, const T *restrict a, int64_t ars, int64_t acs,
                                 const T *restrict b, int64_t bs, int64_t n, const char *p, const char *p_end,
                                 int l1)
{
    const int64_t steps = (n + SPREAD_STEP - 1) / SPREAD_STEP;
    const int64_t per = steps > 0 ? ((p_end - p + 63) / 64 + steps - 1) / steps : 0;
    for (int64_t c0 = 0; c0 < n; c0 += SPREAD_STEP) {
        for (int64_t x = 0; x < per && p < p_end; x++, p += 64) {
            if (l1) __builtin_prefetch(p, 0, 3); /* (a constant level in each call) */
            else    __builtin_prefetch(p, 0, 2);
        }
        const int64_t c1 = c0 + SPREAD_STEP < n ? c0 + SPREAD_STEP : n;
        for (int64_t c = c0; c < c1; c++) {
            const vec b0 = vload(b + c * bs);
            UNROLL(16) for (int r = 0; r < R; r++) a0[r] += a[r * ars + c * acs] * b0;
        }
    }
}

/* Whether a tile's prefetch pf can be spread over the register tiles
 * (tile_spread): the table says so, and pf holds rows of one kind only,
 * contiguous (V during Q.K^T, K during P.V), so that each register tile's share
 * is one range of bytes; the last tile's, which adds the output rows or the
 * next item's queries, is issued as before. */
INLINE int spread_v(const tile_pf *pf)
{
    return pf && pf->spread && pf->nv > 0 && pf->vrs == pf->dv && !pf->nk && !pf->nq && !pf->nm && !pf->no;
}
INLINE int spread_k(const tile_pf *pf)
{
    return pf && pf->spread && pf->nk > 0 && pf->krs == pf->dk && !pf->nv && !pf->nq && !pf->nm && !pf->no;
}

/* St[r][0..L) = sum_c kr[r][c] * Qt[c][0..L) for r < R, of one query vector
 * without a mask (qk_tile's NV = 1, i = 0; f: the fused exp), meanwhile the
 * lines [p, p_end) prefetched (tile_products_spread) */
INLINE void qk_tile_spread(const int R, T *st, int64_t bqp, const T *restrict kr, int64_t krs,
                           const T *restrict qt, int64_t dk, fuse_t *f, int64_t j, const char *p,
                           const char *p_end, int l1)
{
    vec a0[RBS];
    UNROLL(16) for (int r = 0; r < R; r++) a0[r] = vset1(0);
    tile_products_spread(R, a0, kr, krs, 1, qt, bqp, dk, p, p_end, l1);
    if (f) {
        fuse_exp(R, a0, f, 0, j, st, bqp);
        return;
    }
    UNROLL(16) for (int r = 0; r < R; r++) vstore(st + r * bqp, a0[r]);
}

/* St[r][0..NV*L) = sum_c kr[r][c] * Qt[c][0..NV*L) (+ mt[r][0..NV*L))   for r < R
 * or, with f, their probabilities (fuse_exp; st is f->St + j * bqp + i):
 *   st  (R, NV*L)   row stride bqp
 *   kr  (R, dk)     row stride krs
 *   qt  (dk, NV*L)  row stride bqp
 *   mt  (R, NV*L)   row stride bqp: a float mask's tile, transposed (mask_tile),
 *                   or NULL; it may be st itself */
INLINE void qk_tile(const int R, const int NV, T *st, int64_t bqp, const T *restrict kr,
                    int64_t krs, const T *restrict qt, int64_t dk, fuse_t *f, const T *mt, int64_t i,
                    int64_t j)
{
    vec a0[RB], a1[RB];
    UNROLL(16) for (int r = 0; r < R; r++) a0[r] = a1[r] = vset1(0);
    tile_products(R, NV, a0, a1, kr, krs, 1, qt, bqp, dk);
    if (mt)
        UNROLL(16) for (int r = 0; r < R; r++)
        {
            a0[r] += vload(mt + r * bqp);
            if (NV == 2) a1[r] += vload(mt + r * bqp + L);
        }
    if (f) {
        fuse_exp(R, a0, f, i, j, st, bqp);
        if (NV == 2) fuse_exp(R, a1, f, i + L, j, st + L, bqp);
        return;
    }
    UNROLL(16) for (int r = 0; r < R; r++)
    {
        vstore(st + r * bqp, a0[r]);
        if (NV == 2) vstore(st + r * bqp + L, a1[r]);
    }
}

/* Ot[c + r][0..NV*L) += sum_j V[j][c + r] * Pt[j][0..NV*L)   for r < R, the
 * tile's sum formed fresh, then added (one rounding a tile, not one a key,
 * against Ot: see FOLD_KEYS):
 *   ot  (R, NV*L)   row stride bqp
 *   pt  (nb, NV*L)  row stride bqp
 *   vc  (nb, R)     row stride vrs (V advanced to column c) */
INLINE void pv_tile(const int R, const int NV, T *restrict ot, int64_t bqp, const T *restrict pt,
                    const T *restrict vc, int64_t vrs, int64_t nb)
{
    vec a0[RB], a1[RB];
    UNROLL(16) for (int r = 0; r < R; r++) a0[r] = a1[r] = vset1(0);
    tile_products(R, NV, a0, a1, vc, 1, vrs, pt, bqp, nb);
    UNROLL(16) for (int r = 0; r < R; r++)
    {
        vstore(ot + r * bqp, vload(ot + r * bqp) + a0[r]);
        if (NV == 2) vstore(ot + r * bqp + L, vload(ot + r * bqp + L) + a1[r]);
    }
}

/* pv_tile of one query vector (NV = 1), meanwhile the lines [p, p_end)
 * prefetched (tile_products_spread) */
INLINE void pv_tile_spread(const int R, T *restrict ot, int64_t bqp, const T *restrict pt,
                           const T *restrict vc, int64_t vrs, int64_t nb, const char *p, const char *p_end, int l1)
{
    vec a0[RBS];
    UNROLL(16) for (int r = 0; r < R; r++) a0[r] = vset1(0);
    tile_products_spread(R, a0, vc, 1, vrs, pt, bqp, nb, p, p_end, l1);
    UNROLL(16) for (int r = 0; r < R; r++) vstore(ot + r * bqp, vload(ot + r * bqp) + a0[r]);
}

/* The rows [R, R + npf) of a float mask's tile Mt (the next register tile's),
 * columns [i, i + w), into L1: mask_cache's kept tiles sit in L2, and qk_tile
 * adds them right after its products (docs/tuning.md, mask_cache). */
INLINE void mt_prefetch(const T *Mt, int64_t ld, const int R, int64_t npf, int64_t i, int64_t w)
{
    for (int64_t r = R; r < R + npf; r++)
        for (int64_t c = 0; c < w * (int64_t)sizeof(T); c += 64)
            __builtin_prefetch((const char *)(Mt + r * ld + i) + c, 0, 3);
}

/* St rows [0, R) over the bqp query columns (row stride ld): two-vector
 * groups, then one vector when bqp is an odd number of vectors; with Mt, its
 * npf rows after these prefetched as they go (mt_prefetch). */
INLINE void qk_rows(const int R, T *St, const T *restrict K, int64_t krs,
                    const T *restrict Qt, int64_t ld, int64_t bqp, int64_t dk, fuse_t *f, const T *Mt,
                    int64_t j, int64_t npf)
{
    int64_t i = 0;
    for (; i + TW <= bqp; i += TW) {
        if (Mt) mt_prefetch(Mt, ld, R, npf, i, TW);
        qk_tile(R, 2, St + i, ld, K, krs, Qt + i, dk, f, Mt ? Mt + i : NULL, i, j);
    }
    if (i < bqp) {
        if (Mt) mt_prefetch(Mt, ld, R, npf, i, L);
        qk_tile(R, 1, St + i, ld, K, krs, Qt + i, dk, f, Mt ? Mt + i : NULL, i, j);
    }
}

/* Where the register tiles of RB rows end among n rows; 4-row tiles, then
 * single rows, take the rest.  A rest of 1-3 single rows takes one RB tile
 * with it where 4-row tiles then leave fewer single rows (with RB 6: 8 = 4 + 4,
 * 9 = 4 + 4 + 1): a single row has too few accumulators to cover the FMA
 * latency (docs/tuning.md, rb_tiles_end). */
INLINE int64_t rb_tiles_end(int64_t n)
{
    const int64_t rem = n % RB, end = n - rem;
    return rem > 0 && rem < 4 && end >= RB && (RB + rem) % 4 < rem ? end - RB : end;
}

/* St (nb, bqp) = K[0..nb) . Qt (+ Mt);  K (nb, dk) row stride krs, Qt (dk, bqp),
 * Mt (nb, bqp) a float mask's tile transposed or NULL (it may be St); St, Qt and
 * Mt have row stride ld.  Or, with f (f->St == St), their probabilities (the
 * fused exp).  Meanwhile prefetches pf's rows (NULL: none). */
INLINE void qk_block_body(T *St, const T *restrict K, int64_t krs, const T *restrict Qt, int64_t ld,
                          int64_t bqp, int64_t dk, int64_t nb, const tile_pf *pf, fuse_t *f, const T *Mt)
{
    int64_t j = 0;
    if (RBS > RB && bqp == L && !Mt && spread_v(pf)) /* (tile_spread) */
        for (; j + RBS <= nb; j += RBS) {
            const KT *v1 = pf->v + (j + RBS < pf->nv ? j + RBS : pf->nv) * pf->vrs;
            qk_tile_spread(RBS, St + j * ld, ld, K + j * krs, krs, Qt, dk, f, j,
                           (const char *)(pf->v + j * pf->vrs), (const char *)v1, pf->l1);
        }
    const int64_t end = j + rb_tiles_end(nb - j);
#define QK_MT(j) (Mt ? Mt + (j) * ld : NULL)
    for (; j < end; j += RB) {
        if (pf) tile_prefetch(pf, j, RB);
        /* Mt's rows of the next register tile (a kept tile's: St's are in L1) */
        const int64_t npf = Mt == St ? 0 : nb - j - RB < RB ? nb - j - RB : RB;
        qk_rows(RB, St + j * ld, K + j * krs, krs, Qt, ld, bqp, dk, f, QK_MT(j), j, npf);
    }
    if (pf) tile_prefetch(pf, j, INT64_MAX - j); /* the rest, also rows past nb */
    for (; j + 4 <= nb; j += 4)
        qk_rows(4, St + j * ld, K + j * krs, krs, Qt, ld, bqp, dk, f, QK_MT(j), j,
                Mt == St ? 0 : nb - j - 4 < 4 ? nb - j - 4 : 4);
    for (; j < nb; j++) qk_rows(1, St + j * ld, K + j * krs, krs, Qt, ld, bqp, dk, f, QK_MT(j), j, 0);
#undef QK_MT
}

/* qk_block_body, with K's row stride a constant where it is 64 or 128
 * (QK_CONST_KRS, see the top of this file) */
#ifndef QK_CONST_KRS
#define QK_CONST_KRS (FA_VB == 64)
#endif
static void qk_block(T *St, const T *restrict K, int64_t krs, const T *restrict Qt, int64_t ld,
                     int64_t bqp, int64_t dk, int64_t nb, const tile_pf *pf, fuse_t *f, const T *Mt)
{
    if (QK_CONST_KRS && krs == 128) qk_block_body(St, K, 128, Qt, ld, bqp, dk, nb, pf, f, Mt);
    else if (QK_CONST_KRS && krs == 64) qk_block_body(St, K, 64, Qt, ld, bqp, dk, nb, pf, f, Mt);
    else qk_block_body(St, K, krs, Qt, ld, bqp, dk, nb, pf, f, Mt);
}

/* Ot columns [i, i + NV*L) += Pt^T-contracted with V, over all dv rows of Ot;
 * meanwhile prefetches pf's rows (NULL: none; pf->nv must be 0). */
INLINE void pv_cols(const int NV, T *restrict Ot, const T *restrict Pt, const T *restrict V,
                    int64_t vrs, int64_t ld, int64_t dv, int64_t nb, const tile_pf *pf)
{
    int64_t c = 0;
    if (RBS > RB && NV == 1 && spread_k(pf)) /* (tile_spread; each tile's rows as prefetch_in_step's) */
        for (; c + RBS <= dv; c += RBS) {
            const KT *k0 = pf->k + c * pf->nk / dv * pf->krs, *k1 = pf->k + (c + RBS) * pf->nk / dv * pf->krs;
            pv_tile_spread(RBS, Ot + c * ld, ld, Pt, V + c, vrs, nb, (const char *)k0, (const char *)k1, pf->l1);
        }
    const int64_t end = c + rb_tiles_end(dv - c);
    for (; c < end; c += RB) {
        if (pf) prefetch_in_step(pf, c, c + RB, dv);
        pv_tile(RB, NV, Ot + c * ld, ld, Pt, V + c, vrs, nb);
    }
    if (pf) prefetch_in_step(pf, c, dv, dv); /* the rest */
    for (; c + 4 <= dv; c += 4) pv_tile(4, NV, Ot + c * ld, ld, Pt, V + c, vrs, nb);
    for (; c < dv; c++) pv_tile(1, NV, Ot + c * ld, ld, Pt, V + c, vrs, nb);
}

/* Ot (dv, bqp) += (Pt (nb, bqp))^T-contracted with V (nb, dv) row stride vrs;
 * Ot and Pt have row stride ld.  Meanwhile prefetches pf's K and query rows
 * (NULL: none), over the first group of query columns. */
static void pv_block(T *restrict Ot, const T *restrict Pt, const T *restrict V, int64_t vrs,
                     int64_t ld, int64_t bqp, int64_t dv, int64_t nb, const tile_pf *pf)
{
    int64_t i = 0;
    for (; i + TW <= bqp; i += TW, pf = NULL) pv_cols(2, Ot + i, Pt + i, V, vrs, ld, dv, nb, pf);
    if (i < bqp) pv_cols(1, Ot + i, Pt + i, V, vrs, ld, dv, nb, pf);
}

/* PV_ROWS: an item of one query vector (bqp == L), unfused, keeps its
 * accumulator in rows, A (ld, dv) in the place of Ot (dv, ld), and takes P.V by
 * pv_block_rows: each p broadcast serves two V vectors, and a V vector loaded
 * once serves up to 4 rows, where Ot's single-vector tile broadcasts one V
 * element an FMA, and on AVX2 the broadcasts, not the FMAs, bound it
 * (docs/tuning.md, PV_ROWS). */
#ifndef PV_ROWS
#define PV_ROWS (FA_VB == 32)
#endif

/* A[r][0..NV*L) += sum_j Pt[j][r] * V[j][0..NV*L)   for r < R, the tile's sum
 * formed fresh, then added (FOLD_KEYS):
 *   a   (R, NV*L)   row stride dv
 *   pt  (nb, R)     row stride ld (St's columns of these rows)
 *   vc  (nb, NV*L)  row stride vrs (V advanced to the tile's column) */
INLINE void pv_rows_tile(const int R, const int NV, T *restrict a, int64_t dv, const T *restrict pt,
                         int64_t ld, const T *restrict vc, int64_t vrs, int64_t nb, const tile_pf *pf,
                         int64_t r0, int64_t r1)
{
    vec acc[4][2];
    UNROLL(4) for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = vset1(0);
    /* pf's rows [r0, r1) (pf NULL: none), one every few keys */
    const int64_t every = r1 > r0 ? (nb + r1 - r0 - 1) / (r1 - r0) : 0;
    int64_t next = pf && r1 > r0 ? 0 : INT64_MAX;
    for (int64_t j = 0; j < nb; j++) {
        if (j == next) {
            tile_prefetch(pf, r0++, 1);
            next = r0 < r1 ? next + every : INT64_MAX;
        }
        const vec v0 = vload(vc + j * vrs), v1 = NV == 2 ? vload(vc + j * vrs + L) : v0;
        UNROLL(4) for (int r = 0; r < R; r++)
        {
            const T p = pt[j * ld + r]; /* scalar x vector: a broadcast */
            acc[r][0] += p * v0;
            if (NV == 2) acc[r][1] += p * v1;
        }
    }
    UNROLL(4) for (int r = 0; r < R; r++)
    {
        vstore(a + r * dv, vload(a + r * dv) + acc[r][0]);
        if (NV == 2) vstore(a + r * dv + L, vload(a + r * dv + L) + acc[r][1]);
    }
}

/* pv_rows_tile for the nrows rows of A, four at a time, over the columns
 * [c, c + NV L) */
INLINE void pv_rows_cols(const int NV, T *restrict A, int64_t dv, const T *restrict Pt, int64_t ld,
                         int64_t nrows, const T *restrict V, int64_t vrs, int64_t nb, int64_t c,
                         const tile_pf *pf)
{
    /* pf's rows in step with the columns (prefetch_in_step), spread over the keys */
    const int64_t n = pf ? (pf->nk > pf->nq ? pf->nk : pf->nq) : 0, w = NV * L;
#define PV_PF_ROW(x) (pf ? ((c + (x) * w / nrows) < dv ? (c + (x) * w / nrows) * n / dv : n) : 0)
#define PV_ROWS_TILE(R, i_end)                                                                          \
    pv_rows_tile(R, NV, A + i * dv + c, dv, Pt + i, ld, V + c, vrs, nb, pf, PV_PF_ROW(i), PV_PF_ROW(i_end))
    int64_t i = 0;
    for (; i + 4 <= nrows; i += 4) PV_ROWS_TILE(4, i + 4);
    switch (nrows - i) {
    case 3: PV_ROWS_TILE(3, nrows); break;
    case 2: PV_ROWS_TILE(2, nrows); break;
    case 1: PV_ROWS_TILE(1, nrows); break;
    default: break;
    }
#undef PV_ROWS_TILE
#undef PV_PF_ROW
}

/* A (nrows, dv) += (Pt (nb, ld) columns [0, nrows))^T-contracted with V (nb, dv)
 * row stride vrs: two vectors of columns at a time (the rows four at a time
 * within), one, then the last dv % L columns; pf's rows (NULL: none) in step
 * with the columns. */
static void pv_block_rows(T *restrict A, const T *restrict Pt, const T *restrict V, int64_t vrs,
                          int64_t ld, int64_t nrows, int64_t dv, int64_t nb, const tile_pf *pf)
{
    int64_t c = 0;
    for (; c + 2 * L <= dv; c += 2 * L) pv_rows_cols(2, A, dv, Pt, ld, nrows, V, vrs, nb, c, pf);
    if (pf) prefetch_in_step(pf, c, dv, dv); /* the rest */
    if (c + L <= dv) {
        pv_rows_cols(1, A, dv, Pt, ld, nrows, V, vrs, nb, c, NULL);
        c += L;
    }
    for (; c < dv; c++)
        for (int64_t i = 0; i < nrows; i++) {
            T s = 0;
            for (int64_t j = 0; j < nb; j++) s += Pt[j * ld + i] * V[j * vrs + c];
            A[i * dv + c] += s;
        }
}

enum { Q_PF_BYTES = 65536 }; /* pack_queries' prefetch, at most: twice a 32 KiB L1 */
/* Pack the item's queries, times scale, transposed and zero-padded:
 *   Qt (dk, bqp) row stride ld <- q (bq, dk) row stride q_rs
 * L x L blocks in registers (bqp is a whole number of vectors; rows past bq
 * are zeros), then the columns past the last whole vector one by one. */
static void pack_queries(const fa_attention_args *a, const fa_tiles *tl, const fa_item *it, void *scratch, T *Qt,
                         int64_t ld, int64_t bqp)
{
    const T *q = it->q;
    int64_t q_rs = a->q_rs;
    const T scale = (T)a->scale;
    const int64_t bq = it->bq, dk = a->dk;
#if FA_KV
    if (a->q_kv) { /* 16-bit q: its rows widened first (tl->q_off), then packed as float32 */
        T *qw = (T *)scratch + tl->q_off;
        for (int64_t i = 0; i < bq; i++) widen_row(qw + i * dk, (const KT *)it->q + i * a->q_rs, dk);
        q = qw;
        q_rs = dk;
    }
#else
    (void)tl, (void)scratch;
#endif
    /* The rows into L1 first, so that their misses overlap: the transpose reads
     * one line of each row at a time, and an item of few keys (BERT's 128)
     * waits on them (docs/tuning.md, pack_queries). */
    if (bq * dk * (int64_t)sizeof(T) <= Q_PF_BYTES)
        for (int64_t i = 0; i < bq; i++) prefetch_lines(q + i * q_rs, dk, (int64_t)sizeof(T), q_rs != dk, 1);
    int64_t c0 = 0;
    for (; c0 + L <= dk; c0 += L)
        for (int64_t i0 = 0; i0 < bqp; i0 += L) {
            vec r[L];
            UNROLL(16) for (int x = 0; x < L; x++)
                r[x] = i0 + x < bq ? vload(q + (i0 + x) * q_rs + c0) * scale : vset1(0);
            transpose_block(r);
            UNROLL(16) for (int x = 0; x < L; x++) vstore(Qt + (c0 + x) * ld + i0, r[x]);
        }
    for (int64_t c = c0; c < dk; c++) {
        for (int64_t i = 0; i < bq; i++) Qt[c * ld + i] = q[i * q_rs + c] * scale;
        for (int64_t i = bq; i < bqp; i++) Qt[c * ld + i] = 0;
    }
}

/* ---------------------------------------------------------------------------
 * mask_cache: a float mask that the heads share, with the items of a query block
 * going head by head (fa_plan.head_turns).  The first item on a block's mask rows
 * keeps each tile transposed (all of them at its start, mask_cache_fill, where the
 * mask's rows are contiguous; else each as mask_tile transposes it), with the
 * tile's key runs and whether the mask hides it all; the next items on the same
 * rows (the other heads: the header says whose tiles they are) add the kept tile
 * to their scores as the products store them, instead of transposing it and
 * adding it in a pass over St of its own.  At tl->mt_off in the scratch (fa_mt_cache_elems):
 *   head  (64 bytes)      whose tiles: the mask rows' first element, the item's
 *                         keys and rows; mask NULL: none (attention.c clears it)
 *   rec   (tiles) mask_rec, FA_MT_REC_BYTES reserved a tile: key runs, hidden flag
 *   Mt    (tiles, bk, ld) the tiles transposed (a hidden tile's are not read)
 * with tiles = ceil(nk / bk).
 * ------------------------------------------------------------------------- */
typedef struct {
    const void *mask;
    int64_t j_lo, j_hi, bq, pad[4];
} mask_head;
typedef struct {
    key_runs kr;
    int hidden;
} mask_rec;
typedef struct {
    int state;  /* 0: no cache, 1: this item keeps its tiles, 2: it reads them */
    int filled; /* state 1, all its tiles transposed at the start (mask_cache_fill) */
    int64_t bk;
    mask_head *head;
    mask_rec *rec;
    T *Mt;
} mask_cache;
_Static_assert(sizeof(mask_head) == FA_MT_HEAD_BYTES && sizeof(mask_rec) <= FA_MT_REC_BYTES,
               "the sizes of fa_mt_cache_elems");

/* The item's cache: kept by an item before on the same mask rows and keys
 * (state 2), or to be kept by this one (1; the header cleared until it is done). */
static mask_cache mask_cache_open(const fa_attention_args *a, const fa_tiles *tl, const fa_item *it,
                                  void *scratch, const band_t *b)
{
    mask_cache mc = {.state = 0};
    if (!tl->mt_off) return mc;
    mc.bk = tl->bk;
    mc.head = (mask_head *)((T *)scratch + tl->mt_off);
    mc.rec = (mask_rec *)(mc.head + 1);
    mc.Mt = (T *)((char *)mc.rec + FA_MT_REC_BYTES * ((a->nk + tl->bk - 1) / tl->bk));
    const mask_head *h = mc.head;
    mc.state = h->mask == it->mask && h->j_lo == b->j_lo && h->j_hi == b->j_hi && h->bq == it->bq ? 2 : 1;
    if (mc.state == 1) mc.head->mask = NULL;
    return mc;
}

/* State 1 on a mask whose rows are contiguous: every tile of the item's keys
 * transposed into the cache at the start, bit for bit as mask_tile (set)
 * stores a tile, but L rows at a time across all the keys, so that each mask
 * row streams in order (a tile's rows are a mask row apart, each on a page of
 * its own: docs/tuning.md, mask_cache).  The tiles' key runs and hidden flags
 * come later, from the kept tiles (mask_rec_from_tile). */
static void mask_cache_fill(const fa_attention_args *a, const fa_item *it, const band_t *b, const mask_cache *mc,
                            int64_t ld)
{
    const int64_t bq = it->bq, bk = mc->bk, mrs = a->m_rs;
    for (int64_t i0 = 0; i0 < bq; i0 += L) {
        const int64_t n = bq - i0 < L ? bq - i0 : L; /* rows of this group; the rest pad with -inf, or 0 */
        const T *mrow = (const T *)it->mask + i0 * mrs;
        for (int64_t j0 = b->j_lo; j0 < b->j_hi; j0 += bk) {
            const int64_t nb = b->j_hi - j0 < bk ? b->j_hi - j0 : bk;
            T *Mc = mc->Mt + (j0 - b->j_lo) / bk * bk * ld + i0;
            int64_t j = 0;
            for (; j + L <= nb; j += L) { /* (the key runs: mask_rec_from_tile, later) */
                if (n == L) mask_block(1, Mc + j * ld, ld, mrow + j0 + j, mrs, L, 0, 1, 0, NULL);
                else        mask_block(0, Mc + j * ld, ld, mrow + j0 + j, mrs, n, 0, 1, 0, NULL);
            }
            for (; j < nb; j++)
                for (int64_t x = 0; x < L; x++) Mc[j * ld + x] = x < n ? mrow[x * mrs + j0 + j] : 0;
        }
    }
}

/* A kept tile's record, from the tile (nb, ld) itself: the keys where some
 * real row (< bq) is not -inf, and whether there are none (mask_tile_hidden). */
static void mask_rec_from_tile(mask_rec *rec, const T *Mc, int64_t ld, int64_t bq, int64_t nb)
{
    const int64_t bqv = bq / L * L;
    int any = 0;
    rec->kr.n = 0;
    rec->kr.start = -1;
    for (int64_t j = 0; j < nb; j++) {
        const T *row = Mc + j * ld;
        ivec s = (ivec)vset1(0);
        for (int64_t i = 0; i < bqv; i += L) s |= vload(row + i) != vset1(-INFINITY);
        int seen = vany(s);
        for (int64_t i = bqv; i < bq && !seen; i++) seen = row[i] != -INFINITY;
        key_runs_add(&rec->kr, j, seen);
        any |= seen;
    }
    key_runs_add(&rec->kr, nb, 0);
    rec->hidden = !any;
}

/* Scores of the key tile [j0, j0 + nb) for the item's rows:
 *   St (nb, bqp) = K_tile . Qt (Qt already scaled; both row stride ld), then softcap, ALiBi,
 *   float mask and the band (causal, window), on every lane or the real rows.
 * A bool mask is packed into bit words W (ceil(nb / 32), ld) for the caller
 * to apply.  With f, a tile that has none of those modifiers but a float mask
 * (nor a bool mask with a False in it) gets its probabilities instead (the
 * fused exp, FUSE_LAG; the float mask stored in St first, for qk_tile to add).
 * Returns -1 when the bool mask forbids the whole tile, or the float mask is
 * -inf throughout it and no score there can be NaN or +inf (hidden_tile_skips;
 * qmax is max |Qt|, or -1 until known): St is not computed; 2 when St holds the fused
 * probabilities, 1 when W must be applied, 0 otherwise.  Under a float mask,
 * kr gets the keys that some row sees (mask_tile); otherwise it is left as it
 * is.  mc: the item's mask_cache (NULL: none), of which this is tile
 * (j0 - j_lo) / bk.  pf: prefetched during Q.K^T (NULL: none, and mask_tile
 * prefetches the next tile's mask rows itself, which fa_attn_item's P.V does). */
static int tile_scores(const fa_attention_args *a, const fa_item *it, const band_t *b, T *St,
                       const T *Qt, T *qmax, IT *W, int64_t ld, int64_t bqp, int64_t j0, int64_t nb,
                       const T *K, int64_t krs, const tile_pf *pf, fuse_t *f, const mask_cache *mc,
                       key_runs *kr)
{
    const int64_t bq = it->bq;
    int bits = 0;
    if (a->mask_kind == FA_MASK_BOOL) {
        const int kind = mask_bits(W, ld, (const uint8_t *)it->mask + j0 * a->m_cs, a->m_rs, a->m_cs, it->mbits,
                                   it->mb_rs, j0, bq, nb);
        if (kind == 0) return -1;
        bits = kind == 1;
    }
    const T *mk = a->mask_kind == FA_MASK_ADD ? (const T *)it->mask + j0 * a->m_cs : NULL;
    const T *Mt = NULL; /* the tile transposed, for the products to add */
    if (mk) {
        const int64_t tile = mc && mc->state ? (j0 - b->j_lo) / mc->bk : -1;
        mask_rec *rec = tile >= 0 ? mc->rec + tile : NULL;
        int hidden;
        if (rec && mc->filled) /* (its tile already kept) */
            mask_rec_from_tile(rec, mc->Mt + tile * mc->bk * ld, ld, bq, nb);
        if (rec && (mc->state == 2 || mc->filled))
            hidden = rec->hidden;
        else {
            hidden = mask_tile_hidden(mk, a->m_rs, a->m_cs, bq, nb);
            if (rec) rec->hidden = hidden;
        }
        if (hidden && hidden_tile_skips(K, krs, a->dk, nb, Qt, ld, bqp, qmax)) return -1;
        if (rec && !hidden) {
            T *Mc = mc->Mt + tile * mc->bk * ld;
            if (mc->state == 1 && !mc->filled)
                mask_tile(Mc, ld, mk, a->m_rs, a->m_cs, bq, bqp, nb, 1, !pf, &rec->kr);
            *kr = rec->kr;
            Mt = Mc;
        }
    }
    /* band: key j hides the rows before the first at position j - right, and
     * those from the first at position j + left + 1 on (band_first_row) */
    const int cut_right = b->has_right && j0 + nb - 1 > band_pos(b, 0) + b->right;
    const int cut_left = b->has_left && j0 < band_pos(b, bq - 1) - b->left;
    if (f && !bits && !cut_right && !cut_left && !(a->softcap > 0) && it->slope == 0) {
        if (mk && !Mt) { /* the mask into St first, for qk_tile to add */
            mask_tile(St, ld, mk, a->m_rs, a->m_cs, bq, bqp, nb, 1, !pf, kr);
            Mt = St;
        }
        qk_block(St, K, krs, Qt, ld, bqp, a->dk, nb, pf, f, Mt);
        return 2;
    }
    qk_block(St, K, krs, Qt, ld, bqp, a->dk, nb, pf, NULL, Mt); /* (Mt: no softcap nor ALiBi, plan.c) */
    if (a->softcap > 0) {
        const T c = (T)a->softcap, ic = 1 / c;
        for (int64_t j = 0; j < nb; j++)
            for (int64_t i = 0; i < bqp; i += L) vstore(St + j * ld + i, vtanh(vload(St + j * ld + i) * ic) * c);
    }
    if (it->slope != 0 && b->g == 1) { /* ALiBi: s -= slope * |p(i) - j|, p(i) = p(0) + i */
        const T slope = (T)it->slope;
        const int64_t p0 = band_pos(b, 0);
        T io[L];
        for (int r = 0; r < L; r++) io[r] = (T)r;
        const vec iota = vload(io);
        for (int64_t j = 0; j < nb; j++)
            for (int64_t i = 0; i < bqp; i += L) {
                const vec d = iota + (T)(p0 + i - (j0 + j));
                vstore(St + j * ld + i, vload(St + j * ld + i) - slope * vsel(d < 0, -d, d));
            }
    } else if (it->slope != 0) { /* rows sharing positions (the fold leaves out ALiBi) */
        for (int64_t j = 0; j < nb; j++)
            for (int64_t i = 0; i < bq; i++) {
                const int64_t d = band_pos(b, i) - (j0 + j);
                St[j * ld + i] -= (T)it->slope * (T)(d < 0 ? -d : d);
            }
    }
    if (mk && !Mt) mask_tile(St, ld, mk, a->m_rs, a->m_cs, bq, bqp, nb, 0, !pf, kr);
    if (cut_right || cut_left)
        for (int64_t j = 0; j < nb; j++) {
            const int64_t jj = j0 + j;
            if (cut_right)
                for (int64_t i = 0, hide = band_first_row(b, jj - b->right, bq); i < hide; i++)
                    St[j * ld + i] = -INFINITY;
            if (cut_left)
                for (int64_t i = band_first_row(b, jj + b->left + 1, bq); i < bq; i++) St[j * ld + i] = -INFINITY;
        }
    return bits;
}

/* pv_block over the key ranges of kr (n >= 0), pf's rows during the first
 * (pointers as pv_block's, at the tile's first key); with rows > 0, Ot is in
 * rows (PV_ROWS) and pv_block_rows takes that many.  Off the common path, as
 * rows_pv_runs: a second call of pv_block in fa_attn_item made gcc stop
 * inlining it. */
static __attribute__((noinline)) void pv_block_runs(const key_runs *kr, T *restrict Ot, const T *restrict Pt,
                                                    const T *restrict V, int64_t vrs, int64_t ld, int64_t bqp,
                                                    int64_t dv, const tile_pf *pf, int64_t rows)
{
    for (int r = 0; r < kr->n; r++) {
        const int64_t j = kr->run[r][0];
        if (rows) /* Ot in rows (pv_block_rows) */
            pv_block_rows(Ot, Pt + j * ld, V + j * vrs, vrs, ld, rows, dv, kr->run[r][1] - j, r == 0 ? pf : NULL);
        else
            pv_block(Ot, Pt + j * ld, V + j * vrs, vrs, ld, bqp, dv, kr->run[r][1] - j, r == 0 ? pf : NULL);
    }
}

/* The step of tile_softmax: the reference max m moves only in the lanes where
 * the tile's max bm exceeds it by more than FUSE_LAG (the fused exp's rule), so
 * that l and Ot are rescaled rarely, not at most tiles of a row whose max
 * creeps up; alpha is 1 in the other lanes.  The probabilities, up to e^24,
 * come out as they would with the true max times a constant, which l cancels
 * (overflow: redo_nonfinite_rows, as under the fused exp). */
INLINE vstep_t vstep_begin_lag(vec mo, vec bm)
{
    vstep_t s;
    const ivec grow = bm > mo + (T)FUSE_LAG;
    s.mn = vsel(grow, bm, mo);
    s.mu = vstep_shift(s.mn);
    s.alpha = vsel(grow, vexp_neg(mo - s.mu), vset1(1));
    return s;
}

/* Ot in rows (PV_ROWS): row i0 + r of each of the nblk blocks (ld, dv) of A,
 * its total and compensation (FOLD_KEYS) times lane r of alpha, where that is
 * not 1 (NaN included) */
static __attribute__((noinline)) void scale_acc_rows(T *A, int64_t ld, int64_t dv, int64_t nblk, vec alpha,
                                                     int64_t i0)
{
    T al[L];
    memcpy(al, &alpha, sizeof al);
    for (int r = 0; r < L; r++) {
        if (al[r] == 1) continue;
        for (int64_t x = 0; x < nblk; x++) {
            T *row = A + x * ld * dv + (i0 + r) * dv;
            for (int64_t c = 0; c < dv; c++) row[c] *= al[r];
        }
    }
}

/* Pass 4 of fa_attn_item for NV (1 or 2) vectors of query rows, the columns
 * [i, i + NV L) of the key tile's scores St (nb, ld): a bool mask's bits W
 * applied (bits), each row's max, the probabilities exp(s - m) in place, m
 * (lagging: vstep_begin_lag) and l updated (l's compensation at l + ld), the
 * arows rows of Ot (dv, ld) and its total and compensation (FOLD_KEYS)
 * rescaled where m moved (rows_dv > 0: Ot in rows, arows / rows_dv blocks
 * (ld, rows_dv): scale_acc_rows).  Two vectors (a cache line's worth with
 * AVX2) walk the rows of St once, not twice: a little faster than one vector
 * at a time (docs/tuning.md, tile_softmax). */
INLINE void tile_softmax(const int NV, T *St, const IT *W, int bits, int64_t ld, int64_t nb, T *m, T *l,
                         T *Ot, int64_t arows, int64_t i, int64_t rows_dv)
{
    vec bm[2], sum[2];
    vstep_t st[2];
    UNROLL(2) for (int v = 0; v < NV; v++) bm[v] = vset1(-INFINITY);
    if (bits) {
        for (int64_t j = 0; j < nb; j++)
            UNROLL(2) for (int v = 0; v < NV; v++) {
                const vec s = masked_scores(St, W, ld, i + v * L, j);
                vstore(St + j * ld + i + v * L, s);
                bm[v] = vmax(s, bm[v]);
            }
    } else {
        for (int64_t j = 0; j < nb; j++)
            UNROLL(2) for (int v = 0; v < NV; v++) bm[v] = vmax(vload(St + j * ld + i + v * L), bm[v]);
    }
    UNROLL(2) for (int v = 0; v < NV; v++) {
        st[v] = vstep_begin_lag(vload(m + i + v * L), bm[v]);
        vstore(m + i + v * L, st[v].mn);
        sum[v] = vset1(0);
    }
    for (int64_t j = 0; j < nb; j++)
        UNROLL(2) for (int v = 0; v < NV; v++) {
            T *sj = St + j * ld + i + v * L;
            const vec p = vexp_neg(vload(sj) - st[v].mu);
            vstore(sj, p);
            sum[v] += p;
        }
    UNROLL(2) for (int v = 0; v < NV; v++) {
        if (!vall(st[v].alpha == vset1(1))) { /* only when some max grew */
            scale_rows(l + i + v * L, ld, 2, st[v].alpha);
            if (rows_dv)
                scale_acc_rows(Ot, ld, rows_dv, arows / rows_dv, st[v].alpha, i + v * L);
            else
                scale_rows(Ot + i + v * L, ld, arows, st[v].alpha);
        }
        vacc_add(l + i + v * L, l + ld + i + v * L, sum[v]);
    }
}

/* 16-bit K and V (FA_KV) as the tiled and weights kernels read them: float32
 * rows in the thread's scratch, from tl->kv_off on: a header (kv_head), then
 * tl->kv_rows rows of K (Kc) and of V (Vc).  The header says whose rows they are
 * (an item's K and V pointers: its leading index) and which keys, [lo, hi); the
 * next item of the same leading index (its next query block) reuses them and
 * widens only the keys past hi, so that a leading index's keys are widened
 * about once a thread, not once a query block (a measurable share of a
 * prefill: docs/tuning.md, kv_rows_widened).  Where an item's keys exceed kv_rows (K and
 * V beyond FA_KV_CACHE_BYTES), each key tile is widened as it comes instead;
 * where keys move on past kv_rows (a window), the rows start again.
 * attention.c zeroes the header before a thread's first item. */
typedef struct {
    const void *k, *v; /* the item's K and V (v NULL: K only, the weights kernel) */
    int64_t lo, hi;    /* the keys widened: key j is row j - lo of Kc and Vc */
} kv_head;
_Static_assert(sizeof(kv_head) <= FA_KV_HEAD * sizeof(float), "kv_head fits FA_KV_HEAD elements");

/* Make the keys [lo, hi) of the item widened in place of a key tile at a time
 * (returns 1), or 0 where they exceed kv_rows (or K and V are stored as T). */
static int kv_rows_widened(const fa_attention_args *a, const fa_tiles *tl, const fa_item *it, void *scratch,
                           int64_t lo, int64_t hi, int with_v)
{
#if FA_KV
    kv_head *h = (kv_head *)((T *)scratch + tl->kv_off);
    T *Kc = (T *)scratch + tl->kv_off + FA_KV_HEAD, *Vc = Kc + tl->kv_rows * a->dk;
    const KT *k = it->k, *v = with_v ? it->v : NULL;
    if (hi - lo > tl->kv_rows) {
        h->k = NULL; /* a key tile at a time: Kc's rows are the tile's */
        return 0;
    }
    if (h->k != it->k || h->v != (const void *)v || lo < h->lo || lo > h->hi || hi - h->lo > tl->kv_rows) {
        h->k = it->k; /* another leading index, or keys that do not follow on: start again */
        h->v = v;
        h->lo = h->hi = lo;
    }
    for (int64_t j = h->hi; j < hi; j++) {
        widen_row(Kc + (j - h->lo) * a->dk, k + j * a->k_rs, a->dk);
        if (v) widen_row(Vc + (j - h->lo) * a->dv, v + j * a->v_rs, a->dv);
    }
    if (a->stats && hi > h->hi) __atomic_fetch_add(&a->stats->kv_widened, hi - h->hi, __ATOMIC_RELAXED);
    if (hi > h->hi) h->hi = hi;
    return 1;
#else
    (void)a, (void)tl, (void)it, (void)scratch, (void)lo, (void)hi, (void)with_v;
    return 0;
#endif
}

/* The K (and with V, V) rows of key tile [j0, j0 + nb) as the products read
 * them: in place; with 16-bit K and V, the widened rows (cached: those of
 * kv_rows_widened), or this tile's rows widened now.  Returns K; *krs, and with V
 * *V and *vrs, are set. */
INLINE const T *tile_kv(const fa_attention_args *a, const fa_tiles *tl, const fa_item *it, void *scratch,
                        int cached, int64_t j0, int64_t nb, int64_t *krs, const T **V, int64_t *vrs)
{
#if FA_KV
    const kv_head *h = (const kv_head *)((T *)scratch + tl->kv_off);
    T *Kc = (T *)scratch + tl->kv_off + FA_KV_HEAD, *Vc = Kc + tl->kv_rows * a->dk;
    const int64_t r = cached ? j0 - h->lo : 0;
    if (!cached) {
        for (int64_t j = 0; j < nb; j++) {
            widen_row(Kc + j * a->dk, (const KT *)it->k + (j0 + j) * a->k_rs, a->dk);
            if (V) widen_row(Vc + j * a->dv, (const KT *)it->v + (j0 + j) * a->v_rs, a->dv);
        }
        if (a->stats) __atomic_fetch_add(&a->stats->kv_widened, nb, __ATOMIC_RELAXED);
    }
    *krs = a->dk;
    if (V) {
        *V = Vc + r * a->dv;
        *vrs = a->dv;
    }
    return Kc + r * a->dk;
#else
    (void)tl, (void)scratch, (void)cached, (void)nb;
    *krs = a->k_rs;
    if (V) {
        *V = (const T *)it->v + j0 * a->v_rs;
        *vrs = a->v_rs;
    }
    return (const T *)it->k + j0 * a->k_rs;
#endif
}

/* ---------------------------------------------------------------------------
 * One attention work item (see fa_item in internal.h for q, k, v, mask, out,
 * lse and part).  Scratch, in elements of T; every row is ld >= bqp long
 * (tl->ld: see choose_tiles), of which the first bqp are used:
 *   Qt   (dk, bqp)  queries of the item, times scale, transposed, zero-padded
 *   St   (bk, bqp)  scores of one key tile, transposed; then probabilities
 *   Ot   (dv, bqp)  unnormalised output accumulator, transposed: the block
 *                   of up to FOLD_KEYS keys, each tile's P . V formed fresh
 *   Os, Oc (dv, bqp)  the total of the blocks and its compensation (acc_flush)
 *   m    (bqp)      reference max of each row: the running max, or up to
 *                   FUSE_LAG below it after fused tiles
 *   l    (bqp)      running row sum of exp(score - m)
 *   lc   (bqp)      l's compensation
 *   ts   (bqp)      a fused key tile's row sums, added to (l, lc) after it
 *   W    (ceil(bk / 32), bqp)  a bool mask tile as bit words (IT lanes)
 * ------------------------------------------------------------------------- */
void FN(fa_attn_item)(const fa_attention_args *a, const fa_tiles *tl, const fa_item *it,
                      void *scratch)
{
    /* the item's rows in whole vectors: fewer than the tile's (tl->bqp) in a last
     * query block, a sequence's last (q_len) or a short packed sequence */
    const int64_t bqp = (it->bq + L - 1) / L * L, ld = tl->ld, bk = tl->bk, dk = a->dk, dv = a->dv;
    T *Qt = scratch, *St = Qt + dk * ld, *Ot = St + bk * ld, *m = Ot + 3 * dv * ld, *l = m + ld, *ts = l + 2 * ld;
    /* one query vector, unfused: Ot in rows, A (ld, dv), and P.V by pv_block_rows */
    const int64_t rows_dv = PV_ROWS && bqp == L && !tl->fuse ? dv : 0;
    IT *W = (IT *)(ts + ld);
    fuse_t fz = {.m = m, .l = ts, .lr = l, .Ot = Ot, .St = St, .ld = ld, .arows = dv, .regrows = 0};

    /* Pass 1: pack the queries. */
    pack_queries(a, tl, it, scratch, Qt, ld, bqp);
    T qmax = -1; /* max |Qt|, when hidden_tile_skips first needs it */
    memset(Ot, 0, (size_t)(dv * ld) * sizeof(T)); /* (the total: at the first flush) */
    for (int64_t i = 0; i < bqp; i++) {
        m[i] = -INFINITY;
        l[i] = l[ld + i] = ts[i] = 0;
    }

    /* Key tiles outside every row's band (causal, window, kv length) are never visited. */
    const band_t b = item_band(a, it);
    const int cached = kv_rows_widened(a, tl, it, scratch, b.j_lo, b.j_hi, 1);
    mask_cache mc = mask_cache_open(a, tl, it, scratch, &b);
    if (mc.state == 1 && a->m_cs == 1 && a->m_rs != 0) {
        mask_cache_fill(a, it, &b, &mc, ld);
        mc.filled = 1;
    }
    int64_t block = 0; /* keys in Ot's block (FOLD_KEYS) */
    for (int64_t j0 = b.j_lo; j0 < b.j_hi && !fa_stopped(a->stop); j0 += bk) {
        const int64_t nb = (b.j_hi - j0 < bk) ? b.j_hi - j0 : bk;
        if (block >= FOLD_KEYS) {
            acc_flush(Ot, dv * ld, fz.arows == dv);
            fz.arows = 3 * dv;
            block = 0;
        }
        block += nb;

        /* Passes 2-3: scores with every modifier and mask except a bool mask's bits,
         * while this tile's V rows, and in the last tile the item's output rows, are
         * prefetched (pf_v; tile_pf). */
        const int64_t nb_next = b.j_hi - (j0 + nb) < bk ? b.j_hi - (j0 + nb) : bk;
        const int last = nb_next <= 0;
        const int out_pf = last && !it->part;
        tile_pf pf_v = {.v = (const KT *)it->v + j0 * a->v_rs, .nv = nb, .vrs = a->v_rs, .dv = dv, .l1 = tl->pf_l1,
                        .o = out_pf ? it->out : NULL, .no = out_pf ? it->bq : 0, .ors = a->o_rs,
                        .o_per = (it->bq + nb - 1) / nb, .spread = tl->spread};
        /* the next tile's K rows (in the last tile: the first K rows and the
         * queries of the thread's next item), prefetched during pass 5 */
        tile_pf pf_k = {.k = last ? it->next_k : (const KT *)it->k + (j0 + nb) * a->k_rs,
                        .q = a->q_kv ? NULL : it->next_q, /* (16-bit q: not prefetched) */
                        .nk = last ? it->next_nk : nb_next,
                        .nq = last && !a->q_kv ? it->next_bq : 0,
                        .krs = a->k_rs, .qrs = a->q_rs, .dk = dk, .l1 = tl->pf_l1, .spread = tl->spread};
        if (a->mask_kind == FA_MASK_ADD && a->m_cs == 1 && a->m_rs != 0 && mc.state == 0 && !last) {
            /* the next tile's float mask rows, which mask_tile reads transposing them */
            pf_k.m = (const T *)it->mask + j0 + nb;
            pf_k.nm = it->bq;
            pf_k.mrs = a->m_rs;
            pf_k.mn = nb_next;
        }
        /* the fused exp, until its rescaling costs more than it saves (FUSE_LAG) */
        fuse_t *f = tl->fuse && fz.regrows <= 2 * (bqp / L) ? &fz : NULL;
        key_runs kr = {.n = -1}; /* the keys P.V needs: all, or those a mask leaves some row */
        int64_t krs, vrs;
        const T *vt;
        const T *kt = tile_kv(a, tl, it, scratch, cached, j0, nb, &krs, &vt, &vrs);
        if (FA_KV && cached) { /* the widened rows that the products read, not the 16-bit ones
                                * that the widening has read (a float32 row of n elements as
                                * n * sizeof(T) / sizeof(KT) of KT: docs/tuning.md, kv_rows) */
            const int64_t w = (int64_t)(sizeof(T) / sizeof(KT));
            pf_v.v = (const KT *)vt;
            pf_v.vrs = pf_v.dv = w * dv;
            if (!last) { /* (the last tile's: the next item's 16-bit rows, which it widens) */
                pf_k.k = (const KT *)(kt + nb * krs);
                pf_k.krs = pf_k.dk = w * dk;
            }
        }
        const int bits = tile_scores(a, it, &b, St, Qt, &qmax, W, ld, bqp, j0, nb, kt, krs, &pf_v, f, &mc, &kr);
        if (bits < 0) continue;

        /* Pass 4 (when the exp is not fused): online softmax, two vectors of
         * query rows at a time. */
        if (bits != 2) {
            int64_t i = 0;
            for (; i + 2 * L <= bqp; i += 2 * L) tile_softmax(2, St, W, bits, ld, nb, m, l, Ot, fz.arows, i, 0);
            if (i < bqp) tile_softmax(1, St, W, bits, ld, nb, m, l, Ot, fz.arows, i, rows_dv);
        } else { /* the fused tile's row sums join the running ones */
            for (int64_t i = 0; i < bqp; i += L) {
                vacc_add(l + i, l + ld + i, vload(ts + i));
                vstore(ts + i, vset1(0));
            }
        }

        /* Pass 5: Ot += P . V_tile, while pf_k's rows are prefetched; under a
         * mask, over the keys that some row sees (visible_runs; a float
         * mask's from mask_tile) */
        if (bits == 1) visible_runs(&kr, W, ld, it->bq, nb);
        if (!runs_whole(&kr, nb))
            pv_block_runs(&kr, Ot, St, vt, vrs, ld, bqp, dv, &pf_k, rows_dv ? it->bq : 0);
        else if (rows_dv)
            pv_block_rows(Ot, St, vt, vrs, ld, it->bq, dv, nb, &pf_k);
        else
            pv_block(Ot, St, vt, vrs, ld, bqp, dv, nb, &pf_k);
    }

    if (mc.state == 1 && !fa_stopped(a->stop)) /* every tile kept: the next item may read them */
        *mc.head = (mask_head){.mask = it->mask, .j_lo = b.j_lo, .j_hi = b.j_hi, .bq = it->bq};

    /* Pass 6: write out (acc element (i, c) is Ot[c * ld + i], in rows
     * Ot[i * dv + c]), the compensations added back. */
    acc_result(Ot, dv * ld, fz.arows == dv);
    sum_result(l, ld);
    if (rows_dv)
        write_rows(a, it, Ot, dv, 1, m, l, 0);
    else
        write_rows(a, it, Ot, 1, ld, m, l, 0);
    redo_nonfinite_rows(a, tl, it, scratch);
}

/* ---------------------------------------------------------------------------
 * Attention weights of one item: out (bq, nk) row stride o_rs, zero-filled by
 * the caller.  Pass A finds each row's max and sum over the visible tiles;
 * pass B recomputes the scores and writes exp(s - max) / sum.  A row whose sum
 * is NaN is NaN throughout.  Scratch as fa_attn_item with dv = 0.
 * ------------------------------------------------------------------------- */
void FN(fa_weights_item)(const fa_attention_args *a, const fa_tiles *tl, const fa_item *it,
                         void *scratch)
{
    const int64_t bq = it->bq, bqp = (bq + L - 1) / L * L, ld = tl->ld, bk = tl->bk, dk = a->dk;
    T *Qt = scratch, *St = Qt + dk * ld, *m = St + bk * ld, *l = m + ld, *lc = l + ld;
    IT *W = (IT *)(l + 3 * ld);
    T *out = it->out;
    pack_queries(a, tl, it, scratch, Qt, ld, bqp);
    T qmax = -1; /* max |Qt|, when hidden_tile_skips first needs it */
    for (int64_t i = 0; i < bqp; i++) {
        m[i] = -INFINITY;
        l[i] = lc[i] = 0;
    }
    const band_t b = item_band(a, it);
    const int cached = kv_rows_widened(a, tl, it, scratch, b.j_lo, b.j_hi, 0);
    for (int pass = 0; pass < 2; pass++) {
        for (int64_t j0 = b.j_lo; j0 < b.j_hi && !fa_stopped(a->stop); j0 += bk) {
            const int64_t nb = (b.j_hi - j0 < bk) ? b.j_hi - j0 : bk;
            key_runs kr;
            int64_t krs;
            const T *kt = tile_kv(a, tl, it, scratch, cached, j0, nb, &krs, NULL, NULL);
            const int bits = tile_scores(a, it, &b, St, Qt, &qmax, W, ld, bqp, j0, nb, kt, krs, NULL, NULL, NULL, &kr);
            if (bits < 0) continue;
            if (bits) apply_bits(St, W, ld, bqp, nb);
            for (int64_t i = 0; i < bqp; i += L) {
                if (pass == 0) {
                    vec bm = vset1(-INFINITY);
                    for (int64_t j = 0; j < nb; j++) bm = vmax(vload(St + j * ld + i), bm);
                    const vstep_t s = vstep_begin(vload(m + i), bm);
                    vec sum = vset1(0);
                    for (int64_t j = 0; j < nb; j++) sum += vexp_neg(vload(St + j * ld + i) - s.mu);
                    vstore(l + i, vload(l + i) * s.alpha);
                    vstore(lc + i, vload(lc + i) * s.alpha);
                    vacc_add(l + i, lc + i, sum);
                    vstore(m + i, s.mn);
                } else {
                    const vec mu = vstep_shift(vload(m + i)), lv = vacc_fold(vload(l + i), vload(lc + i));
                    const vec inv = vsel(lv == vset1(0), vset1(0), 1 / lv);
                    for (int64_t j = 0; j < nb; j++)
                        vstore(St + j * ld + i, vexp_neg(vload(St + j * ld + i) - mu) * inv);
                }
            }
            if (pass == 1)
                for (int64_t i = 0; i < bq; i++)
                    for (int64_t j = 0; j < nb; j++) out[i * a->o_rs + j0 + j] = St[j * ld + i];
        }
    }
    for (int64_t i = 0; i < bq; i++)
        if (l[i] != l[i])
            for (int64_t j = 0; j < a->nk; j++) out[i * a->o_rs + j] = l[i];
}
