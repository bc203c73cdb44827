/*
 * The group kernel (included by kernel_body.h): the row kernel over items
 * whose K and V rows interleave, the heads of a (B, n, H, d) cache.
 */

/* ---------------------------------------------------------------------------
 * The row kernel over a group of items whose K and V rows interleave: the
 * heads of a (B, n, H, d) cache (layout "blhd"), where key j's rows of the
 * group's items lie side by side and one item's rows H d apart.  Item by item
 * (item_rows), a thread reads pieces of d elements H d apart, which memory
 * serves at roughly half the rate of the same bytes in address order
 * (docs/tuning.md, fa_attn_group_rows).  Here the items take turns on each
 * key tile of tl->bk keys (a few: a longer tile read as rows of pieces was no
 * faster than item by item), so that K and V stream through in address order;
 * each item keeps its own state.  The rows GROUP_PF_BYTES of K and V ahead
 * are prefetched into L2 in step with the tiles, or (tl->group_touch) the
 * next tile is loaded ahead in address order (group_touch).  One-row items
 * with plain scores take chunks of keys instead, with one softmax step a
 * chunk for all of them (group_chunks), and so do items of several rows that
 * all see the item's keys where the tuning says so (group_chunks_rows).
 * Items of several rows (GQA's folded heads, a few new tokens) take longer
 * tiles (attention.c), and their work on a tile is long enough that a burst
 * of prefetches at its start stalls it: there the rows of the tile ahead are
 * prefetched in step with the work, V's with the scores and K's key by key in
 * P . V (tile_pf.per_key); all of them with the scores (as item_rows does),
 * or K's with P . V's column tiles, was slower than item by item on some
 * shapes.
 *   its   (n) the items: the same rows i0 and at most tl->bq of them, keys
 *         [j_lo, j_hi) each; K and V rows of item g at it[g].k, it[g].v
 *         (row strides a->k_rs, a->v_rs)
 * Scratch, in elements of T: per item Qs (bq, dkp), A, As, Ac (bq, dv), m, l, lc
 * (bq) (bq = tl->bq; see item_rows), then S (bq, bk): fa_group_scratch_elems.
 * GROUP_PF_BYTES: 128 KiB, within the 64-512 KiB that measured alike; into L2,
 * which beat no prefetch, L1 and non-temporal (docs/tuning.md, GROUP_PF_BYTES).
 * ------------------------------------------------------------------------- */
enum { GROUP_PF_BYTES = 131072 };

/* Item g's state in fa_attn_group_rows' scratch, st elements an item of bq
 * rows: Qs (bq, dkp), then A, As, Ac (bq, dv) from A, then m, l, lc (bq) from m
 * (l = m + bq, lc = m + 2 bq), as item_rows lays them out. */
typedef struct {
    T *Qs, *A, *m, *l;
} group_state;
INLINE group_state group_item(T *scratch, int64_t st, int64_t g, int64_t bq, int64_t dkp, int64_t dv)
{
    group_state s;
    s.Qs = scratch + g * st;
    s.A = s.Qs + bq * dkp;
    s.m = s.A + 3 * bq * dv;
    s.l = s.m + bq;
    return s;
}

/* One key tile of fa_attn_group_rows for a row whose scores need nothing but
 * the scale (no mask, softcap or ALiBi; one row's band is its key range):
 * s = Qs . K, the online softmax of the row (m, l), A += P . V, for nb <= 4
 * keys; its probabilities and the rescaling factor from one vector exp.  In
 * place of rows_scores, rows_softmax and rows_pv, which serve any rows and
 * tiles (and still take the other cases): faster from memory and in the L3
 * (docs/tuning.md, group_step).  Only where a vector has 4 lanes or more.
 * For the one-row items that group_chunks does not take: float16 K and V
 * (FA_KV 1: slower in chunks, docs/tuning.md, group_chunks) and items whose
 * key ranges differ (kv_lengths per head).
 *   Qs (dkp) the row, times scale, zero-padded   K (nb, dk), V (nb, dv) row
 *   strides krs, vrs   A, As, Ac (dv)   m, l, lc (1) */
