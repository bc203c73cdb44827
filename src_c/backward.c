/*
 * The backward driver: fa_attention_backward (fastattn.h).  A work unit is
 * (leading index, block of bk keys), run by the backward kernel
 * (kernel/backward.h): it writes its keys' rows of dk and dv and adds to its
 * thread's dQ rows of that leading index.  Many leading indices: each thread
 * takes whole leading indices, and its dQ rows are the result's.  Few: the
 * team shares each leading index's key blocks (thread t the blocks t, t + T,
 * ...), then sums the threads' dQ rows in thread order.  Either way every sum
 * runs in a fixed order: the same inputs on the same team give bitwise the
 * same gradients.  Each leading index's D = rowsum(dO * out) is computed
 * before its key blocks (bwd_rows_d: by the thread that takes it, or shared
 * among the team), where a 16-bit dO is widened too; then its rows' lo, the
 * log of the weights' sum that a large lse lost, and their D anew from those
 * weights (bwd_lo, fa_bwd_lse_lo: lo 0 but for such rows; each query block
 * by one thread, so a team shares them by query blocks).  Packed sequences: the
 * state's counts (n_qb, n_kb, the dQ rows) are for the longest sequence; each
 * leading index's own rows and offsets come from lead_rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "runtime.h"

typedef struct {
    const fa_attention_args *a;
    const fa_backward_args *b;
    fa_tiles t;
    fa_bwd_unit_fn fn;
    fa_bwd_lo_fn lo_fn;
    fa_kv_widen_fn widen; /* 16-bit dO or out (do_kv, o_kv): their rows to float32 */
    int64_t n_lead, n_qb, n_kb, dkp;
    size_t esz, msz, scratch_bytes, dq_bytes, items_bytes, d_bytes, w_bytes;
    int per_lead;  /* 1: threads take whole leading indices */
    void **dq;     /* each team member's dQ rows (nq, dkp) */
    void *D;       /* per_lead 0: the leading index's D (nq), */
    void *lo;      /* its lo (nq, bwd_lo) */
    float *dow;    /* and a 16-bit dO widened (nq, dv), shared by the team (bwd_rows_d) */
    int status;
} bwd_state;

/* The element offset of leading index l in an operand of leading strides s. */
static int64_t lead_offset(const fa_attention_args *a, int64_t l, const int64_t *s)
{
    int64_t o = 0;
    for (int d = a->n_lead - 1; d >= 0; d--) {
        o += l % a->lead_shape[d] * s[d];
        l /= a->lead_shape[d];
    }
    return o;
}

/* Leading index l's rows: its first query row and key row in the arrays
 * (packed sequences: q_start and kv_start), and how many of each it has (the
 * real ones of a packed sequence; nq and nk otherwise). */
typedef struct {
    int64_t q0, k0, nq, nk;
} bwd_rows;

static bwd_rows lead_rows(const fa_attention_args *a, int64_t l)
{
    bwd_rows r = {0, 0, a->nq, a->nk};
    if (a->q_start) {
        r.q0 = a->q_start[lead_offset(a, l, a->qst_lead)];
        r.nq = fa_real_positions(a, lead_offset(a, l, a->qln_lead));
    }
    if (a->kv_start) {
        r.k0 = a->kv_start[lead_offset(a, l, a->kst_lead)];
        const int64_t kv = a->kv_len ? a->kv_len[lead_offset(a, l, a->kvl_lead)] : a->nk;
        r.nk = kv < 0 ? 0 : kv < a->nk ? kv : a->nk;
    }
    return r;
}

/* dO of leading index l (its rows r) as the kernel reads it, row stride *dos:
 * as given, or a 16-bit dO's rows widened into dow (nq, dv; bwd_rows_d). */
