"""fastattn.attention and fastattn.attention_weights.

attention takes the plain path where it can (_plain: three C-contiguous float32 or
float64 arrays of one dtype, or float32 q with 16-bit k and v, a mask the C core
reads as it is, no options beyond causal, scale, num_threads and out=: straight to
the C core, the overhead-sensitive call; _plain_gqa: the same for grouped-query
decoding, a group's heads folded into one item's rows; both in layout "blhd" too,
through the arrays' (..., H, n, d) views); otherwise _prepare (in _prepare.py)
checks and converts the arguments and _call hands them to the C core, folding a GQA group's query heads
into the rows of one work item when decoding.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Literal, Optional, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

from . import _core, _float_mask
from ._float_mask import _fill_pad_rows, _may_pay
from ._prepare import _prepare, _Prepared
from ._validate import (
    _BOOL,
    _F32,
    _F64,
    Causal,
    Layout,
    Window,
    _blhd,
    _causal,
    _check_out,
    _direct_out,
    _heads_first,
    _lengths,
    _native_half,
    _num_threads,
    _overlaps,
    _readable,
    _scale,
    _slopes,
    _softcap,
    _window,
)

__all__ = ["attention", "attention_weights"]


_SHARED_DOC = """
    enable_gqa : bool, default False
        Grouped-query attention: q is (..., H, n_q, d), k and v are
        (..., H_kv, n_k, d) with H a multiple of H_kv; query head h uses
        key/value head h // (H // H_kv).  K and V are read in place, never
        repeated.  A mask, alibi_slopes or kv_lengths with a head axis have H
        (or 1) heads there.
    window : (left, right), optional
        Sliding window: with p = i + n_k - n_q (query i's bottom-right aligned
        position; kv_lengths replaces n_k; p = i with causal="upper_left"),
        query i sees keys j with p - left <= j <= p + right.  None or a
        negative number leaves that side
        unbounded.  Key tiles outside every window are skipped, so the cost
        grows with n * window, not n^2.
    softcap : float, optional
        A positive c turns each scaled score s into c * tanh(s / c) before the
        mask is applied (Gemma 2).
    alibi_slopes : array_like, optional
        Slopes of shape (H,) or broadcastable to the leading dims; adds
        ``-slope * abs(p - j)`` to the scaled scores (ALiBi).
    kv_lengths : array_like of int, optional
        Broadcastable to the leading dims: only the first kv_lengths[...] keys
        exist for that leading index (a padded KV cache); causal and window
        alignment use that length in place of n_k.  Note NumPy broadcasting:
        for (B, H, n, d) inputs, per-batch lengths have shape (B, 1).
    q_lengths : array_like of int, optional
        Broadcastable to the leading dims: only the first q_lengths[...]
        query rows are real (right-padded queries, as in batched prefill of
        sequences of different lengths); the rows after them are padding,
        not computed: zeros in the output (lse -inf, zero weights).  Causal
        and window alignment use that length in place of n_q: with
        q_lengths == kv_lengths, query i sits at position i.  Values in
        [0, n_q]; the same broadcasting note as kv_lengths."""


@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, mask: Optional[ArrayLike] = ...,
              causal: Causal = ..., scale: Optional[float] = ..., out: Optional[np.ndarray] = ...,
              return_lse: Literal[False] = ..., num_threads: Optional[int] = ..., enable_gqa: bool = ...,
              window: Optional[Window] = ..., softcap: Optional[float] = ...,
              alibi_slopes: Optional[ArrayLike] = ..., kv_lengths: Optional[ArrayLike] = ...,
              q_lengths: Optional[ArrayLike] = ..., layout: Layout = ...) -> NDArray[Any]: ...


@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, mask: Optional[ArrayLike] = ...,
              causal: Causal = ..., scale: Optional[float] = ..., out: Optional[np.ndarray] = ...,
              return_lse: Literal[True], num_threads: Optional[int] = ..., enable_gqa: bool = ...,
              window: Optional[Window] = ..., softcap: Optional[float] = ...,
              alibi_slopes: Optional[ArrayLike] = ...,
              kv_lengths: Optional[ArrayLike] = ...,
              q_lengths: Optional[ArrayLike] = ..., layout: Layout = ...) -> tuple[NDArray[Any], NDArray[Any]]: ...


def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, mask: Optional[ArrayLike] = None,
              causal: Causal = False, scale: Optional[float] = None, out: Optional[np.ndarray] = None,
              return_lse: bool = False, num_threads: Optional[int] = None, enable_gqa: bool = False,
              window: Optional[Window] = None, softcap: Optional[float] = None,
              alibi_slopes: Optional[ArrayLike] = None,
              kv_lengths: Optional[ArrayLike] = None,
              q_lengths: Optional[ArrayLike] = None,
              layout: Layout = "bhld") -> NDArray[Any] | tuple[NDArray[Any], NDArray[Any]]:
    if (mask is None and out is None and kv_lengths is None and q_lengths is None and alibi_slopes is None
            and window is None and softcap is None and return_lse is False and enable_gqa is False):
        plain = _core.attention_plain(q, k, v, causal, scale, num_threads, layout)   # None: not that call
        if plain is not None:
            return plain
    blhd = _blhd(layout)
    # the plain calls: no per-row arrays (q_lengths); ALiBi slopes only without the GQA
    # fold (which needs one slope for a group's heads), nor a causal alignment string,
    # window or softcap there
    plain_options = q_lengths is None
    fold_options = plain_options and alibi_slopes is None and type(causal) is bool and window is None \
        and softcap is None
    if blhd:   # (..., n, H, d): computed on (..., H, n, d) views, the result written in the caller's layout
        given = (q, k, v)
        q, k, v = _heads_first(given, "qkv")
        if plain_options and _plain_blhd(*given, enable_gqa) and _plain_out_ok(out, *given, mask):
            got = _plain_extras(mask, kv_lengths, q, k, False, alibi_slopes, out)  # type: ignore[arg-type]
            if got is not None:
                return _attention_plain(q, k, v, mask, got[0], causal, scale,  # type: ignore[arg-type]
                                        num_threads, out, return_lse, got[1], window, softcap, got[2], blhd=True)
        elif (fold_options and enable_gqa and _plain_arrays(*given) and _gqa_fold_shapes(q, k, v)
              and _plain_out_ok(out, *given, mask)):
            got = _plain_extras(mask, kv_lengths, q, k, True, None, out)  # type: ignore[arg-type]
            if got is not None:
                return _attention_plain_gqa(q, k, v, mask, got[0], causal, scale,  # type: ignore[arg-type]
                                            num_threads, out, return_lse, got[1], blhd=True)
    elif plain_options:
        if (not enable_gqa or _gqa_equal_heads(q, k)) and _plain(q, k, v) and _plain_out_ok(out, q, k, v, mask):
            got = _plain_extras(mask, kv_lengths, q, k, False, alibi_slopes, out)  # type: ignore[arg-type]
            if got is not None:
                return _attention_plain(q, k, v, mask, got[0], causal, scale,  # type: ignore[arg-type]
                                        num_threads, out, return_lse, got[1], window, softcap, got[2])
        elif fold_options and enable_gqa and _plain_gqa(q, k, v) and _plain_out_ok(out, q, k, v, mask):
            got = _plain_extras(mask, kv_lengths, q, k, True, None, out)  # type: ignore[arg-type]
            if got is not None:
                return _attention_plain_gqa(q, k, v, mask, got[0], causal, scale,  # type: ignore[arg-type]
                                            num_threads, out, return_lse, got[1])
    p = _prepare(q, k, v, mask, causal, scale, enable_gqa, window, softcap, alibi_slopes, kv_lengths,
                 num_threads, q_lengths=q_lengths, blhd=blhd)
    full_shape = p.lead + (p.n_q, p.d_v)
    res_lead = p.lead if p.gqa is None else p.lead[:-2] + (p.gqa[0],)
    res_shape = res_lead + ((p.n_q,) if not p.q1 else ()) + ((p.d_v,) if not p.v1 else ())
    user_out = None
    if blhd:   # the result (..., n_q, H, d_v), filled through its (..., H, n_q, d_v) view
        user_shape = res_shape[:-3] + (res_shape[-2], res_shape[-3], res_shape[-1])
        if out is None:
            out = np.empty(user_shape, p.res)
        else:
            _check_out(out, user_shape, p.res)
        user_out, out = out, out.swapaxes(-3, -2)
    elif out is not None:
        _check_out(out, res_shape, p.res)

    lse = np.empty(p.lead + (p.n_q,), p.comp) if return_lse else None
    direct = (out is not None and _direct_out(out, p.comp)
              and not _overlaps(out, *p.inputs, p.slopes, p.kvl, p.qln))
    target: np.ndarray = np.empty(0)
    if direct:
        assert out is not None
        target = out
        if p.q1:
            target = target[..., None, :] if not p.v1 else target[..., None]
        if p.v1:
            target = target[..., None]
        if p.gqa is not None:
            target = target.reshape(full_shape)   # splitting the head axis: a view ...
            direct = target.size == 0 or np.may_share_memory(target, out)   # ... else write a temporary
    if not direct:
        target = np.empty(full_shape, p.comp)

    if target.size or lse is not None:
        _call(p, target, lse)

    result: np.ndarray
    if direct:
        assert out is not None
        result = out
    else:
        result = _merge_heads(target, p.gqa, 2)
        if p.v1:
            result = result[..., 0]
        if p.q1:
            result = result[..., 0, :] if not p.v1 else result[..., 0]
        if out is None:
            result = result.astype(p.res, copy=False)
        else:
            np.copyto(out, result, casting="same_kind")
            result = out
    if user_out is not None:
        result = user_out
    if lse is not None:
        lse = _merge_heads(lse, p.gqa, 1)
        return result, (lse[..., 0] if p.q1 else lse)
    return result


attention.__doc__ = """Exact scaled dot-product attention, softmax(q k^T * scale + mask) v.

    Computed by a fused C kernel with a streaming (online) softmax: memory is
    O(n * d) and the n_q x n_k score matrix is never built.

    Parameters
    ----------
    q : array_like, shape (..., n_q, d_k) or (d_k,)
        Queries.  A 1-D q is one query and drops the n_q axis of the result.
    k : array_like, shape (..., n_k, d_k)
        Keys.  float16 or bfloat16 (ml_dtypes) K and V of one dtype are read
        as stored in a float32 computation (no copy; see the guide, 16-bit
        K and V).
    v : array_like, shape (..., n_k, d_v) or (n_k,)
        Values.  A 1-D v drops the d_v axis of the result.
    mask : array_like of bool or float, optional
        Broadcastable to (..., n_q, n_k).  bool: True = may attend.  float:
        added to the scaled scores (-inf forbids; a large finite number such
        as np.finfo(dtype).min hides a key from a row that sees another, but
        a row of only such numbers attends every key, as in the reference and
        PyTorch).  With a 1-D q, broadcastable to (..., n_k).
    causal : bool or str, default False
        True (or "lower_right"): query i may attend key j iff
        j <= i + (n_k - n_q), aligned bottom-right, as in FlashAttention
        >= 2.1 and KV-cache decoding (the same as PyTorch's `is_causal` when
        n_q == n_k).  "upper_left": j <= i, aligned top-left, as PyTorch's
        `is_causal` for any n_q and n_k; window and alibi_slopes then use the
        position i too.  Combines with `mask`.
    scale : float, optional
        Multiplies q k^T; default 1/sqrt(d_k).  0 gives the plain mean of the
        visible values.
    out : ndarray, optional
        Array of the result's exact shape (any strides), filled and returned.
        Any dtype the result casts to under NumPy's same_kind rule (float32
        for a float64 result, say): the compute dtype's values, cast once.
    return_lse : bool, default False
        Also return lse = log(sum_j exp(scaled, masked score)), shape
        (..., n_q), in the compute dtype (float32 or float64).
    num_threads : int, optional
        Threads for this call.  None uses the OpenMP default (OMP_NUM_THREADS,
        threadpoolctl); a negative n uses that default plus n + 1 (-1 all of
        it, -2 one fewer; at least 1), as in scikit-learn.  Not 0.  At most
        fastattn._core.thread_cap() (4 a CPU, at least 8; docs/guide.md,
        "Threads, fork and the thread cap").""" + _SHARED_DOC + """
    layout : {"bhld", "blhd"}, default "bhld"
        The axes of q, k, v, out and the result: "bhld" (..., H, n, d), as
        PyTorch and the shapes here; "blhd" (..., n, H, d), as flash-attn and
        JAX (at least 3-D; read in place, and the result written in that
        layout).  mask, lse, alibi_slopes, kv_lengths and q_lengths keep the
        head-major leading dims (..., H) either way.

    Returns
    -------
    out : ndarray, shape (..., n_q, d_v)
        The leading dims are those of q, k, v and mask broadcast together.
        dtype is np.result_type(q, k, v): float32 and float64 compute in their
        own precision, 16-bit floats (float16, bfloat16) compute in and give
        float32, integers and bool give float64.
    lse : ndarray, shape (..., n_q)
        Only with return_lse=True.

    Notes
    -----
    A query row that may attend nothing (fully masked, n_k == 0, an empty
    window or kv length) or is padding (q_lengths) gives zeros, never NaN,
    and lse = -inf.  NaN or inf in
    an input reaches only the rows that attend it: a key hidden from a query
    (mask, causal, window, kv_lengths) adds nothing to its row, even when its
    value row holds inf or NaN; a key the row sees adds its inf and NaN even
    when its weight underflows to 0.  The GIL is released during the
    computation.

    Raises
    ------
    ValueError
        Shapes that do not fit (d_k of q and k, n_k of k and v, leading dims or
        mask not broadcastable, out of the wrong shape, head counts with
        enable_gqa), num_threads == 0, a non-finite scale, softcap <= 0,
        kv_lengths outside [0, n_k], q_lengths outside [0, n_q], a causal
        string other than "lower_right" and "upper_left", a layout other than
        "bhld" and "blhd", an input of fewer than 3 dims with "blhd".
    TypeError
        Complex, object, string inputs; an integer mask; an out whose dtype the
        result does not cast to (same_kind); a causal that is neither a bool
        nor a string; a scale or softcap that is not a real number.

    Examples
    --------
    The key-value lookup: the query "fruit" against the keys apple, banana and
    chair, whose values are 10, 5 and 2.

    >>> import numpy as np, fastattn
    >>> keys = np.array([[1.0, 1.0], [1.0, 0.8], [0.0, -1.0]])   # apple, banana, chair
    >>> values = np.array([10.0, 5.0, 2.0])
    >>> fruit = np.array([1.0, 0.9])
    >>> round(float(fastattn.attention(fruit, keys, values)), 3)
    7.272
    """


def attention_weights(q: ArrayLike, k: ArrayLike, *, mask: Optional[ArrayLike] = None, causal: Causal = False,
                      scale: Optional[float] = None, enable_gqa: bool = False, window: Optional[Window] = None,
                      softcap: Optional[float] = None, alibi_slopes: Optional[ArrayLike] = None,
                      kv_lengths: Optional[ArrayLike] = None, num_threads: Optional[int] = None,
                      q_lengths: Optional[ArrayLike] = None, layout: Layout = "bhld") -> NDArray[Any]:
    blhd = _blhd(layout)
    if blhd:
        q, k = _heads_first((q, k), "qk")
    p = _prepare(q, k, None, mask, causal, scale, enable_gqa, window, softcap, alibi_slopes, kv_lengths,
                 num_threads, weights=True, q_lengths=q_lengths, blhd=blhd)
    target = np.zeros(p.lead + (p.n_q, p.n_k), p.comp)
    if target.size:
        _call(p, target, None, weights=True)
    result = _merge_heads(target, p.gqa, 2)
    if p.q1:
        result = result[..., 0, :]
    return result.astype(p.res, copy=False)


attention_weights.__doc__ = """The attention weights softmax(q k^T * scale + mask), from the C core.

    Rows sum to 1; a row that may attend nothing is zero.  The result is
    O(n_q * n_k) in memory by nature: it is meant for inspection and plots
    (see fastattn.plot.attention_map), not for computing attention.

    Parameters
    ----------
    q : array_like, shape (..., n_q, d_k) or (d_k,)
    k : array_like, shape (..., n_k, d_k)
    mask, causal, scale, num_threads, layout
        As for `attention` (with layout="blhd", q and k are (..., n, H, d); the
        weights keep (..., H, n_q, n_k)).""" + _SHARED_DOC + """

    Returns
    -------
    ndarray, shape (..., n_q, n_k) (a 1-D q gives (..., n_k))
        dtype np.result_type(q, k) (16-bit floats give float32, integers and
        bool float64).

    Examples
    --------
    >>> import numpy as np, fastattn
    >>> w = fastattn.attention_weights(np.eye(3), np.eye(3), causal=True)
    >>> w.sum(axis=-1)
    array([1., 1., 1.])
    """


# ---------------------------------------------------------------------------
# the plain path: the common call, straight to the C core
# ---------------------------------------------------------------------------
def _plain_arrays(q: Any, k: Any, v: Any) -> bool:
    """Three ndarrays (not subclasses), C-contiguous and aligned, that the C core
    reads as they are: q, k and v of one native float32 or float64 dtype, or a
    float32 q with k and v of one native 16-bit dtype (read as stored, as
    _prepare keeps them)."""
    if not (type(q) is np.ndarray and type(k) is np.ndarray and type(v) is np.ndarray):
        return False
    dt, kt = q.dtype, k.dtype
    if not (kt == v.dtype and (dt == kt and (dt == _F32 or dt == _F64) or dt == _F32 and _native_half(kt))):
        return False
    return (q.flags.c_contiguous and k.flags.c_contiguous and v.flags.c_contiguous
            and q.flags.aligned and k.flags.aligned and v.flags.aligned)


def _plain(q: Any, k: Any, v: Any) -> bool:
    """Is this the common call, which every check of _prepare passes and which
    needs no conversion?  Arrays that _plain_arrays accepts, shaped (..., n_q, d_k),
    (..., n_k, d_k) and (..., n_k, d_v) with the same leading dims: a few attribute
    reads, where _prepare's general work is most of a small call."""
    if not _plain_arrays(q, k, v):
        return False
    qs, ks, vs = q.shape, k.shape, v.shape
    n = len(qs)
    return n >= 2 and n == len(ks) and qs[-1] == ks[-1] and qs[:-2] == ks[:-2] and ks[:-1] == vs[:-1]


