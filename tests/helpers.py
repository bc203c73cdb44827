"""What the test files share besides the fixtures (those are in conftest.py):

- check: fastattn.attention against the float64 reference, the one comparison
  every test makes (check_varlen: the same for attention_varlen);
- team_check: the team a call ran on, against its plan and num_threads;
- the SIMD path's thresholds (rows_limits, tail_rows), read from its table;
- problem makers (PATHS, packed, heads_last) and run_script (a fresh Python).
"""

import contextlib
import os
import subprocess
import sys
import textwrap

import numpy as np
from conftest import assert_close, reference64

import fastattn
from fastattn import _core
from fastattn import reference as ref

F32, F64 = np.float32, np.float64

# shapes (n_q, n_k, threads) that go through the tiled kernel, the row kernel, and
# the split keys' merge
PATHS = {"tiled": (150, 300, 1), "rows": (3, 300, 1), "split": (2, 2100, 2)}

_core_attention = _core.attention   # the binding itself, for plans (not a test's spy on it)


def _operands(arrays):
    """Arrays (array-likes such as lists as arrays) and dtypes, for np.result_type;
    16-bit floats (float16, ml_dtypes' bfloat16) as float32, which they compute in."""
    out = []
    for a in arrays:
        dt = np.dtype(a) if isinstance(a, (np.dtype, type)) else np.asarray(a).dtype
        out.append(np.dtype(F32) if dt.itemsize == 2 and dt.kind in "fV" else
                   (a if isinstance(a, (np.dtype, type)) else np.asarray(a)))
    return out


def compute_dtype(*arrays):
    """The dtype fastattn computes in: float32 for 16-bit floats and float32 inputs, else
    float64 (arrays: the inputs, or their dtypes)."""
    res = np.result_type(*_operands(arrays))
    return np.dtype(F32) if res == np.dtype(F32) else np.dtype(F64)


def result_dtype(*arrays):
    """The dtype of the result: NumPy's result_type of the inputs, float32 for 16-bit
    floats, float64 for integers and bools."""
    res = np.result_type(*_operands(arrays))
    return res if res.kind == "f" else np.dtype(F64)


@contextlib.contextmanager
def team_check(num_threads=None):
    """Check the team of the last call into the C core made inside the block, if
    any: num_threads (the public argument: None or a positive count) reached the
    core; the plan's team is min(num_threads or the default, the plan's work
    units), or 1 for the plan's work below _core.TEAM_MIN_WORK; and _core.last_threads() reports
    that team (1 without OpenMP)."""
    assert num_threads is None or num_threads > 0, "team_check takes None or a positive count"
    calls = []
    real = _core.attention

    def spy(*args, **kw):
        calls.append((args, kw))
        return real(*args, **kw)

    _core.attention = spy
    try:
        yield
    finally:
        _core.attention = real
    if not calls:
        return
    args, kw = calls[-1]
    reached = args[0].nthreads                     # the prepared call (_core.Args)
    assert reached == (0 if num_threads is None else min(num_threads, _core.thread_cap())), \
        f"num_threads={num_threads} reached the C core as {reached}"
    plan = _core_attention(*args, **kw, plan_only=True)
    if plan["n_items"] == 0:                       # nothing ran
        assert _core.last_threads() == 0, f"{_core.last_threads()} threads ran a call with nothing to compute"
        return
    wanted = reached if reached > 0 else _core.max_threads()
    units = (plan["n_groups"] if plan["group"] else plan["n_items"]) * plan["n_splits"]
    team = 1 if plan["work"] < _core.TEAM_MIN_WORK else min(wanted, units)
    assert plan["threads"] == team, f"plan: {plan['threads']} threads, not {team} (work {plan['work']:.3g})"
    ran = plan["threads"] if _core.openmp_enabled() else 1
    assert _core.last_threads() == ran, f"{_core.last_threads()} threads ran, the plan's team is {ran}"


def _compare(got, got_lse, want, want_lse, dtype, what):
    assert_close(got, want, dtype, what)
    assert_close(got_lse, want_lse, dtype, f"{what}, lse")


def _thread_counts(num_threads):
    return list(num_threads) if isinstance(num_threads, (list, tuple)) else [num_threads]


