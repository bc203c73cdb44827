/* kernel_body.h for float with K and V stored as float16 (IEEE binary16) (FA_KV 1: every
 * kernel but the softmax and the backward pass) with AVX2 and FMA, 32-byte vectors.  Only the
 * functions of this file are compiled for AVX2 (the build has no -march flag);
 * dispatch.c calls them only after CPUID reports AVX2, FMA and F16C.  No static
 * initialisers here: they would run at load time on any CPU. */
#if defined(__x86_64__) || defined(_M_X64)
#define FA_TARGET "avx2,fma,f16c"
#define FA_T float
#define FA_IT int32_t
#define FA_UT uint32_t
#define FA_SUF h16
#define FA_KV 1
#define FA_ISA avx2
#define FA_VB 32
#define FA_IS_F64 0
#include "kernel_body.h"
#else
typedef int fa_no_avx2_on_this_arch;
#endif
