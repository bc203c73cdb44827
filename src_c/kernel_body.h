/*
 * The attention and softmax kernels, written once with GCC/Clang vector
 * extensions and compiled once per (dtype, ISA) by kernels_<dtype>_<isa>.c,
 * which define before including this file:
 *
 *   FA_T     float or double          FA_IT   int32_t or int64_t (same width)
 *   FA_UT    the unsigned twin of FA_IT
 *   FA_SUF   f32 or f64               FA_ISA  generic, avx2 or avx512
 *   FA_VB    vector bytes: 16 (SSE2/NEON), 32 (AVX2) or 64 (AVX-512)
 *   FA_IS_F64  0 or 1
 *
 * The AVX2 file sets `#pragma GCC target("avx2,fma")` first, so the same code
 * becomes 256-bit AVX2 with FMA there; the AVX-512 files make it 512-bit code
 * (32 registers); elsewhere it stays baseline code.
 *
 * Layout idea.  A work item is bq query rows of one leading index.  Its queries
 * are packed once, scaled and transposed, into Qt (dk, bqp).  Scores of a key
 * tile are computed transposed, St (bk, bqp) = K_tile . Qt, so that every
 * softmax step (row max, exp, row sum, rescale) is a plain vertical SIMD
 * operation across query rows, and the products read K and V rows in place as
 * scalar broadcasts: no packing of K or V, any row stride, no horizontal sums.
 * The output accumulator is kept transposed too, Ot (dv, bqp), and is turned
 * back and normalised once at the end (FlashAttention-2 loop order).
 */
#include <float.h>
#include <math.h>
#include <string.h>

#include "internal.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h> /* max, and movemask for the bool-mask bit words (SSE2, AVX2 in the AVX files) */
#endif

/* The AVX files name their target features in FA_TARGET: every function from
 * here on is compiled for them (GCC: a target pragma; clang: a target attribute
 * on each function, popped at the end of this file).  The headers above stay
 * baseline code. */
#define FA_PRAGMA_(x) _Pragma(#x)
#define FA_PRAGMA(x) FA_PRAGMA_(x) /* a pragma built from macros */
#ifdef FA_TARGET
#if defined(__clang__)
FA_PRAGMA(clang attribute push(__attribute__((target(FA_TARGET))), apply_to = function))
#else
FA_PRAGMA(GCC target(FA_TARGET))
#endif
#endif

/* Full unrolling of the register-tile loops (n: their largest trip count),
 * so that the accumulator arrays live in registers. */
#if defined(__clang__)
#define UNROLL(n) _Pragma("unroll")
#else
#define UNROLL(n) FA_PRAGMA(GCC unroll n)
#endif

#define FA_CAT3_(a, b, c) a##_##b##_##c
#define FA_CAT3(a, b, c) FA_CAT3_(a, b, c)
#define FN(name) FA_CAT3(name, FA_SUF, FA_ISA)
#define INLINE static inline __attribute__((always_inline))

typedef FA_T T;
typedef FA_IT IT;
typedef FA_UT UT;
enum { L = FA_VB / sizeof(T) };                    /* lanes per vector */
_Static_assert(L <= FA_LANES_MAX, "scratch sizes in internal.h assume at most FA_LANES_MAX lanes");
enum { TW = 2 * L };                               /* query columns of a micro-tile */
typedef T vec __attribute__((vector_size(FA_VB)));
typedef IT ivec __attribute__((vector_size(FA_VB)));
typedef UT uvec __attribute__((vector_size(FA_VB)));
typedef T vec_u __attribute__((vector_size(FA_VB), aligned(sizeof(T)), may_alias));

const int FN(fa_lanes) = L;

INLINE vec vload(const T *p) { return *(const vec_u *)p; }
INLINE void vstore(T *p, vec x) { *(vec_u *)p = x; }
typedef IT ivec_u __attribute__((vector_size(FA_VB), aligned(sizeof(IT)), may_alias));
INLINE ivec vload_i(const IT *p) { return *(const ivec_u *)p; }
INLINE vec vset1(T x) { vec z = {0}; return z + x; }
INLINE vec vsel(ivec m, vec a, vec b) { return (vec)(((ivec)a & m) | ((ivec)b & ~m)); }
/* max that propagates NaN from either side */
INLINE vec vnanmax(vec a, vec b) { return vsel((a > b) | (a != a), a, b); }
/* plain max: a NaN in `a` gives `b` (vmaxps semantics); used where NaN
 * propagates another way */
INLINE vec vmax(vec a, vec b)
{
#if (defined(__x86_64__) || defined(_M_X64)) && FA_VB == 64 && FA_IS_F64
    return (vec)_mm512_max_pd((__m512d)a, (__m512d)b);
#elif (defined(__x86_64__) || defined(_M_X64)) && FA_VB == 64
    return (vec)_mm512_max_ps((__m512)a, (__m512)b);
#elif (defined(__x86_64__) || defined(_M_X64)) && FA_VB == 32 && FA_IS_F64
    return (vec)_mm256_max_pd((__m256d)a, (__m256d)b);
#elif (defined(__x86_64__) || defined(_M_X64)) && FA_VB == 32
    return (vec)_mm256_max_ps((__m256)a, (__m256)b);
#elif (defined(__x86_64__) || defined(_M_X64)) && FA_IS_F64
    return (vec)_mm_max_pd((__m128d)a, (__m128d)b);
#elif defined(__x86_64__) || defined(_M_X64)
    return (vec)_mm_max_ps((__m128)a, (__m128)b);
#else
    return vsel(a > b, a, b);
#endif
}
/* whether any lane of a comparison result is set */
INLINE int vany(ivec m)
{
#if (defined(__x86_64__) || defined(_M_X64)) && FA_VB == 64
    return _mm512_test_epi32_mask((__m512i)m, (__m512i)m) != 0;
#elif (defined(__x86_64__) || defined(_M_X64)) && FA_VB == 32
    return !_mm256_testz_si256((__m256i)m, (__m256i)m);
#elif defined(__x86_64__) || defined(_M_X64)
    return _mm_movemask_epi8((__m128i)m) != 0;
#else
    IT x[L];
    memcpy(x, &m, sizeof x);
    for (int i = 0; i < L; i++)
        if (x[i]) return 1;
    return 0;
#endif
}
INLINE int vall(ivec m)
{
    IT x[L];
    memcpy(x, &m, sizeof x);
    for (int i = 0; i < L; i++)
        if (!x[i]) return 0;
    return 1;
}

/* ---------------------------------------------------------------------------
 * Vector exp.  n = round(x / ln 2), r = x - n ln 2 in two parts (Cody-Waite),
 * exp(r) by polynomial, times 2^n built in the exponent bits (in two halves so
 * that subnormal results come out right).  NaN stays NaN, -inf gives 0, +inf
 * gives +inf.
 *
 * EXP_HORNER: the AVX2 and AVX-512 builds (FMA) take exp(r) = 1 + r g(r) in
 * plain Horner form, g a Chebyshev fit of (exp(r) - 1) / r on |r| <= ln 2 / 2
 * (mpmath.chebyfit): float32 degree 6 (relative error 4e-9), float64 degree 11
 * (6e-18).  Max error over every float32 argument of vexp_neg: 0.965 ulp (the
 * earlier Cephes polynomial: 1.01); float64: 0.89 ulp on 4e7 samples.  The
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
 * add and subtract of the exponent per vector (measured 3-4 % faster at B1 H8
 * N2048 d64 float32 on AVX2). */
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
#if (defined(__x86_64__) || defined(_M_X64)) && FA_VB == 64
    /* AVX-512: p * 2^n by vscalef, and the flush to 0 by its zero-masking (NaN
     * compares not-less, so it stays NaN): 4 fewer integer and select
     * operations.  With EXP_HORNER, the kernels' exp loop (load, subtract the
     * max, exp, store, sum) took 7.1 cycles a vector here, against 10.0 before.
     * The lanes it zeroes may compute garbage (inf - inf), at no cost. */
    ivec tb; /* unused: the compiler drops it */
    vec nf;
    const vec p = exp_reduce(x, 0, &tb, &nf);
#if FA_IS_F64
    const __mmask8 keep = _mm512_cmp_pd_mask((__m512d)x, _mm512_set1_pd(EXP_TINY), _CMP_NLT_UQ);
    return (vec)_mm512_maskz_scalef_pd(keep, (__m512d)p, (__m512d)nf);
#else
    const __mmask16 keep = _mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(EXP_TINY), _CMP_NLT_UQ);
    return (vec)_mm512_maskz_scalef_ps(keep, (__m512)p, (__m512)nf);
#endif
#else
    /* Lanes below EXP_TINY (masked scores are -inf) are raised to EXP_TINY by
     * a max, which keeps NaN (vmax returns its second operand when either is
     * NaN), and their scale 2^n is zeroed, so they come out p * 0 = 0 with no
     * subnormal product (subnormal arithmetic costs the exp loop 2x on Zen 3
     * where many scores are masked).  The zeroing is off the polynomial's
     * dependency chain: against a select of the argument before and of the
     * result after, measured 1.02-1.04x at B1 H2-H4 N2048 d64 (float32 and
     * float64, one thread, AVX2 on Zen 3), and the exp loop alone 8.5 against
     * 10.1 cycles a vector (float32), 12.8 against 15.0 (float64). */
    const ivec zero = x < EXP_TINY;
    ivec tb;
    vec nf;
    const vec p = exp_reduce(vmax(vset1(EXP_TINY), x), EXP_BIAS, &tb, &nf);
    return p * (vec)((tb << EXP_MANT) & ~zero);
#endif
}

void FN(fa_exp_neg)(const void *x_, void *y_, int64_t n)
{
    const T *x = x_;
    T *y = y_;
    int64_t i = 0;
    for (; i + L <= n; i += L) vstore(y + i, vexp_neg(vload(x + i)));
    if (i < n) {
        T buf[L] = {0};
        memcpy(buf, x + i, (size_t)(n - i) * sizeof(T));
        vec e = vexp_neg(vload(buf));
        memcpy(buf, &e, sizeof buf);
        memcpy(y + i, buf, (size_t)(n - i) * sizeof(T));
    }
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

/* exp of n values, x (n) -> y (n): the same polynomial, for the tests. */
void FN(fa_exp)(const void *x_, void *y_, int64_t n)
{
    const T *x = x_;
    T *y = y_;
    int64_t i = 0;
    for (; i + L <= n; i += L) vstore(y + i, vexp(vload(x + i)));
    if (i < n) {
        T buf[L] = {0};
        memcpy(buf, x + i, (size_t)(n - i) * sizeof(T));
        vec e = vexp(vload(buf));
        memcpy(buf, &e, sizeof buf);
        memcpy(y + i, buf, (size_t)(n - i) * sizeof(T));
    }
}

/* ---------------------------------------------------------------------------
 * Transpose of an L x L block in registers: r[0..L) are its rows on entry and
 * its columns on exit.  log2(L) rounds; the round of half-width h swaps the
 * off-diagonal h x h blocks of every 2h x 2h block, two rows at a time.  With
 * GCC the shuffle masks fold to constants (shufps, permt2ps and the like);
 * other compilers go through memory.
 * ------------------------------------------------------------------------- */
#if defined(__GNUC__) && !defined(__clang__)
#define FA_LANES (FA_VB / (FA_IS_F64 ? 8 : 4))
/* lane x of the result takes lane FA_BM(x) of (a, b): index L + k is b[k] */
#define FA_BM(x)                                                                       \
    ((x) % (2 * h) < h ? (x) / (2 * h) * 2 * h + (x) % (2 * h) + hi * h                \
                       : L + (x) / (2 * h) * 2 * h + (x) % (2 * h) - h + hi * h)
#if FA_LANES == 16
#define FA_BMASK {FA_BM(0), FA_BM(1), FA_BM(2), FA_BM(3), FA_BM(4), FA_BM(5), FA_BM(6), FA_BM(7), \
                  FA_BM(8), FA_BM(9), FA_BM(10), FA_BM(11), FA_BM(12), FA_BM(13), FA_BM(14), FA_BM(15)}
#elif FA_LANES == 8
#define FA_BMASK {FA_BM(0), FA_BM(1), FA_BM(2), FA_BM(3), FA_BM(4), FA_BM(5), FA_BM(6), FA_BM(7)}
#elif FA_LANES == 4
#define FA_BMASK {FA_BM(0), FA_BM(1), FA_BM(2), FA_BM(3)}
#elif FA_LANES == 2
#define FA_BMASK {FA_BM(0), FA_BM(1)}
#endif
/* hi = 0: a's low halves of each 2h block, then b's; hi = 1: the high halves */
INLINE vec swap_blocks(vec a, vec b, const int h, const int hi)
{
    const ivec mask = FA_BMASK;
    return __builtin_shuffle(a, b, mask);
}
INLINE void transpose_block(vec *r)
{
    UNROLL(4) for (int h = L / 2; h >= 1; h /= 2)
    {
        UNROLL(16) for (int x = 0; x < L; x++)
        {
            if (x & h) continue;
            const vec lo = r[x], up = r[x + h];
            r[x] = swap_blocks(lo, up, h, 0);
            r[x + h] = swap_blocks(lo, up, h, 1);
        }
    }
}
#undef FA_BMASK
#undef FA_BM
#undef FA_LANES
#else
INLINE void transpose_block(vec *r)
{
    T b[L][L];
    memcpy(b, r, sizeof b);
    for (int x = 0; x < L; x++)
        for (int y = 0; y < L; y++) r[x][y] = b[y][x];
}
#endif

