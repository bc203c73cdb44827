/*
 * Masks and bands (included by kernel_body.h): which keys each query row sees.
 * A bool mask as bit words (mask_bits) or bytes (mask_runs), a float mask
 * transposed into the scores (mask_tile), the band of causal and window
 * positions (band_t), the key ranges that some row sees (key_runs), and the
 * test that lets a tile or the ends of a row's keys be skipped when a float
 * mask hides them (scores_bounded).
 */

/* A row's bit word of a tile into W, and into whether any and all of the tile's are set. */
INLINE void put_bits(IT *w, uint32_t bits, uint32_t full, uint32_t *any, uint32_t *all)
{
    *w = (IT)bits;
    *any |= bits;
    *all &= bits | ~full;
}

/* Bool mask of one tile as bit words: bit (j % 32) of W[j / 32][i] is
 * mask[i][j0 + j] != 0, for the real rows i < bq; padded rows are all ones.
 * From the mask packed to bits once per call (mb, mask_pack in attention.c)
 * when the item has them, else from its bytes:
 *   mk  (bq, nb) bytes, strides mrs, mcs (already at key j0)
 *   mb  (bq, ceil(nk / 32) + 1) words, row stride mbrs (0: every row the same),
 *       key j of a row at bit j % 32 of its word j / 32 (from key 0, not j0:
 *       a tile that starts inside a word takes each of its words from two)
 *   W   (ceil(nb / 32), ld) words in IT lanes
 * Returns 0 when every entry of the tile is False, 2 when every one is True,
 * 1 otherwise. */
static int mask_bits(IT *restrict W, int64_t ld, const uint8_t *restrict mk, int64_t mrs, int64_t mcs,
                     const uint32_t *restrict mb, int64_t mbrs, int64_t j0, int64_t bq, int64_t nb)
{
    const int64_t nw = (nb + 31) / 32;
    const int sh = (int)(j0 % 32);
    uint32_t any = 0, all = 0xffffffffu;
    for (int64_t w = 0; w < nw; w++) {
        const int64_t len = (nb - 32 * w < 32) ? nb - 32 * w : 32;
        const uint32_t full = len == 32 ? 0xffffffffu : ((1u << len) - 1);
        if (mb) {
            const uint32_t *src = mb + j0 / 32 + w;
            for (int64_t i = 0; i < bq; i++) {
                const uint32_t *x = src + i * mbrs;
                put_bits(W + w * ld + i, (sh ? (uint32_t)((((uint64_t)x[1] << 32) | x[0]) >> sh) : x[0]) & full,
                         full, &any, &all);
            }
        } else {
            for (int64_t i = 0; i < bq; i++) {
                const uint8_t *row = mk + i * mrs + 32 * w * mcs;
                uint32_t bits;
#if (defined(__x86_64__) || defined(_M_X64)) && FA_VB >= 32
                if (mcs == 1 && len == 32) {
                    const __m256i x = _mm256_loadu_si256((const __m256i *)row);
                    bits = ~(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(x, _mm256_setzero_si256()));
                } else
#endif
                    bits = fa_byte_bits(row, mcs, len);
                put_bits(W + w * ld + i, bits, full, &any, &all);
            }
        }
        for (int64_t i = bq; i < ld; i++) W[w * ld + i] = (IT)0xffffffffu;
    }
    return any == 0 ? 0 : (all == 0xffffffffu ? 2 : 1);
}

/* ---------------------------------------------------------------------------
 * Which keys the rows of an item see (fastattn.h): row i (local) sees key j iff
 *   j >= p(i) - left   (when has_left)   and   j <= p(i) + right  (when has_right)
 * with p(i) = (r0 + i) / g + off its aligned position: r0 = i0 the item's first
 * row, g = a->row_group rows per position (1, or a GQA group folded
 * position-major), so positions never decrease along the rows; causal is
 * right = 0.  The item's key range is the union over its rows.
 * ------------------------------------------------------------------------- */
typedef struct {
    int64_t r0, g, off, left, right;
    int has_left, has_right;
    int64_t j_lo, j_hi; /* keys any row of the item may see */
} band_t;

