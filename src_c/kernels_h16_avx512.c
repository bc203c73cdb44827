/* kernels_f32_avx512.c with K and V stored as float16 (IEEE binary16), widened to float32 as
 * they are read (FA_KV 1: every kernel but the softmax and the backward pass). */
#define FA_KV 1
#define FA_SUF h16
#include "kernels_f32_avx512.c"
