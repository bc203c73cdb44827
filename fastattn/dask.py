"""Attention over Dask arrays: ``fastattn.dask.attention``.

An optional extra (``pip install "fastattn[dask]"``).  The problem is split into
tasks by its chunks: one per (block of leading indices, query block, key block)
that some query of the block may see, each computed by ``fastattn.attention`` at
its absolute positions; the partial results of a query block's key blocks are
combined by a tree of logsumexp merges (``fastattn.merge_attention``'s rule), so
that K and V are never gathered in one place.
"""

from __future__ import annotations

import os
import threading
from itertools import product
from typing import Any, Optional, Tuple

import numpy as np

try:
    import dask.array as da
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph
except ImportError:  # pragma: no cover - exercised without dask only
    raise ImportError('fastattn.dask needs dask: pip install "fastattn[dask]" (or pip install "dask[array]")') \
        from None

from . import _core
from ._attention import attention as _attention
from ._merge import merge_attention
from ._prepare import _prepare
from ._validate import _as_array, _asarray, _blhd, _dtypes

__all__ = ["attention"]


# ---------------------------------------------------------------------------
# validation: fastattn.attention's own checks, on zero-stride stand-ins
# ---------------------------------------------------------------------------
def _stand_in(shape: Tuple[int, ...], dtype: Any) -> np.ndarray:
    """An array of `shape` and `dtype` that takes no memory (every axis but the
    last of stride 0, the last contiguous, as the C core reads it)."""
    return np.broadcast_to(np.zeros(shape[-1:] if shape else (), dtype), shape)


def _small(x: Any, name: str) -> Optional[np.ndarray]:
    """A per-leading-index argument (slopes, lengths) as NumPy: small, computed now."""
    if x is None:
        return None
    if isinstance(x, da.Array):
        x = x.compute()
    return _asarray(x, name)


def _as_dask(x: Any, name: str) -> Any:
    if isinstance(x, da.Array):
        return x
    a = _as_array(x, name) if name in ("q", "k", "v") else _asarray(x, name)
    return da.from_array(a, chunks=a.shape or ())


