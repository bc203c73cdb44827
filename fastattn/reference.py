"""The plain NumPy reference of what fastattn computes.

Short and readable on purpose: it is the oracle of the tests, and the place to
read the semantics.  It builds the full (..., n_q, n_k) score matrix, so it is
O(n_q * n_k) in memory and slow; `fastattn.attention` computes the same thing
in O(n * d) memory with a fused streaming kernel.

Semantics shared with the fast path:

* scores = (q @ k^T) * scale, with scale = 1/sqrt(d_k) by default;
* softcap c > 0: scores -> c * tanh(scores / c);
* ALiBi: ``scores -= slope * abs(p_i - j)``, where p_i = i + kv - qn is query i's
  bottom-right aligned position, kv the number of keys (kv_lengths or n_k)
  and qn the number of real queries (q_lengths or n_q); with
  causal="upper_left", p_i = i (aligned top-left, PyTorch's is_causal);
* a bool mask keeps the scores where it is True (False -> -inf); a float mask
  is added (-inf allowed);
* visibility: key j exists iff j < kv; query i is padding iff i >= qn and
  sees nothing; causal: j <= p_i; window (left, right):
  p_i - left <= j <= p_i + right (None or negative: unbounded);
* softmax subtracts the row max (numerically stable); a row whose scores are
  all -inf (nothing visible) gives zeros and lse = -inf, never NaN;
* a key hidden from a query (score -inf) adds nothing to the query's output,
  even when its value row holds inf or NaN; a key the query sees adds its inf
  and NaN values even when its weight underflows to 0 (its true weight is
  positive);
* grouped-query attention: query head h uses key/value head h // (H // H_kv).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = ["softmax", "scores", "causal_mask", "attention", "attention_backward", "attention_varlen",
           "attention_weights", "merge_attention", "self_attention", "multihead_attention", "default_scale"]


def default_scale(d_k: int) -> float:
    """1/sqrt(d_k), the scale of "Attention Is All You Need" (1.0 when d_k == 0).

    Examples
    --------
    >>> default_scale(64)
    0.125
    """
    return 1.0 / math.sqrt(d_k) if d_k > 0 else 1.0


def _float_dtype(*arrays: Any) -> np.dtype[Any]:
    dt = np.result_type(*arrays)
    return dt if dt.kind == "f" else np.dtype(np.float64)


def softmax(x: ArrayLike, axis: Union[int, Tuple[int, ...], None] = -1) -> NDArray[Any]:
    """exp(x - max) / sum(exp(x - max)) along `axis`.

    Parameters
    ----------
    x : array_like
    axis : int, tuple of ints or None, default -1
        As in np.sum: the entries of these axes together sum to 1.

    Returns
    -------
    ndarray of x's shape, in x's float dtype (float64 for integers).  An all
    -inf slice gives zeros (not NaN); NaN propagates to its slice.

    Examples
    --------
    >>> softmax([0.0, np.log(3.0)])
    array([0.25, 0.75])
    """
    x = np.asarray(x)
    x = x.astype(_float_dtype(x), copy=False)
    m = np.max(x, axis=axis, keepdims=True, initial=-np.inf)
    m = np.where(np.isneginf(m), 0, m)  # all -inf: exp(-inf - 0) = 0
    with np.errstate(invalid="ignore"):  # inf - inf = NaN, as it should be
        e = np.exp(x - m)
    s = np.sum(e, axis=axis, keepdims=True)
    return np.where(s == 0, 0, e / np.where(s == 0, 1, s)).astype(x.dtype, copy=False)


def causal_mask(n_q: int, n_k: int) -> NDArray[np.bool_]:
    """Bool (n_q, n_k): True where query i may attend key j, j <= i + n_k - n_q.

    Examples
    --------
    >>> causal_mask(2, 3).astype(int)
    array([[1, 1, 0],
           [1, 1, 1]])
    """
    i = np.arange(n_q)[:, None]
    j = np.arange(n_k)[None, :]
    return j <= i + (n_k - n_q)


def _repeat_kv_heads(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """GQA: repeat k's head axis (-3) to q's head count (the reference may copy)."""
    H, Hkv = q.shape[-3], k.shape[-3]
    return np.repeat(k, H // Hkv, axis=-3)


def _per_lead(x: Any) -> np.ndarray:
    """An array broadcastable to the leading dims, as (..., 1, 1) for the scores."""
    return np.asarray(x)[..., None, None]


def scores(q: ArrayLike, k: ArrayLike, *, mask: Optional[ArrayLike] = None, causal: Any = False,
           scale: Optional[float] = None, enable_gqa: bool = False, window: Any = None,
           softcap: Optional[float] = None, alibi_slopes: Optional[ArrayLike] = None,
           kv_lengths: Optional[ArrayLike] = None, q_lengths: Optional[ArrayLike] = None) -> NDArray[Any]:
    """Scaled, modified, masked scores (..., n_q, n_k): the logits the softmax sees.

    Parameters
    ----------
    q : array_like, (..., n_q, d_k)
    k : array_like, (..., n_k, d_k)
    mask, causal, scale, enable_gqa, window, softcap, alibi_slopes, kv_lengths, q_lengths
        As for `fastattn.attention` (see the module docstring for the order).

    Returns
    -------
    ndarray (..., n_q, n_k), -inf where a key is not visible.

    Examples
    --------
    >>> scores(np.eye(2), np.eye(2), causal=True, scale=1.0)
    array([[  1., -inf],
           [  0.,   1.]])
    """
    q, k = np.asarray(q), np.asarray(k)
    dt = _float_dtype(q, k)
    q, k = q.astype(dt, copy=False), k.astype(dt, copy=False)
    if enable_gqa:
        k = _repeat_kv_heads(q, k)
    n_q, n_k = q.shape[-2], k.shape[-2]
    if scale is None:
        scale = default_scale(q.shape[-1])
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 is NaN, and a huge product inf, as they should be
        s = (q @ np.swapaxes(k, -1, -2)) * dt.type(scale)
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    kv = n_k if kv_lengths is None else _per_lead(kv_lengths)
    qn = n_q if q_lengths is None else _per_lead(q_lengths)
    i = np.arange(n_q)[:, None]
    j = np.arange(n_k)[None, :]
    top_left = isinstance(causal, str) and causal == "upper_left"
    p = i if top_left else i + kv - qn        # query i's position: aligned bottom-right, or top-left
    if alibi_slopes is not None:
        s = s - _per_lead(alibi_slopes).astype(dt) * np.abs(p - j)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == bool:
            s = np.where(mask, s, -np.inf)
        else:
            with np.errstate(invalid="ignore"):  # inf + -inf = NaN, as it should be
                s = s + mask.astype(dt, copy=False)
    visible = (j < kv) & (i < qn)             # padding queries (i >= qn) see nothing
    if causal:
        visible = visible & (j <= p)
    if window is not None:
        left, right = window
        if left is not None and left >= 0:     # j >= p - left, without p - left overflowing
            visible = visible & (p - j <= left)
        if right is not None and right >= 0:   # j <= p + right
            visible = visible & (j - p <= right)
    return np.where(visible, s, -np.inf).astype(dt, copy=False)


def _heads_first(layout: str, *arrays: Any) -> list[np.ndarray]:
    """The arrays as (..., H, n, d): swapped views for layout "blhd" ((..., n, H, d),
    flash-attn's and JAX's), as they are for "bhld" (the default)."""
    if str(layout).lower() not in ("bhld", "blhd"):
        raise ValueError(f'layout must be "bhld" or "blhd", got {layout!r}')
    blhd = str(layout).lower() == "blhd"
    return [np.swapaxes(np.asarray(a), -3, -2) if blhd else np.asarray(a) for a in arrays]


def attention_weights(q: ArrayLike, k: ArrayLike, **options: Any) -> NDArray[Any]:
    """``softmax(scores(q, k, **options))``: rows sum to 1, zero where nothing is visible.

    Parameters
    ----------
    q : array_like, (..., n_q, d_k) or (d_k,)
    k : array_like, (..., n_k, d_k)
    **options
        The keywords of `scores`, and layout ("blhd": q and k are (..., n, H, d)).

    Returns
    -------
    ndarray (..., n_q, n_k), or (..., n_k) for a 1-D q.

    Examples
    --------
    >>> attention_weights(np.ones(2), np.ones((4, 2)))
    array([0.25, 0.25, 0.25, 0.25])
    """
    q, k = _heads_first(options.pop("layout", "bhld"), q, k)
    if q.ndim == 1:
        mask = options.pop("mask", None)
        if mask is not None:
            options["mask"] = np.asarray(mask)[..., None, :]
        return attention_weights(q[None, :], k, **options)[..., 0, :]
    return softmax(scores(q, k, **options), axis=-1)


def _weighted_values(w: NDArray[Any], v: NDArray[Any], seen: NDArray[Any]) -> NDArray[Any]:
    """w @ v, where a key hidden from a row (seen False) adds nothing to it even
    if its value row holds inf or NaN (w @ v alone would add 0 * inf = NaN),
    and a key the row sees adds its inf and NaN even when its weight underflows
    to 0 (its true weight is positive, and inf * tiny = inf).  A row whose
    weights are NaN (a NaN score) is NaN throughout, inf values or not."""
    finite = np.isfinite(v)
    if finite.all():
        return w @ v
    out = w @ np.where(finite, v, 0)   # NaN only where the row's weights hold NaN
    seen = seen.astype(w.dtype)
    nan = (seen @ np.isnan(v) > 0) | np.isnan(out)
    pos = seen @ (v == np.inf) > 0
    neg = seen @ (v == -np.inf) > 0
    return np.where(nan | (pos & neg), np.nan, np.where(pos, np.inf, np.where(neg, -np.inf, out)))


def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, mask: Optional[ArrayLike] = None, causal: Any = False,
              scale: Optional[float] = None, return_lse: bool = False, **options: Any) -> Any:
    """softmax(q k^T * scale + mask) v.

    Parameters
    ----------
    q : array_like, (..., n_q, d_k) or (d_k,)
        A 1-D q drops the n_q axis of the result.
    k : array_like, (..., n_k, d_k)
    v : array_like, (..., n_k, d_v) or (n_k,)
        A 1-D v drops the d_v axis of the result.
    mask, causal, scale
        As for `fastattn.attention`.
    return_lse : bool
        Also return lse = log(sum(exp(scores))), shape (..., n_q).
    **options
        enable_gqa, window, softcap, alibi_slopes, kv_lengths, q_lengths (see `scores`);
        layout: "bhld" (the default) or "blhd", where q, k, v and out are (..., n, H, d)
        and the rest keeps (..., H) leading dims.

    Returns
    -------
    out : ndarray (..., n_q, d_v), leading dims broadcast; (out, lse) with return_lse.

    Examples
    --------
    >>> float(attention(np.array([1.0, 0.9]), np.array([[1.0, 1.0], [1.0, 0.8], [0.0, -1.0]]),
    ...                 np.array([10.0, 5.0, 2.0]))).__round__(3)
    7.272
    """
    layout = options.pop("layout", "bhld")
    if str(layout).lower() == "blhd":
        out, lse = attention(*_heads_first(layout, q, k, v), mask=mask, causal=causal, scale=scale,
                             return_lse=True, **options)
        return (np.swapaxes(out, -3, -2), lse) if return_lse else np.swapaxes(out, -3, -2)
    q, k, v = _heads_first(layout, q, k, v)
    dt = _float_dtype(q, k, v)
    q1, v1 = q.ndim == 1, v.ndim == 1
    if q1:
        q = q[None, :]
        if mask is not None:
            mask = np.asarray(mask)[..., None, :]
    if v1:
        v = v[:, None]
    if options.get("enable_gqa"):
        v = _repeat_kv_heads(q, v)
    s = scores(q, k, mask=mask, causal=causal, scale=scale, **options).astype(dt, copy=False)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isneginf(m), 0, m)
    with np.errstate(invalid="ignore"):
        e = np.exp(s - m)
    total = np.sum(e, axis=-1, keepdims=True)
    w = np.where(total == 0, 0, e / np.where(total == 0, 1, total))  # fully masked rows: zeros
    out = _weighted_values(w, v.astype(dt, copy=False), ~np.isneginf(s))
    with np.errstate(divide="ignore"):
        lse = (m + np.log(total))[..., 0]
    lse = np.broadcast_to(lse, out.shape[:-1]).copy()  # v's leading dims too
    if v1:
        out = out[..., 0]
    if q1:
        out = out[..., 0, :] if not v1 else out[..., 0]
        lse = lse[..., 0]
    return (out, lse) if return_lse else out


def _sum_to(g: np.ndarray, shape: Tuple[int, ...]) -> np.ndarray:
    """g summed over the leading axes that an input of `shape` was broadcast along."""
    g = g.sum(axis=tuple(range(g.ndim - len(shape)))) if g.ndim > len(shape) else g
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


def attention_backward(do: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike, out: ArrayLike,
                       lse: Optional[ArrayLike] = None, *, mask: Optional[ArrayLike] = None, causal: Any = False,
                       scale: Optional[float] = None,
                       **options: Any) -> Tuple[NDArray[Any], NDArray[Any], NDArray[Any]]:
    """The gradients (dq, dk, dv) of sum(do * attention(q, k, v, ...)): the materialised formula.

    With P the attention weights and D = rowsum(do * out):
    dv = P^T do, dS = P * (do v^T - D), dq = dS k * scale, dk = dS^T q * scale,
    and dS times 1 - tanh(s / softcap)^2 through a softcap.

    Parameters
    ----------
    do : array_like
        The gradient of the output: the output's shape.
    q, k, v, mask, causal, scale, **options
        As for `attention` (layout "blhd": do and out are (..., n, H, d) too).
    out : array_like
        The output of ``attention(q, k, v, ...)``.
    lse : array_like, optional
        Not needed here (accepted as `fastattn.attention_backward` takes it).

    Returns
    -------
    (dq, dk, dv), each of its input's shape (summed over the axes it was broadcast
    along, and over each group's query heads with enable_gqa), in the result dtype.

    Examples
    --------
    >>> q, k, v = np.eye(2), np.eye(2), np.array([[1.0], [3.0]])
    >>> out = attention(q, k, v, scale=1.0)
    >>> [g.round(3).tolist() for g in attention_backward(np.ones_like(out), q, k, v, out, scale=1.0)]
    [[[-0.393, 0.393], [-0.393, 0.393]], [[-0.393, -0.393], [0.393, 0.393]], [[1.0], [1.0]]]
    """
    layout = options.pop("layout", "bhld")
    q_in, k_in, v_in = (np.asarray(a) for a in (q, k, v))
    q, k, v, do, out = _heads_first(layout, q, k, v, do, out)
    dt = _float_dtype(q, k, v)
    q1, v1 = q.ndim == 1, v.ndim == 1
    if v1:
        v, do, out = v[:, None], do[..., None], out[..., None]
    if q1:
        q, do, out = q[None, :], do[..., None, :], out[..., None, :]
        if mask is not None:
            mask = np.asarray(mask)[..., None, :]
    q, k, v, do, out = (a.astype(dt, copy=False) for a in (q, k, v, do, out))
    gqa = options.get("enable_gqa")
    kk, vv = (_repeat_kv_heads(q, k), _repeat_kv_heads(q, v)) if gqa else (k, v)
    if scale is None:
        scale = default_scale(q.shape[-1])
    w = attention_weights(q, k, mask=mask, causal=causal, scale=scale, **options)
    dv = np.swapaxes(w, -1, -2) @ do
    with np.errstate(invalid="ignore"):   # a hidden key (weight 0) adds nothing, even with inf or NaN
        ds = np.where(w == 0, 0, w * (do @ np.swapaxes(vv, -1, -2) - np.sum(do * out, axis=-1, keepdims=True)))
    kk = np.where(np.isfinite(kk), kk, 0)   # (where a row's weights are NaN, its ds is NaN already)
    if options.get("softcap") is not None:   # s = c tanh(x / c): ds/dx = 1 - (s / c)^2
        t = np.tanh((q @ np.swapaxes(kk, -1, -2)) * dt.type(scale) / options["softcap"])
        ds = ds * (1 - t * t)
    dq = (ds @ kk) * dt.type(scale)
    dk = (np.swapaxes(ds, -1, -2) @ q) * dt.type(scale)
    if gqa:   # each key/value head: the sum over its group's query heads
        H, Hkv = q.shape[-3], k.shape[-3]
        dk = dk.reshape(dk.shape[:-3] + (Hkv, H // Hkv) + dk.shape[-2:]).sum(-3)
        dv = dv.reshape(dv.shape[:-3] + (Hkv, H // Hkv) + dv.shape[-2:]).sum(-3)
    dq, dk, dv = _sum_to(dq, q.shape), _sum_to(dk, k.shape), _sum_to(dv, v.shape)
    blhd = str(layout).lower() == "blhd"
    grads = []
    for g, a in ((dq, q_in), (dk, k_in), (dv, v_in)):
        g = np.swapaxes(g, -3, -2) if blhd else g
        grads.append(g.reshape(a.shape).astype(dt, copy=False))
    return grads[0], grads[1], grads[2]


def attention_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike, *,
                     causal: Any = False, scale: Optional[float] = None, return_lse: bool = False,
                     alibi_slopes: Optional[ArrayLike] = None, **options: Any) -> Any:
    """Packed sequences: sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q
    and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k and v, attended on its own.

    Parameters
    ----------
    q : array_like, (total_q, H, d_k);  k : (total_k, H_kv, d_k);  v : (total_k, H_kv, d_v)
        H a multiple of H_kv (grouped-query attention when larger).
    cu_seqlens_q, cu_seqlens_k : array_like of int, (B + 1,)
        Each sequence's first row, and the total last.
    causal, scale, return_lse
        As for `attention`, per sequence (causal aligned at each one's ends).
    alibi_slopes : array_like, optional
        Broadcastable to (B, H).
    **options
        window, softcap (see `scores`).

    Returns
    -------
    out : ndarray (total_q, H, d_v); (out, lse) with return_lse, lse (H, total_q).

    Examples
    --------
    >>> q = k = v = np.eye(3)[:, None, :]                  # two sequences: rows 0-1 and 2
    >>> attention_varlen(q, k, v, [0, 2, 3], [0, 2, 3], causal=True)[:, 0].round(2)
    array([[1.  , 0.  , 0.  ],
           [0.36, 0.64, 0.  ],
           [0.  , 0.  , 1.  ]])
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    dt = _float_dtype(q, k, v)
    cq, ck = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
    H, Hkv = q.shape[1], k.shape[1]
    out = np.zeros((q.shape[0], H, v.shape[2]), dt)
    lse = np.full((H, q.shape[0]), -np.inf, dt)
    for b in range(len(cq) - 1):
        rows, keys = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        slopes = None if alibi_slopes is None else np.broadcast_to(alibi_slopes, (len(cq) - 1, H))[b]
        o, x = attention(np.swapaxes(q[rows], 0, 1), np.swapaxes(k[keys], 0, 1), np.swapaxes(v[keys], 0, 1),
                         causal=causal, scale=scale, return_lse=True, enable_gqa=H != Hkv,
                         alibi_slopes=slopes, **options)
        out[rows], lse[:, rows] = np.swapaxes(o, 0, 1), x
    return (out, lse) if return_lse else out


def merge_attention(outs: Sequence[ArrayLike], lses: Sequence[ArrayLike],
                    layout: str = "bhld") -> tuple[NDArray[Any], NDArray[Any]]:
    """Attention over the union of disjoint key sets from the parts' (out, lse).

    Parameters
    ----------
    outs : sequence of array_like, each (..., n_q, d_v); (..., n_q, H, d_v) with layout "blhd"
    lses : sequence of array_like, each (..., n_q); (..., H, n_q) with layout "blhd"

    Returns
    -------
    (out, lse): lse = log(sum_p exp(lse_p)), out = sum_p exp(lse_p - lse) out_p;
    parts with lse = -inf add nothing.

    Examples
    --------
    >>> merge_attention([np.ones((1, 2)), np.zeros((1, 2))], [np.zeros(1), np.zeros(1)])[0]
    array([[0.5, 0.5]])
    """
    part_lses = [np.asarray(x, dtype=np.float64) for x in lses]
    parts = [np.asarray(o, dtype=np.float64) for o in _heads_first(layout, *outs)]
    with np.errstate(divide="ignore"):
        lse = np.log(np.sum([np.exp(x) for x in part_lses], axis=0))  # fine for the moderate lse of the tests
    out = np.zeros_like(parts[0])
    for o, x in zip(parts, part_lses):
        wgt = np.where(np.isneginf(x), 0.0, np.exp(x - np.where(np.isneginf(lse), 0, lse)))
        out += np.where(wgt[..., None] > 0, wgt[..., None] * o, 0)
    return _heads_first(layout, out)[0], lse


def _plus(t: Any, b: Any) -> Any:
    return t if b is None else t + np.asarray(b)


def self_attention(x: ArrayLike, w_q: Any, w_k: Any, w_v: Any, *, b_q: Any = None, b_k: Any = None,
                   b_v: Any = None, mask: Optional[ArrayLike] = None, causal: Any = False,
                   scale: Optional[float] = None, seq_lengths: Optional[ArrayLike] = None) -> Any:
    """attention(x W_Q + b_Q, x W_K + b_K, x W_V + b_V).

    Parameters
    ----------
    x : array_like, (..., n, d_model)
    w_q, w_k : (d_model, d_k);  w_v : (d_model, d_v)
    b_q, b_k : (d_k,);  b_v : (d_v,);  optional biases
    mask, causal, scale
        As for `fastattn.attention`.
    seq_lengths : array_like of int, optional
        Per leading index: q_lengths = kv_lengths (a right-padded batch).

    Returns
    -------
    ndarray (..., n, d_v)

    Examples
    --------
    >>> self_attention(np.eye(3), np.eye(3), np.eye(3), np.eye(3), causal=True)[0]
    array([1., 0., 0.])
    """
    x = np.asarray(x)
    return attention(_plus(x @ w_q, b_q), _plus(x @ w_k, b_k), _plus(x @ w_v, b_v), mask=mask, causal=causal,
                     scale=scale, q_lengths=seq_lengths, kv_lengths=seq_lengths)


def multihead_attention(x: ArrayLike, w_q: Any, w_k: Any, w_v: Any, w_o: Any, *, num_heads: int,
                        num_kv_heads: Optional[int] = None, b_q: Any = None, b_k: Any = None, b_v: Any = None,
                        b_o: Any = None, mask: Optional[ArrayLike] = None, causal: Any = False,
                        scale: Optional[float] = None, seq_lengths: Optional[ArrayLike] = None) -> Any:
    """concat over heads h of attention(x W_Q[:, h] + b_Q[h], x W_K[:, g(h)] + b_K[g(h)],
    x W_V[:, g(h)] + b_V[g(h)]) @ W_O + b_O.

    Head h takes columns h*d_head:(h+1)*d_head and g(h) = h // (H // H_kv).

    Parameters
    ----------
    x : array_like, (..., n, d_model)
    w_q : (d_model, H * d_head);  w_k, w_v : (d_model, H_kv * d_head);  w_o : (H * d_head, d_model)
    b_q, b_k, b_v, b_o : optional biases, one entry per column of w_q, w_k, w_v, w_o
    num_heads, num_kv_heads : int
    mask, causal, scale
        As for `fastattn.attention`; the mask broadcasts to (..., H, n, n).
    seq_lengths : array_like of int, optional
        As for `self_attention`, the same for every head; padding tokens give
        zeros (without b_O).

    Returns
    -------
    ndarray (..., n, d_model)

    Examples
    --------
    >>> multihead_attention(np.eye(4), *(np.eye(4) for _ in range(4)), num_heads=2).shape
    (4, 4)
    """
    x = np.asarray(x)
    H = num_heads
    Hkv = num_kv_heads or H
    d_head = np.shape(w_q)[1] // H
    heads = []
    bias = lambda b, cols: None if b is None else np.asarray(b)[cols]  # noqa: E731  (a head's columns)
    for h in range(H):
        g = h // (H // Hkv)
        cols_q = slice(h * d_head, (h + 1) * d_head)
        cols_kv = slice(g * d_head, (g + 1) * d_head)
        m = None
        if mask is not None:
            m = np.asarray(mask)
            if m.ndim >= 3:
                m = m[..., h if m.shape[-3] > 1 else 0, :, :]
        qh = _plus(x @ w_q[:, cols_q], bias(b_q, cols_q))
        kh = _plus(x @ w_k[:, cols_kv], bias(b_k, cols_kv))
        vh = _plus(x @ w_v[:, cols_kv], bias(b_v, cols_kv))
        heads.append(attention(qh, kh, vh, mask=m, causal=causal, scale=scale,
                               q_lengths=seq_lengths, kv_lengths=seq_lengths))
    out = _plus(np.concatenate(heads, axis=-1) @ w_o, b_o)
    if seq_lengths is not None:   # padding tokens: zeros
        real = np.arange(x.shape[-2]) < np.asarray(seq_lengths)[..., None]
        out = np.where(real[..., None], out, 0)
    return out
