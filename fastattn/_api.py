"""The public API: validate, convert, call the C core.

Everything a user can get wrong is checked here, before any work, and raised
as ValueError (shapes, values) or TypeError (dtypes).  The C core then trusts
its arguments.  Inputs are never modified.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Literal, Optional, Sequence, Tuple, Union, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

from . import _core
from .reference import default_scale

# GQA: up to _FOLD_ROWS query rows (up to _FOLD_ROWS_BIG where K and V hold at least
# _FOLD_BIG_BYTES, on the AVX2 and AVX-512 paths), a group's query heads become the rows
# of one work item over their K and V, read once for the group (see _prepare); beyond
# that one item per head is the faster (docs/tuning.md: the GQA fold).
_FOLD_ROWS = 8
_FOLD_ROWS_BIG, _FOLD_BIG_BYTES = 12, 4 << 20

__all__ = ["attention", "attention_varlen", "attention_weights", "merge_attention", "softmax"]

_F16, _F32, _F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
_BOOL = np.dtype(bool)


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


def _dtypes(*arrays: Any) -> tuple[np.dtype[Any], np.dtype[Any]]:
    """(result dtype, compute dtype) of NumPy's promotion of the inputs."""
    res = np.result_type(*arrays)
    if res.kind != "f":  # integer and bool compute in float64, as NumPy does
        res = _F64
    comp = _F32 if res in (_F16, _F32) else _F64
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
        a = np.broadcast_to(_broadcast_core(a).astype(dtype), a.shape)
    else:
        a = a.astype(dtype, copy=False)
    if _readable(a, unit_last):
        return a
    return np.ascontiguousarray(a) if a.flags.aligned else np.array(a, order="C")   # a fresh, aligned copy


def _broadcast_core(a: np.ndarray) -> np.ndarray:
    """`a` with each broadcast (stride-0) axis cut to length 1: its distinct entries."""
    return a[tuple(slice(0, 1) if st == 0 else slice(None) for st in a.strides)]


# ---------------------------------------------------------------------------
# float masks of only 0 and -inf (or a large negative number)
# ---------------------------------------------------------------------------
# Such a mask (np.triu(np.full((n, n), -np.inf), 1), np.where(keep, 0.0, -np.inf)) is
# handed to the C core as the bool mask `mask == 0` where that gives the same result:
# s + 0 = s, and s + -inf = -inf is what a False does, unless a score s is NaN or +inf
# (then s + -inf is NaN, which the row must get).  So only when no score can be: q and k
# finite with d_k * max|q * scale| * max|k| within half the dtype's range (as the C core's
# scores_bounded) and ALiBi slopes finite.  A bool mask is a quarter of float32's bytes
# (an eighth of float64's, and float32 inputs then need no converted copy of a float64
# mask), and the C core tests a bool tile for all True or all False in one pass.  The
# check and the bool copy take one threaded pass over the mask's distinct entries in C
# (_core.mask_keep; NumPy's four passes for a mask that is not C-contiguous) and two
# over q and k, so a mask goes to bool only where the call reads it again and again,
# for every query row and key (2 * scores >= 3 * entries + 2 * (q + k) elements, a
# rule set when the check took three NumPy passes, kept as a margin; a mask shared by
# the heads): a key-padding mask is read as cheaply as a float one.
# mask_keep against NumPy's passes, in one process: 1.08-1.10x for the whole call with
# float32 inputs (conversion 2.05 -> 0.84 ms, float64 mask 2.94 -> 1.33), 1.03-1.05x
# with float64 inputs.
# Against the float path in one process (AVX-512, two threads), B1 H8 N2048 d64 with
# a causal mask: float32 inputs 1.12x (float32 mask, 33.3 -> 29.8 ms) and 1.23x
# (float64 mask, 37.6 -> 30.5); float64 inputs 1.19-1.22x; H32 N1024 d128 1.08x.
# Key padding, a mask per head, BERT and decoding stay float: 0.97-1.02x.  Tests turn
# it off (_FLOAT_MASKS_AS_BOOL) to reach the C core's float path with such masks too.
_FLOAT_MASKS_AS_BOOL = True

# Masks written with a large finite negative number for "hidden" (Hugging Face's
# np.finfo(dtype).min, -1e9, -10000.0) act as the same bool mask where each hidden
# entry's weight exp(s + c - max) underflows to exactly 0 and the row's max is that of
# its visible scores: every |score| is at most `bound` (as above; ALiBi adds at most
# max|slope| * (n_q + n_k)), so c <= -(2 * bound + _HIDDEN_MARGIN) gives an exponent
# below -1024 (exp underflows to 0 below -746 in float64, -104 in float32), and each
# row that holds such a c holds a 0 too.  Then only where nothing else hides keys (no
# causal, window, kv_lengths or q_lengths, which could hide a row's 0s and leave it a
# softmax over its c + s) and v is finite (a key the row sees adds its NaN or inf even
# at weight 0, see reference._weighted_values).  B1 H8 N2048 d64 float32, one
# process: a causal np.finfo(np.float32).min mask 53.0 -> 25.7 ms; 90 % visible at
# random 49.4 -> 47.1 ms.
# A row without a 0 (a padding query row of such a mask: Hugging Face's eager masks
# with left padding) attends every key alike where it is one constant c that absorbs
# every score (c + s == c, in float64 and so in float32: |c| >= _PAD_ABSORB * bound):
# its output is then the mean of v over the keys and its lse c + log(n_k), which _call
# writes after the C core has left the row empty (all False).  Another row without a
# 0 keeps the whole mask float.  Causal finfo.min masks with left padding (1 to 300
# padding rows a sequence), against the float path in one process: B4 H8 N1024 d64
# float32 51.7 -> 26.4 ms, float64 107.4 -> 50.3, B2 H12 N512 1.81x; without padding
# rows 1.00x.  (The mean of v, 0.7 ms of the 26.4, covers every leading index.)
_HIDDEN_MARGIN = 1024.0
_PAD_ABSORB = 2.0 ** 56   # c + s rounds to c in float64 where |s| < |c| 2^-55


