"""fastattn.softmax against the reference, the SIMD exp against NumPy's exp,
and the reference itself against first principles."""

import numpy as np
import pytest
from conftest import assert_close

import fastattn
from fastattn import _core
from fastattn import reference as ref

F32, F64 = np.float32, np.float64


# ---------------------------------------------------------------------------
# softmax
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("shape,axis", [((7,), 0), ((3, 1), -1), ((4, 1023), -1), ((2, 3000), 1),
                                        ((2, 2049), 0), ((5, 6, 7), 1), ((3, 4, 5), 0), ((2, 1025, 3), -2)])
def test_softmax_matches_reference(isa, rng, dtype, shape, axis):
    x = (rng.standard_normal(shape) * 5).astype(dtype)
    got = fastattn.softmax(x, axis=axis)
    assert got.dtype == dtype and got.shape == x.shape
    assert_close(got, ref.softmax(x.astype(F64), axis=axis), dtype)
    assert_close(got.sum(axis=axis), np.ones(np.delete(shape, axis % len(shape))), dtype)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_softmax_extreme(isa, dtype):
    x = np.array([[1e30, 0.0, -1e30, 1e30],
                  [-np.inf, 2.0, -np.inf, 1.0],
                  [-np.inf] * 4,
                  [-1e30, -1e30, -1e30, -1e30],
                  [np.nan, 1.0, 2.0, 3.0],
                  [np.inf, 1.0, 2.0, 3.0]], dtype)
    got = fastattn.softmax(x)
    want = ref.softmax(x.astype(F64))
    assert_close(got, want, dtype)
    np.testing.assert_array_equal(got[0], [0.5, 0, 0, 0.5])
    np.testing.assert_array_equal(got[2], 0)             # all -inf: zeros, not NaN
    assert np.isnan(got[4]).all() and np.isnan(got[5]).all()


def test_softmax_long_rows_with_masked_chunks(isa, rng):
    """Rows longer than a chunk whose chunks are entirely -inf, or whose max is
    far below another chunk's (the merge across chunks)."""
    x = rng.standard_normal((3, 5000))
    x[0, :2048] = -np.inf
    x[1, 1024:3072] = -np.inf
    x[2, :1000] -= 1e4
    for dt in (F32, F64):
        assert_close(fastattn.softmax(x.astype(dt)), ref.softmax(x.astype(dt).astype(F64)), dt)


def test_softmax_dtypes_and_out(rng):
    x = rng.integers(-5, 5, (3, 9))
    assert fastattn.softmax(x).dtype == F64
    assert_close(fastattn.softmax(x), ref.softmax(x.astype(F64)), F64)
    h = rng.standard_normal((3, 9)).astype(np.float16)
    assert fastattn.softmax(h).dtype == np.float16
    assert_close(fastattn.softmax(h), ref.softmax(h.astype(F64)), np.float16)
    x = rng.standard_normal((4, 6, 5)).astype(F32)
    out = np.empty((6, 5, 4), F32).transpose(2, 0, 1)
    assert fastattn.softmax(x, axis=1, out=out) is out
    assert_close(out, ref.softmax(x.astype(F64), axis=1), F32)
    y = x.copy()
    fastattn.softmax(y, out=y)                            # in place
    assert_close(y, ref.softmax(x.astype(F64)), F32)
    z = x.copy()
    fastattn.softmax(z[:, :, :4], axis=1, out=z[:, :, 1:])  # overlapping, shifted
    assert_close(z[:, :, 1:], ref.softmax(x[:, :, :4].astype(F64), axis=1), F32)
    xc = x.copy()
    fastattn.softmax(x, axis=0)
    np.testing.assert_array_equal(x, xc)


def test_softmax_errors(rng):
    with pytest.raises(TypeError, match="complex"):
        fastattn.softmax(np.ones(3, complex))
    with pytest.raises(np.exceptions.AxisError):
        fastattn.softmax(np.ones((2, 3)), axis=2)
    with pytest.raises(ValueError, match="scalar"):
        fastattn.softmax(np.float64(1.0))
    with pytest.raises(ValueError, match="out has shape"):
        fastattn.softmax(np.ones((2, 3)), out=np.empty((3, 2)))
    with pytest.raises(TypeError, match="out has dtype int64, which the result's dtype float64"):
        fastattn.softmax(np.ones((2, 3)), out=np.empty((2, 3), np.int64))