/* ---------------------------------------------------------------------------
 * Register-blocked micro-kernels.  R rows of one operand times NV = 2 vectors
 * (TW query columns) of the other: 2R accumulators.  R is at most RB: 6 with
 * 16 registers (12 accumulators, plus two loads and a broadcast: 15 of the 16
 * AVX2 registers), FA_RB64 with the 32 registers of AVX-512.  NV = 1 (L query
 * columns) serves a last odd vector of query rows, so that bqp is a multiple
 * of L, not of TW: few query rows waste less (5 rows on AVX-512 pad to 16, not
 * 32).  One loop over the head dim serves every d: copies of qk_block and
 * pv_block compiled for d = 64 (bqp 128) and d = 128 (bqp 64), and the dk loop
 * unrolled by 4, measured within +-2 % (B1 H2/H8 N2048, one and two threads).
 * ------------------------------------------------------------------------- */
#ifndef FA_RB64
#define FA_RB64 12
#endif
enum { RB = FA_VB == 64 ? FA_RB64 : 6 };

/* The fused exp (pass 4 in fa_attn_item).  A key tile with no score modifier
 * takes its probabilities p = exp(s - m) straight from the accumulator
 * registers of Q.K^T, so that St is written once and never read back for the
 * max and the exp.  m is a reference max per query row, which may lag the true
 * running max by up to FUSE_LAG: the online softmax is exact for any reference
 * (l, Ot and lse all refer to m), and p <= e^24 = 2.6e10 cannot overflow l.
 * Each register tile checks its column max first; where one exceeds
 * m + FUSE_LAG (the first keys of a row, or a score far above all before it),
 * fuse_regrow raises m to the max in every lane that rose and rescales l, Ot and
 * the tile's rows already written.  Scores that keep rising steeply (a ramp of
 * 100 per 256 keys) would rescale at every few register tiles: after 2 such
 * calls per query vector the item goes on unfused.  A row's Ot can overflow
 * only where n_k |v| is within a factor e^24 of the dtype's limit; such a row
 * comes out non-finite and is redone carefully (redo_nonfinite_rows).
 * Measured 2-4 % faster at B1 H8 N2048 d64 (float32 and float64, one and two
 * threads; at d128 within the noise), against 42e4aba in one process, with
 * AVX-512; with 16 registers it was slower, so only AVX-512 takes it
 * (tl->fuse, from the ISA table in dispatch.c; the tests force it on and off). */
#define FUSE_LAG 24
typedef struct {
    T *m, *l;        /* (bqp) reference max and row sums of the item */
    T *Ot;           /* (dv, bqp) the output accumulator */
    T *St;           /* (nb, ld) the tile's first row */
    int64_t ld, dv;  /* row stride of Ot and St; rows of Ot */
    int64_t regrows; /* rescaling calls of fuse_regrow in the item so far */
    int mask;        /* St holds the tile's float mask, transposed (mask_tile), to add */
} fuse_t;

/* x[r * stride + 0..L) *= alpha for r < n: one query vector of Ot or St */
INLINE void scale_rows(T *x, int64_t stride, int64_t n, vec alpha)
{
    for (int64_t r = 0; r < n; r++) vstore(x + r * stride, vload(x + r * stride) * alpha);
}

/* Called when some lane of bm (the max of a register tile's rows [j, j + R) in
 * the query columns [i, i + L)) exceeds the reference max by more than
 * FUSE_LAG: raise the reference to bm in every lane where bm is above it (so
 * that lanes do not call one by one), and rescale their l, Ot and the
 * probabilities of the tile's rows [0, j) already written.  A row that has
 * seen no finite score (m = -inf) has nothing to rescale: l = 0, and Ot = 0
 * (or NaN from 0 * NaN, which a multiply keeps). */
static __attribute__((noinline)) void fuse_regrow(fuse_t *f, int64_t i, int64_t j, vec bm)
{
    const vec mo = vload(f->m + i);
    const ivec grow = bm > mo;
    vstore(f->m + i, vsel(grow, bm, mo));
    if (!vany(grow & (mo > -INFINITY))) return;
    f->regrows++;
    const vec alpha = vsel(grow, vexp_neg(mo - bm), vset1(1));
    vstore(f->l + i, vload(f->l + i) * alpha);
    scale_rows(f->Ot + i, f->ld, f->dv, alpha);
    scale_rows(f->St + i, f->ld, j, alpha);
}

/* The fused exp of R rows of one query vector (columns [i, i + L)), rows
 * [j, j + R) of the tile: st[r * ld] <- exp(a[r] - m), their sum added to l.
 * Each probability goes straight to St rather than back into a[r], which
 * shortens the registers' lives while the exps of a register tile overlap:
 * against the write-back, 1.01-1.03x across B1 H8 N512-N4096 d64-d128, BERT
 * and B4 H8 N1024, float32 and float64 (AVX-512, 2 threads, one process). */
INLINE void fuse_exp(const int R, vec *a, fuse_t *f, int64_t i, int64_t j, T *st, int64_t ld)
{
    vec bm = vset1(-INFINITY);
    UNROLL(16) for (int r = 0; r < R; r++) bm = vmax(a[r], bm);
    if (vany(bm > vload(f->m + i) + (T)FUSE_LAG)) fuse_regrow(f, i, j, bm);
    const vec m = vload(f->m + i);
    const vec mu = vsel(m == vset1(-INFINITY), vset1(0), m); /* as in pass 4 */
    vec sum = vset1(0);
    UNROLL(16) for (int r = 0; r < R; r++)
    {
        const vec e = vexp_neg(a[r] - mu);
        vstore(st + r * ld, e);
        sum += e;
    }
    vstore(f->l + i, vload(f->l + i) + sum);
}

/* St[r][0..NV*L) = sum_c kr[r][c] * Qt[c][0..NV*L)   for r < R
 * or, with f, their probabilities (fuse_exp; st is f->St + j * bqp + i), of
 * the scores plus what st holds with f->mask (a float mask):
 *   st  (R, NV*L)   row stride bqp
 *   kr  (R, dk)     row stride krs
 *   qt  (dk, NV*L)  row stride bqp */
INLINE void qk_tile(const int R, const int NV, T *st, int64_t bqp, const T *restrict kr,
                    int64_t krs, const T *restrict qt, int64_t dk, fuse_t *f, int64_t i,
                    int64_t j)
{
    vec a0[RB], a1[RB];
    UNROLL(16) for (int r = 0; r < R; r++) a0[r] = a1[r] = vset1(0);
    for (int64_t c = 0; c < dk; c++) {
        const vec b0 = vload(qt + c * bqp), b1 = NV == 2 ? vload(qt + c * bqp + L) : b0;
        UNROLL(16) for (int r = 0; r < R; r++)
        {
            const T x = kr[r * krs + c];
            a0[r] += x * b0;
            if (NV == 2) a1[r] += x * b1;
        }
    }
    if (f) {
        if (f->mask)
            UNROLL(16) for (int r = 0; r < R; r++)
            {
                a0[r] += vload(st + r * bqp);
                if (NV == 2) a1[r] += vload(st + r * bqp + L);
            }
        fuse_exp(R, a0, f, i, j, st, bqp);
        if (NV == 2) fuse_exp(R, a1, f, i + L, j, st + L, bqp);
        return;
    }
    UNROLL(16) for (int r = 0; r < R; r++)
    {
        vstore(st + r * bqp, a0[r]);
        if (NV == 2) vstore(st + r * bqp + L, a1[r]);
    }
}

/* Ot[c + r][0..NV*L) += sum_j V[j][c + r] * Pt[j][0..NV*L)   for r < R
 *   ot  (R, NV*L)   row stride bqp
 *   pt  (nb, NV*L)  row stride bqp
 *   vc  (nb, R)     row stride vrs (V advanced to column c) */
INLINE void pv_tile(const int R, const int NV, T *restrict ot, int64_t bqp, const T *restrict pt,
                    const T *restrict vc, int64_t vrs, int64_t nb)
{
    vec a0[RB], a1[RB];
    UNROLL(16) for (int r = 0; r < R; r++)
    {
        a0[r] = vload(ot + r * bqp);
        a1[r] = NV == 2 ? vload(ot + r * bqp + L) : a0[r];
    }
    for (int64_t j = 0; j < nb; j++) {
        const vec p0 = vload(pt + j * bqp), p1 = NV == 2 ? vload(pt + j * bqp + L) : p0;
        UNROLL(16) for (int r = 0; r < R; r++)
        {
            const T x = vc[j * vrs + r];
            a0[r] += x * p0;
            if (NV == 2) a1[r] += x * p1;
        }
    }
    UNROLL(16) for (int r = 0; r < R; r++)
    {
        vstore(ot + r * bqp, a0[r]);
        if (NV == 2) vstore(ot + r * bqp + L, a1[r]);
    }
}

static void write_rows(const fa_attention_args *a, const fa_item *it, const T *acc, int64_t ai,
                       int64_t ac, const T *m, const T *l, int normalised);
static void redo_nonfinite_rows(const fa_attention_args *a, const fa_tiles *tl, const fa_item *it,
                                void *scratch);

/* St rows [0, R) over the bqp query columns (row stride ld): two-vector
 * groups, then one vector when bqp is an odd number of vectors. */
INLINE void qk_rows(const int R, T *St, const T *restrict K, int64_t krs,
                    const T *restrict Qt, int64_t ld, int64_t bqp, int64_t dk, fuse_t *f, int64_t j)
{
    int64_t i = 0;
    for (; i + TW <= bqp; i += TW) qk_tile(R, 2, St + i, ld, K, krs, Qt + i, dk, f, i, j);
    if (i < bqp) qk_tile(R, 1, St + i, ld, K, krs, Qt + i, dk, f, i, j);
}

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

/* Where the register tiles of RB rows end among n rows; 4-row tiles, then
 * single rows, take the rest.  A rest of 1-3 single rows takes one RB tile
 * with it where 4-row tiles then leave fewer single rows (with RB 6: 8 = 4 + 4,
 * 9 = 4 + 4 + 1): a single row has too few accumulators to cover the FMA
 * latency.  At B1 H8 N2048 d128 (dv 128: 20 tiles of 6 and two of 4, not 21
 * and two single columns) 1.016x (float32, AVX2, two threads). */
INLINE int64_t rb_tiles_end(int64_t n)
{
    const int64_t rem = n % RB, end = n - rem;
    return rem > 0 && rem < 4 && end >= RB && (RB + rem) % 4 < rem ? end - RB : end;
}

/* St (nb, bqp) = K[0..nb) . Qt;  K (nb, dk) row stride krs, Qt (dk, bqp);
 * St and Qt have row stride ld.  Or, with f (f->St == St), their
 * probabilities (the fused exp).  Meanwhile prefetches pf's rows (NULL: none). */
static void qk_block(T *St, const T *restrict K, int64_t krs, const T *restrict Qt, int64_t ld,
                     int64_t bqp, int64_t dk, int64_t nb, const tile_pf *pf, fuse_t *f)
{
    int64_t j = 0;
    const int64_t end = rb_tiles_end(nb);
    for (; j < end; j += RB) {
        if (pf) tile_prefetch(pf, j, RB);
        qk_rows(RB, St + j * ld, K + j * krs, krs, Qt, ld, bqp, dk, f, j);
    }
    if (pf) tile_prefetch(pf, j, INT64_MAX - j); /* the rest, also rows past nb */
    for (; j + 4 <= nb; j += 4) qk_rows(4, St + j * ld, K + j * krs, krs, Qt, ld, bqp, dk, f, j);
    for (; j < nb; j++) qk_rows(1, St + j * ld, K + j * krs, krs, Qt, ld, bqp, dk, f, j);
}

/* Ot columns [i, i + NV*L) += Pt^T-contracted with V, over all dv rows of Ot;
 * meanwhile prefetches pf's rows (NULL: none; pf->nv must be 0). */
INLINE void pv_cols(const int NV, T *restrict Ot, const T *restrict Pt, const T *restrict V,
                    int64_t vrs, int64_t ld, int64_t dv, int64_t nb, const tile_pf *pf)
{
    int64_t c = 0;
    const int64_t end = rb_tiles_end(dv);
    for (; c < end; c += RB) {
        if (pf) prefetch_in_step(pf, c, c + RB, dv);
        pv_tile(RB, NV, Ot + c * ld, ld, Pt, V + c, vrs, nb);
    }
    if (pf) prefetch_in_step(pf, c, dv, dv); /* the rest */
    for (; c + 4 <= dv; c += 4) pv_tile(4, NV, Ot + c * ld, ld, Pt, V + c, vrs, nb);
    for (; c < dv; c++) pv_tile(1, NV, Ot + c * ld, ld, Pt, V + c, vrs, nb);
}

