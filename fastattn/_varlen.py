"""fastattn.attention_varlen: packed sequences of different lengths (flash-attn's varlen form).

The cu_seqlens checks, then one C call whose leading dims are (B, H_kv, G), each
sequence's rows read from its offset; decoding (one query a sequence) with GQA
takes a group's query heads as the rows of one item.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Tuple

import numpy as np
from numpy.typing import ArrayLike

from . import _core
from ._validate import (
    Causal,
    Window,
    _as_array,
    _as_compute,
    _asarray,
    _causal,
    _check_out,
    _direct_out,
    _dtypes,
    _int_or_none,
    _native_half,
    _num_threads,
    _overlaps,
    _scale,
    _slopes,
    _softcap,
    _window,
)

__all__ = ["attention_varlen"]


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


class _Packed(NamedTuple):
    """A checked, converted packed-sequence call (_prepare_varlen): the arrays in
    what the C core reads, the sequences' offsets and lengths, and the scalars."""
    q: np.ndarray            # (T_q, H, d_k), compute dtype (or K's 16-bit dtype)
    k: np.ndarray            # (T_k, H_kv, d_k), compute dtype or 16-bit as stored
    v: np.ndarray            # (T_k, H_kv, d_v), as k
    res: np.dtype[Any]       # the result's dtype
    comp: np.dtype[Any]      # the compute dtype
    B: int                   # sequences
    G: int                   # query heads a K and V head (H // H_kv)
    cq: np.ndarray           # cu_seqlens_q, int64 (B + 1,)
    ck: np.ndarray           # cu_seqlens_k, int64 (B + 1,)
    max_q: int               # the longest sequence's query rows
    max_k: int               # ... and keys
    slopes: Optional[np.ndarray]   # ALiBi slopes (B, H_kv, G), compute dtype, or None
    args: dict[str, Any]     # _core.Args's scalar options: scale, causal, window, softcap, threads
    inputs: Tuple[np.ndarray, np.ndarray, np.ndarray]   # q, k, v as given (as arrays): what out= must not overlap


def _prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, num_threads, window, softcap,
                    alibi_slopes, max_seqlen_q=None, max_seqlen_k=None,
                    check: Optional[Callable[[int, int, int, np.dtype[Any]], None]] = None) -> _Packed:
    """Check and convert the arguments of attention_varlen and of its backward (K and V
    of one 16-bit dtype stay so for a float32 call, and so does a q of their dtype).  check(T_q, H, d_v,
    result dtype) runs with the other checks, before any conversion (the caller's
    out=, or the backward's do, out and lse)."""
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
    B, G = cq.size - 1, H // Hkv
    max_q, max_k = (int((c[1:] - c[:-1]).max()) if B else 0 for c in (cq, ck))
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
    causal_, top_left = _causal(causal)
    win_left, win_right = _window(window, max_q + max_k)
    args = dict(scale=_scale(scale, d_k), nthreads=_num_threads(num_threads), causal=causal_, top_left=top_left,
                win_left=win_left, win_right=win_right, softcap=_softcap(softcap))
    if check is not None:
        check(T_q, H, v.shape[2], res)
    kv_store = k.dtype if (comp == np.float32 and k.dtype == v.dtype
                           and _native_half(k.dtype)) else comp   # 16-bit K and V: as stored
    q_store = kv_store if q.dtype == kv_store else comp   # 16-bit q of K's dtype: as stored too
    return _Packed(_as_compute(q, q_store), _as_compute(k, kv_store), _as_compute(v, kv_store), res, comp, B, G,
                   cq, ck, max_q, max_k, slopes, args, (q, k, v))


