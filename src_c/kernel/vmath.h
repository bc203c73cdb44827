/*
 * Vector math of the kernels (included by kernel_body.h): exp for any
 * argument (vexp, the softmax), exp for the attention kernels' arguments <= 0
 * (vexp_neg), tanh for the softcap, and their test entry points fa_exp and
 * fa_exp_neg.
 */

/* ---------------------------------------------------------------------------
 * Vector exp.  n = round(x / ln 2), r = x - n ln 2 in two parts (Cody-Waite),
 * exp(r) by polynomial, times 2^n built in the exponent bits (in two halves so
 * that subnormal results come out right).  NaN stays NaN, -inf gives 0, +inf
 * gives +inf.
 *
 * EXP_HORNER: the AVX2 and AVX-512 builds (FMA) take exp(r) = 1 + r g(r) in
 * plain Horner form, g a Chebyshev fit of (exp(r) - 1) / r on |r| <= ln 2 / 2
 * (mpmath.chebyfit): float32 degree 6 (relative error 4e-9), float64 degree 11
 * (6e-18).  Max error over every float32 argument of vexp_neg: 0.965 ulp
 * (docs/tuning.md, EXP_HORNER); float64: 0.89 ulp on 4e7 samples.  (AVX2's
 * float32 vexp_neg takes a table of 2^(j/8) and a cubic instead: see there.)  The
 * baseline build has no FMA (x86-64), where that form rounds to 1.24 ulp, so it
 * keeps the more expensive 1 + r + r^2 q(r) with r added exactly: float32
 * degree 7 (Cephes), float64 the Taylor series to degree 13; both within 1 ulp.
 * ------------------------------------------------------------------------- */
/* c[0] r^(n-1) + c[1] r^(n-2) + ... + c[n-1] */
INLINE vec horner(vec r, const T *c, const int n)
{
    vec p = vset1(c[0]);
    UNROLL(16) for (int i = 1; i < n; i++) p = p * r + c[i];
    return p;
}

/* The shared core: for |xc| in range, n = round(xc / ln 2) (as a float in
 * nf_out) and p = exp(xc - n ln 2), so that exp(xc) = p * 2^n.  t_out holds
 * the bits of t = xc / ln 2 + EXP_MAGIC + bias, whose low bits are n + bias:
 * with bias = EXP_BIAS, t_out << EXP_MANT is the bit pattern of 2^n itself
 * (for a normal 2^n; the magic's own bits shift out), which saves the integer
 * add and subtract of the exponent per vector (docs/tuning.md, EXP_MAGIC). */
#if FA_IS_F64
#define EXP_MAGIC 6755399441055744.0 /* 1.5 * 2^52: adding it rounds to an integer */
#else
#define EXP_MAGIC 12582912.0f /* 1.5 * 2^23 */
#endif
INLINE vec exp_reduce(vec xc, const T bias, ivec *t_out, vec *nf_out)
{
    const T magic = EXP_MAGIC + bias;
#if FA_IS_F64
    const vec t = xc * 1.4426950408889634 + magic;
    const vec nf = t - magic;
    *t_out = (ivec)t;
    *nf_out = nf;
    vec r = xc - nf * 6.93147180369123816490e-01;
    r = r - nf * 1.90821492927058770002e-10;
#if FA_VB == 16 /* see EXP_HORNER: 1 + r + r^2 q(r), q the Taylor series */
    static const T q[] = {1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0,
                          1.0 / 362880.0, 1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0,
                          1.0 / 24.0, 1.0 / 6.0, 0.5};
    return horner(r, q, 12) * (r * r) + r + 1.0;
#else /* 1 + r g(r) */
    static const T g[] = {2.5105259538448493419e-8, 2.7626426376580332797e-7, 2.7557255297969644392e-6,
                          2.4801504180837138252e-5, 1.9841269874901259234e-4, 1.3888888932619635148e-3,
                          8.3333333333261120526e-3, 4.1666666666572767692e-2, 1.6666666666666671008e-1,
                          5.0000000000000056451e-1, 1.0};
    return horner(r, g, 11) * r + 1.0;
#endif
#else
    const vec t = xc * 1.44269504088896341f + magic;
    const vec nf = t - magic;
    *t_out = (ivec)t;
    *nf_out = nf;
    vec r = xc - nf * 0.693359375f;
    r = r + nf * 2.12194440e-4f;
#if FA_VB == 16 /* see EXP_HORNER: 1 + r + r^2 q(r), q from Cephes */
    static const T q[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                          1.6666665459e-1f, 5.0000001201e-1f};
    return horner(r, q, 6) * (r * r) + r + 1.0f;
#else /* 1 + r g(r) */
    static const T g[] = {1.3933685862617173589e-3f, 8.3691843822919614316e-3f, 4.1666464602026541557e-2f,
                          1.6666504936963596529e-1f, 5.0000000134981778643e-1f, 1.00000001080395231f};
    return horner(r, g, 6) * r + 1.0f;
#endif
#endif
}

