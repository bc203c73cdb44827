"""Self-attention and multi-head attention layers on top of fastattn.attention.

The classic formulation: token vectors x are projected into queries, keys and
values by W_Q, W_K, W_V; each output is a weighted sum of the values; a causal
mask stops a token from seeing later ones; several heads run side by side and
their outputs are combined by W_O.  The projections are NumPy matrix products
(BLAS); the attention is the fused C kernel, reading the heads through
strides (no copy into a per-head layout).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._attention import attention
from ._validate import Causal, _as_array, _broadcast_shapes, _int_or_none, _lengths

__all__ = ["self_attention", "multihead_attention"]


def _weight(w: Any, name: str, rows: Optional[int] = None, cols: Optional[int] = None) -> np.ndarray:
    w = _as_array(w, name)
    if w.ndim != 2:
        raise ValueError(f"{name} must be a 2-D matrix, got shape {w.shape}")
    if rows is not None and w.shape[0] != rows:
        raise ValueError(f"{name} has {w.shape[0]} rows; it must have d_model = {rows} (shape {w.shape})")
    if cols is not None and w.shape[1] != cols:
        raise ValueError(f"{name} has {w.shape[1]} columns; it must have {cols} (shape {w.shape})")
    return w


def _bias(b: Any, name: str, size: int, of: str) -> Optional[np.ndarray]:
    """An optional bias: None, or a 1-D array of `size` entries (the columns of `of`)."""
    if b is None:
        return None
    b = _as_array(b, name)
    if b.shape != (size,):
        raise ValueError(f"{name} has shape {b.shape}; it must be ({size},), as {of} has {size} columns")
    return b


def _project(x: np.ndarray, w: np.ndarray, b: Optional[np.ndarray]) -> np.ndarray:
    """x @ w (+ b)."""
    t = x @ w
    return t if b is None else t + b


def _tokens(x: Any) -> np.ndarray:
    x = _as_array(x, "x")
    if x.ndim < 2:
        raise ValueError(f"x must have shape (..., n, d_model), got shape {x.shape}")
    return x


def _seq_lengths(seq_lengths: Any, x: np.ndarray) -> Optional[np.ndarray]:
    """seq_lengths as int64 (None stays None), checked: integers in [0, n] that
    broadcast to x's leading dims."""
    a = _lengths(seq_lengths, "seq_lengths", "n", x.shape[-2])
    if a is None:
        return None
    lead = x.shape[:-2]
    try:
        ok = _broadcast_shapes(a.shape, lead) == lead
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"seq_lengths of shape {a.shape} does not broadcast to x's leading dims {lead}")
    return a


def self_attention(x: ArrayLike, w_q: ArrayLike, w_k: ArrayLike, w_v: ArrayLike, *,
                   b_q: Optional[ArrayLike] = None, b_k: Optional[ArrayLike] = None,
                   b_v: Optional[ArrayLike] = None, mask: Optional[ArrayLike] = None, causal: Causal = False,
                   scale: Optional[float] = None, seq_lengths: Optional[ArrayLike] = None,
                   num_threads: Optional[int] = None) -> NDArray[Any]:
    """Single-head self-attention: attention(x W_Q + b_Q, x W_K + b_K, x W_V + b_V).

    Parameters
    ----------
    x : array_like, shape (..., n, d_model)
        Token vectors.
    w_q, w_k : array_like, shape (d_model, d_k)
    w_v : array_like, shape (d_model, d_v)
    b_q, b_k : array_like, shape (d_k,), optional
    b_v : array_like, shape (d_v,), optional
        Biases of the projections (None: none).
    mask, causal, scale
        As for `fastattn.attention` (causal: a token sees itself and earlier ones).
    seq_lengths : array_like of int, optional
        Broadcastable to x's leading dims (...), in [0, n]: a right-padded
        batch, only the first seq_lengths[...] tokens of each sequence real.
        Tokens attend only to real ones, and padding tokens give zeros
        (fastattn.attention's q_lengths and kv_lengths).
    num_threads : int, optional
        Threads for the attention, as for `fastattn.attention` (the
        projections are NumPy's products, on BLAS's threads).

    Returns
    -------
    ndarray, shape (..., n, d_v)

    Examples
    --------
    >>> import numpy as np, fastattn
    >>> x = np.random.default_rng(0).standard_normal((3, 4))       # "I am hungry", d_model 4
    >>> w = np.eye(4)
    >>> fastattn.self_attention(x, w, w, w, causal=True).shape
    (3, 4)
    """
    x = _tokens(x)
    d_model = x.shape[-1]
    w_q = _weight(w_q, "w_q", d_model)
    w_k = _weight(w_k, "w_k", d_model, w_q.shape[1])
    w_v = _weight(w_v, "w_v", d_model)
    b_q = _bias(b_q, "b_q", w_q.shape[1], "w_q")
    b_k = _bias(b_k, "b_k", w_k.shape[1], "w_k")
    b_v = _bias(b_v, "b_v", w_v.shape[1], "w_v")
    lengths = _seq_lengths(seq_lengths, x)
    return attention(_project(x, w_q, b_q), _project(x, w_k, b_k), _project(x, w_v, b_v), mask=mask,
                     causal=causal, scale=scale, q_lengths=lengths, kv_lengths=lengths, num_threads=num_threads)


