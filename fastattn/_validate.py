"""Array conversion and argument checks, shared by the public functions.

Everything a user can get wrong is checked before any work and raised as
ValueError (shapes, values) or TypeError (dtypes); the C core then trusts its
arguments.  Inputs are never modified.  Here: arrays in (_asarray, _as_array),
dtypes (_check_input_dtype, _dtypes) and the compute copy the C core reads
(_as_compute), the scalar options (num_threads, causal, scale, window,
softcap, alibi_slopes, kv_lengths / q_lengths, layout) and out= (_check_out,
_direct_out).  Shape checks of one call are in _prepare.py.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Literal, Optional, Tuple, Union

import numpy as np

from . import _core
from .reference import default_scale

_F16, _F32, _F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
_BOOL = np.dtype(bool)

Window = Tuple[Optional[int], Optional[int]]
Causal = Union[bool, Literal["lower_right", "upper_left"]]
Layout = Literal["bhld", "blhd"]


def _asarray(x: Any, name: str) -> np.ndarray:
    """np.asarray(x), refusing a np.ma.MaskedArray: asarray would drop its mask and
    compute with the data under it."""
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(f"{name} is a numpy.ma.MaskedArray, whose mask fastattn would ignore: pass "
                        f"{name}.filled(value) (a plain array), or express the masked entries as a bool "
                        f"mask= (True = may attend)")
    return np.asarray(x)


def _broadcast_shapes(*shapes: Tuple[int, ...]) -> Tuple[int, ...]:
    """np.broadcast_shapes for any number of dims (NumPy's stops at 32 with a
    RuntimeError); a ValueError when they do not broadcast."""
    n = max(map(len, shapes), default=0)
    out = [1] * n
    for sh in shapes:
        for i, x in enumerate(sh, n - len(sh)):
            if x != 1:
                if out[i] not in (1, x):
                    raise ValueError(f"shapes {shapes} do not broadcast")
                out[i] = x
    return tuple(out)


def _as_array(a: Any, name: str) -> np.ndarray:
    if a is None:
        raise TypeError(f"{name} must be an array, got None")
    a = _asarray(a, name)
    _check_input_dtype(a, name)
    return a


# ---------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------
def _bf16() -> Optional[np.dtype[Any]]:
    """ml_dtypes' bfloat16, when ml_dtypes is imported (an array can hold it only then;
    fastattn never imports it), else None."""
    return _core.bfloat16_dtype()


def _is_half(dt: np.dtype[Any]) -> bool:
    """float16 (either byte order) or bfloat16: 16-bit floats, computed in float32."""
    if dt.kind == "f":
        return dt.itemsize == 2
    bf = _bf16() if dt.kind == "V" else None
    return bf is not None and dt == bf


def _native_half(dt: np.dtype[Any]) -> bool:
    """A 16-bit float the C core reads as stored: float16 or bfloat16 in this
    machine's byte order."""
    return _is_half(dt) and dt.isnative


def _check_input_dtype(a, name):
    dt = a.dtype
    if _is_half(dt):
        return
    if dt.kind == "f" and dt.itemsize > 8:
        raise TypeError(f"{name} has dtype {dt}; fastattn computes in float32 or float64, "
                        f"cast it with .astype(np.float64)")
    if dt.kind not in "fiub":
        raise TypeError(f"{name} has dtype {dt}; fastattn takes real floating, integer or bool "
                        f"arrays (complex, object, string and datetime are not supported)")


def _dtypes(*arrays: Any, half_result: bool = False) -> tuple[np.dtype[Any], np.dtype[Any]]:
    """(result dtype, compute dtype) of NumPy's promotion of the inputs, where 16-bit
    floats (float16, bfloat16) compute in float32 and give float32 results; with
    half_result one array of 16-bit floats gives its own dtype (softmax)."""
    res = np.result_type(*(_F32 if _is_half(a.dtype) else a for a in arrays))
    if res.kind != "f":  # integer and bool compute in float64, as NumPy does
        res = _F64
    comp = _F32 if res == _F32 else _F64
    if half_result and len(arrays) == 1 and _is_half(arrays[0].dtype):
        res = arrays[0].dtype
    return res, comp


def _readable(a: np.ndarray, unit_last: bool) -> bool:
    """Can the C core address `a` as it is: aligned to its dtype (an unpickled
    buffer may not be), strides in whole elements and, if unit_last, a contiguous
    last axis?"""
    if not a.flags.aligned:
        return False
    if a.flags.c_contiguous:
        return True
    if unit_last and a.ndim and a.shape[-1] > 1 and a.strides[-1] != a.itemsize:
        return False
    return all(s % a.itemsize == 0 for s in a.strides)