static const void *bwd_dout(const bwd_state *p, int64_t l, const bwd_rows *r, const float *dow, int64_t *dos)
{
    const fa_attention_args *a = p->a;
    const fa_backward_args *b = p->b;
    *dos = b->do_kv ? a->dv : b->do_rs;
    if (b->do_kv) return dow;
    return (const char *)b->dout + (lead_offset(a, l, b->do_lead) + r->q0 * b->do_rs) * (int64_t)p->esz;
}

/* Rows [i0, i1) of leading index l (its rows r): D_i = sum_c dO[i][c]
 * out[i][c] into D (nq), in the compute dtype, in one order; a 16-bit dO's
 * rows widened into dow (nq, dv) first (do_kv), a 16-bit out's row by row
 * into orow (dv). */
static void bwd_rows_d(const bwd_state *p, int64_t l, const bwd_rows *r, int64_t i0, int64_t i1, void *D,
                       float *dow, float *orow)
{
    const fa_attention_args *a = p->a;
    const fa_backward_args *b = p->b;
    const int64_t e = (int64_t)p->esz, dv = a->dv;
    const char *dout = (const char *)b->dout + (lead_offset(a, l, b->do_lead) + r->q0 * b->do_rs) * (b->do_kv ? 2 : e);
    const char *out = (const char *)a->out + (lead_offset(a, l, a->o_lead) + r->q0 * a->o_rs) * (b->o_kv ? 2 : e);
    if (b->do_kv)
        for (int64_t i = i0; i < i1; i++) p->widen(dout + i * b->do_rs * 2, dow + i * dv, dv);
    int64_t dos;
    dout = bwd_dout(p, l, r, dow, &dos);
    for (int64_t i = i0; i < i1; i++) {
        if (a->dtype == FA_F32) {
            const float *o = orow, *d = (const float *)dout + i * dos;
            if (b->o_kv)
                p->widen(out + i * a->o_rs * 2, orow, dv);
            else
                o = (const float *)out + i * a->o_rs;
            float s = 0;
            for (int64_t c = 0; c < dv; c++) s += d[c] * o[c];
            ((float *)D)[i] = s;
        } else {
            const double *o = (const double *)out + i * a->o_rs, *d = (const double *)dout + i * dos;
            double s = 0;
            for (int64_t c = 0; c < dv; c++) s += d[c] * o[c];
            ((double *)D)[i] = s;
        }
    }
}

/* Leading index l (its rows r): its query blocks as items its[0..n_qb) (their
 * real rows: fa_fill_item); returns n_qb. */
static int64_t bwd_items(const bwd_state *p, int64_t l, const bwd_rows *r, fa_item *its)
{
    const int64_t bq = p->t.bq, n_qb = (r->nq + bq - 1) / bq;
    for (int64_t qb = 0; qb < n_qb; qb++) {
        fa_fill_item(p->a, &p->t, NULL, p->n_qb, l * p->n_qb + qb, p->esz, p->msz, &its[qb]);
        its[qb].out = NULL; /* (the kernel reads D, not out) */
    }
    return n_qb;
}

/* lo (nq) of leading index l (its rows r, its items its[0..n_qb)), and D (nq)
 * where lo is not 0: the query blocks qs, qs + step, ... (fa_bwd_lse_lo); dO
 * as the kernel reads it (bwd_dout). */
static void bwd_lo(const bwd_state *p, const bwd_rows *r, const fa_item *its, int64_t n_qb, int64_t qs,
                   int64_t step, const void *dout, int64_t dos, void *D, void *lo, void *scratch)
{
    const int64_t e = (int64_t)p->esz;
    for (int64_t qb = qs; qb < n_qb && !fa_stopped(p->a->stop); qb += step) {
        const int64_t i0 = its[qb].i0;
        p->lo_fn(p->a, &p->t, &its[qb], r->nk, (const char *)dout + i0 * dos * e, dos, (char *)D + i0 * e,
                 (char *)lo + i0 * e, scratch);
    }
}

