"""The backward benchmark (``fastattn-bench --backward``): forward (with lse)
plus backward against PyTorch's autograd of scaled_dot_product_attention on the
same arrays, interleaved in one process; the backward alone as GFLOP/s and as a
share of NumPy's matrix-product rate; and the NumPy materialised backward
(fastattn.reference.attention_backward) in float64 beside fastattn's.

GFLOP/s of the backward counts 2.5 times the forward's flops (4 n_q n_k d a
head, half of it causal): FlashAttention-2's five products against the
forward's two.
"""

import sys
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from . import attention, attention_backward, attention_varlen, attention_varlen_backward, reference

# name, (B, H, H_kv, N, d), dtype, causal, packed: the B sequences of N tokens packed
# into (B N, H, d) rows for attention_varlen and its backward (PyTorch: the (B, H, N, d) batch)
ROWS = [
    ("B1 H8 N2048 d64", (1, 8, 8, 2048, 64), "float32", False, False),
    ("B1 H8 N4096 d64 causal", (1, 8, 8, 4096, 64), "float32", True, False),
    ("B1 H8 N2048 d128", (1, 8, 8, 2048, 128), "float32", False, False),
    ("B32 H12 N128 d64", (32, 12, 12, 128, 64), "float32", False, False),
    ("B1 H8 N2048 d64 f64", (1, 8, 8, 2048, 64), "float64", False, False),
    ("GQA 32/8 N2048 d128 causal", (1, 32, 8, 2048, 128), "float32", True, False),
    ("packed 256 x 32 H8 d64 causal", (256, 8, 8, 32, 64), "float32", True, True),
]
QUICK = [0, 3]
NUMPY_SHAPE = (1, 8, 2048, 64)   # the NumPy materialised backward's workload, float64


def _best(fns: Dict[str, Callable[[], Any]], repeats: int, settle: Any = ()) -> Dict[str, float]:
    """The best time of each, in ms, over `repeats` interleaved rounds after a
    warm-up; after those named in `settle` (NumPy's BLAS) a pause (bench._settle:
    its idle threads spin for a while and would share the cores with the next)."""
    from .bench import _settle
    for f in fns.values():
        f()
    t = {n: float("inf") for n in fns}
    for _ in range(repeats):
        for n, f in fns.items():
            t0 = time.perf_counter()
            f()
            t[n] = min(t[n], (time.perf_counter() - t0) * 1e3)
            if n in settle:
                _settle()
    return t


def calls(shape: Any, dtype: str, causal: bool, packed: bool, threads: Optional[int] = None,
          torch: Any = None) -> Dict[str, Callable[[], Any]]:
    """The calls of one workload (a row of ROWS without its name): fastattn's
    forward (with lse) and backward, and PyTorch's autograd of
    scaled_dot_product_attention (forward and backward) when torch is given."""
    B, H, Hkv, N, d = shape
    r = np.random.default_rng(0)
    q = r.standard_normal((B, H, N, d)).astype(dtype)
    k, v = (r.standard_normal((B, Hkv, N, d)).astype(dtype) for _ in range(2))
    do = r.standard_normal((B, H, N, d)).astype(dtype)
    fns: Dict[str, Callable[[], Any]]
    if packed:   # (B, H, N, d) -> (B N, H, d): sequence b is rows b N to (b + 1) N
        qp, kp, vp, dop = (np.ascontiguousarray(a.transpose(0, 2, 1, 3).reshape(B * N, -1, d)) for a in (q, k, v, do))
        cu = np.arange(B + 1) * N
        po, plse = attention_varlen(qp, kp, vp, cu, cu, causal=causal, return_lse=True, num_threads=threads)
        fns = {"forward": lambda: attention_varlen(qp, kp, vp, cu, cu, causal=causal, return_lse=True,
                                                   num_threads=threads),
               "backward": lambda: attention_varlen_backward(dop, qp, kp, vp, po, plse, cu, cu, causal=causal,
                                                             num_threads=threads)}
    else:
        kw = dict(causal=causal, enable_gqa=Hkv != H, num_threads=threads)
        o, lse = attention(q, k, v, return_lse=True, **kw)
        fns = {"forward": lambda: attention(q, k, v, return_lse=True, **kw),
               "backward": lambda: attention_backward(do, q, k, v, o, lse, **kw)}
    if torch is not None:
        tq, tk, tv = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
        tdo = torch.from_numpy(do)

        def torch_call():
            for t in (tq, tk, tv):
                t.grad = None
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal,
                                                             enable_gqa=Hkv != H).backward(tdo)
            return tq.grad, tk.grad, tv.grad
        fns["torch"] = torch_call
    return fns