/* Ot (dv, bqp) += (Pt (nb, bqp))^T-contracted with V (nb, dv) row stride vrs;
 * Ot and Pt have row stride ld.  Meanwhile prefetches pf's K and query rows
 * (NULL: none), over the first group of query columns. */
static void pv_block(T *restrict Ot, const T *restrict Pt, const T *restrict V, int64_t vrs,
                     int64_t ld, int64_t bqp, int64_t dv, int64_t nb, const tile_pf *pf)
{
    int64_t i = 0;
    for (; i + TW <= bqp; i += TW, pf = NULL) pv_cols(2, Ot + i, Pt + i, V, vrs, ld, dv, nb, pf);
    if (i < bqp) pv_cols(1, Ot + i, Pt + i, V, vrs, ld, dv, nb, pf);
}

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

/* Pack the item's queries, times scale, transposed and zero-padded:
 *   Qt (dk, bqp) row stride ld <- q (bq, dk) row stride q_rs
 * L x L blocks in registers (bqp is a whole number of vectors; rows past bq
 * are zeros), then the columns past the last whole vector one by one. */
static void pack_queries(const fa_attention_args *a, const fa_item *it, T *Qt, int64_t ld, int64_t bqp)
{
    const T *q = it->q;
    const T scale = (T)a->scale;
    const int64_t bq = it->bq, dk = a->dk;
    int64_t c0 = 0;
    for (; c0 + L <= dk; c0 += L)
        for (int64_t i0 = 0; i0 < bqp; i0 += L) {
            vec r[L];
            UNROLL(16) for (int x = 0; x < L; x++)
                r[x] = i0 + x < bq ? vload(q + (i0 + x) * a->q_rs + c0) * scale : vset1(0);
            transpose_block(r);
            UNROLL(16) for (int x = 0; x < L; x++) vstore(Qt + (c0 + x) * ld + i0, r[x]);
        }
    for (int64_t c = c0; c < dk; c++) {
        for (int64_t i = 0; i < bq; i++) Qt[c * ld + i] = q[i * a->q_rs + c] * scale;
        for (int64_t i = bq; i < bqp; i++) Qt[c * ld + i] = 0;
    }
}

/* The key columns of a tile that some row of the item sees under a bool
 * mask (or a float mask, where it is not -inf), as at most PV_RUNS ranges
 * run[r] = [start, end) (key_runs: -1 when there are more).  P.V runs over
 * these ranges only: a key that the mask hides from every row (padding) has
 * weight 0 everywhere, but 0 * NaN = NaN, so NaN or inf in its V row (a
 * padded cache from np.empty) would make every row of the item non-finite and
 * send it to the careful redo (redo_nonfinite_rows): B1 H8 N2048 d64 with its
 * last 100 keys masked and NaN there took 5.6x as long (the row kernel:
 * 1.5-3.1x at 1-8 rows; a float mask's -inf, 5.3x).  Skipping them is exact,
 * and saves their share of P.V. */
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
 * the others out).  A mask row that is contiguous is read L keys of L rows at
 * a time and transposed in registers; a mask the same for every row (mrs ==
 * 0: key padding) is one broadcast per key.  Element by element, the
 * transposed read cost as much as the rest of the tile: B1 H8 N2048 d64
 * float32 with an N x N float mask took 97-103 ms against 48 with a bool mask
 * (AVX-512, 2 threads). */
INLINE void mask_put(T *s, vec x, int set) { vstore(s, set ? x : vload(s) + x); }
static void mask_tile(T *St, int64_t ld, const T *mk, int64_t mrs, int64_t mcs, int64_t bq, int64_t bqp,
                      int64_t nb, int set, key_runs *kr)
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
            ivec seen[L];
            for (int x = 0; x < L; x++) seen[x] = (ivec)vset1(0);
            for (int64_t i0 = 0; i0 < bq; i0 += L) {
                vec r[L];
                UNROLL(16) for (int x = 0; x < L; x++)
                {
                    r[x] = vset1(-INFINITY);
                    if (i0 + x < bq) {
                        r[x] = vload(mk + (i0 + x) * mrs + j);
                        __builtin_prefetch(mk + (i0 + x) * mrs + j + nb, 0, 2); /* the next tile's */
                    }
                }
                transpose_block(r);
                UNROLL(16) for (int x = 0; x < L; x++)
                {
                    seen[x] |= r[x] != vset1(-INFINITY);
                    mask_put(St + (j + x) * ld + i0, r[x], set);
                }
            }
            for (int x = 0; x < L; x++) key_runs_add(kr, j + x, vany(seen[x]));
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

/* The largest |x| over x (nr, nc) row stride rs; NaN when any is NaN. */
static T abs_max(const T *x, int64_t rs, int64_t nc, int64_t nr)
{
    vec mv = vset1(0);
    T ms = 0;
    for (int64_t r = 0; r < nr; r++) {
        int64_t c = 0;
        for (; c + L <= nc; c += L) {
            const vec y = vload(x + r * rs + c);
            mv = vnanmax(vsel(y < 0, -y, y), mv);
        }
        for (; c < nc; c++) {
            const T y = x[r * rs + c] < 0 ? -x[r * rs + c] : x[r * rs + c];
            if (y > ms || y != y) ms = y;
        }
    }
    T t[L];
    memcpy(t, &mv, sizeof t);
    for (int i = 0; i < L; i++)
        if (t[i] > ms || t[i] != t[i]) ms = t[i];
    return ms;
}

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

/* Scores of the key tile [j0, j0 + nb) for the item's rows:
 *   St (nb, bqp) = K_tile . Qt (Qt already scaled; both row stride ld), then softcap, ALiBi,
 *   float mask and the band (causal, window), on every lane or the real rows.
 * A bool mask is packed into bit words W (ceil(nb / 32), ld) for the caller
 * to apply.  With f, a tile that has none of those modifiers but a float mask
 * (nor a bool mask with a False in it) gets its probabilities instead (the
 * fused exp, FUSE_LAG; the float mask stored in St first, for qk_tile to add).
 * Returns -1 when the bool mask forbids the whole tile, or the float mask is
 * -inf throughout it and no score there can be NaN or +inf (hidden_tile_skips;
 * qmax is max |Qt|, or -1 until known): St is not computed; 2 when St holds the fused
 * probabilities, 1 when W must be applied, 0 otherwise.  Under a float mask,
 * kr gets the keys that some row sees (mask_tile); otherwise it is left as it
 * is. */
