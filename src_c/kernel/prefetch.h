/*
 * Software prefetch of the kernels (included by kernel_body.h): the tiled
 * kernel's prefetch of the next tile's rows in step with its work (tile_pf),
 * and the row kernel's prefetch of the K and V rows it streams (near: L1,
 * far: L2).
 */

/* Prefetch into L2 the rows [j, j + r) of what the item reads next (pf),
 * spread over the work of the current tile: this tile's V over Q.K^T (rows
 * [j, j + r) of the scores), the next tile's K (or the next item's first K rows
 * and queries) over P.V (the columns of Ot in step with the rows).  Against
 * prefetching both during Q.K^T, so that P.V streamed nothing: 1.04-1.12x for
 * 12-20 query rows from memory (H32 Nk4096 d128, float32 and float64, one and
 * two threads; H8 Nk2048 d128 20 rows 1.11x), 1.03-1.06x at B32 H12 N128 d64;
 * B1 H8 N2048 (d64, d128, float64, bool mask; one and two threads) and N4096
 * causal 0.97-1.02x, within the noise (AVX2 on Zen 3, alternating calls). */
typedef struct {
    const T *v;        /* V rows of this tile: (nv, dv) row stride vrs */
    const T *k;        /* K rows of the next tile, or of the thread's next item's
                        * first tile: (nk, dk) row stride krs */
    const T *q;        /* the next item's query rows: (nq, dk) row stride qrs */
    int64_t nv, nk, nq, vrs, krs, qrs, dv, dk;
    int per_key;       /* rows_pv: row j with key j of the first column tile
                        * (fa_attn_group_rows), not in step with the column tiles */
} tile_pf;

/* Software prefetch into L2 of a row p[0..n): a line every 64 bytes from p on,
 * and with tail the line of p[n - 1] too.  NumPy's large arrays start 16 bytes
 * into a line, so that a row of d128 float32 spans 9 lines, not 8: where rows
 * abut, the next row's first prefetch takes that last line; where they do not
 * (tail: the stride is not n; K and V of a (B, n, H, d) cache, each head's
 * rows H*d apart) it was a demand miss from memory on every row.  With tail,
 * decoding from such a cache (H32 Nk4096 d128, K and V from memory) 1.10-1.15x,
 * with GQA 32/8 (four rows a kv head) 1.32-1.37x, float64 1.21x, d64 1.30x;
 * the tail for abutting rows too cost 1-2 % (8 and 20 rows, head-major). */
INLINE void prefetch_l2(const T *p, int64_t n, int tail)
{
    for (int64_t c = 0; c < n; c += 64 / (int64_t)sizeof(T)) __builtin_prefetch(p + c, 0, 2);
    if (tail && n > 0) __builtin_prefetch(p + n - 1, 0, 2);
}

INLINE void tile_prefetch(const tile_pf *pf, int64_t j, int64_t r)
{
    for (int64_t x = j; x < j + r && x < pf->nv; x++) prefetch_l2(pf->v + x * pf->vrs, pf->dv, pf->vrs != pf->dv);
    for (int64_t x = j; x < j + r && x < pf->nk; x++) prefetch_l2(pf->k + x * pf->krs, pf->dk, pf->krs != pf->dk);
    for (int64_t x = j; x < j + r && x < pf->nq; x++) prefetch_l2(pf->q + x * pf->qrs, pf->dk, pf->qrs != pf->dk);
}

/* Prefetch pf's K and query rows in step with a P.V pass over the columns of
 * V: the share of them that goes with the columns [c, c_end) of dv (c_end >=
 * dv: all the rows from that share on; dv = 0: all of them). */
INLINE void prefetch_in_step(const tile_pf *pf, int64_t c, int64_t c_end, int64_t dv)
{
    const int64_t n = pf->nk > pf->nq ? pf->nk : pf->nq;
    const int64_t r0 = c < dv ? c * n / dv : c > 0 ? n : 0, r1 = c_end >= dv ? INT64_MAX : c_end * n / dv;
    tile_prefetch(pf, r0, r1 - r0);
}

/* Software prefetch of the K and V rows that the row kernel streams, in two
 * kinds (far: fa_tiles.far, K and V beyond FA_KV_FAR_BYTES).
 * Near, K and V in cache: into L1, rows about PF_BYTES ahead of use (at least
 * 4 rows).  Measured at H32 Nk4096 d128 float32 (Zen 3): 1.3-1.4x PyTorch
 * without, 1.6-2.1x with; 4-8 KiB ahead was a plateau, 2 rows ahead too close.
 * In the pipelined decode loop (decode_step), which reads K and V together,
 * DECODE_PF_BYTES ahead: against 6 KiB, 1.5-3 KiB 1.10-1.14x (float32), 4 rows
 * of float64 1.17-1.19x; at d64 all within the noise.
 * Far, K and V from memory: into L2 (prefetcht1), FAR_PF_BYTES ahead.  On Zen 4
 * (H32 Nk4096 d128, two threads) against the near kind: decoding 1.34-1.68x
 * (float64 1.52x, one thread 1.60x), 2-20 rows 1.14-1.26x; 4-16 KiB ahead
 * alike; both kinds at once only 1.17x (the L1 prefetch
 * is what held the stream back).  With K and V in cache (1-8 MiB) the far kind
 * cost decoding 8-15 %; at 16 MiB the two were even, at 32 MiB far 1.46-1.63x. */
enum { PF_BYTES = 6144, DECODE_PF_BYTES = 2048, FAR_PF_BYTES = 8192 };
INLINE int64_t prefetch_dist_bytes(int64_t row_elems, int64_t bytes)
{
    const int64_t r = bytes / (row_elems * (int64_t)sizeof(T) + 1);
    return r < 4 ? 4 : r;
}
/* Rows ahead for the row kernel's K and V prefetch (near: PF_BYTES). */
INLINE int64_t prefetch_dist(int64_t row_elems, int far)
{
    return prefetch_dist_bytes(row_elems, far ? FAR_PF_BYTES : PF_BYTES);
}
/* One K or V row (n elements), into L2 (far; tail: see prefetch_l2) or L1.
 * (In cache, the tail made no difference: 0.99-1.01x, H32 Nk512 d128.) */
INLINE void prefetch_row(const T *p, int64_t n, int far, int tail)
{
    if (far)
        prefetch_l2(p, n, tail);
    else
        for (int64_t c = 0; c < n; c += 64 / (int64_t)sizeof(T)) __builtin_prefetch(p + c, 0, 3);
}
