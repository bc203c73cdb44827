/*
 * The plan of an attention call: everything that chooses what runs, in one
 * place.  From the arguments, the CPU's table (dispatch.c) and the call's
 * overrides (fa_attention_args.force, for the tests and for tuning) it decides
 * the kernel, the tiles, the tail, the group kernel, the key splits and their
 * waves, the packing of a bool mask, the team and the scratch.  attention.c
 * carries the plan out; _core.plan() returns it to Python.  The measurements
 * behind each choice are in docs/tuning.md, under the names used here.
 */
#include <stdint.h>
#include <stdlib.h>

#include "internal.h"
#include "runtime.h"

static const fa_overrides no_overrides = {.fuse = -1, .stream = -1, .far = -1, .decode_pf = -1, .group = -1,
                                           .group_touch = -1, .mask_pack = -1, .head_turns = -1,
                                           .mask_cache = -1};

/* Bytes of K and V that a call reads (broadcast leading dims counted once). */
static int64_t kv_bytes(const fa_attention_args *a)
{
    int64_t nk_rows = a->nk, nv_rows = a->nk;
    for (int d = 0; d < a->n_lead; d++) {
        if (a->k_lead[d] != 0) nk_rows *= a->lead_shape[d];
        if (a->v_lead[d] != 0) nv_rows *= a->lead_shape[d];
    }
    return (nk_rows * a->dk + nv_rows * a->dv) * fa_kv_esz(a);
}

/* The tiles (query rows per item, keys per tile, their padded layout).
 * Query rows: the tuning's bq_tiled (at most 128 under a mask or a band, whose
 * rows come with each block or whose diagonal wastes more of a larger one),
 * halved down to 32 while the packed queries Qt (dk, bq)
 * would exceed the tuning's q_tile_bytes (the L1, where it holds them beside
 * the key tile; more rows a block read each K and V element for more of them),
 * or q_tile_bytes_band under a causal band or a window (a larger block computes
 * more of the scores that the band hides), and while that leaves fewer than four
 * items per thread; 32 under a narrow window, which wastes less at its edges.
 * Keys: the row kernel long tiles (fewer switches between the K and V streams:
 * the tuning's bk_decode for one row, bk_rows for more); the tiled kernel the
 * tuning's bk_tiled (64: a tile's K and V arrive from memory
 * in time through the prefetch one pass ahead), bk_tiled_mem for few rows from
 * memory (with tile_pf_l1, fewer keys of rows longer than 512 bytes, more of float32 rows
 * up to 256 bytes). */