#if FA_IS_F64
#define EXP_BIAS 1023   /* exponent bias, mantissa bits, exp's range */
#define EXP_MANT 52
#define EXP_ZERO (-745.2)             /* exp rounds to 0 below */
#define EXP_TINY (-708.3964185322641) /* ln of the smallest normal */
#define EXP_HUGE 709.79               /* exp overflows above */
#else
#define EXP_BIAS 127
#define EXP_MANT 23
#define EXP_ZERO (-103.98f)
#define EXP_TINY (-87.3365447f)
#define EXP_HUGE 88.72f
#endif

/* exp for any argument.  Lanes whose exp rounds to 0 (masked scores are -inf)
 * compute exp(0) and are zeroed at the end, so that no multiply underflows
 * (subnormal arithmetic is slow); 2^n is applied in two halves so that
 * subnormal results come out right. */
INLINE vec vexp(vec x)
{
    const ivec zero = x < EXP_ZERO;
    vec xc = vsel(zero, vset1(0), x);
    xc = vsel(xc > EXP_HUGE, vset1(EXP_HUGE), xc);
    ivec tb;
    vec nf;
    const vec p = exp_reduce(xc, 0, &tb, &nf);
    const ivec n = tb - (ivec)vset1(EXP_MAGIC);
    const ivec n1 = (ivec)((uvec)(n + 8 * EXP_BIAS) >> 1) - 4 * EXP_BIAS;
    const ivec n2 = n - n1;
    const vec y = p * (vec)((n1 + EXP_BIAS) << EXP_MANT) * (vec)((n2 + EXP_BIAS) << EXP_MANT);
    return vsel(x > EXP_HUGE, vset1(INFINITY), (vec)((ivec)y & ~zero));
}

/* exp for the attention kernels, whose arguments are <= 0, or up to FUSE_LAG
 * (24) in the fused exp, or NaN: no overflow handling and one exponent scale;
 * results below the smallest normal number are flushed to 0 (an absolute error
 * below 2.3e-308 / 1.2e-38 on weights that sum to 1).  NaN stays NaN, -inf
 * gives 0.  Tested against NumPy as `vexp(x, neg=True)` in the test suite, on
 * [-inf, 30]. */
