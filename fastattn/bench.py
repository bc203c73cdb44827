"""Benchmark: fastattn against the NumPy reference and (when installed) PyTorch.

    python -m fastattn.bench            the full table
    python -m fastattn.bench --quick    a short run
    python -m fastattn.bench --json     machine-readable output
    python -m fastattn.bench --plot speed.png   a bar chart (needs matplotlib)
    python -m fastattn.bench --accuracy the error against an exact evaluation, 1k-128k keys
    python -m fastattn.bench --backward forward plus backward against PyTorch's autograd

Every peer runs on the same ndarrays in this process, interleaved, and the
table reports medians, so the ratios are side by side.  PyTorch is optional
(`pip install torch`); it runs on torch.from_numpy views with
torch.set_num_threads equal to fastattn's thread count.  GFLOP/s counts
2 * B * H * n_q * n_k * (d_k + d_v) (half of it when causal), and "% mm" is
that rate over NumPy's own matrix product (2048 x 2048, same dtype), measured
at the start and at the end of the run (the best sample after a warm-up: a
neighbour on a shared machine only slows it).  Decoding (a few query rows)
against K and V beyond the L3 is bound by memory bandwidth instead: for those
rows a plain streaming read (256 MiB, same threads) is timed in the same
interleaving, and the rate at which fastattn reads K and V is printed beside it.

After anything that runs in NumPy's OpenBLAS (the matrix-product ceiling, the
reference) the benchmark pauses for a moment (`_settle`): OpenBLAS's idle
worker threads keep spinning for about 0.1 s after a call, and a peer timed in
that window shares its cores with them (measured: a 2.8 ms decode call took
13 ms there).  The peers' runtimes do the same (ONNX Runtime's threads for
tens of ms; docs/benchmarks.md), so two peers' samples have a pause and an
untimed call between them.
"""

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

from . import _core, attention, attention_varlen, reference

__all__ = ["WORKLOADS", "QUICK", "has_reference", "has_torch", "main", "make_inputs", "peer_calls",
           "reference_f64_ms", "run"]


# name, (B, H, n_q, n_k, d), dtype, options
def _w(name, shape, dtype="float32", causal=False, mask=None, quick=False, **options):
    return dict(name=name, shape=shape, dtype=dtype, causal=causal, mask=mask, quick=quick, options=options)


