"""The public API: validate, convert, call the C core.

Everything a user can get wrong is checked here, before any work, and raised
as ValueError (shapes, values) or TypeError (dtypes).  The C core then trusts
its arguments.  Inputs are never modified.
"""

import math
import operator

import numpy as np

from . import _core
from .reference import default_scale

__all__ = ["attention", "softmax"]

_F16, _F32, _F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)


# ---------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------
def _check_input_dtype(a, name):
    dt = a.dtype
    if dt.kind == "f" and dt.itemsize > 8:
        raise TypeError(f"{name} has dtype {dt}; fastattn computes in float32 or float64, "
                        f"cast it with .astype(np.float64)")
    if dt.kind not in "fiub":
        raise TypeError(f"{name} has dtype {dt}; fastattn takes real floating, integer or bool "
                        f"arrays (complex, object, string and datetime are not supported)")


def _dtypes(*arrays):
    """(result dtype, compute dtype) of NumPy's promotion of the inputs."""
    res = np.result_type(*arrays)
    if res.kind != "f":  # integer and bool compute in float64, as NumPy does
        res = _F64
    comp = _F32 if res in (_F16, _F32) else _F64
    return res, comp


def _as_compute(a, dtype):
    """`a` in the compute dtype, with unit stride on the last axis (a copy only
    when needed; leading and row strides are read as they are)."""
    a = a.astype(dtype, copy=False)
    if a.flags.c_contiguous:
        return a
    if a.ndim and a.shape[-1] > 1 and a.strides[-1] != a.itemsize:
        a = np.ascontiguousarray(a)
    elif any(s % a.itemsize for s in a.strides):
        a = np.ascontiguousarray(a)
    return a


# ---------------------------------------------------------------------------
# scalar arguments
# ---------------------------------------------------------------------------
def _num_threads(n):
    if n is None:
        return 0
    if isinstance(n, (bool, np.bool_)):
        raise TypeError("num_threads must be None or a positive int, got a bool")
    try:
        n = operator.index(n)
    except TypeError:
        raise TypeError(f"num_threads must be None or a positive int, got {type(n).__name__}") from None
    if n <= 0:
        raise ValueError(f"num_threads must be None or a positive int, got {n}")
    return min(n, 1 << 16)


def _scale(scale, d_k):
    if scale is None:
        return default_scale(d_k)
    try:
        s = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}") from None
    if not math.isfinite(s):
        raise ValueError(f"scale must be finite, got {s}")
    return s


def _check_out(out, shape, dtype):
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy.ndarray, got {type(out).__name__}")
    if out.shape != tuple(shape):
        raise ValueError(f"out has shape {out.shape}, the result has shape {tuple(shape)}")
    if out.dtype != dtype:
        raise TypeError(f"out has dtype {out.dtype}, the result has dtype {dtype}")
    if not out.flags.writeable:
        raise ValueError("out is read-only")


def _overlaps(out, *arrays):
    """Might `out` share memory with an input?  (A bounds check: cheap and
    conservative; an overlap means the result goes through a temporary.)"""
    return any(isinstance(a, np.ndarray) and np.may_share_memory(out, a) for a in arrays)


def _direct_out(out, comp):
    """Can the C core write into `out` as it is?"""
    return (out.dtype == comp and (out.ndim == 0 or out.shape[-1] <= 1 or out.strides[-1] == out.itemsize)
            and all(s % out.itemsize == 0 for s in out.strides))


# ---------------------------------------------------------------------------
# softmax
# ---------------------------------------------------------------------------
def softmax(x, axis=-1, *, out=None):
    """Numerically stable softmax along `axis`, computed by the C core.

    Parameters
    ----------
    x : array_like
        Real floating, integer or bool.  float16 is computed in float32 and
        returned as float16; integers and bool give float64.
    axis : int, default -1
        The axis along which the entries sum to 1.
    out : ndarray, optional
        Array of the result's exact shape and dtype (any strides) to fill.

    Returns
    -------
    ndarray
        exp(x - max) / sum(exp(x - max)) along `axis`.  A slice whose entries
        are all -inf gives zeros (not NaN); NaN propagates to its slice.
        Extreme entries (±1e30, -inf) are handled without overflow.

    Raises
    ------
    TypeError
        For complex, object, string or datetime input, or an `out` of the wrong dtype.
    numpy.exceptions.AxisError
        For an axis out of range (a ValueError and an IndexError).
    ValueError
        For an `out` of the wrong shape or a read-only `out`.

    Examples
    --------
    >>> import numpy as np, fastattn
    >>> fastattn.softmax(np.array([1.0, 2.0, 3.0])).round(4)
    array([0.09  , 0.2447, 0.6652])
    """
    x = np.asarray(x)
    _check_input_dtype(x, "x")
    res, comp = _dtypes(x)
    if x.ndim == 0:
        raise ValueError("softmax needs at least one axis; x is a scalar")
    axis = np.lib.array_utils.normalize_axis_index(axis, x.ndim) if hasattr(np.lib, "array_utils") \
        else np.core.multiarray.normalize_axis_index(axis, x.ndim)
    if out is not None:
        _check_out(out, x.shape, res)
    xc = np.moveaxis(_as_compute_any(x, comp), axis, -1)
    if out is not None and _direct_out_any(out, comp) and (
            not np.may_share_memory(out, x) or _same_view(out, x)):
        target = np.moveaxis(out, axis, -1)
        _core.softmax(xc, target, 0)
        return out
    tmp = np.empty(xc.shape, comp)
    _core.softmax(xc, tmp, 0)
    result = np.moveaxis(tmp, -1, axis)
    if out is not None:
        np.copyto(out, result, casting="same_kind")
        return out
    return result.astype(res, copy=False)


