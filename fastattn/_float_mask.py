"""Float masks of only 0 and -inf (or a large negative number) read as bool masks.

_prepare hands such a mask to the C core as the bool mask it acts as, where that
gives the same result (_mask_as_bool; the reasoning and the measurements are in
the comments below); _call then fills the padding rows it left (_fill_pad_rows).
_FLOAT_MASKS_AS_BOOL turns it off (the tests and the fuzzer do, to reach the C
core's float path with such masks too).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional, Tuple

import numpy as np

from . import _core
from ._validate import _F32, _F64, _broadcast_core

if TYPE_CHECKING:
    from ._prepare import _Prepared


# Such a mask (np.triu(np.full((n, n), -np.inf), 1), np.where(keep, 0.0, -np.inf)) is
# handed to the C core as the bool mask `mask == 0` where that gives the same result:
# s + 0 = s, and s + -inf = -inf is what a False does, unless a score s is NaN or +inf
# (then s + -inf is NaN, which the row must get).  So only when no score can be: q and k
# finite with d_k * max|q * scale| * max|k| within half the dtype's range (as the C core's
# scores_bounded) and ALiBi slopes finite.  A bool mask is a quarter of float32's bytes
# (an eighth of float64's, and float32 inputs then need no converted copy of a float64
# mask), and the C core tests a bool tile for all True or all False in one pass.  The
# check and the bool copy take passes over q, k (v) and the mask's distinct entries, in
# one OpenMP team of the C core where they are C-contiguous (_check_in_one_team), so a
# mask goes to bool only where the call reads it again and again, for every query row
# and key (2 * scores >= 3 * entries + 2 * (q + k) elements, kept as a margin; a mask
# shared by the heads): a key-padding mask is read as cheaply as a float one
# (docs/tuning.md: float masks read as bool).  Tests turn it off
# (_FLOAT_MASKS_AS_BOOL) to reach the C core's float path with such masks too.
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
# at weight 0, see reference._weighted_values).
# A row without a 0 (a padding query row of such a mask: Hugging Face's eager masks
# with left padding) attends every key alike where it is one constant c that absorbs
# every score (c + s == c, in float64 and so in float32: |c| >= _PAD_ABSORB * bound):
# its output is then the mean of v over the keys and its lse c + log(n_k), which _call
# writes after the C core has left the row empty (all False).  Another row without a
# 0 keeps the whole mask float.
_HIDDEN_MARGIN = 1024.0
_PAD_ABSORB = 2.0 ** 56   # c + s rounds to c in float64 where |s| < |c| 2^-55


def _hidden_floor(p: _Prepared, slopes: Optional[np.ndarray], bound: float) -> Tuple[float, float]:
    """The largest mask value that acts as a False in this call (see above), and the
    largest constant of a padding row: -inf unless finite ones can."""
    if not _allows_finite_floor(p):
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
    if _scannable(x):
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


def _mask_as_bool(mm: np.ndarray, p: _Prepared, slopes: Optional[np.ndarray]) -> Optional[Tuple[np.ndarray, Any]]:
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

    last = core[..., -1, :]  # a float bias fails here, on one row
    neginf_only = _keep_of(last, -math.inf, p.nthreads) is not None
    if not neginf_only and _keep_of(last, -_HIDDEN_MARGIN, p.nthreads) is None:
        return None
    if slopes is not None and not np.isfinite(slopes).all():
        return None
    scannable = _scannable(core) and all(_scannable(a) and a.dtype == p.comp for a in (p.q, p.k, p.v))
    got = (_check_in_one_team if scannable else _check_in_passes)(core, p, slopes, neginf_only)
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


def _keep_of(x: np.ndarray, floor: float, nthreads: int, pad_floor: float = -math.inf) -> Any:
    """(x == 0, padding rows or None) where every entry of x is 0 or at most floor
    and each row holding a finite one holds a 0 or (pad_floor > -inf) is one
    constant at most pad_floor throughout (as _core.mask_keep), else None."""
    pad = np.empty(x.shape[:-1], bool) if pad_floor > -math.inf else None  # every row written
    if _scannable(x):
        keep = np.empty(x.shape, bool)
        if not _core.mask_keep(x, keep, floor, nthreads, pad, pad_floor):  # one pass, threaded
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


def _scannable(x: np.ndarray) -> bool:
    """Can the C core scan x in place (C-contiguous, aligned, float32 or float64)?"""
    return bool(x.flags.c_contiguous and x.flags.aligned and (x.dtype == _F32 or x.dtype == _F64))


def _allows_finite_floor(p: _Prepared) -> bool:
    """May a finite mask value act as a False here: nothing else hides keys (see above)?"""
    return not (p.causal or p.win_left >= 0 or p.win_right >= 0 or p.kvl is not None or p.qln is not None)


def _check_in_passes(core: np.ndarray, p: _Prepared, slopes: Optional[np.ndarray], neginf_only: bool) -> Any:
    """The bool mask (keep, pad) that core acts as, or None: the score bound from
    max |q| and max |k|, then a pass over the mask with floor -inf (neginf_only),
    else, where allowed and v is finite, with the finite floor (see above)."""
    bound = p.q.shape[-1] * _abs_max(p.q, p.nthreads) * abs(p.scale) * _abs_max(p.k, p.nthreads)  # |score| at most
    if not bound <= 0.5 * float(np.finfo(p.comp).max):
        return None  # (not <=: scale 0 times an inf is NaN, and 0 * inf is a NaN score)
    got = _keep_of(core, -math.inf, p.nthreads) if neginf_only else None
    if got is None:  # a large finite negative number for hidden (its floor needs a pass over v)
        floor, pad_floor = _hidden_floor(p, slopes, bound)
        if floor == -math.inf:
            return None
        got = _keep_of(core, floor, p.nthreads, pad_floor)
    return got


def _check_in_one_team(core: np.ndarray, p: _Prepared, slopes: Optional[np.ndarray], neginf_only: bool) -> Any:
    """_check_in_passes in one threaded team of the C core (_core.mask_as_bool),
    where core, q, k and v are C-contiguous float arrays: one team, not one a pass."""
    finite = _allows_finite_floor(p)
    slope_term = _abs_max(slopes) * (p.n_q + p.n_k) if slopes is not None else 0.0
    keep, pad = np.empty(core.shape, bool), np.empty(core.shape[:-1], bool)
    mode = _core.mask_as_bool(core, p.q, p.k, p.v if finite else None, p.q.shape[-1] * abs(p.scale), slope_term,
                              neginf_only, finite, _HIDDEN_MARGIN, _PAD_ABSORB, keep, pad, p.nthreads)
    return None if mode == 0 else (keep, pad if mode == 2 else None)


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