static int tile_scores(const fa_attention_args *a, const fa_item *it, const band_t *b, T *St,
                       const T *Qt, T *qmax, IT *W, int64_t ld, int64_t bqp, int64_t j0, int64_t nb,
                       const tile_pf *pf, fuse_t *f, key_runs *kr)
{
    const int64_t bq = it->bq;
    int bits = 0;
    if (a->mask_kind == FA_MASK_BOOL) {
        const int kind = mask_bits(W, ld, (const uint8_t *)it->mask + j0 * a->m_cs, a->m_rs, a->m_cs, it->mbits,
                                   it->mb_rs, j0, bq, nb);
        if (kind == 0) return -1;
        bits = kind == 1;
    }
    if (a->mask_kind == FA_MASK_ADD &&
        mask_tile_hidden((const T *)it->mask + j0 * a->m_cs, a->m_rs, a->m_cs, bq, nb) &&
        hidden_tile_skips((const T *)it->k + j0 * a->k_rs, a->k_rs, a->dk, nb, Qt, ld, bqp, qmax))
        return -1;
    /* band: key j hides the rows before the first at position j - right, and
     * those from the first at position j + left + 1 on (band_first_row) */
    const int cut_right = b->has_right && j0 + nb - 1 > band_pos(b, 0) + b->right;
    const int cut_left = b->has_left && j0 < band_pos(b, bq - 1) - b->left;
    if (f && !bits && !cut_right && !cut_left && !(a->softcap > 0) && it->slope == 0) {
        f->mask = a->mask_kind == FA_MASK_ADD;
        if (f->mask) mask_tile(St, ld, (const T *)it->mask + j0 * a->m_cs, a->m_rs, a->m_cs, bq, bqp, nb, 1, kr);
        qk_block(St, (const T *)it->k + j0 * a->k_rs, a->k_rs, Qt, ld, bqp, a->dk, nb, pf, f);
        return 2;
    }
    qk_block(St, (const T *)it->k + j0 * a->k_rs, a->k_rs, Qt, ld, bqp, a->dk, nb, pf, NULL);
    if (a->softcap > 0) {
        const T c = (T)a->softcap, ic = 1 / c;
        for (int64_t j = 0; j < nb; j++)
            for (int64_t i = 0; i < bqp; i += L) vstore(St + j * ld + i, vtanh(vload(St + j * ld + i) * ic) * c);
    }
    if (it->slope != 0 && b->g == 1) { /* ALiBi: s -= slope * |p(i) - j|, p(i) = p(0) + i */
        const T slope = (T)it->slope;
        const int64_t p0 = band_pos(b, 0);
        T io[L];
        for (int r = 0; r < L; r++) io[r] = (T)r;
        const vec iota = vload(io);
        for (int64_t j = 0; j < nb; j++)
            for (int64_t i = 0; i < bqp; i += L) {
                const vec d = iota + (T)(p0 + i - (j0 + j));
                vstore(St + j * ld + i, vload(St + j * ld + i) - slope * vsel(d < 0, -d, d));
            }
    } else if (it->slope != 0) { /* rows sharing positions (the fold leaves out ALiBi) */
        for (int64_t j = 0; j < nb; j++)
            for (int64_t i = 0; i < bq; i++) {
                const int64_t d = band_pos(b, i) - (j0 + j);
                St[j * ld + i] -= (T)it->slope * (T)(d < 0 ? -d : d);
            }
    }
    if (a->mask_kind == FA_MASK_ADD)
        mask_tile(St, ld, (const T *)it->mask + j0 * a->m_cs, a->m_rs, a->m_cs, bq, bqp, nb, 0, kr);
    if (cut_right || cut_left)
        for (int64_t j = 0; j < nb; j++) {
            const int64_t jj = j0 + j;
            if (cut_right)
                for (int64_t i = 0, hide = band_first_row(b, jj - b->right, bq); i < hide; i++)
                    St[j * ld + i] = -INFINITY;
            if (cut_left)
                for (int64_t i = band_first_row(b, jj + b->left + 1, bq); i < bq; i++) St[j * ld + i] = -INFINITY;
        }
    return bits;
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

/* pv_block over the key ranges of kr (n >= 0), pf's rows during the first
 * (pointers as pv_block's, at the tile's first key).  Off the common path, as
 * rows_pv_runs: a second call of pv_block in fa_attn_item made gcc stop
 * inlining it. */
static __attribute__((noinline)) void pv_block_runs(const key_runs *kr, T *restrict Ot, const T *restrict Pt,
                                                    const T *restrict V, int64_t vrs, int64_t ld, int64_t bqp,
                                                    int64_t dv, const tile_pf *pf)
{
    for (int r = 0; r < kr->n; r++) {
        const int64_t j = kr->run[r][0];
        pv_block(Ot, Pt + j * ld, V + j * vrs, vrs, ld, bqp, dv, kr->run[r][1] - j, r == 0 ? pf : NULL);
    }
}

/* Pass 4 of fa_attn_item for NV (1 or 2) vectors of query rows, the columns
 * [i, i + NV L) of the key tile's scores St (nb, ld): a bool mask's bits W
 * applied (bits), each row's max, the probabilities exp(s - m) in place, m and
 * l updated, Ot (dv, ld) rescaled where a max grew.  Two vectors (a cache
 * line's worth with AVX2) walk the rows of St once, not twice: against one
 * vector at a time, 1.01-1.05x at B1 H4 N2048 d64 float32 (one thread), 1.03-1.06x
 * with a bool mask, 1.00-1.05x at B1 H8 N2048 d128 (two threads), float64 the
 * same (AVX2 on Zen 3). */
INLINE void tile_softmax(const int NV, T *St, const IT *W, int bits, int64_t ld, int64_t nb, T *m, T *l,
                         T *Ot, int64_t dv, int64_t i)
{
    vec bm[2], mu[2], alpha[2], sum[2];
    UNROLL(2) for (int v = 0; v < NV; v++) bm[v] = vset1(-INFINITY);
    if (bits) {
        for (int64_t j = 0; j < nb; j++)
            UNROLL(2) for (int v = 0; v < NV; v++) {
                const vec s = masked_scores(St, W, ld, i + v * L, j);
                vstore(St + j * ld + i + v * L, s);
                bm[v] = vmax(s, bm[v]);
            }
    } else {
        for (int64_t j = 0; j < nb; j++)
            UNROLL(2) for (int v = 0; v < NV; v++) bm[v] = vmax(vload(St + j * ld + i + v * L), bm[v]);
    }
    UNROLL(2) for (int v = 0; v < NV; v++) {
        const vec mo = vload(m + i + v * L), mn = vmax(bm[v], mo);
        /* A row that has seen only -inf so far subtracts 0, so its
         * probabilities are exp(-inf) = 0 and never NaN.  The max need not
         * propagate NaN: a NaN score makes its p, and so l and the row's
         * output and lse, NaN anyway. */
        mu[v] = vsel(mn == vset1(-INFINITY), vset1(0), mn);
        alpha[v] = vexp_neg(mo - mu[v]);
        vstore(m + i + v * L, mn);
        sum[v] = vset1(0);
    }
    for (int64_t j = 0; j < nb; j++)
        UNROLL(2) for (int v = 0; v < NV; v++) {
            T *sj = St + j * ld + i + v * L;
            const vec p = vexp_neg(vload(sj) - mu[v]);
            vstore(sj, p);
            sum[v] += p;
        }
    UNROLL(2) for (int v = 0; v < NV; v++) {
        vstore(l + i + v * L, vload(l + i + v * L) * alpha[v] + sum[v]);
        if (!vall(alpha[v] == vset1(1))) scale_rows(Ot + i + v * L, ld, dv, alpha[v]); /* only when some max grew */
    }
}

/* ---------------------------------------------------------------------------
 * One attention work item (see fa_item in internal.h for q, k, v, mask, out,
 * lse and part).  Scratch, in elements of T; every row is ld >= bqp long
 * (tl->ld: see choose_tiles), of which the first bqp are used:
 *   Qt   (dk, bqp)  queries of the item, times scale, transposed, zero-padded
 *   St   (bk, bqp)  scores of one key tile, transposed; then probabilities
 *   Ot   (dv, bqp)  unnormalised output accumulator, transposed
 *   m    (bqp)      reference max of each row: the running max, or up to
 *                   FUSE_LAG below it after fused tiles
 *   l    (bqp)      running row sum of exp(score - m)
 *   W    (ceil(bk / 32), bqp)  a bool mask tile as bit words (IT lanes)
 * ------------------------------------------------------------------------- */
void FN(fa_attn_item)(const fa_attention_args *a, const fa_tiles *tl, const fa_item *it,
                      void *scratch)
{
    /* the item's rows in whole vectors: fewer than the tile's (tl->bqp) in a last
     * query block, a sequence's last (q_len) or a short packed sequence */
    const int64_t bqp = (it->bq + L - 1) / L * L, ld = tl->ld, bk = tl->bk, dk = a->dk, dv = a->dv;
    T *Qt = scratch, *St = Qt + dk * ld, *Ot = St + bk * ld, *m = Ot + dv * ld, *l = m + ld;
    IT *W = (IT *)(l + ld);
    fuse_t fz = {.m = m, .l = l, .Ot = Ot, .St = St, .ld = ld, .dv = dv, .regrows = 0, .mask = 0};

    /* Pass 1: pack the queries. */
    pack_queries(a, it, Qt, ld, bqp);
    T qmax = -1; /* max |Qt|, when hidden_tile_skips first needs it */
    memset(Ot, 0, (size_t)(dv * ld) * sizeof(T));
    for (int64_t i = 0; i < bqp; i++) {
        m[i] = -INFINITY;
        l[i] = 0;
    }

    /* Key tiles outside every row's band (causal, window, kv length) are never visited. */
    const band_t b = item_band(a, it);
    for (int64_t j0 = b.j_lo; j0 < b.j_hi && !fa_stopped(a->stop); j0 += bk) {
        const int64_t nb = (b.j_hi - j0 < bk) ? b.j_hi - j0 : bk;

        /* Passes 2-3: scores with every modifier and mask except a bool mask's bits,
         * while this tile's V rows are prefetched (pf_v; tile_pf). */
        const int64_t nb_next = b.j_hi - (j0 + nb) < bk ? b.j_hi - (j0 + nb) : bk;
        const int last = nb_next <= 0;
        const tile_pf pf_v = {.v = (const T *)it->v + j0 * a->v_rs, .nv = nb, .vrs = a->v_rs, .dv = dv};
        /* the next tile's K rows (in the last tile: the first K rows and the
         * queries of the thread's next item), prefetched during pass 5 */
        const tile_pf pf_k = {.k = last ? it->next_k : (const T *)it->k + (j0 + nb) * a->k_rs,
                              .q = it->next_q,
                              .nk = last ? it->next_nk : nb_next,
                              .nq = last ? it->next_bq : 0,
                              .krs = a->k_rs, .qrs = a->q_rs, .dk = dk};
        /* the fused exp, until its rescaling costs more than it saves (FUSE_LAG) */
        fuse_t *f = tl->fuse && fz.regrows <= 2 * (bqp / L) ? &fz : NULL;
        key_runs kr = {.n = -1}; /* the keys P.V needs: all, or those a mask leaves some row */
        const int bits = tile_scores(a, it, &b, St, Qt, &qmax, W, ld, bqp, j0, nb, &pf_v, f, &kr);
        if (bits < 0) continue;

        /* Pass 4 (when the exp is not fused): online softmax, two vectors of
         * query rows at a time. */
        if (bits != 2) {
            int64_t i = 0;
            for (; i + 2 * L <= bqp; i += 2 * L) tile_softmax(2, St, W, bits, ld, nb, m, l, Ot, dv, i);
            if (i < bqp) tile_softmax(1, St, W, bits, ld, nb, m, l, Ot, dv, i);
        }

        /* Pass 5: Ot += P . V_tile, while pf_k's rows are prefetched; under a
         * mask, over the keys that some row sees (visible_runs; a float
         * mask's from mask_tile) */
        const T *vt = (const T *)it->v + j0 * a->v_rs;
        if (bits == 1) visible_runs(&kr, W, ld, it->bq, nb);
        if (runs_whole(&kr, nb))
            pv_block(Ot, St, vt, a->v_rs, ld, bqp, dv, nb, &pf_k);
        else
            pv_block_runs(&kr, Ot, St, vt, a->v_rs, ld, bqp, dv, &pf_k);
    }

    /* Pass 6: write out (acc element (i, c) is Ot[c * ld + i]). */
    write_rows(a, it, Ot, 1, ld, m, l, 0);
    redo_nonfinite_rows(a, tl, it, scratch);
}

/* ---------------------------------------------------------------------------
 * Attention weights of one item: out (bq, nk) row stride o_rs, zero-filled by
 * the caller.  Pass A finds each row's max and sum over the visible tiles;
 * pass B recomputes the scores and writes exp(s - max) / sum.  A row whose sum
 * is NaN is NaN throughout.  Scratch as fa_attn_item with dv = 0.
 * ------------------------------------------------------------------------- */
void FN(fa_weights_item)(const fa_attention_args *a, const fa_tiles *tl, const fa_item *it,
                         void *scratch)
{
    const int64_t bq = it->bq, bqp = (bq + L - 1) / L * L, ld = tl->ld, bk = tl->bk, dk = a->dk;
    T *Qt = scratch, *St = Qt + dk * ld, *m = St + bk * ld, *l = m + ld;
    IT *W = (IT *)(l + ld);
    T *out = it->out;
    pack_queries(a, it, Qt, ld, bqp);
    T qmax = -1; /* max |Qt|, when hidden_tile_skips first needs it */
    for (int64_t i = 0; i < bqp; i++) {
        m[i] = -INFINITY;
        l[i] = 0;
    }
    const band_t b = item_band(a, it);
    for (int pass = 0; pass < 2; pass++) {
        for (int64_t j0 = b.j_lo; j0 < b.j_hi && !fa_stopped(a->stop); j0 += bk) {
            const int64_t nb = (b.j_hi - j0 < bk) ? b.j_hi - j0 : bk;
            key_runs kr;
            const int bits = tile_scores(a, it, &b, St, Qt, &qmax, W, ld, bqp, j0, nb, NULL, NULL, &kr);
            if (bits < 0) continue;
            if (bits) apply_bits(St, W, ld, bqp, nb);
            for (int64_t i = 0; i < bqp; i += L) {
                if (pass == 0) {
                    vec bm = vset1(-INFINITY);
                    for (int64_t j = 0; j < nb; j++) bm = vmax(vload(St + j * ld + i), bm);
                    const vec mo = vload(m + i), mn = vmax(bm, mo);
                    const vec mu = vsel(mn == vset1(-INFINITY), vset1(0), mn);
                    vec sum = vset1(0);
                    for (int64_t j = 0; j < nb; j++) sum += vexp_neg(vload(St + j * ld + i) - mu);
                    vstore(l + i, vload(l + i) * vexp_neg(mo - mu) + sum);
                    vstore(m + i, mn);
                } else {
                    const vec mn = vload(m + i), lv = vload(l + i);
                    const vec mu = vsel(mn == vset1(-INFINITY), vset1(0), mn);
                    const vec inv = vsel(lv == vset1(0), vset1(0), 1 / lv);
                    for (int64_t j = 0; j < nb; j++)
                        vstore(St + j * ld + i, vexp_neg(vload(St + j * ld + i) - mu) * inv);
                }
            }
            if (pass == 1)
                for (int64_t i = 0; i < bq; i++)
                    for (int64_t j = 0; j < nb; j++) out[i * a->o_rs + j0 + j] = St[j * ld + i];
        }
    }
    for (int64_t i = 0; i < bq; i++)
        if (l[i] != l[i])
            for (int64_t j = 0; j < a->nk; j++) out[i * a->o_rs + j] = l[i];
}

/* dst (nr, nc) row stride ds <- src element (i, c) at src[c * ss + i], times
 * 1 / l[i] (0 where l[i] == 0) when l is given: a transposed accumulator turned
 * back, in L x L blocks in registers.  ss is a whole number of vectors >= nr. */
static void untranspose_rows(T *dst, int64_t ds, const T *src, int64_t ss, int64_t nr, int64_t nc,
                             const T *l)
{
    for (int64_t i0 = 0; i0 < nr; i0 += L) {
        const int64_t n = nr - i0 < L ? nr - i0 : L;
        T f[L];
        for (int64_t x = 0; x < L; x++) f[x] = !l || x >= n ? 1 : l[i0 + x] == 0 ? 0 : 1 / l[i0 + x];
        int64_t c0 = 0;
        for (; c0 + L <= nc; c0 += L) {
            vec r[L];
            UNROLL(16) for (int x = 0; x < L; x++) r[x] = vload(src + (c0 + x) * ss + i0);
            transpose_block(r);
            for (int64_t x = 0; x < n; x++) vstore(dst + (i0 + x) * ds + c0, r[x] * f[x]);
        }
        for (int64_t x = 0; x < n; x++)
            for (int64_t c = c0; c < nc; c++) dst[(i0 + x) * ds + c] = src[c * ss + i0 + x] * f[x];
    }
}

/* Write one item's rows from the accumulator, running max and sum:
 * out = acc / l (zeros when l == 0), lse = m + log(l) (-inf when l == 0);
 * or, with it->part, (acc / l, m, l) for a split-key merge.  With normalised,
 * acc already holds acc / l (the careful row kernel and the merge), and is
 * written as it is.
 *   acc  (bq, dv) element (i, c) at acc[i * ai + c * ac]; either rows of dv
 *        (ac == 1) or transposed (ai == 1, ac a whole number of vectors >= bq)
 *   m, l (bq) */
static void write_rows(const fa_attention_args *a, const fa_item *it, const T *acc, int64_t ai,
                       int64_t ac, const T *m, const T *l, int normalised)
{
    const int64_t bq = it->bq, dv = a->dv;
    T *out = it->part ? it->part : it->out;
    const int64_t os = it->part ? dv + 2 : a->o_rs;
    if (ac != 1) { /* transposed */
        untranspose_rows(out, os, acc, ac, bq, dv, normalised ? NULL : l);
    } else {
        for (int64_t i = 0; i < bq; i++) {
            const T inv = normalised ? 1 : (l[i] == 0) ? 0 : 1 / l[i];
            T *orow = out + i * os;
            for (int64_t c = 0; c < dv; c++) orow[c] = acc[i * ai + c] * inv;
        }
    }
    if (it->part) {
        for (int64_t i = 0; i < bq; i++) {
            out[i * os + dv] = m[i];
            out[i * os + dv + 1] = l[i];
        }
        return;
    }
    if (it->lse) {
        T *lse = it->lse;
        for (int64_t i = 0; i < bq; i++) lse[i * a->lse_rs] = (l[i] == 0) ? -INFINITY : m[i] + log(l[i]);
    }
}

/* Merge the split-key partial results of one item (flash-decoding):
 *   parts  (nparts, bq, dv + 2): acc / l, running max m, running sum l per row
 * M = max_p m_p;  w_p = exp(m_p - M) l_p;  l = sum_p w_p;
 * out = sum_p (w_p / l) (acc / l)_p: a weighted mean of the parts' means, so it
 * cannot overflow where the output itself does not.  Parts that saw no key
 * (l_p == 0) add nothing; a part whose exp(m_p - M) underflows to 0 adds only
 * its inf and NaN (see rows_pv_careful); NaN propagates.
 * Scratch: dv + 2 elements. */
void FN(fa_attn_merge)(const fa_attention_args *a, const fa_item *it, const void *parts_,
                       int64_t nparts, void *scratch)
{
    const T *parts = parts_;
    const int64_t bq = it->bq, dv = a->dv, ps = bq * (dv + 2);
    T *acc = scratch;
    fa_item row = *it;
    for (int64_t i = 0; i < bq; i++) {
        T M = -INFINITY;
        for (int64_t p = 0; p < nparts; p++) {
            const T mp = parts[p * ps + i * (dv + 2) + dv];
            const T lp = parts[p * ps + i * (dv + 2) + dv + 1];
            if (lp != 0 || lp != lp) M = (mp > M || mp != mp) ? mp : M;
        }
        T lsum = 0;
        for (int64_t p = 0; p < nparts; p++) {
            const T *pr = parts + p * ps + i * (dv + 2);
            if (pr[dv + 1] != 0) lsum += (T)exp(pr[dv] - M) * pr[dv + 1];
        }
        for (int64_t c = 0; c < dv; c++) acc[c] = 0;
        for (int64_t p = 0; p < nparts; p++) {
            const T *pr = parts + p * ps + i * (dv + 2);
            if (pr[dv + 1] == 0) continue;
            const T e = (T)exp(pr[dv] - M);
            if (e == 0) { /* underflowed: only its inf and NaN count (see rows_pv_careful) */
                for (int64_t c = 0; c < dv; c++)
                    if (!isfinite(pr[c])) acc[c] += pr[c];
                continue;
            }
            const T w = e * pr[dv + 1] / lsum;
            for (int64_t c = 0; c < dv; c++) acc[c] += w * pr[c];
        }
        row.bq = 1;
        row.out = it->out ? (T *)it->out + i * a->o_rs : NULL;
        row.lse = it->lse ? (T *)it->lse + i * a->lse_rs : NULL;
        row.part = NULL;
        write_rows(a, &row, acc, 0, 1, &M, &lsum, 1);
    }
}

/* ---------------------------------------------------------------------------
 * Few query rows (decode, speculative verification): bq <= rows_max rows
 * (dispatch.c: with AVX-512 12, or 24 (float64: 20) when K and V come from
 * memory or dk >= 128, but not 14-16 float32 rows, which fill one vector of the
 * tiled kernel (rows_full); with AVX2 3 to 6; 10 on the portable path) against
 * a long key range; also the few rows past the tiled kernel's last whole
 * vector (attention.c, run: the tail), with the tiled kernel's tiles.
 * Per key tile: scores by dot products along dk (register tiles of up to 4
 * rows x 4 keys: a K vector loaded once serves the rows), the online softmax
 * vectorised along the keys, then A += P . V by register tiles of R rows x
 * PV_ACC / R vectors (AVX-512: 8 x 3, 4 x 6; AVX2: 4 x 2; a V vector loaded
 * once serves the rows).  Memory-bound by design: K and V stream through once.
 * One row (decoding) is software-pipelined: the scores of key tile t + 1 are
 * computed beside P . V of tile t, so that K and V stream together
 * (decode_step, item_rows).
 * Scratch, in elements of T:
 *   Qs   (bq, dkp)  the rows, times scale, zero-padded to dkp (multiple of L)
 *   S    (bq, bk)   scores of one key tile; then probabilities
 *   A    (bq, dv)   output accumulator: unnormalised; careful: the mean
 *   m, l (bq)
 *   Sn   (bk)       one row: the next tile's scores
 * ------------------------------------------------------------------------- */
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

INLINE T hsum(vec x)
{
    T t[L];
    memcpy(t, &x, sizeof t);
    T s = 0;
    for (int i = 0; i < L; i++) s += t[i];
    return s;
}

/* The horizontal sums of four vectors: s[r] = sum of the lanes of ar.  On
 * AVX2/AVX-512 by a tree of adds and hadds (about 13 instructions for 16
 * float32 lanes, in place of 60 scalar adds).  With the vector row max and
 * the attention exp below, the decode kernel went from 66 to 83 GB/s on one
 * core with K and V in cache (float32, AVX-512). */
INLINE void hsum4(vec a0, vec a1, vec a2, vec a3, T *restrict s)
{
#if (defined(__x86_64__) || defined(_M_X64)) && FA_VB >= 32 && !FA_IS_F64
#if FA_VB == 64
#define HALF(x) _mm256_add_ps(_mm512_castps512_ps256((__m512)(x)), _mm512_extractf32x8_ps((__m512)(x), 1))
#else
#define HALF(x) ((__m256)(x))
#endif
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(HALF(a0), HALF(a1)), _mm256_hadd_ps(HALF(a2), HALF(a3)));
    _mm_storeu_ps(s, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
#undef HALF
#elif (defined(__x86_64__) || defined(_M_X64)) && FA_VB >= 32
#if FA_VB == 64
#define HALF(x) _mm256_add_pd(_mm512_castpd512_pd256((__m512d)(x)), _mm512_extractf64x4_pd((__m512d)(x), 1))
#else
#define HALF(x) ((__m256d)(x))
#endif
    const __m256d h01 = _mm256_hadd_pd(HALF(a0), HALF(a1)), h23 = _mm256_hadd_pd(HALF(a2), HALF(a3));
    _mm256_storeu_pd(s, _mm256_add_pd(_mm256_permute2f128_pd(h01, h23, 0x20),
                                      _mm256_permute2f128_pd(h01, h23, 0x31)));
#undef HALF
#else
    s[0] = hsum(a0);
    s[1] = hsum(a1);
    s[2] = hsum(a2);
    s[3] = hsum(a3);
#endif
}

/* Register tiles of the row kernel: RS_MAX query rows x 4 keys of scores and
 * R <= RP_MAX rows x up to PV_ACC / R vectors (at most 8) of P.V, so that a K
 * or V vector loaded once serves several rows (32 vector registers with
 * AVX-512, 16 otherwise).  Measured at 8 rows, H2 Nk2048 d128, one thread, K
 * and V in L3, ns per (row, key), row by row -> tiles: AVX-512 float32 8.0 -> 3.9, float64 17.9 -> 7.7;
 * AVX2 float32 9.9 -> 6.7, float64 21.6 -> 13.7; 2 and 4 rows (AVX-512
 * float32) 12.2 -> 10.0 and 9.8 -> 6.6.  At H32 Nk4096 from memory,
 * 8 rows went from 46-62 % to 72-78 % of a plain streaming read.
 * AVX-512 P.V: 8 rows x 3 vectors (24 accumulators), in place of 4 x 4:
 * 1.02-1.11x at 8-24 rows (d128 float32 and float64, K and V in L3; from
 * memory within the noise, 0.95-1.07x); splitting the key tile so that V stays in L1 across the row groups
 * measured no better (the V loads are not what limits it). */
#if FA_VB == 64
#define RP_MAX 8
#define RS_MAX 4
#define PV_ACC 24
#else
#define RP_MAX 4
#define RS_MAX 2
#define PV_ACC 8
#endif

/* Scores of one row and four keys, K rows k0..k3: s[0..4) = Qs row . K row.
 * Two accumulators per key: eight independent FMA chains (the decode case). */
INLINE void rows_scores_1x4(T *restrict s, const T *restrict qi, const T *restrict k0,
                            const T *restrict k1, const T *restrict k2, const T *restrict k3,
                            int64_t dk, int64_t dkv)
{
    vec a0 = vset1(0), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int64_t c = 0;
    for (; c + 2 * L <= dkv; c += 2 * L) {
        const vec x = vload(qi + c), y = vload(qi + c + L);
        a0 += x * vload(k0 + c); b0 += y * vload(k0 + c + L);
        a1 += x * vload(k1 + c); b1 += y * vload(k1 + c + L);
        a2 += x * vload(k2 + c); b2 += y * vload(k2 + c + L);
        a3 += x * vload(k3 + c); b3 += y * vload(k3 + c + L);
    }
    for (; c < dkv; c += L) {
        const vec x = vload(qi + c);
        a0 += x * vload(k0 + c); a1 += x * vload(k1 + c);
        a2 += x * vload(k2 + c); a3 += x * vload(k3 + c);
    }
    hsum4(a0 + b0, a1 + b1, a2 + b2, a3 + b3, s);
    for (; c < dk; c++) {
        s[0] += qi[c] * k0[c]; s[1] += qi[c] * k1[c];
        s[2] += qi[c] * k2[c]; s[3] += qi[c] * k3[c];
    }
}

/* Scores of R rows (Qs rows i = 0..R, stride dkp) and four keys k0..k3:
 * S[i * ls + 0..4).  R x 4 accumulators; each K vector serves R rows. */
INLINE void rows_scores_rx4(const int R, T *restrict S, int64_t ls, const T *restrict Qs, int64_t dkp,
                            const T *restrict k0, const T *restrict k1, const T *restrict k2,
                            const T *restrict k3, int64_t dk, int64_t dkv)
{
    vec acc[RS_MAX][4];
    UNROLL(4) for (int i = 0; i < R; i++)
        UNROLL(4) for (int x = 0; x < 4; x++) acc[i][x] = vset1(0);
    for (int64_t c = 0; c < dkv; c += L) {
        const vec x0 = vload(k0 + c), x1 = vload(k1 + c), x2 = vload(k2 + c), x3 = vload(k3 + c);
        UNROLL(4) for (int i = 0; i < R; i++) {
            const vec qv = vload(Qs + i * dkp + c);
            acc[i][0] += qv * x0; acc[i][1] += qv * x1;
            acc[i][2] += qv * x2; acc[i][3] += qv * x3;
        }
    }
    UNROLL(4) for (int i = 0; i < R; i++) {
        T *si = S + i * ls;
        const T *qi = Qs + i * dkp;
        hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], si);
        for (int64_t c = dkv; c < dk; c++) {
            si[0] += qi[c] * k0[c]; si[1] += qi[c] * k1[c];
            si[2] += qi[c] * k2[c]; si[3] += qi[c] * k3[c];
        }
    }
}