def _plain_blhd(q: Any, k: Any, v: Any, enable_gqa: bool) -> bool:
    """The plain call in layout "blhd": arrays that _plain_arrays accepts, shaped
    (..., n_q, H, d_k), (..., n_k, H, d_k) and (..., n_k, H, d_v) with the same
    leading dims and heads (with enable_gqa, at least one head: zero go the
    general way, to its error), read through their (..., H, n, d) views as the
    general path reads them."""
    if not _plain_arrays(q, k, v):
        return False
    qs, ks, vs = q.shape, k.shape, v.shape
    n = len(qs)
    return (n >= 3 and n == len(ks) and qs[:-3] == ks[:-3] and qs[-2:] == ks[-2:]
            and ks[:-1] == vs[:-1] and (qs[-2] > 0 or not enable_gqa))


def _gqa_equal_heads(q: Any, k: Any) -> bool:
    """enable_gqa with as many key/value heads as query heads (ndarrays with a
    head axis): multi-head attention, which the plain call serves as it is (the
    general path runs the same C call on (..., H, 1, n, d) views).  Zero heads
    go the general way, to its error."""
    return (type(q) is np.ndarray and type(k) is np.ndarray and q.ndim >= 3 and k.ndim >= 3
            and q.shape[-3] == k.shape[-3] > 0)


