"""Public behaviour: the shapes fastattn.attention takes and returns (sizes, head
dims, n_q != n_k, broadcast leading dims, empty dims, the 1-D forms), scale,
the result's dtype, strides and views, layout="blhd", misaligned arrays, and
inputs left as they were; each against the float64 reference."""

import numpy as np
import pytest
from conftest import assert_close, rand, reference64
from helpers import F32, F64, check, compute_dtype, heads_last, team_check

import fastattn
from fastattn import reference as ref


# ---------------------------------------------------------------------------
# sizes, head dims, tails (every SIMD path)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("n", [1, 7, 33, 65, 127, 129, 257, 600])
@pytest.mark.parametrize("causal", [False, True])
def test_sizes(isa, fused, rng, dtype, n, causal):
    q, k, v = (rand(rng, (2, n, 32), dtype) for _ in range(3))
    check(q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("d", [1, 16, 32, 64, 80, 96, 128, 256])
def test_head_dims(isa, rng, dtype, d):
    q, k, v = (rand(rng, (2, 45, d), dtype) for _ in range(3))
    check(q, k, v)
    check(q, k, v, causal=True)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("nq,nk", [(1, 300), (5, 129), (64, 65), (200, 31), (129, 1), (70, 520)])
@pytest.mark.parametrize("causal", [False, True])
def test_nq_ne_nk(isa, rng, dtype, nq, nk, causal):
    q = rand(rng, (3, nq, 24), dtype)
    k = rand(rng, (3, nk, 24), dtype)
    v = rand(rng, (3, nk, 40), dtype)
    check(q, k, v, causal=causal)


@pytest.mark.parametrize("dk,dv", [(16, 48), (64, 1), (3, 130), (128, 64)])
def test_dk_ne_dv(isa, rng, dk, dv):
    q, k = rand(rng, (2, 70, dk)), rand(rng, (2, 90, dk))
    v = rand(rng, (2, 90, dv))
    check(q, k, v)
    check(q, k, v, causal=True)


def test_larger(isa, rng):
    q, k, v = (rand(rng, (1, 2, 1100, 64)) for _ in range(3))
    check(q, k, v, causal=True)
    check(q.astype(F64), k.astype(F64), v.astype(F64))


# ---------------------------------------------------------------------------
# broadcasting of leading dims, empty dims
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("qs,ks,vs", [
    ((2, 3, 10, 8), (2, 3, 12, 8), (2, 3, 12, 5)),
    ((2, 3, 10, 8), (1, 3, 12, 8), (2, 1, 12, 5)),
    ((10, 8), (4, 12, 8), (12, 5)),
    ((4, 1, 10, 8), (5, 12, 8), (1, 5, 12, 5)),
    ((3, 1, 2, 1, 10, 8), (2, 4, 12, 8), (12, 5)),
])
def test_broadcast_leading(isa, rng, qs, ks, vs):
    q, k, v = rand(rng, qs), rand(rng, ks), rand(rng, vs)
    out, _ = check(q, k, v)
    assert out.shape == np.broadcast_shapes(qs[:-2], ks[:-2], vs[:-2]) + (qs[-2], vs[-1])


def test_broadcast_view_inputs(rng):
    """Stride-0 views are read as they are."""
    k = np.broadcast_to(rand(rng, (1, 20, 16)), (6, 20, 16))
    v = np.broadcast_to(rand(rng, (20, 1)), (20, 16))
    q = rand(rng, (6, 9, 16))
    check(q, k, v)

def test_many_leading_dims():
    """40 leading dims (30 under NumPy 1) with a mask, kv_lengths, q_lengths and ALiBi slopes (NumPy's
    broadcast_shapes stops at 32 with a RuntimeError): the same as the squeezed call."""
    rng = np.random.default_rng(7)
    q, k, v = rand(rng, (2, 3, 5, 8)), rand(rng, (2, 3, 7, 8)), rand(rng, (2, 3, 7, 4))
    mask = rng.random((3, 5, 7)) < 0.8
    kvl, qln, sl = np.array([[7], [5]]), np.array([[5], [4]]), np.array([0.1, 0.2, 0.3], F32)
    want = fastattn.attention(q, k, v, mask=mask, kv_lengths=kvl, q_lengths=qln, alibi_slopes=sl)
    # NumPy 2 arrays take up to 64 dims (the bug needed more than 32 leading ones); NumPy 1 up to 32
    extra = (1,) * (38 if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else 28)
    grow = lambda a: a.reshape(extra + a.shape)  # noqa: E731
    got = fastattn.attention(grow(q), grow(k), grow(v), mask=mask, kv_lengths=grow(kvl), q_lengths=qln,
                             alibi_slopes=sl)
    assert got.shape == extra + (2, 3, 5, 4)
    np.testing.assert_array_equal(got.reshape(want.shape), want)
    assert_close(want, ref.attention(q.astype(F64), k.astype(F64), v.astype(F64), mask=mask,
                                     kv_lengths=kvl, q_lengths=qln, alibi_slopes=sl.astype(F64)), F32)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_no_keys(dtype):
    q = np.ones((3, 4, 8), dtype)
    out, lse = fastattn.attention(q, np.ones((3, 0, 8), dtype), np.ones((3, 0, 5), dtype), return_lse=True)
    assert out.shape == (3, 4, 5) and np.all(out == 0) and np.all(np.isneginf(lse))


@pytest.mark.parametrize("shape_q,shape_k,shape_v,expect", [
    ((0, 4, 8), (0, 5, 8), (0, 5, 3), (0, 4, 3)),
    ((2, 0, 8), (2, 5, 8), (2, 5, 3), (2, 0, 3)),
    ((2, 4, 8), (2, 5, 8), (2, 5, 0), (2, 4, 0)),
    ((2, 4, 0), (2, 5, 0), (2, 5, 3), (2, 4, 3)),
])
def test_empty_dims(shape_q, shape_k, shape_v, expect, rng):
    q, k, v = rand(rng, shape_q), rand(rng, shape_k), rand(rng, shape_v)
    out = fastattn.attention(q, k, v)
    assert out.shape == expect
    check(q, k, v)                          # the values (and the lse: finite where d_k or d_v is 0)


# ---------------------------------------------------------------------------
# scale
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [0.0, 1e-3, 0.125, 1.0, 3.0, -0.5])
def test_scale(isa, rng, scale):
    q, k, v = rand(rng, (2, 33, 16)), rand(rng, (2, 70, 16)), rand(rng, (2, 70, 8))
    out, _ = check(q, k, v, scale=scale)
    if scale == 0.0:
        assert_close(out, v.astype(F64).mean(axis=-2, keepdims=True).repeat(33, axis=-2), F32)