INLINE void group_step(const T *restrict Qs, const KT *restrict K, int64_t krs, int64_t dk, const KT *restrict V,
                       int64_t vrs, int64_t dv, int64_t nb, T *restrict A, T *m, T *l)
{
    const int64_t dkv = dk / L * L, dvv = dv / L * L;
    T s[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    if (nb == 4)
        rows_scores_1x4(s, Qs, K, K + krs, K + 2 * krs, K + 3 * krs, dk, dkv);
    else
        rows_scores(s, 0, Qs, 0, 1, K, krs, dk, nb, 0, 0, NULL);
    const T mo = *m;
    T mn = mo;
    for (int j = 0; j < nb; j++) mn = max_nan(mn, s[j]);
    const T mu = step_shift(mn);
    /* lanes 0..nb: the probabilities; lane 4 (where there is one): the rescaling factor */
    T e[L > 4 ? L : 8];
    for (int r = 0; r < L; r++) e[r] = r < nb ? s[r] : r == 4 ? mo : -INFINITY;
    const vec ev = vexp_neg(vload(e) - mu);
    memcpy(e, &ev, sizeof ev);
    const T alpha = L > 4 ? e[4] : exp_neg1(mo - mu);
    T p[4];
    for (int j = 0; j < 4; j++) p[j] = j < nb ? e[j] : 0;
    const T p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3];
    *m = mn;
    if (alpha != 1) {
        l[0] *= alpha;
        l[1] *= alpha;
        for (int64_t c = 0; c < 3 * dv; c++) A[c] *= alpha;
    }
    acc_add(l, l + 1, (p0 + p1) + (p2 + p3));
    if (nb < 4) {
        rows_pv(A, p, 0, 1, V, vrs, dv, nb, 0, 0, NULL);
        return;
    }
    pv_1x4(A, p0, p1, p2, p3, V, V + vrs, V + 2 * vrs, V + 3 * vrs, dv, dvv);
}

/* fa_attn_group_rows over items whose scores need nothing but the scale (no
 * mask, softcap or ALiBi) and which see the same keys [lo, hi), every row of
 * an item all of them: one-row items (decoding), and where the tuning's
 * group_chunks_rows says so (tl->chunks_rows) items of several rows (GQA's
 * folded heads, a few tokens without a causal band between them).  Chunk by
 * chunk of GROUP_CHUNK keys,
 *   1. the scores of every item, four keys at a time, the items in turn (so
 *      that K streams through in address order), into S (chunk keys, rows);
 *      an item of several rows by the row kernel's R x 4 tiles (each K vector
 *      loaded once for R rows);
 *   2. the online softmax step of the chunk, vectorised across the rows (S
 *      becomes P; A rescaled where a row's max grew; m keeps NaN, as the
 *      scalar steps' max_nan does, for the merge of split keys);
 *   3. A += P . V, four keys at a time, the items in turn (V in address order);
 *      an item of up to PV4_ROWS rows by the pipelined row kernel's pv_rx4
 *      where the plan's pipe_rows (the table's, from memory) takes that many
 *      rows (faster than rows_pv's register tiles on four keys: docs/tuning.md,
 *      group_chunks).
 * One softmax step a chunk for all the rows, not a chain of scalar work per
 * item and four keys, so that the work keeps up with memory (docs/tuning.md,
 * group_chunks).  The rest take the tiles below: items of several rows where
 * the table leaves them to the tiles, or whose rows see different keys, masks,
 * softcap, ALiBi, key ranges that differ, float16 K and V.
 * pf (fa_tiles.decode_pf): each pass prefetches into L2 its items' rows four
 * keys ahead.
 *   its (n <= FA_GROUP_MAX) the items, at most FA_GROUP_ROWS rows each and
 *       FA_GROUP_MAX in all, states at scratch + g st (fa_attn_group_rows'
 *       layout); K and V rows of item g at its[g].k, its[g].v, row strides
 *       a->k_rs, a->v_rs, keys [lo, hi)
 *   S   (GROUP_CHUNK, np)  the scores, then weights, of item g's row i at lane
 *       x + i (x: the rows of the items before g); np: the rows rounded up to
 *       whole vectors (padding lanes: -inf at first, then whatever the steps
 *       leave; never read back)
 *   mv, lv, lcv, al (np)   the rows' m, l, lc and the chunk's alpha
 * GROUP_CHUNK: long enough to share a softmax step, short enough for 16-bit
 * K and V, which slow down at 64 (docs/tuning.md, group_chunks). */