def _hidden_floor(p: Any, slopes: Optional[np.ndarray], bound: float) -> Tuple[float, float]:
    """The largest mask value that acts as a False in this call (see above), and the
    largest constant of a padding row: -inf unless finite ones can."""
    if p.causal or p.win_left >= 0 or p.win_right >= 0 or p.kvl is not None or p.qln is not None:
        return -math.inf, -math.inf
    if slopes is not None:
        bound += _abs_max(slopes) * (p.n_q + p.n_k)
    if not _abs_max(p.v, p.nthreads) < math.inf:
        return -math.inf, -math.inf
    floor = -(2.0 * bound + _HIDDEN_MARGIN)
    return floor, min(floor, -_PAD_ABSORB * bound)


def _abs_max(x: np.ndarray, nthreads: int = 0) -> float:
    """max |x| as a Python float; inf when x holds NaN; 0 when empty.  One threaded
    pass in C for a C-contiguous float32 or float64 x (NumPy's max and min take two
    on one thread): the conversion's checks at B4 H8 N1024 d64 float32 (q, k, v and a
    (B, 1, N, N) mask) took 2.1 ms, not 3.5."""
    if x.size == 0:
        return 0.0
    if x.flags.c_contiguous and x.flags.aligned and (x.dtype == _F32 or x.dtype == _F64):
        m = _core.abs_max(x, nthreads)
        return math.inf if math.isnan(m) else m
    hi, lo = float(x.max()), float(x.min())
    return math.inf if math.isnan(hi) or math.isnan(lo) else max(hi, -lo)


def _pays(n_scores: int, mask_entries: int, qk_size: int) -> bool:
    """Does reading a mask of mask_entries as bool pay in a call of n_scores scores
    with q.size + k.size == qk_size?  The gain (score reads of the mask) against the
    cost (passes over the mask, q and k): see above."""
    return 2 * n_scores >= 3 * mask_entries + 2 * qk_size


def _may_pay(mask_shape: Tuple[int, ...], n_scores: int, n_q: int, n_k: int, qk_size: int) -> bool:
    """Could the conversion of a float mask of this shape pay in a call of n_scores
    scores over n_q x n_k and q.size + k.size == qk_size?  The two tests of
    _mask_as_bool below, first with the fewest entries the mask can have."""
    return mask_shape[-2] > 1 and mask_shape[-1] > 1 and _pays(n_scores, n_q * n_k, qk_size)


def _mask_as_bool(mm: np.ndarray, p: Any, slopes: Optional[np.ndarray]) -> Optional[Tuple[np.ndarray, Any]]:
    """The bool mask that the float mask `mm` (shape (..., n_q | 1, n_k | 1)) acts as in
    this call (see above), broadcast to mm's shape, and its padding rows (None, or
    (rows, c): bool of mm.shape[:-1] and their constants, broadcast alike); None
    where it has another value or the call could form a NaN or +inf score."""
    n_scores, qk_size = math.prod(p.lead) * p.n_q * p.n_k, p.q.size + p.k.size
    if not _may_pay(mm.shape, n_scores, p.n_q, p.n_k, qk_size):
        return None
    core = _broadcast_core(mm)
    if core.shape[-2] < 2 or core.shape[-1] < 2:
        return None  # a key-padding (or per-row) mask: the float path reads it as cheaply
    if not _pays(n_scores, core.size, qk_size):
        return None

    def keep_of(x, floor, pad_floor=-math.inf):
        """(x == 0, padding rows or None) where every entry of x is 0 or at most floor
        and each row holding a finite one holds a 0 or (pad_floor > -inf) is one
        constant at most pad_floor throughout (as _core.mask_keep), else None."""
        pad = np.empty(x.shape[:-1], bool) if pad_floor > -math.inf else None  # every row written
        if x.flags.c_contiguous and x.flags.aligned and (x.dtype == _F32 or x.dtype == _F64):
            keep = np.empty(x.shape, bool)
            if not _core.mask_keep(x, keep, floor, p.nthreads, pad, pad_floor):  # one pass, threaded
                return None
            return keep, pad
        zero, low = x == 0, x <= np.float64(floor)  # (a float64 scalar: float16 holds no -1e20)
        if np.count_nonzero(zero) + np.count_nonzero(low) != x.size:
            return None
        if floor > -math.inf:
            bad = ~zero.any(axis=-1) & (low & (x != -math.inf)).any(axis=-1)
            if pad is not None:
                pad = bad & (x == x[..., :1]).all(axis=-1) & (x[..., 0] <= np.float64(pad_floor))
                bad &= ~pad
            if bad.any():
                return None
        return zero, pad

    last = core[..., -1, :]  # a float bias fails here, on one row
    neginf_only = keep_of(last, -math.inf) is not None
    if not neginf_only and keep_of(last, -_HIDDEN_MARGIN) is None:
        return None
    if slopes is not None and not np.isfinite(slopes).all():
        return None
    bound = p.q.shape[-1] * _abs_max(p.q, p.nthreads) * abs(p.scale) * _abs_max(p.k, p.nthreads)  # |score| at most
    if not bound <= 0.5 * float(np.finfo(p.comp).max):
        return None  # (not <=: scale 0 times an inf is NaN, and 0 * inf is a NaN score)
    got = keep_of(core, -math.inf) if neginf_only else None
    if got is None:  # a large finite negative number for hidden (its floor needs a pass over v)
        floor, pad_floor = _hidden_floor(p, slopes, bound)
        if floor == -math.inf:
            return None
        got = keep_of(core, floor, pad_floor)
        if got is None:
            return None
    keep, pad = got
    pads = None
    if pad is not None:
        with np.errstate(over="ignore"):
            c = core[..., 0].astype(p.comp)
        pad &= c > -math.inf  # a constant beyond the compute dtype's range is -inf there: nothing seen
        if pad.any():
            shape = mm.shape[:-1]
            pads = np.broadcast_to(pad, shape), np.broadcast_to(c, shape)
    return np.broadcast_to(keep, mm.shape), pads


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