def test_default_scale_is_inverse_sqrt_dk(rng):
    q, k, v = rand(rng, (9, 20)), rand(rng, (11, 20)), rand(rng, (11, 3))
    np.testing.assert_array_equal(fastattn.attention(q, k, v), fastattn.attention(q, k, v, scale=1 / np.sqrt(20)))


def test_real_arguments_of_any_real_type(rng):
    """scale and softcap take any real number: Python's int, float and Fraction,
    NumPy's scalars and 0-d arrays; each gives what its float gives."""
    from fractions import Fraction
    q, k, v = rand(rng, (2, 5, 8)), rand(rng, (2, 6, 8)), rand(rng, (2, 6, 4))
    for value in (Fraction(1, 4), 0.25, np.float32(0.25), np.float64(0.25), np.array(0.25), np.array(0.25, F32)):
        assert np.array_equal(fastattn.attention(q, k, v, scale=value), fastattn.attention(q, k, v, scale=0.25))
    for value in (2, np.int64(2), np.uint8(2), np.array(2)):
        assert np.array_equal(fastattn.attention(q, k, v, scale=value), fastattn.attention(q, k, v, scale=2.0))
        assert np.array_equal(fastattn.attention(q, k, v, softcap=value), fastattn.attention(q, k, v, softcap=2.0))


# ---------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------
def test_float16(isa, rng):
    q, k, v = (rand(rng, (2, 50, 16), np.float16) for _ in range(3))
    out, lse = fastattn.attention(q, k, v, return_lse=True)
    assert out.dtype == F32 and lse.dtype == F32   # 16-bit floats compute in and give float32
    want, want_lse = reference64(q, k, v)
    assert_close(out, want, F32)
    assert_close(lse, want_lse, F32, "lse")