def _plain_gqa(q: Any, k: Any, v: Any) -> bool:
    """The plain call of grouped-query decoding (enable_gqa, no mask): arrays that
    _plain_arrays accepts, q (..., H, n_q, d_k), k (..., H_kv, n_k, d_k) and v
    (..., H_kv, n_k, d_v) with the same leading dims and H a multiple of H_kv,
    and few enough rows that the plan folds each group's query heads into the
    rows of one item (_prepare's fold; _core.gqa_fold)."""
    return _plain_arrays(q, k, v) and _gqa_fold_shapes(q, k, v)


def _gqa_fold_shapes(q: Any, k: Any, v: Any) -> bool:
    """_plain_gqa's shapes: q (..., H, n_q, d_k), k (..., H_kv, n_k, d_k) and v
    (..., H_kv, n_k, d_v) with the same leading dims, H a multiple of H_kv, and
    few enough rows for the fold (in layout "blhd": the arrays' heads-first
    views)."""
    qs, ks, vs = q.shape, k.shape, v.shape
    n = len(qs)
    return (n >= 3 and n == len(ks) and qs[-1] == ks[-1] and qs[:-3] == ks[:-3] and ks[:-1] == vs[:-1]
            and 0 < ks[-3] < qs[-3] and qs[-3] % ks[-3] == 0 and _core.gqa_fold(qs[-2], k.nbytes + v.nbytes))


