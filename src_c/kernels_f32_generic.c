/* kernel_body.h for float on the portable path: baseline ISA only (SSE2 on
 * x86-64, NEON on aarch64), 16-byte vectors.  Chosen when the CPU lacks AVX2
 * or FMA, or when FASTATTN_ISA=generic. */
#define FA_T float
#define FA_IT int32_t
#define FA_UT uint32_t
#ifndef FA_SUF /* kernels_h16_*.c, kernels_b16_*.c: f32 over 16-bit K and V */
#define FA_SUF f32
#endif
#define FA_ISA generic
#define FA_VB 16
#define FA_IS_F64 0
#include "kernel_body.h"
