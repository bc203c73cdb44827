"""fastattn.merge_attention: attention results over disjoint key sets combined by their lse."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

from . import _core
from ._validate import Layout, _asarray, _blhd, _check_input_dtype, _dtypes, _heads_first, _num_threads

__all__ = ["merge_attention"]


def merge_attention(outs: Sequence[ArrayLike], lses: Sequence[ArrayLike], *,
                    layout: Layout = "bhld", num_threads: Optional[int] = None) -> tuple[NDArray[Any], NDArray[Any]]:
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
    num_threads : int, optional
        Threads for the merge, as for `attention` (default: the OpenMP
        default team size).

    Returns
    -------
    out : ndarray, shape (..., n_q, d_v)
        sum_p exp(lse_p - lse) * out_p.  A part with lse = -inf (it saw no key)
        contributes nothing; a row no part saw is zero.
    lse : ndarray, shape (..., n_q)
        log(sum_p exp(lse_p)).

    Both in NumPy's promotion of the parts' dtypes, with 16-bit floats giving
    float32 (as `attention`); the sums run in float64, compensated.

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
    # the result dtype as attention's: NumPy's promotion, 16-bit floats giving
    # float32; merge.c sums in float64 whatever the dtype, compensated, so that
    # merging many parts costs no accuracy, and reads C-contiguous aligned arrays
    dt, ct = _dtypes(*parts, *part_lses)
    if blhd:   # rows in the outputs' own (..., n_q, H) order, the lse transposed to it
        parts = [np.swapaxes(o, -3, -2) for o in parts]
        part_lses = [np.swapaxes(x, -1, -2) for x in part_lses]
    rows_shape, d = parts[0].shape[:-1], shape[-1]
    rows = math.prod(rows_shape)
    out, lse = _core.merge([np.require(o, ct, ["C", "A"]).reshape(rows, d) for o in parts],
                           [np.require(x, ct, ["C", "A"]).reshape(rows) for x in part_lses],
                           _num_threads(num_threads))
    lse = lse.reshape(rows_shape)
    if blhd:
        lse = np.swapaxes(lse, -1, -2).copy()
    return out.reshape(rows_shape + (d,)).astype(dt, copy=False), lse.astype(dt, copy=False)
