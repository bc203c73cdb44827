/*
 * The SIMD layer of the kernels (included by kernel_body.h once per dtype and
 * ISA): target pragmas, the vector types of FA_VB bytes over T, loads,
 * stores, selects, max, the any/all tests, the in-register L x L transpose and
 * the horizontal sums.  Everything above the kernels that depends on the ISA.
 */

#include <float.h>
#include <math.h>
#include <string.h>

#include "../internal.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h> /* max, and movemask for the bool-mask bit words (SSE2, AVX2 in the AVX files) */
#endif

/* The AVX files name their target features in FA_TARGET: every function from
 * here on is compiled for them (GCC: a target pragma; clang: a target attribute
 * on each function, popped at the end of kernel_body.h).  The headers above stay
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
 * so that the accumulator arrays live in registers; NO_UNROLL keeps a loop
 * rolled (decode_step_rolled). */
#if defined(__clang__)
#define UNROLL(n) _Pragma("unroll")
#define NO_UNROLL _Pragma("nounroll")
#else
#define UNROLL(n) FA_PRAGMA(GCC unroll n)
#define NO_UNROLL FA_PRAGMA(GCC unroll 1)
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
/* x held in a register from here on: GCC folds a vector load that several
 * FMAs use into each of them as a memory operand, a load an FMA, so that the
 * load ports rather than the FMAs bound a register tile (rows_scores_4x2).
 * AVX2 only (unmeasured elsewhere). */
#if (defined(__x86_64__) || defined(_M_X64)) && FA_VB == 32 && defined(__GNUC__)
#define VREG(x) __asm__("" : "+x"(x))
#else
#define VREG(x) ((void)0)
#endif
INLINE void vstore(T *p, vec x) { *(vec_u *)p = x; }
typedef IT ivec_u __attribute__((vector_size(FA_VB), aligned(sizeof(IT)), may_alias));
/* K and V as stored: KT, T itself, or with FA_KV (float32 kernels only) 16-bit
 * floats widened to T as they are loaded: 1 IEEE binary16 (float16), 2
 * bfloat16.  vload_kv(p) is L elements from p as a vec; kv_s(x) one of them. */
#ifndef FA_KV
#define FA_KV 0
#endif
#if FA_KV == 0
typedef T KT;
INLINE vec vload_kv(const KT *p) { return vload(p); }
INLINE T kv_s(KT x) { return x; }
#else
_Static_assert(sizeof(T) == 4, "16-bit K and V: float32 kernels only");
typedef uint16_t KT;
#if FA_KV == 1
/* binary16 -> binary32, exactly, in integers (a flush-to-zero mode cannot
 * touch a subnormal): the exponent rebased by 127 - 15 = 112, a subnormal
 * renormalised, inf and NaN (exponent 31) with their mantissa.  The portable
 * path's; F16C and AVX-512 convert 8 or 16 at a time (vload_kv). */
INLINE T kv_s(KT h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu;
    uint32_t m = h & 0x3ffu;
    uint32_t x;
    if (e == 0x1f) {
        x = sign | 0x7f800000u | (m << 13);
    } else if (e != 0) {
        x = sign | ((e + 112) << 23) | (m << 13);
    } else if (m == 0) {
        x = sign;
    } else { /* subnormal m 2^-24: shift the leading 1 into the implicit bit */
        int sh = 0;
        while (!(m & 0x400u)) {
            m <<= 1;
            sh++;
        }
        x = sign | ((uint32_t)(113 - sh) << 23) | ((m & 0x3ffu) << 13);
    }
    T f;
    memcpy(&f, &x, sizeof f);
    return f;
}
INLINE vec vload_kv(const KT *p)
{
#if (defined(__x86_64__) || defined(_M_X64)) && FA_VB == 64
    return (vec)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif (defined(__x86_64__) || defined(_M_X64)) && FA_VB == 32
    return (vec)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); /* F16C (the AVX2 file's target) */
#else
    T b[L];
    for (int r = 0; r < L; r++) b[r] = kv_s(p[r]);
    return vload(b);
#endif
}
#else /* FA_KV == 2: bfloat16 is the upper half of a binary32 */
INLINE T kv_s(KT h)
{
    const uint32_t x = (uint32_t)h << 16;
    T f;
    memcpy(&f, &x, sizeof f);
    return f;
}
/* L 16-bit words from p, each the upper half of a 32-bit lane: one zero-extending
 * load and a shift on x86 (GCC 12 made __builtin_convertvector two 128-bit
 * halves and an insert there). */