def multihead_attention(x: ArrayLike, w_q: ArrayLike, w_k: ArrayLike, w_v: ArrayLike, w_o: ArrayLike, *,
                        num_heads: int, num_kv_heads: Optional[int] = None, b_q: Optional[ArrayLike] = None,
                        b_k: Optional[ArrayLike] = None, b_v: Optional[ArrayLike] = None,
                        b_o: Optional[ArrayLike] = None, mask: Optional[ArrayLike] = None,
                        causal: Causal = False, scale: Optional[float] = None,
                        seq_lengths: Optional[ArrayLike] = None, num_threads: Optional[int] = None) -> NDArray[Any]:
    """Multi-head self-attention with an output projection.

    Parameters
    ----------
    x : array_like, shape (..., n, d_model)
    w_q : array_like, shape (d_model, num_heads * d_head)
    w_k, w_v : array_like, shape (d_model, num_kv_heads * d_head)
    w_o : array_like, shape (num_heads * d_head, d_model)
    b_q, b_k, b_v, b_o : array_like, optional
        Biases of the projections (None: none), one entry per column of the
        matching weight: as PyTorch's in_proj_bias (split in three) and
        out_proj.bias, and the attention layers of BERT, GPT-2 and ViT.
    num_heads : int
        Head h uses columns h * d_head to (h + 1) * d_head of the projections.
    num_kv_heads : int, optional
        Key/value heads (default num_heads).  Fewer than num_heads, dividing
        it, is grouped-query attention (1: multi-query).
    mask : array_like, optional
        bool or float, broadcastable to (..., num_heads, n, n).
    causal, scale
        As for `fastattn.attention`; scale defaults to 1/sqrt(d_head).
    seq_lengths : array_like of int, optional
        Broadcastable to x's leading dims (...), in [0, n]: as for
        `self_attention`; padding tokens give zeros (b_o too is left out).
    num_threads : int, optional
        As for `self_attention`.

    Returns
    -------
    ndarray, shape (..., n, d_model)
        concat_h(attention_h) @ w_o + b_o.

    Examples
    --------
    >>> import numpy as np, fastattn
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((2, 5, 8))
    >>> wq, wk, wv, wo = (rng.standard_normal((8, 8)) for _ in range(4))
    >>> fastattn.multihead_attention(x, wq, wk, wv, wo, num_heads=2, causal=True).shape
    (2, 5, 8)
    """
    x = _tokens(x)
    d_model = x.shape[-1]
    H = _int_or_none(num_heads, "num_heads must be an int")
    if H is None:
        raise TypeError("num_heads must be an int, got None")
    Hkv = _int_or_none(num_kv_heads, "num_kv_heads must be None or an int")
    Hkv = H if Hkv is None else Hkv
    if H <= 0 or Hkv <= 0:
        raise ValueError(f"num_heads ({H}) and num_kv_heads ({Hkv}) must be positive")
    if H % Hkv:
        raise ValueError(f"num_heads ({H}) must be a multiple of num_kv_heads ({Hkv})")
    w_q = _weight(w_q, "w_q", d_model)
    if w_q.shape[1] % H:
        raise ValueError(f"w_q has {w_q.shape[1]} columns, not a multiple of num_heads = {H}")
    d_head = w_q.shape[1] // H
    w_k = _weight(w_k, "w_k", d_model, Hkv * d_head)
    w_v = _weight(w_v, "w_v", d_model, Hkv * d_head)
    w_o = _weight(w_o, "w_o", H * d_head, d_model)
    b_q = _bias(b_q, "b_q", H * d_head, "w_q")
    b_k = _bias(b_k, "b_k", Hkv * d_head, "w_k")
    b_v = _bias(b_v, "b_v", Hkv * d_head, "w_v")
    b_o = _bias(b_o, "b_o", d_model, "w_o")

    lead, n = x.shape[:-2], x.shape[-2]

    def heads(t, h):  # (..., n, h * d_head) -> (..., h, n, d_head), a view
        return np.swapaxes(t.reshape(lead + (n, h, d_head)), -2, -3)

    q, k, v = heads(_project(x, w_q, b_q), H), heads(_project(x, w_k, b_k), Hkv), heads(_project(x, w_v, b_v), Hkv)
    dtype = np.result_type(q, k, v)
    dtype = dtype if dtype.kind == "f" else np.dtype(np.float64)
    lengths = _seq_lengths(seq_lengths, x)
    if lengths is not None:
        lengths = lengths[..., None]                                 # (..., 1): the same for every head
    concat = np.empty(lead + (n, H * d_head), dtype)                 # (..., n, H * d_head)
    attention(q, k, v, mask=mask, causal=causal, scale=scale, enable_gqa=Hkv < H,
              q_lengths=lengths, kv_lengths=lengths, out=heads(concat, H), num_threads=num_threads)   # through strides
    out = _project(concat, w_o, b_o)
    if b_o is not None and lengths is not None:                      # padding tokens stay zeros
        np.copyto(out, 0, where=(np.arange(n) >= lengths)[..., None])
    return out
