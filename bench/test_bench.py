"""pytest-benchmark: fastattn against the NumPy reference (and PyTorch when it
is installed) on the grid of `python -m fastattn.bench` (fastattn.bench.WORKLOADS:
the same shapes, inputs and calls).

    pytest bench                          time them all
    pytest bench -k "N2048 and d64"       some of them
    pytest bench --benchmark-disable      run each once (a smoke test, as in CI)

Each workload is a benchmark group, so pytest-benchmark's table compares the
peers of one workload.  The side-by-side table with ratios, the matrix-product
ceiling and the memory lines is `python -m fastattn.bench`.
"""

import numpy as np
import pytest

from fastattn import _core
from fastattn.bench import WORKLOADS, available, has_reference, has_torch, make_inputs, peer_calls, stored_dtype

try:
    import torch
except Exception:  # torch is an optional peer
    torch = None


def _peers(w):
    peers = ["fastattn"]
    if has_reference(w):   # the reference builds the n_q x n_k matrix: not at N8192
        peers.append("reference")
    if torch is not None and has_torch(w):
        peers.append("torch")
    if stored_dtype(w) is not None:   # the 16-bit rows: fastattn on float32 copies beside them
        peers.append("float32")
    return peers


CASES = [pytest.param(w, peer, id=f"{w['name'].strip(' .')}-{peer}")
         for w in WORKLOADS if available(w) for peer in _peers(w)]


@pytest.mark.parametrize("w, peer", CASES)
def test_attention(benchmark, w, peer):
    B, H, nq, nk, d = w["shape"]
    if torch is not None:
        torch.set_num_threads(_core.max_threads())
    call = peer_calls(w, make_inputs(w), torch=torch)[peer]
    benchmark.group = w["name"].strip(" .")
    out = np.asarray(benchmark(call))
    packed = peer == "fastattn" and w["options"].get("packed")   # (total, H, d): the sequences' rows only
    blhd = w["options"].get("layout") == "blhd"   # every peer's result in the inputs' layout
    assert out.shape == ((int(make_inputs(w)[4]["q_lengths"].sum()), H, d) if packed
                         else (B, nq, H, d) if blhd else (B, H, nq, d))
    assert np.isfinite(out).all()