static void choose_tiles(const fa_attention_args *a, const fa_overrides *f, const fa_tuning *tu, int64_t lanes,
                         int64_t rows_max, int rows_kernel, int from_memory, int64_t n_lead, int threads, fa_tiles *t)
{
    const int64_t esz = a->dtype == FA_F32 ? 4 : 8;
    const int band = a->causal || a->win_left >= 0 || a->win_right >= 0;
    /* longer blocks only without a mask or a band (docs/tuning.md, bq_tiled) */
    const int64_t bq_top = (a->mask_kind == FA_MASK_NONE && !band) || tu->bq_tiled < 128 ? tu->bq_tiled : 128;
    int64_t bq_max = rows_kernel ? rows_max : bq_top;
    const int64_t q_bytes = band ? tu->q_tile_bytes_band : tu->q_tile_bytes;
    while (!rows_kernel && bq_max > 32 && a->dk * bq_max * esz > q_bytes) bq_max /= 2;
    while (!rows_kernel && bq_max > 32 && n_lead * ((a->nq + bq_max - 1) / bq_max) < 4 * (int64_t)threads)
        bq_max /= 2;
    if (!rows_kernel && a->win_left >= 0 && a->win_left < 1024 && bq_max > 32) bq_max = 32;
    if (f->bq && !rows_kernel) bq_max = f->bq;
    t->bq = a->nq < bq_max ? a->nq : bq_max;
    if (t->bq < 1) t->bq = 1;
    t->q_main = a->nq;
    t->bqp = (t->bq + lanes - 1) / lanes * lanes; /* whole vectors: the micro-kernels take one or two */
    /* Rows of the transposed tiles (St, Qt, Ot) one cache line further apart
     * when bqp would put them a multiple of 128 bytes apart, so that a column
     * slice of them spreads over more sets of the L1. */
    t->ld = t->bqp;
    if ((t->bqp * esz) % 128 == 0) t->ld += 64 / esz;
    int64_t bk_max = !rows_kernel ? tu->bk_tiled : a->nq == 1 ? tu->bk_decode : tu->bk_rows;
    /* into L1 only K's and V's own contiguous rows: rows at the heads' stride fall in
     * few of its sets */
    t->pf_l1 = !rows_kernel && t->bq <= 32 && from_memory && tu->tile_pf_l1 && a->k_rs == a->dk &&
               a->v_rs == a->dv && a->kv_dtype == FA_KV_SAME;
    if (!rows_kernel && t->bq <= 32 && from_memory) bk_max = tu->bk_tiled_mem;
    if (t->pf_l1) { /* K and V tiles that L1 holds beside the item's: bk_tiled_mem rows of 512 bytes;
                     * of float32 rows up to 256 bytes, half as many more (docs/tuning.md, tile_pf_l1) */
        const int64_t fit = (int64_t)tu->bk_tiled_mem * 512 / (a->dk * esz);
        int64_t bk = fit < bk_max ? fit : bk_max;
        if (esz == 4 && fit >= 2 * bk_max) bk = bk_max * 3 / 2;
        bk_max = bk < 8 ? 8 : bk;
    }
    if (f->bk) bk_max = f->bk;
    t->bk = a->nk < bk_max ? a->nk : bk_max;
    if (t->bk < 1) t->bk = 1;
}

int64_t fa_live_items(const fa_attention_args *a, int64_t n_lead_total, int64_t n_qb, int64_t bq, int64_t *live,
                      double *rows)
{
    int64_t n = 0;
    *rows = 0;
    for (int64_t l = 0; l < n_lead_total; l++) {
        int64_t rest = l, oql = 0;
        for (int d = a->n_lead - 1; d >= 0; d--) { /* row-major over lead_shape, as fill_item */
            oql += rest % a->lead_shape[d] * a->qln_lead[d];
            rest /= a->lead_shape[d];
        }
        const int64_t real = fa_real_positions(a, oql) * a->row_group, blocks = (real + bq - 1) / bq;
        if (live)
            for (int64_t qb = 0; qb < blocks; qb++) live[n + qb] = l * n_qb + qb;
        n += blocks;
        *rows += (double)real;
    }
    return n;
}

/* Whether the last leading dim's K and V rows interleave key by key (the heads
 * of a (B, n, H, d) cache), where the group kernel can take the heads. */
static int heads_interleave(const fa_attention_args *a)
{
    if (a->n_lead < 1) return 0;
    const int d = a->n_lead - 1;
    const int64_t hn = a->lead_shape[d];
    return hn >= 2 && a->k_lead[d] > 0 && a->k_lead[d] * hn == a->k_rs && a->v_lead[d] > 0 &&
           a->v_lead[d] * hn == a->v_rs;
}

/* Decoding from a (B, n, H, d) cache: the last leading dim's indices h (the
 * heads) have their K and V rows at h k_lead (v_lead) within key rows that
 * hold all of them (k_rs = H k_lead).  With up to FA_GROUP_ROWS query rows an
 * item and K and V from memory, the group kernel takes the heads of each group
 * together, key tile by key tile, so that K and V are read in address order,
 * not in pieces H d elements apart; in cache the item-by-item kernel's rows
 * come from the L3 fast enough.  Sets p->group (0: none), p->n_groups and the
 * group's key tile.  group_fits: whether the group kernel takes the call, given
 * the row kernel (long_splits: plan_splits' splits of long rows). */