INLINE vec vexp_neg(vec x)
{
#if (defined(__x86_64__) || defined(_M_X64)) && FA_VB == 64 && FA_IS_F64
    /* AVX-512 float64: k = round(16 x / ln 2) = 16 n + j, the low bits of t's
     * bits; r = x - k ln 2 / 16 in two parts, |r| <= ln 2 / 32; exp(x) = S (1 +
     * c) exp(r) with S = 2^n 2^(j/16): 2^(j/16) rounded, from a table of sixteen
     * (one vpermt2pd over two registers, which reads the low 4 bits of its
     * index), 2^n added to its exponent bits, and c that rounding's relative
     * error, from a second table.  exp(r) = 1 + r g(r), g the Taylor series to
     * r^6 (relative error 1e-18): three FMAs and the vscalef fewer than
     * exp_reduce's degree 11.  The result S + S (r g + c), one FMA, so that
     * the table's rounding stays out of it: within 0.6 ulp (docs/tuning.md,
     * vexp_neg).  Lanes below EXP_TINY are zeroed by that FMA's zero-masking
     * (they may compute garbage, inf - inf, at no cost); NaN compares not-less
     * and stays NaN through r; EXP_TINY <= x <= 30 keeps S a normal number. */
    static const uint64_t tab[16] = {
        0x3ff0000000000000ull, 0x3fefb5586cf9890full, 0x3fef72b83c7d517bull, 0x3fef387a6e756238ull,
        0x3fef06fe0a31b715ull, 0x3feedea64c123422ull, 0x3feebfdad5362a27ull, 0x3feeab07dd485429ull,
        0x3feea09e667f3bcdull, 0x3feea11473eb0187ull, 0x3feeace5422aa0dbull, 0x3feec49182a3f090ull,
        0x3feee89f995ad3adull, 0x3fef199bdd85529cull, 0x3fef5818dcfba487ull, 0x3fefa4afa2a490daull};
    /* tab[j] = bits of S_j - (j << 48), S_j the double nearest 2^(j/16): + (k << 48) leaves S_j 2^n */
    static const double cor[16] = {
        0.0, 8.189317638195515e-17, -2.7939114859515733e-17, 7.826573258636076e-17,
        3.3484623336251524e-17, 3.750854201303127e-17, 1.9572585293112036e-17, 5.68648095791174e-17,
        -6.835808657661922e-17, -2.3591094770850053e-17, 5.1548301170786783e-17, 1.5341410053603723e-17,
        4.875160526227062e-17, 1.685487290628973e-17, 1.790126907604513e-17, -5.545065618639427e-17};
    /* cor[j] = (2^(j/16) - S_j) / S_j */
    static const T g[] = {1.0 / 5040, 1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0};
    const __mmask8 keep = _mm512_cmp_pd_mask((__m512d)x, _mm512_set1_pd(EXP_TINY), _CMP_NLT_UQ);
    const vec t = x * 23.083120654223414 + EXP_MAGIC, kf = t - EXP_MAGIC; /* 16 / ln 2 */
    vec r = x - kf * (6.93147180369123816490e-01 / 16);
    r = r - kf * (1.90821492927058770002e-10 / 16);
    const __m512i tb = (__m512i)t;
    const __m512i sj = _mm512_permutex2var_epi64(_mm512_loadu_si512(tab), tb, _mm512_loadu_si512(tab + 8));
    const __m512d s = (__m512d)_mm512_add_epi64(sj, _mm512_slli_epi64(tb, 48));
    const __m512d c = _mm512_permutex2var_pd(_mm512_loadu_pd(cor), tb, _mm512_loadu_pd(cor + 8));
    const __m512d w = _mm512_fmadd_pd((__m512d)r, (__m512d)horner(r, g, 7), c);
    return (vec)_mm512_maskz_fmadd_pd(keep, w, s, s);
#elif (defined(__x86_64__) || defined(_M_X64)) && FA_VB == 64
    /* AVX-512 float32: p * 2^n by vscalef, and the flush to 0 by its
     * zero-masking (NaN compares not-less, so it stays NaN): 4 fewer integer
     * and select operations, a shorter exp loop (docs/tuning.md, vexp_neg).
     * The lanes it zeroes may compute garbage (inf - inf), at no cost. */
    ivec tb; /* unused: the compiler drops it */
    vec nf;
    const vec p = exp_reduce(x, 0, &tb, &nf);
    const __mmask16 keep = _mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(EXP_TINY), _CMP_NLT_UQ);
    return (vec)_mm512_maskz_scalef_ps(keep, (__m512)p, (__m512)nf);
#elif (defined(__x86_64__) || defined(_M_X64)) && FA_VB == 32 && !FA_IS_F64
    /* AVX2 float32: k = round(8 x / ln 2) = 8 n + j, the low bits of t's bits
     * (EXP_MAGIC without the bias); r = x - k ln 2 / 8 in two parts, |r| <= ln 2
     * / 16; exp(x) = S exp(r) with S = 2^n 2^(j/8): 2^(j/8) from a table of
     * eight (one vpermps, which reads the low 3 bits of its index), 2^n added
     * to its exponent bits.  exp(r) = 1 + r g(r), g a cubic fit (relative
     * error 2e-10): two FMAs fewer than exp_reduce's degree 6.  (S g) r + S,
     * not (S r) g + S, whose S r is subnormal near EXP_TINY.  Max error over
     * every float32 argument in [EXP_TINY, 30]: 0.913 ulp (docs/tuning.md,
     * vexp_neg).  Lanes below EXP_TINY get S = 0, as below; NaN stays NaN
     * through r. */
    static const uint32_t tab[8] = {0x3f800000u, 0x3f7b95c2u, 0x3f7837f0u, 0x3f75fed7u,
                                    0x3f7504f3u, 0x3f75672au, 0x3f7744fdu, 0x3f7ac0c7u};
    /* tab[j] = bits of 2^(j/8) - (j << 20): + (k << 20) leaves 2^(j/8) 2^n */
    const ivec zero = x < EXP_TINY;
    const vec xc = vmax(vset1(EXP_TINY), x);
    const vec t = xc * 11.5415602f + EXP_MAGIC, kf = t - EXP_MAGIC;
    vec r = xc - kf * 0.0866699219f;
    r = r + kf * 2.65243050e-5f;
    vec g = r * 0.0416699238f + 0.166682303f;
    g = g * r + 0.5f;
    g = g * r + 1.0f;
    const __m256i tb = (__m256i)t;
    const ivec sb = (ivec)_mm256_add_epi32(_mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)tab), tb),
                                           _mm256_slli_epi32(tb, 20));
    const vec s = (vec)(sb & ~zero);
    return (s * g) * r + s;
