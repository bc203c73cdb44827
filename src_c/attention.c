/*
 * The attention driver: the plan of a call (plan.c) carried out.  Work items
 * are (leading index, block of bq query rows); each thread owns the output
 * rows of its items, so no reduction is needed.  The kernels
 * (kernel_body.h) contain no OpenMP.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "runtime.h"


/* ---------------------------------------------------------------------------
 * A bool mask as bits, packed once per call for the tiled kernel
 * (mask_bits in kernel_body.h reads them), in place of each key tile
 * turning the mask's bytes into bit words itself: the heads (or batch entries)
 * that share a mask then read an eighth of its bytes, and a tile's words come
 * from a few cache lines, not one line per query row.
 *   bits  (n_slices, rows, nw) words: bit j % 32 of word j / 32 of row r is
 *         mask[r][j] != 0, 0 past nk; rows = nq, or 1 when the mask's rows
 *         are broadcast (m_rs == 0); nw = ceil(nk / 32) + 1, so that a tile
 *         starting inside a word may read the word after its last
 *   slice s: the mask of the leading indices whose coordinates on the dims
 *         the mask does not broadcast (m_lead != 0) are s's, row-major
 * ------------------------------------------------------------------------- */
typedef struct {
    uint32_t *bits;
    int64_t rows, nw, n_slices;
    int64_t s_lead[FA_MAX_DIMS]; /* slice index strides over the leading dims (0 where broadcast) */
} mask_pack;

/* Row r of slice s of the mask as bits: dst (nw) words <- the mask's bytes. */
static void pack_mask_row(const fa_attention_args *a, const mask_pack *mp, int64_t s, int64_t r)
{
    int64_t om = 0, rest = s;
    for (int d = a->n_lead - 1; d >= 0; d--)
        if (a->m_lead[d] != 0) {
            om += rest % a->lead_shape[d] * a->m_lead[d];
            rest /= a->lead_shape[d];
        }
    const uint8_t *row = (const uint8_t *)a->mask + om + r * a->m_rs;
    uint32_t *dst = mp->bits + (s * mp->rows + r) * mp->nw;
    for (int64_t w = 0; w < mp->nw; w++) { /* the last word's keys past nk (and the spare word): 0 */
        const int64_t len = a->nk - 32 * w < 32 ? a->nk - 32 * w : 32;
        dst[w] = len > 0 ? fa_byte_bits(row + 32 * w * a->m_cs, a->m_cs, len) : 0;
    }
}

/* Work item w -> (leading index, query block): pointers and row range; mp:
 * the packed bool mask, or NULL. */