# ---------------------------------------------------------------------------
# softmax
# ---------------------------------------------------------------------------
def softmax(x: ArrayLike, axis: Union[int, Tuple[int, ...], None] = -1, *,
            out: Optional[np.ndarray] = None) -> NDArray[Any]:
    """Numerically stable softmax along `axis`, computed by the C core.

    Parameters
    ----------
    x : array_like
        Real floating, integer or bool.  float16 is computed in float32 and
        returned as float16; integers and bool give float64.
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
    res, comp = _dtypes(x)
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


# ---------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------
def _as_array(a: Any, name: str) -> np.ndarray:
    if a is None:
        raise TypeError(f"{name} must be an array, got None")
    a = _asarray(a, name)
    _check_input_dtype(a, name)
    return a


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


def _split_heads(a, name, H, Hkv, core):
    """Split the head axis (the one before the `core` trailing axes) of an
    array broadcastable to (..., H, *core) into (..., Hkv, H // Hkv): a view."""
    if a.ndim <= core:
        return a
    h = a.shape[-core - 1]
    if h == 1:
        return np.expand_dims(a, -core - 1)
    if h != H:
        raise ValueError(f"{name} has {h} heads on axis {-core - 1} (shape {a.shape}); "
                         f"with enable_gqa it must be {H} (the query heads) or 1")
    return a.reshape(a.shape[:-core - 1] + (Hkv, H // Hkv) + a.shape[a.ndim - core:])


class _Prepared:
    """Validated, converted arguments of one attention call."""


def _prepare(q, k, v, mask, causal, scale, enable_gqa, window, softcap, alibi_slopes, kv_lengths,
             num_threads, weights=False, q_lengths=None, blhd=False):
    """Check and convert the arguments of attention and attention_weights (q, k, v
    as (..., H, n, d); blhd: the caller's arrays were (..., n, H, d), and the errors
    name their shapes as given)."""
    def sh(a):
        return a.swapaxes(-3, -2).shape if blhd else a.shape

    p = _Prepared()
    p.pad = None  # padding rows of a float mask read as bool (_mask_as_bool), for _call to fill
    q = _as_array(q, "q")
    k = _as_array(k, "k")
    v = _as_array(v, "v") if v is not None else None
    res, comp = _dtypes(q, k) if weights else _dtypes(q, k, v)
    if q.ndim < 1:
        raise ValueError("q must have shape (..., n_q, d_k) or (d_k,), got a scalar")
    if k.ndim < 2:
        raise ValueError(f"k must have shape (..., n_k, d_k), got shape {k.shape}")
    if v is not None and v.ndim < 1:
        raise ValueError("v must have shape (..., n_k, d_v) or (n_k,), got a scalar")
    p.q1, p.v1 = q.ndim == 1, (v is not None and v.ndim == 1)
    qq = q[None, :] if p.q1 else q
    vv = k if v is None else (v[:, None] if p.v1 else v)
    n_q, d_k = qq.shape[-2:]
    n_k, d_k2 = k.shape[-2:]
    n_k2, d_v = vv.shape[-2:]
    if d_k != d_k2:
        raise ValueError(f"d_k differs: q has shape {sh(q)} (d_k={d_k}), k has shape {sh(k)} (d_k={d_k2})")
    if n_k != n_k2:
        raise ValueError(f"n_k differs: k has shape {sh(k)} (n_k={n_k}), v has shape {sh(v)} (n_k={n_k2})")

    # mask: bool or float, broadcastable to (..., n_q, n_k)
    p.mask_kind = _core.MASK_NONE
    mm = None
    if mask is not None:
        mm = _asarray(mask, "mask")
        if mm.dtype == bool:
            p.mask_kind = _core.MASK_BOOL
        elif mm.dtype.kind == "f" and mm.dtype.itemsize <= 8:
            p.mask_kind = _core.MASK_ADD
        elif mm.dtype.kind in "iu":
            raise TypeError(f"mask has integer dtype {mm.dtype}; use a bool mask (True = may attend) "
                            f"or a float mask (added to the scores), e.g. mask.astype(bool)")
        else:
            raise TypeError(f"mask must be bool or floating, got dtype {mm.dtype}")
        if p.q1:
            mm = mm[..., None, :] if mm.ndim >= 1 else mm
        if mm.ndim < 2:
            mm = mm.reshape((1,) * (2 - mm.ndim) + mm.shape)
        mq, mk = mm.shape[-2:]
        if mq not in (1, n_q) or mk not in (1, n_k):
            hint = ""
            if (not p.q1 and np.ndim(mask) == 2 and mk == n_k and qq.ndim >= 3 and k.ndim >= 3
                    and mq in (qq.shape[0], k.shape[0])):
                hint = ("; a key-padding mask of shape (B, n_k), as PyTorch's key_padding_mask, is "
                        "mask[:, None, None, :] for (B, H, n_q, n_k) scores (True = may attend: "
                        "~key_padding_mask), or pass the lengths as kv_lengths")
            raise ValueError(f"mask of shape {np.shape(mask)} does not broadcast to the scores "
                             f"(..., n_q={n_q}, n_k={n_k})" + (" (1-D q: (..., n_k))" if p.q1 else "") + hint)

    slopes = _slopes(alibi_slopes, comp)
    kvl = _lengths(kv_lengths, "kv_lengths", "n_k", n_k)
    qln = _lengths(q_lengths, "q_lengths", "n_q", n_q)

    # grouped-query attention: query head h uses key/value head h // (H // H_kv)
    p.gqa = None
    if enable_gqa:
        if qq.ndim < 3 or k.ndim < 3 or vv.ndim < 3:
            raise ValueError(f"enable_gqa needs a head axis: q (..., H, n_q, d), k and v (..., H_kv, n_k, d); "
                             f"got q {sh(q)}, k {sh(k)}" + (f", v {sh(v)}" if v is not None else ""))
        H, Hkv = qq.shape[-3], k.shape[-3]
        if vv.shape[-3] != Hkv:
            raise ValueError(f"k and v have different head counts: k {sh(k)}, v {sh(v)}")
        if Hkv == 0 or H % Hkv:
            raise ValueError(f"enable_gqa: the query heads ({H}) must be a multiple of the key/value heads ({Hkv})")
        p.gqa = (H, Hkv)
        qq = qq.reshape(qq.shape[:-3] + (Hkv, H // Hkv) + qq.shape[-2:])     # a view
        k = np.expand_dims(k, -3)                                            # stride 0 over the group
        vv = np.expand_dims(vv, -3)
        if mm is not None:
            mm = _split_heads(mm, "mask", H, Hkv, 2)
        if slopes is not None:
            slopes = _split_heads(slopes, "alibi_slopes", H, Hkv, 0)
        if kvl is not None:
            kvl = _split_heads(kvl, "kv_lengths", H, Hkv, 0)
        if qln is not None:
            qln = _split_heads(qln, "q_lengths", H, Hkv, 0)

    try:
        lq, lk, lv = qq.shape[:-2], k.shape[:-2], vv.shape[:-2]
        if lq == lk == lv and mm is None:
            lead = lq
        else:
            lead = _broadcast_shapes(lq, lk, lv, mm.shape[:-2] if mm is not None else ())
    except ValueError:
        shapes = f"q {sh(q)}, k {sh(k)}" + (f", v {sh(v)}" if v is not None else "") + \
            (f", mask {np.shape(mask)}" if mask is not None else "")
        hint = ""
        if not enable_gqa and min(qq.ndim, k.ndim, vv.ndim) >= 3 and k.shape[-3] == vv.shape[-3] \
                and 0 < k.shape[-3] < qq.shape[-3] and qq.shape[-3] % k.shape[-3] == 0:
            hint = (f" (q has {qq.shape[-3]} heads, {'k and v' if v is not None else 'k'} {k.shape[-3]}: "
                    f"for grouped-query attention pass enable_gqa=True)")
        raise ValueError(f"leading dims do not broadcast: {shapes}{hint}") from None
    given = {"alibi_slopes": alibi_slopes, "kv_lengths": kv_lengths, "q_lengths": q_lengths}
    for arr, name in ((slopes, "alibi_slopes"), (kvl, "kv_lengths"), (qln, "q_lengths")):
        if arr is not None:
            try:
                ok = _broadcast_shapes(arr.shape, lead) == lead
            except ValueError:
                ok = False
            if not ok:
                want = lead if not p.gqa else lead[:-2] + (p.gqa[0],)
                raise ValueError(f"{name} of shape {np.shape(given[name])} "
                                 f"does not broadcast to the leading dims {want}"
                                 + (" (for (B, H, n, d) inputs, per-batch values have shape (B, 1))"
                                    if name != "alibi_slopes" else ""))

    p.scale = _scale(scale, d_k)
    p.nthreads = _num_threads(num_threads)
    p.causal, p.top_left = _causal(causal)
    p.win_left, p.win_right = _window(window, n_q + n_k)
    p.softcap = _softcap(softcap)
    p.res, p.comp, p.lead = res, comp, lead
    p.n_q, p.n_k, p.d_v = n_q, n_k, d_v
    p.q, p.k, p.v = _as_compute(qq, comp), _as_compute(k, comp), _as_compute(vv, comp)
    p.kvl, p.qln = kvl, qln
    if mm is not None and p.mask_kind == _core.MASK_ADD and _FLOAT_MASKS_AS_BOOL:
        got = _mask_as_bool(mm, p, slopes)
        if got is not None:
            (mm, p.pad), p.mask_kind = got, _core.MASK_BOOL
    if mm is not None:  # read with any strides: never expanded, a bool mask never converted
        mm = _as_compute(mm.view(np.uint8) if p.mask_kind == _core.MASK_BOOL else mm,
                         np.uint8 if p.mask_kind == _core.MASK_BOOL else comp, unit_last=False)
    p.mask, p.slopes = mm, slopes
    p.inputs = (q, k, v, mask)
    # GQA decoding: _call hands the C core the query heads of a group as the rows of one
    # item over their K and V (n_q * g rows, position-major: the C core's row_group),
    # which it then reads once, not once per head.  One query row: H32/8 Nk4096-16384
    # d128 2.0-2.9x; 32 heads on one K and V 4.8x.  2-8 rows (speculative decoding,
    # chunked prefill), and up to 12 with large K and V: see the notes at _FOLD_ROWS.
    # Exact where the rows of a group differ only in their queries and positions (causal
    # and windows follow the positions): no ALiBi slopes (per head), kv_lengths and
    # q_lengths the same across the group.
    p.fold = (p.gqa is not None and not weights and p.gqa[0] > p.gqa[1] and _fold_rows(p, n_q)
              and slopes is None and all(x is None or x.ndim == 0 or x.shape[-1] == 1 for x in (kvl, qln)))
    return p


def _fold_rows(p: Any, n_q: int) -> bool:
    """Few enough query rows for the GQA fold (see _FOLD_ROWS)?"""
    if n_q <= _FOLD_ROWS:
        return True
    return (n_q <= _FOLD_ROWS_BIG and _core.isa_name() != "generic"
            and _broadcast_core(p.k).nbytes + _broadcast_core(p.v).nbytes >= _FOLD_BIG_BYTES)


def _plain(q: Any, k: Any, v: Any) -> bool:
    """Is this the common call, which every check of _prepare passes and which
    needs no conversion?  Three ndarrays (not subclasses) of one native float32
    or float64 dtype, C-contiguous, shaped (..., n_q, d_k), (..., n_k, d_k) and
    (..., n_k, d_v) with the same leading dims.  Checked in about 0.6 us,
    where _prepare takes about 2.5 us: most of a small call."""
    if not (type(q) is np.ndarray and type(k) is np.ndarray and type(v) is np.ndarray):
        return False
    dt = q.dtype
    if not (dt == k.dtype and dt == v.dtype and (dt == _F32 or dt == _F64)):
        return False
    qs, ks, vs = q.shape, k.shape, v.shape
    n = len(qs)
    return (n >= 2 and n == len(ks) and qs[-1] == ks[-1] and qs[:-2] == ks[:-2] and ks[:-1] == vs[:-1]
            and q.flags.c_contiguous and k.flags.c_contiguous and v.flags.c_contiguous
            and q.flags.aligned and k.flags.aligned and v.flags.aligned)


def _plain_mask(mask: Any, q: np.ndarray, k: np.ndarray) -> int:
    """The C core's mask kind for the mask of a plain call (see _plain) that it can
    read as it is, else MASK_NONE (the general path then checks, converts or
    refuses it): an ndarray (not a subclass) of dtype bool or of q's dtype, of rank
    2 to q's, broadcastable to the scores (..., n_q, n_k) without adding to or
    growing q's leading dims, with strides in whole elements.  A float mask that
    _mask_as_bool might turn into a bool one goes the general way too."""
    if type(mask) is not np.ndarray:
        return _core.MASK_NONE
    dt = mask.dtype
    kind = _core.MASK_BOOL if dt == _BOOL else _core.MASK_ADD if dt == q.dtype else _core.MASK_NONE
    ms, qs = mask.shape, q.shape
    n = len(ms)
    if kind == _core.MASK_NONE or not 2 <= n <= len(qs):
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
        if _FLOAT_MASKS_AS_BOOL and _may_pay(ms, math.prod(qs[:-1]) * n_k, n_q, n_k, q.size + k.size):
            return _core.MASK_NONE
    return kind


def _plain_out(out: Any, q: Any, k: Any, v: Any) -> bool:
    """Can a plain call write into `out` as it is?  An ndarray (not a
    subclass) of q's dtype and the result's shape, C-contiguous, writeable and
    clear of the inputs; anything else goes the general way (its checks, its
    errors, a temporary when out overlaps an input)."""
    return (type(out) is np.ndarray and out.dtype == q.dtype and out.shape == q.shape[:-1] + v.shape[-1:]
            and out.flags.c_contiguous and out.flags.writeable and out.flags.aligned
            and not (np.may_share_memory(out, q) or np.may_share_memory(out, k) or np.may_share_memory(out, v)))


def _attention_plain(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: Optional[np.ndarray], mask_kind: int,
                     causal: bool, scale: Any, num_threads: Any, out: Optional[np.ndarray],
                     return_lse: bool) -> Any:
    """attention() of a call that _plain (and _plain_out, _plain_mask) accepted:
    the same result as through _prepare (the same C call on the same arrays),
    without its general work."""
    s, nthreads = _scale(scale, q.shape[-1]), _num_threads(num_threads)
    result = np.empty(q.shape[:-1] + v.shape[-1:], q.dtype) if out is None else out
    lse = np.empty(q.shape[:-1], q.dtype) if return_lse else None
    if result.size or lse is not None:
        _core.attention(q, k, v, mask, mask_kind, result, lse, q.shape[:-2], bool(causal), s, nthreads)
    return (result, lse) if return_lse else result


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


def _fold_mask(p):
    """The mask of a folded call (see _prepare), (..., Hkv|1, n_q, g, n_k|1) as
    (..., Hkv|1, n_q * g, n_k|1): a view where the rows' strides allow one (say a
    key-padding mask, the same for every row), else a copy of at most n_q * g rows
    of n_k per K and V head."""
    if p.mask is None:
        return None
    g = p.gqa[0] // p.gqa[1]
    mask = p.mask.reshape((1,) * (3 - p.mask.ndim) + p.mask.shape)
    return _rows(np.broadcast_to(mask, mask.shape[:-3] + (g, p.n_q, mask.shape[-1])), 1)


def _call(p, target, lse, weights=False):
    q, k, v, mask, kvl, qln, lead, g = p.q, p.k, p.v, p.mask, p.kvl, p.qln, p.lead, 1
    rows, rows_lse = target, lse
    if p.fold:  # (see _prepare) q (..., Hkv, g, n_q, d) -> (..., Hkv, n_q * g, d), position-
        # major, rows g apart sharing a position (the C core's row_group); k and v
        # (..., Hkv, 1, n_k, d) -> (..., Hkv, n_k, d); out, lse and the mask alike
        g = p.gqa[0] // p.gqa[1]
        q, k, v, lead, mask = _rows(q, 1), k[..., 0, :, :], v[..., 0, :, :], lead[:-1], _fold_mask(p)
        rows = _rows(target, 1)
        rows_lse = _rows(lse, 0) if lse is not None else None
        if kvl is not None and kvl.ndim:  # (..., Hkv|1, 1)
            kvl = kvl[..., 0]
        if qln is not None and qln.ndim:  # (..., Hkv|1, 1): in positions, as the C core takes it
            qln = qln[..., 0]
    _core.attention(q, k, v, mask, p.mask_kind, rows, rows_lse, lead, p.causal, p.scale, p.nthreads,
                    p.softcap, p.win_left, p.win_right, p.slopes, kvl, weights, g, qln, top_left=p.top_left)
    if rows is not target and not np.may_share_memory(rows, target):
        _unrows(target, rows, 1)  # rows written as a copy (no view of them): back in place
    if rows_lse is not lse and not np.may_share_memory(rows_lse, lse):
        _unrows(lse, rows_lse, 0)
    if p.pad is not None:
        _fill_pad_rows(p, target, lse, weights)


def _fill_pad_rows(p, target, lse, weights):
    """The padding rows of a float mask read as bool (see _mask_as_bool), which the C
    core left empty: each attends every key alike, so its weights are 1 / n_k, its
    output the mean of v over the keys and its lse c + log(n_k)."""
    rows, c = p.pad
    at = np.nonzero(np.broadcast_to(rows, target.shape[:-1]))
    if weights:
        target[at] = p.comp.type(1) / p.comp.type(p.n_k)
    else:
        mean = p.v.mean(axis=-2, dtype=p.comp)[..., None, :]  # (..., 1, d_v), v's leading dims
        target[at] = np.broadcast_to(mean, target.shape)[at]
    if lse is not None:
        lse[at] = np.broadcast_to(c, lse.shape)[at] + p.comp.type(math.log(p.n_k))


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


Window = Tuple[Optional[int], Optional[int]]
Causal = Union[bool, Literal["lower_right", "upper_left"]]
Layout = Literal["bhld", "blhd"]


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
    blhd = _blhd(layout)
    if blhd:   # (..., n, H, d): computed on (..., H, n, d) views, the result written in the caller's layout
        q, k, v = _heads_first((q, k, v), "qkv")
    if (not blhd and type(causal) is bool and not enable_gqa and window is None and softcap is None
            and alibi_slopes is None and kv_lengths is None and q_lengths is None and _plain(q, k, v)
            and (out is None or _plain_out(out, q, k, v) and not _overlaps(out, mask))):
        mask_kind = _core.MASK_NONE if mask is None else _plain_mask(mask, q, k)  # type: ignore[arg-type]
        if mask is None or mask_kind != _core.MASK_NONE:
            return _attention_plain(q, k, v, mask, mask_kind, causal, scale,  # type: ignore[arg-type]
                                    num_threads, out, return_lse)
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
        Keys.
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
        own precision, float16 computes in float32, integers and bool give
        float64.
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
        dtype np.result_type(q, k) (integers and bool give float64).

    Examples
    --------
    >>> import numpy as np, fastattn
    >>> w = fastattn.attention_weights(np.eye(3), np.eye(3), causal=True)
    >>> w.sum(axis=-1)
    array([1., 1., 1.])
    """


def _cu_seqlens(cu, name, total, rows):
    """cu_seqlens as int64 (B + 1,), checked: integers, 0 first, non-decreasing,
    `total` (the packed rows of `rows`) last."""
    if cu is None:
        raise TypeError(f"{name} must be an array of B + 1 integers, got None")
    a = _asarray(cu, name)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"{name} must be 1-D, B + 1 offsets for B sequences, got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integers, got dtype {a.dtype}")
    if a[0] != 0:
        raise ValueError(f"{name} must start at 0, got {a[0]}")
    down = a[1:] < a[:-1]
    if down.any():
        i = int(np.argmax(down))
        raise ValueError(f"{name} must be non-decreasing, got {a[i]} then {a[i + 1]} at index {i}")
    if a[-1] != total:
        raise ValueError(f"{name} must end at the number of packed rows of {rows} ({total}), got {a[-1]}")
    return a.astype(np.int64)


def _max_seqlen(m, name, longest, rows):
    """flash-attn's max_seqlen_q / max_seqlen_k: None, or an int at least the
    longest sequence (flash-attn sizes its launch by it; here it is only checked)."""
    m = _int_or_none(m, f"{name} must be None or an int")
    if m is not None and m < longest:
        raise ValueError(f"{name}={m} is shorter than the longest sequence of {rows} ({longest} rows)")


def attention_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike,
                     max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                     *, causal: Causal = False, scale: Optional[float] = None, out: Optional[np.ndarray] = None,
                     return_lse: bool = False, num_threads: Optional[int] = None,
                     window: Optional[Window] = None, softcap: Optional[float] = None,
                     alibi_slopes: Optional[ArrayLike] = None) -> Any:
    q = _as_array(q, "q")
    k = _as_array(k, "k")
    v = _as_array(v, "v")
    res, comp = _dtypes(q, k, v)
    for a, name, want in ((q, "q", "(total_q, H, d_k)"), (k, "k", "(total_k, H_kv, d_k)"),
                          (v, "v", "(total_k, H_kv, d_v)")):
        if a.ndim != 3:
            raise ValueError(f"{name} must have shape {want}: the sequences' rows packed one after "
                             f"another, got shape {a.shape}")
    T_q, H, d_k = q.shape
    T_k, Hkv, d_k2 = k.shape
    if d_k != d_k2:
        raise ValueError(f"d_k differs: q has shape {q.shape} (d_k={d_k}), k has shape {k.shape} (d_k={d_k2})")
    if v.shape[:2] != k.shape[:2]:
        raise ValueError(f"k and v must have the same rows and heads: k {k.shape}, v {v.shape}")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"the query heads ({H}) must be a multiple of the key/value heads ({Hkv}): "
                         f"q {q.shape}, k {k.shape}")
    cq = _cu_seqlens(cu_seqlens_q, "cu_seqlens_q", T_q, "q")
    ck = _cu_seqlens(cu_seqlens_k, "cu_seqlens_k", T_k, "k and v")
    if cq.size != ck.size:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k give different numbers of sequences: "
                         f"{cq.size - 1} and {ck.size - 1}")
    B, G, d_v = cq.size - 1, H // Hkv, v.shape[2]
    len_q, len_k = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    max_q, max_k = (int(x.max()) if B else 0 for x in (len_q, len_k))
    _max_seqlen(max_seqlen_q, "max_seqlen_q", max_q, "q")
    _max_seqlen(max_seqlen_k, "max_seqlen_k", max_k, "k and v")
    slopes = _slopes(alibi_slopes, comp)
    if slopes is not None:
        try:
            slopes = np.broadcast_to(slopes, (B, H))
        except ValueError:
            raise ValueError(f"alibi_slopes of shape {slopes.shape} does not broadcast to (B, H) = ({B}, {H})") \
                from None
        slopes = np.ascontiguousarray(slopes).reshape(B, Hkv, G)
    scale_ = _scale(scale, d_k)
    nthreads = _num_threads(num_threads)
    causal_, top_left = _causal(causal)
    win_left, win_right = _window(window, max_q + max_k)
    cap = _softcap(softcap)
    if out is not None:
        _check_out(out, (T_q, H, d_v), res)

    # The C core's view: leading dims (B, H_kv, G), a sequence's rows from its start
    # (q_start, kv_start), max_q and max_k rows at most (q_len, kv_len cut them).
    qc, kc, vc = _as_compute(q, comp), _as_compute(k, comp), _as_compute(v, comp)
    direct = out is not None and _direct_out(out, comp) and not _overlaps(out, q, k, v, slopes)
    target: np.ndarray = out if direct and out is not None else np.empty((T_q, H, d_v), comp)
    lse = np.empty((H, T_q), comp) if return_lse else None
    if T_q and H and d_v or lse is not None and lse.size:
        def heads(x):  # (T, H, d) -> (H_kv, G, T, d): a view (an axis split never copies)
            return x.reshape(x.shape[0], Hkv, x.shape[1] // Hkv, x.shape[2]).transpose(1, 2, 0, 3)

        lse_v = None
        if lse is not None:  # (H, T_q) -> (B, H_kv, G, T_q), stride 0 over B (the binding reads every axis)
            l3 = lse.reshape(Hkv, G, T_q)
            lse_v = np.lib.stride_tricks.as_strided(l3, (B,) + l3.shape, (0,) + l3.strides)
        per_seq = (lambda x: np.ascontiguousarray(x, dtype=np.int64).reshape(B, 1, 1))
        if G > 1 and T_q == B and max_q == 1 and slopes is None:
            # Decoding, one query per sequence: q is (B, H, d), and a group's G query heads
            # become the G rows of one item over its K and V (row_group G, as attention's
            # GQA fold), which it then reads once, not once per head (docs/tuning.md).
            def group_rows(x):  # (B, H, d) -> (B, H_kv, G, d): a view
                return x.reshape(B, Hkv, G, x.shape[2])

            if lse is not None:  # (H, B) -> (B, H_kv, G)
                lse_v = lse.reshape(Hkv, G, T_q).transpose(2, 0, 1)
            _core.attention(group_rows(qc), kc.transpose(1, 0, 2), vc.transpose(1, 0, 2), None, _core.MASK_NONE,
                            group_rows(target), lse_v, (B, Hkv), causal_, scale_, nthreads, cap, win_left,
                            win_right, None, len_k.reshape(B, 1), False, G, None, None,
                            ck[:-1].reshape(B, 1), G, max_k, top_left)
        else:
            _core.attention(heads(qc), heads(kc), heads(vc), None, _core.MASK_NONE, heads(target), lse_v,
                            (B, Hkv, G), causal_, scale_, nthreads, cap, win_left, win_right, slopes,
                            per_seq(len_k), False, 1, per_seq(len_q), per_seq(cq[:-1]), per_seq(ck[:-1]),
                            max_q, max_k, top_left)
    result: np.ndarray
    if direct:
        assert out is not None
        result = out
    elif out is not None:
        np.copyto(out, target, casting="same_kind")
        result = out
    else:
        result = target.astype(res, copy=False)
    return (result, lse) if return_lse else result


attention_varlen.__doc__ = """Attention over packed sequences of different lengths (flash-attn's varlen form).

    Sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and rows
    cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k and v; each attends only within
    itself, as if alone.  No padding is stored or computed.

    Parameters
    ----------
    q : array_like, shape (total_q, H, d_k)
        The sequences' query rows, packed one after another.
    k : array_like, shape (total_k, H_kv, d_k)
    v : array_like, shape (total_k, H_kv, d_v)
        H a multiple of H_kv: query head h uses key/value head h // (H // H_kv)
        (grouped-query attention, as in flash_attn_varlen_func).
    cu_seqlens_q, cu_seqlens_k : array_like of int, shape (B + 1,)
        Cumulative lengths: 0, then each sequence's end; the last is total_q
        (total_k).  Empty sequences are allowed.
    max_seqlen_q, max_seqlen_k : int, optional
        flash-attn's arguments of these places, so that its calls carry over:
        the longest query (key) sequence or more.  Only checked: fastattn
        finds the lengths itself.
    causal : bool or str, default False
        Per sequence, aligned bottom-right: query i of a sequence with n_q
        queries and n_k keys sees key j iff j <= i + n_k - n_q; "upper_left":
        iff j <= i (as for `attention`).
    scale : float, optional
        Default 1/sqrt(d_k).
    out : ndarray, optional
        (total_q, H, d_v), any strides and any dtype the result casts to under
        NumPy's same_kind rule, filled and returned.
    return_lse : bool, default False
        Also return lse, shape (H, total_q) (flash-attn's layout), in the
        compute dtype.
    num_threads : int, optional
        As for `attention`.
    window, softcap
        As for `attention`, per sequence.
    alibi_slopes : array_like, optional
        Broadcastable to (B, H).

    Returns
    -------
    out : ndarray, shape (total_q, H, d_v)
        dtype np.result_type(q, k, v) (float16 computes in float32, integers
        and bool give float64).  A query that sees no key (an empty key
        sequence, an empty window) gives zeros, lse -inf.
    lse : ndarray, shape (H, total_q)
        Only with return_lse=True.

    Raises
    ------
    ValueError
        q, k, v not 3-D or of shapes that do not fit, cu_seqlens not starting
        at 0, decreasing, not ending at total_q (total_k), or of different
        lengths; max_seqlen_q (max_seqlen_k) below the longest sequence;
        alibi_slopes not broadcastable to (B, H); out of the wrong shape.
    TypeError
        cu_seqlens or max_seqlen not integers; dtypes as for `attention`.

    Examples
    --------
    Two sequences, of 3 and 2 tokens, packed into 5 rows:

    >>> import numpy as np, fastattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((5, 4, 16)) for _ in range(3))   # (total, H, d)
    >>> cu = np.array([0, 3, 5])
    >>> out = fastattn.attention_varlen(q, k, v, cu, cu, causal=True)
    >>> alone = fastattn.attention(q[3:].transpose(1, 0, 2), k[3:].transpose(1, 0, 2),
    ...                            v[3:].transpose(1, 0, 2), causal=True)
    >>> bool(np.allclose(out[3:], alone.transpose(1, 0, 2)))
    True
    """


def merge_attention(outs: Sequence[ArrayLike], lses: Sequence[ArrayLike], *,
                    layout: Layout = "bhld") -> tuple[NDArray[Any], NDArray[Any]]:
    """Combine attention results over disjoint sets of keys into the result
    over their union, by the logsumexp rule.

    Parameters
    ----------
    outs : sequence of array_like, each (..., n_q, d_v)
        Outputs of `attention` over each set of keys.
    lses : sequence of array_like, each (..., n_q)
        Their lse (`return_lse=True`).
    layout : {"bhld", "blhd"}, default "bhld"
        As for `attention`: with "blhd" the outputs (and the result) are
        (..., n_q, H, d_v) and the lse (..., H, n_q), as `attention` returns
        them in that layout.

    Returns
    -------
    out : ndarray, shape (..., n_q, d_v)
        sum_p exp(lse_p - lse) * out_p.  A part with lse = -inf (it saw no key)
        contributes nothing; a row no part saw is zero.
    lse : ndarray, shape (..., n_q)
        log(sum_p exp(lse_p)).

    This is what split-key (flash-decoding) and sequence-parallel attention
    rest on: attention over keys K1 and K2 equals the merge of attention over
    K1 and over K2.

    Examples
    --------
    >>> import numpy as np, fastattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((4, 8)), rng.standard_normal((10, 8)), rng.standard_normal((10, 3))
    >>> o1, l1 = fastattn.attention(q, k[:6], v[:6], return_lse=True)
    >>> o2, l2 = fastattn.attention(q, k[6:], v[6:], return_lse=True)
    >>> out, lse = fastattn.merge_attention([o1, o2], [l1, l2])
    >>> bool(np.allclose(out, fastattn.attention(q, k, v)))
    True
    """
    blhd = _blhd(layout)
    parts = [_asarray(o, f"output {i}") for i, o in enumerate(outs)]
    part_lses = [_asarray(x, f"lse {i}") for i, x in enumerate(lses)]
    if not parts:
        raise ValueError("merge_attention needs at least one part")
    if len(parts) != len(part_lses):
        raise ValueError(f"got {len(parts)} outputs but {len(part_lses)} lse arrays")
    for a in parts + part_lses:
        _check_input_dtype(a, "merge_attention input")
    for i, o in enumerate(parts):
        if o.shape != parts[0].shape:
            raise ValueError(f"output {i} has shape {o.shape}, output 0 has shape {parts[0].shape}")
    if blhd:   # (..., n_q, H, d_v) outputs: merged as (..., H, n_q, d_v) views, the lse as they are
        parts = _heads_first(parts, [f"output {i}" for i in range(len(parts))])
    shape = parts[0].shape
    if len(shape) < 1:
        raise ValueError("each output must have shape (..., n_q, d_v)")
    for i, x in enumerate(part_lses):
        if x.shape != shape[:-1]:
            raise ValueError(f"lse {i} has shape {x.shape}; it must be the output's shape without "
                             f"the last axis, {shape[:-1]}" if not blhd else
                             f"lse {i} has shape {x.shape}; with layout=\"blhd\" it must be the output's "
                             f"(..., H, n_q), {shape[:-1]}")
    dt = np.result_type(*parts, *part_lses)
    if dt.kind != "f":
        dt = _F64
    L = np.stack([x.astype(dt, copy=False) for x in part_lses])           # (P, ..., n_q)
    M = np.max(L, axis=0)
    Ms = np.where(np.isneginf(M), 0, M)
    with np.errstate(invalid="ignore"):
        w = np.exp(L - Ms)                                              # 0 for lse = -inf
    s = np.sum(w, axis=0)
    out = np.zeros(shape, dt)
    with np.errstate(invalid="ignore", divide="ignore"):
        for wp, o, lp in zip(w, parts, L):
            # A part that saw no key (lse = -inf) adds nothing, even where it holds NaN;
            # one whose weight underflowed to 0 adds only its inf and NaN (its true
            # weight is positive), as attention() does across its own split keys.
            keep = np.where(np.isfinite(o) | np.isneginf(lp)[..., None], 0, o)
            out += np.where(wp[..., None] > 0, wp[..., None] * o, keep)
        out = np.where(s[..., None] == 0, 0, out / np.where(s == 0, 1, s)[..., None])
        lse = Ms + np.log(s)
    out = out.astype(dt, copy=False)
    if blhd:
        out = np.ascontiguousarray(np.swapaxes(out, -3, -2))
    return out, lse.astype(dt, copy=False)