#else
    /* Lanes below EXP_TINY (masked scores are -inf) are raised to EXP_TINY by
     * a max, which keeps NaN (vmax returns its second operand when either is
     * NaN), and their scale 2^n is zeroed, so they come out p * 0 = 0 with no
     * subnormal product (subnormal arithmetic is slow, and many scores may be
     * masked).  The zeroing is off the polynomial's dependency chain, faster
     * than a select of the argument before and of the result after
     * (docs/tuning.md, vexp_neg). */
    const ivec zero = x < EXP_TINY;
    ivec tb;
    vec nf;
    const vec p = exp_reduce(vmax(vset1(EXP_TINY), x), EXP_BIAS, &tb, &nf);
    return p * (vec)((tb << EXP_MANT) & ~zero);
#endif
}

/* tanh for the softcap: the odd Taylor series below |x| = 0.25 (terms to
 * x^11 for float32, x^23 for float64), (1 - e) / (1 + e) with e = exp(-2|x|)
 * above.  NaN stays NaN; +-inf give +-1. */
INLINE vec vtanh(vec x)
{
    const ivec neg = x < 0;
    const vec ax = vsel(neg, -x, x), x2 = x * x;
#if FA_IS_F64
    vec p = vset1(-113927491862.0 / 2900518163668125.0);
    p = p * x2 + 18888466084.0 / 194896477400625.0;
    p = p * x2 - 443861162.0 / 1856156927625.0;
    p = p * x2 + 6404582.0 / 10854718875.0;
    p = p * x2 - 929569.0 / 638512875.0;
    p = p * x2 + 21844.0 / 6081075.0;
    p = p * x2 - 1382.0 / 155925.0;
    p = p * x2 + 62.0 / 2835.0;
#else
    vec p = vset1(-1382.0f / 155925.0f);
    p = p * x2 + 62.0f / 2835.0f;
#endif
    p = p * x2 - (T)17 / 315;
    p = p * x2 + (T)2 / 15;
    p = p * x2 - (T)1 / 3;
    const vec small = x + x * (x2 * p);
    const vec e = vexp_neg(-2 * ax);
    vec big = (1 - e) / (1 + e);
    big = vsel(neg, -big, big);
    return vsel(ax < (T)0.25, small, big);
}

/* y (n) = exp(x (n)) by vexp, or with neg by vexp_neg: the tests' view of
 * the kernels' exp (fa_exp in internal.h). */
INLINE void exp_array(const T *x, T *y, int64_t n, const int neg)
{
    int64_t i = 0;
    for (; i + L <= n; i += L) vstore(y + i, neg ? vexp_neg(vload(x + i)) : vexp(vload(x + i)));
    if (i < n) {
        T buf[L] = {0};
        memcpy(buf, x + i, (size_t)(n - i) * sizeof(T));
        vec e = neg ? vexp_neg(vload(buf)) : vexp(vload(buf));
        memcpy(buf, &e, sizeof buf);
        memcpy(y + i, buf, (size_t)(n - i) * sizeof(T));
    }
}
void FN(fa_exp)(const void *x, void *y, int64_t n) { exp_array(x, y, n, 0); }
void FN(fa_exp_neg)(const void *x, void *y, int64_t n) { exp_array(x, y, n, 1); }
