/*
 * Software prefetch of the kernels (included by kernel_body.h): the tiled
 * kernel's prefetch of the next tile's rows in step with its work (tile_pf),
 * and the row kernel's prefetch of the K and V rows it streams (near: L1,
 * far: L2).
 */

/* Prefetch into L2 the rows [j, j + r) of what the item reads next (pf),
 * spread over the work of the current tile: this tile's V over Q.K^T (rows
 * [j, j + r) of the scores; in the last tile also the output rows that the item
 * then writes, o_per a row), the next tile's K (or the next item's first K rows
 * and queries) over P.V (the columns of Ot in step with the rows).  Memory then
 * streams during both passes: faster than prefetching both during Q.K^T for
 * 12-20 query rows from memory, and no slower elsewhere (docs/tuning.md,
 * tile_pf). */
typedef struct {
    const KT *v;       /* V rows of this tile: (nv, dv) row stride vrs */
    const KT *k;       /* K rows of the next tile, or of the thread's next item's
                        * first tile: (nk, dk) row stride krs */
    const T *q;        /* the next item's query rows: (nq, dk) row stride qrs */
    T *o;              /* the item's output rows, written after this tile: (no, dv) row
                        * stride ors, o_per of them with each of the tile's rows */
    const T *m;        /* a float mask's rows of the next tile, for mask_tile: (nm, mn)
                        * row stride mrs */
    int64_t nv, nk, nq, no, nm, vrs, krs, qrs, ors, mrs, o_per, dv, dk, mn;
    int per_key;       /* rows_pv: row j with key j of the first column tile
                        * (fa_attn_group_rows), not in step with the column tiles */
    int l1;            /* into L1, not L2 (fa_tiles.pf_l1) */
    int spread;        /* spread over the register tiles where it can (fa_tiles.spread;
                        * tiled.h, tile_spread) */
} tile_pf;

/* Software prefetch of a row p[0..n) of esz-byte elements, into L1 or L2: a
 * line every 64 bytes from p on, and with tail the line of p[n - 1] too.
 * NumPy's large arrays start 16 bytes into a line, so that a row of d128
 * float32 spans 9 lines, not 8: where rows abut, the next row's first prefetch
 * takes that last line; where they do not (tail: the stride is not n; K and V
 * of a (B, n, H, d) cache, each head's rows H*d apart) it was a demand miss
 * from memory on every row.  The callers ask for the tail only where rows do
 * not abut: there it pays, for abutting rows it costs a little (docs/tuning.md,
 * prefetch_l2).  The locality hint must be a constant, hence the two calls. */
INLINE void prefetch_lines(const void *p, int64_t n, int64_t esz, int tail, int l1)
{
    const char *b = (const char *)p;
    const int64_t bytes = n * esz;
    for (int64_t c = 0; c < bytes; c += 64) {
        if (l1) __builtin_prefetch(b + c, 0, 3);
        else    __builtin_prefetch(b + c, 0, 2);
    }
    if (tail && n > 0) {
        if (l1) __builtin_prefetch(b + bytes - esz, 0, 3);
        else    __builtin_prefetch(b + bytes - esz, 0, 2);
    }
}
/* A K or V row into L2 (the group kernel's prefetch) */
INLINE void prefetch_l2(const KT *p, int64_t n, int tail) { prefetch_lines(p, n, (int64_t)sizeof(KT), tail, 0); }

/* tile_prefetch's V, K and query rows: K and V into L1 (l1) or L2, the queries
 * to L2 (the next item's, not the next pass's) */
INLINE void tile_prefetch_kv(const tile_pf *pf, int64_t j, int64_t r, int l1)
{
    for (int64_t x = j; x < j + r && x < pf->nv; x++)
        prefetch_lines(pf->v + x * pf->vrs, pf->dv, (int64_t)sizeof(KT), pf->vrs != pf->dv, l1);
    for (int64_t x = j; x < j + r && x < pf->nk; x++)
        prefetch_lines(pf->k + x * pf->krs, pf->dk, (int64_t)sizeof(KT), pf->krs != pf->dk, l1);
    for (int64_t x = j; x < j + r && x < pf->nq; x++)
        prefetch_lines(pf->q + x * pf->qrs, pf->dk, (int64_t)sizeof(T), pf->qrs != pf->dk, 0);
}