/* Scores of a key tile for bq rows: S[i][j] = Qs[i] . K[j]   for j < nb
 *   S   (bq, ls)    Qs (bq, dkp) zero-padded rows
 *   K   (nb, dk)    row stride krs
 * Four keys at a time, for RS_MAX rows at a time (one row: two accumulators
 * per key).  Rows j < npf of K exist and may be prefetched (far: into L2, see
 * prefetch_row); xpf's rows (NULL: none) are prefetched in step with the keys. */
static void rows_scores(T *restrict S, int64_t ls, const T *restrict Qs, int64_t dkp, int64_t bq,
                        const T *restrict K, int64_t krs, int64_t dk, int64_t nb, int64_t npf, int far,
                        const tile_pf *xpf)
{
    const int64_t dkv = dk / L * L, pf = prefetch_dist(dk, far);
    int64_t j = 0;
    for (; j + 4 <= nb; j += 4) {
        const T *k0 = K + j * krs, *k1 = k0 + krs, *k2 = k1 + krs, *k3 = k2 + krs;
        for (int64_t r = j + pf; r < j + pf + 4 && r < npf; r++) prefetch_row(K + r * krs, dk, far, krs != dk);
        if (xpf) tile_prefetch(xpf, j, 4);
        int64_t i = 0;
        for (; i + RS_MAX <= bq; i += RS_MAX)
            rows_scores_rx4(RS_MAX, S + i * ls + j, ls, Qs + i * dkp, dkp, k0, k1, k2, k3, dk, dkv);
        switch (bq - i) {
#if RS_MAX > 3
        case 3: rows_scores_rx4(3, S + i * ls + j, ls, Qs + i * dkp, dkp, k0, k1, k2, k3, dk, dkv); break;
        case 2: rows_scores_rx4(2, S + i * ls + j, ls, Qs + i * dkp, dkp, k0, k1, k2, k3, dk, dkv); break;
#endif
        case 1: rows_scores_1x4(S + i * ls + j, Qs + i * dkp, k0, k1, k2, k3, dk, dkv); break;
        default: break;
        }
    }
    if (xpf) tile_prefetch(xpf, j, INT64_MAX - j); /* the rest */
    for (; j < nb; j++) {
        const T *kj = K + j * krs;
        for (int64_t i = 0; i < bq; i++) {
            const T *qi = Qs + i * dkp;
            vec a0 = vset1(0), b0 = a0;
            int64_t c = 0;
            for (; c + 2 * L <= dkv; c += 2 * L) {
                a0 += vload(qi + c) * vload(kj + c);
                b0 += vload(qi + c + L) * vload(kj + c + L);
            }
            for (; c < dkv; c += L) a0 += vload(qi + c) * vload(kj + c);
            T s = hsum(a0 + b0);
            for (; c < dk; c++) s += qi[c] * kj[c];
            S[i * ls + j] = s;
        }
    }
}

/* A[i][0..NV*L) += sum_j S[i][j] * V[j][0..NV*L)   for i < R:
 *   A (R, lda)   S (R, ls)   V (nb, NV*L) row stride vrs
 * An R x NV register tile: each V vector, loaded once, serves R rows.
 * Rows j < npf of V exist and may be prefetched: pfn elements of the row pf
 * rows ahead (far: into L2; tail: see prefetch_l2); and kp's row j with key j
 * (NULL: none). */
