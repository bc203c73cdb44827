"""How fastattn fits the ecosystem: one version, threadpoolctl, show_config,
typing files, and memory that stays flat over many calls."""

import importlib.metadata
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

import fastattn
from fastattn import _core

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_one_version_number():
    assert importlib.metadata.version("fastattn") == fastattn.__version__
    assert re.match(r"^\d+\.\d+\.\d+", fastattn.__version__)
    assert f"fastattn {fastattn.__version__}" in README.read_text()


def test_changelog_and_license():
    """The CHANGELOG has a section for this version; the metadata names the license."""
    changelog = README.parent / "CHANGELOG.md"
    assert re.search(rf"^## \[{re.escape(fastattn.__version__)}\] - \d{{4}}-\d{{2}}-\d{{2}}$",
                     changelog.read_text(), re.M), "CHANGELOG.md has no section for this version"
    meta = importlib.metadata.metadata("fastattn")
    assert meta["License-Expression"] == "BSD-3-Clause"
    assert "Programming Language :: Python :: 3.13" in meta.get_all("Classifier")


@pytest.mark.parametrize("extra,path", [("test", "tests/requirements.txt"), ("docs", "docs/requirements.txt")])
def test_requirements_files_match_the_extras(extra, path):
    """tests/requirements.txt (the quick start's second command) and docs/requirements.txt
    list pyproject.toml's "test" and "docs" extras."""
    listed = [line.strip() for line in (README.parent / path).read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    in_meta = [r.split(";")[0].strip() for r in importlib.metadata.requires("fastattn") or []
               if re.search(rf"extra\s*==\s*['\"]{extra}['\"]", r)]
    assert sorted(x.replace(" ", "") for x in listed) == sorted(x.replace(" ", "") for x in in_meta)


def test_typing_files_installed():
    pkg = pathlib.Path(fastattn.__file__).parent
    assert (pkg / "py.typed").is_file() and (pkg / "_core.pyi").is_file()


def test_show_config(capsys):
    fastattn.show_config()
    text = capsys.readouterr().out
    assert f"fastattn {fastattn.__version__}" in text
    assert _core.isa_name() in text and "compiler:" in text and "flags:" in text
    assert f"threads:        {_core.max_threads()}" in text
    if _core.openmp_enabled():
        assert _core.openmp_library() in text and "omp" in _core.openmp_library()


def test_build_flags():
    """setup.py's flags, as the core records them: a * b + c contracted to FMA
    (gcc's default only in GNU C modes: a -std=c11 in CFLAGS would leave the
    AVX2 kernels without FMA), and no fast-math (it breaks -inf masks and NaN)."""
    flags = _core.build_info().split("flags: ", 1)[1].split(";")[0].split()
    assert "-ffp-contract=fast" in flags, flags
    assert not {"-ffast-math", "-Ofast", "-funsafe-math-optimizations"} & set(flags), flags


def _isa_at_import(value):
    """The SIMD path and the warnings of a fresh import with FASTATTN_ISA=value
    (the import this test session uses: run where that package is found, not
    from a checkout whose source folder would shadow an installed build)."""
    env = dict(os.environ, FASTATTN_ISA=value)
    code = "import fastattn; from fastattn import _core; print(_core.isa_name())"
    where = pathlib.Path(fastattn.__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-W", "always", "-c", code], env=env, capture_output=True,
                         text=True, cwd=where)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip(), run.stderr


def _spin_at_import(**env_vars):
    """GOMP_SPINCOUNT as a fresh import's libgomp reports it (OMP_DISPLAY_ENV; None
    for another OpenMP runtime) and as the environment holds it after the import."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(env_vars, OMP_DISPLAY_ENV="verbose")
    code = "import os, fastattn; print(os.environ.get('GOMP_SPINCOUNT'))"
    where = pathlib.Path(fastattn.__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=where)
    assert run.returncode == 0, run.stderr
    seen = re.findall(r"GOMP_SPINCOUNT = '(\d+)'", run.stderr + run.stdout)
    return (seen[0] if seen else None), run.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(not _core.openmp_enabled(), reason="a build without OpenMP has no threads to spin")
def test_openmp_spin_count_at_import():
    """fastattn's libgomp spins 10,000 loops before its idle threads sleep (not
    300,000, which took the cores from NumPy's next matrix product), unless the user
    chose (GOMP_SPINCOUNT or OMP_WAIT_POLICY); the environment is left as it was."""
    gomp = "gomp" in _core.openmp_library()
    assert _spin_at_import() == ("10000" if gomp else None, "None")
    assert _spin_at_import(GOMP_SPINCOUNT="777") == ("777" if gomp else None, "777")
    assert _spin_at_import(OMP_WAIT_POLICY="active") == ("30000000000" if gomp else None, "None")


def test_isa_choice_at_import():
    available = [n for n in fastattn.ISA_NAMES if _core.isa_available(n)]
    assert available[-1] == "generic"   # the portable path is always there
    # auto: the first (best) available path, silently
    assert _isa_at_import("auto") == (available[0], "")
    # each available path can be forced
    for name in available:
        assert _isa_at_import(name) == (name, "")
    # a path this CPU lacks, or a name that is none, is refused with a warning naming it
    for name in [n for n in fastattn.ISA_NAMES if n not in available] + ["sse9"]:
        isa, err = _isa_at_import(name)
        assert isa == available[0] and f"FASTATTN_ISA={name!r}" in err and "RuntimeWarning" in err


@pytest.mark.skipif(not _core.openmp_enabled(), reason="single-threaded build: no OpenMP runtime to list")
def test_threadpoolctl_lists_our_openmp():
    libs = [i for i in threadpool_info() if i["user_api"] == "openmp"]
    mine = pathlib.Path(_core.openmp_library()).resolve()
    assert any(pathlib.Path(i["filepath"]).resolve() == mine for i in libs), (mine, libs)


def _team(**kw):
    q, k, v = (np.ones((8, 256, 32), np.float32) for _ in range(3))
    fastattn.attention(q, k, v, **kw)
    return _core.last_threads()


@pytest.mark.skipif(not _core.openmp_enabled(), reason="single-threaded build")
def test_threadpool_limits_limits_our_threads():
    assert _team(num_threads=2) == 2                      # the problem is big enough for two
    with threadpool_limits(limits=1, user_api="openmp"):
        assert _core.max_threads() == 1
        assert _team() == 1
        assert _team(num_threads=2) == 2                  # an explicit request still wins
    with threadpool_limits(limits=2, user_api="openmp"):
        assert _team() == 2


@pytest.mark.skipif(not _core.openmp_enabled(), reason="single-threaded build")
def test_negative_num_threads_count_back_from_the_default():
    """scikit-learn's rule: -1 is the default team size, -2 one fewer, never below 1;
    the default is read at the call (threadpoolctl)."""
    for limit in (1, 2, 3):
        with threadpool_limits(limits=limit, user_api="openmp"):
            assert _team(num_threads=-1) == limit
            assert _team(num_threads=-2) == max(1, limit - 1)
            assert _team(num_threads=-1000) == 1
    q, k, v = (np.random.default_rng(0).standard_normal((8, 256, 32)).astype(np.float32) for _ in range(3))
    np.testing.assert_array_equal(fastattn.attention(q, k, v, num_threads=-1), fastattn.attention(q, k, v))


def test_tiny_problems_run_serial():
    q = np.ones((1, 4, 8), np.float32)
    fastattn.attention(q, q, q, num_threads=2)
    assert _core.last_threads() == 1


def _rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.skipif(not pathlib.Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_memory_stays_flat():
    rng = np.random.default_rng(0)
    small = [rng.standard_normal((2, 16, 8)).astype(np.float32) for _ in range(3)]
    large = [rng.standard_normal((2, 4, 512, 64)).astype(np.float32) for _ in range(3)]
    mask = rng.random((512, 512)) < 0.9
    dec = (rng.standard_normal((1, 2, 1, 64)).astype(np.float32),
           *(rng.standard_normal((1, 2, 3000, 64)) for _ in range(2)))

    def rounds(n_small, n_large):
        for _ in range(n_small):
            fastattn.attention(*small, causal=True)
            fastattn.softmax(small[0])
        for _ in range(n_large):
            fastattn.attention(*large, mask=mask, return_lse=True)
            fastattn.attention(*dec, num_threads=2)           # the split-key path and its buffers
            fastattn.attention_weights(large[0], large[1], causal=True)

    rounds(1000, 10)                                          # warm up allocator pools and caches
    before = _rss_mb()
    rounds(10_000, 100)
    growth = _rss_mb() - before
    assert growth < 8, f"resident memory grew by {growth:.1f} MB over 10,000 small and 100 large calls"


def test_stream_read_helper():
    """The benchmark's memory ceiling reads every byte (checksum) on any team."""
    x = np.random.default_rng(0).integers(0, 2**63, 4096 + 8, dtype=np.uint64)
    for threads in (0, 1, 2, 3):
        assert _core._stream_read(x, threads) == int(np.bitwise_xor.reduce(x))
    for bad in (np.ones(63, np.uint8), np.ones((64, 2), np.uint8)[:, 0], np.ones(65, np.uint8)[1:]):
        with pytest.raises(ValueError, match="16-byte aligned"):
            _core._stream_read(bad)


@pytest.mark.parametrize("head_name,row_name", [("decode H32 Nk4096 d128", "(B, n, H, d) layout"),
                                                ("decode GQA 32/8 Nk16k d128", "(B, n, H_kv, d) layout")])
def test_bench_blhd_decode_row(head_name, row_name):
    """The benchmark's (B, n, H, d) decoding rows (one head per K and V head, and
    GQA 32/8) hold the row above's values in that layout, and each peer's call on
    them (fastattn, the reference, PyTorch when installed) returns the row above's
    result in that layout."""
    from fastattn import bench
    names = [w["name"] for w in bench.WORKLOADS]
    i = names.index(head_name)
    head, row = bench.WORKLOADS[i], bench.WORKLOADS[i + 1]
    assert row["name"].strip(" .") == row_name and row["shape"] == head["shape"]
    assert row["options"].get("gqa") == head["options"].get("gqa")
    small = (1, 32, 1, 300, 16)
    a, b = (bench.make_inputs(dict(w, shape=small)) for w in (head, row))
    for x, y in zip(a[:3], b[:3]):
        assert y.shape == x.swapaxes(1, 2).shape and np.array_equal(y, x.swapaxes(1, 2))
        assert y.flags.c_contiguous
    assert b[4] == dict(a[4], layout="blhd")
    try:
        import torch
    except Exception:
        torch = None
    torch_threads = torch.get_num_threads() if torch is not None else None
    try:   # PyTorch's set_num_threads sets the OpenMP runtime's count, which fastattn shares: put it back
        ca = bench.peer_calls(dict(head, shape=small), a, threads=1, torch=torch)
        cb = bench.peer_calls(dict(row, shape=small), b, threads=1, torch=torch)
        assert set(ca) == set(cb) >= {"fastattn", "reference"}
        want = ca["reference"]()
        assert np.array_equal(cb["fastattn"](), ca["fastattn"]().swapaxes(1, 2))
        for peer in cb:
            np.testing.assert_allclose(cb[peer](), want.swapaxes(1, 2), rtol=1e-4, atol=1e-5, err_msg=peer)
    finally:
        if torch is not None:
            torch.set_num_threads(torch_threads)


def test_bench_decode_bytes(monkeypatch):
    """The decoding rows' read rate counts the K and V bytes of the arrays, in either
    layout: B * H_kv * n_k rows of d_k + d_v elements (times fixed at 1 ms here)."""
    from fastattn import bench
    monkeypatch.setattr(bench, "_median_times", lambda fns, repeats, min_time=0.05: [1e-3] * len(fns))
    monkeypatch.setattr(bench, "_stream_buffer", lambda: np.ones(1 << 16, np.uint8))
    for name in ("decode H32 Nk4096 d128", "  ...(B, n, H, d) layout", "decode GQA 32/8 Nk16k d128",
                 "  ...(B, n, H_kv, d) layout"):
        w = next(x for x in bench.WORKLOADS if x["name"] == name)
        B, H, _, nk, d = w["shape"]
        rows = B * w["options"].get("gqa", H) * nk
        row = bench._measure(w, threads=1, torch=None, repeats=1, with_reference=False)
        assert row["read_gbs"] == pytest.approx(rows * 2 * d * 4 / 1e-3 / 1e9), name


def test_bench_reference_f64_line(monkeypatch, capsys):
    """The benchmark's float64-reference line times reference.attention on float64
    copies of the B1 H8 N2048 d64 row's own inputs (the tests' oracle), beside the
    row's fastattn time, and prints the ratio; without the reference there is none."""
    from fastattn import bench, reference
    real, seen = reference.attention, []

    def spy(q, k, v, **kw):
        seen.append((q, k, v, kw))
        return real(q, k, v, **kw)

    monkeypatch.setattr(reference, "attention", spy)
    monkeypatch.setattr(bench, "_settle", lambda seconds=0.2: None)
    monkeypatch.setattr(bench, "_matmul_rate", lambda dtype, repeats: 100.0)   # the ceiling: not needed here
    w = dict(bench.WORKLOADS[2], shape=(1, 2, 48, 48, 16))            # the row's name, a small shape
    assert w["name"] == "B1 H8 N2048 d64"
    q32, k32, v32, _, _ = bench.make_inputs(w)
    result = bench.run([w], repeats=2, threads=1, with_torch=False)
    row, orc = result["rows"][0], result["reference_f64"]
    f64 = [s for s in seen if s[0].dtype == np.float64]
    assert len(f64) == 5 and len(seen) == 10    # a warm-up, a calibration and 3 samples: float32 (the column), float64
    for q, k, v, kw in f64:
        assert k.dtype == v.dtype == np.float64 and kw == seen[0][3]   # the column's call, in float64
        assert np.array_equal(q, q32) and np.array_equal(k, k32) and np.array_equal(v, v32)
    assert orc["workload"] == row["name"] and orc["fastattn_ms"] == row["ms"]
    assert orc["speedup"] == pytest.approx(orc["reference_f64_ms"] / row["ms"])
    assert result["rows"][0]["x_reference"] > 0
    assert bench.run([w], repeats=1, threads=1, with_reference=False, with_torch=False)["reference_f64"] is None
    assert bench.run([dict(w, name="other")], repeats=1, threads=1, with_torch=False)["reference_f64"] is None

    monkeypatch.setattr(bench, "run", lambda *a, **kw: result)
    bench.main(["--no-torch"])
    out = capsys.readouterr().out
    assert (f"The float64 reference (the tests' oracle: the same inputs in float64), B1 H8 N2048 d64: "
            f"{orc['reference_f64_ms']:.1f} ms, fastattn (float32) {orc['speedup']:.1f}x") in out


def test_bench_accuracy(monkeypatch, capsys):
    """fastattn-bench --accuracy: one row per dtype, number of keys and kind of
    scores with each peer's error against the exact evaluation (fastattn's within
    a few eps), as JSON or a table; --quick takes the first three key counts."""
    from fastattn import _accuracy, bench
    monkeypatch.setattr(_accuracy, "KEYS", (96, 200, 300, 5000))
    assert bench.main(["--accuracy", "--quick", "--no-torch", "--json", "--threads", "2"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["dtype"], r["n_k"], r["scores"]) for r in rows] == [
        (dt, n, kind) for dt in ("float32", "float64") for n in (96, 200, 300) for kind in _accuracy.KINDS]
    for r in rows:
        assert set(r["error"]) == {"fastattn", "NumPy"}
        eps = np.finfo(r["dtype"]).eps
        assert 0 <= r["error"]["fastattn"] <= (8 if r["scores"] != "peaked" else 64) * eps, r
    bench.main(["--accuracy", "--quick", "--no-torch"])
    out = capsys.readouterr().out
    assert out.startswith("| dtype | keys | scores | fastattn | NumPy |") and "| float64 | 300 | peaked |" in out
    with pytest.raises(SystemExit):
        bench.main(["--accuracy", "--plot", "x.png"])


def test_bench_backward(monkeypatch, capsys):
    """fastattn-bench --backward: a row per workload with the forward's and the
    backward's times and the backward's rate; the NumPy backward's line."""
    from fastattn import _bench_backward, bench
    monkeypatch.setattr(_bench_backward, "ROWS", [("small", (1, 2, 1, 96, 16), "float32", True, False),
                                                  ("small f64", (2, 2, 2, 64, 8), "float64", False, False),
                                                  ("packed", (3, 2, 2, 20, 8), "float32", True, True)])
    monkeypatch.setattr(_bench_backward, "QUICK", [0, 1, 2])
    monkeypatch.setattr(_bench_backward, "NUMPY_SHAPE", (1, 2, 64, 16))
    monkeypatch.setattr(bench, "_matmul_rate", lambda dtype, repeats: 100.0)
    assert bench.main(["--backward", "--quick", "--no-torch", "--json", "--threads", "2", "--repeats", "1"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in res["rows"]] == ["small", "small f64", "packed"]
    assert [r["packed"] for r in res["rows"]] == [False, False, True]
    r = res["rows"][0]
    assert (r["B"], r["H"], r["H_kv"], r["n"], r["d"], r["causal"]) == (1, 2, 1, 96, 16, True)
    assert r["forward_ms"] > 0 and r["backward_ms"] > 0
    assert r["backward_gflops"] == pytest.approx(2.5 * 4 * 2 * 96 * 96 * 16 * 0.5 / r["backward_ms"] / 1e6)
    assert res["numpy_backward"]["workload"] == "B1 H2 N64 d16 float64"
    bench.main(["--backward", "--quick", "--no-torch", "--repeats", "1"])
    out = capsys.readouterr().out
    assert out.startswith("| workload | forward ms |") and "NumPy materialised backward" in out


def test_bench_blas_note(monkeypatch, capsys):
    """The matrix-product line says when OPENBLAS_CORETYPE is set: OpenBLAS then runs
    that core's kernels and its rate (the ceiling of "% mm") may understate this CPU's."""
    from fastattn import _bench_backward, bench
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    assert bench.blas_note() == ""
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Nehalem")
    assert "OPENBLAS_CORETYPE=Nehalem is set" in bench.blas_note()
    monkeypatch.setattr(_bench_backward, "ROWS", [("small", (1, 2, 1, 96, 16), "float32", True, False)])
    monkeypatch.setattr(_bench_backward, "QUICK", [0])
    monkeypatch.setattr(_bench_backward, "NUMPY_SHAPE", (1, 2, 64, 16))
    monkeypatch.setattr(bench, "_matmul_rate", lambda dtype, repeats: 100.0)
    bench.main(["--backward", "--quick", "--no-torch", "--repeats", "1"])
    assert "OPENBLAS_CORETYPE=Nehalem is set" in capsys.readouterr().out