enum { GROUP_CHUNK = 32 };
_Static_assert(FA_GROUP_MAX % FA_LANES_MAX == 0, "group_chunks: rows rounded up to whole vectors fit FA_GROUP_MAX");
static void group_chunks(const fa_attention_args *a, const fa_item *its, int64_t n, T *scratch, int64_t st,
                         int64_t lo, int64_t hi, int pf, int64_t pipe_rows)
{
    const int64_t dk = a->dk, dv = a->dv, dkp = (dk + L - 1) / L * L, dkv = dk / L * L, dvv = dv / L * L;
    const int64_t krs = a->k_rs, vrs = a->v_rs;
    _Alignas(64) T S[GROUP_CHUNK * FA_GROUP_MAX];
    _Alignas(64) T mv[FA_GROUP_MAX], lv[FA_GROUP_MAX], lcv[FA_GROUP_MAX], al[FA_GROUP_MAX];
    int64_t nr = 0; /* the rows, item by item */
    for (int64_t g = 0; g < n; g++) nr += its[g].bq;
    const int64_t np = (nr + L - 1) / L * L;
    for (int64_t g = 0, x = 0; g < n; g++) /* item g's rows: m, l, lc at m + i, m + bq + i, m + 2 bq + i */
        for (int64_t i = 0; i < its[g].bq; i++, x++) {
            const T *m = group_item(scratch, st, g, its[g].bq, dkp, dv).m + i;
            mv[x] = m[0];
            lv[x] = m[its[g].bq];
            lcv[x] = m[2 * its[g].bq];
        }
    for (int64_t x = nr; x < np; x++) mv[x] = -INFINITY, lv[x] = lcv[x] = 0;
    for (int64_t x = 0; x < GROUP_CHUNK * np; x++) S[x] = -INFINITY;
    int64_t block = 0; /* keys in the items' blocks A (FOLD_KEYS) */
    for (int64_t j0 = lo; j0 < hi; j0 += GROUP_CHUNK) {
        const int64_t nb = hi - j0 < GROUP_CHUNK ? hi - j0 : GROUP_CHUNK;
        for (int64_t j = 0; j < nb; j += 4) { /* 1. the scores */
            const int64_t nj = nb - j < 4 ? nb - j : 4;
            for (int64_t g = 0, x = 0; g < n; x += its[g].bq, g++) {
                const KT *K = (const KT *)its[g].k + (j0 + j) * krs;
                if (pf)
                    for (int64_t y = j0 + j + 4; y < j0 + j + 8 && y < hi; y++)
                        prefetch_l2((const KT *)its[g].k + y * krs, dk, 1);
                const T *Qs = group_item(scratch, st, g, its[g].bq, dkp, dv).Qs;
                T s4[FA_GROUP_ROWS * 4];
                if (nj == 4 && its[g].bq == 1)
                    rows_scores_1x4(s4, Qs, K, K + krs, K + 2 * krs, K + 3 * krs, dk, dkv);
                else /* several rows: R x 4 tiles, each K vector loaded once for R rows */
                    rows_scores(s4, 4, Qs, dkp, its[g].bq, K, krs, dk, nj, 0, 0, NULL);
                for (int64_t i = 0; i < its[g].bq; i++)
                    for (int64_t y = 0; y < nj; y++) S[(j + y) * np + x + i] = s4[i * 4 + y];
            }
        }
        for (int64_t x = 0; x < np; x += L) { /* 2. the softmax step, L rows at a time */
            const vec mo = vload(mv + x);
            vec mn = mo;
            for (int64_t j = 0; j < nb; j++) mn = vnanmax(mn, vload(S + j * np + x));
            const vec mu = vstep_shift(mn), alpha = vexp_neg(mo - mu);
            vec ps = vset1(0);
            for (int64_t j = 0; j < nb; j++) {
                const vec p = vexp_neg(vload(S + j * np + x) - mu);
                vstore(S + j * np + x, p);
                ps += p;
            }
            vstore(mv + x, mn);
            vstore(al + x, alpha);
            vstore(lv + x, vload(lv + x) * alpha);
            vstore(lcv + x, vload(lcv + x) * alpha);
            vacc_add(lv + x, lcv + x, ps);
        }
        for (int64_t g = 0, x = 0; g < n; g++) /* A, As, Ac of row i: A + i dv, + bq dv, + 2 bq dv */
            for (int64_t i = 0; i < its[g].bq; i++, x++)
                if (al[x] != 1) {
                    T *A = group_item(scratch, st, g, its[g].bq, dkp, dv).A + i * dv;
                    for (int64_t b = 0; b < 3; b++)
                        for (int64_t c = 0; c < dv; c++) A[b * its[g].bq * dv + c] *= al[x];
                }
        for (int64_t j = 0; j < nb; j += 4) { /* 3. A += P . V */
            const int64_t nj = nb - j < 4 ? nb - j : 4;
            const T *P = S + j * np;
            for (int64_t g = 0, x = 0; g < n; x += its[g].bq, g++) {
                const KT *V = (const KT *)its[g].v + (j0 + j) * vrs;
                if (pf)
                    for (int64_t y = j0 + j + 4; y < j0 + j + 8 && y < hi; y++)
                        prefetch_l2((const KT *)its[g].v + y * vrs, dv, 1);
                T *A = group_item(scratch, st, g, its[g].bq, dkp, dv).A;
                T p[FA_GROUP_ROWS * 4];
                for (int64_t i = 0; i < its[g].bq; i++)
                    for (int64_t y = 0; y < nj; y++) p[i * 4 + y] = P[y * np + x + i];
                if (nj == 4 && its[g].bq == 1)
                    pv_1x4(A, p[0], p[1], p[2], p[3], V, V + vrs, V + 2 * vrs, V + 3 * vrs, dv, dvv);
                else if (nj == 4 && its[g].bq <= PV4_ROWS && its[g].bq <= pipe_rows)
                    pv_rx4_rows(its[g].bq, A, dv, p, 4, V, V + vrs, V + 2 * vrs, V + 3 * vrs, dv, dvv);
                else /* several rows: each V vector loaded once for R rows */
                    rows_pv(A, p, 4, its[g].bq, V, vrs, dv, nj, 0, 0, NULL);
            }
        }
        if ((block += nb) >= FOLD_KEYS) { /* the blocks join the totals (FOLD_KEYS) */
            for (int64_t g = 0; g < n; g++)
                acc_flush(group_item(scratch, st, g, its[g].bq, dkp, dv).A, its[g].bq * dv, 0);
            block = 0;
        }
    }
    for (int64_t g = 0, x = 0; g < n; g++)
        for (int64_t i = 0; i < its[g].bq; i++, x++) {
            T *m = group_item(scratch, st, g, its[g].bq, dkp, dv).m + i;
            m[0] = mv[x];
            m[its[g].bq] = lv[x];
            m[2 * its[g].bq] = lcv[x];
        }
}