void fa_fill_item(const fa_attention_args *a, const fa_tiles *t, const void *mask_pack_, int64_t n_qb,
                  int64_t w, size_t esz, size_t msz, fa_item *it)
{
    const mask_pack *mp = mask_pack_;
    int64_t lead = w / n_qb, qb = w % n_qb;
    int64_t oq = 0, ok = 0, ov = 0, oo = 0, om = 0, ol = 0, os = 0, okl = 0, oql = 0, oqs = 0, oks = 0, osl = 0;
    for (int d = a->n_lead - 1; d >= 0; d--) { /* row-major over lead_shape */
        const int64_t i = lead % a->lead_shape[d];
        lead /= a->lead_shape[d];
        if (mp) osl += i * mp->s_lead[d];
        oq += i * a->q_lead[d];
        ok += i * a->k_lead[d];
        ov += i * a->v_lead[d];
        oo += i * a->o_lead[d];
        om += i * a->m_lead[d];
        ol += i * a->lse_lead[d];
        os += i * a->slope_lead[d];
        okl += i * a->kvl_lead[d];
        oql += i * a->qln_lead[d];
        oqs += i * a->qst_lead[d];
        oks += i * a->kst_lead[d];
    }
    if (a->q_start) { /* packed sequences: this one's rows start further on */
        const int64_t r = a->q_start[oqs];
        oq += r * a->q_rs;
        oo += r * a->o_rs;
        ol += r * a->lse_rs;
    }
    if (a->kv_start) {
        const int64_t r = a->kv_start[oks];
        ok += r * a->k_rs;
        ov += r * a->v_rs;
    }
    it->kv = a->kv_len ? a->kv_len[okl] : a->nk;
    if (it->kv > a->nk) it->kv = a->nk;
    if (it->kv < 0) it->kv = 0;
    const int64_t qn = fa_real_positions(a, oql);
    it->off = a->top_left ? 0 : it->kv - qn;
    it->slope = !a->slopes ? 0.0
              : a->dtype == FA_F32 ? (double)((const float *)a->slopes)[os] : ((const double *)a->slopes)[os];
    const int64_t i0 = qb * t->bq < t->q_main ? qb * t->bq : t->q_main, e = (int64_t)esz;
    const int64_t end = i0 == t->q_main ? a->nq : i0 + t->bq < t->q_main ? i0 + t->bq : t->q_main;
    it->i0 = i0;
    it->bq = end - i0;
    const int64_t real = qn * a->row_group - i0; /* rows before the padding */
    it->pad = real >= it->bq ? 0 : real <= 0 ? it->bq : it->bq - real;
    it->bq -= it->pad;
    it->j_lo = 0;
    it->j_hi = it->kv;
    it->q = (const char *)a->q + (oq + i0 * a->q_rs) * fa_q_esz(a);
    it->k = (const char *)a->k + ok * fa_kv_esz(a);
    it->v = (const char *)a->v + ov * fa_kv_esz(a);
    it->mask = a->mask ? (const char *)a->mask + (om + i0 * a->m_rs) * (int64_t)msz : NULL;
    it->mbits = mp ? mp->bits + (osl * mp->rows + (mp->rows > 1 ? i0 : 0)) * mp->nw : NULL;
    it->mb_rs = mp && mp->rows > 1 ? mp->nw : 0;
    it->out = (char *)a->out + (oo + i0 * a->o_rs) * e;
    it->lse = a->lse ? (char *)a->lse + (ol + i0 * a->lse_rs) * e : NULL;
    it->part = NULL;
    it->next_q = it->next_k = NULL;
    it->next_bq = it->next_nk = 0;
}

/* One attention call running: its plan (plan.c) with the kernels, the buffers
 * and the shared counter (run below fills it). */
typedef struct {
    const fa_attention_args *a;
    const fa_tiles *tiles;
    fa_attn_item_fn item_fn;
    fa_attn_item_fn rows_fn; /* the row kernel: items of few rows (few) and the tails (n_main) */
    int few;      /* packed sequences under the tiled kernel: their items of few rows
                   * (fa_few_rows) take rows_fn */
    int64_t few_max, full_lo, full_hi;
    fa_attn_merge_fn merge_fn;
    fa_attn_group_fn group_fn; /* the row kernel over interleaved items (group > 0) */
    int64_t group, n_groups; /* items per group (the last leading dim's, at most FA_GROUP_MAX;
                              * 0: no groups), and the groups; a unit is then (group, split) */
    size_t esz, msz, scratch_bytes;
    int64_t n_qb, n_items, n_splits, chunk, part_elems;
    int64_t n_main; /* items of each leading index: n_qb, or n_qb - 1 where its last
                     * block is a tail (tiles->q_main < nq), which rows_fn runs after the
                     * block before it (run); item k is then block k % n_main of
                     * leading index k / n_main */
    const int64_t *live; /* packed sequences: item k is live[k] (fa_live_items), or NULL: item k is k */
    int64_t turns; /* > 0: item k is block k / turns % n_main of the leading index's turn k % turns
                    * (fa_plan.head_turns) */
    const mask_pack *mp; /* the bool mask as bits (the team packs it first), or NULL */
    void *parts;  /* (n_items, n_splits, part_elems) partial results, or NULL */
    int64_t w0;   /* the first item of this wave: items w0 .. w0 + n_items - 1 run (run) */
    int pack;     /* pack mp's bits first (the first wave) */
    int status;   /* FA_ENOMEM when a thread's scratch could not be allocated */
    int weights;  /* fa_attention_weights: padding rows are left as they are (zero) */
    int64_t claimed; /* units claimed from the shared counter so far */
} run_state;