def _plain_mask(mask: Any, q: np.ndarray, k: np.ndarray, gqa: bool = False) -> int:
    """The C core's mask kind for the mask of a plain call (see _plain) that it can
    read as it is, else MASK_NONE (the general path then checks, converts or
    refuses it): an ndarray (not a subclass) of dtype bool or of q's dtype, of rank
    2 to q's, broadcastable to the scores (..., n_q, n_k) without adding to or
    growing q's leading dims, with strides in whole elements.  A float mask that
    _mask_as_bool might turn into a bool one goes the general way too.  With gqa
    (a folded call), only a mask with a head axis of 1 (or none): one per query
    head goes the general path's fold."""
    if type(mask) is not np.ndarray:
        return _core.MASK_NONE
    dt = mask.dtype
    kind = _core.MASK_BOOL if dt == _BOOL else _core.MASK_ADD if dt == q.dtype else _core.MASK_NONE
    ms, qs = mask.shape, q.shape
    n = len(ms)
    if kind == _core.MASK_NONE or not 2 <= n <= len(qs) or (gqa and n >= 3 and ms[-3] != 1):
        return _core.MASK_NONE
    n_q, n_k = qs[-2], k.shape[-2]
    if not ((ms[-2] == 1 or ms[-2] == n_q) and (ms[-1] == 1 or ms[-1] == n_k)):
        return _core.MASK_NONE
    lead = qs[len(qs) - n:-2]
    if ms[:-2] != lead and not all(m == 1 or m == x for m, x in zip(ms[:-2], lead)):
        return _core.MASK_NONE
    if kind == _core.MASK_ADD:
        if not _readable(mask, False):
            return _core.MASK_NONE
        if _float_mask._FLOAT_MASKS_AS_BOOL and _may_pay(ms, math.prod(qs[:-1]) * n_k, n_q, n_k, q.size + k.size):
            return _core.MASK_NONE
    return kind