static int group_fits(const fa_attention_args *a, const fa_overrides *f, int from_memory, int64_t long_splits)
{
    return a->nq <= FA_GROUP_ROWS && !a->q_start && !a->kv_start && a->n_lead >= 1 && f->group != 0 &&
           long_splits == 1 && heads_interleave(a) && (f->group == 1 || from_memory);
}
static void plan_group(const fa_attention_args *a, const fa_overrides *f, const fa_tuning *tu, fa_plan *p)
{
    p->group = p->n_groups = 0;
    if (p->kernel != FA_KERNEL_ROWS || !group_fits(a, f, p->from_memory, p->long_splits)) return;
    const int64_t hn = a->lead_shape[a->n_lead - 1];
    const int64_t per = FA_GROUP_MAX / a->nq, n_sub = (hn + per - 1) / per; /* at most FA_GROUP_MAX rows a group */
    p->group = (hn + n_sub - 1) / n_sub;
    p->n_groups = p->n_lead / hn * n_sub;
    /* FA_GROUP_BK keys for one row; for more, about group_tile_bytes of the
     * group's K and V, 8 to 64 keys */
    int64_t gbk = FA_GROUP_BK;
    const int64_t key_bytes = p->group * (a->dk + a->dv) * (a->dtype == FA_F32 ? 4 : 8); /* 0: d_k = d_v = 0 */
    if (a->nq > 1) {
        gbk = key_bytes > 0 ? tu->group_tile_bytes / key_bytes / 4 * 4 : tu->group_bk_max;
        gbk = gbk < 8 ? 8 : gbk > tu->group_bk_max ? tu->group_bk_max : gbk;
    }
    if (!f->bk) p->tiles.bk = a->nk < gbk ? (a->nk < 1 ? 1 : a->nk) : gbk;
}

/* The key splits: rows of more than FA_SPLIT_KEYS keys always (a float32
 * running sum stops taking its increments well before 2^24 of them, and a unit
 * stays short enough for Ctrl-C); otherwise when there are fewer units than
 * threads (flash-decoding), or, for groups, few and long, where the threads
 * would not get as many each.  Then the waves: items whose partials fit in
 * FA_PARTS_BYTES at a time. */
static void plan_splits(const fa_attention_args *a, const fa_overrides *f, int want, fa_plan *p)
{
    const int64_t n_work = p->group ? p->n_groups : p->n_items;
    p->n_splits = 1;
    if (p->kernel != FA_KERNEL_WEIGHTS && n_work < want && a->nk >= 1024) {
        p->n_splits = (want + n_work - 1) / n_work;
        if (p->n_splits > a->nk / 512) p->n_splits = a->nk / 512;
    }
    if (p->group && n_work >= want && n_work % want != 0 && n_work < 4 * (int64_t)want && a->nk >= 1024) {
        p->n_splits = want;
        if (p->n_splits > a->nk / 512) p->n_splits = a->nk / 512;
    }
    if (p->n_splits < p->long_splits) p->n_splits = p->long_splits;
    const int64_t bk = p->tiles.bk;
    p->chunk = p->n_splits > 1 ? ((a->nk + p->n_splits - 1) / p->n_splits + bk - 1) / bk * bk : a->nk;
    p->part_elems = p->tiles.bq * (a->dv + 2);
    p->wave = p->n_items;
    if (p->n_splits > 1) {
        const int64_t per_item = p->n_splits * p->part_elems * (a->dtype == FA_F32 ? 4 : 8);
        const int64_t budget = f->parts_bytes ? f->parts_bytes : FA_PARTS_BYTES;
        if (!p->group && per_item * p->n_items > budget) p->wave = budget / per_item > 0 ? budget / per_item : 1;
    }
}

/* Each thread's scratch, in elements: the largest that any kernel the plan
 * runs needs (the row kernel for one row always: the careful redo). */