/* Loads the key rows [r0, r1) of the group's items into the caches ahead of
 * their use (tl->group_touch): one byte a cache line, its value unused, key by
 * key with the items in turn, K then V, so that memory is read in address
 * order (a key's heads abut) and the hardware's prefetchers can follow it,
 * where software prefetch at the heads' stride does not keep up.  Only bytes
 * of each item's rows within its band are read.  The caller spreads a tile's
 * loads over the items' work on the tile before, not in one burst, which
 * would stall that work (docs/tuning.md, group_touch). */
INLINE void touch_row(const KT *p, int64_t n)
{
    for (int64_t c = 0; c < n; c += 64 / (int64_t)sizeof(KT)) (void)*(const volatile unsigned char *)(p + c);
    if (n > 0) (void)*(const volatile unsigned char *)(p + n - 1); /* a row may end in one more line */
}
static void group_touch(const fa_attention_args *a, const fa_item *its, const band_t *band, int64_t n, int64_t r0,
                        int64_t r1)
{
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t g = 0; g < n; g++)
            if (r >= band[g].j_lo && r < band[g].j_hi) touch_row((const KT *)its[g].k + r * a->k_rs, a->dk);
        for (int64_t g = 0; g < n; g++)
            if (r >= band[g].j_lo && r < band[g].j_hi) touch_row((const KT *)its[g].v + r * a->v_rs, a->dv);
    }
}