@pytest.mark.parametrize("dts,expect", [
    ((F32, F32, F32), F32), ((F32, F64, F32), F64), ((np.float16, F32, np.float16), F32),
    ((np.int64, np.int64, np.int64), F64), ((np.int32, F32, np.int8), F64), ((bool, bool, bool), F64),
    ((np.uint8, np.float16, np.float16), F32), ((np.float16,) * 3, F32), ((np.float16, F64, F64), F64),
])
def test_result_dtype(rng, dts, expect):
    q = (rng.standard_normal((6, 4)) * 3).astype(dts[0])
    k = (rng.standard_normal((9, 4)) * 3).astype(dts[1])
    v = (rng.standard_normal((9, 5)) * 3).astype(dts[2])
    out = fastattn.attention(q, k, v)
    promoted = np.result_type(q, k, v)   # NumPy's, but integers give float64 and 16-bit floats float32
    assert out.dtype == np.dtype(expect) == (F64 if promoted.kind != "f" else max(promoted, np.dtype(F32)))
    want, _ = reference64(q, k, v)
    assert_close(out, want, expect)


def test_integer_inputs(rng):
    q, k, v = rng.integers(-3, 4, (2, 10, 6)), rng.integers(-3, 4, (2, 12, 6)), rng.integers(0, 9, (2, 12, 2))
    check(q, k, v)


def test_lists_accepted():
    """Nested lists are arrays (float64): the values, as the reference and by hand."""
    q, k, v = [[1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]], [[1.0], [2.0]]
    out, lse = check(q, k, v)
    assert out.shape == (1, 1) and out.dtype == F64
    w = np.exp([1 / np.sqrt(2), 0.0])                     # the scores: q.k / sqrt(2)
    assert_close(out, [[(w[0] * 1.0 + w[1] * 2.0) / w.sum()]], F64)
    assert_close(lse, [np.log(w.sum())], F64, "lse")


# ---------------------------------------------------------------------------
# 1-D forms: the key-value lookup
# ---------------------------------------------------------------------------
def test_fruit_lookup():
    """The query "fruit" against apple, banana and chair (values 10, 5, 2)."""
    keys = np.array([[1.0, 1.0], [1.0, 0.8], [0.0, -1.0]])
    values = np.array([10.0, 5.0, 2.0])
    fruit = np.array([1.0, 0.9])
    out = fastattn.attention(fruit, keys, values)
    s = keys @ fruit / np.sqrt(2)
    w = np.exp(s) / np.exp(s).sum()
    assert out.shape == () and out.dtype == F64
    assert abs(float(out) - float(w @ values)) < 1e-12
    assert w[0] > w[1] > w[2]  # apple, then banana, then chair


def test_one_dim_forms(rng):
    k, v2, v1 = rand(rng, (3, 7, 5)), rand(rng, (3, 7, 4)), rand(rng, (7,))
    q1 = rand(rng, (5,))
    q2 = q1[None, :]
    out = fastattn.attention(q1, k, v2)
    assert out.shape == (3, 4)
    assert_close(out, fastattn.attention(q2, k, v2)[:, 0], F32)
    assert_close(out, reference64(q1, k, v2)[0], F32)
    out = fastattn.attention(q2, k, v1)
    assert out.shape == (3, 1)
    assert_close(out, reference64(q2, k, v1)[0], F32)
    out, lse = fastattn.attention(q1, k, v1, return_lse=True)
    assert out.shape == (3,) and lse.shape == (3,)
    want, want_lse = reference64(q1, k, v1)
    assert_close(out, want, F32)
    assert_close(lse, want_lse, F32)
    mask = np.array([True, False, True, True, False, True, True])
    assert_close(fastattn.attention(q1, k, v1, mask=mask), reference64(q1, k, v1, mask=mask)[0], F32)


# ---------------------------------------------------------------------------
# strides, views, alignment
# ---------------------------------------------------------------------------
def test_transposed_views(isa, rng):
    """(B, N, H, d) buffers read as (B, H, N, d) through strides."""
    qb, kb, vb = rand(rng, (2, 40, 3, 16)), rand(rng, (2, 50, 3, 16)), rand(rng, (2, 50, 3, 16))
    q, k, v = (np.swapaxes(a, 1, 2) for a in (qb, kb, vb))
    check(q, k, v)
    check(q, k, v, causal=True)


