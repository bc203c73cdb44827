"""fastattn.dask.attention against fastattn.attention and the reference: every
chunking, options, the graph's shape, on the threaded scheduler and on a
distributed LocalCluster of two single-threaded worker processes."""

import os

import dask  # the "test" extra installs dask and distributed
import dask.array as da
import distributed
import numpy as np
import pytest
from conftest import assert_close, rand, reference64

import fastattn
import fastattn.dask as fdask

F32, F64 = np.float32, np.float64
B, H, N, D = 2, 4, 160, 16
NQ = N - 30                         # query rows of test_options (fewer than keys: bottom-right causal)
CHUNKINGS = {                       # (B, H, n, d) chunks of q, k and v
    "none": (B, H, N, D),
    "lead": (1, 2, N, D),
    "queries": (B, H, 48, D),
    "keys": "keys",                 # q whole, k and v in key blocks of 48
    "all": (1, 2, 48, D),
}


def _chunk(q, k, v, how):
    if how == "keys":
        return da.from_array(q, chunks=q.shape), da.from_array(k, chunks=(B, H, 48, D)), \
            da.from_array(v, chunks=(B, H, 48, D))
    return tuple(da.from_array(x, chunks=how) for x in (q, k, v))


@pytest.fixture(scope="module")
def cluster():
    """Two worker processes with one thread each (distributed sets OMP_NUM_THREADS=1 in them,
    and leaves it in this process's environment too: put back after, for the libraries
    that later tests import, PyTorch among them, which would read it)."""
    env = dict(os.environ)
    try:
        with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                      silence_logs=50) as c, distributed.Client(c) as client:
            yield client
    finally:
        os.environ.clear()
        os.environ.update(env)


def _compute(x, where):
    if where == "threads":
        return dask.compute(*x, scheduler="threads") if isinstance(x, tuple) else x.compute(scheduler="threads")
    return where.compute(list(x) if isinstance(x, tuple) else x, sync=True)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("how", list(CHUNKINGS))
def test_chunkings_threaded(how, causal, dtype):
    rng = np.random.default_rng(0)
    q, k, v = (rand(rng, (B, H, N, D), dtype) for _ in range(3))
    out, lse = fdask.attention(*_chunk(q, k, v, CHUNKINGS[how]), causal=causal, return_lse=True)
    got, got_lse = _compute((out, lse), "threads")
    want, want_lse = fastattn.attention(q, k, v, causal=causal, return_lse=True)
    assert got.dtype == want.dtype and got.shape == want.shape and got_lse.dtype == want_lse.dtype
    assert_close(got, reference64(q, k, v, causal=causal)[0], dtype)
    assert_close(got, want, dtype, "against fastattn.attention")
    assert_close(got_lse, want_lse, dtype, "lse")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("how", list(CHUNKINGS))
def test_chunkings_local_cluster(cluster, how, causal):
    rng = np.random.default_rng(1)
    for dtype in (F32, F64):
        q, k, v = (rand(rng, (B, H, N, D), dtype) for _ in range(3))
        out, lse = fdask.attention(*_chunk(q, k, v, CHUNKINGS[how]), causal=causal, return_lse=True)
        got, got_lse = _compute((out, lse), cluster)
        ref, ref_lse = reference64(q, k, v, causal=causal)
        assert_close(got, ref, dtype)
        assert_close(got_lse, ref_lse, dtype, "lse")


CASES = {
    "bool mask (dask)": lambda rng: dict(mask=da.from_array(rng.random((B, 1, NQ, N)) < 0.7,
                                                            chunks=(1, 1, 48, 64))),
    "float mask (dask)": lambda rng: dict(mask=da.from_array(np.where(rng.random((NQ, N)) < 0.8, 0.0, -np.inf)
                                                             .astype(F32), chunks=(64, 64)), causal=True),
    "window": lambda rng: dict(window=(40, 10)),
    "causal window": lambda rng: dict(causal=True, window=(30, 0)),
    "kv_lengths": lambda rng: dict(kv_lengths=np.array([[160], [77]]), causal=True),
    "q_lengths": lambda rng: dict(q_lengths=np.array([[100], [160]]), kv_lengths=np.array([[100], [160]]),
                                  causal=True),
    "alibi": lambda rng: dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625], F32), causal=True),
    "upper_left": lambda rng: dict(causal="upper_left"),
    "softcap scale": lambda rng: dict(softcap=5.0, scale=0.7),
}


@pytest.mark.parametrize("case", list(CASES))
def test_options(case):
    rng = np.random.default_rng(2)
    q, k, v = rand(rng, (B, H, NQ, D)), rand(rng, (B, H, N, D)), rand(rng, (B, H, N, D))
    kw = CASES[case](rng)
    if case == "q_lengths":
        q = rand(rng, (B, H, N, D))
    qd, kd, vd = (da.from_array(x, chunks=(1, 2, 48, D)) for x in (q, k, v))
    got, got_lse = fdask.attention(qd, kd, vd, return_lse=True, **kw)
    got, got_lse = _compute((got, got_lse), "threads")
    np_kw = {key: (val.compute() if isinstance(val, da.Array) else val) for key, val in kw.items()}
    want, want_lse = fastattn.attention(q, k, v, return_lse=True, **np_kw)
    ref, ref_lse = reference64(q, k, v, **np_kw)
    assert_close(got, ref, F32, case)
    assert_close(got, want, F32, case)
    np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
    assert_close(got_lse, ref_lse, F32, "lse")