/* The item's padding rows (q_len), after its bq real ones: out rows zero,
 * lse -inf, as for a row that sees nothing.  Not with packed sequences
 * (q_start): those rows are the next sequence's.
 *   out  (pad, dv) row stride a->o_rs, from row bq of it->out
 *   lse  (pad)     stride a->lse_rs, from row bq of it->lse, or NULL */
static void write_padding(const fa_attention_args *a, const fa_item *it, size_t esz)
{
    const int64_t e = (int64_t)esz;
    for (int64_t i = it->bq; i < it->bq + it->pad; i++) {
        memset((char *)it->out + i * a->o_rs * e, 0, (size_t)a->dv * esz);
        if (!it->lse) continue;
        if (a->dtype == FA_F32)
            ((float *)it->lse)[i * a->lse_rs] = -INFINITY;
        else
            ((double *)it->lse)[i * a->lse_rs] = -INFINITY;
    }
}

/* The next unit from the shared counter (n_units or more when none is left):
 * units [0, team) are the threads' first, one each; the rest go in order. */
static int64_t claim_unit(run_state *p, int64_t team)
{
    int64_t c;
#pragma omp atomic capture
    c = p->claimed++;
    return team + c;
}

/* Item k of the plan as fill_item's w = lead * n_qb + qb. */
static int64_t item_index(const run_state *p, int64_t k)
{
    k += p->w0;
    if (p->live) return p->live[k];
    if (p->turns) { /* runs of turns leading indices (the heads), block by block */
        const int64_t run = p->n_main * p->turns, r = k % run;
        return (k / run * p->turns + r % p->turns) * p->n_qb + r / p->turns;
    }
    return k / p->n_main * p->n_qb + k % p->n_main;
}

/* Unit u = (item w, split sp): the item, with its share of the keys and its
 * place among the partial results when the keys are split. */
static void fill_unit(const run_state *p, int64_t u, fa_item *it)
{
    const int64_t w = u / p->n_splits, sp = u % p->n_splits;
    fa_fill_item(p->a, p->tiles, p->mp, p->n_qb, item_index(p, w), p->esz, p->msz, it);
    if (p->parts) {
        it->j_lo = sp * p->chunk;
        it->j_hi = (it->j_lo + p->chunk < it->kv) ? it->j_lo + p->chunk : it->kv;
        it->part = (char *)p->parts + (w * p->n_splits * p->part_elems + sp * it->bq * (p->a->dv + 2)) * (int64_t)p->esz;
    }
}

/* Unit u = (group, split) of the group row kernel: group gi holds the items
 * (leading indices: the row kernel's items are whole) of one index of the
 * other leading dims and up to p->group consecutive indices h0.. of the last;
 * their padding rows are written, and the kernel runs the items that have real rows. */
static void run_group(run_state *p, int64_t u, void *scratch)
{
    const int64_t gi = u / p->n_splits, sp = u % p->n_splits;
    const int64_t hn = p->a->lead_shape[p->a->n_lead - 1], n_sub = (hn + p->group - 1) / p->group;
    const int64_t h0 = gi % n_sub * p->group, w0 = gi / n_sub * hn + h0;
    const int64_t n = hn - h0 < p->group ? hn - h0 : p->group;
    fa_item its[FA_GROUP_MAX];
    int64_t m = 0;
    for (int64_t g = 0; g < n; g++) {
        fill_unit(p, (w0 + g) * p->n_splits + sp, &its[m]);
        if (its[m].pad && sp == 0) write_padding(p->a, &its[m], p->esz);
        if (its[m].bq > 0) m++;
    }
    if (m > 0) {
        p->group_fn(p->a, p->tiles, its, m, scratch);
        if (p->a->stats) __atomic_fetch_add(&p->a->stats->group_runs, 1, __ATOMIC_RELAXED);
    }
}

/* The work of each thread of the team (or of the caller alone): its own
 * scratch, then a share of the (item, split) units; with split keys, after a
 * barrier, a share of the merges.  Each thread starts with the unit of its
 * own number, then claims its next unit from a shared counter before it runs
 * the current one (as schedule(dynamic, 1) does, one unit ahead), so that the
 * kernel can prefetch the next unit's first queries and keys while the current
 * one runs (docs/tuning.md: run_team). */
