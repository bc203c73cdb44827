"""fastattn.softmax: a numerically stable softmax over one or more axes, by the C core."""

from __future__ import annotations

import math
import operator
from typing import Any, Optional, Tuple, Union

import numpy as np
from numpy.typing import ArrayLike, NDArray

from . import _core
from ._validate import _as_compute, _asarray, _check_input_dtype, _check_out, _direct_out, _dtypes

__all__ = ["softmax"]


def softmax(x: ArrayLike, axis: Union[int, Tuple[int, ...], None] = -1, *,
            out: Optional[np.ndarray] = None) -> NDArray[Any]:
    """Numerically stable softmax along `axis`, computed by the C core.

    Parameters
    ----------
    x : array_like
        Real floating, integer or bool.  float16 (and ml_dtypes' bfloat16) is
        computed in float32 and returned in its own dtype; integers and bool
        give float64.
    axis : int, tuple of ints or None, default -1
        The axis along which the entries sum to 1; with a tuple, the entries
        of those axes together sum to 1 (None: all axes, as in
        scipy.special.softmax; (): each entry alone).
    out : ndarray, optional
        Array of the result's exact shape (any strides, any dtype the result
        casts to under NumPy's same_kind rule) to fill.

    Returns
    -------
    ndarray
        exp(x - max) / sum(exp(x - max)) along `axis`.  A slice whose entries
        are all -inf gives zeros (not NaN); NaN propagates to its slice.
        Extreme entries (±1e30, -inf) are handled without overflow.

    Raises
    ------
    TypeError
        For complex, object, string or datetime input, or an `out` whose dtype the
        result does not cast to (same_kind: an integer or bool out).
    numpy.exceptions.AxisError
        For an axis out of range (a ValueError and an IndexError).
    ValueError
        For an `out` of the wrong shape or a read-only `out`, a repeated axis,
        or an int axis of a 0-d x.

    Examples
    --------
    >>> import numpy as np, fastattn
    >>> fastattn.softmax(np.array([1.0, 2.0, 3.0])).round(4)
    array([0.09  , 0.2447, 0.6652])
    """
    x = _asarray(x, "x")
    _check_input_dtype(x, "x")
    res, comp = _dtypes(x, half_result=True)
    if isinstance(axis, tuple) or axis is None:
        axes = tuple(range(x.ndim)) if axis is None else tuple(_normalize_axis(a, x.ndim) for a in axis)
        if len(set(axes)) < len(axes):
            raise ValueError(f"duplicate value in axis {axis}")
        if len(axes) != 1:
            return _softmax_axes(x, axes, res, comp, out)
        axis = axes[0]
    if x.ndim == 0:
        raise ValueError("softmax needs at least one axis; x is a scalar")
    axis = _normalize_axis(axis, x.ndim)
    if out is not None:
        _check_out(out, x.shape, res)
    xc = np.moveaxis(_as_compute(x, comp, unit_last=False), axis, -1)
    if out is not None and _direct_out(out, comp, unit_last=False) and (
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


def _softmax_axes(x: np.ndarray, axes: Tuple[int, ...], res: np.dtype, comp: np.dtype,
                  out: Optional[np.ndarray]) -> NDArray[Any]:
    """softmax over several axes (or none) of x: those axes moved last and
    flattened into one (a copy where the layout needs it), then put back.
    Into out: the compute dtype's values, cast once."""
    if out is not None:
        _check_out(out, x.shape, res)
    rest = [i for i in range(x.ndim) if i not in axes]
    perm = rest + sorted(axes)
    xt = np.transpose(x, perm)
    rows = xt.reshape(xt.shape[:len(rest)] + (math.prod(xt.shape[len(rest):]),))
    if out is not None:
        rows = _as_compute(rows, comp, unit_last=False)
    result = np.transpose(softmax(rows).reshape(xt.shape), np.argsort(perm))
    if out is None:
        return result
    np.copyto(out, result, casting="same_kind")
    return out


def _normalize_axis(axis: Any, ndim: int) -> int:
    if isinstance(axis, (bool, np.bool_)):
        raise TypeError("axis must be an int, got a bool")
    try:
        axis = operator.index(axis)
    except TypeError:
        raise TypeError(f"axis must be an int, got {type(axis).__name__}") from None
    if not -ndim <= axis < ndim:
        raise np.exceptions.AxisError(axis, ndim)
    return axis % ndim


def _same_view(a, b):
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.strides == b.strides and a.shape == b.shape)
