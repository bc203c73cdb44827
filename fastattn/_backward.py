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
from ._varlen import _heads, _packed_call, _packed_lse, _prepare_varlen


def _sum_to(g: np.ndarray, shape: Tuple[int, ...]) -> np.ndarray:
    """g (lead + core) summed over the leading axes that an operand of `shape`
    (its leading dims broadcast to lead) was broadcast along."""
    g = g.sum(axis=tuple(range(g.ndim - len(shape)))) if g.ndim > len(shape) else g
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


def _as_read(a: np.ndarray, kv: Any, comp: Any) -> np.ndarray:
    """do or out as the C core reads it: in the compute dtype, or as stored where it is
    of the 16-bit dtype that K and V are read in (kv)."""
    return _as_compute(a, kv if kv != comp and a.dtype == kv else comp)


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
        The forward's output.  With float16 or bfloat16 K and V, a q, `do` and `out`
        of that dtype are read as stored, without float32 copies.
    lse : array_like
        The forward's log-sum-exp, ``(..., n_q)`` (head-major in either layout).
    mask, causal, scale, enable_gqa, window, softcap, alibi_slopes, kv_lengths, q_lengths, layout, num_threads
        As for `attention`, and the same as the forward's. Masks, slopes and lengths
        get no gradient; a softcap is differentiated through its tanh.

    Returns
    -------
    (dq, dk, dv) : tuple of ndarray
        Each of its input's shape, in the forward's result dtype (16-bit inputs
        compute in and give float32). An input broadcast along leading dims gets its
        gradient summed over them; with `enable_gqa`, dk and dv are summed over
        each group's query heads. Padding query rows (`q_lengths`), keys beyond
        `kv_lengths` and rows that see no key get zeros.

    Raises
    ------
    ValueError
        A shape that does not fit (naming the argument), or what `attention` refuses.

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
    blhd = _blhd(layout)
    q_in, k_in, v_in = _as_array(q, "q"), _as_array(k, "k"), _as_array(v, "v")
    do_a, out_a, lse_a = _as_array(do, "do"), _as_array(out, "out"), _as_array(lse, "lse")
    qh, kh, vh = _heads_first((q_in, k_in, v_in), "qkv") if blhd else (q_in, k_in, v_in)
    if blhd:
        do_a, out_a = _heads_first((do_a, out_a), ("do", "out"))
    p = _prepare(qh, kh, vh, mask, causal, scale, enable_gqa, window, softcap, alibi_slopes, kv_lengths, num_threads,
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
    do_c = _as_read(do_a.reshape(core_o), p.k.dtype, p.comp)
    out_c = _as_read(out_a.reshape(core_o), p.k.dtype, p.comp)
    lse_c = np.ascontiguousarray(lse_a.reshape(core_l), dtype=p.comp)
    dq = np.empty(p.lead + p.q.shape[-2:], p.comp)
    dk = np.empty(p.lead + p.k.shape[-2:], p.comp)
    dv = np.empty(p.lead + p.v.shape[-2:], p.comp)
    _core.attention(p, out_c, lse_c, backward=(do_c, dq, dk, dv))
    grads = []
    for g, h, pa in ((dq, qh, p.q), (dk, kh, p.k), (dv, vh, p.v)):
        # summed over the broadcast axes and GQA's groups (k, v: size 1 there), in the caller's shape
        g = _sum_to(g, pa.shape).reshape(h.shape)
        g = np.swapaxes(g, -3, -2) if blhd else g
        grads.append(np.ascontiguousarray(g, dtype=p.res))
    return grads[0], grads[1], grads[2]


def attention_varlen_backward(do: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike, out: ArrayLike, lse: ArrayLike,
                              cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike, *, causal: Causal = False,
                              scale: Optional[float] = None, window: Optional[Window] = None,
                              softcap: Optional[float] = None, alibi_slopes: Optional[ArrayLike] = None,
                              num_threads: Optional[int] = None) -> Tuple[NDArray[Any], NDArray[Any], NDArray[Any]]:
    """Gradients of `attention_varlen`: (dq, dk, dv) of ``sum(do * out)``.

    ``out, lse = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, ..., return_lse=True)``
    with the same options gives `out` (total_q, H, d_v) and `lse` (H, total_q).

    Parameters
    ----------
    do : array_like, (total_q, H, d_v)
        The gradient of the loss with respect to the output.
    q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window, softcap, alibi_slopes, num_threads
        As for `attention_varlen`, and the same as the forward's (GQA: k and v with H_kv heads).
    out, lse : array_like
        The forward's output and log-sum-exp.

    Returns
    -------
    (dq, dk, dv) : tuple of ndarray
        The shapes of q, k and v, in the result dtype (16-bit inputs compute in
        and give float32): each sequence's gradients, as `attention_backward`
        gives them on its own rows (layout "blhd"), from one call into the C
        core over all the sequences.  A sequence without queries gives its keys
        zeros; one without keys gives its queries zeros.  With fewer K and V
        heads than query heads, dk and dv are computed per query head first:
        temporaries of H / H_kv times their size.

    Examples
    --------
    >>> import numpy as np, fastattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((10, 2, 8)) for _ in range(3))
    >>> cu = np.array([0, 4, 10])
    >>> out, lse = fastattn.attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True)
    >>> dq, dk, dv = fastattn.attention_varlen_backward(np.ones_like(out), q, k, v, out, lse, cu, cu, causal=True)
    >>> dq.shape, dv.shape
    ((10, 2, 8), (10, 2, 8))
    """
    do_a, out_a, lse_a = _as_array(do, "do"), _as_array(out, "out"), _as_array(lse, "lse")

    def check(T_q, H, d_v, res):   # with the other checks, before any conversion
        for a, name in ((do_a, "do"), (out_a, "out")):
            if a.shape != (T_q, H, d_v):
                raise ValueError(f"{name} has shape {a.shape}; the output has shape (total_q, H, d_v) = "
                                 f"({T_q}, {H}, {d_v})")
        if lse_a.shape != (H, T_q):
            raise ValueError(f"lse has shape {lse_a.shape}; the forward's lse has shape (H, total_q) = ({H}, {T_q})")

    pk = _prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, num_threads, window, softcap,
                         alibi_slopes, check=check)
    (T_q, H, _), (T_k, Hkv, _), d_v, G = pk.q.shape, pk.k.shape, pk.v.shape[2], pk.G
    do_c, out_c = _as_read(do_a, pk.k.dtype, pk.comp), _as_read(out_a, pk.k.dtype, pk.comp)
    lse_c = np.ascontiguousarray(lse_a, dtype=pk.comp)
    # dk and dv per query head (T_k, H, d), summed over each group's G heads below:
    # every leading index (b, h_kv, g) of the C core writes its own rows (with GQA,
    # temporaries G times dk's and dv's size); the sequences cover every row, and
    # the C core writes each of them (zeros where a sequence has no query or key)
    dq = np.empty((T_q, H, pk.q.shape[2]), pk.comp)
    dk = np.empty((T_k, H, pk.k.shape[2]), pk.comp)
    dv = np.empty((T_k, H, d_v), pk.comp)
    _core.attention(_packed_call(pk), _heads(out_c, G), _packed_lse(lse_c, pk.B, G),
                    backward=(_heads(do_c, G), _heads(dq, G), _heads(dk, G), _heads(dv, G)))
    if G > 1:
        dk, dv = (g.reshape(T_k, Hkv, G, g.shape[2]).sum(axis=2) for g in (dk, dv))
    return tuple(np.ascontiguousarray(g, dtype=pk.res) for g in (dq, dk, dv))   # type: ignore[return-value]
