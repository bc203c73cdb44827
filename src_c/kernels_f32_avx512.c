/* kernel_body.h for float with AVX-512 (F, DQ, BW, VL), 64-byte vectors.  Only
 * the functions of this file are compiled for AVX-512 (the build has no -march
 * flag); dispatch.c calls them only after CPUID reports those four extensions
 * and the OS saves the ZMM and mask registers.  No static initialisers here:
 * they would run at load time on any CPU.  -DFA_NO_AVX512 leaves them out (CI's
 * sanitizer build on a CPU that cannot run them: its slowest files). */
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(FA_NO_AVX512)
#define FA_TARGET "avx512f,avx512dq,avx512bw,avx512vl,avx2,fma"
#define FA_T float
#define FA_IT int32_t
#define FA_UT uint32_t
#ifndef FA_SUF /* kernels_h16_*.c, kernels_b16_*.c: f32 over 16-bit K and V */
#define FA_SUF f32
#endif
#define FA_ISA avx512
#define FA_VB 64
#define FA_IS_F64 0
#include "kernel_body.h"
#else
typedef int fa_no_avx512_on_this_arch;
#endif