/* The aligned position of local row i. */
INLINE int64_t band_pos(const band_t *b, int64_t i) { return (b->r0 + i) / b->g + b->off; }

/* The first local row whose position is x or more, within [0, bq]. */
INLINE int64_t band_first_row(const band_t *b, int64_t x, int64_t bq)
{
    const int64_t r = (x - b->off) * b->g - b->r0; /* (r0 + i) / g >= x - off */
    return r < 0 ? 0 : r > bq ? bq : r;
}

static band_t item_band(const fa_attention_args *a, const fa_item *it)
{
    band_t b;
    b.r0 = it->i0;
    b.g = a->row_group;
    b.off = it->off;
    b.has_left = a->win_left >= 0;
    b.left = a->win_left;
    b.has_right = a->causal || a->win_right >= 0;
    b.right = a->causal ? 0 : a->win_right;
    b.j_lo = it->j_lo;
    b.j_hi = it->j_hi < it->kv ? it->j_hi : it->kv;
    const int64_t first = band_pos(&b, 0), last = band_pos(&b, it->bq - 1);
    if (b.has_left && first - b.left > b.j_lo) b.j_lo = first - b.left;
    if (b.has_right && last + 1 + b.right < b.j_hi) b.j_hi = last + 1 + b.right;
    return b;
}

/* The key columns of a tile that some row of the item sees under a bool
 * mask (or a float mask, where it is not -inf), as at most PV_RUNS ranges
 * run[r] = [start, end) (key_runs: -1 when there are more).  P.V runs over
 * these ranges only: a key that the mask hides from every row (padding) has
 * weight 0 everywhere, but 0 * NaN = NaN, so NaN or inf in its V row (a
 * padded cache from np.empty) would make every row of the item non-finite and
 * send it to the careful redo (redo_nonfinite_rows), up to several times
 * slower (docs/tuning.md, PV_RUNS).  Skipping them is exact, and saves their
 * share of P.V.  PV_RUNS: ranges kept per tile; a tile with more takes P.V
 * over all its keys, still correct (non-finite rows are redone). */
enum { PV_RUNS = 4 };
typedef struct {
    int64_t run[PV_RUNS][2];
    int n;         /* ranges so far; -1: more than PV_RUNS */
    int64_t start; /* of the range open at the key before, or -1 */
} key_runs;

/* Key j is seen (on) or not; keys come in order.  j = nb, off closes the last. */
INLINE void key_runs_add(key_runs *r, int64_t j, int on)
{
    if (on && r->start < 0) r->start = j;
    if (on || r->start < 0 || r->n < 0) return;
    if (r->n == PV_RUNS) {
        r->n = -1;
        return;
    }
    r->run[r->n][0] = r->start;
    r->run[r->n][1] = j;
    r->n++;
    r->start = -1;
}

/* kr holds the whole tile of nb keys (or is not a list of ranges: n < 0) */
INLINE int runs_whole(const key_runs *kr, int64_t nb)
{
    return kr->n < 0 || (kr->n == 1 && kr->run[0][0] == 0 && kr->run[0][1] == nb);
}

/* A float mask tile, transposed, added to the scores (set = 0) or stored in
 * their place (set = 1, for the fused exp to add: qk_tile):
 *   St  (nb, bqp)  row stride ld (transposed scores); added to in the real
 *                  rows i < bq, or, with set, stored there.  The padded rows
 *                  of the last vector of rows may get -inf, and with set the
 *                  others get 0
 *   mk  (bq, nb)   the mask in the compute dtype, strides mrs, mcs (already at
 *                  the tile's first key)
 * and in kr the keys where some row's mask is not -inf (key_runs: P.V leaves
 * the others out); with pf_next, the next tile's rows prefetched as they go
 * (else the caller's tile_pf has them, spread over its P.V).  A mask row that
 * is contiguous is read L keys of L rows at a time and transposed in
 * registers; a mask the same for every row (mrs == 0: key padding) is one
 * broadcast per key.  Element by element, the transposed read cost as much as
 * the rest of the tile (docs/tuning.md, mask_tile). */
