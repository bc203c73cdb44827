"""pytest-benchmark: fastattn's forward (with lse) plus backward against PyTorch's
autograd of scaled_dot_product_attention (when it is installed) on the workloads of
`fastattn-bench --backward` (fastattn._bench_backward.ROWS: the same shapes, inputs
and calls).

    pytest bench/test_backward.py                        time them all
    pytest bench/test_backward.py -k packed              some of them
    pytest bench/test_backward.py --benchmark-disable    run each once (as in CI)

Each workload is a benchmark group.  The side-by-side table with ratios and the
backward's GFLOP/s is `fastattn-bench --backward`.
"""

import numpy as np
import pytest

from fastattn import _core
from fastattn._bench_backward import ROWS, calls

try:
    import torch
except Exception:  # torch is an optional peer
    torch = None

CASES = [pytest.param(row, peer, id=f"{row[0]}-{peer}") for row in ROWS
         for peer in (("fastattn", "torch") if torch is not None else ("fastattn",))]


@pytest.mark.parametrize("row, peer", CASES)
def test_forward_backward(benchmark, row, peer):
    name, shape, dtype, causal, packed = row
    if torch is not None:
        torch.set_num_threads(_core.max_threads())
    fns = calls(shape, dtype, causal, packed, torch=torch if peer == "torch" else None)
    benchmark.group = name
    if peer == "torch":
        grads = benchmark(fns["torch"])
    else:
        grads = benchmark(lambda: (fns["forward"](), fns["backward"]())[1])
    B, H, Hkv, N, d = shape
    dq = np.asarray(grads[0])
    assert dq.shape == ((B * N, H, d) if packed and peer == "fastattn" else (B, H, N, d))
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