def test_packed_qkv_views(rng):
    qkv = rand(rng, (2, 30, 3, 4, 8))  # (B, N, 3, H, d)
    q, k, v = (np.moveaxis(qkv[:, :, i], 1, 2) for i in range(3))
    check(q, k, v)


def test_negative_and_odd_strides(isa, rng):
    q, k, v = rand(rng, (3, 40, 16)), rand(rng, (3, 60, 16)), rand(rng, (3, 60, 9))
    check(q[::-1, ::-1], k[:, ::-1], v[::-1])
    check(q[..., ::-1], k[..., ::-1], v[..., ::-1])            # last axis reversed: copied
    check(q[:, ::3], k[:, 1::2], v[:, 1::2])
    check(np.asfortranarray(q), np.asfortranarray(k), v)


def _misaligned(a):
    """A copy of `a` one byte past an aligned address (as an unpickled buffer can be)."""
    buf = np.zeros(a.nbytes + 65, np.uint8)
    start = (-buf.ctypes.data) % 64 + 1
    x = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    x[...] = a
    assert not x.flags.aligned
    return x


@pytest.mark.parametrize("dtype", [F32, F64])
def test_misaligned_arrays(dtype):
    """Arrays not aligned to their dtype (q, k, v, a float mask, lengths, slopes, out) are
    copied, not read in place: the C core's loads assume element alignment (UBSan)."""
    rng = np.random.default_rng(9)
    q, k, v = rand(rng, (2, 3, 20, 8), dtype), rand(rng, (2, 3, 30, 8), dtype), rand(rng, (2, 3, 30, 4), dtype)
    mask = np.where(rng.random((20, 30)) < 0.8, 0.0, -np.inf).astype(dtype)
    kvl, sl = np.array([[30], [17]], np.int64), np.array([0.1, 0.2, 0.3], dtype)
    want = fastattn.attention(q, k, v, causal=True)
    out = _misaligned(np.zeros_like(want))
    got = fastattn.attention(_misaligned(q), _misaligned(k), _misaligned(v), causal=True, out=out)
    assert got is out
    np.testing.assert_array_equal(got, want)
    kw = dict(mask=mask, kv_lengths=kvl, alibi_slopes=sl)
    want = fastattn.attention(q, k, v, **kw)
    got = fastattn.attention(_misaligned(q), _misaligned(k), _misaligned(v), mask=_misaligned(mask),
                             kv_lengths=_misaligned(kvl), alibi_slopes=_misaligned(sl))
    np.testing.assert_array_equal(got, want)
    assert_close(got, reference64(q, k, v, **kw)[0], dtype)
    x = rand(rng, (5, 40), dtype)
    np.testing.assert_array_equal(fastattn.softmax(_misaligned(x)), fastattn.softmax(x))
    qv = rand(rng, (25, 3, 8), dtype)
    cu = np.array([0, 10, 25])
    got = fastattn.attention_varlen(_misaligned(qv), qv, qv, cu, cu, alibi_slopes=_misaligned(sl))
    np.testing.assert_array_equal(got, fastattn.attention_varlen(qv, qv, qv, cu, cu, alibi_slopes=sl))

def test_inputs_unmodified(rng):
    q, k, v = rand(rng, (2, 30, 8)), rand(rng, (2, 40, 8)), rand(rng, (2, 40, 8))
    mask = rng.random((30, 40)) < 0.5
    fmask = rng.standard_normal((30, 40)).astype(F32)
    copies = [a.copy() for a in (q, k, v, mask, fmask)]
    fastattn.attention(q, k, v, mask=mask, causal=True, return_lse=True)
    fastattn.attention(q, k, v, mask=fmask)
    fastattn.attention(q.astype(np.float16), k, v, mask=fmask)
    for a, c in zip((q, k, v, mask, fmask), copies):
        np.testing.assert_array_equal(a, c)