static int64_t plan_scratch(const fa_attention_args *a, const fa_plan *p)
{
    const fa_tiles *t = &p->tiles;
    const int weights = p->kernel == FA_KERNEL_WEIGHTS;
    int64_t n = p->kernel == FA_KERNEL_ROWS ? fa_rows_scratch_elems(t, a->dk, a->dv)
                                           : fa_attn_scratch_elems(t, a->dk, weights ? 0 : a->dv);
    if (t->kv_off) n = t->kv_off + fa_kv_cache_elems(t, a->dk, weights ? 0 : a->dv); /* widened K and V */
    if (t->q_off) n = t->q_off + t->bq * a->dk;                                    /* ... and q */
    if ((p->few || p->tail) && n < fa_rows_scratch_elems(t, a->dk, a->dv)) n = fa_rows_scratch_elems(t, a->dk, a->dv);
    if (p->group && n < fa_group_scratch_elems(t, a->dk, a->dv, p->group))
        n = fa_group_scratch_elems(t, a->dk, a->dv, p->group);
    if (n < a->dv + 2) n = a->dv + 2;
    const fa_tiles one = {.bq = 1, .bk = t->bk, .bqp = 1, .ld = 1, .fuse = 0};
    const int64_t row = fa_rows_scratch_elems(&one, a->dk, a->dv);
    if (!weights && n < row) n = row;
    return n;
}

