/*
 * fastattn.softmax's kernel (included by kernel_body.h): a streaming softmax
 * of one row, one exp per element.
 */

/* ---------------------------------------------------------------------------
 * Streaming softmax of one row, x (n) stride xs -> o (n) stride os.
 * Pass 1 goes over chunks of FA_SOFTMAX_CHUNK: chunk max c_m, o = exp(x - c_m),
 * chunk sum; the chunk maxima are kept, the running max and sum merged (the
 * sum compensated: acc_add).
 * Pass 2 multiplies each chunk of o by exp(c_m - max) / sum.  One exp per
 * element.  o may be x itself (each element is read before it is written).
 * Scratch: FA_SOFTMAX_CHUNK elements (gather buffer) + one per chunk.
 * ------------------------------------------------------------------------- */
INLINE void chunk_exp(T *e, const T *x, int64_t n, T *cm, T *cs)
{
    const T mc = row_max_nan(x, n), mu = step_shift(mc);
    int64_t i;
    vec s = vset1(0);
    for (i = 0; i + L <= n; i += L) {
        const vec p = vexp(vload(x + i) - mu);
        vstore(e + i, p);
        s += p;
    }
    T sx[L];
    memcpy(sx, &s, sizeof sx);
    T sum = 0;
    for (int r = 0; r < L; r++) sum += sx[r];
    if (i < n) {
        T buf[L];
        for (int r = 0; r < L; r++) buf[r] = (i + r < n) ? x[i + r] - mu : -INFINITY;
        const vec p = vexp(vload(buf));
        memcpy(buf, &p, sizeof buf);
        for (int r = 0; i + r < n; r++) {
            e[i + r] = buf[r];
            sum += buf[r];
        }
    }
    *cm = mc; /* the raw max: -inf for an all -inf chunk, whose sum is 0 */
    *cs = sum;
}

void FN(fa_softmax_row)(const void *x_, int64_t xs, void *o_, int64_t os, int64_t n, void *scratch)
{
    const T *x = x_;
    T *o = o_;
    T *buf = scratch, *cmax = buf + FA_SOFTMAX_CHUNK;
    const int contiguous = (xs == 1 && os == 1);
    T M = -INFINITY, S = 0, Sc = 0; /* running max (NaN-propagating), sum and its compensation */
    int64_t nc = 0;
    for (int64_t s0 = 0; s0 < n; s0 += FA_SOFTMAX_CHUNK, nc++) {
        const int64_t len = (n - s0 < FA_SOFTMAX_CHUNK) ? n - s0 : FA_SOFTMAX_CHUNK;
        T cm, cs;
        if (contiguous) {
            chunk_exp(o + s0, x + s0, len, &cm, &cs);
        } else {
            for (int64_t i = 0; i < len; i++) buf[i] = x[(s0 + i) * xs];
            chunk_exp(buf, buf, len, &cm, &cs);
            for (int64_t i = 0; i < len; i++) o[(s0 + i) * os] = buf[i];
        }
        cmax[nc] = cm;
        /* merge the chunk into (M, S); an all -inf chunk adds nothing */
        if (cm != -INFINITY) {
            const T Mn = max_nan(M, cm), f = (T)exp(M - Mn);
            if (f != 1) {
                S *= f;
                Sc *= f;
            }
            acc_add(&S, &Sc, (T)(cs * exp(cm - Mn)));
            M = Mn;
        }
    }
    S = acc_fold(S, Sc);
    const T inv = (S == 0) ? 0 : 1 / S;
    nc = 0;
    for (int64_t s0 = 0; s0 < n; s0 += FA_SOFTMAX_CHUNK, nc++) {
        const int64_t len = (n - s0 < FA_SOFTMAX_CHUNK) ? n - s0 : FA_SOFTMAX_CHUNK;
        const T f = (S == 0) ? 0 : (T)exp(cmax[nc] - M) * inv; /* cmax -inf: 0 */
        if (contiguous) {
            T *oc = o + s0;
            int64_t i = 0;
            for (; i + L <= len; i += L) vstore(oc + i, vload(oc + i) * f);
            for (; i < len; i++) oc[i] *= f;
        } else {
            for (int64_t i = 0; i < len; i++) o[(s0 + i) * os] *= f;
        }
    }
}