def _as_compute(a: np.ndarray, dtype: Any, unit_last: bool = True) -> np.ndarray:
    """`a` in `dtype`, copied only when the C core could not read it as it is
    (leading and row strides, zero and negative ones included, are read in place).
    A conversion copies one entry of each broadcast (stride-0) axis and broadcasts
    the copy again: a float64 key-padding mask broadcast to (n_q, n_k) stays n_k
    numbers for float32 inputs, not an n_q x n_k copy."""
    if a.dtype != dtype and a.size > 1 and 0 in a.strides:
        a = np.broadcast_to(_widen_or_cast(_broadcast_core(a), dtype), a.shape)
    else:
        a = _widen_or_cast(a, dtype)
    if _readable(a, unit_last):
        return a
    return np.ascontiguousarray(a) if a.flags.aligned else np.array(a, order="C")   # a fresh, aligned copy


def _widen_or_cast(a: np.ndarray, dtype: Any) -> np.ndarray:
    """a.astype(dtype, copy=False), but a C-contiguous float16 or bfloat16 `a` to float32
    by the C core's SIMD widening, which NumPy's float16 cast is many times slower than
    (docs/tuning.md, vload_kv)."""
    if dtype == _F32 and a.size and a.flags.c_contiguous and a.flags.aligned and _native_half(a.dtype):
        return _core.kv_widen(a.reshape(-1)).reshape(a.shape)
    return a.astype(dtype, copy=False)


def _broadcast_core(a: np.ndarray) -> np.ndarray:
    """`a` with each broadcast (stride-0) axis cut to length 1: its distinct entries."""
    return a[tuple(slice(0, 1) if st == 0 else slice(None) for st in a.strides)]


# ---------------------------------------------------------------------------
# scalar arguments
# ---------------------------------------------------------------------------
def _int_or_none(x, what):
    """x as an int (None stays None); TypeError "{what}, got ..." for a bool
    or anything that is not an integer."""
    if x is None:
        return None
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{what}, got a bool")
    try:
        return operator.index(x)
    except TypeError:
        raise TypeError(f"{what}, got {type(x).__name__}") from None


def _real(x, what):
    """x as a float: a real number (Python's or NumPy's, or a 0-d array of one).
    TypeError "{what}, got ..." for a str, a bool, a complex number or anything
    else, where float() would parse "1", take True as 1 or drop an imaginary part."""
    kind = x.dtype.kind if isinstance(x, (np.ndarray, np.generic)) else None
    if (isinstance(x, (bool, str, bytes, complex)) or kind not in (None, "i", "u", "f")
            or (isinstance(x, np.ndarray) and x.ndim != 0)):
        raise TypeError(f"{what}, got {type(x).__name__}" + (f" of dtype {x.dtype}" if kind else ""))
    try:
        return float(x)
    except (TypeError, ValueError):
        raise TypeError(f"{what}, got {type(x).__name__}") from None


def _num_threads(n):
    """num_threads as the C core takes it (0: the OpenMP default), with
    scikit-learn's meaning: None the default, n > 0 that many, n < 0 the
    default team size plus n + 1 (-1 all of it, -2 one fewer; at least 1)."""
    what = "num_threads must be None or a nonzero int (-1: the default team size)"
    n = _int_or_none(n, what)
    if n is None:
        return 0
    if n == 0:
        raise ValueError(f"{what}, got 0")
    if n < 0:
        n = max(1, _core.max_threads() + n + 1)  # read per call: OMP_NUM_THREADS, threadpoolctl
    return min(n, _core.thread_cap())


def _causal(causal):
    """causal as (on, top_left): False (None too), True or "lower_right" (aligned
    bottom-right), "upper_left" (aligned top-left, PyTorch's is_causal)."""
    if isinstance(causal, str):
        if causal in ("lower_right", "upper_left"):
            return True, causal == "upper_left"
        raise ValueError(f'causal must be False, True, "lower_right" or "upper_left", got {causal!r}')
    if causal is None:
        return False, False
    if isinstance(causal, (bool, np.bool_)) or (isinstance(causal, (int, np.integer)) and causal in (0, 1)):
        return bool(causal), False
    raise TypeError(f'causal must be False, True, "lower_right" or "upper_left", got {type(causal).__name__} '
                    f"{causal!r}")


def _slopes(alibi_slopes, comp):
    """alibi_slopes as a C-contiguous array of the compute dtype (None stays None;
    a scalar stays 0-d), checked to be real numbers."""
    if alibi_slopes is None:
        return None
    s = _asarray(alibi_slopes, "alibi_slopes")
    if s.dtype.kind not in "fiu" or s.dtype.itemsize > 8:
        raise TypeError(f"alibi_slopes must be real numbers, got dtype {s.dtype}")
    return np.require(s, comp, ["C", "A"])