@pytest.mark.parametrize("axis", [None, (), (0, 2), (2, 0), (1, 0), (-1, 1), (0, 1, 2), (1,)])
def test_softmax_several_axes(rng, axis):
    """A tuple of axes (None: all, as scipy.special.softmax) softmaxes their entries
    together, like the reference (np.max and np.sum over the axes)."""
    x = (rng.standard_normal((3, 4, 5)) * 4).astype(F32)
    x[1, :, 2] = -np.inf                                  # a slice that is -inf only in part
    got = fastattn.softmax(x, axis=axis)
    want = ref.softmax(x.astype(F64), axis=axis)
    assert got.dtype == F32 and got.shape == x.shape
    assert_close(got, want, F32)
    seen = np.isfinite(x).any(axis=axis)                 # slices with a finite entry sum to 1, the rest 0
    assert_close(got.sum(axis=axis), seen.astype(F64), F32)
    out = np.full((5, 4, 3), np.nan, F32).transpose(2, 1, 0)
    assert fastattn.softmax(x, axis=axis, out=out) is out
    assert_close(out, want, F32)
    xt = x.transpose(2, 0, 1)[::-1]                                     # strided and reversed: (5, 3, 4)
    assert_close(fastattn.softmax(xt, axis=axis), ref.softmax(xt.astype(F64), axis=axis), F32)


def test_softmax_several_axes_edges():
    np.testing.assert_array_equal(fastattn.softmax(np.float64(3.0), axis=None), 1.0)
    np.testing.assert_array_equal(fastattn.softmax(np.full((2, 3), -np.inf), axis=None), 0.0)
    assert fastattn.softmax(np.ones((2, 0, 3), F32), axis=(1, 2)).shape == (2, 0, 3)
    h = np.arange(6, dtype=np.float16).reshape(2, 3)
    assert fastattn.softmax(h, axis=None).dtype == np.float16
    e = np.exp(np.arange(6.0))
    assert_close(fastattn.softmax(np.arange(6).reshape(2, 3), axis=(0, 1)), (e / e.sum()).reshape(2, 3), F64)
    with pytest.raises(ValueError, match="duplicate value in axis"):
        fastattn.softmax(np.ones((2, 3)), axis=(1, -1))
    with pytest.raises(np.exceptions.AxisError):
        fastattn.softmax(np.ones((2, 3)), axis=(0, 2))
    with pytest.raises(TypeError, match="axis must be an int"):
        fastattn.softmax(np.ones((2, 3)), axis=(0, 1.0))
    with pytest.raises(ValueError, match="out has shape"):
        fastattn.softmax(np.ones((2, 3)), axis=None, out=np.empty((3, 2)))


def test_softmax_empty():
    assert fastattn.softmax(np.ones((0, 4))).shape == (0, 4)
    assert fastattn.softmax(np.ones((4, 0))).shape == (4, 0)


# ---------------------------------------------------------------------------
# the SIMD exp (every argument attention feeds it is <= 0)
# ---------------------------------------------------------------------------
def _ulp_error(got, want, dtype):
    """Error in units of the last place of the exact result (subnormals: of the
    smallest normal spacing)."""
    want = want.astype(np.longdouble)
    spacing = np.spacing(np.abs(want.astype(dtype))).astype(np.longdouble)
    spacing = np.maximum(spacing, np.longdouble(np.finfo(dtype).smallest_subnormal))
    return (np.abs(got.astype(np.longdouble) - want) / spacing).astype(np.float64)


@pytest.mark.parametrize("dtype,lo,max_ulp", [(F32, -103.0, 1.5), (F64, -744.0, 1.0)])
def test_vexp_accuracy(isa, rng, dtype, lo, max_ulp):
    x = np.concatenate([np.linspace(lo, 0, 200_001), -rng.exponential(5.0, 100_000),
                        -rng.random(100_000) * 1e-3, [0.0, -0.0]]).astype(dtype)
    got = _core.vexp(x)
    # the exact value, to well below an ulp: long double (80-bit on x86-64)
    want = np.exp(x.astype(np.longdouble))
    if dtype is F64 and np.finfo(np.longdouble).eps >= np.finfo(F64).eps:
        max_ulp += 0.5  # no extended long double here: the reference itself is rounded
    err = _ulp_error(got, want, dtype)
    assert err.max() <= max_ulp, f"max {err.max():.2f} ulp at x={x[err.argmax()]}"