INLINE void mask_put(T *s, vec x, int set) { vstore(s, set ? x : vload(s) + x); }
/* One L x L block of mask_tile: the rows [0, n) of mk (with full, all L;
 * the others read as -inf), L keys, transposed into st (L, L) row stride ld;
 * with seen, a lane of *seen set for each key some row does not hide (-inf).
 * Full blocks load unconditionally, which keeps the block in registers. */
INLINE void mask_block(const int full, T *st, int64_t ld, const T *mk, int64_t mrs, int64_t n, int64_t nb, int set,
                       int pf_next, ivec *seen)
{
    vec r[L];
    UNROLL(16) for (int x = 0; x < L; x++)
    {
        r[x] = vset1(-INFINITY);
        if (full || x < n) {
            r[x] = vload(mk + x * mrs);
            if (pf_next) __builtin_prefetch(mk + x * mrs + nb, 0, 2);
            if (seen) *seen |= r[x] != vset1(-INFINITY);
        }
    }
    transpose_block(r);
    UNROLL(16) for (int x = 0; x < L; x++) mask_put(st + x * ld, r[x], set);
}
static void mask_tile(T *St, int64_t ld, const T *mk, int64_t mrs, int64_t mcs, int64_t bq, int64_t bqp,
                      int64_t nb, int set, int pf_next, key_runs *kr)
{
    const int64_t bqv = bq / L * L; /* rows in whole vectors */
    int64_t j = 0, done = bq;       /* keys [0, j) are written in the rows [0, done) */
    kr->n = 0;
    kr->start = -1;
    if (mrs == 0) {
        for (; j < nb; j++) {
            const T x = mk[j * mcs];
            for (int64_t i = 0; i < bqv; i += L) mask_put(St + j * ld + i, vset1(x), set);
            for (int64_t i = bqv; i < bq; i++) St[j * ld + i] = set ? x : St[j * ld + i] + x;
            key_runs_add(kr, j, x != -INFINITY);
        }
    } else if (mcs == 1) {
        done = (bq + L - 1) / L * L;
        for (; j + L <= nb; j += L) {
            ivec seen = (ivec)vset1(0); /* lane x: key j + x is not -inf in some row */
            int64_t i0 = 0;
            for (; i0 + L <= bq; i0 += L)
                mask_block(1, St + j * ld + i0, ld, mk + i0 * mrs + j, mrs, L, nb, set, pf_next, &seen);
            if (i0 < bq)
                mask_block(0, St + j * ld + i0, ld, mk + i0 * mrs + j, mrs, bq - i0, nb, set, pf_next, &seen);
            const uint32_t sb = vbits(seen);
            for (int x = 0; x < L; x++) key_runs_add(kr, j + x, (int)(sb >> x) & 1);
        }
    }
    for (int64_t jj = j; jj < nb; jj++) {
        int seen = 0;
        for (int64_t i = 0; i < bq; i++) {
            const T x = mk[i * mrs + jj * mcs];
            St[jj * ld + i] = set ? x : St[jj * ld + i] + x;
            seen |= x != -INFINITY;
        }
        key_runs_add(kr, jj, seen);
    }
    key_runs_add(kr, nb, 0);
    if (set) /* the padded rows, bq up to bqp */
        for (int64_t jj = 0; jj < nb; jj++)
            for (int64_t i = jj < j ? done : bq; i < bqp; i++) St[jj * ld + i] = 0;
}

/* Whether a float mask tile hides every key from every row: all of
 *   mk (bq, nb), strides mrs, mcs
 * is -inf (NaN is not). */
static int mask_tile_hidden(const T *mk, int64_t mrs, int64_t mcs, int64_t bq, int64_t nb)
{
    for (int64_t i = 0; i < (mrs == 0 ? 1 : bq); i++) {
        const T *row = mk + i * mrs;
        int64_t j = 0;
        if (mcs == 1)
            for (; j + L <= nb; j += L)
                if (vany(vload(row + j) != vset1(-INFINITY))) return 0;
        for (; j < nb; j++)
            if (row[j * mcs] != -INFINITY) return 0;
    }
    return 1;
}

/* The largest |x| over x (nr, nc) row stride rs, elements of T or with kv of KT
 * (K rows as stored); NaN when any is NaN. */