/* Leading index l (its rows r, its items its[0..n_qb)): the key blocks ks,
 * ks + step, ... of it, adding to dq (nq, dkp); dO as the kernel reads it
 * (bwd_dout), its rows' D (nq) and lo (nq). */
static void bwd_lead(const bwd_state *p, int64_t l, const bwd_rows *r, int64_t ks, int64_t step, const fa_item *its,
                     int64_t n_qb, const void *dout, int64_t dos, const void *D, const void *lo, void *dq,
                     void *scratch)
{
    const fa_attention_args *a = p->a;
    const fa_backward_args *b = p->b;
    const int64_t e = (int64_t)p->esz;
    const int64_t bk = p->t.bk, n_kb = (r->nk + bk - 1) / bk;
    char *dk = (char *)b->dk + (lead_offset(a, l, b->dk_lead) + r->k0 * b->dk_rs) * e;
    char *dv = (char *)b->dv + (lead_offset(a, l, b->dv_lead) + r->k0 * b->dv_rs) * e;
    for (int64_t kb = ks; kb < n_kb && !fa_stopped(a->stop); kb += step) {
        const int64_t j0 = kb * bk, nb = r->nk - j0 < bk ? r->nk - j0 : bk;
        if (n_qb == 0) { /* no query rows (the kernel reads K from its items): zeros */
            for (int64_t j = j0; j < j0 + nb; j++) {
                memset(dk + j * b->dk_rs * e, 0, (size_t)(a->dk * e));
                memset(dv + j * b->dv_rs * e, 0, (size_t)(a->dv * e));
            }
            continue;
        }
        p->fn(a, &p->t, its, n_qb, dout, dos, D, lo, j0, nb, dk + j0 * b->dk_rs * e, b->dk_rs, dv + j0 * b->dv_rs * e,
              b->dv_rs, dq, scratch);
    }
}

/* dq rows [r0, r1) of leading index l (its rows r) <- scale times the sum of
 * the n accumulators (nq, dkp) in order. */
static void bwd_write_dq(const bwd_state *p, int64_t l, const bwd_rows *r, void *const *acc, int n, int64_t r0,
                         int64_t r1)
{
    const fa_attention_args *a = p->a;
    const fa_backward_args *b = p->b;
    const int64_t dk = a->dk, dkp = p->dkp, rs = b->dq_rs, o = lead_offset(a, l, b->dq_lead) + r->q0 * rs;
    if (a->dtype == FA_F32) {
        float *dst = (float *)b->dq + o;
        for (int64_t i = r0; i < r1; i++)
            for (int64_t c = 0; c < dk; c++) {
                float s = 0;
                for (int t = 0; t < n; t++) s += ((const float *)acc[t])[i * dkp + c];
                dst[i * rs + c] = s * (float)a->scale;
            }
    } else {
        double *dst = (double *)b->dq + o;
        for (int64_t i = r0; i < r1; i++)
            for (int64_t c = 0; c < dk; c++) {
                double s = 0;
                for (int t = 0; t < n; t++) s += ((const double *)acc[t])[i * dkp + c];
                dst[i * rs + c] = s * a->scale;
            }
    }
}