WORKLOADS = [
    _w("B1 H8 N512 d64", (1, 8, 512, 512, 64), quick=True),
    _w("B1 H8 N512 d64 f64", (1, 8, 512, 512, 64), "float64", quick=True),
    _w("B1 H8 N2048 d64", (1, 8, 2048, 2048, 64), quick=True),
    _w("B1 H8 N2048 d64 f64", (1, 8, 2048, 2048, 64), "float64", quick=True),
    _w("B4 H8 N1024 d64", (4, 8, 1024, 1024, 64)),
    _w("B1 H8 N4096 d64", (1, 8, 4096, 4096, 64)),
    _w("B1 H8 N4096 d64 causal", (1, 8, 4096, 4096, 64), causal=True),
    _w("B1 H8 N2048 d128", (1, 8, 2048, 2048, 128)),
    _w("B32 H12 N128 d64 (BERT)", (32, 12, 128, 128, 64), quick=True),
    _w("B1 H1 N64 d64 (overhead)", (1, 1, 64, 64, 64)),
    _w("decode H32 Nk4096 d128", (1, 32, 1, 4096, 128), quick=True),
    # ... from a cache laid out (B, n_k, H, d), as flash-attn's and JAX's: layout="blhd", each
    # head's K and V rows H*d apart (the same values as the row above)
    _w("  ...(B, n, H, d) layout", (1, 32, 1, 4096, 128), layout="blhd"),
    _w("8 rows H32 Nk4096 d128", (1, 32, 8, 4096, 128)),   # e.g. verifying 8 speculative tokens
    _w("12 rows H32 Nk4096 d128", (1, 32, 12, 4096, 128)),  # the row kernel's limit with AVX-512 in cache
    _w("16 rows H32 Nk4096 d128", (1, 32, 16, 4096, 128)),  # one AVX-512 vector of float32 rows: tiled
    _w("20 rows H32 Nk4096 d128", (1, 32, 20, 4096, 128)),  # ... and from memory: up to 24 rows
    _w("20 rows H8 Nk2048 d128", (1, 8, 20, 2048, 128)),    # ... and in cache from d128 on
    # verifying 16 draft tokens (16 + 1 rows), in cache: the tiled kernel's 16 and a tail of one
    # row that the row kernel takes (rather than a whole vector of the tiled kernel)
    _w("17 rows H8 Nk1024 d64", (1, 8, 17, 1024, 64)),
    _w("B1 H8 N2048 d64 bool mask", (1, 8, 2048, 2048, 64), mask="bool"),
    # an additive mask (as PyTorch users pass): normal scores, -inf where the bool mask is False
    _w("B1 H8 N2048 d64 float mask", (1, 8, 2048, 2048, 64), mask="float"),
    # a causal float mask as tutorials build it, np.triu(np.full((n, n), -np.inf), 1) (in the dtype)
    _w("B1 H8 N2048 d64 triu mask", (1, 8, 2048, 2048, 64), mask="causal"),
    # ... as Hugging Face builds it: 0, and np.finfo(dtype).min for hidden
    _w("B1 H8 N2048 d64 finfo.min mask", (1, 8, 2048, 2048, 64), mask="finfo"),
    # ... and as its eager path builds it for a left-padded batch (1024, 768, 512 and 256 tokens):
    # (B, 1, N, N), causal, finfo.min for hidden, and the padding query rows finfo.min throughout
    _w("B4 H8 N1024 d64 left-pad mask", (4, 8, 1024, 1024, 64), mask="hf_left_pad"),
    # key padding (the last 128 keys) whose K and V rows hold NaN, as an unwritten cache from np.empty
    _w("B1 H8 N2048 d64 pad, NaN", (1, 8, 2048, 2048, 64), mask="pad"),
    _w("B1 H8 N2048 d64 GQA 8q/2kv", (1, 8, 2048, 2048, 64), gqa=2),
    # a batch of 4 sequences of 1024, 768, 512 and 256 tokens, right-padded to 1024, causal:
    # q_lengths and kv_lengths (PyTorch: the equivalent (B, 1, N, N) bool mask)
    _w("B4 H8 N1024 d64 padded batch", (4, 8, 1024, 1024, 64), causal=True, q_lengths=True),
    # ... the same sequences packed, no padding (attention_varlen; peers: as above, padded)
    _w("  ...packed (varlen)", (4, 8, 1024, 1024, 64), causal=True, q_lengths=True, packed=True),
    _w("B1 H8 N8192 d64 causal", (1, 8, 8192, 8192, 64), causal=True),
    _w("  ...window (256, 0)", (1, 8, 8192, 8192, 64), causal=True, window=(256, 0)),
    _w("decode B8 H8 Nk4096 kv_len", (8, 8, 1, 4096, 128), kv_lengths=True),
    # ... the same lengths as a key-padding bool mask (B, 1, 1, n_k), as HF-style decoding passes them
    _w("decode B8 H8 Nk4096 pad mask", (8, 8, 1, 4096, 128), mask="keys"),
    # GQA decoding: 32 query heads on 8 K and V heads (as Llama 3 8B), as many bytes as the decode row
    _w("decode GQA 32/8 Nk16k d128", (1, 32, 1, 16384, 128), gqa=8),
    # ... from a (B, n_k, H_kv, d) cache: each K and V head's rows H_kv*d apart, a group's 4 query
    # heads one item's rows (the same values as the row above)
    _w("  ...(B, n, H_kv, d) layout", (1, 32, 1, 16384, 128), gqa=8, layout="blhd"),
    # ... verifying 8 speculative tokens there (causal: bottom-right, as KV-cache decoding)
    _w("8 rows GQA 32/8 Nk16k causal", (1, 32, 8, 16384, 128), causal=True, gqa=8),
    # 16-bit K and V, float32 q (a float16 KV cache as llama.cpp's, bfloat16 as JAX's through
    # ml_dtypes), read as stored; fastattn on float32 copies of the same values beside it
    _w("decode H32 Nk4096 d128 f16 KV", (1, 32, 1, 4096, 128), kv="float16", quick=True),
    _w("decode H32 Nk4096 d128 bf16 KV", (1, 32, 1, 4096, 128), kv="bfloat16"),
    _w("decode GQA 32/8 Nk16k f16 KV", (1, 32, 1, 16384, 128), gqa=8, kv="float16"),
    _w("decode GQA 32/8 Nk16k bf16 KV", (1, 32, 1, 16384, 128), gqa=8, kv="bfloat16"),
    # ... and q, k, v all float16 (computed in float32, as PyTorch's CPU kernel does)
    _w("B1 H8 N2048 d64 float16", (1, 8, 2048, 2048, 64), qkv="float16"),
]
QUICK = [w for w in WORKLOADS if w["quick"]]


PEER_PAUSE = 0.1   # seconds between two peers' samples: the last one's threads stop spinning


def _interleaved_samples(fns, repeats, min_time=0.05):
    """Run each fn of `fns` interleaved, `repeats` times; per fn, the list of
    seconds per call.  Each sample repeats the call enough times to last about
    min_time.  Between the samples of two fns a pause (PEER_PAUSE) and one untimed
    call: a peer's idle threads spin on for a while after its calls, and the next
    fn timed in that window would share its cores."""
    inner = []
    for f in fns:
        f()  # warm up
        t0 = time.perf_counter()
        f()
        dt = time.perf_counter() - t0
        inner.append(max(1, int(min_time / max(dt, 1e-7))))
    samples: "list[list[float]]" = [[] for _ in fns]
    for _ in range(repeats):
        for i, f in enumerate(fns):
            if len(fns) > 1:
                time.sleep(PEER_PAUSE)
                f()
            t0 = time.perf_counter()
            for _ in range(inner[i]):
                f()
            samples[i].append((time.perf_counter() - t0) / inner[i])
    return samples