static void run_team(void *arg)
{
    run_state *p = arg;
    const fa_attention_args *a = p->a;
    void *raw;
    void *scratch = fa_team_scratch(p->scratch_bytes, &raw, &p->status);
    const int64_t n_units = (p->group ? p->n_groups : p->n_items) * p->n_splits, team = fa_num_threads();
    if (p->mp && p->pack) { /* the mask's bits, before any item reads them (the loop's closing barrier) */
#pragma omp for schedule(static)
        for (int64_t x = 0; x < p->mp->n_slices * p->mp->rows; x++)
            pack_mask_row(a, p->mp, x / p->mp->rows, x % p->mp->rows);
    }
    if (scratch && p->tiles->kv_off) /* no rows of widened K and V yet (tiled.h, kv_rows_widened) */
        memset((char *)scratch + p->tiles->kv_off * (int64_t)p->esz, 0, FA_KV_HEAD * p->esz);
    if (scratch && p->tiles->mt_off) /* no mask tiles kept yet (tiled.h, mask_cache) */
        memset((char *)scratch + p->tiles->mt_off * (int64_t)p->esz, 0, FA_MT_HEAD_BYTES);
    int64_t u = scratch ? fa_thread_num() : n_units;
    while (u < n_units && !fa_stopped(a->stop)) {
        const int64_t un = claim_unit(p, team);
        if (p->group) {
            run_group(p, u, scratch);
            u = un;
            continue;
        }
        fa_item it;
        fill_unit(p, u, &it);
        if (un < n_units) {
            fa_item nx;
            fill_unit(p, un, &nx);
            const int64_t j_end = nx.j_lo + p->tiles->bk < nx.j_hi ? nx.j_lo + p->tiles->bk : nx.j_hi;
            it.next_q = nx.q;
            it.next_bq = nx.bq;
            it.next_k = (const char *)nx.k + nx.j_lo * a->k_rs * fa_kv_esz(a);
            it.next_nk = j_end > nx.j_lo ? j_end - nx.j_lo : 0;
        }
        if (it.pad && !p->weights && !a->q_start && u % p->n_splits == 0) write_padding(a, &it, p->esz);
        if (it.bq > 0) {
            const int few = p->few && fa_few_rows(it.bq, p->few_max, p->full_lo, p->full_hi);
            (few ? p->rows_fn : p->item_fn)(a, p->tiles, &it, scratch);
        }
        if (p->n_main < p->n_qb && (p->turns ? item_index(p, u) % p->n_qb : u % p->n_main) == p->n_main - 1) {
            /* the leading index's tail (n_splits 1) */
            fa_item tl;
            fa_fill_item(a, p->tiles, p->mp, p->n_qb, item_index(p, u) + 1, p->esz, p->msz, &tl);
            if (tl.pad) write_padding(a, &tl, p->esz);
            if (tl.bq > 0) {
                p->rows_fn(a, p->tiles, &tl, scratch);
                if (a->stats) __atomic_fetch_add(&a->stats->tail_rows, tl.bq, __ATOMIC_RELAXED);
            }
        }
        u = un;
    }
    if (p->parts) { /* after every split is done: merge each item's splits */
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t w = 0; w < p->n_items; w++) {
            if (!scratch || fa_stopped(a->stop)) continue;
            fa_item it;
            fa_fill_item(a, p->tiles, p->mp, p->n_qb, item_index(p, w), p->esz, p->msz, &it);
            if (it.bq == 0) continue; /* all padding */
            p->merge_fn(a, &it, (char *)p->parts + w * p->n_splits * p->part_elems * (int64_t)p->esz,
                        p->n_splits, scratch);
        }
    }
    free(raw);
}

/* Attention (weights = 0) or its weights (weights = 1: out is (lead, nq, nk),
 * zero-filled; always the tiled kernel, never split): the plan carried out. */
