/* kernel_body.h for double with AVX2 and FMA, 32-byte vectors.  Only the
 * functions of this file are compiled for AVX2 (the build has no -march flag);
 * dispatch.c calls them only after CPUID reports both AVX2 and FMA.  No static
 * initialisers here: they would run at load time on any CPU. */
#if defined(__x86_64__) || defined(_M_X64)
#define FA_TARGET "avx2,fma"
#define FA_T double
#define FA_IT int64_t
#define FA_UT uint64_t
#define FA_SUF f64
#define FA_ISA avx2
#define FA_VB 32
#define FA_IS_F64 1
#include "kernel_body.h"
#else
typedef int fa_no_avx2_on_this_arch;
#endif