def _heads(x: np.ndarray, G: int) -> np.ndarray:
    """(T, H, d) as (H_kv, G, T, d), H = H_kv G: a view (an axis split never copies)."""
    return x.reshape(x.shape[0], x.shape[1] // G, G, x.shape[2]).transpose(1, 2, 0, 3)


def _packed_call(pk: _Packed) -> _core.Args:
    """The C core's view of a packed call: leading dims (B, H_kv, G), a sequence's
    rows from its start (q_start, kv_start), max_q and max_k rows at most
    (q_len, kv_len cut them)."""
    def per_seq(x):
        return np.ascontiguousarray(x, dtype=np.int64).reshape(pk.B, 1, 1)
    return _core.Args(_heads(pk.q, pk.G), _heads(pk.k, 1), _heads(pk.v, 1), None, _core.MASK_NONE,
                      (pk.B, pk.k.shape[1], pk.G), slopes=pk.slopes, kvl=per_seq(pk.ck[1:] - pk.ck[:-1]),
                      qln=per_seq(pk.cq[1:] - pk.cq[:-1]), q_start=per_seq(pk.cq[:-1]),
                      kv_start=per_seq(pk.ck[:-1]), n_q=pk.max_q, n_k=pk.max_k, **pk.args)


def _packed_lse(lse: np.ndarray, B: int, G: int) -> np.ndarray:
    """lse (H, T_q) as the C core reads it for _packed_call: (B, H_kv, G, T_q), stride 0 over B."""
    l3 = lse.reshape(lse.shape[0] // G, G, lse.shape[1])
    return np.lib.stride_tricks.as_strided(l3, (B,) + l3.shape, (0,) + l3.strides)


def attention_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike,
                     max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                     *, causal: Causal = False, scale: Optional[float] = None, out: Optional[np.ndarray] = None,
                     return_lse: bool = False, num_threads: Optional[int] = None,
                     window: Optional[Window] = None, softcap: Optional[float] = None,
                     alibi_slopes: Optional[ArrayLike] = None) -> Any:
    def check_out(T_q, H, d_v, res):
        if out is not None:
            _check_out(out, (T_q, H, d_v), res)

    pk = _prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, num_threads, window, softcap,
                         alibi_slopes, max_seqlen_q, max_seqlen_k, check=check_out)
    (T_q, H, _), Hkv, d_v, B, G = pk.q.shape, pk.k.shape[1], pk.v.shape[2], pk.B, pk.G
    direct = out is not None and _direct_out(out, pk.comp) and not _overlaps(out, *pk.inputs, pk.slopes)
    target: np.ndarray = out if direct and out is not None else np.empty((T_q, H, d_v), pk.comp)
    lse = np.empty((H, T_q), pk.comp) if return_lse else None
    if T_q and H and d_v or lse is not None and lse.size:
        if G > 1 and T_q == B and pk.max_q == 1 and pk.slopes is None:
            # Decoding, one query per sequence: q is (B, H, d), and a group's G query heads
            # become the G rows of one item over its K and V (row_group G, as attention's
            # GQA fold), which it then reads once, not once per head (docs/tuning.md).
            def group_rows(x):  # (B, H, d) -> (B, H_kv, G, d): a view
                return x.reshape(B, Hkv, G, x.shape[2])

            call = _core.Args(group_rows(pk.q), pk.k.transpose(1, 0, 2), pk.v.transpose(1, 0, 2), None,
                              _core.MASK_NONE, (B, Hkv), kvl=(pk.ck[1:] - pk.ck[:-1]).reshape(B, 1), row_group=G,
                              kv_start=pk.ck[:-1].reshape(B, 1), n_k=pk.max_k, **pk.args)
            lse_rows = None if lse is None else lse.reshape(Hkv, G, T_q).transpose(2, 0, 1)   # (B, H_kv, G)
            _core.attention(call, group_rows(target), lse_rows)
        else:
            _core.attention(_packed_call(pk), _heads(target, G), None if lse is None else _packed_lse(lse, B, G))
    result: np.ndarray
    if direct:
        assert out is not None
        result = out
    elif out is not None:
        np.copyto(out, target, casting="same_kind")
        result = out
    else:
        result = target.astype(pk.res, copy=False)
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
        dtype np.result_type(q, k, v) (16-bit floats compute in and give
        float32, integers and bool float64; 16-bit K and V, and a q of their
        dtype, are read as stored).  A query that sees no key (an empty key
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
