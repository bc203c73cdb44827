"""Public behaviour: out= (its values, any strides, the dtypes the result casts to
under NumPy's same_kind rule, an out that aliases or overlaps an input, a mask
or the slopes, and one whose elements overlap one another)."""

import numpy as np
import pytest
from conftest import assert_close, rand, reference64
from helpers import F32, F64, check, compute_dtype, team_check

import fastattn


# ---------------------------------------------------------------------------
# out= of the result's dtype, any strides
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, F64])
def test_out_contiguous(rng, dtype):
    q, k, v = (rand(rng, (2, 20, 8), dtype) for _ in range(3))
    out = np.empty((2, 20, 8), dtype)
    res = fastattn.attention(q, k, v, out=out)
    assert res is out
    assert_close(out, reference64(q, k, v)[0], dtype)


def test_out_strided_and_float16(rng):
    q, k, v = rand(rng, (2, 20, 8)), rand(rng, (2, 25, 8)), rand(rng, (2, 25, 6))
    big = np.zeros((2, 40, 12), F32)
    out = big[:, ::2, 3:9]
    res = fastattn.attention(q, k, v, out=out)
    assert res is out
    assert_close(out, reference64(q, k, v)[0], F32)
    assert np.all(big[:, 1::2] == 0) and np.all(big[:, :, :3] == 0) and np.all(big[:, :, 9:] == 0)
    out_t = np.zeros((2, 6, 20), F32).transpose(0, 2, 1)   # last axis not contiguous
    assert fastattn.attention(q, k, v, out=out_t) is out_t
    assert_close(out_t, reference64(q, k, v)[0], F32)
    q16, k16, v16 = (a.astype(np.float16) for a in (q, k, v))
    out16 = np.empty((2, 20, 6), np.float16)
    assert fastattn.attention(q16, k16, v16, out=out16) is out16
    assert_close(out16, reference64(q16, k16, v16)[0], np.float16)


def test_out_one_dim_forms(rng):
    """The 1-D forms write into out= too: (n_k,) values give one number a query."""
    k, v = rand(rng, (3, 7, 5)), rand(rng, (7,))
    q = rand(rng, (5,))
    out = np.full(3, np.nan, F32)
    check(q, k, v, out=out)                                 # out is returned, its values the reference's
    out0 = np.full((), np.nan)                              # (5,), (7, 5), (7,): a 0-d out
    check(q, k[0], v, out=out0)


def test_out_aliasing_an_input(rng):
    q, k, v = rand(rng, (2, 20, 8)), rand(rng, (2, 20, 8)), rand(rng, (2, 20, 8))
    want = reference64(q, k, v, causal=True)[0]
    qq = q.copy()
    fastattn.attention(qq, k, v, causal=True, out=qq)   # out is q itself
    assert_close(qq, want, F32)


# ---------------------------------------------------------------------------
# out= of another dtype: same_kind casts
# ---------------------------------------------------------------------------
# (inputs, out): out's dtype differs from the result's, and the result casts to it under
# NumPy's same_kind rule
_OUT_CASTS = [(F32, F64), (F64, F32), (F32, ">f4"), (F64, ">f8"), (np.float16, F32), (np.float16, F64),
              (F32, np.float16), (F64, np.complex128), (np.int16, F32)]


@pytest.mark.parametrize("in_dt,out_dt", _OUT_CASTS)
@pytest.mark.parametrize("form", ["bhld", "blhd", "gqa", "decode"])
def test_out_casts_same_kind(rng, in_dt, out_dt, form):
    """out= takes any dtype the result casts to (same_kind, as NumPy's out=): the compute
    dtype's values cast once, bitwise the call without out cast to out's dtype."""
    nq, hkv = (1, 2) if form == "decode" else (37, 2 if form == "gqa" else 4)
    shape = {"q": (2, 4, nq, 24), "kv": (2, hkv, 50, 24)}
    q = (rand(rng, shape["q"]) * 4).astype(in_dt)
    k, v = ((rand(rng, shape["kv"]) * 4).astype(in_dt) for _ in range(2))
    kw = dict(causal=True, enable_gqa=hkv != 4)
    if form == "blhd":
        q, k, v = (np.ascontiguousarray(a.swapaxes(1, 2)) for a in (q, k, v))
        kw["layout"] = "blhd"
    comp = compute_dtype(np.result_type(q, k, v))
    plain = fastattn.attention(q, k, v, **kw)
    assert plain.dtype == comp
    out = np.full(plain.shape, 7, out_dt)
    res = fastattn.attention(q, k, v, out=out, **kw)
    assert res is out and out.dtype == np.dtype(out_dt)
    np.testing.assert_array_equal(out, plain.astype(out_dt))
    if form == "blhd":
        q, k, v = (a.swapaxes(1, 2) for a in (q, k, v))
        out = out.swapaxes(1, 2)
    low = F32 if F32 in (comp, np.dtype(out_dt).newbyteorder("=")) else F64
    if np.dtype(out_dt) == np.dtype(np.float16):
        low = np.float16
    assert_close(out.real.astype(F64), reference64(q, k, v, causal=True, enable_gqa=hkv != 4)[0], low)