INLINE vec vload_kv(const KT *p)
{
#if (defined(__x86_64__) || defined(_M_X64)) && FA_VB == 64
    return (vec)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif (defined(__x86_64__) || defined(_M_X64)) && FA_VB == 32
    return (vec)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    typedef uint16_t hvec_u __attribute__((vector_size(FA_VB / 2), aligned(2), may_alias));
    return (vec)(__builtin_convertvector(*(const hvec_u *)p, uvec) << 16);
#endif
}
#endif
#endif
/* dst[0..n) = src[0..n) widened (a K or V row into a float32 tile, or fa_kv_widen) */
INLINE void widen_row(T *restrict dst, const KT *restrict src, int64_t n)
{
    int64_t i = 0;
    for (; i + L <= n; i += L) vstore(dst + i, vload_kv(src + i));
    for (; i < n; i++) dst[i] = kv_s(src[i]);
}

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
/* the lanes of a comparison result as bits (lane x: bit x), read in
 * registers, not through memory, where a wide store read back a lane at a time
 * waits on the store */
INLINE uint32_t vbits(ivec m)
{
#if (defined(__x86_64__) || defined(_M_X64)) && FA_VB == 64 && FA_IS_F64
    return _mm512_test_epi64_mask((__m512i)m, (__m512i)m);
#elif (defined(__x86_64__) || defined(_M_X64)) && FA_VB == 64
    return _mm512_test_epi32_mask((__m512i)m, (__m512i)m);
#elif (defined(__x86_64__) || defined(_M_X64)) && FA_VB == 32 && FA_IS_F64
    return (uint32_t)_mm256_movemask_pd((__m256d)m);
#elif (defined(__x86_64__) || defined(_M_X64)) && FA_VB == 32
    return (uint32_t)_mm256_movemask_ps((__m256)m);
#elif (defined(__x86_64__) || defined(_M_X64)) && FA_IS_F64
    return (uint32_t)_mm_movemask_pd((__m128d)m);
#elif defined(__x86_64__) || defined(_M_X64)
    return (uint32_t)_mm_movemask_ps((__m128)m);
#else
    IT x[L];
    memcpy(x, &m, sizeof x);
    uint32_t b = 0;
    for (int i = 0; i < L; i++) b |= (uint32_t)(x[i] != 0) << i;
    return b;
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

INLINE T hsum(vec x)
{
    T t[L];
    memcpy(t, &x, sizeof t);
    T s = 0;
    for (int i = 0; i < L; i++) s += t[i];
    return s;
}

/* The horizontal sums of an R x 4 tile of vectors at once (R 3 or 4; a[3] is
 * read, and must be zeros when R is 3), AVX-512 float32:
 * s[i * ls + x] = sum of the lanes of a[i][x], i < R.  One tree for all sixteen
 * (128-bit block swaps, then in-block swaps; 45 micro-ops) in place of four
 * hsum4 trees (about 80: each hadd is three): the row kernel's score tiles end with it
 * (docs/tuning.md, hsum4x4). */
#if (defined(__x86_64__) || defined(_M_X64)) && FA_VB == 64 && !FA_IS_F64
#define FA_HSUM4X4 1
INLINE void hsum4x4(vec a[4][4], T *restrict s, int64_t ls, const int R)
{
    __m512 x[4];
    UNROLL(4) for (int k = 0; k < 4; k++)
    {
        /* rows (0, 1) and (2, 3) of key k: each folded to two blocks, side by side */
        const __m512 a0 = (__m512)a[0][k], a1 = (__m512)a[1][k], a2 = (__m512)a[2][k], a3 = (__m512)a[3][k];
        const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xee));
        const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xee));
        /* block i: row i's four partial sums of key k */
        x[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xdd));
    }
    /* in each block i: lanes (k0, k1, k0, k1) halved, then (k0, k1, k2, k3) */
    const __m512 y01 = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
    const __m512 y23 = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
    const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y01, y23, 0x44), _mm512_shuffle_ps(y01, y23, 0xee));
    _mm_storeu_ps(s, _mm512_castps512_ps128(z));
    _mm_storeu_ps(s + ls, _mm512_extractf32x4_ps(z, 1));
    _mm_storeu_ps(s + 2 * ls, _mm512_extractf32x4_ps(z, 2));
    if (R == 4) _mm_storeu_ps(s + 3 * ls, _mm512_extractf32x4_ps(z, 3));
}
#else
#define FA_HSUM4X4 0
#endif

/* The horizontal sums of four vectors: s[r] = sum of the lanes of ar.  On
 * AVX2/AVX-512 by a tree of adds and hadds (about 13 instructions for 16
 * float32 lanes, in place of 60 scalar adds): the row kernel ends every four
 * keys' dot products with one (docs/tuning.md, hsum4). */
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
