/* kernel_body.h for float with AVX2 and FMA, 32-byte vectors.  Only the
 * functions of this file are compiled for AVX2 (the build has no -march flag);
 * dispatch.c calls them only after CPUID reports AVX2, FMA and F16C.  No static
 * initialisers here: they would run at load time on any CPU. */
#if defined(__x86_64__) || defined(_M_X64)
#define FA_TARGET "avx2,fma,f16c" /* F16C: the float16 K and V build of this file */
#define FA_T float
#define FA_IT int32_t
#define FA_UT uint32_t
#ifndef FA_SUF /* kernels_h16_*.c, kernels_b16_*.c: f32 over 16-bit K and V */
#define FA_SUF f32
#endif
#define FA_ISA avx2
#define FA_VB 32
#define FA_IS_F64 0
#include "kernel_body.h"
#else
typedef int fa_no_avx2_on_this_arch;
#endif