def test_gqa_layout_and_1d():
    rng = np.random.default_rng(3)
    q, k, v = rand(rng, (2, N, 8, D)), rand(rng, (2, N, 2, D)), rand(rng, (2, N, 2, D))   # (B, n, H, d)
    qd = da.from_array(q, chunks=(1, 48, 3, D))    # head blocks of 3: rounded to whole groups of 4
    kd, vd = (da.from_array(x, chunks=(1, 64, 1, D)) for x in (k, v))
    got = fdask.attention(qd, kd, vd, enable_gqa=True, causal=True, layout="blhd").compute(scheduler="threads")
    want = fastattn.attention(q, k, v, enable_gqa=True, causal=True, layout="blhd")
    assert got.shape == want.shape == (2, N, 8, D)
    assert_close(got, want, F32)
    # a 1-D query and 1-D values, NumPy inputs (one chunk each)
    q1, k2, v1 = rand(rng, (D,)), rand(rng, (50, D)), rand(rng, (50,))
    got1 = fdask.attention(q1, da.from_array(k2, chunks=(16, D)), v1).compute(scheduler="threads")
    assert got1.shape == () and abs(float(got1) - float(fastattn.attention(q1, k2, v1))) < 1e-5


def test_graph_has_a_task_per_visible_pair():
    """Causal with 4 query and 4 key blocks: the 10 visible (i, j) pairs are tasks, the
    6 hidden ones are not; no partial task receives whole K or V."""
    rng = np.random.default_rng(4)
    q, k, v = (rand(rng, (1, 2, 256, D)) for _ in range(3))
    qd, kd, vd = (da.from_array(x, chunks=(1, 2, 64, D)) for x in (q, k, v))
    out = fdask.attention(qd, kd, vd, causal=True)
    graph = dict(out.__dask_graph__())
    parts = [key for key in graph if isinstance(key, tuple) and key[0].startswith("fastattn-part-")]
    assert sorted(key[-2:] for key in parts) == [(i, j) for i in range(4) for j in range(i + 1)]
    for key in parts:
        task = graph[key]
        args = task.args if hasattr(task, "args") else task[1:]
        names = [a for a in args if isinstance(a, tuple) or type(a).__name__ == "Alias"]
        assert len(names) >= 3        # q, k and v chunk keys, not whole arrays
    # a window hides the far blocks too
    out = fdask.attention(qd, kd, vd, window=(64, 0), causal=True)
    parts = [key for key in dict(out.__dask_graph__()) if isinstance(key, tuple)
             and key[0].startswith("fastattn-part-")]
    assert sorted(key[-2:] for key in parts) == [(0, 0), (1, 0), (1, 1), (2, 1), (2, 2), (3, 2), (3, 3)]


def test_errors_as_attention():
    """The same errors as fastattn.attention, raised before any work."""
    rng = np.random.default_rng(5)
    q, k, v = (da.from_array(rand(rng, (2, 5, 8)), chunks=(1, 5, 8)) for _ in range(3))
    with pytest.raises(ValueError, match="d_k differs"):
        fdask.attention(q, da.zeros((2, 5, 7), chunks=1), v)
    with pytest.raises(ValueError, match="does not broadcast to the scores"):
        fdask.attention(q, k, v, mask=da.ones((3, 3), dtype=bool))
    with pytest.raises(TypeError, match="integer dtype"):
        fdask.attention(q, k, v, mask=da.ones((5, 5), dtype=int))
    with pytest.raises(TypeError, match="complex"):
        fdask.attention(q.astype(complex), k, v)
    with pytest.raises(ValueError, match="kv_lengths must lie in"):
        fdask.attention(q, k, v, kv_lengths=np.array([9]))
    with pytest.raises(ValueError, match="num_threads"):
        fdask.attention(q, k, v, num_threads=0)
    with pytest.raises(ValueError, match="split_every"):
        fdask.attention(q, k, v, split_every=1)
    with pytest.raises(TypeError, match="MaskedArray"):
        fdask.attention(np.ma.MaskedArray(np.ones((2, 5, 8))), k, v)


def test_threads_per_task(cluster):
    """A task on the threaded scheduler runs fastattn on one thread; on a distributed
    worker with OMP_NUM_THREADS=1, on one too; num_threads, if given, stands."""
    assert fdask._task_threads(3) == 3 and fdask._task_threads(-1) == -1
    assert fdask._task_threads(None) is None               # the main thread: fastattn's default
    import threading
    got = []
    t = threading.Thread(target=lambda: got.append(fdask._task_threads(None)))
    t.start()
    t.join()
    assert got == [1]
    cluster.wait_for_workers(2, timeout=120)
    workers = sorted(cluster.run(lambda: None))             # the live workers' addresses
    got = [cluster.submit(fdask._task_threads, None, workers=[w], pure=False).result() for w in workers]
    assert got == [1, 1]
    assert set(cluster.run(lambda: fastattn._core.max_threads()).values()) == {1}   # OMP_NUM_THREADS=1


@pytest.mark.parametrize("num_threads", [None, 1, -1])
def test_synchronous_scheduler(num_threads):
    """On the synchronous scheduler the tasks run in the main thread: fastattn's default
    team (or the request, a negative one counted back on the worker)."""
    rng = np.random.default_rng(6)
    q, k, v = (rand(rng, (B, H, N, D)) for _ in range(3))
    qd, kd, vd = _chunk(q, k, v, CHUNKINGS["all"])
    got = fdask.attention(qd, kd, vd, causal=True, num_threads=num_threads).compute(scheduler="sync")
    assert_close(got, fastattn.attention(q, k, v, causal=True), F32)