def _row(name: str, shape: Any, dtype: str, causal: bool, packed: bool, threads: Optional[int], torch: Any,
         repeats: int, ceiling: Dict[str, float]) -> Dict[str, Any]:
    """One workload: forward, backward and PyTorch's autograd, interleaved."""
    B, H, Hkv, N, d = shape
    fns = calls(shape, dtype, causal, packed, threads, torch)
    t = _best(fns, repeats)
    flops = 4.0 * B * H * N * N * d * (0.5 if causal else 1.0)
    row = {"name": name, "B": B, "H": H, "H_kv": Hkv, "n": N, "d": d, "dtype": dtype, "causal": causal,
           "packed": packed,
           "forward_ms": t["forward"], "backward_ms": t["backward"],
           "backward_gflops": 2.5 * flops / t["backward"] / 1e6}
    row["pct_mm"] = 100 * row["backward_gflops"] / ceiling[dtype]
    if "torch" in t:
        row["torch_ms"] = t["torch"]
        row["x_torch"] = t["torch"] / (t["forward"] + t["backward"])
    return row


def run(rows: List[Any], repeats: int = 5, threads: Optional[int] = None, with_torch: bool = True,
        log: Optional[Callable[[Dict[str, Any]], None]] = None) -> Dict[str, Any]:
    """Each row of `rows` (entries of ROWS), then the NumPy materialised backward."""
    from .bench import _matmul_rate, _torch
    torch = _torch() if with_torch else None
    if torch is not None and threads:
        torch.set_num_threads(threads)
    ceiling = {dt: _matmul_rate(dt, 3) for dt in ("float32", "float64")}
    out = []
    for name, shape, dtype, causal, packed in rows:
        out.append(_row(name, shape, dtype, causal, packed, threads, torch, repeats, ceiling))
        if log:
            log(out[-1])
    # the NumPy materialised backward, float64
    r = np.random.default_rng(0)
    q, k, v, do = (r.standard_normal(NUMPY_SHAPE) for _ in range(4))
    o, lse = attention(q, k, v, return_lse=True, num_threads=threads)
    t = _best({"numpy": lambda: reference.attention_backward(do, q, k, v, o),
               "fastattn": lambda: attention_backward(do, q, k, v, o, lse, num_threads=threads)}, 2, settle=("numpy",))
    return {"rows": out, "matmul_gflops": ceiling, "torch": torch.__version__ if torch is not None else None,
            "numpy_backward": {"workload": "B{} H{} N{} d{} float64".format(*NUMPY_SHAPE), "numpy_ms": t["numpy"],
                               "fastattn_ms": t["fastattn"], "speedup": t["numpy"] / t["fastattn"]}}


def main(threads: Optional[int], with_torch: bool, as_json: bool, quick: bool, repeats: Optional[int]) -> int:
    """fastattn-bench --backward."""
    import json
    rows = [ROWS[i] for i in QUICK] if quick else ROWS
    print(f"measuring the backward on {len(rows)} workloads (progress here, the "
          f"{'JSON' if as_json else 'table'} when done)", file=sys.stderr, flush=True)
    res = run(rows, repeats or (3 if quick else 5), threads, with_torch,
              log=lambda r: print(f"  {r['name']}: forward {r['forward_ms']:.1f} ms, backward "
                                  f"{r['backward_ms']:.1f} ms" + (f", {r['x_torch']:.2f}x PyTorch"
                                                                 if "x_torch" in r else ""),
                                  file=sys.stderr, flush=True))
    if as_json:
        print(json.dumps(res, indent=2))
        return 0
    print("| workload | forward ms | backward ms | backward GFLOP/s | % mm | PyTorch ms | x torch |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in res["rows"]:
        tcol = f"{r['torch_ms']:.1f} | {r['x_torch']:.2f}" if "torch_ms" in r else "- | -"
        print(f"| {r['name']} | {r['forward_ms']:.1f} | {r['backward_ms']:.1f} | {r['backward_gflops']:.0f} | "
              f"{r['pct_mm']:.0f} | {tcol} |")
    from .bench import blas_note
    nb = res["numpy_backward"]
    mm = ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in res["matmul_gflops"].items())
    print(f"x torch: PyTorch {res['torch'] or 'not installed'} autograd of scaled_dot_product_attention "
          f"(forward and backward) over fastattn's forward with lse plus backward, same arrays. GFLOP/s: "
          f"2.5x the forward's flops over the backward's time; % mm: of NumPy's matrix product ({mm})"
          f"{blas_note()}.")
    print(f"NumPy materialised backward (reference.attention_backward), {nb['workload']}: {nb['numpy_ms']:.0f} ms, "
          f"fastattn's {nb['fastattn_ms']:.1f} ms: {nb['speedup']:.1f}x")
    return 0
