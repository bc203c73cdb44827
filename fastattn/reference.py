"""The plain NumPy reference of what fastattn computes.

Short and readable on purpose: it is the oracle of the tests, and the place to
read the semantics.  It builds the full (..., n_q, n_k) score matrix, so it is
O(n_q * n_k) in memory and slow; `fastattn.attention` computes the same thing
in O(n * d) memory with a fused streaming kernel.

Semantics shared with the fast path:

* scores = (q @ k^T) * scale, with scale = 1/sqrt(d_k) by default;
* a bool mask keeps the scores where it is True (False -> -inf); a float mask
  is added to the scaled scores (-inf allowed);
* causal: query i may attend key j iff j <= i + (n_k - n_q), i.e. aligned
  bottom-right (FlashAttention >= 2.1; the same as PyTorch's top-left when
  n_q == n_k);
* softmax subtracts the row max (numerically stable); a row whose scores are
  all -inf (fully masked, or n_k == 0) gives zeros and lse = -inf, never NaN;
* NaN in a score that takes part reaches that row's output.
"""

import math

import numpy as np

__all__ = ["softmax", "scores", "causal_mask", "attention", "default_scale"]


def default_scale(d_k):
    """1/sqrt(d_k), the scale of "Attention Is All You Need" (1.0 when d_k == 0)."""
    return 1.0 / math.sqrt(d_k) if d_k > 0 else 1.0


def _float_dtype(*arrays):
    dt = np.result_type(*arrays)
    return dt if dt.kind == "f" else np.dtype(np.float64)


def softmax(x, axis=-1):
    """exp(x - max) / sum(exp(x - max)) along `axis`.

    An all -inf slice gives zeros (not NaN); NaN propagates to its slice.
    """
    x = np.asarray(x)
    x = x.astype(_float_dtype(x), copy=False)
    m = np.max(x, axis=axis, keepdims=True, initial=-np.inf)
    m = np.where(np.isneginf(m), 0, m)  # all -inf: exp(-inf - 0) = 0
    with np.errstate(invalid="ignore"):  # inf - inf = NaN, as it should be
        e = np.exp(x - m)
    s = np.sum(e, axis=axis, keepdims=True)
    return np.where(s == 0, 0, e / np.where(s == 0, 1, s)).astype(x.dtype, copy=False)


def scores(q, k, *, mask=None, causal=False, scale=None):
    """Scaled, masked scores (..., n_q, n_k): the logits the softmax sees."""
    q, k = np.asarray(q), np.asarray(k)
    dt = _float_dtype(q, k)
    q, k = q.astype(dt, copy=False), k.astype(dt, copy=False)
    if scale is None:
        scale = default_scale(q.shape[-1])
    s = (q @ np.swapaxes(k, -1, -2)) * dt.type(scale)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == bool:
            s = np.where(mask, s, -np.inf)
        else:
            s = s + mask.astype(dt, copy=False)
    if causal:
        s = np.where(causal_mask(q.shape[-2], k.shape[-2]), s, -np.inf)
    return s


def causal_mask(n_q, n_k):
    """Bool (n_q, n_k): True where query i may attend key j, j <= i + n_k - n_q."""
    i = np.arange(n_q)[:, None]
    j = np.arange(n_k)[None, :]
    return j <= i + (n_k - n_q)


def attention(q, k, v, *, mask=None, causal=False, scale=None, return_lse=False):
    """softmax(q k^T * scale + mask) v.

    q (..., n_q, d_k), k (..., n_k, d_k), v (..., n_k, d_v) -> (..., n_q, d_v);
    leading dims broadcast.  A 1-D q (d_k,) drops the n_q axis of the result,
    a 1-D v (n_k,) the d_v axis.  With return_lse, also
    lse = log(sum(exp(scores))) of shape (..., n_q).
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    dt = _float_dtype(q, k, v)
    q1, v1 = q.ndim == 1, v.ndim == 1
    if q1:
        q = q[None, :]
        if mask is not None:
            mask = np.asarray(mask)[..., None, :]
    if v1:
        v = v[:, None]
    s = scores(q, k, mask=mask, causal=causal, scale=scale).astype(dt, copy=False)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isneginf(m), 0, m)
    with np.errstate(invalid="ignore"):
        e = np.exp(s - m)
    l = np.sum(e, axis=-1, keepdims=True)
    w = np.where(l == 0, 0, e / np.where(l == 0, 1, l))  # fully masked rows: zeros
    out = w @ v.astype(dt, copy=False)
    with np.errstate(divide="ignore"):
        lse = (m + np.log(l))[..., 0]
    lse = np.broadcast_to(lse, out.shape[:-1]).copy()  # v's leading dims too
    if v1:
        out = out[..., 0]
    if q1:
        out = out[..., 0, :] if not v1 else out[..., 0]
        lse = lse[..., 0]
    return (out, lse) if return_lse else out