static void bwd_team(void *arg)
{
    bwd_state *p = arg;
    const fa_attention_args *a = p->a;
    void *raw;
    char *scratch = fa_team_scratch(p->scratch_bytes + p->dq_bytes + p->items_bytes + p->d_bytes + p->w_bytes, &raw,
                                    &p->status);
    const int t = fa_thread_num(), team = fa_num_threads();
    void *dq = scratch ? scratch + p->scratch_bytes : NULL;
    fa_item *its = scratch ? (fa_item *)(scratch + p->scratch_bytes + p->dq_bytes) : NULL;
    /* the thread's D (nq), lo (nq) and a 16-bit dO widened (nq, dv) (per_lead), then a 16-bit out's row (dv) */
    char *ws = scratch ? scratch + p->scratch_bytes + p->dq_bytes + p->items_bytes : NULL;
    char *lo = ws ? ws + p->d_bytes / 2 : NULL;
    float *dow = ws ? (float *)(ws + p->d_bytes) : NULL;
    float *orow = ws ? dow + (p->per_lead && p->b->do_kv ? a->nq * a->dv : 0) : NULL;
    int64_t dos;
    p->dq[t] = dq;
    if (p->per_lead) {
#pragma omp for schedule(dynamic, 1)
        for (int64_t l = 0; l < p->n_lead; l++) {
            if (!scratch || fa_stopped(a->stop)) continue;
            const bwd_rows r = lead_rows(a, l);
            memset(dq, 0, (size_t)(r.nq * p->dkp) * p->esz);
            bwd_rows_d(p, l, &r, 0, r.nq, ws, dow, orow);
            const int64_t n_qb = bwd_items(p, l, &r, its);
            const void *dout = bwd_dout(p, l, &r, dow, &dos);
            bwd_lo(p, &r, its, n_qb, 0, 1, dout, dos, ws, lo, scratch);
            bwd_lead(p, l, &r, 0, 1, its, n_qb, dout, dos, ws, lo, dq, scratch);
            bwd_write_dq(p, l, &r, &dq, 1, 0, r.nq);
        }
    } else {
        for (int64_t l = 0; l < p->n_lead; l++) {
            const bwd_rows r = lead_rows(a, l);
            int64_t n_qb = 0;
            if (scratch) /* the member's share of the rows' D (and of a 16-bit dO widened) */
                bwd_rows_d(p, l, &r, r.nq * t / team, r.nq * (t + 1) / team, p->D, p->dow, orow);
#pragma omp barrier
            const void *dout = bwd_dout(p, l, &r, p->dow, &dos);
            if (scratch) { /* then its share of the query blocks' lo (and D anew where lo is not 0) */
                n_qb = bwd_items(p, l, &r, its);
                bwd_lo(p, &r, its, n_qb, t, team, dout, dos, p->D, p->lo, scratch);
            }
#pragma omp barrier
            if (scratch) {
                memset(dq, 0, (size_t)(r.nq * p->dkp) * p->esz);
                bwd_lead(p, l, &r, t, team, its, n_qb, dout, dos, p->D, p->lo, dq, scratch);
            }
#pragma omp barrier
            if (p->status == FA_OK) /* every member has its accumulator */
                bwd_write_dq(p, l, &r, p->dq, team, r.nq * t / team, r.nq * (t + 1) / team);
#pragma omp barrier
        }
    }
    free(raw);
}

