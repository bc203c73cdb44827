"""Shared test fixtures (the SIMD path, the forcing of a path, a spy on the C core)
and the tolerance rule (assert_close; helpers.py holds check and the rest).

Every fast result is compared with fastattn.reference evaluated in float64 on
the same (already rounded) inputs.  Tolerances are relative to the magnitude
of the reference output.
"""

import os

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from fastattn import ISA_NAMES, _core
from fastattn import reference as ref

# The reference's matrix products (NumPy's BLAS) on one thread, for the whole session:
# OpenBLAS keeps its threads spinning for 75-100 ms after each product (docs/guide.md:
# Environment variables), and each test's next fastattn call shared the cores with them.
# The suite took 98 s so and takes 86 s now (under CI's sanitizers 307 s, now 278 s).
# fastattn's own threads are not limited by this (user_api "blas" only).
_BLAS_ON_ONE_THREAD = threadpool_limits(limits=1, user_api="blas")

ISAS = [name for name in ISA_NAMES if _core.isa_available(name)]
# FASTATTN_TEST_ISAS=avx2,generic: only those paths (CI's Python-version runs
# take the default path only; the main run takes every path this CPU has)
if os.environ.get("FASTATTN_TEST_ISAS"):
    _want = os.environ["FASTATTN_TEST_ISAS"].split(",")
    ISAS = [name for name in ISAS if name in _want]
    if not ISAS:
        raise pytest.UsageError(f"FASTATTN_TEST_ISAS={os.environ['FASTATTN_TEST_ISAS']}: none of "
                                f"{_want} is available here (available: "
                                f"{[n for n in ISA_NAMES if _core.isa_available(n)]})")

# relative tolerance of each compute dtype against the float64 reference
RTOL = {np.dtype(np.float16): 2e-3, np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}


@pytest.fixture(params=ISAS)
def isa(request):
    """Run the test on each SIMD path this machine has (with its built-in
    tuning), then restore the path and the tuning in use."""
    before, tuning = _core.isa_name(), _core.isa_table()
    _core.set_isa(request.param)
    yield request.param
    _core.set_isa(before)
    _core.set_tuning(tuning)


def tol(dtype):
    dt = np.dtype(dtype)
    if dt.kind != "f":
        dt = np.dtype(np.float64)
    return RTOL[dt]


def assert_close(got, want, dtype, what="output", rtol=None):
    """|got - want| <= rtol * max(1, max|want|), with NaN and inf where want has them
    (rtol: the dtype's tolerance, tol(dtype), unless given)."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN positions differ")
    inf = np.isinf(want)
    np.testing.assert_array_equal(got[inf], want[inf], err_msg=f"{what}: inf entries differ")
    fin = np.isfinite(want)
    if not fin.any():
        return
    scale = max(1.0, float(np.max(np.abs(want[fin]))))
    err = float(np.max(np.abs(got[fin] - want[fin]), initial=0.0))
    rtol = tol(dtype) if rtol is None else rtol
    assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol:.1g} * {scale:.3g} ({dtype})"


def reference64(q, k, v, **kw):
    """The reference on float64 copies of the inputs (masks kept as they are)."""
    c = lambda a: np.asarray(a).astype(np.float64)  # noqa: E731
    mask = kw.pop("mask", None)
    if mask is not None and np.asarray(mask).dtype != bool:
        mask = c(mask)
    return ref.attention(c(q), c(k), c(v), mask=mask, return_lse=True, **kw)


def rand(rng, shape, dtype=np.float32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


# Forcing a path: the plan's per-call overrides (fastattn._core.forcing), which
# apply to this test's calls on its own thread only and end with the test.

@pytest.fixture
def force():
    """The overrides of this test's calls: force.set(bq=..., rows_max=..., ...)
    (fastattn._core.Forcing names them), and what the calls ran: force.group_runs,
    force.tail_rows, force.redo_rows, force.kv_widened, force.chunk_rows, counted from force.reset_counts()."""
    with _core.forcing() as f:
        yield f


@pytest.fixture
def tuning():
    """tuning(field=value, ...): this test's calls plan with the tuning in use but
    these fields (fastattn._core.isa_table names them); restored after."""
    before = _core.isa_table()
    yield lambda **fields: _core.set_tuning(dict(_core.isa_table(), **fields))
    _core.set_tuning(before)


@pytest.fixture
def tiles(force):
    """tiles(bq, bk): force the tiled kernel's tile sizes (0: the plan's)."""
    return lambda bq=0, bk=0: force.set(bq=bq, bk=bk)


@pytest.fixture
def rows_max(force):
    """rows_max(n): force the largest n_q that takes the row kernel (0: the plan's)."""
    return lambda n=0: force.set(rows_max=n)


@pytest.fixture
def stream(force):
    """stream(mode): force the row kernel's prefetch across passes and its far
    prefetch into L2 on (1) or off (0); -1: the plan's (by the size of K and V)."""
    return lambda mode=-1: force.set(stream=mode)


@pytest.fixture
def group(force):
    """group(mode): force the group kernel over the interleaved heads of a
    (B, n, H, d) cache on (1) or off (0); -1: the plan's (from memory only)."""
    return lambda mode=-1: force.set(group=mode)


@pytest.fixture
def long_split(force):
    """long_split(keys, parts_bytes): split rows of more than `keys` keys, in waves
    of at most parts_bytes of partials (0: the plan's)."""
    return lambda keys=0, parts_bytes=0: force.set(split_keys=keys, parts_bytes=parts_bytes)


@pytest.fixture(params=[1, 0], ids=["fused", "unfused"])
def fused(request, force):
    """Run with the tiled kernel's fused exp forced on, then off (each SIMD path's
    default is one of the two: dispatch.c)."""
    force.set(fuse=request.param)
    return request.param


@pytest.fixture(params=[1, 0], ids=["packed", "bytes"])
def mask_pack(request, force):
    """Run with the tiled kernel's packing of a bool mask into bits forced on, then
    off (the tiles read the mask's bytes; by default only a mask of its own per
    head is read so)."""
    force.set(mask_pack=request.param)
    return request.param


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def core_calls(monkeypatch):
    """The (lead, q shape, row_group) of each call into the C core."""
    calls = []
    real = _core.attention

    def spy(p, out, lse, **kw):
        calls.append((p.lead, p.q.shape, p.row_group))
        return real(p, out, lse, **kw)

    monkeypatch.setattr(_core, "attention", spy)
    return calls