# ---------------------------------------------------------------------------
# layout="blhd": q, k, v and the result (..., n, H, d), as flash-attn and JAX
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, F64, np.float16])
@pytest.mark.parametrize("nq,threads", [(1, 2), (5, 1), (70, 2), (300, 2)])
def test_layout_blhd(isa, rng, dtype, nq, threads):
    """layout="blhd" against the reference on the head-major arrays: one query
    row and a few (the row kernel, split keys), tiles with tails; masks, lse,
    lengths and slopes keep their head-major leading dims; GQA, out= (its
    layout, contiguous and strided), views of a packed qkv buffer, 3-D inputs
    broadcast against 4-D ones, and attention_weights.  The result is the
    head-major call's, bit for bit, in the other layout."""
    B, H, Hkv, nk, d = 2, 4, 2, 150, 24
    qh, kh, vh = rand(rng, (B, H, nq, d), dtype), rand(rng, (B, H, nk, d), dtype), rand(rng, (B, H, nk, 12), dtype)
    q, k, v = heads_last(qh), heads_last(kh), heads_last(vh)
    kvl = rng.integers(1, nk + 1, (B, 1))
    for kw in (dict(), dict(causal=True), dict(mask=rng.random((B, 1, nq, nk)) < 0.8, window=(40, 3)),
               dict(kv_lengths=kvl, alibi_slopes=np.linspace(0.01, 0.1, H), softcap=5.0),
               dict(q_lengths=np.minimum(kvl, nq), kv_lengths=kvl, causal=True)):
        with team_check(threads):
            out, lse = fastattn.attention(q, k, v, layout="blhd", return_lse=True, num_threads=threads, **kw)
        want, want_lse = reference64(qh, kh, vh, **kw)
        assert out.shape == (B, nq, H, 12) and out.dtype == compute_dtype(dtype) and out.flags.c_contiguous
        assert_close(out, heads_last(want), dtype)
        assert lse.shape == (B, H, nq)                                       # head-major, as flash-attn's
        assert_close(lse, want_lse, dtype, "lse")
        assert np.array_equal(out, heads_last(fastattn.attention(qh, kh, vh, num_threads=threads, **kw)))

    kg, vg = kh[:, :Hkv], vh[:, :Hkv]                                        # GQA: 4 query heads on 2
    with team_check(threads):
        out = fastattn.attention(q, heads_last(kg), heads_last(vg), layout="blhd", enable_gqa=True, causal=True,
                                 num_threads=threads)
    assert_close(out, heads_last(reference64(qh, kg, vg, enable_gqa=True, causal=True)[0]), dtype)

    want = heads_last(reference64(qh, kh, vh, causal=True)[0])
    for dst in (np.empty((B, nq, H, 12), dtype), np.full((B, nq, H, 24), np.nan, dtype)[..., ::2]):
        with team_check(threads):
            assert fastattn.attention(q, k, v, layout="blhd", causal=True, out=dst, num_threads=threads) is dst
        assert_close(dst, want, dtype)

    qkv = rand(rng, (B, nq, 3, H, d), dtype)                                 # a packed projection, split by views
    qs, ks, vs = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert_close(fastattn.attention(qs, ks, vs, layout="blhd"),
                 heads_last(reference64(*(np.swapaxes(a, 1, 2) for a in (qs, ks, vs)))[0]), dtype)
    out = fastattn.attention(q[0], k, v, layout="blhd")                      # (nq, H, d) against (B, nk, H, d)
    assert out.shape == (B, nq, H, 12)
    assert_close(out, heads_last(reference64(qh[0], kh, vh)[0]), dtype)

    w = fastattn.attention_weights(q, k, layout="blhd", causal=True)
    assert w.shape == (B, H, nq, nk)
    assert_close(w, ref.attention_weights(qh.astype(F64), kh.astype(F64), causal=True), dtype, "weights")


def test_reference_layout_blhd(rng):
    """The reference's layout="blhd": its attention, weights and merge on (..., n, H, d)
    arrays are the head-major ones on the swapped arrays."""
    q, k, v = rand(rng, (2, 7, 3, 4), F64), rand(rng, (2, 9, 3, 4), F64), rand(rng, (2, 9, 3, 2), F64)
    t = lambda a: np.swapaxes(a, 1, 2)  # noqa: E731
    out, lse = ref.attention(q, k, v, layout="blhd", causal=True, return_lse=True)
    want, want_lse = ref.attention(t(q), t(k), t(v), causal=True, return_lse=True)
    np.testing.assert_array_equal(out, t(want))
    np.testing.assert_array_equal(lse, want_lse)
    np.testing.assert_array_equal(ref.attention_weights(q, k, layout="BLHD"), ref.attention_weights(t(q), t(k)))
    with pytest.raises(ValueError, match="layout must be"):
        ref.attention(q, k, v, layout="bshd")