static int run(const fa_attention_args *a, int weights)
{
    fa_team_none();
    fa_plan pl;
    const int status = fa_attention_plan(a, weights, &pl);
    if (status != FA_OK || pl.n_items == 0) return status;
    const fa_isa_table *isa = fa_isa_current();
    const int dt = a->dtype, kv = a->kv_dtype - 1; /* kv >= 0: the kernels over 16-bit K and V */
    const size_t esz = dt == FA_F32 ? sizeof(float) : sizeof(double);
    int64_t *live = NULL; /* packed sequences: the live items (plan.c counted them) */
    if (a->q_start) {
        double rows;
        live = malloc((size_t)pl.n_items * sizeof *live);
        if (!live) return FA_ENOMEM;
        fa_live_items(a, pl.n_lead, pl.n_qb, pl.tiles.bq, live, &rows);
    }
    void *parts = NULL;
    if (pl.n_splits > 1) {
        parts = malloc((size_t)(pl.wave * pl.n_splits * pl.part_elems) * esz);
        if (!parts) {
            free(live);
            return FA_ENOMEM;
        }
    }
    /* the bool mask as bits, unless they cannot be allocated (then the tiles
     * read its bytes) */
    mask_pack mpk, *mp = NULL;
    if (pl.mask_pack) {
        mpk.rows = a->m_rs != 0 ? a->nq : 1;
        mpk.nw = (a->nk + 31) / 32 + 1;
        mpk.n_slices = 1;
        for (int d = a->n_lead - 1; d >= 0; d--) {
            mpk.s_lead[d] = a->m_lead[d] != 0 ? mpk.n_slices : 0;
            if (a->m_lead[d] != 0) mpk.n_slices *= a->lead_shape[d];
        }
        mpk.bits = malloc((size_t)(mpk.n_slices * mpk.rows * mpk.nw) * sizeof(uint32_t));
        if (mpk.bits) mp = &mpk;
    }
    const fa_attn_item_fn rows_fn = kv >= 0 ? isa->attn_item_rows_kv[kv] : isa->attn_item_rows[dt];
    const fa_attn_item_fn item_fn = pl.kernel == FA_KERNEL_ROWS ? rows_fn
                                    : pl.kernel == FA_KERNEL_WEIGHTS
                                        ? (kv >= 0 ? isa->weights_item_kv[kv] : isa->weights_item[dt])
                                        : (kv >= 0 ? isa->attn_item_kv[kv] : isa->attn_item[dt]);
    run_state st = {.a = a, .tiles = &pl.tiles, .item_fn = item_fn, .rows_fn = rows_fn,
                    .few = pl.few, .few_max = pl.rows_max, .full_lo = pl.full_lo, .full_hi = pl.full_hi,
                    .merge_fn = isa->attn_merge[dt],
                    .group_fn = kv >= 0 ? isa->attn_group_rows_kv[kv] : isa->attn_group_rows[dt],
                    .group = pl.group, .n_groups = pl.n_groups,
                    .esz = esz, .msz = a->mask_kind == FA_MASK_BOOL ? 1 : esz,
                    .scratch_bytes = (size_t)pl.scratch_elems * esz,
                    .n_qb = pl.n_qb, .n_items = pl.n_items, .n_splits = pl.n_splits, .chunk = pl.chunk,
                    .part_elems = pl.part_elems, .n_main = pl.n_qb - pl.tail, .live = live, .turns = pl.head_turns,
                    .mp = mp,
                    .parts = parts, .status = FA_OK, .weights = weights, .claimed = 0};
    for (int64_t w0 = 0; w0 < pl.n_items && st.status == FA_OK && !fa_stopped(a->stop); w0 += pl.wave) {
        st.w0 = w0;
        st.n_items = pl.n_items - w0 < pl.wave ? pl.n_items - w0 : pl.wave;
        st.pack = w0 == 0;
        st.claimed = 0;
        fa_run_parallel(run_team, &st, pl.threads);
    }
    if (mp) free(mp->bits);
    free(parts);
    free(live);
    return st.status == FA_OK && fa_stopped(a->stop) ? FA_EINTR : st.status;
}

int fa_attention(const fa_attention_args *a) { return run(a, 0); }

/* Attention weights (lead, nq, nk): the same items, each writing its rows of
 * probabilities.  out must be zero-filled. */
int fa_attention_weights(const fa_attention_args *a) { return run(a, 1); }
