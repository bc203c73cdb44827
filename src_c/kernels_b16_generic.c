/* kernel_body.h for float with K and V stored as bfloat16 (FA_KV 2: every
 * kernel but the softmax and the backward pass) on the portable path: baseline ISA only (SSE2 on
 * x86-64, NEON on aarch64), 16-byte vectors.  Chosen when the CPU lacks AVX2
 * or FMA, or when FASTATTN_ISA=generic. */
#define FA_T float
#define FA_IT int32_t
#define FA_UT uint32_t
#define FA_SUF b16
#define FA_KV 2
#define FA_ISA generic
#define FA_VB 16
#define FA_IS_F64 0
#include "kernel_body.h"
