"""Smoke test of the portable SIMD path, meant to run on a CPU without AVX:

    OPENBLAS_CORETYPE=Nehalem qemu-x86_64 -cpu Nehalem PYTHON tests/smoke_portable.py --expect generic
    qemu-x86_64 -cpu Haswell PYTHON tests/smoke_portable.py --expect avx2

(PYTHON: the interpreter binary itself, not a shell shim; OPENBLAS_CORETYPE
because NumPy's OpenBLAS misdetects qemu's Nehalem and runs AVX code.)
On a CPU without AVX, fastattn must choose the generic path at import, refuse
FASTATTN_ISA=avx2 with a warning, and give the reference's results.  Any AVX
instruction executed on the way (a stray one in a static initialiser, in the
dispatcher, in an inlined helper) kills the process with SIGILL, so a clean
exit is the proof.  The Haswell control (AVX2 and FMA, no AVX-512) must take
the avx2 path: the AVX-512 kernels are not chosen without their CPUID bits.
Exit status 0 on success.
"""

import os
import sys
import warnings

import numpy as np

os.environ["FASTATTN_ISA"] = "avx2"   # asked for, but must not be granted on this CPU
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import fastattn
    from fastattn import _core, reference

expect = sys.argv[sys.argv.index("--expect") + 1] if "--expect" in sys.argv else None
isa = _core.isa_name()
print(f"SIMD path chosen: {isa}; available: "
      f"{', '.join(n for n in fastattn.ISA_NAMES if _core.isa_available(n))}")
if expect is not None:
    assert isa == expect, f"expected the {expect} path on this CPU, got {isa}"
if expect == "generic":
    assert any("not available" in str(w.message) for w in caught), "no warning for FASTATTN_ISA=avx2"

rng = np.random.default_rng(0)
checks = 0
for dtype, tol in ((np.float32, 1e-5), (np.float64, 1e-12)):
    for (lead, nq, nk, d, dv) in (((2, 2), 37, 70, 16, 8), ((1,), 1, 1500, 64, 64), ((1,), 70, 3000, 24, 40),
                                  ((), 3, 9, 80, 3)):
        q = rng.standard_normal(lead + (nq, d)).astype(dtype)
        k = rng.standard_normal(lead + (nk, d)).astype(dtype)
        v = rng.standard_normal(lead + (nk, dv)).astype(dtype)
        mask = rng.random((nq, nk)) < 0.8
        for kw in (dict(), dict(causal=True), dict(mask=mask)):
            for threads in (1, 2):
                out, lse = fastattn.attention(q, k, v, return_lse=True, num_threads=threads, **kw)
                want, want_lse = reference.attention(*(a.astype(np.float64) for a in (q, k, v)),
                                                     return_lse=True, **kw)
                scale = max(1.0, float(np.abs(want).max()))
                assert np.max(np.abs(out - want)) <= tol * scale, (dtype, lead, nq, nk, kw)
                fin = np.isfinite(want_lse)
                assert np.array_equal(fin, np.isfinite(lse))
                assert np.max(np.abs(lse[fin] - want_lse[fin]), initial=0) <= tol * 100, (dtype, "lse")
                checks += 1
    # GQA speculative decoding: 3 query rows of 8 heads on 2 K and V heads, folded into
    # 12-row items with 4 rows to a position (the C core's row_group), causal
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((2, 8, 3, 32), (2, 2, 1500, 32), (2, 2, 1500, 32)))
    out = fastattn.attention(q, k, v, causal=True, enable_gqa=True)
    want = reference.attention(*(a.astype(np.float64) for a in (q, k, v)), causal=True, enable_gqa=True)
    assert np.max(np.abs(out - want)) <= tol * max(1.0, float(np.abs(want).max())), (dtype, "gqa")
    checks += 1
    x = (rng.standard_normal((5, 3000)) * 10).astype(dtype)
    assert np.max(np.abs(fastattn.softmax(x) - reference.softmax(x.astype(np.float64)))) <= tol
    xs = np.linspace(-700 if dtype is np.float64 else -87, 0, 1001).astype(dtype)  # normal results
    assert np.allclose(_core.vexp(xs), np.exp(xs.astype(np.float64)), rtol=4 * np.finfo(dtype).eps, atol=0)
    checks += 2
# 16-bit K and V (float16; bfloat16 where ml_dtypes is installed), read as stored: the
# portable path widens them in integer code (no F16C), the AVX2 path by F16C
halves = [np.dtype(np.float16)]
try:
    import ml_dtypes
    halves.append(np.dtype(ml_dtypes.bfloat16))
except ImportError:
    pass
for half in halves:
    bits = np.arange(1 << 16, dtype=np.uint16).view(half)
    want = bits.astype(np.float32)
    got = _core.kv_widen(bits)
    nan = np.isnan(want)
    assert np.isnan(got[nan]).all() and np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32)), half
    for nq in (1, 3, 70):
        q = rng.standard_normal((2, 4, nq, 40)).astype(np.float32)
        k, v = (rng.standard_normal((2, 2, 900, 40)).astype(half) for _ in range(2))
        out = fastattn.attention(q, k, v, causal=True, enable_gqa=True)
        ref = reference.attention(*(a.astype(np.float64) for a in (q, k, v)), causal=True, enable_gqa=True)
        assert out.dtype == np.float32 and np.max(np.abs(out - ref)) <= 1e-5 * max(1.0, float(np.abs(ref).max())), half
        checks += 1
    checks += 1
print(f"portable-path smoke test: {checks} checks passed on the {isa} path")