int fa_attention_backward(const fa_attention_args *a, const fa_backward_args *b)
{
    fa_team_none();
    /* 16-bit K and V: float32, q in float32 or stored as K (q_kv) */
    const int kv = a->kv_dtype != FA_KV_SAME;
    if (a->row_group != 1 || (a->mask_kind != FA_MASK_NONE && (a->q_start || a->kv_start)) || !a->lse ||
        ((a->q_kv || b->do_kv || b->o_kv) && !kv) ||
        (kv && (a->dtype != FA_F32 || (a->kv_dtype != FA_KV_F16 && a->kv_dtype != FA_KV_BF16))))
        return FA_EINVAL;
    const fa_isa_table *isa = fa_isa_current();
    const int dt = a->dtype;
    bwd_state st = {.a = a, .b = b, .fn = kv ? isa->bwd_unit_kv[a->kv_dtype - 1] : isa->bwd_unit[dt],
                    .lo_fn = kv ? isa->bwd_lse_lo_kv[a->kv_dtype - 1] : isa->bwd_lse_lo[dt],
                    .widen = kv ? isa->kv_widen[a->kv_dtype - 1] : NULL, .status = FA_OK};
    st.esz = dt == FA_F32 ? sizeof(float) : sizeof(double);
    st.msz = a->mask_kind == FA_MASK_BOOL ? 1 : st.esz;
    st.n_lead = 1;
    for (int d = 0; d < a->n_lead; d++) st.n_lead *= a->lead_shape[d];
    if (st.n_lead == 0) return FA_OK;
    const int64_t lanes = isa->lanes[dt];
    const fa_tuning *tu = fa_tuning_current();
    const fa_overrides *f = a->force;
    const int want = fa_threads_wanted(a->num_threads);
    st.t.bq = f && f->bq ? f->bq : tu->bwd_bq;
    st.t.bk = f && f->bk ? f->bk : tu->bwd_bk;
    /* a team sharing one leading index's key blocks: at least two a member
     * (smaller units, down to 64 keys, rather than idle threads) */
    if (!(f && f->bk) && st.n_lead < 2 * (int64_t)want)
        while (st.t.bk > 64 && (a->nk + st.t.bk - 1) / st.t.bk < 2 * (int64_t)want) st.t.bk /= 2;
    st.t.bqp = (st.t.bq + lanes - 1) / lanes * lanes;
    st.t.ld = st.t.bqp;
    st.t.q_main = a->nq;
    st.n_qb = (a->nq + st.t.bq - 1) / st.t.bq;
    st.n_kb = (a->nk + st.t.bk - 1) / st.t.bk;
    st.dkp = (a->dk + lanes - 1) / lanes * lanes;
    /* a 16-bit q's rows widened after the kernel's scratch, 64-byte aligned (pack_queries) */
    const int64_t elems = fa_bwd_scratch_elems(&st.t, a->dk, a->dv, kv);
    st.t.q_off = a->q_kv ? (elems + FA_KV_HEAD - 1) / FA_KV_HEAD * FA_KV_HEAD : 0;
    st.scratch_bytes = ((size_t)(a->q_kv ? st.t.q_off + st.t.bq * a->dk : elems) * st.esz + 63) / 64 * 64;
    st.dq_bytes = ((size_t)(a->nq * st.dkp) * st.esz + 63) / 64 * 64;
    st.items_bytes = ((size_t)(st.n_qb > 0 ? st.n_qb : 1) * sizeof(fa_item) + 63) / 64 * 64;
    /* work: 5 products of nq nk (dk or dv) multiply-adds a leading index */
    const double work = 2.5 * (double)st.n_lead * (double)a->nq * (double)a->nk * (double)(a->dk + a->dv);
    st.per_lead = st.n_lead >= 2 * (int64_t)want || st.n_kb < 2;
    /* D (nq), lo (nq) and a 16-bit dO widened (nq, dv) (bwd_rows_d, bwd_lo):
     * each thread's own when threads take whole leading indices, else one for
     * the team; and a 16-bit out's row (dv) a thread */
    const size_t d_bytes = ((size_t)a->nq * st.esz + 63) / 64 * 64;
    const size_t dow_bytes = (size_t)(b->do_kv ? a->nq * a->dv : 0) * sizeof(float);
    st.d_bytes = st.per_lead ? 2 * d_bytes : 0;
    st.w_bytes = (st.per_lead ? dow_bytes : 0) + (size_t)(b->o_kv ? a->dv : 0) * sizeof(float);
    void *shared = NULL;
    if (!st.per_lead) {
        shared = malloc(2 * d_bytes + dow_bytes);
        if (!shared) return FA_ENOMEM;
        st.D = shared;
        st.lo = (char *)shared + d_bytes;
        st.dow = (float *)((char *)shared + 2 * d_bytes);
    }
    const int threads = fa_team_size(a->num_threads, st.per_lead ? st.n_lead : st.n_kb, work);
    void *dq_ptrs[FA_THREADS_MAX];
    st.dq = dq_ptrs;
    fa_run_parallel(bwd_team, &st, threads);
    free(shared);
    return st.status == FA_OK && fa_stopped(a->stop) ? FA_EINTR : st.status;
}
