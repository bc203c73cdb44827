"""The accuracy benchmark (``fastattn-bench --accuracy``): the error of attention
against an exact evaluation of the same inputs, as the number of keys grows,
for fastattn, the NumPy reference in the same dtype and (when installed)
PyTorch.

The error is max |out - exact| / max |exact| over 64 query rows, d = 64, one
head; queries, keys N(0, 1) with the queries scaled to make the scores flat
(x 0.1), N(0, 1) (x 1) or peaked (x 8); values 1 + 0.5 N(0, 1), a non-zero mean
as real values have, where a plain running sum's error is largest.  "Exact" is
the same rounded inputs evaluated in float64 (float32 inputs) or with the
weights in extended precision and the products summed in blocks (float64
inputs: a plain float64 evaluation is itself off by tens of float64 eps at
65,536 keys).  tests/test_accuracy.py holds the kernels to these measures.
"""

import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

KEYS = (1024, 4096, 16384, 65536, 131072)
# query scale of each kind of scores
KINDS = {"flat": 0.1, "N(0,1)": 1.0, "peaked": 8.0}
ROWS, D = 64, 64


def problem(dtype, qscale: float, nq: int = ROWS, nk: int = 4096, heads: int = 1, d: int = D, seed: int = 0):
    """q, k, v of shape (1, heads, n, d) in dtype, as the module docstring describes."""
    r = np.random.default_rng(seed)
    q = (r.standard_normal((1, heads, nq, d)) * qscale).astype(dtype)
    k = r.standard_normal((1, heads, nk, d)).astype(dtype)
    v = (1 + 0.5 * r.standard_normal((1, heads, nk, d))).astype(dtype)
    return q, k, v


def weights_exact(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """softmax(q k^T / sqrt(d)) of the rounded inputs as float64: computed in
    float64 for float32 inputs, in np.longdouble for float64 ones."""
    wide = np.longdouble if q.dtype == np.float64 else np.float64
    s = (q.astype(wide) @ np.swapaxes(k.astype(wide), -1, -2)) / np.sqrt(wide(q.shape[-1]))
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)).astype(np.float64)


def exact(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """weights_exact(q, k) . v, over blocks of 256 keys whose products are summed
    in extended precision."""
    w, v = weights_exact(q, k), v.astype(np.float64)
    n = k.shape[-2]
    parts = np.stack([w[..., j:j + 256] @ v[..., j:j + 256, :] for j in range(0, n, 256)])
    return parts.astype(np.longdouble).sum(0).astype(np.float64)


def rel_err(got: Any, want: np.ndarray) -> float:
    """max |got - want| / max |want|."""
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


def peers(threads: Optional[int] = None, with_torch: bool = True) -> Dict[str, Callable]:
    """name -> attention(q, k, v): fastattn, the NumPy reference, and PyTorch's
    scaled_dot_product_attention when installed (and with_torch)."""
    import fastattn
    from fastattn import reference
    calls: Dict[str, Callable] = {
        "fastattn": lambda q, k, v: fastattn.attention(q, k, v, num_threads=threads),
        "NumPy": reference.attention,
    }
    if with_torch:
        try:
            import torch
        except ImportError:
            return calls
        if threads:
            torch.set_num_threads(threads)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        calls["PyTorch"] = lambda q, k, v: sdpa(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v)).numpy()
    return calls


def run(keys: Sequence[int] = KEYS, dtypes: Sequence[str] = ("float32", "float64"), threads: Optional[int] = None,
        with_torch: bool = True, log: Optional[Callable[[Dict[str, Any]], None]] = None) -> List[Dict[str, Any]]:
    """One row per (dtype, keys, kind of scores): the error of each peer."""
    calls = peers(threads, with_torch)
    rows = []
    for dtype in dtypes:
        for nk in keys:
            for kind, qscale in KINDS.items():
                q, k, v = problem(np.dtype(dtype), qscale, nk=nk)
                want = exact(q, k, v)
                row = {"dtype": dtype, "n_k": nk, "scores": kind,
                       "error": {name: rel_err(f(q, k, v), want) for name, f in calls.items()}}
                rows.append(row)
                if log:
                    log(row)
    return rows


def table(rows: List[Dict[str, Any]]) -> str:
    """The rows as a Markdown table: each peer's error, and fastattn's over PyTorch's."""
    names = list(rows[0]["error"])
    head = ["dtype", "keys", "scores"] + names + (["fastattn / PyTorch"] if "PyTorch" in names else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * (len(head) - 3)) + "|"]
    for r in rows:
        e = r["error"]
        cells = [r["dtype"], f"{r['n_k']:,}", r["scores"]] + [f"{e[n]:.1e}" for n in names]
        if "PyTorch" in e:
            cells.append(f"{e['fastattn'] / e['PyTorch']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


LEGEND = ("error: max |out - exact| / max |exact| against an exact evaluation of the same inputs "
          f"({ROWS} query rows, d {D}, values 1 + 0.5 N(0,1)); scores flat (queries x 0.1), "
          "N(0,1), peaked (queries x 8). NumPy: fastattn.reference in the same dtype.")


def main(threads: Optional[int], with_torch: bool, as_json: bool, quick: bool = False) -> int:
    """fastattn-bench --accuracy."""
    import json
    keys = KEYS[:3] if quick else KEYS
    print(f"measuring the error at {', '.join(f'{n:,}' for n in keys)} keys (progress here, the "
          f"{'JSON' if as_json else 'table'} when done)", file=sys.stderr, flush=True)
    rows = run(keys, threads=threads, with_torch=with_torch,
               log=lambda r: print(f"  {r['dtype']} {r['n_k']} {r['scores']}: "
                                   + ", ".join(f"{n} {e:.1e}" for n, e in r["error"].items()),
                                   file=sys.stderr, flush=True))
    if as_json:
        print(json.dumps({"rows": rows, "legend": LEGEND}, indent=2))
    else:
        print(table(rows))
        print(LEGEND)
    return 0