def _as_compute_any(a, dtype):
    """The compute dtype; any strides that are whole elements."""
    a = a.astype(dtype, copy=False)
    if any(s % a.itemsize for s in a.strides):
        a = np.ascontiguousarray(a)
    return a


def _direct_out_any(out, comp):
    return out.dtype == comp and all(s % out.itemsize == 0 for s in out.strides)


def _same_view(a, b):
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.strides == b.strides and a.shape == b.shape)


# ---------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------
def _as_array(a, name):
    if a is None:
        raise TypeError(f"{name} must be an array, got None")
    a = np.asarray(a)
    _check_input_dtype(a, name)
    return a


def attention(q, k, v, *, mask=None, causal=False, scale=None, out=None,
              return_lse=False, num_threads=None):
    """Exact scaled dot-product attention, softmax(q k^T * scale + mask) v.

    Computed by a fused C kernel with a streaming (online) softmax: memory is
    O(n * d) and the n_q x n_k score matrix is never built.

    Parameters
    ----------
    q : array_like, shape (..., n_q, d_k) or (d_k,)
        Queries.  A 1-D q is one query and drops the n_q axis of the result.
    k : array_like, shape (..., n_k, d_k)
        Keys.
    v : array_like, shape (..., n_k, d_v) or (n_k,)
        Values.  A 1-D v drops the d_v axis of the result.
    mask : array_like of bool or float, optional
        Broadcastable to (..., n_q, n_k).  bool: True = may attend.  float:
        added to the scaled scores (-inf forbids).  With a 1-D q, broadcastable
        to (..., n_k).
    causal : bool, default False
        Query i may attend key j iff j <= i + (n_k - n_q): aligned
        bottom-right, as in FlashAttention >= 2.1 and KV-cache decoding (the
        same as PyTorch's `is_causal` when n_q == n_k).  Combines with `mask`.
    scale : float, optional
        Multiplies q k^T; default 1/sqrt(d_k).  0 gives the plain mean of the
        visible values.
    out : ndarray, optional
        Array of the result's exact shape and dtype (any strides), filled and
        returned.
    return_lse : bool, default False
        Also return lse = log(sum_j exp(scaled, masked score)), shape
        (..., n_q), in the compute dtype (float32 or float64).
    num_threads : int, optional
        Threads for this call.  None uses the OpenMP default (OMP_NUM_THREADS,
        threadpoolctl).  Must be positive.

    Returns
    -------
    out : ndarray, shape (..., n_q, d_v)
        The leading dims are those of q, k, v and mask broadcast together.
        dtype is np.result_type(q, k, v): float32 and float64 compute in their
        own precision, float16 computes in float32, integers and bool give
        float64.
    lse : ndarray, shape (..., n_q)
        Only with return_lse=True.

    Notes
    -----
    A query row that may attend nothing (fully masked, or n_k == 0) gives
    zeros, never NaN, and lse = -inf.  NaN or inf in an input reaches only the
    rows that attend it.  The GIL is released during the computation.

    Raises
    ------
    ValueError
        Shapes that do not fit (d_k of q and k, n_k of k and v, leading dims or
        mask not broadcastable, out of the wrong shape), num_threads <= 0, a
        non-finite scale.
    TypeError
        Complex, object, string inputs; an integer mask; out of the wrong dtype.

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
    q = _as_array(q, "q")
    k = _as_array(k, "k")
    v = _as_array(v, "v")
    res, comp = _dtypes(q, k, v)
    if q.ndim < 1:
        raise ValueError(f"q must have shape (..., n_q, d_k) or (d_k,), got a scalar")
    if k.ndim < 2:
        raise ValueError(f"k must have shape (..., n_k, d_k), got shape {k.shape}")
    if v.ndim < 1:
        raise ValueError(f"v must have shape (..., n_k, d_v) or (n_k,), got a scalar")
    q1, v1 = q.ndim == 1, v.ndim == 1
    qq = q[None, :] if q1 else q
    vv = v[:, None] if v1 else v
    n_q, d_k = qq.shape[-2:]
    n_k, d_k2 = k.shape[-2:]
    n_k2, d_v = vv.shape[-2:]
    if d_k != d_k2:
        raise ValueError(f"d_k differs: q has shape {q.shape} (d_k={d_k}), k has shape {k.shape} (d_k={d_k2})")
    if n_k != n_k2:
        raise ValueError(f"n_k differs: k has shape {k.shape} (n_k={n_k}), v has shape {v.shape} (n_k={n_k2})")

    # mask: bool or float, broadcastable to (..., n_q, n_k)
    mask_kind = _core.MASK_NONE
    mm = None
    if mask is not None:
        mm = np.asarray(mask)
        if mm.dtype == bool:
            mask_kind = _core.MASK_BOOL
        elif mm.dtype.kind == "f" and mm.dtype.itemsize <= 8:
            mask_kind = _core.MASK_ADD
        elif mm.dtype.kind in "iu":
            raise TypeError(f"mask has integer dtype {mm.dtype}; use a bool mask (True = may attend) "
                            f"or a float mask (added to the scores), e.g. mask.astype(bool)")
        else:
            raise TypeError(f"mask must be bool or floating, got dtype {mm.dtype}")
        if q1:
            mm = mm[..., None, :] if mm.ndim >= 1 else mm
        if mm.ndim < 2:
            mm = mm.reshape((1,) * (2 - mm.ndim) + mm.shape)
        mq, mk = mm.shape[-2:]
        if mq not in (1, n_q) or mk not in (1, n_k):
            raise ValueError(f"mask of shape {np.shape(mask)} does not broadcast to the scores "
                             f"(..., n_q={n_q}, n_k={n_k})" + (" (1-D q: (..., n_k))" if q1 else ""))

    try:
        lq, lk, lv = qq.shape[:-2], k.shape[:-2], vv.shape[:-2]
        if lq == lk == lv and mm is None:
            lead = lq
        else:
            lead = np.broadcast_shapes(lq, lk, lv, mm.shape[:-2] if mm is not None else ())
    except ValueError:
        shapes = f"q {q.shape}, k {k.shape}, v {v.shape}" + (f", mask {np.shape(mask)}" if mask is not None else "")
        raise ValueError(f"leading dims do not broadcast: {shapes}") from None

    scale = _scale(scale, d_k)
    nthreads = _num_threads(num_threads)
    causal = bool(causal)

    full_shape = lead + (n_q, d_v)
    res_shape = lead + ((n_q,) if not q1 else ()) + ((d_v,) if not v1 else ())
    if out is not None:
        _check_out(out, res_shape, res)

    # leading dims broadcast in the binding (stride 0), without views here
    qc, kc, vc = _as_compute(qq, comp), _as_compute(k, comp), _as_compute(vv, comp)
    if mm is not None:
        mdt = np.uint8 if mask_kind == _core.MASK_BOOL else comp
        mm = mm.view(np.uint8) if mask_kind == _core.MASK_BOOL else mm.astype(comp, copy=False)
        if any(s % mm.itemsize for s in mm.strides):
            mm = np.ascontiguousarray(mm, dtype=mdt)

    lse = np.empty(lead + (n_q,), comp) if return_lse else None
    direct = out is not None and _direct_out(out, comp) and not _overlaps(out, q, k, v, mask)
    if direct:
        target = out
        if q1:
            target = target[..., None, :] if not v1 else target[..., None]
        if v1:
            target = target[..., None]
    else:
        target = np.empty(full_shape, comp)

    if target.size or lse is not None:
        _core.attention(qc, kc, vc, mm, mask_kind, target, lse, lead, causal, scale, nthreads)

    if direct:
        result = out
    else:
        result = target
        if v1:
            result = result[..., 0]
        if q1:
            result = result[..., 0, :] if not v1 else result[..., 0]
        if out is None:
            result = result.astype(res, copy=False)
        else:
            np.copyto(out, result, casting="same_kind")
            result = out
    if return_lse:
        return result, (lse[..., 0] if q1 else lse)
    return result
