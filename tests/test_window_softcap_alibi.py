"""Score modifiers: sliding windows, softcap and ALiBi slopes, on every kernel path
(PATHS), against the reference."""

import numpy as np
import pytest
from conftest import assert_close, rand
from helpers import F32, F64, PATHS, check

import fastattn
from fastattn import reference as ref

# ---------------------------------------------------------------------------
# sliding windows
# ---------------------------------------------------------------------------
WINDOWS = [(0, 0), (5, 0), (None, 3), (3, None), (-1, 2), (40, 40), (0, 10**6), (10**6, 10**6), (None, None),
           (2**63 - 1, 0), (0, 2**63 - 1)]


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("path", list(PATHS))
def test_window(isa, rng, dtype, window, path):
    nq, nk, threads = PATHS[path]
    q, k, v = rand(rng, (2, nq, 16), dtype), rand(rng, (2, nk, 16), dtype), rand(rng, (2, nk, 8), dtype)
    check(q, k, v, dtype, window=window, num_threads=threads)
    check(q, k, v, dtype, window=window, causal=True, num_threads=threads)
    check(q, k, v, dtype, window=window, mask=rng.random((nq, nk)) < 0.8, num_threads=threads)


def test_window_empty_rows_and_more_queries(isa, rng):
    """n_q > n_k: a window puts early rows entirely before the first key."""
    q, k, v = rand(rng, (300, 8)), rand(rng, (100, 8)), rand(rng, (100, 4))
    out, lse = check(q, k, v, F32, window=(10, 0))
    assert np.all(out[:190] == 0) and np.all(np.isneginf(lse[:190]))
    for huge in (2**63 - 1, 2**62, 400, 399):   # wider than any distance (< 400): unbounded
        out, _ = check(q, k, v, F32, window=(huge, 0))
        assert np.array_equal(out, fastattn.attention(q, k, v, window=(None, 0)))
        out, _ = check(q, k, v, F32, window=(0, huge), causal=False)
        assert np.array_equal(out, fastattn.attention(q, k, v, window=(0, None)))


@pytest.mark.parametrize("window,exc", [((1, 2, 3), ValueError), (5, ValueError), ((1.5, 2), TypeError),
                                        ((True, 2), TypeError)])
def test_window_errors(rng, window, exc):
    with pytest.raises(exc, match="window"):
        fastattn.attention(rand(rng, (4, 8)), rand(rng, (6, 8)), rand(rng, (6, 2)), window=window)


# ---------------------------------------------------------------------------
# softcap
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("softcap", [0.1, 1.0, 5.0, 50.0])
@pytest.mark.parametrize("path", list(PATHS))
def test_softcap(isa, rng, dtype, softcap, path):
    nq, nk, threads = PATHS[path]
    q, k, v = rand(rng, (2, nq, 16), dtype, 3.0), rand(rng, (2, nk, 16), dtype), rand(rng, (2, nk, 8), dtype)
    check(q, k, v, dtype, softcap=softcap, scale=1.0, num_threads=threads)
    check(q, k, v, dtype, softcap=softcap, causal=True, mask=rng.random((nq, nk)) < 0.9, num_threads=threads)


def test_softcap_extremes(rng):
    q, k, v = rand(rng, (5, 4)), rand(rng, (9, 4)), rand(rng, (9, 2))
    q[0] = 1e30
    q[1] = np.inf
    out = fastattn.attention(q, k, v, softcap=10.0)
    want = ref.attention(q.astype(F64), k.astype(F64), v.astype(F64), softcap=10.0)
    assert_close(out, want, F32)


@pytest.mark.parametrize("bad,exc", [(0.0, ValueError), (-1.0, ValueError), (np.inf, ValueError), ("x", TypeError)])
def test_softcap_errors(rng, bad, exc):
    with pytest.raises(exc, match="softcap"):
        fastattn.attention(rand(rng, (4, 8)), rand(rng, (6, 8)), rand(rng, (6, 2)), softcap=bad)


# ---------------------------------------------------------------------------
# ALiBi
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("path", list(PATHS))
def test_alibi(isa, rng, dtype, path):
    nq, nk, threads = PATHS[path]
    q, k, v = rand(rng, (2, 4, nq, 16), dtype), rand(rng, (2, 4, nk, 16), dtype), rand(rng, (2, 4, nk, 8), dtype)
    slopes = 2.0 ** -np.arange(1, 5)
    check(q, k, v, dtype, alibi_slopes=slopes, num_threads=threads)
    check(q, k, v, dtype, alibi_slopes=slopes, causal=True, num_threads=threads)
    check(q, k, v, dtype, alibi_slopes=rng.random((2, 4)), window=(30, 0), num_threads=threads)
    check(q, k, v, dtype, alibi_slopes=0.5, softcap=4.0, num_threads=threads)


def test_alibi_errors(rng):
    q, k, v = rand(rng, (2, 3, 4, 8)), rand(rng, (2, 3, 6, 8)), rand(rng, (2, 3, 6, 2))
    with pytest.raises(ValueError, match="alibi_slopes"):
        fastattn.attention(q, k, v, alibi_slopes=np.ones(5))
    with pytest.raises(ValueError, match="alibi_slopes"):
        fastattn.attention(q, k, v, alibi_slopes=np.ones((4, 2, 3)))      # would grow the leading dims
    with pytest.raises(TypeError, match="alibi_slopes"):
        fastattn.attention(q, k, v, alibi_slopes=np.ones(3, complex))