INLINE void rows_pv_tile(const int R, const int NV, T *restrict A, int64_t lda, const T *restrict S,
                         int64_t ls, const T *restrict V, int64_t vrs, int64_t nb, int64_t npf, int64_t pf,
                         int64_t pfn, int far, int tail, const tile_pf *kp)
{
    vec acc[RP_MAX][8];
    UNROLL(8) for (int i = 0; i < R; i++)
        UNROLL(8) for (int x = 0; x < NV; x++) acc[i][x] = vload(A + i * lda + x * L);
    for (int64_t j = 0; j < nb; j++) {
        const T *vj = V + j * vrs;
        if (j + pf < npf) prefetch_row(vj + pf * vrs, pfn, far, tail);
        if (kp) tile_prefetch(kp, j, 1);
        vec vv[8];
        UNROLL(8) for (int x = 0; x < NV; x++) vv[x] = vload(vj + x * L);
        UNROLL(8) for (int i = 0; i < R; i++) {
            const T p = S[i * ls + j]; /* scalar x vector: a broadcast (vset1 would add 0 first) */
            UNROLL(8) for (int x = 0; x < NV; x++) acc[i][x] += p * vv[x];
        }
    }
    UNROLL(8) for (int i = 0; i < R; i++)
        UNROLL(8) for (int x = 0; x < NV; x++) vstore(A + i * lda + x * L, acc[i][x]);
}

/* rows_pv for R rows: the whole vectors of dv by tiles of NVM vectors (R x NVM
 * accumulators: PV_ACC, at most 8 vectors; one row takes 8, a single pass
 * over each V row, as decoding streams V from memory) and one narrower tile,
 * then the last dv % L columns.  The first tile prefetches whole V rows (the
 * later ones find them in cache); xpf's rows (NULL: none) are prefetched in
 * step with the tiles, or with xpf->per_key key by key in the first tile. */
#define PV_TILE(NV) rows_pv_tile(R, NV, A + c, lda, S, ls, V + c, vrs, nb, (R == 1 || c == 0) ? npf : 0, pf, R == 1 ? NV * L : dv, far, vrs != dv, \
                                 (xpf && xpf->per_key && c == 0) ? xpf : NULL)
INLINE void rows_pv_r(const int R, T *restrict A, int64_t lda, const T *restrict S, int64_t ls,
                      const T *restrict V, int64_t vrs, int64_t dv, int64_t nb, int64_t npf, int far,
                      const tile_pf *xpf)
{
    const int NVM = PV_ACC / R > 8 ? 8 : PV_ACC / R;
    const int64_t nvec = dv / L, pf = prefetch_dist(dv, far);
    int64_t c = 0;
    for (; c + NVM * L <= nvec * L; c += NVM * L) {
        if (xpf && !xpf->per_key) prefetch_in_step(xpf, c, c + NVM * L, dv);
        PV_TILE(NVM);
    }
    if (xpf && !xpf->per_key) prefetch_in_step(xpf, c, dv, dv); /* the rest */
    switch (nvec - c / L) { /* < NVM: the tests below are constants */
    case 7: if (7 < NVM) PV_TILE(7); break;
    case 6: if (6 < NVM) PV_TILE(6); break;
    case 5: if (5 < NVM) PV_TILE(5); break;
    case 4: if (4 < NVM) PV_TILE(4); break;
    case 3: if (3 < NVM) PV_TILE(3); break;
    case 2: if (2 < NVM) PV_TILE(2); break;
    case 1: PV_TILE(1); break;
    default: break;
    }
    for (int i = 0; i < R; i++)
        for (c = nvec * L; c < dv; c++) {
            T s = A[i * lda + c];
            for (int64_t j = 0; j < nb; j++) s += S[i * ls + j] * V[j * vrs + c];
            A[i * lda + c] = s;
        }
}
#undef PV_TILE

/* A (bq, dv) += S (bq, nb; row stride ls) . V (nb, dv; row stride vrs), rows
 * RP_MAX at a time.  Rows j < npf of V may be prefetched (0: none; far: into
 * L2), and xpf's rows (NULL: none); only the first group of rows prefetches
 * (the others find V in cache). */
static void rows_pv(T *restrict A, const T *restrict S, int64_t ls, int64_t bq, const T *restrict V,
                    int64_t vrs, int64_t dv, int64_t nb, int64_t npf, int far, const tile_pf *xpf)
{
    int64_t i = 0;
    for (; i + RP_MAX <= bq; i += RP_MAX, npf = 0, xpf = NULL)
        rows_pv_r(RP_MAX, A + i * dv, dv, S + i * ls, ls, V, vrs, dv, nb, npf, far, xpf);
    switch (bq - i) {
#if RP_MAX == 8
    case 7: rows_pv_r(7, A + i * dv, dv, S + i * ls, ls, V, vrs, dv, nb, npf, far, xpf); break;
    case 6: rows_pv_r(6, A + i * dv, dv, S + i * ls, ls, V, vrs, dv, nb, npf, far, xpf); break;
    case 5: rows_pv_r(5, A + i * dv, dv, S + i * ls, ls, V, vrs, dv, nb, npf, far, xpf); break;
    case 4: rows_pv_r(4, A + i * dv, dv, S + i * ls, ls, V, vrs, dv, nb, npf, far, xpf); break;
#elif RP_MAX != 4
#error "rows_pv: a case for each remainder below RP_MAX"
#endif
    case 3: rows_pv_r(3, A + i * dv, dv, S + i * ls, ls, V, vrs, dv, nb, npf, far, xpf); break;
    case 2: rows_pv_r(2, A + i * dv, dv, S + i * ls, ls, V, vrs, dv, nb, npf, far, xpf); break;
    case 1: rows_pv_r(1, A + i * dv, dv, S + i * ls, ls, V, vrs, dv, nb, npf, far, xpf); break;
    default: break;
    }
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
 * passes it), so that neither their scores nor P . V are computed.  Decoding
 * 1, 4 and 12 rows against 4096 keys of which the last 3000 are padding, with
 * a bool mask: 2.2-5.6 ms before, 0.59-2.1 after, 0.56-0.72 with kv_lengths
 * (H32 d128; H8 Nk1024 d64 in cache 1.5-2.4x).  Under a float mask only where
 * no score of the cut keys can be NaN or +inf (scores_bounded, which takes
 * reading their K rows), and only for 2 rows or more:
 * 4 and 12 rows 1.7x and 1.7x (H32 Nk4096), 1.08x and 1.8x (H8 Nk1024 in
 * cache), but one row, whose scores cost no more than that check, 0.81x in
 * cache (mask_runs leaves the keys out of its P . V anyway).
 *   Qs (bq, dkp) the scaled queries, zero-padded rows */
static __attribute__((noinline)) void mask_trim(band_t *b, const fa_attention_args *a, const fa_item *it,
                                                const T *Qs, int64_t dkp)
{
    if (a->mask_kind == FA_MASK_NONE || (a->mask_kind == FA_MASK_ADD && it->bq < 2)) return;
    int64_t lo = b->j_lo, hi = b->j_hi;
    while (hi > lo && !mask_key_seen(a, it, hi - 1)) hi--;
    while (lo < hi && !mask_key_seen(a, it, lo)) lo++;
    if (a->mask_kind == FA_MASK_ADD && (lo > b->j_lo || hi < b->j_hi)) {
        const T *K = (const T *)it->k, qmax = abs_max(Qs, dkp, dkp, it->bq);
        if (!scores_bounded(qmax, abs_max(K + b->j_lo * a->k_rs, a->k_rs, a->dk, lo - b->j_lo), a->dk) ||
            !scores_bounded(qmax, abs_max(K + hi * a->k_rs, a->k_rs, a->dk, b->j_hi - hi), a->dk))
            return;
    }
    b->j_lo = lo;
    b->j_hi = hi;
}

/* rows_pv over the key ranges of kr (all nb keys when n < 0), pointers as
 * rows_pv's; off the common path (noinline: inlined, it slowed item_rows by
 * 4-5 % at 4 rows, mask or not) */
static __attribute__((noinline)) void rows_pv_runs(const key_runs *kr, T *restrict A, const T *restrict S,
                                                   int64_t ls, int64_t bq, const T *restrict V, int64_t vrs,
                                                   int64_t dv, int64_t nb, int64_t npf, int far,
                                                   const tile_pf *xpf)
{
    if (kr->n < 0) {
        rows_pv(A, S, ls, bq, V, vrs, dv, nb, npf, far, xpf);
        return;
    }
    for (int r = 0; r < kr->n; r++) {
        const int64_t j = kr->run[r][0];
        rows_pv(A, S + j, ls, bq, V + j * vrs, vrs, dv, kr->run[r][1] - j, npf - j, far,
                r == 0 ? xpf : NULL);
    }
}

/* P . V for the rows that redo_nonfinite_rows recomputes, where the weight
 * of a key the query does not see is -0 (item_rows, careful): such a value
 * row adds nothing even when it holds inf or NaN.  A (dv) += S (nb) . V (nb, dv). */
static void rows_pv_careful(T *restrict A, const T *restrict S, const T *restrict V, int64_t vrs,
                            int64_t dv, int64_t nb)
{
    for (int64_t j = 0; j < nb; j++) {
        const T p = S[j];
        const T *vj = V + j * vrs;
        if (p == 0) {
            /* -0: a hidden key, which adds nothing.  +0: a key the row sees
             * whose weight underflowed; its true weight is positive, so its
             * inf and NaN values still count (inf * tiny = inf), its finite
             * ones add nothing. */
            if (!signbit(p))
                for (int64_t c = 0; c < dv; c++)
                    if (!isfinite(vj[c])) A[c] += vj[c];
            continue;
        }
        for (int64_t c = 0; c < dv; c++) A[c] += p * vj[c];
    }
}

/* The online softmax of the rows over the key tile [j0, j0 + nb), whose
 * scores are in S: the score modifiers and masks, each row's max,
 * S <- exp(S - max) (the probabilities), m and l updated, A rescaled (for
 * careful, see item_rows).
 *   S (bq, bk)   A (bq, dv)   m, l (bq) */
static void rows_softmax(const fa_attention_args *a, const fa_item *it, const band_t *band, T *S,
                         int64_t bk, T *A, T *m, T *l, int64_t j0, int64_t nb, int careful)
{
    const int64_t bq = it->bq, dv = a->dv;
    const band_t b = *band;
    for (int64_t i = 0; i < bq; i++) {
        T *si = S + i * bk;
        const int64_t pos = band_pos(&b, i); /* the row's aligned position */
        if (a->softcap > 0) {
            const T c = (T)a->softcap, ic = 1 / c;
            int64_t j = 0;
            for (; j + L <= nb; j += L) vstore(si + j, vtanh(vload(si + j) * ic) * c);
            for (; j < nb; j++) {
                T buf[L] = {0};
                buf[0] = si[j] * ic;
                const vec t = vtanh(vload(buf));
                memcpy(buf, &t, sizeof buf);
                si[j] = buf[0] * c;
            }
        }
        if (it->slope != 0)
            for (int64_t j = 0; j < nb; j++) {
                const int64_t d = pos - (j0 + j);
                si[j] -= (T)it->slope * (T)(d < 0 ? -d : d);
            }
        if (a->mask_kind == FA_MASK_BOOL) {
            const uint8_t *mk = (const uint8_t *)it->mask + i * a->m_rs + j0 * a->m_cs;
            for (int64_t j = 0; j < nb; j++)
                if (!mk[j * a->m_cs]) si[j] = -INFINITY;
        } else if (a->mask_kind == FA_MASK_ADD) {
            const T *mk = (const T *)it->mask + i * a->m_rs + j0 * a->m_cs;
            for (int64_t j = 0; j < nb; j++) si[j] += mk[j * a->m_cs];
        }
        if (b.has_right) /* key j0 + j is hidden iff j0 + j > pos + right */
            for (int64_t j = (pos + b.right + 1 - j0 > 0) ? pos + b.right + 1 - j0 : 0; j < nb; j++)
                si[j] = -INFINITY;
        if (b.has_left) /* ... or j0 + j < pos - left */
            for (int64_t j = 0; j < nb && j0 + j < pos - b.left; j++) si[j] = -INFINITY;
        /* online softmax of row i over this tile */
        T bm = -INFINITY;
        {
            vec vm = vset1(-INFINITY);
            int64_t j = 0;
            for (; j + L <= nb; j += L) vm = vnanmax(vm, vload(si + j));
            T mx[L];
            memcpy(mx, &vm, sizeof mx);
            for (int r = 0; r < L; r++) bm = (mx[r] > bm || mx[r] != mx[r]) ? mx[r] : bm;
            for (; j < nb; j++) bm = (si[j] > bm || si[j] != si[j]) ? si[j] : bm;
        }
        const T mo = m[i], mn = (bm > mo || bm != bm || mo != mo) ? (mo != mo ? mo : bm) : mo;
        const T mu = (mn == -INFINITY) ? 0 : mn;
        T sum = 0;
        {
            vec vs = vset1(0);
            int64_t j = 0;
            /* careful: a hidden key (score -inf) gets weight -0, told apart from
             * a weight that underflowed to +0 (rows_pv_careful) */
            const vec hid = -vset1(0);
            for (; j + L <= nb; j += L) { /* arguments <= 0 (or NaN): the attention exp */
                const vec x = vload(si + j);
                const vec p = vexp_neg(x - mu);
                vstore(si + j, careful ? vsel(x == vset1(-INFINITY), hid, p) : p);
                vs += p;
            }
            if (j < nb) {
                T buf[L];
                for (int r = 0; r < L; r++) buf[r] = (j + r < nb) ? si[j + r] : -INFINITY;
                const vec x = vload(buf);
                const vec p = vexp_neg(x - mu);
                vs += p;
                const vec ps = careful ? vsel(x == vset1(-INFINITY), hid, p) : p;
                memcpy(buf, &ps, sizeof buf);
                for (int r = 0; j + r < nb; r++) si[j + r] = buf[r];
            }
            sum = hsum(vs);
        }
        T alpha_buf[L];
        {
            const vec al = vexp_neg(vset1(mo - mu));
            memcpy(alpha_buf, &al, sizeof alpha_buf);
        }
        const T alpha = alpha_buf[0], lo = l[i];
        l[i] = lo * alpha + sum;
        m[i] = mn;
        T f = alpha;
        if (careful) { /* A holds the mean so far: A <- A lo alpha / l + P . V / l */
            const T inv = l[i] == 0 ? 0 : 1 / l[i];
            f = lo * alpha * inv;
            for (int64_t j = 0; j < nb; j++) si[j] *= inv; /* keeps the sign of -0 */
        }
        /* f is 0 exactly when alpha is (vexp_neg gives no subnormals, lo >= 1 and
         * l <= lo alpha + bk), and then inf * 0 would be NaN: the old terms weigh 0, */
        if (careful && f == 0) {
            for (int64_t c = 0; c < dv; c++) /* but their inf and NaN stay (see rows_pv_careful) */
                if (isfinite(A[i * dv + c])) A[i * dv + c] = 0;
        } else if (f != 1)
            for (int64_t c = 0; c < dv; c++) A[i * dv + c] *= f;
    }
}

