"""The benchmark's ggml peer (fastattn/_peers.py: llama.cpp's ggml_flash_attn_ext
through ggml-python) agrees with fastattn on the rows it runs and declines the
others.  Not collected by `pytest` and not run by CI: ggml-python installs from
source (cmake and a C++ compiler, a few minutes).  Run it by hand where it
builds: `pip install ggml-python && pytest tests/peer_ggml.py`."""

import numpy as np
import pytest

from fastattn import _peers, bench


def _workload(name):
    return next(w for w in bench.WORKLOADS if w["name"].strip() == name)


@pytest.mark.parametrize("name", ["B1 H8 N512 d64", "decode H32 Nk4096 d128", "decode H32 Nk4096 d128 f16 KV",
                                  "decode H32 Nk4096 d128 bf16 KV", "decode GQA 32/8 Nk16k f16 KV",
                                  "decode GQA 32/8 Nk16k bf16 KV"])
def test_ggml_agrees(name):
    """float32 q with float32 or 16-bit K and V, GQA by broadcast heads: within 1e-2 of
    fastattn (ggml rounds q to 16 bits beside 16-bit K and V), 1e-5 in float32."""
    w = _workload(name)
    B, H, nq, nk, d = w["shape"]
    w = dict(w, shape=(B, H, nq, min(nk, 700), d))   # a smaller copy of the row
    inputs = bench.make_inputs(w)
    calls = bench.peer_calls(w, inputs, threads=2)
    extra, bad = bench._extra_peers(w, inputs, 2, ("ggml",), calls)
    assert "ggml" in extra and not bad, bad
    want = calls["fastattn"]()
    for _ in range(3):   # the graph computes again on the same context and work buffer
        got = extra["ggml"]()
        tol = 1e-5 if inputs[1].dtype == np.float32 else 1e-2
        assert np.abs(got - want).max() <= tol * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("name", ["B1 H8 N512 d64 f64", "B1 H8 N2048 d64 bool mask", "B1 H8 N4096 d64 causal",
                                  "decode B8 H8 Nk4096 kv_len", "...(B, n, H, d) layout", "B1 H8 N2048 d64 float16"])
def test_ggml_declines(name):
    assert _peers.MAKERS["ggml"](_workload(name), None, 2) is None
