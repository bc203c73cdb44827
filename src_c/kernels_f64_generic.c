/* kernel_body.h for double on the portable path: baseline ISA only (SSE2 on
 * x86-64, NEON on aarch64), 16-byte vectors.  Chosen when the CPU lacks AVX2
 * or FMA, or when FASTATTN_ISA=generic. */
#define FA_T double
#define FA_IT int64_t
#define FA_UT uint64_t
#define FA_SUF f64
#define FA_ISA generic
#define FA_VB 16
#define FA_IS_F64 1
#include "kernel_body.h"