@pytest.mark.parametrize("dtype", [F32, F64])
def test_vexp_special_values(isa, dtype):
    x = np.array([-np.inf, np.nan, 0.0, -0.0, -1e30, -2000.0, 1.0, 50.0, np.inf, 1e30], dtype)
    got = _core.vexp(x)
    with np.errstate(over="ignore"):
        want = np.exp(x.astype(np.float64)).astype(dtype)
    np.testing.assert_array_equal(got[[0, 2, 3, 4, 5, 8, 9]], want[[0, 2, 3, 4, 5, 8, 9]])
    assert np.isnan(got[1])
    np.testing.assert_allclose(got[[6, 7]], want[[6, 7]], rtol=4 * np.finfo(dtype).eps)


def test_vexp_underflow_to_subnormals(isa):
    for dt, xs in ((F32, np.linspace(-103.5, -87, 3001)), (F64, np.linspace(-745.0, -700, 3001))):
        x = xs.astype(dt)
        got = _core.vexp(x).astype(np.float64)
        want = np.exp(x.astype(np.longdouble)).astype(np.float64)
        tiny = np.finfo(dt).smallest_subnormal
        assert np.all(np.abs(got - want) <= np.maximum(2 * np.spacing(want.astype(dt)).astype(np.float64), tiny))


# ---------------------------------------------------------------------------
# the reference against first principles
# ---------------------------------------------------------------------------
def test_reference_softmax_basics():
    x = np.array([1.0, 2.0, 3.0])
    e = np.exp(x)
    np.testing.assert_allclose(ref.softmax(x), e / e.sum(), rtol=1e-15)
    np.testing.assert_array_equal(ref.softmax(np.array([-np.inf, -np.inf])), [0, 0])


def test_reference_attention_by_loops(rng):
    q, k, v = rng.standard_normal((4, 3)), rng.standard_normal((6, 3)), rng.standard_normal((6, 2))
    mask = rng.random((4, 6)) < 0.7
    mask[2] = False
    out, lse = ref.attention(q, k, v, mask=mask, causal=True, return_lse=True)
    for i in range(4):
        s = [q[i] @ k[j] / np.sqrt(3) for j in range(6) if mask[i, j] and j <= i + 2]
        idx = [j for j in range(6) if mask[i, j] and j <= i + 2]
        if not s:
            assert np.all(out[i] == 0) and lse[i] == -np.inf
            continue
        w = np.exp(s) / np.sum(np.exp(s))
        np.testing.assert_allclose(out[i], w @ v[idx], rtol=1e-13)
        np.testing.assert_allclose(lse[i], np.log(np.sum(np.exp(s))), rtol=1e-13)


@pytest.mark.parametrize("dtype,lo,max_ulp", [(F32, -103.0, 1.5), (F64, -744.0, 1.0)])
def test_vexp_neg_accuracy(isa, rng, dtype, lo, max_ulp):
    """The attention kernels' exp (arguments <= 0, and up to 24 in the fused exp;
    tested to 30): as accurate as vexp where the result is a normal number; below
    that it may flush to exactly 0."""
    x = np.concatenate([np.linspace(lo, 30, 200_001), -rng.exponential(5.0, 100_000),
                        rng.random(100_000) * 30, -rng.random(100_000) * 1e-3, [0.0, -0.0]]).astype(dtype)
    # far below the row max, a finite score (a float mask of finfo.min) gives 0 as -inf does
    special = np.array([-np.finfo(dtype).max, -1e30, -1e5, -2000.0, -np.inf, np.nan], dtype)
    got_special = _core.vexp(special, neg=True)
    np.testing.assert_array_equal(got_special[:-1], 0)
    assert np.isnan(got_special[-1])
    got = _core.vexp(x, neg=True)
    want = np.exp(x.astype(np.longdouble))
    normal = want >= np.finfo(dtype).tiny
    err = _ulp_error(got[normal], want[normal], dtype)
    if dtype is F64 and isa == "avx512":
        max_ulp = 0.6  # the table form with its rounding corrected (vmath.h)
    if dtype is F64 and np.finfo(np.longdouble).eps >= np.finfo(F64).eps:
        max_ulp += 0.5
    assert err.max() <= max_ulp, f"max {err.max():.2f} ulp at x={x[normal][err.argmax()]}"
    sub = ~normal
    assert np.all((got[sub] == 0) | (np.abs(got[sub] - want[sub].astype(np.float64)) <= np.finfo(dtype).tiny))
