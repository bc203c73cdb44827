"""The benchmark's optional peers (fastattn/_peers.py): ONNX Runtime's
MultiHeadAttention and OpenVINO's SDPA op agree with fastattn where they can
run a workload, and decline the rest.  Not collected by `pytest` (it needs
onnxruntime, onnx and openvino): CI installs them and runs
`pytest tests/peer_runtimes.py`."""

import importlib.util

import numpy as np
import pytest

from fastattn import _peers, bench


def _workload(name):
    return next(w for w in bench.WORKLOADS if w["name"].strip() == name)


@pytest.mark.parametrize("peer", ["onnxruntime", "openvino"])
@pytest.mark.parametrize("name", ["B1 H8 N512 d64", "B1 H8 N2048 d64 bool mask", "B1 H8 N2048 d64 float mask",
                                  "B1 H8 N4096 d64 causal", "...(B, n, H, d) layout"])
def test_peer_agrees(peer, name):
    w = _workload(name)
    if w["shape"][2] > 512:   # a smaller copy of the row: the same options
        w = dict(w, shape=(1, 2, 256, 256, 64) if w["shape"][2] == w["shape"][3] else (1, 4, 1, 512, 64))
    inputs = bench.make_inputs(w)
    calls = bench.peer_calls(w, inputs, threads=2)
    extra, bad = bench._extra_peers(w, inputs, 2, (peer,), calls)
    assert peer in extra and not bad, bad
    got = extra[peer]()
    want = calls["fastattn"]()
    if inputs[4].get("layout") == "blhd":
        want = np.swapaxes(want, 1, 2)
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("name", ["decode GQA 32/8 Nk16k d128", "...(B, n, H_kv, d) layout",
                                  "8 rows GQA 32/8 Nk16k causal"])
def test_onnxruntime_group_query_attention_agrees(name):
    """GQA rows: ONNX Runtime's GroupQueryAttention with its KV cache bound in place
    (past and present one buffer), against fastattn; the cache is left as it was."""
    w = _workload(name)
    w = dict(w, shape=(1, 8, w["shape"][2], 300, 32), options=dict(w["options"], gqa=2))   # a smaller copy
    inputs = bench.make_inputs(w)
    k_before = inputs[1].copy()
    calls = bench.peer_calls(w, inputs, threads=2)
    extra, bad = bench._extra_peers(w, inputs, 2, ("onnxruntime", "openvino"), calls)
    assert "openvino" not in extra and not bad, bad      # OpenVINO's SDPA op: one head count
    want = calls["fastattn"]()
    if inputs[4].get("layout") == "blhd":
        want = np.swapaxes(want, 1, 2)
    for _ in range(2):   # a second call reads the same cache
        np.testing.assert_allclose(extra["onnxruntime"](), want, rtol=1e-3, atol=1e-4)
    np.testing.assert_array_equal(inputs[1], k_before)


@pytest.mark.parametrize("name", ["B1 H8 N512 d64 f64", "B1 H8 N2048 d64 GQA 8q/2kv", "  ...window (256, 0)",
                                  "decode B8 H8 Nk4096 kv_len", "B1 H8 N2048 d64 pad, NaN"])
def test_peer_declines(name):
    w = next(w for w in bench.WORKLOADS if w["name"] == name)
    for peer in ("onnxruntime", "openvino"):   # (ggml: tests/peer_ggml.py)
        assert _peers.MAKERS[peer](w, None, 2) is None


def test_bench_peers_columns(monkeypatch, capsys):
    """fastattn-bench --peers all: a column per peer, timed where it agreed."""
    small = dict(bench.WORKLOADS[0], shape=(1, 2, 128, 128, 32))
    monkeypatch.setattr(bench, "QUICK", [small])
    monkeypatch.setattr(bench, "_matmul_rate", lambda dtype, repeats: 100.0)
    bench.main(["--quick", "--peers", "all", "--no-reference", "--no-torch", "--repeats", "1"])
    lines = capsys.readouterr().out.splitlines()
    head = next(line for line in lines if line.startswith("| workload"))
    row = next(line for line in lines if line.startswith("| B1 H8 N512 d64"))
    assert head.rstrip().endswith("x onnxruntime| x openvino  | x ggml      |")
    ggml = importlib.util.find_spec("ggml") is not None   # (not installed by CI: tests/peer_ggml.py)
    assert row.count("x |") == 2 + ggml and row.rstrip().endswith("x |" if ggml else "- |")   # timed: installed
    with pytest.raises(SystemExit):
        bench.main(["--peers", "tensorflow"])