/* One row's A (dv) += p0 v0 + p1 v1 + p2 v2 + p3 v3 for four V rows v0..v3 (dv),
 * dvv = dv rounded down to whole vectors (decode_step, group_step). */
INLINE void pv_1x4(T *restrict A, T p0, T p1, T p2, T p3, const T *restrict v0, const T *restrict v1,
                   const T *restrict v2, const T *restrict v3, int64_t dv, int64_t dvv)
{
    for (int64_t c = 0; c < dvv; c += L) {
        vec acc = vload(A + c);
        acc += p0 * vload(v0 + c);
        acc += p1 * vload(v1 + c);
        acc += p2 * vload(v2 + c);
        acc += p3 * vload(v3 + c);
        vstore(A + c, acc);
    }
    for (int64_t c = dvv; c < dv; c++) A[c] += p0 * v0[c] + p1 * v1[c] + p2 * v2[c] + p3 * v3[c];
}

/* One decode step, K and V read side by side: the scores of the next key
 * tile (Sn[j] = Qs . K[j], j < nk) and A += P . V over this tile (j < nv),
 * four keys of each at a time.  Reading K and V as two streams at once, not one
 * tile after the other, measured 1.1-1.2x faster as a plain read of K and V
 * from memory (two threads, Zen 3; chunks of 16 keys or more lost it), and the
 * decode kernel 1.2-1.27x faster than the tile-by-tile loop (H32 Nk4096 and H8
 * Nk16384 d128, float32 and float64, one and two threads; K and V in the L3: the same).
 *   Sn (nk)        Qs (dkp) the row, times scale, zero-padded
 *   K  (nk, dk)    row stride krs; rows j < npk exist (prefetched ahead)
 *   P  (nv)        probabilities of this tile
 *   V  (nv, dv)    row stride vrs; rows j < npv exist
 *   A  (dv)        accumulator
 * far: K and V come from memory (prefetch_row). */
static void decode_step(T *restrict Sn, const T *restrict Qs, const T *restrict K, int64_t krs, int64_t dk,
                        int64_t nk, int64_t npk, T *restrict A, const T *restrict P, const T *restrict V,
                        int64_t vrs, int64_t dv, int64_t nv, int64_t npv, int far)
{
    const int64_t dkv = dk / L * L, dvv = dv / L * L, ahead = far ? FAR_PF_BYTES : DECODE_PF_BYTES;
    const int64_t pfk = prefetch_dist_bytes(dk, ahead), pfv = prefetch_dist_bytes(dv, ahead);
    const int64_t n = nk > nv ? nk : nv;
    for (int64_t j = 0; j < n; j += 4) {
        if (j + 4 <= nk) {
            const T *k0 = K + j * krs;
            for (int64_t r = j + pfk; r < j + pfk + 4 && r < npk; r++) prefetch_row(K + r * krs, dk, far, krs != dk);
            rows_scores_1x4(Sn + j, Qs, k0, k0 + krs, k0 + 2 * krs, k0 + 3 * krs, dk, dkv);
        } else if (j < nk) { /* the last 1-3 keys: rows_scores' one-key loop */
            rows_scores(Sn + j, 0, Qs, 0, 1, K + j * krs, krs, dk, nk - j, 0, 0, NULL);
        }
        if (j + 4 <= nv) {
            const T *v0 = V + j * vrs, *v1 = v0 + vrs, *v2 = v1 + vrs, *v3 = v2 + vrs;
            for (int64_t r = j + pfv; r < j + pfv + 4 && r < npv; r++) prefetch_row(V + r * vrs, dv, far, vrs != dv);
            pv_1x4(A, P[j], P[j + 1], P[j + 2], P[j + 3], v0, v1, v2, v3, dv, dvv);
        } else if (j < nv) { /* the last 1-3 keys */
            rows_pv(A, P + j, 0, 1, V + j * vrs, vrs, dv, nv - j, 0, 0, NULL);
        }
    }
}

/* decode_step's work where a bool mask hides some keys of this tile from the
 * row: the next tile's scores, then P . V over kr's ranges (rows_pv_runs).
 * Pointers as decode_step's; Sn and P have row stride bk. */
static __attribute__((noinline)) void decode_step_runs(const key_runs *kr, T *Sn, const T *Qs, int64_t dkp,
                                                       const T *K, int64_t krs, int64_t dk, int64_t nk,
                                                       int64_t npk, T *A, const T *P, int64_t bk, const T *V,
                                                       int64_t vrs, int64_t dv, int64_t nv, int64_t npv, int far)
{
    rows_scores(Sn, bk, Qs, dkp, 1, K, krs, dk, nk, npk, far, NULL);
    rows_pv_runs(kr, A, P, bk, 1, V, vrs, dv, nv, npv, far, NULL);
}

/* The row kernel; careful = 1 (one row, from redo_nonfinite_rows) marks the
 * weights of hidden keys -0, takes the P . V above, and when the accumulator's
 * scale underflows to 0 keeps only its inf and NaN entries.  It also keeps A
 * as the mean so far (P / l before P . V, A rescaled by l_old alpha / l), not
 * the sum: a sum of many values near the dtype's limit overflows where their
 * mean does not, and such a row comes here after the fast kernels overflow. */
/* The row kernel's start on an item: Qs (bq, dkp) <- its rows times scale,
 * zero-padded; A (bq, dv) <- 0; m, l (bq) <- -inf, 0.  Returns the keys its
 * rows may see (item_band), less the ends a mask hides from all (mask_trim). */
static band_t rows_begin(const fa_attention_args *a, const fa_item *it, T *restrict Qs, int64_t dkp,
                         T *restrict A, T *restrict m, T *restrict l)
{
    const int64_t bq = it->bq, dk = a->dk;
    const T *q = it->q, scale = (T)a->scale;
    for (int64_t i = 0; i < bq; i++) {
        for (int64_t c = 0; c < dk; c++) Qs[i * dkp + c] = q[i * a->q_rs + c] * scale;
        for (int64_t c = dk; c < dkp; c++) Qs[i * dkp + c] = 0;
        m[i] = -INFINITY;
        l[i] = 0;
    }
    memset(A, 0, (size_t)(bq * a->dv) * sizeof(T));
    band_t b = item_band(a, it);
    mask_trim(&b, a, it, Qs, dkp);
    return b;
}

static void item_rows(const fa_attention_args *a, const fa_tiles *tl, const fa_item *it, void *scratch,
                      int careful)
{
    const int64_t bq = it->bq, bk = tl->bk, dk = a->dk, dv = a->dv;
    const int64_t dkp = (dk + L - 1) / L * L;
    const T *k = it->k, *v = it->v;
    T *Qs = scratch, *S = Qs + bq * dkp, *A = S + bq * bk, *m = A + bq * dv, *l = m + bq;
    const int far = tl->far; /* K and V from memory: prefetch into L2, further ahead */
    band_t b = rows_begin(a, it, Qs, dkp, A, m, l);
    if (bq == 1 && !careful && b.j_lo < b.j_hi) {
        /* Decoding, one row: software-pipelined over the key tiles, so that the
         * scores of tile t + 1 and P . V of tile t read K and V together
         * (decode_step); Sn (bk), after l, holds the next tile's scores. */
        T *Sn = l + 1;
        int64_t j0 = b.j_lo, nb = (b.j_hi - j0 < bk) ? b.j_hi - j0 : bk;
        rows_scores(S, bk, Qs, dkp, 1, k + j0 * a->k_rs, a->k_rs, dk, nb, b.j_hi - j0, far, NULL);
        rows_softmax(a, it, &b, S, bk, A, m, l, j0, nb, 0);
        for (;;) {
            const int64_t j1 = j0 + nb, nb1 = (b.j_hi - j1 < bk) ? b.j_hi - j1 : bk;
            key_runs kr; /* keys a mask hides (padding): P . V skips them */
            mask_runs(&kr, a, it, j0, nb);
            if (nb1 <= 0) {
                rows_pv_runs(&kr, A, S, bk, 1, v + j0 * a->v_rs, a->v_rs, dv, nb, b.j_hi - j0, far, NULL);
                break;
            }
            if (runs_whole(&kr, nb)) {
                decode_step(Sn, Qs, k + j1 * a->k_rs, a->k_rs, dk, nb1, b.j_hi - j1, A, S, v + j0 * a->v_rs,
                            a->v_rs, dv, nb, b.j_hi - j0, far);
            } else { /* the two passes one after the other */
                decode_step_runs(&kr, Sn, Qs, dkp, k + j1 * a->k_rs, a->k_rs, dk, nb1, b.j_hi - j1, A, S, bk,
                                 v + j0 * a->v_rs, a->v_rs, dv, nb, b.j_hi - j0, far);
            }
            rows_softmax(a, it, &b, Sn, bk, A, m, l, j1, nb1, 0);
            T *t = S;
            S = Sn;
            Sn = t;
            j0 = j1;
            nb = nb1;
        }
        write_rows(a, it, A, dv, 1, m, l, 0);
        return;
    }
    for (int64_t j0 = b.j_lo; j0 < b.j_hi && !fa_stopped(a->stop); j0 += bk) {
        const int64_t nb = (b.j_hi - j0 < bk) ? b.j_hi - j0 : bk;
        /* K and V from memory (tl->stream): this tile's V rows prefetched during
         * its scores, the next tile's K rows during its P . V, so that memory
         * streams through both passes.  Against each pass prefetching only its own
         * rows a few KiB ahead: 1.09-1.27x at 2-10 rows, H32 Nk4096 d128 (float32
         * and float64, one and two threads); with K and V in cache it cost 5-12 %
         * (H8 Nk512 and Nk4096 d64, 8 rows), hence only from memory. */
        const int64_t nb_next = b.j_hi - (j0 + nb) < bk ? b.j_hi - (j0 + nb) : bk;
        const tile_pf pf_v = {.v = v + j0 * a->v_rs, .nv = nb, .vrs = a->v_rs, .dv = dv};
        const tile_pf pf_k = {.k = k + (j0 + nb) * a->k_rs, .nk = nb_next > 0 ? nb_next : 0,
                              .krs = a->k_rs, .dk = dk};
        const int stream = tl->stream && !careful;
        rows_scores(S, bk, Qs, dkp, bq, k + j0 * a->k_rs, a->k_rs, dk, nb, b.j_hi - j0, far,
                    stream ? &pf_v : NULL);
        rows_softmax(a, it, &b, S, bk, A, m, l, j0, nb, careful);
        /* A += P . V_tile */
        if (careful)
            rows_pv_careful(A, S, v + j0 * a->v_rs, a->v_rs, dv, nb);
        else {
            key_runs kr; /* keys a mask hides from every row (padding): skipped */
            mask_runs(&kr, a, it, j0, nb);
            if (runs_whole(&kr, nb))
                rows_pv(A, S, bk, bq, v + j0 * a->v_rs, a->v_rs, dv, nb, b.j_hi - j0, far,
                        stream ? &pf_k : NULL);
            else
                rows_pv_runs(&kr, A, S, bk, bq, v + j0 * a->v_rs, a->v_rs, dv, nb, b.j_hi - j0, far,
                             stream ? &pf_k : NULL);
        }
    }
    write_rows(a, it, A, dv, 1, m, l, careful);
}