def _median_times(fns, repeats, min_time=0.05):
    """Per fn of `fns`, the median seconds of one call (interleaved samples)."""
    return [float(np.median(s)) for s in _interleaved_samples(fns, repeats, min_time)]


def _settle(seconds=0.2):
    """Let OpenBLAS's spinning worker threads go to sleep before the next timing."""
    time.sleep(seconds)


def _matmul_rate(dtype, repeats, warmup=0.3):
    """NumPy's matrix-product rate (2048^2), the ceiling: after `warmup` seconds of
    products (the first ones of a process, after an idle spell, ran up to 2x
    slower here), the best of `repeats` samples, since interference only slows."""
    n = 2048
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warmup:
        a @ b
    (samples,) = _interleaved_samples([lambda: a @ b], repeats)
    t = min(samples)
    _settle()
    return 2 * n**3 / t / 1e9


def _torch():
    try:
        import torch
    except Exception:
        return None
    return torch


def stored_dtype(w):
    """The 16-bit dtype that workload w stores K and V (kv) or q, k and v (qkv) in, or
    None; bfloat16 needs ml_dtypes (without it: None, and `available` is False)."""
    name = w["options"].get("kv") or w["options"].get("qkv")
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            return None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name) if name else None


def available(w):
    """Whether workload w can run here (a bfloat16 row needs ml_dtypes)."""
    return not (w["options"].get("kv") or w["options"].get("qkv")) or stored_dtype(w) is not None


