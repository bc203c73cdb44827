/*
 * fastattn.softmax's driver: softmax along the last axis, parallel over rows
 * (the row kernel: fa_softmax_row in kernel/softmax_row.h).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "runtime.h"

typedef struct {
    const fa_softmax_args *a;
    fa_softmax_row_fn row_fn;
    size_t esz, scratch_bytes;
    int64_t rows;
    int status;
} softmax_plan;

static void softmax_team(void *arg)
{
    softmax_plan *p = arg;
    const fa_softmax_args *a = p->a;
    void *raw;
    void *scratch = fa_team_scratch(p->scratch_bytes, &raw, &p->status);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < p->rows; r++) {
        if (!scratch || fa_stopped(a->stop)) continue;
        int64_t idx = r, ox = 0, oo = 0;
        for (int d = a->n_lead - 1; d >= 0; d--) {
            const int64_t i = idx % a->lead_shape[d];
            idx /= a->lead_shape[d];
            ox += i * a->x_lead[d];
            oo += i * a->o_lead[d];
        }
        p->row_fn((const char *)a->x + ox * (int64_t)p->esz, a->x_s,
                  (char *)a->out + oo * (int64_t)p->esz, a->o_s, a->n, scratch);
    }
    free(raw);
}

int fa_softmax(const fa_softmax_args *a)
{
    fa_team_none();
    if (a->dtype != FA_F32 && a->dtype != FA_F64) return FA_EINVAL;
    if (a->n_lead < 0 || a->n_lead > FA_MAX_DIMS) return FA_EINVAL;
    int64_t rows = 1;
    for (int d = 0; d < a->n_lead; d++) rows *= a->lead_shape[d];
    if (rows == 0 || a->n == 0) return FA_OK;

    const size_t esz = a->dtype == FA_F32 ? sizeof(float) : sizeof(double);
    softmax_plan plan = {.a = a, .row_fn = fa_isa_current()->softmax_row[a->dtype], .esz = esz,
                         .scratch_bytes = (size_t)fa_softmax_scratch_elems(a->n) * esz,
                         .rows = rows, .status = FA_OK};
    fa_run_parallel(softmax_team, &plan, fa_team_size(a->num_threads, rows, 20.0 * (double)rows * (double)a->n));
    return plan.status == FA_OK && fa_stopped(a->stop) ? FA_EINTR : plan.status;
}