INLINE void tile_prefetch(const tile_pf *pf, int64_t j, int64_t r)
{
    if (__builtin_expect(pf->no > 0, 0)) { /* into L2 for writing: its stores then wait for no memory */
        const int64_t x1 = r >= pf->no ? pf->no : (j + r) * pf->o_per;
        for (int64_t x = j * pf->o_per; x < x1 && x < pf->no; x++)
            for (int64_t c = 0; c < pf->dv; c += 64 / (int64_t)sizeof(T))
                __builtin_prefetch(pf->o + x * pf->ors + c, 1, 2);
    }
    for (int64_t x = j; x < j + r && x < pf->nm; x++) prefetch_lines(pf->m + x * pf->mrs, pf->mn, (int64_t)sizeof(T), 1, 0);
    if (pf->l1) tile_prefetch_kv(pf, j, r, 1); /* a constant level in each call, branch out of the loops */
    else        tile_prefetch_kv(pf, j, r, 0);
}

/* Prefetch pf's K, query and mask rows in step with a P.V pass over the columns
 * of V: the share of them that goes with the columns [c, c_end) of dv (c_end >=
 * dv: all the rows from that share on; dv = 0: all of them). */
INLINE void prefetch_in_step(const tile_pf *pf, int64_t c, int64_t c_end, int64_t dv)
{
    const int64_t nkq = pf->nk > pf->nq ? pf->nk : pf->nq, n = pf->nm > nkq ? pf->nm : nkq;
    const int64_t r0 = c < dv ? c * n / dv : c > 0 ? n : 0, r1 = c_end >= dv ? INT64_MAX : c_end * n / dv;
    tile_prefetch(pf, r0, r1 - r0);
}

/* Software prefetch of the K and V rows that the row kernel streams, in two
 * kinds (far: fa_tiles.far, K and V beyond the tuning's kv_far_bytes).
 * Near, K and V in cache: into L1, rows about PF_BYTES ahead of use (at least
 * 4 rows).  Far, K and V from memory: into L2 (prefetcht1), FAR_PF_BYTES
 * ahead; the near kind's L1 prefetch held a stream from memory back, and the
 * far kind costs decoding in cache.  The distances (docs/tuning.md, under
 * each name):
 *   PF_BYTES         mid-plateau (4-8 KiB ahead alike; 2 rows is too close)
 *   DECODE_PF_BYTES  the pipelined decode loop (decode_step) reads K and V
 *                    together, two streams: closer than PF_BYTES is faster
 *   FAR_PF_BYTES     from memory into L2: 4-16 KiB ahead measured alike
 *   PIPE_PF_BYTES    the pipelined loop of several rows (rows_step), from
 *                    memory into L1: a few rows ahead, as two streams read
 *                    together leave less time between a row's prefetch and use */
enum { PF_BYTES = 6144, DECODE_PF_BYTES = 2048, FAR_PF_BYTES = 8192, PIPE_PF_BYTES = 3072 };
INLINE int64_t prefetch_dist_bytes(int64_t row_elems, int64_t bytes)
{
    const int64_t r = bytes / (row_elems * (int64_t)sizeof(KT) + 1); /* K or V rows */
    return r < 4 ? 4 : r;
}
/* Rows ahead for the row kernel's K and V prefetch (near: PF_BYTES). */
INLINE int64_t prefetch_dist(int64_t row_elems, int far)
{
    return prefetch_dist_bytes(row_elems, far ? FAR_PF_BYTES : PF_BYTES);
}
/* One K or V row (n elements), into L2 (far; tail: see prefetch_lines) or into
 * L1 without the tail (in cache it makes no difference: docs/tuning.md,
 * prefetch_l2). */
INLINE void prefetch_row(const KT *p, int64_t n, int far, int tail)
{
    if (far) prefetch_lines(p, n, (int64_t)sizeof(KT), tail, 0); /* constant levels: see tile_prefetch */
    else     prefetch_lines(p, n, (int64_t)sizeof(KT), 0, 1);
}