def _plain_lengths(lengths: Any, lead: tuple, n_k: int, gqa: bool) -> Optional[np.ndarray]:
    """kv_lengths of a plain call as the C core reads them (int64, checked by
    _lengths, which raises what the general path would: not integers, values
    outside [0, n_k]), else None (the general path then takes them): an ndarray
    (not a subclass) of rank at most len(lead) that broadcasts to the leading
    dims `lead` (..., H) without growing them.  With gqa (a folded call: lead
    (..., H_kv) for the C core), one length for all the heads of a batch (a
    head axis of 1, or none), as the fold needs."""
    if type(lengths) is not np.ndarray:
        return None
    kvl = _lengths(lengths, "kv_lengths", "n_k", n_k)   # the general path's checks, errors and int64
    ls = kvl.shape
    n = len(ls)
    if n > len(lead) or (gqa and n and ls[-1] != 1):
        return None
    if n and not all(m == 1 or m == x for m, x in zip(ls, lead[len(lead) - n:])):
        return None
    return kvl


def _plain_out(out: Any, q: Any, k: Any, v: Any) -> bool:
    """Can a plain call write into `out` as it is?  An ndarray (not a
    subclass) of q's dtype and the result's shape, C-contiguous, writeable and
    clear of the inputs; anything else goes the general way (its checks, its
    errors, a temporary when out overlaps an input)."""
    return (type(out) is np.ndarray and out.dtype == q.dtype and out.shape == q.shape[:-1] + v.shape[-1:]
            and out.flags.c_contiguous and out.flags.writeable and out.flags.aligned
            and not (np.may_share_memory(out, q) or np.may_share_memory(out, k) or np.may_share_memory(out, v)))


