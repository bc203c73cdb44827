"""The plan of a call (src_c/plan.c): what it chooses, read back through
_core.attention(..., plan_only=True), and the per-call overrides that force a path
(fastattn._core.forcing), which stay with the thread that opened them."""
import threading

import numpy as np
import pytest
from conftest import rand

import fastattn
from fastattn import _core


def plan_of(q, k, v, **kw):
    """The plan of _core.attention on head-major q, k, v (..., n, d) without a mask."""
    out = np.empty(q.shape[:-1] + v.shape[-1:], q.dtype)
    return _core.attention(_core.Args(q, k, v, None, _core.MASK_NONE, q.shape[:-2], False, 1.0, 2, **kw), out,
                           None, plan_only=True)


def test_plan_names_the_kernel_and_its_thresholds(isa, rng):
    k, v = rand(rng, (2, 300, 32)), rand(rng, (2, 300, 32))
    one = plan_of(rand(rng, (2, 1, 32)), k, v)
    assert one["kernel"] == "rows" and one["isa"] == isa
    assert one["rows_max"] >= 1 and one["lanes"] in (4, 8, 16)
    big = plan_of(rand(rng, (2, 500, 32)), k, v)
    assert big["kernel"] == "tiled" and big["n_items"] >= 2 and big["bq"] * big["n_qb"] >= 500
    assert plan_of(rand(rng, (2, big["rows_max"], 32)), k, v)["kernel"] in ("rows", "tiled")
    assert plan_of(rand(rng, (2, big["rows_max"] + 1, 32)), k, v)["kernel"] == "tiled"
    assert plan_of(rand(rng, (0, 5, 32)), k[:0], v[:0])["n_items"] == 0


def test_plan_takes_the_overrides(isa, rng):
    q, k, v = rand(rng, (2, 40, 32)), rand(rng, (2, 3000, 32)), rand(rng, (2, 3000, 32))
    with _core.forcing(bq=16, bk=32, fuse=0, split_keys=1024) as f:
        p = plan_of(q, k, v)
        with _core.forcing(rows_max=24):          # an inner block keeps the outer's overrides
            inner = plan_of(q[:, :20], k, v)
    assert (p["bq"], p["bk"], p["fuse"], p["long_splits"]) == (16, 32, False, 3)
    assert inner["kernel"] == "rows" and inner["long_splits"] == 3
    assert f.overrides["bq"] == 16 and plan_of(q, k, v)["bq"] != 16
    with pytest.raises(TypeError, match="no override named 'tile'"):
        _core.forcing(tile=3)


def test_overrides_stay_with_their_thread(isa, rng):
    """A forcing block on one thread does not touch another thread's calls running
    at the same time (the overrides travel in each call's arguments)."""
    q, k, v = rand(rng, (4, 4, 64)), rand(rng, (4, 2000, 64)), rand(rng, (4, 2000, 64))
    rows = fastattn.attention(q, k, v, num_threads=1)
    with _core.forcing(rows_max=1):
        tiled = fastattn.attention(q, k, v, num_threads=1)
    assert not np.array_equal(rows, tiled)        # the two kernels can be told apart
    stop, seen, errors = threading.Event(), [], []

    def other():
        try:
            while not stop.is_set():
                seen.append(np.array_equal(fastattn.attention(q, k, v, num_threads=1), rows))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=other)
    t.start()
    try:
        with _core.forcing(rows_max=1) as f:
            for _ in range(50):
                assert np.array_equal(fastattn.attention(q, k, v, num_threads=1), tiled)
            assert f.tail_rows == 0
    finally:
        stop.set()
        t.join()
    assert not errors and seen and all(seen)


def test_counts_are_per_block(isa, rng):
    """What a block's calls ran: the careful redo of a row with inf in it."""
    q, k, v = rand(rng, (1, 3, 8)), rand(rng, (1, 50, 8)), rand(rng, (1, 50, 8))
    v[0, 7, 2] = np.inf
    with _core.forcing() as f:
        fastattn.attention(q, k, v)
        assert f.redo_rows == 3
        f.reset_counts()
        assert f.redo_rows == 0
        fastattn.attention(q, k, np.nan_to_num(v, posinf=1.0))
        assert f.redo_rows == 0


def test_python_plan_matches_the_table(isa, rng):
    """fastattn._attention._plan: the plan of a public call.  The row kernel takes
    n_q up to rows_max but not rows_full..lanes (the table's, read back from the
    plan), and a GQA group's heads fold into one item's rows up to fold_rows."""
    from fastattn._attention import _plan
    k, v = rand(rng, (2, 600, 64)), rand(rng, (2, 600, 64))
    for nq in range(1, 30):
        p = _plan(rand(rng, (2, nq, 64)), k, v)
        few = nq <= p["rows_max"] and not (p["rows_full"] and p["rows_full"][0] <= nq <= p["rows_full"][1])
        assert p["kernel"] == ("rows" if few else "tiled"), nq
        assert p["n_lead"] == 2 and p["n_qb"] * p["bq"] >= nq and p["n_items"] == 2 * (p["n_qb"] - p["tail"]), nq
    t = _core.isa_table()
    kg, vg = rand(rng, (1, 2, 600, 64)), rand(rng, (1, 2, 600, 64))
    for nq in (1, t["fold_rows"], t["fold_rows"] + 1):
        p = _plan(rand(rng, (1, 8, nq, 64)), kg, vg, enable_gqa=True)
        assert p["fold"] == (nq <= t["fold_rows"]), nq
        assert p["n_lead"] == (2 if p["fold"] else 8)
    w = _plan(rand(rng, (2, 40, 64)), k, v, weights=True)
    assert w["kernel"] == "weights" and w["n_splits"] == 1