static T abs_max_of(const void *x, int kv, int64_t rs, int64_t nc, int64_t nr)
{
    const T *xt = x;
    const KT *xk = x;
    vec mv = vset1(0);
    T ms = 0;
    for (int64_t r = 0; r < nr; r++) {
        int64_t c = 0;
        for (; c + L <= nc; c += L) {
            const vec y = kv ? vload_kv(xk + r * rs + c) : vload(xt + r * rs + c);
            mv = vnanmax(vsel(y < 0, -y, y), mv);
        }
        for (; c < nc; c++) {
            const T xs = kv ? kv_s(xk[r * rs + c]) : xt[r * rs + c], y = xs < 0 ? -xs : xs;
            if (y > ms || y != y) ms = y;
        }
    }
    T t[L];
    memcpy(t, &mv, sizeof t);
    for (int i = 0; i < L; i++)
        if (t[i] > ms || t[i] != t[i]) ms = t[i];
    return ms;
}
#define abs_max(x, rs, nc, nr) abs_max_of(x, 0, rs, nc, nr)            /* T rows */
#define abs_max_kv(x, rs, nc, nr) abs_max_of(x, FA_KV != 0, rs, nc, nr) /* K rows as stored */

/* Whether no score of queries with max |q| = qmax (scaled) and keys with
 * max |k| = kmax can be NaN or +inf: every |score| is at most dk * qmax * kmax
 * (false when either max is NaN); a softcap and ALiBi keep a finite score
 * finite.  Keys that a float mask hides (-inf) may then be left out entirely:
 * otherwise +inf + -inf = NaN, which the row must get, as in the reference. */
INLINE int scores_bounded(T qmax, T kmax, int64_t dk)
{
    return (double)qmax * (double)kmax * (double)dk <= 0.5 * (FA_IS_F64 ? DBL_MAX : FLT_MAX);
}

/* Whether a key tile that a float mask hides everywhere may be skipped
 * (scores_bounded), with qmax = max |Qt| (the scaled queries; -1 until known,
 * then computed once per item) and the max |K| over the tile. */
static int hidden_tile_skips(const T *K, int64_t krs, int64_t dk, int64_t nb, const T *Qt, int64_t ld,
                             int64_t bqp, T *qmax)
{
    if (*qmax < 0) *qmax = abs_max(Qt, ld, bqp, dk);
    return scores_bounded(*qmax, abs_max(K, krs, dk, nb), dk);
}

/* The scores of key j (row j of St) at the query columns [i, i + L), -inf
 * where W's bit says the mask forbids them. */
INLINE vec masked_scores(const T *St, const IT *W, int64_t ld, int64_t i, int64_t j)
{
    const uvec w = (uvec)vload_i(W + (j >> 5) * ld + i);
    const ivec keep = (ivec)((w >> (j & 31)) & 1) != 0;
    return vsel(keep, vload(St + j * ld + i), vset1(-INFINITY));
}

/* St[j][i] = -inf where the bool mask's bit is 0 (for the weights kernel;
 * the attention kernel applies the bits in its max pass, tile_softmax). */
static void apply_bits(T *St, const IT *W, int64_t ld, int64_t bqp, int64_t nb)
{
    for (int64_t j = 0; j < nb; j++)
        for (int64_t i = 0; i < bqp; i += L) vstore(St + j * ld + i, masked_scores(St, W, ld, i, j));
}

/* kr from the tiled kernel's bits (mask_bits) of a tile of nb keys:
 *   W  (ceil(nb / 32), ld) words, of which rows i < bq are real (the padded
 *      rows' bits are all ones) */
static void visible_runs(key_runs *r, const IT *W, int64_t ld, int64_t bq, int64_t nb)
{
    r->n = 0;
    r->start = -1;
    for (int64_t w = 0; w * 32 < nb; w++) {
        uint32_t seen = 0;
        for (int64_t i = 0; i < bq; i++) seen |= (uint32_t)W[w * ld + i];
        const int64_t len = nb - 32 * w < 32 ? nb - 32 * w : 32;
        if (r->start >= 0 && len == 32 && seen == 0xffffffffu) continue; /* a range goes on */
        for (int64_t b = 0; b < len; b++) key_runs_add(r, 32 * w + b, (seen >> b) & 1);
    }
    key_runs_add(r, nb, 0);
}