def _plain_out_ok(out: Any, q: Any, k: Any, v: Any, mask: Any) -> bool:
    """No out=, or one that a plain call writes as it is (_plain_out) and that is
    clear of the mask."""
    return out is None or _plain_out(out, q, k, v) and not _overlaps(out, mask)


def _plain_extras(mask: Any, kv_lengths: Any, q: np.ndarray, k: np.ndarray, gqa: bool, alibi_slopes: Any = None,
                  out: Optional[np.ndarray] = None
                  ) -> Optional[tuple[int, Optional[np.ndarray], Optional[np.ndarray]]]:
    """The mask kind, kv_lengths and ALiBi slopes of a plain call (_plain_mask,
    _plain_lengths, _plain_slopes; q and k as the C core reads them, gqa for a
    folded call), or None where any of them needs the general path, or where
    out might share memory with the lengths or slopes (the general path then
    writes through a temporary).  In _prepare's order, so that the first bad
    argument raises its error: the mask (the general path's errors), the
    slopes, the lengths."""
    mask_kind = _core.MASK_NONE if mask is None else _plain_mask(mask, q, k, gqa)
    if mask is not None and mask_kind == _core.MASK_NONE:
        return None
    slopes = _plain_slopes(alibi_slopes, q)
    kvl = _plain_lengths(kv_lengths, q.shape[:-2], k.shape[-2], gqa)
    if ((kv_lengths is not None and kvl is None) or (alibi_slopes is not None and slopes is None)
            or (out is not None and _overlaps(out, kvl, slopes))):
        return None
    return mask_kind, kvl, slopes


def _plain_slopes(alibi_slopes: Any, q: np.ndarray) -> Optional[np.ndarray]:
    """alibi_slopes of a plain call as the C core reads them (_slopes: the general
    path's check, error and conversion to q's dtype), else None (the general
    path then takes them): values that broadcast to q's leading dims (..., H)
    without growing them."""
    if alibi_slopes is None:
        return None
    s = _slopes(alibi_slopes, q.dtype)
    lead, n = q.shape[:-2], s.ndim
    if n > len(lead) or (n and not all(m == 1 or m == x for m, x in zip(s.shape, lead[len(lead) - n:]))):
        return None
    return s


