/*
 * The attention and softmax kernels, written once with GCC/Clang vector
 * extensions and compiled once per (dtype, ISA) by kernels_<dtype>_<isa>.c,
 * which define before including this file:
 *
 *   FA_T     float or double          FA_IT   int32_t or int64_t (same width)
 *   FA_UT    the unsigned twin of FA_IT
 *   FA_SUF   f32 or f64               FA_ISA  generic, avx2 or avx512
 *   FA_VB    vector bytes: 16 (SSE2/NEON), 32 (AVX2) or 64 (AVX-512)
 *   FA_IS_F64  0 or 1
 *   FA_KV    (optional) K and V stored as 1 float16 or 2 bfloat16, widened
 *            as they are loaded (simd.h: KT, vload_kv; the tiled kernel into
 *            rows kept in its scratch: kv_rows_widened), float32 only
 *            (kernels_h16_<isa>.c, kernels_b16_<isa>.c; the backward pass: each
 *            unit's rows widened once into its scratch); not the softmax
 *
 * The AVX2 file sets `#pragma GCC target("avx2,fma")` first, so the same code
 * becomes 256-bit AVX2 with FMA there; the AVX-512 files make it 512-bit code
 * (32 registers); elsewhere it stays baseline code.
 *
 * Layout idea.  A work item is bq query rows of one leading index.  Its queries
 * are packed once, scaled and transposed, into Qt (dk, bqp).  Scores of a key
 * tile are computed transposed, St (bk, bqp) = K_tile . Qt, so that every
 * softmax step (row max, exp, row sum, rescale) is a plain vertical SIMD
 * operation across query rows, and the products read K and V rows in place as
 * scalar broadcasts: no packing of K or V, any row stride, no horizontal sums.
 * The output accumulator is kept transposed too, Ot (dv, bqp), and is turned
 * back and normalised once at the end (FlashAttention-2 loop order); an item
 * of a single query vector on AVX2 keeps it in rows instead (PV_ROWS, tiled.h).
 *
 * The comments give shapes, invariants and, for each tuning constant or
 * choice, its reason in a line; the measurements behind them are in
 * docs/tuning.md, under the constant's or function's name.
 */
/*
 * The parts, by role (each a header of src_c/kernel/, in this order):
 *   simd.h            vector types and operations, target pragmas
 *   vmath.h           exp, tanh
 *   online_softmax.h  the online softmax step every kernel takes
 *   prefetch.h        software prefetch of the rows read next
 *   masks.h           bool and float masks, causal and window bands
 *   epilogue.h        write-out, split merge, careful redo of non-finite rows
 *   tiled.h           the tiled kernel and the attention-weights kernel
 *   rows.h            the row kernel (few query rows, decoding)
 *   group.h           the row kernel over interleaved heads
 *   softmax_row.h     fastattn.softmax
 *   backward.h        the backward pass (fastattn.attention_backward)
 */
#include "kernel/simd.h"
#include "kernel/vmath.h"
#include "kernel/online_softmax.h"
#include "kernel/prefetch.h"
#include "kernel/masks.h"
#include "kernel/epilogue.h"
#include "kernel/tiled.h"
#include "kernel/rows.h"
#include "kernel/group.h"
#if !FA_KV
#include "kernel/softmax_row.h"
#endif
#include "kernel/backward.h"

#if FA_KV
/* fa_kv_widen_fn: 16-bit floats to float32 (the Python layer's conversions) */
void FN(fa_kv_widen)(const void *src, float *dst, int64_t n) { widen_row(dst, src, n); }
#endif

#if defined(FA_TARGET) && defined(__clang__)
#pragma clang attribute pop
#endif