def make_inputs(w, seed=0):
    """Inputs of workload `w` (an entry of WORKLOADS): q, k, v, mask (or None), and
    fastattn's keyword options for it."""
    B, H, nq, nk, d = w["shape"]
    rng = np.random.default_rng(seed)
    dt = np.dtype(w["dtype"])
    opts = w.get("options", {})
    hkv = opts.get("gqa", H)
    q = rng.standard_normal((B, H, nq, d)).astype(dt)
    k = rng.standard_normal((B, hkv, nk, d)).astype(dt)
    v = rng.standard_normal((B, hkv, nk, d)).astype(dt)
    mask = rng.random((nq, nk)) < 0.9 if w["mask"] in ("bool", "float") else None
    if w["mask"] == "float":
        mask = np.where(mask, rng.standard_normal((nq, nk)), -np.inf).astype(dt)
    if w["mask"] in ("causal", "finfo"):   # hidden: -inf, or as Hugging Face, the dtype's lowest number
        hidden = -np.inf if w["mask"] == "causal" else np.finfo(dt).min
        mask = np.triu(np.full((nq, nk), hidden, dt), nk - nq + 1)
    if w["mask"] == "hf_left_pad":
        j = np.arange(nk)
        start = nk - _left_pad_lengths(w)[:, None, None]   # each sequence's first real position
        mask = np.where((j <= j[:, None]) & (j >= start), 0, np.finfo(dt).min).astype(dt)[:, None]
    if w["mask"] == "pad":
        mask = np.ones((nq, nk), bool)
        mask[:, nk - nk // 16:] = False
        k[..., nk - nk // 16:, :] = np.nan
        v[..., nk - nk // 16:, :] = np.nan
    store = stored_dtype(w)
    if store is not None:   # the 16-bit rows: K and V (and with qkv q) stored so
        k, v = k.astype(store), v.astype(store)
        q = q.astype(store) if opts.get("qkv") else q
    kw = {}
    if opts.get("layout") == "blhd":   # the same values, (B, n, H, d) in memory
        q, k, v = (np.ascontiguousarray(a.swapaxes(1, 2)) for a in (q, k, v))
        kw["layout"] = "blhd"
    if "gqa" in opts:
        kw["enable_gqa"] = True
    if "window" in opts:
        kw["window"] = opts["window"]
    if opts.get("q_lengths"):
        kw["q_lengths"] = kw["kv_lengths"] = nq - np.arange(B)[:, None] * (nq // 4)   # (B, 1)
    elif opts.get("kv_lengths") or w["mask"] == "keys":
        lengths = rng.integers(nk // 4, nk + 1, (B, 1))   # a padded cache: B sequence lengths
        if w["mask"] == "keys":
            mask = np.arange(nk) < lengths[:, :, None, None]
        else:
            kw["kv_lengths"] = lengths
    return q, k, v, mask, kw


def _left_pad_lengths(w):
    """The sequence lengths of the left-padded batch: n, 3n/4, n/2, n/4, ..."""
    B, _, nq, _, _ = w["shape"]
    return nq - np.arange(B) * (nq // 4)


_STREAM_BUF: "list[np.ndarray]" = []


def _stream_buffer():
    """256 MiB (8x the L3 of the machines this was tuned on), allocated and touched once."""
    if not _STREAM_BUF:
        _STREAM_BUF.append(np.ones(256 << 20, np.uint8))
    return _STREAM_BUF[0]


def _live_keys(w, mask, kw):
    """Key rows summed over the leading dims that a padded cache holds (kv_lengths or a
    key-padding mask), or None."""
    if "kv_lengths" in kw:
        return float(kw["kv_lengths"].sum()) * w["shape"][1]
    if w["mask"] == "keys":
        return float(mask.sum()) * w["shape"][1]
    return None


def _flops(w, kw, mask=None):
    """Floating-point operations of a workload (the keys each query really sees)."""
    B, H, nq, nk, d = w["shape"]
    if "q_lengths" in kw or w["mask"] == "hf_left_pad":   # causal over each sequence's own length
        n = (kw["q_lengths"] if "q_lengths" in kw else _left_pad_lengths(w)).astype(float)
        return float(2 * H * (n * (n + 1) / 2).sum() * (d + d))
    if "window" in kw:
        return 2 * B * H * nq * (min(kw["window"][0], nk) + 1) * (d + d)
    live = _live_keys(w, mask, kw)
    if live is not None:
        return 2 * nq * live * (d + d)
    if w["mask"] == "pad":
        nk -= nk // 16
    return 2 * B * H * nq * nk * (d + d) / (2 if (w["causal"] or w["mask"] in ("causal", "finfo")) and nq == nk else 1)


def has_torch(w):
    """Whether PyTorch's SDPA computes workload `w`: it has no sliding window (only a
    dense N x N mask, another computation), NaN under a bool mask reaches its output, and
    its causal rule is aligned top-left (bottom-right here: as a mask where n_q != n_k, so
    not beside another mask), and q, k and v must share their dtype."""
    _, _, nq, nk, _ = w["shape"]
    causal_mask = w["causal"] and nq != nk
    return ("window" not in w["options"] and w["mask"] != "pad" and not w["options"].get("kv")
            and not (causal_mask and (w["mask"] or "kv_lengths" in w["options"])))


def has_reference(w):
    """Whether the NumPy reference runs on a workload: it builds the n_q x n_k matrix."""
    _, _, nq, nk, _ = w["shape"]
    return nq * nk <= 4096 * 4096


def peer_calls(w, inputs, threads=None, torch=None):
    """Zero-argument calls that run workload `w` on `inputs` (from `make_inputs`), by peer:
    "fastattn", "reference" (when `has_reference`), "torch" (when `torch` is given and
    PyTorch has the computation), "float32" (the 16-bit rows: fastattn on float32 copies).
    One definition for the table and for `bench/`."""
    q, k, v, mask, kw = inputs
    nk = w["shape"][3]
    calls = {
        "fastattn": lambda: attention(q, k, v, mask=mask, causal=w["causal"], num_threads=threads, **kw)}
    if w["options"].get("packed"):   # the padded batch packed: each sequence's real rows, one after another
        n = kw["q_lengths"][:, 0]
        pq, pk, pv = (np.concatenate([a[b, :, :m].transpose(1, 0, 2) for b, m in enumerate(n)]) for a in (q, k, v))
        cu = np.cumsum(np.r_[0, n])
        calls["fastattn"] = lambda: attention_varlen(pq, pk, pv, cu, cu, causal=w["causal"], num_threads=threads)
    rq, rk, rv = q, k, v   # the reference's inputs
    if stored_dtype(w) is not None:   # fastattn on float32 copies of the same values
        q32, k32, v32 = rq, rk, rv = tuple(a.astype(np.float32) for a in (q, k, v))
        calls["float32"] = lambda: attention(q32, k32, v32, mask=mask, causal=w["causal"], num_threads=threads,
                                             **kw)
    if has_reference(w):   # (16-bit rows: on the float32 copies, as NumPy has no fast 16-bit product)
        calls["reference"] = lambda: reference.attention(rq, rk, rv, mask=mask, causal=w["causal"], **kw)
    if torch is not None and has_torch(w):
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        blhd = kw.get("layout") == "blhd"
        if blhd:   # PyTorch takes (B, H, n, d): views of the same memory, the result back to (B, n, H, d)
            tq, tk, tv = (a.transpose(1, 2) for a in (tq, tk, tv))
        tm = torch.from_numpy(mask) if mask is not None else None
        sdpa = torch.nn.functional.scaled_dot_product_attention
        nq, causal = w["shape"][2], w["causal"]
        if "q_lengths" in kw:    # PyTorch takes right-padded sequences as a causal bool mask per length
            n, i, j = kw["q_lengths"][:, :, None, None], np.arange(nq)[:, None], np.arange(nk)
            tm, causal = torch.from_numpy((i < n) & (j <= i)), False   # (B, 1, N, N); q = kv lengths
        elif "kv_lengths" in kw:   # PyTorch takes a padded cache as a key-padding bool mask
            tm = torch.from_numpy(np.arange(nk)[None, None, None, :] < kw["kv_lengths"][:, :, None, None])
        if causal and nq != nk:   # PyTorch's is_causal is top-left aligned: a bottom-right bool mask
            tm, causal = torch.from_numpy(np.arange(nk) <= np.arange(nq)[:, None] + (nk - nq)), False
        tkw = dict(enable_gqa=True) if "enable_gqa" in kw else {}
        def torch_call():
            o = sdpa(tq, tk, tv, attn_mask=tm, is_causal=causal, **tkw)
            return (o.transpose(1, 2) if blhd else o).numpy()
        calls["torch"] = torch_call
    return calls


def _extra_peers(w, inputs, threads, peers, calls):
    """The optional peers (fastattn._peers) that can run workload w, each checked
    against fastattn's output before it is timed: name -> call, and name ->
    max relative difference for those that disagree (not timed)."""
    from . import _peers
    out, bad = {}, {}
    want = None
    for name in peers:
        make = _peers.MAKERS.get(name)
        call = make(w, inputs, threads) if make else None
        if call is None:
            continue
        if want is None:
            want = np.asarray(calls["fastattn"](), np.float64)
            if inputs[4].get("layout") == "blhd":
                want = np.swapaxes(want, 1, 2)
        got = np.asarray(call(), np.float64)
        err = float(np.max(np.abs(got - want))) / max(1.0, float(np.max(np.abs(want))))
        if got.shape == want.shape and err <= _peers.TOLERANCE.get(name, 1e-3):
            out[name] = call
        else:
            bad[name] = err
    return out, bad


def _measure(w, threads, torch, repeats, with_reference, peers=()):
    """One row of the table: fastattn, and its peers, on one workload."""
    inputs = make_inputs(w)
    q, k, v, mask, kw = inputs
    B, H, nq, nk, d = w["shape"]
    flops = _flops(w, kw, mask)
    calls = peer_calls(w, inputs, threads, torch)
    ref = calls.pop("reference", None)
    extra, disagree = _extra_peers(w, inputs, threads, peers, calls) if peers else ({}, {})
    fns = dict(calls, **extra)
    # few rows against K and V beyond the L3 (32 MiB): memory-bound, so time a
    # plain streaming read beside it (the ceiling)
    decode = nq <= 24 and k.nbytes + v.nbytes > 48 << 20
    if decode:
        buf = _stream_buffer()
        fns["stream"] = lambda: _core._stream_read(buf, threads)
    names = list(fns)
    times = dict(zip(names, _median_times([fns[n] for n in names], repeats)))
    if with_reference and ref is not None:
        (times["reference"],) = _median_times([ref], 3, min_time=0)
        _settle()
    t = times["fastattn"]
    row = dict(name=w["name"], B=B, H=H, n_q=nq, n_k=nk, d=d, shape=list(w["shape"]), dtype=w["dtype"],
               causal=w["causal"], mask=w["mask"], ms=t * 1e3, gflops=flops / t / 1e9, flop=flops)
    if "reference" in times:
        row["reference_ms"] = times["reference"] * 1e3
        row["x_reference"] = times["reference"] / t
    if "torch" in times:
        row["torch_ms"] = times["torch"] * 1e3
        row["x_torch"] = times["torch"] / t
    if "float32" in times:
        row["stored"] = str(stored_dtype(w))
        row["float32_ms"] = times["float32"] * 1e3
        row["of_float32"] = t / times["float32"]
    for name in extra:
        row[f"{name}_ms"] = times[name] * 1e3
        row[f"x_{name}"] = times[name] / t
    for name, err in disagree.items():
        row[f"{name}_disagrees"] = err
    if decode:   # bytes of K and V that fastattn reads (a padded cache: only the live rows)
        live = _live_keys(w, mask, kw)
        kv_rows = live if live is not None else k.size // k.shape[-1]
        row["read_gbs"] = kv_rows * (k.shape[-1] + v.shape[-1]) * k.itemsize / t / 1e9
        row["stream_gbs"] = buf.nbytes / times["stream"] / 1e9
    return row


def reference_f64_ms(w, repeats=3):
    """The NumPy reference on float64 copies of workload `w`'s inputs, as the tests run it
    (their oracle), in ms: the median of `repeats` calls.  The "x NumPy" column times
    the reference in the inputs' own dtype, which for float32 takes about half as long."""
    q, k, v, mask, kw = make_inputs(w)
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    (t,) = _median_times([lambda: reference.attention(q, k, v, mask=mask, causal=w["causal"], **kw)],
                         repeats, min_time=0)
    _settle()
    return t * 1e3


def run(workloads, repeats=5, threads=None, with_reference=True, with_torch=True, log=None, peers=()):
    """Measure `workloads` (and the optional `peers`, fastattn._peers.MAKERS' names);
    returns a dict with the rows and the ceilings."""
    threads = threads or _core.max_threads()
    workloads = [w for w in workloads if available(w)]
    torch = _torch() if with_torch else None
    if torch is not None:
        torch.set_num_threads(threads)
    dtypes = sorted({w["dtype"] for w in workloads})
    mm_start = {dt: _matmul_rate(dt, repeats) for dt in dtypes}
    rows = []
    for w in workloads:
        row = _measure(w, threads, torch, repeats, with_reference, peers)
        rows.append(row)
        if log:
            log(row)
    scaling = None
    if threads >= 2 and any(w["name"] == "B1 H8 N2048 d64" for w in workloads):
        q, k, v, _, _ = make_inputs(WORKLOADS[2])
        t1, tn = _median_times([lambda: attention(q, k, v, num_threads=1),
                                lambda: attention(q, k, v, num_threads=threads)], repeats)
        scaling = dict(workload="B1 H8 N2048 d64", one_thread_ms=t1 * 1e3, threads=threads,
                       threads_ms=tn * 1e3, speedup=t1 / tn, beyond_cpus=threads > _cpus())
    # "x NumPy" at B1 H8 N2048 d64 read both ways: the reference in the inputs' float32
    # (the table's column) and in float64 (the tests' oracle)
    oracle = None
    w, row = next(((w, r) for w, r in zip(workloads, rows) if w["name"] == "B1 H8 N2048 d64"), (None, None))
    if with_reference and w is not None and has_reference(w):
        t = reference_f64_ms(w)
        oracle = dict(workload=row["name"], reference_f64_ms=t, fastattn_ms=row["ms"], speedup=t / row["ms"])
    # the ceiling: the better of the start and the end (a neighbour only slows it)
    mm_end = {dt: _matmul_rate(dt, repeats) for dt in dtypes}
    mm = {dt: max(mm_start[dt], mm_end[dt]) for dt in dtypes}
    for row in rows:
        row["pct_mm"] = 100 * row["gflops"] / mm[row["dtype"]]
        if "read_gbs" in row:   # the roofline: the larger of reading K and V and the flops, at the ceilings
            read_ms = row["ms"] * row["read_gbs"] / row["stream_gbs"]
            row["roofline_ms"] = max(read_ms, row["flop"] / mm[row["dtype"]] / 1e6)
            row["x_roofline"] = row["ms"] / row["roofline_ms"]
    return dict(
        fastattn=sys.modules["fastattn"].__version__, isa=_core.isa_name(), threads=threads,
        cpus=_cpus(),
        thread_scaling=scaling, reference_f64=oracle,
        torch=getattr(torch, "__version__", None), numpy=np.__version__, peers=_peer_versions(peers),
        machine=platform.machine(), cpu_count=os.cpu_count(),
        matmul_gflops=mm, matmul_gflops_start=mm_start, matmul_gflops_end=mm_end, rows=rows)


def _peer_versions(peers):
    """The optional peers' versions (None: not installed)."""
    out = {}
    for name in peers:
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def _cpus():
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


LEGEND = """\
fastattn ms: median time of a call; GFLOP/s: 4 n_q n_k d (causal: the keys each query sees)
over that time.  % mm: that rate as a share of NumPy's own 2048x2048 matrix product in this
run, in the same dtype (the compute ceiling; decoding rows are bound by memory instead: see
the Memory lines).  x NumPy: fastattn's speed over fastattn.reference, the plain NumPy
formula, run in the inputs' own dtype (16-bit rows: float32 copies).  x torch: over
PyTorch's scaled_dot_product_attention on the same arrays and threads.  Peers are timed
interleaved with fastattn, in this process."""


def blas_note():
    """A note for the matrix-product line where OPENBLAS_CORETYPE is set (as on some
    shared machines, for old OpenBLAS builds): OpenBLAS then runs that core's kernels,
    not this CPU's, so its rate can understate the ceiling (docs/benchmarks.md);
    else ""."""
    core = os.environ.get("OPENBLAS_CORETYPE")
    if not core:
        return ""
    return (f"; OPENBLAS_CORETYPE={core} is set, so NumPy's OpenBLAS runs {core}'s kernels, which may be slower "
            f"than this CPU's own: unset it (and OPENBLAS_L2_SIZE) for the ceiling")


def _ms(x, width=9):
    return f"{x:{width}.3f}" if x < 1 else f"{x:{width}.2f}"


def _fmt_row(r, peers=()):
    ref_ms = _ms(r["reference_ms"]) if "reference_ms" in r else f"{'-':>9}"
    x_ref = f"{r['x_reference']:7.1f}x" if "x_reference" in r else f"{'-':>8}"
    t_ms = _ms(r["torch_ms"]) if "torch_ms" in r else f"{'-':>9}"
    x_t = f"{r['x_torch']:7.2f}x" if "x_torch" in r else f"{'-':>8}"
    more = "".join(f" {r['x_' + p]:10.2f}x |" if "x_" + p in r else
                   (f" {'differs':>11} |" if p + "_disagrees" in r else f" {'-':>11} |") for p in peers)
    return (f"| {r['name']:<30} | {_ms(r['ms'])} | {r['gflops']:7.1f} | {r['pct_mm']:5.0f} % | "
            f"{ref_ms} | {x_ref} | {t_ms} | {x_t} |" + more)


HEADER = ("| workload                       | fastattn ms | GFLOP/s | % mm  | NumPy ms  | x NumPy  "
          "| torch ms  | x torch  |\n"
          "| ------------------------------ | ---------: | ------: | ----: | --------: | -------: "
          "| --------: | -------: |")


def _plot(result, path):
    """GFLOP/s of fastattn beside PyTorch and the NumPy reference on each row, with the
    matrix-product ceiling of the row's dtype marked, so that a bar reads against it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(rows) + 2))
    y = np.arange(len(rows))
    peers = [("fastattn", "ms", "tab:blue"), ("PyTorch SDPA", "torch_ms", "tab:orange"),
             ("NumPy reference", "reference_ms", "tab:gray")]
    h = 0.27
    for i, (label, key, color) in enumerate(peers):
        vals = [r["flop"] / (r[key] * 1e-3) / 1e9 if key in r else 0.0 for r in rows]
        if any(vals):
            ax.barh(y + (i - 1) * h, vals, height=h, color=color, label=label)
    ceil = [result["matmul_gflops"][r["dtype"]] for r in rows]
    ax.scatter(ceil, y, marker="|", s=400, color="k", label="NumPy matrix product (ceiling)", zorder=3)
    ax.set_yticks(y, [r["name"].strip() for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("GFLOP/s (higher is better)")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"fastattn {result['fastattn']} ({result['isa']}, {result['threads']} threads)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _tune_main(threads, as_json, quick=False):
    """fastattn-bench --tune: fastattn.tune, with its measurements on stderr
    (quick: one round, float32 only; the float64 fields keep the built-in table's)."""
    from . import _tune
    print(f"Tuning fastattn {sys.modules['fastattn'].__version__} on {_cpu_name()} "
          f"({_core.isa_name()}, {threads or _core.max_threads()} threads); "
          f"{'a quick pass, float32 only' if quick else '20-30 s'}", file=sys.stderr)
    kw = {"rounds": 1, "dtypes": ("float32",)} if quick else {}
    r = _tune.tune(num_threads=threads, log=lambda s: print(s, file=sys.stderr), **kw)
    if as_json:
        print(json.dumps({k: r[k] for k in ("tuning", "builtin", "changed", "path", "seconds")}, indent=1))
        return 0
    if r["path"]:
        print(f"Measured in {r['seconds']:.0f} s; saved to {r['path']} (read at the next import; "
              f"{_tune.ENV}=off ignores it).")
    else:
        print(f"Measured in {r['seconds']:.0f} s; in use in this process but not saved ({_tune.state['note']}).")
    if not r["changed"]:
        print(f"The built-in table '{r['builtin']['name']}' stays: nothing measured faster by the margin "
              f"({100 * _tune.TIE:.0f} %; the row thresholds {25 * _tune.TIE:.1f} %).")
    for k, v in r["changed"].items():
        print(f"  {k}: {r['builtin'][k]} -> {v}")
    return 0


def _cpu_name():
    c = _core.cpu_info()
    return f"{c['brand'] or 'an unknown CPU'} (family {c['family']} model {c['model']})"


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastattn.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a short run on a few shapes")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="write a bar chart (needs matplotlib)")
    p.add_argument("--repeats", type=int, default=None, help="samples per peer (default 5, quick 3)")
    p.add_argument("--threads", type=int, default=None, help="threads for fastattn and torch")
    p.add_argument("--no-reference", action="store_true", help="skip the slow NumPy reference")
    p.add_argument("--no-torch", action="store_true", help="do not time PyTorch even if installed")
    p.add_argument("--peers", default="", metavar="LIST",
                   help="more peers, comma-separated: onnxruntime (MultiHeadAttention), openvino (SDPA op, f32), "
                        "ggml (ggml-python's flash_attn_ext); 'all' for all three (each where installed)")
    p.add_argument("--tune", action="store_true",
                   help="measure the plan's thresholds on this machine (20-30 s; fastattn.tune) and keep "
                        "them for the next import (--quick: one round, float32 only)")
    p.add_argument("--accuracy", action="store_true",
                   help="instead of speed: the error against an exact evaluation, 1k to 128k keys "
                        "(--quick: to 16k), for fastattn, the NumPy reference and PyTorch")
    p.add_argument("--backward", action="store_true",
                   help="instead: forward plus backward against PyTorch's autograd, and the backward's "
                        "GFLOP/s (--quick: two rows)")
    args = p.parse_args(argv)
    if args.threads is not None and args.threads <= 0:
        p.error("--threads must be positive")
    if args.tune:
        if args.plot or args.accuracy or args.backward:
            p.error("--tune does not go with --plot, --accuracy or --backward")
        return _tune_main(args.threads, args.json, args.quick)
    if args.backward:
        if args.plot or args.accuracy:
            p.error("--backward does not go with --plot or --accuracy")
        from . import _bench_backward
        return _bench_backward.main(args.threads, not args.no_torch, args.json, args.quick, args.repeats)
    if args.accuracy:
        if args.plot:
            p.error("--plot draws the speed table; it does not go with --accuracy")
        from . import _accuracy
        return _accuracy.main(args.threads, not args.no_torch, args.json, args.quick)
    workloads = QUICK if args.quick else WORKLOADS
    repeats = args.repeats or (3 if args.quick else 5)
    # progress on stderr; the table, whose "% mm" needs the ceiling measured
    # again at the end, on stdout when the run is done
    def log(r):
        print(f"  {r['name'].strip()}: {r['ms']:.3f} ms" + (f", {r['x_torch']:.2f}x PyTorch" if "x_torch" in r else ""),
              file=sys.stderr, flush=True)

    print(f"measuring {len(workloads)} workloads (progress here, the "
          f"{'JSON' if args.json else 'table'} when done)", file=sys.stderr, flush=True)
    peers = tuple(n for n in ("onnxruntime", "openvino", "ggml")
                  if args.peers == "all" or n in args.peers.split(","))
    unknown = set(filter(None, args.peers.split(","))) - {"all", "onnxruntime", "openvino", "ggml"}
    if unknown:
        p.error(f"--peers: unknown peer {sorted(unknown)[0]!r} (onnxruntime, openvino, ggml, all)")
    result = run(workloads, repeats, args.threads, not args.no_reference, not args.no_torch, log, peers)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"fastattn {result['fastattn']}: SIMD {result['isa']}, "
              f"{result['threads']} threads; medians of {repeats} interleaved runs")
        head, rule = HEADER.split("\n")
        print(head + "".join(f" x {p:<10}|" for p in peers))
        print(rule + " ----------: |" * len(peers))
        for r in result["rows"]:
            print(_fmt_row(r, peers))
        print(LEGEND)
        if peers:
            vers = ", ".join(f"{k} {v or 'not installed'}" for k, v in result["peers"].items())
            print(f"x onnxruntime, x openvino ({vers}): over ONNX Runtime's com.microsoft MultiHeadAttention and "
                  f"OpenVINO's scaled_dot_product_attention op (f32), one-node models on the same arrays and "
                  f"threads, each checked against fastattn's output first ('differs': it did not agree to 1e-3; "
                  f"'-': it cannot run that row, e.g. float64, windows, lengths, GQA but ONNX Runtime's "
                  f"GroupQueryAttention for decoding and causal rows); x ggml: over llama.cpp's "
                  f"ggml_flash_attn_ext (float32 q, K and V as stored; agreeing to 1e-2, since it rounds q to "
                  f"16 bits beside 16-bit K and V), rows without a mask or causal")
        mm = ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in result["matmul_gflops"].items())
        print(f"NumPy matrix product (2048^2) in this run: {mm} (the better of its start and end); "
              f"PyTorch: {result['torch'] or 'not installed'}{blas_note()}")
        rows = {r["name"]: r for r in result["rows"]}
        full, win = rows.get("B1 H8 N8192 d64 causal"), rows.get("  ...window (256, 0)")
        if full and win:
            print(f"Sliding window (256, 0) at N8192: {win['ms']:.1f} ms, "
                  f"{100 * win['ms'] / full['ms']:.1f} % of plain causal ({full['ms']:.1f} ms)")
        for r in result["rows"]:
            if "of_float32" in r:
                print(f"16-bit, {r['name'].strip()}: {r['stored']} {r['ms']:.2f} ms, {r['of_float32']:.2f}x "
                      f"the time of fastattn on float32 copies of the same values ({r['float32_ms']:.2f} ms)")
        for r in result["rows"]:
            if "read_gbs" in r:
                print(f"Memory, {r['name'].strip()}: fastattn reads K and V at {r['read_gbs']:.1f} GB/s; "
                      f"a plain streaming read, interleaved with it: {r['stream_gbs']:.1f} GB/s "
                      f"({100 * r['read_gbs'] / r['stream_gbs']:.0f} %); {r['x_roofline']:.2f}x its roofline "
                      f"({r['roofline_ms']:.2f} ms: the larger of that read and its flops at the matrix "
                      f"product's rate)")
        orc = result["reference_f64"]
        if orc:
            print(f"The float64 reference (the tests' oracle: the same inputs in float64), {orc['workload']}: "
                  f"{orc['reference_f64_ms']:.1f} ms, fastattn (float32) {orc['speedup']:.1f}x "
                  f"(x NumPy above: the reference in float32)")
        sc = result["thread_scaling"]
        if sc:
            over = sc["beyond_cpus"]
            print(f"Thread scaling, {sc['workload']}: 1 thread {sc['one_thread_ms']:.1f} ms, "
                  f"{sc['threads']} threads {sc['threads_ms']:.1f} ms: {sc['speedup']:.2f}x"
                  + (f" (more threads than this process's {result['cpus']} CPUs: the threads share them, "
                     f"so this is noise, not scaling)" if over else ""))
    if args.plot:
        _plot(result, args.plot)
        if not args.json:
            print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