void FN(fa_attn_group_rows)(const fa_attention_args *a, const fa_tiles *tl, const fa_item *its, int64_t n,
                            void *scratch)
{
    const int64_t bk = tl->bk, dk = a->dk, dv = a->dv, dkp = (dk + L - 1) / L * L;
    const int64_t st = tl->bq * (dkp + 3 * dv + 3); /* one item's state */
    T *S = (T *)scratch + n * st;
    const int plain = a->softcap <= 0 && a->mask_kind == FA_MASK_NONE;
    band_t band[FA_GROUP_MAX];
    int64_t lo = INT64_MAX, hi = 0;
    for (int64_t g = 0; g < n; g++) {
        const fa_item *it = &its[g];
        const group_state s = group_item((T *)scratch, st, g, it->bq, dkp, dv);
        band[g] = rows_begin(a, it, s.Qs, dkp, s.A, s.m, s.l);
        if (band[g].j_lo < band[g].j_hi) {
            lo = band[g].j_lo < lo ? band[g].j_lo : lo;
            hi = band[g].j_hi > hi ? band[g].j_hi : hi;
        }
    }
    /* (float16 K and V: group_step, below, but with AVX2: docs/tuning.md, group_chunks) */
    int chunks = plain && (FA_KV != 1 || FA_VB == 32);
    int64_t rows = 0; /* several rows an item: where each sees all the item's keys */
    for (int64_t g = 0; g < n && chunks; g++) {
        const band_t *b = &band[g];
        const int all_keys = (!b->has_left && !b->has_right) || band_pos(b, 0) == band_pos(b, its[g].bq - 1);
        chunks = its[g].slope == 0 && b->j_lo == band[0].j_lo && b->j_hi == band[0].j_hi &&
                 (its[g].bq == 1 || (tl->chunks_rows && its[g].bq <= FA_GROUP_ROWS && all_keys));
        rows += its[g].bq;
    }
    chunks = chunks && rows <= FA_GROUP_MAX;
    if (chunks) {
        if (lo < hi) group_chunks(a, its, n, (T *)scratch, st, lo, hi, tl->decode_pf, tl->pipe_rows);
        if (a->stats) __atomic_fetch_add(&a->stats->chunk_rows, rows, __ATOMIC_RELAXED);
        hi = lo; /* (nothing left for the tiles below) */
    }
    /* keys ahead for the prefetch: GROUP_PF_BYTES of the group's K and V rows */
    int64_t ahead = GROUP_PF_BYTES / (n * (dk + dv) * (int64_t)sizeof(T) + 1);
    ahead = ahead < bk ? bk : ahead;
    const int touch = tl->group_touch;
    if (touch && lo < hi) group_touch(a, its, band, n, lo, lo + bk < hi ? lo + bk : hi); /* the first tile */
    int64_t block = 0; /* keys in the items' blocks A (FOLD_KEYS) */
    for (int64_t j0 = lo; j0 < hi; j0 += bk) {
        for (int64_t g = 0; g < n; g++) {
            const fa_item *it = &its[g];
            const band_t *b = &band[g];
            const KT *K = it->k, *V = it->v;
            const int64_t jl = j0 > b->j_lo ? j0 : b->j_lo, jh = j0 + bk < b->j_hi ? j0 + bk : b->j_hi;
            const int64_t ja = j0 + ahead, na = b->j_hi - ja < bk ? b->j_hi - ja : bk; /* rows ahead */
            const int in_step = it->bq > 1 && jl < jh && !touch; /* several rows: prefetch in step */
            if (touch) { /* the next tile, a share before each item */
                const int64_t t0 = j0 + bk + g * bk / n, t1 = j0 + bk + (g + 1) * bk / n;
                group_touch(a, its, band, n, t0, t1 < hi ? t1 : hi);
            } else if (!in_step)
                for (int64_t r = ja; r < ja + na; r++) {
                    prefetch_l2(K + r * a->k_rs, dk, 1);
                    prefetch_l2(V + r * a->v_rs, dv, 1);
                }
            if (jl >= jh) continue;
            const group_state s = group_item((T *)scratch, st, g, it->bq, dkp, dv);
            T *Qs = s.Qs, *A = s.A, *m = s.m, *l = s.l;
            if (plain && it->slope == 0 && it->bq == 1 && jh - jl <= 4 && L >= 4) {
                group_step(Qs, K + jl * a->k_rs, a->k_rs, dk, V + jl * a->v_rs, a->v_rs, dv, jh - jl, A, m, l);
                continue;
            }
            const int64_t jp = na > 0 ? ja : jl; /* (no pointer past the item's keys) */
            const tile_pf pf_v = {.v = V + jp * a->v_rs, .nv = na > 0 ? na : 0, .vrs = a->v_rs, .dv = dv};
            const tile_pf pf_k = {.k = K + jp * a->k_rs, .nk = na > 0 ? na : 0, .krs = a->k_rs, .dk = dk,
                                  .per_key = 1};
            rows_scores(S, bk, Qs, dkp, it->bq, K + jl * a->k_rs, a->k_rs, dk, jh - jl, 0, 0,
                        in_step ? &pf_v : NULL);
            rows_softmax(a, it, b, S, bk, A, m, l, jl, jh - jl, 0);
            rows_pv(A, S, bk, it->bq, V + jl * a->v_rs, a->v_rs, dv, jh - jl, 0, 0, in_step ? &pf_k : NULL);
        }
        block += bk;
        if (block >= FOLD_KEYS || j0 + bk >= hi) { /* the blocks join the totals (FOLD_KEYS) */
            for (int64_t g = 0; g < n; g++)
                acc_flush(group_item((T *)scratch, st, g, its[g].bq, dkp, dv).A, its[g].bq * dv, 0);
            block = 0;
        }
    }
    for (int64_t g = 0; g < n; g++) {
        const group_state s = group_item((T *)scratch, st, g, its[g].bq, dkp, dv);
        rows_end(s.A, s.l, its[g].bq, dv);
        write_rows(a, &its[g], s.A, dv, 1, s.m, s.l, 0);
    }
    for (int64_t g = 0; g < n; g++) /* after all are written: this takes the scratch */
        redo_nonfinite_rows(a, tl, &its[g], scratch);
}