def check(q, k, v, dtype=None, *, num_threads=None, out=None, want=None, what="output", **kw):
    """fastattn.attention(q, k, v, **kw) against the float64 reference (reference64):

    - the output and the lse within the tolerance of `dtype` (assert_close; by
      default the result's dtype, float64 for integer inputs);
    - the result's dtype (NumPy's result_type of q, k, v, float32 for 16-bit
      floats, float64 for integers) and the lse's (the compute dtype);
    - num_threads: None, a count, or a sequence of counts, each run and compared,
      each with the team it ran on (team_check);
    - out: an array the result is written into (it must be the one returned, and
      its values are compared);
    - want: the reference's (output, lse), when the caller has it already;
    - what: the call's name in a failure's message.

    Returns the (output, lse) of the first run."""
    res_dt = result_dtype(q, k, v)
    dtype = res_dt if dtype is None else dtype
    if want is None:
        want = reference64(q, k, v, **kw)
    first = None
    for threads in _thread_counts(num_threads):
        with team_check(threads):
            got, lse = fastattn.attention(q, k, v, return_lse=True, num_threads=threads, out=out, **kw)
        if out is None:
            assert got.dtype == res_dt, f"result dtype {got.dtype}, not {res_dt}"
        else:
            assert got is out, "out= given: the result must be out"
        assert lse.dtype == compute_dtype(q, k, v), f"lse dtype {lse.dtype}"
        _compare(got, lse, *want, dtype, f"{what} ({threads} threads)")
        first = first or (got.copy() if out is not None else got, lse)
    return first


def check_varlen(q, k, v, cq, ck, dtype, *, num_threads=None, **kw):
    """check for fastattn.attention_varlen(q, k, v, cq, ck, **kw) against
    reference.attention_varlen in float64: output, lse, dtypes and the team."""
    c = lambda a: np.asarray(a).astype(F64)
    want = ref.attention_varlen(c(q), c(k), c(v), cq, ck, return_lse=True, **kw)
    first = None
    for threads in _thread_counts(num_threads):
        with team_check(threads):
            got, lse = fastattn.attention_varlen(q, k, v, cq, ck, return_lse=True, num_threads=threads, **kw)
        assert got.dtype == result_dtype(q, k, v) and lse.dtype == compute_dtype(q, k, v)
        _compare(got, lse, *want, dtype, f"varlen output ({threads} threads)")
        first = first or (got, lse)
    return first


def packed(rng, lq, lk, H, Hkv, dtype, d=16, dv=8):
    """Packed sequences of lq query and lk key rows: q (T_q, H, d), k (T_k, Hkv, d),
    v (T_k, Hkv, dv) and their cumulative lengths."""
    cq, ck = np.cumsum([0] + list(lq)), np.cumsum([0] + list(lk))
    rand = lambda shape: rng.standard_normal(shape).astype(dtype)
    return rand((cq[-1], H, d)), rand((ck[-1], Hkv, d)), rand((ck[-1], Hkv, dv)), cq, ck


def heads_last(a):
    """(..., H, n, d) -> (..., n, H, d), C-contiguous: the arrays as flash-attn and JAX lay them out."""
    return np.ascontiguousarray(np.swapaxes(a, -3, -2))


def rows_limits(dtype, kind, dk=None, contiguous=True):
    """The most query rows that take the row kernel on the SIMD path in use, and
    the (lo, hi) rows that take the tiled kernel below it (None: none), read from
    its table (_core.isa_table, what the plan reads), for K and V of the queries'
    dtype.  kind: 0 K and V within 48 MiB and dk < 128 (rows_max), 1 K and V beyond
    48 MiB (rows_max_big; at dk >= 128 rows_max_big_dk where set), 2 within 48 MiB
    and dk >= 128 (rows_max_dk).  dk
    (default: 128 for kind 2, else 64) against the table's rows_full_dk, which
    applies where K's and V's rows are contiguous; dk > 128 from memory: no
    rows_full."""
    t, x = _core.isa_table(), int(dtype == F64)
    dk = dk if dk is not None else 128 if kind == 2 else 64
    limit = t[("rows_max", "rows_max_big", "rows_max_dk")[kind]][x]
    if kind == 1 and dk >= 128 and t["rows_max_big_dk"][x] > 0:
        limit = t["rows_max_big_dk"][x]
    full = t["rows_full"][x]
    if (contiguous and 0 < t["rows_full_dk"] <= dk) or (kind == 1 and dk > 128):
        full = 0
    return limit, ((full, t["lanes"][x]) if full else None)


def tail_rows(isa, dtype, nq, one_block_from_memory=False):
    """The rows of nq that the row kernel takes as the tiled kernel's tail (with
    enough blocks for the threads; the blocks are whole vectors but the last);
    none after a single block with K and V from memory where the table's tail_mem
    is off."""
    t, x = _core.isa_table(), int(dtype == F64)
    assert t["isa"] == isa
    if one_block_from_memory and not t["tail_mem"]:
        return 0
    r = nq % t["lanes"][x]
    return r if 0 < r <= t["tail_max"][x] and nq - r >= 16 else 0


def run_script(tmp_path, code, timeout=120, env=None, args=()):
    """Run code in a fresh Python (the fastattn these tests import, not a source
    folder in the working directory) and return the finished process."""
    where = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join([where] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(code))
    return subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path, env=env)