def _scale(scale, d_k):
    if scale is None:
        return default_scale(d_k)
    s = _real(scale, "scale must be a real number")
    if not math.isfinite(s):
        raise ValueError(f"scale must be finite, got {s}")
    return s


def _window(window, reach):
    """(left, right) with -1 for an unbounded side.  A side of `reach` or more
    (wider than any query-key distance, which is below n_q + n_k) is unbounded:
    that also keeps the C core's p - left and p + right within int64."""
    if window is None:
        return -1, -1
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window must be None or a pair (left, right), got {window!r}") from None

    def side(x, name):
        x = _int_or_none(x, f"window {name} must be None or an int")
        return x if x is not None and 0 <= x < reach else -1

    return side(left, "left"), side(right, "right")


def _softcap(softcap):
    if softcap is None:
        return 0.0
    c = _real(softcap, "softcap must be None or a positive number")
    if not (c > 0 and math.isfinite(c)):
        raise ValueError(f"softcap must be None or a positive finite number, got {softcap!r}")
    return c


def _lengths(x, name, axis, n):
    """kv_lengths or q_lengths as int64 (None stays None), checked to be integers
    in [0, n] (n = n_k or n_q, named `axis`)."""
    if x is None:
        return None
    a = _asarray(x, name)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integers, got dtype {a.dtype}")
    if a.size and (a.min() < 0 or a.max() > n):
        raise ValueError(f"{name} must lie in [0, {axis}={n}], got values from {a.min()} to {a.max()}")
    return np.require(a, np.int64, ["C", "A"])


def _blhd(layout):
    """Whether `layout` ("bhld", the default, or "blhd") puts the heads after the
    positions: (..., n, H, d), as flash-attn and JAX lay out q, k, v and out."""
    if not isinstance(layout, str):
        raise TypeError(f'layout must be "bhld" or "blhd", got {type(layout).__name__}')
    if layout.lower() not in ("bhld", "blhd"):
        raise ValueError(f'layout must be "bhld" (..., H, n, d) or "blhd" (..., n, H, d), got {layout!r}')
    return layout.lower() == "blhd"


def _heads_first(arrays, names):
    """(..., n, H, d) arrays (layout "blhd") as (..., H, n, d) views."""
    views = []
    for a, name in zip(arrays, names):
        a = _as_array(a, name)
        if a.ndim < 3:
            raise ValueError(f'layout="blhd" takes {name} of shape (..., n, H, d), got shape {a.shape}')
        views.append(a.swapaxes(-3, -2))
    return views


# ---------------------------------------------------------------------------
# out=
# ---------------------------------------------------------------------------
def _self_overlapping(a: np.ndarray) -> bool:
    """Do two elements of `a` share memory (a stride-0 view, overlapping strides)?
    Checked by the strides from the smallest: each dim's copies of the block below
    it are apart when its stride is at least that block's extent; otherwise (a rare
    interleaved layout) by the elements' byte offsets, up to 2^22 elements (more
    such elements count as overlapping: refused)."""
    dims = sorted((abs(st), n) for st, n in zip(a.strides, a.shape) if n > 1)
    if a.size == 0:
        return False
    if dims and dims[0][0] == 0:
        return True
    extent = a.itemsize
    for st, n in dims:
        if st < extent:
            break
        extent += st * (n - 1)
    else:
        return False
    if a.size > 1 << 22:    # too many offsets to list: refused as if they overlapped
        return True
    offs = np.zeros(1, np.int64)
    for st, n in dims:
        offs = (offs[:, None] + np.arange(n, dtype=np.int64) * st).ravel()
    offs.sort()
    return bool((np.diff(offs) < a.itemsize).any())


def _check_out(out, shape, dtype):
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy.ndarray, got {type(out).__name__}")
    if out.shape != tuple(shape):
        raise ValueError(f"out has shape {out.shape}, the result has shape {tuple(shape)}")
    if not np.can_cast(dtype, out.dtype, "same_kind"):   # NumPy's rule for out=
        raise TypeError(f"out has dtype {out.dtype}, which the result's dtype {dtype} does not cast to "
                        "under NumPy's same_kind rule (any float or complex dtype does)")
    if not out.flags.writeable:
        raise ValueError("out is read-only")
    if _self_overlapping(out):
        raise ValueError(f"out's elements overlap one another (strides {out.strides} for shape {out.shape}, "
                         "a view such as np.broadcast_to or as_strided gives): each result needs its own memory")


def _overlaps(out, *arrays):
    """Might `out` share memory with an input?  (A bounds check: cheap and
    conservative; an overlap means the result goes through a temporary.)"""
    return any(isinstance(a, np.ndarray) and np.may_share_memory(out, a) for a in arrays)


def _direct_out(out, comp, unit_last=True):
    """Can the C core write into `out` as it is?"""
    return out.dtype == comp and _readable(out, unit_last)