# ---------------------------------------------------------------------------
# threads: the worker's budget
# ---------------------------------------------------------------------------
def _task_threads(requested: Optional[int]) -> Optional[int]:
    """num_threads for one task's fastattn call (None: fastattn's default).  A
    request stands (a negative one counts back from the worker's default).  In a
    distributed worker: the OpenMP default (distributed sets OMP_NUM_THREADS=1 in
    its workers) and no more than the worker's cores per task thread.  In another
    pool thread (dask's threaded scheduler, whose tasks already fill the cores):
    one.  In the main thread (the synchronous scheduler, a processes scheduler's
    worker): the default."""
    if requested is not None:
        return requested
    try:
        from distributed import get_worker
        worker = get_worker()
    except (ImportError, ValueError):
        worker = None
    if worker is not None:
        slots = getattr(getattr(worker, "state", worker), "nthreads", 1) or 1
        per_task = max(1, (os.cpu_count() or 1) // slots)
        return max(1, min(_core.max_threads(), per_task))
    return None if threading.current_thread() is threading.main_thread() else 1


# ---------------------------------------------------------------------------
# one (query block, key block) pair: which keys its queries see
# ---------------------------------------------------------------------------
class _Positions:
    """The visibility rules of the whole problem, per leading index: query i
    (of n_q, or of q_len real ones) at position p(i) sees key j iff j < kv_len,
    i < q_len, j <= p (causal), p - left <= j <= p + right (window); ALiBi adds
    -slope |p - j|.  Lengths and slopes are NumPy arrays broadcast to the
    leading dims (or None)."""

    def __init__(self, n_q, n_k, causal, top_left, left, right, kvl, qln, slopes):
        self.n_q, self.n_k, self.causal, self.top_left = n_q, n_k, causal, top_left
        self.left, self.right = left, right
        self.kvl, self.qln, self.slopes = kvl, qln, slopes

    def lengths(self, lead_index: Tuple[slice, ...]) -> Tuple[np.ndarray, np.ndarray]:
        """kv_len and q_len of a block of leading indices, (..., 1, 1)-shaped."""
        def pick(a, default):
            if a is None:
                return np.array(default, np.int64).reshape(1, 1)
            return a[lead_index][..., None, None]
        return pick(self.kvl, self.n_k), pick(self.qln, self.n_q)

    def _grid(self, lead_index, i0, i1, j0, j1):
        """Query rows i (rows, 1), keys j (1, keys), positions p, kv_len and q_len of a block."""
        kvl, qln = self.lengths(lead_index)
        i = np.arange(i0, i1, dtype=np.int64)[:, None]
        j = np.arange(j0, j1, dtype=np.int64)[None, :]
        return i, j, (i if self.top_left else i + kvl - qln), kvl, qln

    def visible(self, lead_index, i0, i1, j0, j1) -> np.ndarray:
        """Bool (lead..., i1 - i0, j1 - j0): which keys each query of the block sees."""
        i, j, p, kvl, qln = self._grid(lead_index, i0, i1, j0, j1)
        vis = (j < kvl) & (i < qln)
        if self.causal:
            vis = vis & (j <= p)
        if self.left >= 0:
            vis = vis & (j >= p - self.left)
        if self.right >= 0:
            vis = vis & (j <= p + self.right)
        return vis

    def alibi(self, lead_index, i0, i1, j0, j1, dtype) -> np.ndarray:
        _, j, p, _, _ = self._grid(lead_index, i0, i1, j0, j1)
        return (-self.slopes[lead_index][..., None, None] * np.abs(p - j)).astype(dtype)

    def kind(self, lead_index, i0, i1, j0, j1) -> str:
        """"none" (no query of the block sees a key of it), "all" (every query of
        it sees every key, before ALiBi), "causal" / "upper_left" (exactly the local
        causal rule of fastattn.attention), or "mask" (an explicit mask).  From
        each row's band of visible keys [lo, hi], as the rules give one: no
        (query, key) array is built."""
        kvl, qln = self.lengths(lead_index)
        kvl, qln = kvl[..., 0], qln[..., 0]                     # (lead..., 1): a column over rows
        i = np.arange(i0, i1, dtype=np.int64)
        p = i if self.top_left else i + kvl - qln
        lo = np.zeros_like(p) if self.left < 0 else p - self.left
        hi = np.broadcast_to(kvl - 1, p.shape)
        if self.causal:
            hi = np.minimum(hi, p)
        if self.right >= 0:
            hi = np.minimum(hi, p + self.right)
        real = np.broadcast_to(i < qln, p.shape)
        seen = real & (np.maximum(lo, j0) <= np.minimum(hi, j1 - 1))
        if not seen.any():
            return "none"
        if (real & (lo <= j0) & (hi >= j1 - 1)).all():
            return "all"
        if self.kvl is None and self.qln is None and self.left < 0 and self.right < 0 and self.causal:
            nq, nk = i1 - i0, j1 - j0
            offset = (i0 - j0) if self.top_left else (i0 - j0 + self.n_k - self.n_q)   # j <= i_local + offset
            if offset == nk - nq:
                return "causal"
            if offset == 0:
                return "upper_left"
        return "mask"


def _partial(q, k, v, mask, lead_index, i0, i1, j0, j1, pos, kind, opts):
    """(out, lse) of queries i0:i1 against keys j0:j1 of one block of leading indices,
    in the compute dtype: lse -inf (and zeros) for a query that sees none of them."""
    kw = dict(scale=opts["scale"], softcap=opts["softcap"], enable_gqa=opts["gqa"], return_lse=True,
              num_threads=_task_threads(opts["num_threads"]))
    comp = opts["comp"]
    if kind in ("causal", "upper_left"):
        kw["causal"] = True if kind == "causal" else "upper_left"
    alibi = pos.slopes is not None
    if kind == "mask" or alibi:
        vis = pos.visible(lead_index, i0, i1, j0, j1)
        if alibi or (mask is not None and mask.dtype.kind != "b"):
            m = np.where(vis, pos.alibi(lead_index, i0, i1, j0, j1, comp) if alibi else comp.type(0),
                         comp.type(-np.inf))
            if mask is not None and mask.dtype.kind == "b":
                m = np.where(mask, m, comp.type(-np.inf))
            elif mask is not None:
                m = m + mask.astype(comp, copy=False)
            mask = m
        else:
            mask = vis if mask is None else (vis & mask)
        kw.pop("causal", None)
    out, lse = _attention(q, k, v, mask=mask, **kw)
    return out.astype(comp, copy=False), lse.astype(comp, copy=False)


def _merge(num_threads, *parts):
    """Merge partial (out, lse) pairs by the logsumexp rule (merge_attention's C
    kernel, in one pass over the parts) on the task's thread budget."""
    if len(parts) == 1:
        return parts[0]
    return merge_attention([p[0] for p in parts], [p[1] for p in parts], num_threads=_task_threads(num_threads))


def _nothing(out_shape, lse_shape, comp):
    """A query block that sees no key at all: zeros and lse -inf."""
    return np.zeros(out_shape, comp), np.full(lse_shape, -np.inf, comp)


def _finish(part, res):
    return part[0].astype(res, copy=False)


def _lse(part):
    return part[1]


# ---------------------------------------------------------------------------
# the public function
# ---------------------------------------------------------------------------
def attention(q: Any, k: Any, v: Any, *, mask: Any = None, causal: Any = False, scale: Optional[float] = None,
              enable_gqa: bool = False, window: Any = None, softcap: Optional[float] = None,
              alibi_slopes: Any = None, kv_lengths: Any = None, q_lengths: Any = None, layout: str = "bhld",
              return_lse: bool = False, num_threads: Optional[int] = None, split_every: int = 4) -> Any:
    """`fastattn.attention` over Dask arrays: a lazy result, computed by chunks.

    The arguments mean what they mean for `fastattn.attention`, with the same
    dtypes and errors (raised here, before any work).  q, k, v (and mask) may be
    dask arrays or NumPy arrays (one chunk each); their chunks split the work:

    - leading dims (batch, heads): a task per block of leading indices (k and v
      rechunked to q's blocks; with enable_gqa, q's head blocks rounded to whole
      groups and k's and v's made to match);
    - queries (q's rows): each query block is computed at its absolute positions,
      so causal, window, q_lengths and ALiBi stay right; a (query block, key
      block) pair that they (or kv_lengths) hide entirely is no task at all;
    - keys (k's rows; v is rechunked to match): each key block gives a partial
      (out, lse), combined by a tree of logsumexp merges (`split_every` at a
      time), never by gathering K and V.

    The head dim d is made one chunk.  alibi_slopes, kv_lengths and q_lengths are
    small per-leading-index arrays, computed now if they are dask arrays.  A
    mask (bool or float, broadcastable to the scores) is rechunked like the
    scores.  Each task runs fastattn with the worker's thread budget: in a
    distributed worker the OpenMP default (distributed sets OMP_NUM_THREADS=1)
    and at most the worker's cores per task thread; on the threaded scheduler
    one thread a task, since its tasks already fill the cores; num_threads, if
    given, stands.

    Returns
    -------
    out : dask array, shape (..., n_q, d_v) (layout "blhd": (..., n_q, H, d_v))
        Of the dtype `fastattn.attention` gives.
    lse : dask array, shape (..., n_q), only with return_lse=True
        In the compute dtype.

    Examples
    --------
    >>> import numpy as np, dask.array as da, fastattn, fastattn.dask
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 256, 32)) for _ in range(3))
    >>> qd, kd, vd = (da.from_array(x, chunks=(1, 4, 64, 32)) for x in (q, k, v))
    >>> out = fastattn.dask.attention(qd, kd, vd, causal=True)        # lazy
    >>> bool(np.allclose(out.compute(), fastattn.attention(q, k, v, causal=True)))
    True
    """
    if isinstance(split_every, bool) or not isinstance(split_every, int) or split_every < 2:
        raise ValueError(f"split_every must be an int of at least 2, got {split_every!r}")
    blhd = _blhd(layout)
    q, k, v = _as_dask(q, "q"), _as_dask(k, "k"), _as_dask(v, "v")
    if mask is not None:
        mask = _as_dask(mask, "mask")
    res, comp = _dtypes(np.empty(0, q.dtype), np.empty(0, k.dtype), np.empty(0, v.dtype))
    if blhd:
        for a, name in ((q, "q"), (k, "k"), (v, "v")):
            if a.ndim < 3:
                raise ValueError(f'layout="blhd" needs (..., n, H, d) arrays of at least 3 dims; {name} has '
                                 f"shape {a.shape}")
        q, k, v = (a.swapaxes(-3, -2) for a in (q, k, v))
    slopes, kvl, qln = (_small(x, n) for x, n in ((alibi_slopes, "alibi_slopes"), (kv_lengths, "kv_lengths"),
                                                   (q_lengths, "q_lengths")))
    # every check of fastattn.attention, on stand-ins that take no memory
    # a float mask's stand-in is bool: _prepare would test a float one's values (_mask_as_bool);
    # any other dtype goes in as it is, for _prepare's own dtype errors
    m_dt = None if mask is None else (np.dtype(bool) if mask.dtype.kind == "f" and mask.dtype.itemsize <= 8
                                      else mask.dtype)
    p = _prepare(_stand_in(q.shape, q.dtype), _stand_in(k.shape, k.dtype), _stand_in(v.shape, v.dtype),
                 None if mask is None else _stand_in(mask.shape, m_dt), causal, scale, enable_gqa, window,
                 softcap, slopes, kvl, num_threads, q_lengths=qln, blhd=blhd)
    q1, v1 = q.ndim == 1, v.ndim == 1
    if q1:
        q = q[None, :]
        if mask is not None and mask.ndim >= 1:
            mask = mask[..., None, :]
    if v1:
        v = v[:, None]
    n_q, n_k, d_v = p.n_q, p.n_k, p.d_v
    gqa = p.gqa
    # leading dims: the broadcast shape, with the head axis of q's size (H) under GQA
    lead = p.lead if gqa is None else p.lead[:-2] + (gqa[0],)
    nl = len(lead)
    g = 1 if gqa is None else gqa[0] // gqa[1]

    # chunks: q's along the leading dims (head blocks whole groups) and rows; k's rows; d whole
    q = da.broadcast_to(q, lead + q.shape[-2:])
    lead_chunks = list(q.chunks[:nl])
    if gqa is not None:   # head blocks of whole groups, adding up to H
        heads: list = []
        for c in lead_chunks[-1]:
            c = min(max(g, c // g * g), gqa[0] - sum(heads))
            if c > 0:
                heads.append(c)
        if sum(heads) < gqa[0]:
            heads.append(gqa[0] - sum(heads))
        lead_chunks[-1] = tuple(heads)
    q = q.rechunk(tuple(lead_chunks) + (q.chunks[-2], (q.shape[-1],)))
    kv_lead = lead if gqa is None else lead[:-1] + (gqa[1],)
    kv_lead_chunks = tuple(lead_chunks) if gqa is None else tuple(lead_chunks[:-1]) + (
        tuple(c // g for c in lead_chunks[-1]),)
    k = da.broadcast_to(k, kv_lead + k.shape[-2:])
    k = k.rechunk(kv_lead_chunks + (k.chunks[-2], (k.shape[-1],)))
    v = da.broadcast_to(v, kv_lead + v.shape[-2:]).rechunk(kv_lead_chunks + (k.chunks[-2], (v.shape[-1],)))
    q_chunks, k_chunks = q.chunks[-2], k.chunks[-2]
    if mask is not None:
        mask = da.broadcast_to(mask, lead + (n_q, n_k)).rechunk(tuple(lead_chunks) + (q_chunks, k_chunks))

    pos = _Positions(n_q, n_k, p.causal, p.top_left, p.win_left, p.win_right,
                     None if kvl is None else np.broadcast_to(kvl, lead),
                     None if qln is None else np.broadcast_to(qln, lead),
                     None if p.slopes is None else np.broadcast_to(np.asarray(slopes, comp), lead))
    opts = dict(scale=p.scale, softcap=p.softcap or None, gqa=gqa is not None, num_threads=num_threads, comp=comp)

    token = tokenize(q, k, v, mask, p.scale, p.softcap, p.causal, p.top_left, p.win_left, p.win_right,
                     kvl, qln, slopes, num_threads, split_every, gqa is not None)
    # each kind of task under its own key name, so that the scheduler learns the
    # pair tasks' durations apart from the much shorter merges' (it places and
    # steals tasks by those)
    core_name = "fastattn-blocks-" + token
    part_name, merge_name, final_name = ("fastattn-" + kind + "-" + token for kind in ("part", "merge", "final"))
    out_name, lse_name = "fastattn-out-" + token, "fastattn-lse-" + token
    q_off = np.concatenate([[0], np.cumsum(q_chunks)]).astype(int)
    k_off = np.concatenate([[0], np.cumsum(k_chunks)]).astype(int)
    lead_off = [np.concatenate([[0], np.cumsum(c)]).astype(int) for c in lead_chunks]
    dsk: dict = {}         # the partials, their merges and each query block's final pair
    dsk_out: dict = {}
    dsk_lse: dict = {}
    for L in product(*(range(len(c)) for c in lead_chunks)):
        lead_index = tuple(slice(lead_off[a][b], lead_off[a][b + 1]) for a, b in enumerate(L))
        lead_shape = tuple(s.stop - s.start for s in lead_index)
        for i in range(len(q_chunks)):
            i0, i1 = int(q_off[i]), int(q_off[i + 1])
            parts = []
            for j in range(len(k_chunks)):
                j0, j1 = int(k_off[j]), int(k_off[j + 1])
                kind = pos.kind(lead_index, i0, i1, j0, j1)
                if kind == "none":
                    continue
                key = (part_name,) + L + (i, j)
                m_key = None if mask is None else (mask.name,) + L + (i, j)
                dsk[key] = (_partial, (q.name,) + L + (i, 0), (k.name,) + L + (j, 0), (v.name,) + L + (j, 0),
                            m_key, lead_index, i0, i1, j0, j1, pos, kind, opts)
                parts.append(key)
            final: Any
            if not parts:
                final = (_nothing, lead_shape + (i1 - i0, d_v), lead_shape + (i1 - i0,), comp)
            else:
                level = 0
                while len(parts) > 1:   # a tree of merges, split_every parts at a time
                    nxt = []
                    for b in range(0, len(parts), split_every):
                        mkey = (merge_name,) + L + (i, level, b)
                        dsk[mkey] = (_merge, num_threads) + tuple(parts[b:b + split_every])
                        nxt.append(mkey)
                    parts, level = nxt, level + 1
                final = parts[0]
            fkey = (final_name,) + L + (i,)
            dsk[fkey] = final
            dsk_out[(out_name,) + L + (i, 0)] = (_finish, fkey, res)
            dsk_lse[(lse_name,) + L + (i,)] = (_lse, fkey)
    deps = [q, k, v] + ([mask] if mask is not None else [])
    core = HighLevelGraph.from_collections(core_name, dsk, dependencies=deps)
    out = da.Array(HighLevelGraph.merge(core, HighLevelGraph({out_name: dsk_out}, {out_name: {core_name}})),
                   out_name, tuple(lead_chunks) + (q_chunks, (d_v,)), dtype=res)
    lse = da.Array(HighLevelGraph.merge(core, HighLevelGraph({lse_name: dsk_lse}, {lse_name: {core_name}})),
                   lse_name, tuple(lead_chunks) + (q_chunks,), dtype=comp)
    if v1:
        out = out[..., 0]
    if q1:
        out = out[..., 0, :] if not v1 else out[..., 0]
        lse = lse[..., 0]
    if blhd:
        out = out.swapaxes(-3, -2)
    return (out, lse) if return_lse else out

