"""The checks and conversions of one attention or attention_weights call: _prepare.

_prepare takes the caller's arguments, checks them (the ValueErrors and TypeErrors
of a call, before any work; out= is checked by the caller), broadcasts the leading
dims, splits the GQA heads and converts the arrays into what the C core reads; it
returns them as a _Prepared, which fastattn._attention._call hands to the C core
(and fastattn.dask reads for its task graph).  The plain path of fastattn.attention
skips all this (see _attention._plain).
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from . import _core, _float_mask
from ._float_mask import _mask_as_bool
from ._validate import (
    _as_array,
    _as_compute,
    _asarray,
    _broadcast_core,
    _broadcast_shapes,
    _causal,
    _dtypes,
    _lengths,
    _native_half,
    _num_threads,
    _scale,
    _slopes,
    _softcap,
    _window,
)


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


# The typed structure of a prepared call: its fields are documented in
# fastattn/_core.pyx (Prepared, and the C core's own in Args), which the binding reads.
_Prepared = _core.Prepared


def _prepare(q, k, v, mask, causal, scale, enable_gqa, window, softcap, alibi_slopes, kv_lengths,
             num_threads, weights=False, q_lengths=None, blhd=False, mask_as_bool=True) -> _Prepared:
    """Check and convert the arguments of attention and attention_weights (q, k, v
    as (..., H, n, d); blhd: the caller's arrays were (..., n, H, d), and the errors
    name their shapes as given).  mask_as_bool=False keeps a float mask float (the
    backward pass, which reads it as the forward's scores took it).  K and V of one
    16-bit dtype stay so for a float32 call (the C core widens them as it reads
    them), and so does a 16-bit q of K's dtype."""
    def sh(a):
        return a.swapaxes(-3, -2).shape if blhd else a.shape

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
    q1, v1 = q.ndim == 1, (v is not None and v.ndim == 1)
    qq = q[None, :] if q1 else q
    vv = k if v is None else (v[:, None] if v1 else v)
    n_q, d_k = qq.shape[-2:]
    n_k, d_k2 = k.shape[-2:]
    n_k2, d_v = vv.shape[-2:]
    if d_k != d_k2:
        raise ValueError(f"d_k differs: q has shape {sh(q)} (d_k={d_k}), k has shape {sh(k)} (d_k={d_k2})")
    if n_k != n_k2:
        raise ValueError(f"n_k differs: k has shape {sh(k)} (n_k={n_k}), v has shape {sh(v)} (n_k={n_k2})")

    # mask: bool or float, broadcastable to (..., n_q, n_k)
    mask_kind = _core.MASK_NONE
    mm = None
    if mask is not None:
        mm = _asarray(mask, "mask")
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
            hint = ""
            if (not q1 and np.ndim(mask) == 2 and mk == n_k and qq.ndim >= 3 and k.ndim >= 3
                    and mq in (qq.shape[0], k.shape[0])):
                hint = ("; a key-padding mask of shape (B, n_k), as PyTorch's key_padding_mask, is "
                        "mask[:, None, None, :] for (B, H, n_q, n_k) scores (True = may attend: "
                        "~key_padding_mask), or pass the lengths as kv_lengths")
            raise ValueError(f"mask of shape {np.shape(mask)} does not broadcast to the scores "
                             f"(..., n_q={n_q}, n_k={n_k})" + (" (1-D q: (..., n_k))" if q1 else "") + hint)

    slopes = _slopes(alibi_slopes, comp)
    kvl = _lengths(kv_lengths, "kv_lengths", "n_k", n_k)
    qln = _lengths(q_lengths, "q_lengths", "n_q", n_q)

    # grouped-query attention: query head h uses key/value head h // (H // H_kv)
    gqa: Optional[Tuple[int, int]] = None
    if enable_gqa:
        if qq.ndim < 3 or k.ndim < 3 or vv.ndim < 3:
            raise ValueError(f"enable_gqa needs a head axis: q (..., H, n_q, d), k and v (..., H_kv, n_k, d); "
                             f"got q {sh(q)}, k {sh(k)}" + (f", v {sh(v)}" if v is not None else ""))
        H, Hkv = qq.shape[-3], k.shape[-3]
        if vv.shape[-3] != Hkv:
            raise ValueError(f"k and v have different head counts: k {sh(k)}, v {sh(v)}")
        if Hkv == 0 or H % Hkv:
            raise ValueError(f"enable_gqa: the query heads ({H}) must be a multiple of the key/value heads ({Hkv})")
        if H > Hkv:   # (as many heads: multi-head attention, as the plain call runs it)
            gqa = (H, Hkv)
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
                want = lead if not gqa else lead[:-2] + (gqa[0],)
                raise ValueError(f"{name} of shape {np.shape(given[name])} "
                                 f"does not broadcast to the leading dims {want}"
                                 + (" (for (B, H, n, d) inputs, per-batch values have shape (B, 1))"
                                    if name != "alibi_slopes" else ""))

    scale_ = _scale(scale, d_k)
    nthreads = _num_threads(num_threads)
    causal_, top_left = _causal(causal)
    win_left, win_right = _window(window, n_q + n_k)
    softcap_ = _softcap(softcap)
    # mask, pad and fold are set below: _mask_as_bool and _fold_rows read p
    kv_store = k.dtype if comp == np.float32 and k.dtype == vv.dtype and _native_half(k.dtype) else comp
    q_store = kv_store if qq.dtype == kv_store else comp   # 16-bit q of K's dtype: read as stored too
    p = _Prepared(q=_as_compute(qq, q_store), k=_as_compute(k, kv_store), v=_as_compute(vv, kv_store), mask=None,
                  mask_kind=mask_kind, pad=None, slopes=slopes, kvl=kvl, qln=qln, lead=lead, n_q=n_q, n_k=n_k,
                  d_v=d_v, q1=q1, v1=v1, gqa=gqa, fold=False, res=res, comp=comp, scale=scale_,
                  softcap=softcap_, causal=causal_, top_left=top_left, win_left=win_left, win_right=win_right,
                  nthreads=nthreads, inputs=(q, k, v, mask))
    if mm is not None and p.mask_kind == _core.MASK_ADD and _float_mask._FLOAT_MASKS_AS_BOOL and mask_as_bool:
        got = _mask_as_bool(mm, p, slopes)
        if got is not None:
            (mm, p.pad), p.mask_kind = got, _core.MASK_BOOL
    if mm is not None:  # read with any strides: never expanded, a bool mask never converted
        mm = _as_compute(mm.view(np.uint8) if p.mask_kind == _core.MASK_BOOL else mm,
                         np.uint8 if p.mask_kind == _core.MASK_BOOL else comp, unit_last=False)
    p.mask = mm
    # GQA decoding: _call hands the C core the query heads of a group as the rows of one
    # item over their K and V (n_q * g rows, position-major: the C core's row_group),
    # which it then reads once, not once per head: decoding, speculative decoding and
    # chunked prefill, up to the plan's row limit (_core.gqa_fold; docs/tuning.md).
    # Exact where the rows of a group differ only in their queries and positions (causal
    # and windows follow the positions): no ALiBi slopes (per head), kv_lengths and
    # q_lengths the same across the group.
    p.fold = (gqa is not None and not weights and gqa[0] > gqa[1] and _fold_rows(p, n_q)
              and slopes is None and all(x is None or x.ndim == 0 or x.shape[-1] == 1 for x in (kvl, qln)))
    return p


def _fold_rows(p: _Prepared, n_q: int) -> bool:
    """Few enough query rows for the GQA fold?  The C plan decides, from the SIMD
    tuning table (src_c/dispatch.c: fold_rows, fold_rows_big, fold_big_bytes)."""
    return _core.gqa_fold(n_q, _broadcast_core(p.k).nbytes + _broadcast_core(p.v).nbytes)
