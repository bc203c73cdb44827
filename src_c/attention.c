/*
 * Drivers: split the work into items, run them on OpenMP threads, give each
 * thread its own scratch, and report allocation failure as a status.
 * The kernels themselves (kernel_body.h) contain no OpenMP.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif

int fa_openmp_enabled(void)
{
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

int fa_max_threads(void)
{
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* Team size: the caller's request or the OpenMP default, no more than the work
 * items, and one thread when the work is too small to pay for a team. */
static int team_size(int requested, int64_t items, double work)
{
    int n = requested > 0 ? requested : fa_max_threads();
    if ((int64_t)n > items) n = (int)items;
    if (work < 1.5e5) n = 1;
    return n < 1 ? 1 : n;
}

/* 64-byte aligned scratch; free with free(raw). */
static void *scratch_alloc(size_t bytes, void **raw)
{
    *raw = malloc(bytes + 64);
    if (!*raw) return NULL;
    return (void *)(((uintptr_t)*raw + 63) & ~(uintptr_t)63);
}

/* ---------------------------------------------------------------------------
 * Attention.  Work items are (leading index, block of bq query rows); each
 * thread owns the output rows of its items, so no reduction is needed.
 * Dynamic scheduling evens out causal work (later query blocks see more keys).
 * ------------------------------------------------------------------------- */

static void choose_tiles(const fa_attention_args *a, int lanes, fa_tiles *t)
{
    const int64_t tw = 2 * lanes;
    t->bq = a->nq < 64 ? a->nq : 64;
    if (t->bq < 1) t->bq = 1;
    t->bqp = (t->bq + tw - 1) / tw * tw;
    const int64_t bk_max = a->dtype == FA_F32 ? 256 : 128;
    t->bk = a->nk < bk_max ? a->nk : bk_max;
    if (t->bk < 1) t->bk = 1;
}

int fa_attention(const fa_attention_args *a)
{
    if (a->dtype != FA_F32 && a->dtype != FA_F64) return FA_EINVAL;
    if (a->n_lead < 0 || a->n_lead > FA_MAX_DIMS) return FA_EINVAL;
    int64_t n_lead_total = 1;
    for (int d = 0; d < a->n_lead; d++) n_lead_total *= a->lead_shape[d];
    if (n_lead_total == 0 || a->nq == 0) return FA_OK;

    const fa_isa_table *isa = fa_isa_current();
    const fa_attn_item_fn item_fn = isa->attn_item[a->dtype];
    const size_t esz = a->dtype == FA_F32 ? sizeof(float) : sizeof(double);
    const size_t msz = a->mask_kind == FA_MASK_BOOL ? 1 : esz;
    fa_tiles tiles;
    choose_tiles(a, isa->lanes[a->dtype], &tiles);
    const int64_t n_qb = (a->nq + tiles.bq - 1) / tiles.bq;
    const int64_t n_items = n_lead_total * n_qb;
    const size_t scratch_bytes = (size_t)fa_attn_scratch_elems(&tiles, a->dk, a->dv) * esz;
    const double work = (double)n_lead_total * (double)a->nq * (double)(a->nk + 1) *
                        (double)(a->dk + a->dv + 8);
    const int nthreads = team_size(a->num_threads, n_items, work);
    int status = FA_OK;

#pragma omp parallel num_threads(nthreads)
    {
        void *raw;
        void *scratch = scratch_alloc(scratch_bytes, &raw);
        if (!scratch) {
#pragma omp atomic write
            status = FA_ENOMEM;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < n_items; w++) {
            if (!scratch) continue;
            /* decode the leading index (row-major over lead_shape) */
            int64_t lead = w / n_qb, qb = w % n_qb;
            int64_t oq = 0, ok = 0, ov = 0, oo = 0, om = 0, ol = 0;
            for (int d = a->n_lead - 1; d >= 0; d--) {
                const int64_t i = lead % a->lead_shape[d];
                lead /= a->lead_shape[d];
                oq += i * a->q_lead[d];
                ok += i * a->k_lead[d];
                ov += i * a->v_lead[d];
                oo += i * a->o_lead[d];
                om += i * a->m_lead[d];
                ol += i * a->lse_lead[d];
            }
            const int64_t i0 = qb * tiles.bq;
            fa_item it;
            it.i0 = i0;
            it.bq = (a->nq - i0 < tiles.bq) ? a->nq - i0 : tiles.bq;
            it.j_lo = 0;
            it.j_hi = a->nk;
            it.q = (const char *)a->q + (oq + i0 * a->q_rs) * (int64_t)esz;
            it.k = (const char *)a->k + ok * (int64_t)esz;
            it.v = (const char *)a->v + ov * (int64_t)esz;
            it.mask = a->mask ? (const char *)a->mask + (om + i0 * a->m_rs) * (int64_t)msz : NULL;
            it.out = (char *)a->out + (oo + i0 * a->o_rs) * (int64_t)esz;
            it.lse = a->lse ? (char *)a->lse + (ol + i0 * a->lse_rs) * (int64_t)esz : NULL;
            it.part = NULL;
            item_fn(a, &tiles, &it, scratch);
        }
        free(raw);
    }
    return status;
}

/* ---------------------------------------------------------------------------
 * Softmax along the last axis, parallel over rows.
 * ------------------------------------------------------------------------- */
int fa_softmax(const fa_softmax_args *a)
{
    if (a->dtype != FA_F32 && a->dtype != FA_F64) return FA_EINVAL;
    if (a->n_lead < 0 || a->n_lead > FA_MAX_DIMS) return FA_EINVAL;
    int64_t rows = 1;
    for (int d = 0; d < a->n_lead; d++) rows *= a->lead_shape[d];
    if (rows == 0 || a->n == 0) return FA_OK;

    const fa_softmax_row_fn row_fn = fa_isa_current()->softmax_row[a->dtype];
    const size_t esz = a->dtype == FA_F32 ? sizeof(float) : sizeof(double);
    const size_t scratch_bytes = (size_t)fa_softmax_scratch_elems(a->n) * esz;
    const int nthreads = team_size(a->num_threads, rows, 20.0 * (double)rows * (double)a->n);
    int status = FA_OK;

#pragma omp parallel num_threads(nthreads)
    {
        void *raw;
        void *scratch = scratch_alloc(scratch_bytes, &raw);
        if (!scratch) {
#pragma omp atomic write
            status = FA_ENOMEM;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!scratch) continue;
            int64_t idx = r, ox = 0, oo = 0;
            for (int d = a->n_lead - 1; d >= 0; d--) {
                const int64_t i = idx % a->lead_shape[d];
                idx /= a->lead_shape[d];
                ox += i * a->x_lead[d];
                oo += i * a->o_lead[d];
            }
            row_fn((const char *)a->x + ox * (int64_t)esz, a->x_s, (char *)a->out + oo * (int64_t)esz,
                   a->o_s, a->n, scratch);
        }
        free(raw);
    }
    return status;
}