def _attention_plain(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: Optional[np.ndarray], mask_kind: int,
                     causal: Any, scale: Any, num_threads: Any, out: Optional[np.ndarray],
                     return_lse: bool, kvl: Optional[np.ndarray] = None, window: Any = None,
                     softcap: Any = None, slopes: Optional[np.ndarray] = None, blhd: bool = False) -> Any:
    """attention() of a call that _plain (and _plain_out, _plain_mask,
    _plain_lengths) accepted: the same result as through _prepare (the same C
    call on the same arrays, its options checked by the same functions in the
    same order), without its general work.  blhd: q, k and v are the (..., H, n,
    d) views of _plain_blhd's arrays, and the result (out, if given) is (...,
    n_q, H, d_v), written through its (..., H, n_q, d_v) view."""
    s, nthreads = _scale(scale, q.shape[-1]), _num_threads(num_threads)
    on, top_left = _causal(causal)
    win_left, win_right = _window(window, q.shape[-2] + k.shape[-2])
    cap = _softcap(softcap)
    shape = q.shape[:-1] + v.shape[-1:]
    if blhd:
        shape = shape[:-3] + (shape[-2], shape[-3], shape[-1])
    result = np.empty(shape, q.dtype) if out is None else out
    lse = np.empty(q.shape[:-1], q.dtype) if return_lse else None
    if result.size or lse is not None:
        _core.attention(_core.Args(q, k, v, mask, mask_kind, q.shape[:-2], on, s, nthreads, kvl=kvl, softcap=cap,
                                   win_left=win_left, win_right=win_right, top_left=top_left, slopes=slopes),
                        result.swapaxes(-3, -2) if blhd else result, lse)
    return (result, lse) if return_lse else result


def _attention_plain_gqa(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: Optional[np.ndarray],
                         mask_kind: int, causal: bool, scale: Any, num_threads: Any, out: Optional[np.ndarray],
                         return_lse: bool, kvl: Optional[np.ndarray] = None, blhd: bool = False) -> Any:
    """attention(..., enable_gqa=True) of a call that _plain_gqa (and _plain_out,
    _plain_mask, _plain_lengths) accepted: the folded C call that _prepare and
    _call would make (a group's g query heads as the n_q * g rows of one item,
    position-major; a mask and kv_lengths with a head axis of 1 serve the K and
    V heads as they are, a mask's rows repeated for the group's heads),
    without their general work.  blhd: q, k and v are the (..., H, n, d) views
    of (..., n, H, d) arrays, and the result (out, if given) is (..., n_q, H,
    d_v), written through its (..., H, n_q, d_v) view."""
    H, Hkv, n_q = q.shape[-3], k.shape[-3], q.shape[-2]
    g, lead = H // Hkv, q.shape[:-3] + (Hkv,)
    s, nthreads = _scale(scale, q.shape[-1]), _num_threads(num_threads)
    shape = q.shape[:-1] + v.shape[-1:]
    if blhd:
        shape = shape[:-3] + (n_q, H, shape[-1])
    result = np.empty(shape, q.dtype) if out is None else out
    target = result.swapaxes(-3, -2) if blhd else result
    lse = np.empty(q.shape[:-1], q.dtype) if return_lse else None
    if mask is not None:   # (..., 1, n_q|1, n_k|1), the group's axis added as _prepare splits the heads
        mask = _fold_rows_mask(mask[..., None, :, :], g, n_q)
    if result.size or lse is not None:
        args = _core.Args(_rows(q.reshape(lead + (g, n_q, q.shape[-1])), 1), k, v, mask, mask_kind, lead,
                          bool(causal), s, nthreads, kvl=kvl, row_group=g)
        # (splitting the head axis in two is a view, of a swapped view too: the C call writes result)
        _attention_rows(args, target.reshape(lead + (g, n_q, v.shape[-1])),
                        lse.reshape(lead + (g, n_q)) if lse is not None else None)
    return (result, lse) if return_lse else result


# ---------------------------------------------------------------------------
# the general path: a _Prepared call into the C core
# ---------------------------------------------------------------------------
def _merge_heads(a, gqa, core):
    """Undo the GQA head split: (..., Hkv, g, *core) -> (..., H, *core)."""
    if gqa is None:
        return a
    return a.reshape(a.shape[:a.ndim - core - 2] + (gqa[0],) + a.shape[a.ndim - core:])


def _rows(a, core):
    """a (..., g, n, *core) as (..., n * g, *core), position-major (row r: n-index
    r // g, g-index r % g): a view where the strides allow one, else a copy."""
    i = a.ndim - core - 2
    return np.swapaxes(a, i, i + 1).reshape(a.shape[:i] + (a.shape[i] * a.shape[i + 1],) + a.shape[i + 2:])


def _unrows(dst, src, core):
    """Write src (..., n * g, *core), rows as _rows orders them, into dst (..., g, n, *core)."""
    i = dst.ndim - core - 2
    t = np.swapaxes(dst, i, i + 1)
    t[...] = src.reshape(t.shape)