@pytest.mark.parametrize("in_dt,out_dt", _OUT_CASTS)
def test_out_casts_same_kind_softmax_varlen(rng, in_dt, out_dt):
    x = (rand(rng, (3, 5, 40)) * 4).astype(in_dt)
    comp = compute_dtype(x.dtype)
    out = np.empty(x.shape, out_dt)
    assert fastattn.softmax(x, out=out) is out
    np.testing.assert_array_equal(out, fastattn.softmax(x.astype(comp)).astype(out_dt))
    out2 = np.empty((3, 40, 5), out_dt).transpose(0, 2, 1)   # strided, and several axes
    assert fastattn.softmax(x, axis=(0, 2), out=out2) is out2
    np.testing.assert_array_equal(out2, fastattn.softmax(x.astype(comp), axis=(0, 2)).astype(out_dt))
    q, k, v = ((rand(rng, (n, 4, 16)) * 4).astype(in_dt) for n in (9, 12, 12))
    cq, ck = np.array([0, 4, 9]), np.array([0, 5, 12])
    out3 = np.empty((9, 4, 16), out_dt)
    assert fastattn.attention_varlen(q, k, v, cq, ck, causal=True, out=out3) is out3
    want = fastattn.attention_varlen(q.astype(comp), k.astype(comp), v.astype(comp), cq, ck, causal=True)
    np.testing.assert_array_equal(out3, want.astype(out_dt))


# ---------------------------------------------------------------------------
# out= that shares memory with an input read after out is first written
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["float", "bool"])
@pytest.mark.parametrize("nthreads", [1, 2])
def test_out_overlapping_mask(kind, nthreads):
    """The plain path checked only q, k, v for overlap with out: a mask in out's
    buffer was overwritten while still being read (wrong by 0.81)."""
    rng = np.random.default_rng(0)
    q, k, v = rand(rng, (300, 16)), rand(rng, (64, 16)), rand(rng, (64, 64))
    buf = rand(rng, (301, 64))
    if kind == "float":
        mask = buf[:-1]
    else:   # a bool mask stored in the first bytes of the same buffer
        mask = buf.reshape(-1).view(np.uint8)[:300 * 64].reshape(300, 64).view(bool)
        mask[...] = rng.random((300, 64)) < 0.7
    mask0 = mask.copy()      # out's writes change the mask: it is read before them
    want = fastattn.attention(q, k, v, mask=mask0, num_threads=nthreads)
    with team_check(nthreads):
        got = fastattn.attention(q, k, v, mask=mask, out=buf[1:], num_threads=nthreads)
    assert np.shares_memory(got, buf)
    np.testing.assert_array_equal(got, want)
    assert_close(got, reference64(q, k, v, mask=mask0)[0], F32)


def test_varlen_out_overlapping_slopes():
    """attention_varlen did not check alibi_slopes for overlap with out (wrong by 3.34)."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((400, 4, 8)) for _ in range(3))
    cu = np.array([0, 100, 250, 400])
    buf = np.zeros(400 * 4 * 8)
    out = buf.reshape(400, 4, 8)
    slopes = buf[:12].reshape(3, 4)          # (B, H), in the first 12 elements of out's buffer
    slopes[...] = rng.random((3, 4))
    want = fastattn.attention_varlen(q, k, v, cu, cu, causal=True, alibi_slopes=slopes.copy())
    got = fastattn.attention_varlen(q, k, v, cu, cu, causal=True, alibi_slopes=slopes, out=out)
    assert got is out
    np.testing.assert_array_equal(got, want)


def test_varlen_out_overlapping_qkv():
    rng = np.random.default_rng(2)
    buf = rng.standard_normal(3 * 60 * 2 * 8)
    q, k, v = (buf[i * 960:(i + 1) * 960].reshape(60, 2, 8) for i in range(3))
    cu = np.array([0, 25, 60])
    want = fastattn.attention_varlen(q.copy(), k.copy(), v.copy(), cu, cu)
    got = fastattn.attention_varlen(q, k, v, cu, cu, out=q)
    np.testing.assert_allclose(got, want, rtol=0, atol=0)


def test_out_self_overlapping_refused():
    """An out whose elements overlap (stride 0, overlapping strides) would come out as
    whichever write was last: refused with a ValueError, on every entry point."""
    rng = np.random.default_rng(3)
    q, k, v = rand(rng, (4, 8)), rand(rng, (6, 8)), rand(rng, (6, 8))
    base = np.zeros(256, F32)
    s = base.itemsize
    bad = [np.lib.stride_tricks.as_strided(base, (4, 8), (0, s), writeable=True),       # rows alike
           np.lib.stride_tricks.as_strided(base, (4, 8), (s, s), writeable=True),       # rows one apart
           np.lib.stride_tricks.as_strided(base, (4, 8), (8 * s, 0), writeable=True),   # columns alike
           np.lib.stride_tricks.as_strided(base, (4, 8), (3 * s, 2 * s), writeable=True)]  # interleaved, overlapping
    for out in bad:
        with pytest.raises(ValueError, match="overlap one another"):
            fastattn.attention(q, k, v, out=out)
        with pytest.raises(ValueError, match="overlap one another"):
            fastattn.softmax(q, out=out)
    with pytest.raises(ValueError, match="overlap one another"):
        fastattn.attention(q[:, None], k[:, None], v[:, None], layout="blhd",
                           out=np.lib.stride_tricks.as_strided(base, (4, 1, 8), (0, 0, s), writeable=True))
    qv = rand(rng, (5, 2, 8))
    with pytest.raises(ValueError, match="overlap one another"):
        fastattn.attention_varlen(qv, qv, qv, [0, 2, 5], [0, 2, 5],
                                  out=np.lib.stride_tricks.as_strided(base, (5, 2, 8), (0, 8 * s, s),
                                                                      writeable=True))
    # interleaved strides whose elements do not overlap: accepted and right
    inter = np.lib.stride_tricks.as_strided(base, (2, 3), (3 * s, 2 * s), writeable=True)  # offsets 0,2,4,3,5,7
    got = fastattn.attention(q[:2, :3], k[:, :3], v[:, :3], out=inter)
    assert got is inter
    assert_close(got, reference64(q[:2, :3], k[:, :3], v[:, :3])[0], F32)
