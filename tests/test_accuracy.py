"""Accuracy at long context: the error against an exact evaluation of the same
inputs stays a small multiple of the dtype's epsilon at 65,536 keys, on every
path (the compensated sums of src_c/kernel/online_softmax.h).  A plain running
sum in float32 gains a rounding per key against an ever larger total, and its
error grows with the number of keys (about 100 eps at 65,536 keys before them).

The error is max |got - exact| / max |exact| (fastattn/_accuracy.py, which
also makes the problems and the exact evaluation).  Scores: flat (queries x 0.1)
or peaked (queries x 4); values drawn around 1 (a non-zero mean, as real
values have), where a running sum's error is largest.  Peaked scores carry
the float32 rounding of Q.K itself (a score of 30 is off by about 30 eps, and
its weight by as much), hence the wider bound.
"""

import functools

import numpy as np
import pytest
from helpers import tail_rows

import fastattn
from fastattn import _accuracy, _core
from fastattn._accuracy import exact, rel_err, weights_exact
from fastattn._attention import _plan

NK = 65536
EPS = {np.float32: float(np.finfo(np.float32).eps), np.float64: float(np.finfo(np.float64).eps)}
# bound in units of the dtype's eps, by score kind: about twice the kernels' largest error on
# any path, far below what plain running sums give at this length (docs/accuracy.md)
BOUND = {"flat": 4, "peaked": 16}
QSCALE = {"flat": 0.1, "peaked": 4.0}


def problem(dtype, kind, nq, nk=NK, heads=1, seed=0):
    return _accuracy.problem(dtype, QSCALE[kind], nq, nk, heads, seed=seed)


@functools.lru_cache(maxsize=None)
def expected(dtype, kind, nq, nk=NK, heads=1):
    """exact() of problem(dtype, kind, nq, nk, heads), computed once."""
    return exact(*problem(dtype, kind, nq, nk, heads))


def check(got, want, dtype, kind):
    err, bound = rel_err(got, want), BOUND[kind] * EPS[dtype]
    assert err <= bound, f"error {err:.2e} = {err / EPS[dtype]:.1f} eps > {BOUND[kind]} eps"


dtypes = pytest.mark.parametrize("dtype", [np.float32, np.float64])
kinds = pytest.mark.parametrize("kind", ["flat", "peaked"])


@dtypes
@kinds
@pytest.mark.parametrize("nq, fuse", [(67, 1), (67, 0), (5, -1), (1, -1)],
                         ids=["tiled-fused-tail", "tiled-unfused-tail", "rows", "decode"])
def test_attention(isa, dtype, kind, nq, fuse):
    """The tiled kernel (fused exp or not, and its tail rows where the SIMD path
    takes them), the row kernel and decoding, on each SIMD path.  The few rows
    take the row kernel by force: a table may give 5 rows of these 32-64 MiB of K
    and V to the tiled kernel (from memory)."""
    q, k, v = problem(dtype, kind, nq)
    force = {"fuse": fuse} if nq > 8 else {"fuse": fuse, "rows_max": 8}
    with _core.forcing(**force):
        plan = _plan(q, k, v, num_threads=2)
        assert plan["kernel"] == ("tiled" if nq > 8 else "rows")
        assert plan["tail"] == (tail_rows(isa, dtype, nq) > 0)
        out = fastattn.attention(q, k, v, num_threads=2)
    check(out, expected(dtype, kind, nq), dtype, kind)


@dtypes
@kinds
def test_split_keys(dtype, kind):
    """Decoding split over 8 key ranges, their partials merged (fa_attn_merge)."""
    q, k, v = problem(dtype, kind, 5)
    with _core.forcing(split_keys=8192):
        assert _plan(q, k, v, num_threads=2)["n_splits"] == NK // 8192
        out = fastattn.attention(q, k, v, num_threads=2)
    check(out, expected(dtype, kind, 5), dtype, kind)


@dtypes
@kinds
def test_group(dtype, kind):
    """The group kernel: one new token's four heads over a (B, n, H, d) cache."""
    q, k, v = problem(dtype, kind, 1, heads=4)
    qb, kb, vb = (np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in (q, k, v))
    assert _plan(qb, kb, vb, num_threads=2, layout="blhd")["kernel"] == "group"
    out = fastattn.attention(qb, kb, vb, num_threads=2, layout="blhd")
    check(out.transpose(0, 2, 1, 3), expected(dtype, kind, 1, heads=4), dtype, kind)


@dtypes
@kinds
def test_varlen(dtype, kind):
    """Packed sequences: 16 rows against 65,536 keys, then 5 against 3,000."""
    q, k, v = problem(dtype, kind, 21, NK + 3000)
    cq, ck = np.array([0, 16, 21]), np.array([0, NK, NK + 3000])
    packed = [a[0].transpose(1, 0, 2) for a in (q, k, v)]   # (total, H = 1, d)
    out = fastattn.attention_varlen(*packed, cq, ck, num_threads=2)
    want = np.concatenate([exact(q[..., :16, :], k[..., :NK, :], v[..., :NK, :]),
                           exact(q[..., 16:, :], k[..., NK:, :], v[..., NK:, :])], axis=2)
    check(out[:, 0], want[0, 0], dtype, kind)


@dtypes
@kinds
def test_weights(dtype, kind):
    """attention_weights: each row's sum over 65,536 keys."""
    q, k, _ = problem(dtype, kind, 8)
    check(fastattn.attention_weights(q, k, num_threads=2), weights_exact(q, k), dtype, kind)


@dtypes
def test_softmax_long_rows(isa, dtype):
    """fastattn.softmax over rows of 2**20 values: within 2.5 eps (a plain sum
    of the chunks' sums: 4 eps)."""
    x = (np.random.default_rng(1).standard_normal((2, 2 ** 20)) * 0.1).astype(dtype)
    xw = x.astype(np.longdouble)
    p = np.exp(xw - xw.max(-1, keepdims=True))
    err = rel_err(fastattn.softmax(x), (p / p.sum(-1, keepdims=True)).astype(np.float64))
    assert err <= 2.5 * EPS[dtype], f"error {err / EPS[dtype]:.1f} eps"


@dtypes
@kinds
def test_merge_attention(dtype, kind):
    """merge_attention of 1,024 parts of 64 keys each."""
    q, k, v = problem(dtype, kind, 16)
    parts = [fastattn.attention(q, k[..., j:j + 64, :], v[..., j:j + 64, :], return_lse=True)
             for j in range(0, NK, 64)]
    out, _ = fastattn.merge_attention([o for o, _ in parts], [s for _, s in parts])
    check(out, expected(dtype, kind, 16), dtype, kind)