int fa_attention_plan(const fa_attention_args *a, int weights, fa_plan *p)
{
    if (a->dtype != FA_F32 && a->dtype != FA_F64) return FA_EINVAL;
    if (a->kv_dtype != FA_KV_SAME && (a->dtype != FA_F32 || (a->kv_dtype != FA_KV_F16 && a->kv_dtype != FA_KV_BF16)))
        return FA_EINVAL; /* 16-bit K and V: float32 calls only */
    if (a->q_kv && a->kv_dtype == FA_KV_SAME) return FA_EINVAL;
    if (a->n_lead < 0 || a->n_lead > FA_MAX_DIMS) return FA_EINVAL;
    if (a->row_group < 1 || a->nq % a->row_group) return FA_EINVAL;
    if ((a->q_start || a->kv_start) && a->mask_kind != FA_MASK_NONE) return FA_EINVAL;
    const fa_overrides *f = a->force ? a->force : &no_overrides;
    const fa_isa_table *isa = fa_isa_current();
    const fa_tuning tuning = *fa_tuning_current(), *tu = &tuning; /* one table throughout */
    const int dt = a->dtype;
    *p = (fa_plan){0};
    p->n_lead = 1;
    for (int d = 0; d < a->n_lead; d++) p->n_lead *= a->lead_shape[d];
    p->lanes = isa->lanes[dt];
    p->tail_max = tu->tail_max[dt];
    p->kv_bytes = kv_bytes(a);
    p->from_memory = p->kv_bytes > tu->kv_mem_bytes; /* K and V beyond the L3 */

    /* The kernel.  The row kernel up to rows_max query rows (more with K and V
     * from memory, more or fewer with them at dk >= FA_ROWS_DK_BIG where the
     * table sets rows_max_big_dk, or long dot products; with 16-bit K and V, which the tiled
     * kernel widens first, rows_max_kv where the table sets it: docs/tuning.md,
     * rows_max_kv), except that rows_full to lanes rows,
     * which fill one vector of the tiled kernel, take that one; not where
     * dk > FA_ROWS_DK_BIG with K and V from memory, nor for 16-bit K and V
     * from dk = FA_ROWS_DK_BIG on, which the tiled kernel widens first and the
     * row kernel reads as stored; nor, where the table's rows_full_dk says so,
     * from that dk on or for 16-bit K and V from memory, where K's and V's rows
     * are contiguous (head-major; the row kernel is slower over rows at the
     * heads' stride: docs/tuning.md, rows_full, rows_full_dk). */
    p->rows_max = f->rows_max          ? (f->rows_max < FA_ROWS_CAP ? f->rows_max : FA_ROWS_CAP)
                  : a->kv_dtype != FA_KV_SAME && tu->rows_max_kv > 0 ? tu->rows_max_kv
                  : p->from_memory && a->dk >= FA_ROWS_DK_BIG && tu->rows_max_big_dk[dt] > 0
                                       ? tu->rows_max_big_dk[dt]
                  : p->from_memory     ? tu->rows_max_big[dt]
                  : a->dk >= FA_ROWS_DK_BIG ? tu->rows_max_dk[dt]
                                            : tu->rows_max[dt];
    /* A (B, n, H, d) cache from memory: up to the table's group_rows query rows
     * take the group kernel past rows_max_big, where the tiled kernel reads each
     * head's rows in pieces H d apart (docs/tuning.md, group_rows). */
    const int64_t split_keys = f->split_keys ? f->split_keys : FA_SPLIT_KEYS;
    p->long_splits = !weights && a->nk > split_keys ? (a->nk + split_keys - 1) / split_keys : 1;
    if (!f->rows_max && !weights && p->from_memory && a->nq > p->rows_max && a->nq <= tu->group_rows[dt] &&
        group_fits(a, f, p->from_memory, p->long_splits))
        p->rows_max = (int)a->nq;
    p->full_lo = 1, p->full_hi = 0; /* (empty) */
    const int full_dk = tu->rows_full_dk > 0 && a->k_rs == a->dk && a->v_rs == a->dv &&
                        (a->dk >= tu->rows_full_dk || (a->kv_dtype != FA_KV_SAME && p->from_memory));
    if (!f->rows_max && tu->rows_full[dt] > 0 && !(p->from_memory && a->dk > FA_ROWS_DK_BIG) &&
        !(a->kv_dtype != FA_KV_SAME && a->dk >= FA_ROWS_DK_BIG) && !full_dk) {
        p->full_lo = tu->rows_full[dt];
        p->full_hi = isa->lanes[dt];
    }
    p->kernel = weights ? FA_KERNEL_WEIGHTS
                : fa_few_rows(a->nq, p->rows_max, p->full_lo, p->full_hi) ? FA_KERNEL_ROWS
                                                                           : FA_KERNEL_TILED;
    if (p->n_lead == 0 || a->nq == 0 || (weights && a->nk == 0)) return FA_OK; /* nothing to do: n_items 0 */
    const int rows_kernel = p->kernel == FA_KERNEL_ROWS;
    const int want = fa_threads_wanted(a->num_threads);
    choose_tiles(a, f, tu, p->lanes, p->rows_max, rows_kernel, p->from_memory, p->n_lead, want, &p->tiles);
    p->tiles.fuse = f->fuse >= 0 ? f->fuse : tu->fuse;
    p->tiles.spread = tu->tile_spread && p->lanes == 16; /* float32 on AVX-512 only (tiled.h, RBS) */
    p->tiles.pipe_pf_l2 = tu->pipe_pf_l2;
    p->tiles.stream = f->stream >= 0 ? f->stream : p->from_memory && tu->stream;
    const int decoding = rows_kernel && p->tiles.bq == 1 && a->kv_dtype == FA_KV_SAME; /* (decode_far, _inorder) */
    p->tiles.far = f->far >= 0      ? f->far
                   : f->stream >= 0 ? f->stream
                                    : p->kv_bytes > tu->kv_far_bytes && (tu->decode_far || !decoding);
    p->tiles.decode_pf = f->decode_pf >= 0 ? f->decode_pf : a->kv_dtype != FA_KV_SAME || tu->decode_pf[dt];
    p->tiles.inorder = decoding && p->tiles.far && tu->decode_inorder; /* decode_step's */
    /* the row kernel's own items only: not the tiled kernel's tails, which follow
     * their block while K and V are still in cache (docs/tuning.md, pipe_rows) */
    p->tiles.pipe_rows = f->pipe_rows > 0 ? (int)(f->pipe_rows < FA_ROWS_CAP ? f->pipe_rows : FA_ROWS_CAP)
                         : rows_kernel && p->from_memory ? tu->pipe_rows[dt]
                                                         : 1;
    p->tiles.group_touch = f->group_touch >= 0 ? f->group_touch : tu->group_touch;
    p->tiles.chunks_rows = tu->group_chunks_rows;

    /* The tail: the rows of the last block past its last whole vector (fewer
     * than the lanes, but the tiled kernel pays for the whole vector) take the
     * row kernel, up to tail_max of them after at least 16 rows, right after
     * the block before them on the same thread, while K and V are still in its
     * caches.  Not with packed sequences, the weights, forced rows or tiles, or
     * split keys; nor, where the table's tail_mem is 0, after a single block
     * with K and V from memory: the tail would read them from memory again. */
    if (p->kernel == FA_KERNEL_TILED && !a->q_start && !f->rows_max && !f->bq && p->long_splits == 1) {
        const int64_t bq = p->tiles.bq, last = a->nq - (a->nq - 1) / bq * bq, r = last % p->lanes;
        const int64_t blocks = (a->nq - r + bq - 1) / bq;
        if (r > 0 && r <= p->tail_max && a->nq - r >= 16 && p->n_lead * blocks >= want &&
            (tu->tail_mem || blocks > 1 || !p->from_memory)) {
            p->tiles.q_main = a->nq - r;
            p->tail = 1;
        }
    }
    p->n_qb = (p->tiles.q_main + p->tiles.bq - 1) / p->tiles.bq + p->tail;
    p->n_items = p->n_lead * (p->n_qb - p->tail);
    p->q_rows = (double)p->n_lead * (double)a->nq;
    /* Packed sequences: only the items with real rows (one long sequence among
     * many short ones gives most (lead, block) pairs no row); under the tiled
     * kernel, a short one's items, as few rows as a call of its own would give
     * the row kernel, take the row kernel too. */
    if (a->q_start) {
        p->n_items = fa_live_items(a, p->n_lead, p->n_qb, p->tiles.bq, NULL, &p->q_rows);
        p->few = p->kernel == FA_KERNEL_TILED;
    }
    plan_group(a, f, tu, p);
    plan_splits(a, f, want, p);
    p->tiles.kv_off = p->tiles.kv_rows = p->tiles.q_off = 0;
    if (a->kv_dtype != FA_KV_SAME && p->kernel != FA_KERNEL_ROWS) { /* after the tiled kernel's scratch */
        /* past what the tiled kernel and the row kernel (its tails, few rows and careful redo) use */
        const int64_t w = a->dk + (weights ? 0 : a->dv), at = fa_attn_scratch_elems(&p->tiles, a->dk, w - a->dk);
        const int64_t rw = fa_rows_scratch_elems(&p->tiles, a->dk, a->dv), end = at > rw ? at : rw;
        p->tiles.kv_off = (end + FA_KV_HEAD - 1) / FA_KV_HEAD * FA_KV_HEAD;   /* 64-byte aligned */
        /* an item's keys: all of them, or with a window on both sides its rows' span */
        int64_t span = a->nk;
        if (a->win_left >= 0 && (a->win_right >= 0 || a->causal)) {
            const int64_t right = a->causal || a->win_right < 0 ? 0 : a->win_right;
            span = p->tiles.bq + 1 + a->win_left + right + p->tiles.bk;
            span = span < a->nk ? span : a->nk;
        }
        p->tiles.kv_rows = span * w * 4 <= FA_KV_CACHE_BYTES ? span : p->tiles.bk;
        /* one query block a leading index (few rows): no item reads another's keys, so a
         * key tile at a time, widened into the L1, not all the keys through the L3 and back
         * (docs/tuning.md, kv_rows) */
        if (!weights && p->n_qb - p->tail <= 1) p->tiles.kv_rows = p->tiles.bk;
        if (a->q_kv) p->tiles.q_off = p->tiles.kv_off + fa_kv_cache_elems(&p->tiles, a->dk, w - a->dk);
    }
    p->scratch_elems = plan_scratch(a, p);

    /* A bool mask under the tiled kernel that two or more leading indices share
     * (its rows broadcast too): packed into bits first, so that each tile reads
     * an eighth of its bytes; not a mask of each head's own, whose packing pass
     * would read it all from memory once more. */
    if (a->mask_kind == FA_MASK_BOOL && !rows_kernel && f->mask_pack != 0) {
        int64_t slices = 1;
        for (int d = 0; d < a->n_lead; d++)
            if (a->m_lead[d] != 0) slices *= a->lead_shape[d];
        p->mask_pack = f->mask_pack == 1 || p->n_lead >= 2 * slices || a->m_rs == 0 || a->nq == 1;
    }
    /* A float mask that the last leading dim's indices (the heads) share, under
     * the tiled kernel: where an item's mask rows (bq nk) are at least its K and V
     * (nk (dk + dv)), the items go query block by query block, the heads in turn,
     * so that a block's mask rows come from memory once for all the heads, not
     * once for each; the heads' K and V are then reread from the cache instead,
     * which costs more where they outweigh the rows (docs/tuning.md, head_turns).
     * Not with 16-bit K and V: their widened rows are kept for one head at a time
     * (kv_rows_widened), and each turn would widen them again. */
    p->head_turns = 0;
    const int64_t heads = a->n_lead > 0 ? a->lead_shape[a->n_lead - 1] : 1;
    if (a->mask_kind == FA_MASK_ADD && a->m_rs != 0 && heads > 1 && a->m_lead[a->n_lead - 1] == 0 &&
        a->kv_dtype == FA_KV_SAME && p->kernel == FA_KERNEL_TILED && !weights && !a->q_start && !p->group &&
        p->n_splits == 1 && p->wave >= p->n_items && p->n_qb - p->tail > 1 && f->head_turns != 0 &&
        (f->head_turns == 1 || p->tiles.bq >= a->dk + a->dv))
        p->head_turns = heads;
    p->work = p->q_rows * (double)(a->nk + 1) * (double)(a->dk + a->dv + 8);
    p->threads = fa_team_size(a->num_threads, (p->group ? p->n_groups : p->n_items) * p->n_splits, p->work);
    /* ... and then the first item on a query block's mask rows keeps the tiles it
     * transposed (mask_cache_fill, or mask_tile) for the next ones (the other heads): they add them to
     * the scores as the products store them, not in a pass of their own.  Where each
     * thread takes at least two heads of a block in turn, so that some item reuses
     * them; not under a softcap or ALiBi, which come before the mask
     * (docs/tuning.md, mask_cache). */
    p->tiles.mt_off = 0;
    if (p->head_turns && !(a->softcap > 0) && !a->slopes && f->mask_cache != 0 &&
        (f->mask_cache == 1 || p->head_turns >= 2 * p->threads)) {
        const int64_t esz = a->dtype == FA_F32 ? 4 : 8, elems = fa_mt_cache_elems(&p->tiles, a->nk, esz);
        if (f->mask_cache == 1 || elems * esz <= FA_MT_CACHE_BYTES) {
            p->tiles.mt_off = (p->scratch_elems + 15) / 16 * 16; /* 64-byte aligned */
            p->scratch_elems = p->tiles.mt_off + elems;
        }
    }
    return FA_OK;
}

int fa_gqa_fold(int64_t n_q, int64_t kv_bytes)
{
    const fa_tuning *tu = fa_tuning_current();
    return n_q <= tu->fold_rows || (n_q <= tu->fold_rows_big && kv_bytes >= tu->fold_big_bytes);
}
