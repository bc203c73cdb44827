/* kernels_f32_avx2.c with K and V stored as bfloat16, widened to float32 as
 * they are read (FA_KV 2: every kernel but the softmax and the backward pass). */
#define FA_KV 2
#define FA_SUF b16
#include "kernels_f32_avx2.c"
