"""fastattn.attention_backward: the gradients of attention, computed by the C core
(src_c/backward.c, src_c/kernel/backward.h) from the forward's output and lse.

The arguments are checked and converted as the forward's are (_prepare); the C
core computes each leading index's gradients on its own, and this module sums
them over the axes an input was broadcast along and, with enable_gqa, over each
group's query heads.
"""

from typing import Any, Optional, Tuple

import numpy as np
from numpy.typing import ArrayLike, NDArray

from . import _core
from ._prepare import _prepare
from ._validate import Causal, Layout, Window, _as_array, _as_compute, _blhd, _heads_first


def _sum_to(g: np.ndarray, shape: Tuple[int, ...]) -> np.ndarray:
    """g (lead + core) summed over the leading axes that an operand of `shape`
    (its leading dims broadcast to lead) was broadcast along."""
    g = g.sum(axis=tuple(range(g.ndim - len(shape)))) if g.ndim > len(shape) else g
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


def attention_backward(do: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike, out: ArrayLike, lse: ArrayLike, *,
                       mask: Optional[ArrayLike] = None, causal: Causal = False, scale: Optional[float] = None,
                       enable_gqa: bool = False, window: Optional[Window] = None, softcap: Optional[float] = None,
                       alibi_slopes: Optional[ArrayLike] = None, kv_lengths: Optional[ArrayLike] = None,
                       q_lengths: Optional[ArrayLike] = None, layout: Layout = "bhld",
                       num_threads: Optional[int] = None) -> Tuple[NDArray[Any], NDArray[Any], NDArray[Any]]:
    """Gradients of attention: (dq, dk, dv) of ``sum(do * out)``.

    ``out, lse = attention(q, k, v, ..., return_lse=True)`` with the same options
    gives `out` and `lse`; the backward recomputes the attention weights tile by
    tile from `lse` (FlashAttention-2's backward), so memory stays O(n·d): the
    n_q × n_k weights are never built.  The same inputs and `num_threads` give
    bitwise the same gradients on every run.

    Parameters
    ----------
    do : array_like
        The gradient of the loss with respect to the output: the output's shape.
    q, k, v
        The forward's inputs.
    out : array_like
        The forward's output.
    lse : array_like
        The forward's log-sum-exp, ``(..., n_q)`` (head-major in either layout).
    mask, causal, scale, enable_gqa, window, alibi_slopes, kv_lengths, q_lengths, layout, num_threads
        As for `attention`, and the same as the forward's. Masks, slopes and lengths
        get no gradient.
    softcap : float, optional
        Not yet supported here: NotImplementedError.

    Returns
    -------
    (dq, dk, dv) : tuple of ndarray
        Each of its input's shape, in the forward's result dtype (float16 inputs
        computed in float32). An input broadcast along leading dims gets its
        gradient summed over them; with `enable_gqa`, dk and dv are summed over
        each group's query heads. Padding query rows (`q_lengths`), keys beyond
        `kv_lengths` and rows that see no key get zeros.

    Raises
    ------
    ValueError
        A shape that does not fit (naming the argument), or what `attention` refuses.
    NotImplementedError
        `softcap`.

    Examples
    --------
    >>> import numpy as np, fastattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 16, 8)) for _ in range(3))
    >>> out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
    >>> dq, dk, dv = fastattn.attention_backward(np.ones_like(out), q, k, v, out, lse, causal=True)
    >>> [g.shape for g in (dq, dk, dv)]
    [(2, 16, 8), (2, 16, 8), (2, 16, 8)]
    >>> bool(np.allclose(dv.sum(axis=-2), 16))   # each row's weights sum to 1
    True
    """
    if softcap is not None:
        raise NotImplementedError("attention_backward: softcap is not supported yet; the forward takes it")
    blhd = _blhd(layout)
    q_in, k_in, v_in = _as_array(q, "q"), _as_array(k, "k"), _as_array(v, "v")
    do_a, out_a, lse_a = _as_array(do, "do"), _as_array(out, "out"), _as_array(lse, "lse")
    qh, kh, vh = _heads_first((q_in, k_in, v_in), "qkv") if blhd else (q_in, k_in, v_in)
    if blhd:
        do_a, out_a = _heads_first((do_a, out_a), ("do", "out"))
    p = _prepare(qh, kh, vh, mask, causal, scale, enable_gqa, window, None, alibi_slopes, kv_lengths, num_threads,
                 q_lengths=q_lengths, blhd=blhd, mask_as_bool=False)
    # the output's leading dims as the caller sees them (GQA: (..., H), not (..., H_kv, g))
    lead = p.lead[:-2] + (p.gqa[0],) if p.gqa else p.lead
    o_shape = lead + ((p.n_q,) if not p.q1 else ()) + ((p.d_v,) if not p.v1 else ())
    l_shape = lead + ((p.n_q,) if not p.q1 else ())

    def shown(s):   # a shape as the caller passes it, in its layout
        return s[:-3] + (s[-2], s[-3], s[-1]) if blhd and len(s) >= 3 else s
    for a, name, want in ((do_a, "do", o_shape), (out_a, "out", o_shape), (lse_a, "lse", l_shape)):
        if a.shape != want:
            raise ValueError(f"{name} has shape {shown(a.shape) if name != 'lse' else a.shape}; the forward's "
                             f"{'lse' if name == 'lse' else 'output'} has shape "
                             f"{shown(want) if name != 'lse' else want}")
    # do, out and lse as the C core reads them: (*p.lead, n_q, d_v) and (*p.lead, n_q)
    core_o, core_l = p.lead + (p.n_q, p.d_v), p.lead + (p.n_q,)
    do_c = _as_compute(do_a.reshape(core_o), p.comp)
    out_c = _as_compute(out_a.reshape(core_o), p.comp)
    lse_c = np.ascontiguousarray(lse_a.reshape(core_l), dtype=p.comp)
    dq = np.empty(p.lead + p.q.shape[-2:], p.comp)
    dk = np.empty(p.lead + p.k.shape[-2:], p.comp)
    dv = np.empty(p.lead + p.v.shape[-2:], p.comp)
    _core.attention(p.q, p.k, p.v, p.mask, p.mask_kind, out_c, lse_c, p.lead, p.causal, p.scale, p.nthreads,
                    win_left=p.win_left, win_right=p.win_right, slopes=p.slopes, kv_len=p.kvl, q_len=p.qln,
                    top_left=p.top_left, backward=(do_c, dq, dk, dv))
    grads = []
    for g, h, pa in ((dq, qh, p.q), (dk, kh, p.k), (dv, vh, p.v)):
        # summed over the broadcast axes and GQA's groups (k, v: size 1 there), in the caller's shape
        g = _sum_to(g, pa.shape).reshape(h.shape)
        g = np.swapaxes(g, -3, -2) if blhd else g
        grads.append(np.ascontiguousarray(g, dtype=p.res))
    return grads[0], grads[1], grads[2]