def _attention_rows(c: _core.Args, target: np.ndarray, lse: Optional[np.ndarray], weights: bool = False) -> None:
    """The C call c of a GQA group's heads folded into rows: target (..., g, n, d)
    and lse (..., g, n) written as the (..., n * g, ...) rows that c computes
    (views where the strides allow, else copies written back)."""
    rows = _rows(target, 1)
    rows_lse = _rows(lse, 0) if lse is not None else None
    _core.attention(c, rows, rows_lse, weights=weights)
    if not np.may_share_memory(rows, target):
        _unrows(target, rows, 1)  # rows written as a copy (no view of them): back in place
    if lse is not None and not np.may_share_memory(rows_lse, lse):
        _unrows(lse, rows_lse, 0)


def _fold_mask(p: _Prepared, g: int) -> Optional[np.ndarray]:
    """The mask of a folded call (see _prepare) of g heads a group (_fold_rows_mask), or None."""
    return None if p.mask is None else _fold_rows_mask(p.mask, g, p.n_q)


def _fold_rows_mask(mask: np.ndarray, g: int, n_q: int) -> np.ndarray:
    """A mask (..., Hkv|1, g|1, n_q|1, n_k|1) of a call that folds g heads a group into
    rows, as (..., Hkv|1, n_q * g, n_k|1), position-major: a view where the rows'
    strides allow one (say a key-padding mask, the same for every row), else a copy
    of at most n_q * g rows of n_k per K and V head."""
    mask = mask.reshape((1,) * (3 - mask.ndim) + mask.shape)
    return _rows(np.broadcast_to(mask, mask.shape[:-3] + (g, n_q, mask.shape[-1])), 1)


def _call(p: _Prepared, target: np.ndarray, lse: Optional[np.ndarray], weights: bool = False,
          plan_only: bool = False) -> Any:
    """Run the prepared call p into target (and lse), or return its plan."""
    c: _core.Args = p
    if p.fold:  # (see _prepare) q (..., Hkv, g, n_q, d) -> (..., Hkv, n_q * g, d), position-
        # major, rows g apart sharing a position (the C core's row_group); k and v
        # (..., Hkv, 1, n_k, d) -> (..., Hkv, n_k, d); out, lse and the mask alike;
        # kv_lengths and q_lengths (..., Hkv|1, 1) -> (..., Hkv|1), q_lengths in positions
        assert p.gqa is not None   # (the fold is of GQA's heads)
        g = p.gqa[0] // p.gqa[1]
        kvl, qln = (x[..., 0] if x is not None and x.ndim else x for x in (p.kvl, p.qln))
        c = p.folded(_rows(p.q, 1), p.k[..., 0, :, :], p.v[..., 0, :, :], _fold_mask(p, g), p.lead[:-1], kvl, qln, g)
    if plan_only:   # (target may be a zero-stride stand-in: nothing is written)
        return _core.attention(c, _rows(target, 1) if p.fold else target,
                               _rows(lse, 0) if p.fold and lse is not None else lse, weights=weights, plan_only=True)
    if p.fold:
        _attention_rows(c, target, lse, weights)
    else:
        _core.attention(c, target, lse, weights=weights)
    if p.pad is not None:
        _fill_pad_rows(p, target, lse, weights)
    return None


def _plan(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, mask: Optional[ArrayLike] = None, causal: Causal = False,
          scale: Optional[float] = None, num_threads: Optional[int] = None, enable_gqa: bool = False,
          window: Optional[Window] = None, softcap: Optional[float] = None,
          alibi_slopes: Optional[ArrayLike] = None, kv_lengths: Optional[ArrayLike] = None,
          q_lengths: Optional[ArrayLike] = None, layout: Layout = "bhld", weights: bool = False) -> Dict[str, Any]:
    """The plan that attention(q, k, v, **options) (attention_weights with weights)
    would run, computed and not run (src_c/plan.c; _core.plan has its fields):
    the kernel, tiles, tail, GQA fold, key splits, team.  Tests and tuning."""
    blhd = _blhd(layout)
    if blhd:
        q, k, v = _heads_first((q, k, v), "qkv")
    p = _prepare(q, k, v, mask, causal, scale, enable_gqa, window, softcap, alibi_slopes, kv_lengths,
                 num_threads, weights=weights, q_lengths=q_lengths, blhd=blhd)
    stand_in = np.broadcast_to(np.zeros((), p.comp), p.lead + (p.n_q, p.n_k if weights else p.d_v))
    plan: Dict[str, Any] = _call(p, stand_in, None, weights, plan_only=True)
    plan["fold"] = p.fold
    return plan
