"""pytest-benchmark: fastattn against the NumPy reference (and PyTorch when it
is installed) on a few shapes.

    pytest bench                        time them
    pytest bench --benchmark-disable    run each once (a smoke test, as in CI)

The full side-by-side table with ratios is `python -m fastattn.bench`.
"""

import numpy as np
import pytest

import fastattn
from fastattn import reference

try:
    import torch
except Exception:  # torch is an optional peer
    torch = None

SHAPES = {
    "B1H8N512d64": ((1, 8, 512, 64), np.float32, False),
    "B1H8N512d64-f64": ((1, 8, 512, 64), np.float64, False),
    "B1H8N1024d64-causal": ((1, 8, 1024, 64), np.float32, True),
    "B32H12N128d64": ((32, 12, 128, 64), np.float32, False),
    "decode-H32Nk4096d128": ((1, 32, 4096, 128), np.float32, False),
}
PEERS = ["fastattn", "reference"] + (["torch"] if torch is not None else [])


def _inputs(shape, dtype, name):
    rng = np.random.default_rng(0)
    k = rng.standard_normal(shape).astype(dtype)
    v = rng.standard_normal(shape).astype(dtype)
    q = k[..., :1, :].copy() if name.startswith("decode") else rng.standard_normal(shape).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("peer", PEERS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_attention(benchmark, name, peer):
    shape, dtype, causal = SHAPES[name]
    q, k, v = _inputs(shape, dtype, name)
    benchmark.group = name
    if peer == "fastattn":
        out = benchmark(fastattn.attention, q, k, v, causal=causal)
    elif peer == "reference":
        out = benchmark(reference.attention, q, k, v, causal=causal)
    else:
        torch.set_num_threads(fastattn._core.max_threads())
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        out = benchmark(torch.nn.functional.scaled_dot_product_attention, tq, tk, tv, is_causal=causal).numpy()
    assert out.shape == q.shape[:-1] + (v.shape[-1],)
