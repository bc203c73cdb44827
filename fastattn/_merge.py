"""fastattn.merge_attention: attention results over disjoint key sets combined by their lse."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._validate import _F64, Layout, _asarray, _blhd, _check_input_dtype, _heads_first

__all__ = ["merge_attention"]


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
    # the sums in float64 whatever the dtype, and compensated (_Sum), so that
    # merging many parts costs no accuracy; the result is cast back to dt
    acc = np.promote_types(dt, _F64)
    L = np.stack([x.astype(acc, copy=False) for x in part_lses])          # (P, ..., n_q)
    M = np.max(L, axis=0)
    Ms = np.where(np.isneginf(M), 0, M)
    with np.errstate(invalid="ignore"):
        w = np.exp(L - Ms)                                              # 0 for lse = -inf
    with np.errstate(invalid="ignore", divide="ignore"):
        s_sum, o_sum = _Sum(w.shape[1:], acc), _Sum(shape, acc)
        for wp, o, lp in zip(w, parts, L):
            s_sum.add(wp)
            # A part that saw no key (lse = -inf) adds nothing, even where it holds NaN;
            # one whose weight underflowed to 0 adds only its inf and NaN (its true
            # weight is positive), as attention() does across its own split keys.
            keep = np.where(np.isfinite(o) | np.isneginf(lp)[..., None], 0, o)
            o_sum.add(np.where(wp[..., None] > 0, wp[..., None] * o, keep))
        s, out = s_sum.total(), o_sum.total()
        out = np.where(s[..., None] == 0, 0, out / np.where(s == 0, 1, s)[..., None])
        lse = Ms + np.log(s)
    out = out.astype(dt, copy=False)
    if blhd:
        out = np.ascontiguousarray(np.swapaxes(out, -3, -2))
    return out, lse.astype(dt, copy=False)


class _Sum:
    """A compensated running sum (Knuth's TwoSum, as src_c/kernel/online_softmax.h):
    the sum s and the rounding errors c of its additions, added back at the end
    where finite (an inf in s makes c NaN, and s is then the answer)."""

    def __init__(self, shape, dtype):
        self.s, self.c = np.zeros(shape, dtype), np.zeros(shape, dtype)

    def add(self, x):
        t = self.s + x
        z = t - self.s
        self.c += (self.s - (t - z)) + (x - z)
        self.s = t

    def total(self):
        return self.s + np.where(np.isfinite(self.c), self.c, 0)