/* Whether some row of the item may see key j under the mask (it->mask (bq,
 * n_k) with strides m_rs, m_cs): a bool mask's True, or a float mask's value
 * other than -inf. */
INLINE int mask_key_seen(const fa_attention_args *a, const fa_item *it, int64_t j)
{
    for (int64_t i = 0; i < (a->m_rs == 0 ? 1 : it->bq); i++) {
        const int64_t x = i * a->m_rs + j * a->m_cs;
        if (a->mask_kind == FA_MASK_BOOL ? ((const uint8_t *)it->mask)[x] != 0
                                         : ((const T *)it->mask)[x] != -INFINITY)
            return 1;
    }
    return 0;
}

/* The row kernel's key_runs (see visible_runs) for the tile [j0, j0 + nb),
 * from the mask it->mask (bq, n_k) with strides m_rs, m_cs: a bool mask's
 * bytes, or where a float mask is not -inf; n = -1 without a mask.  noinline,
 * as rows_pv_runs. */
static __attribute__((noinline)) void mask_runs(key_runs *r, const fa_attention_args *a, const fa_item *it,
                                                int64_t j0, int64_t nb)
{
    r->n = -1;
    r->start = -1;
    if (a->mask_kind == FA_MASK_NONE) return;
    r->n = 0;
    const uint8_t *mk = (const uint8_t *)it->mask + j0 * a->m_cs;
    for (int64_t j = 0; j < nb && r->n >= 0;) {
        if (a->mask_kind == FA_MASK_BOOL && a->m_cs == 1 && r->start >= 0 && j + 8 <= nb) {
            uint64_t w = 0, x; /* 8 keys at once inside a range */
            for (int64_t i = 0; i < it->bq; i++) {
                memcpy(&x, mk + i * a->m_rs + j, 8);
                w |= x;
            }
            if (!((w - 0x0101010101010101ULL) & ~w & 0x8080808080808080ULL)) { /* no zero byte */
                j += 8;
                continue;
            }
        }
        key_runs_add(r, j, mask_key_seen(a, it, j0 + j));
        j++;
    }
    key_runs_add(r, nb, 0);
}

/* The row kernel's key range [b->j_lo, b->j_hi) without the keys at either
 * end that the mask hides from every row (padding, as HF-style decoding
 * passes it), so that neither their scores nor P . V are computed: much
 * faster where the padding is long (docs/tuning.md, mask_trim).  Under
 * a float mask only where no score of the cut keys can be NaN or +inf
 * (scores_bounded, which takes reading their K rows), and only for 2 rows or
 * more: one row's scores cost no more than that check, and mask_runs leaves
 * the keys out of its P . V anyway.
 *   Qs (bq, dkp) the scaled queries, zero-padded rows */
static __attribute__((noinline)) void mask_trim(band_t *b, const fa_attention_args *a, const fa_item *it,
                                                const T *Qs, int64_t dkp)
{
    if (a->mask_kind == FA_MASK_NONE || (a->mask_kind == FA_MASK_ADD && it->bq < 2)) return;
    int64_t lo = b->j_lo, hi = b->j_hi;
    while (hi > lo && !mask_key_seen(a, it, hi - 1)) hi--;
    while (lo < hi && !mask_key_seen(a, it, lo)) lo++;
    if (a->mask_kind == FA_MASK_ADD && (lo > b->j_lo || hi < b->j_hi)) {
        const KT *K = (const KT *)it->k;
        const T qmax = abs_max(Qs, dkp, dkp, it->bq);
        if (!scores_bounded(qmax, abs_max_kv(K + b->j_lo * a->k_rs, a->k_rs, a->dk, lo - b->j_lo), a->dk) ||
            !scores_bounded(qmax, abs_max_kv(K + hi * a->k_rs, a->k_rs, a->dk, b->j_hi - hi), a->dk))
            return;
    }
    b->j_lo = lo;
    b->j_hi = hi;
}