/* ---------------------------------------------------------------------------
 * Zero weights against inf and NaN.  A key that a row does not see (mask,
 * causal, window) has weight exactly 0 there, but when its tile is visited for
 * the item's other rows, P . V adds 0 * inf or 0 * NaN = NaN to the row.
 * Rather than test every product in the hot loops, each row whose result (or
 * split-key partial accumulator) came out non-finite is recomputed by the row
 * kernel in its careful mode.  Only non-finite inputs or an overflow make a
 * row non-finite, so the common cost is one check of each written value.
 * A row that does see a non-finite value comes out the same again.
 * Scratch: the row kernel's for one row (fa_rows_scratch_elems, bq = 1).
 * ------------------------------------------------------------------------- */
INLINE int all_finite(const T *r, int64_t n)
{
    vec z = vset1(0); /* x - x: 0, or NaN for inf and NaN */
    int64_t c = 0;
    for (; c + L <= n; c += L) z += vload(r + c) - vload(r + c);
    T zs = 0;
    for (; c < n; c++) zs += r[c] - r[c];
    return zs == 0 && vall(z == vset1(0));
}

static void redo_nonfinite_rows(const fa_attention_args *a, const fa_tiles *tl, const fa_item *it,
                                void *scratch)
{
    const int64_t dv = a->dv;
    const size_t msz = a->mask_kind == FA_MASK_BOOL ? 1 : sizeof(T);
    for (int64_t i = 0; i < it->bq; i++) {
        const T *r = it->part ? (const T *)it->part + i * (dv + 2) : (const T *)it->out + i * a->o_rs;
        if (all_finite(r, dv)) continue;
        __atomic_fetch_add(&fa_redo_rows, 1, __ATOMIC_RELAXED);
        fa_item row = *it;
        row.bq = 1;
        row.i0 = it->i0 + i;
        row.q = (const T *)it->q + i * a->q_rs;
        row.mask = it->mask ? (const char *)it->mask + i * a->m_rs * (int64_t)msz : NULL;
        row.mbits = it->mbits ? it->mbits + i * it->mb_rs : NULL; /* (the row kernel reads the bytes) */
        row.out = (T *)it->out + i * a->o_rs;
        row.lse = it->lse ? (T *)it->lse + i * a->lse_rs : NULL;
        row.part = it->part ? (T *)it->part + i * (dv + 2) : NULL;
        const fa_tiles t1 = {.bq = 1, .bk = tl->bk, .bqp = 1, .ld = 1, .fuse = 0};
        item_rows(a, &t1, &row, scratch, 1);
    }
}

void FN(fa_attn_item_rows)(const fa_attention_args *a, const fa_tiles *tl, const fa_item *it,
                           void *scratch)
{
    item_rows(a, tl, it, scratch, 0);
    redo_nonfinite_rows(a, tl, it, scratch);
}

/* ---------------------------------------------------------------------------
 * The row kernel over a group of items whose K and V rows interleave: the
 * heads of a (B, n, H, d) cache (layout "blhd"), where key j's rows of the
 * group's items lie side by side and one item's rows H d apart.  Item by item
 * (item_rows), a thread reads pieces of d elements H d apart, which memory
 * serves at 16-22 GB/s against 34-36 for the same bytes in address order
 * (H32 Nk4096 d128 float32, two threads, a plain read).  Here the items take
 * turns on each key tile of tl->bk keys (a few: a tile of 16 keys read as 16
 * rows of pieces was no faster than item by item), so that K and V stream
 * through in address order; each item keeps its own state.  The rows
 * GROUP_PF_BYTES of K and V ahead are prefetched into L2 in step (64-512 KiB
 * alike; none 0.83x, into L1 0.66-0.88x, non-temporal 0.80x).
 * Items of several rows (GQA's folded heads, a few new tokens) take longer
 * tiles (attention.c), and their work on a tile is long enough that a burst
 * of prefetches at its start stalls it (the group then ran at 0.43-0.78x item
 * by item, tiles of 4-64 keys): there the rows of the tile ahead are
 * prefetched in step with the work, V's with the scores and K's key by key in
 * P . V (tile_pf.per_key).
 * All of them with the scores, as item_rows does, measured 0.94-1.45x item
 * by item; K's in step with P . V's column tiles 0.80-1.71x (bursts where
 * dv is one or two tiles).
 *   its   (n) the items: the same rows i0 and at most tl->bq of them, keys
 *         [j_lo, j_hi) each; K and V rows of item g at it[g].k, it[g].v
 *         (row strides a->k_rs, a->v_rs)
 * Scratch, in elements of T: per item Qs (bq, dkp), A (bq, dv), m, l (bq)
 * (bq = tl->bq), then S (bq, bk): fa_group_scratch_elems.
 * ------------------------------------------------------------------------- */
enum { GROUP_PF_BYTES = 131072 };

/* One key tile of fa_attn_group_rows for a row whose scores need nothing but
 * the scale (no mask, softcap or ALiBi; one row's band is its key range):
 * s = Qs . K, the online softmax of the row (m, l), A += P . V, for nb <= 4
 * keys; its probabilities and the rescaling factor from one vector exp.  In
 * place of rows_scores, rows_softmax and rows_pv, which serve any rows and
 * tiles (and still take the other cases): 1.09-1.18x from memory (H32
 * Nk4096 d128 float32), 1.27x with K and V in the L3.  Only where a vector
 * has 4 lanes or more.
 *   Qs (dkp) the row, times scale, zero-padded   K (nb, dk), V (nb, dv) row
 *   strides krs, vrs   A (dv) */
INLINE void group_step(const T *restrict Qs, const T *restrict K, int64_t krs, int64_t dk, const T *restrict V,
                       int64_t vrs, int64_t dv, int64_t nb, T *restrict A, T *m, T *l)
{
    const int64_t dkv = dk / L * L, dvv = dv / L * L;
    T s[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    if (nb == 4)
        rows_scores_1x4(s, Qs, K, K + krs, K + 2 * krs, K + 3 * krs, dk, dkv);
    else
        rows_scores(s, 0, Qs, 0, 1, K, krs, dk, nb, 0, 0, NULL);
    T bm = -INFINITY; /* the max, NaN if any is (as rows_softmax) */
    for (int j = 0; j < nb; j++) bm = (s[j] > bm || s[j] != s[j]) ? s[j] : bm;
    const T mo = *m, mn = (bm > mo || bm != bm || mo != mo) ? (mo != mo ? mo : bm) : mo;
    const T mu = (mn == -INFINITY) ? 0 : mn;
    /* lanes 0..nb: the probabilities; lane 4 (where there is one): the rescaling factor */
    T e[L > 4 ? L : 8];
    for (int r = 0; r < L; r++) e[r] = r < nb ? s[r] : r == 4 ? mo : -INFINITY;
    const vec ev = vexp_neg(vload(e) - mu);
    memcpy(e, &ev, sizeof ev);
    if (L <= 4) {
        const vec av = vexp_neg(vset1(mo - mu));
        memcpy(e + 4, &av, sizeof(T));
    }
    const T alpha = e[4];
    T p[4];
    for (int j = 0; j < 4; j++) p[j] = j < nb ? e[j] : 0;
    const T p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3];
    *l = *l * alpha + ((p0 + p1) + (p2 + p3));
    *m = mn;
    if (alpha != 1)
        for (int64_t c = 0; c < dv; c++) A[c] *= alpha;
    if (nb < 4) {
        rows_pv(A, p, 0, 1, V, vrs, dv, nb, 0, 0, NULL);
        return;
    }
    pv_1x4(A, p0, p1, p2, p3, V, V + vrs, V + 2 * vrs, V + 3 * vrs, dv, dvv);
}

void FN(fa_attn_group_rows)(const fa_attention_args *a, const fa_tiles *tl, const fa_item *its, int64_t n,
                            void *scratch)
{
    const int64_t bk = tl->bk, dk = a->dk, dv = a->dv, dkp = (dk + L - 1) / L * L;
    const int64_t st = tl->bq * (dkp + dv + 2); /* one item's state */
    T *S = (T *)scratch + n * st;
    const int plain = a->softcap <= 0 && a->mask_kind == FA_MASK_NONE;
    band_t band[FA_GROUP_MAX];
    int64_t lo = INT64_MAX, hi = 0;
    for (int64_t g = 0; g < n; g++) {
        const fa_item *it = &its[g];
        T *Qs = (T *)scratch + g * st, *A = Qs + it->bq * dkp, *m = A + it->bq * dv, *l = m + it->bq;
        band[g] = rows_begin(a, it, Qs, dkp, A, m, l);
        if (band[g].j_lo < band[g].j_hi) {
            lo = band[g].j_lo < lo ? band[g].j_lo : lo;
            hi = band[g].j_hi > hi ? band[g].j_hi : hi;
        }
    }
    /* keys ahead for the prefetch: GROUP_PF_BYTES of the group's K and V rows */
    int64_t ahead = GROUP_PF_BYTES / (n * (dk + dv) * (int64_t)sizeof(T) + 1);
    ahead = ahead < bk ? bk : ahead;
    for (int64_t j0 = lo; j0 < hi; j0 += bk) {
        for (int64_t g = 0; g < n; g++) {
            const fa_item *it = &its[g];
            const band_t *b = &band[g];
            const T *K = it->k, *V = it->v;
            const int64_t jl = j0 > b->j_lo ? j0 : b->j_lo, jh = j0 + bk < b->j_hi ? j0 + bk : b->j_hi;
            const int64_t ja = j0 + ahead, na = b->j_hi - ja < bk ? b->j_hi - ja : bk; /* rows ahead */
            const int in_step = it->bq > 1 && jl < jh; /* several rows: prefetch in step */
            if (!in_step)
                for (int64_t r = ja; r < ja + na; r++) {
                    prefetch_l2(K + r * a->k_rs, dk, 1);
                    prefetch_l2(V + r * a->v_rs, dv, 1);
                }
            if (jl >= jh) continue;
            T *Qs = (T *)scratch + g * st, *A = Qs + it->bq * dkp, *m = A + it->bq * dv, *l = m + it->bq;
            if (plain && it->slope == 0 && it->bq == 1 && jh - jl <= 4 && L >= 4) {
                group_step(Qs, K + jl * a->k_rs, a->k_rs, dk, V + jl * a->v_rs, a->v_rs, dv, jh - jl, A, m, l);
                continue;
            }
            const int64_t jp = na > 0 ? ja : jl; /* (no pointer past the item's keys) */
            const tile_pf pf_v = {.v = V + jp * a->v_rs, .nv = na > 0 ? na : 0, .vrs = a->v_rs, .dv = dv};
            const tile_pf pf_k = {.k = K + jp * a->k_rs, .nk = na > 0 ? na : 0, .krs = a->k_rs, .dk = dk,
                                  .per_key = 1};
            rows_scores(S, bk, Qs, dkp, it->bq, K + jl * a->k_rs, a->k_rs, dk, jh - jl, 0, 0,
                        in_step ? &pf_v : NULL);
            rows_softmax(a, it, b, S, bk, A, m, l, jl, jh - jl, 0);
            rows_pv(A, S, bk, it->bq, V + jl * a->v_rs, a->v_rs, dv, jh - jl, 0, 0, in_step ? &pf_k : NULL);
        }
    }
    for (int64_t g = 0; g < n; g++) {
        const T *Qs = (const T *)scratch + g * st, *A = Qs + its[g].bq * dkp, *m = A + its[g].bq * dv;
        write_rows(a, &its[g], A, dv, 1, m, m + its[g].bq, 0);
    }
    for (int64_t g = 0; g < n; g++) /* after all are written: this takes the scratch */
        redo_nonfinite_rows(a, tl, &its[g], scratch);
}

/* ---------------------------------------------------------------------------
 * Streaming softmax of one row, x (n) stride xs -> o (n) stride os.
 * Pass 1 goes over chunks of FA_SOFTMAX_CHUNK: chunk max c_m, o = exp(x - c_m),
 * chunk sum; the chunk maxima are kept, the running max and sum merged.
 * Pass 2 multiplies each chunk of o by exp(c_m - max) / sum.  One exp per
 * element.  o may be x itself (each element is read before it is written).
 * Scratch: FA_SOFTMAX_CHUNK elements (gather buffer) + one per chunk.
 * ------------------------------------------------------------------------- */
INLINE void chunk_exp(T *e, const T *x, int64_t n, T *cm, T *cs)
{
    vec bm = vset1(-INFINITY);
    int64_t i = 0;
    for (; i + L <= n; i += L) bm = vnanmax(bm, vload(x + i));
    T mx[L];
    memcpy(mx, &bm, sizeof mx);
    T mc = mx[0];
    for (int r = 1; r < L; r++) mc = (mx[r] > mc || mx[r] != mx[r]) ? mx[r] : mc;
    for (; i < n; i++) mc = (x[i] > mc || x[i] != x[i]) ? x[i] : mc;
    const T mu = (mc == -INFINITY) ? 0 : mc;
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
    T M = -INFINITY, S = 0; /* running max (NaN-propagating) and sum */
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
            const T Mn = (cm > M || cm != cm) ? cm : M;
            S = (T)(S * exp(M - Mn) + cs * exp(cm - Mn));
            M = Mn;
        }
    }
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

#if defined(FA_TARGET) && defined(__clang__)
#pragma clang attribute pop
#endif
