"""The plain call (contiguous ndarrays of one float dtype, equal leading dims, no
options but causal, scale, a mask the C core reads as it is, out= and
return_lse) skips the general preparation (fastattn/_attention.py: _plain,
_plain_out, _plain_mask): the same checks, the same result, bit for bit."""

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_close, rand, reference64
from helpers import F32, F64, check, team_check

import fastattn
from fastattn import _core


def _strided(a):
    """The same values in a non-contiguous view (rows every other row of a
    buffer): the general path reads it in place, with the same C call."""
    buf = np.zeros(a.shape[:-2] + (2 * a.shape[-2], a.shape[-1]), a.dtype)
    buf[..., ::2, :] = a
    return buf[..., ::2, :]


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("lead", [(), (3,), (2, 3), (1, 2, 1, 2)])
@pytest.mark.parametrize("nq,nk", [(1, 64), (7, 1100), (70, 33)])
@pytest.mark.parametrize("threads", [None, 1, 2])
def test_plain_call_matches_general_path(isa, rng, dtype, lead, nq, nk, threads):
    from fastattn._attention import _plain
    q, k, v = rand(rng, lead + (nq, 24), dtype), rand(rng, lead + (nk, 24), dtype), rand(rng, lead + (nk, 40), dtype)
    for causal, scale in [(False, None), (True, 0.3)]:
        assert _plain(q, k, v)
        with team_check(threads):
            got = fastattn.attention(q, k, v, causal=causal, scale=scale, num_threads=threads)
        assert got.dtype == dtype and got.shape == lead + (nq, 40)
        gq, gk, gv = _strided(q), _strided(k), _strided(v)
        assert not _plain(gq, gk, gv)
        with team_check(threads):
            general = fastattn.attention(gq, gk, gv, causal=causal, scale=scale, num_threads=threads)
        np.testing.assert_array_equal(got, general)
        want, want_lse = reference64(q, k, v, causal=causal, scale=scale)
        assert_close(got, want, dtype)
        # out= and return_lse=True take the plain path too
        out = np.full(got.shape, np.nan, dtype)
        res, lse = fastattn.attention(q, k, v, causal=causal, scale=scale, num_threads=threads, out=out,
                                      return_lse=True)
        g_out = _strided(np.full(got.shape, np.nan, dtype))
        g_res, g_lse = fastattn.attention(gq, gk, gv, causal=causal, scale=scale, num_threads=threads,
                                          out=g_out, return_lse=True)
        assert res is out and g_res is g_out and lse.dtype == dtype and lse.shape == lead + (nq,)
        np.testing.assert_array_equal(out, got)
        np.testing.assert_array_equal(out, g_out)
        np.testing.assert_array_equal(lse, g_lse)
        assert_close(lse, want_lse, dtype)
        res2, lse2 = fastattn.attention(q, k, v, causal=causal, scale=scale, num_threads=threads,
                                        return_lse=True)
        np.testing.assert_array_equal(res2, got)
        np.testing.assert_array_equal(lse2, lse)


def test_plain_call_recognised(rng):
    """_plain accepts exactly the calls that need no conversion and no broadcasting."""
    from fastattn._attention import _plain

    class Sub(np.ndarray):
        pass

    q, k, v = rand(rng, (2, 5, 8)), rand(rng, (2, 6, 8)), rand(rng, (2, 6, 4))
    assert _plain(q, k, v) and _plain(q[0], k[0], v[0]) and _plain(q.astype(F64), k.astype(F64), v.astype(F64))
    not_plain = [
        (q.tolist(), k, v),                                   # a list
        (q.view(Sub), k, v),                                  # an ndarray subclass
        (q.astype(np.float16), k, v),                         # converted to float32
        (q, k.astype(F64), v),                                # mixed dtypes
        (q.astype(">f4"), k, v),                              # byte-swapped
        (q, k, np.asfortranarray(v)),                         # not C-contiguous
        (q[:1], k, v),                                        # broadcast leading dims
        (q[0, 0], k, v[:, :, 0]),                             # the 1-D forms
        (q, np.ascontiguousarray(k[..., :7]), v),             # d_k differs
        (q, k, np.ascontiguousarray(v[:, :5])),               # n_k differs
        (q, k[None], v[None]),                                # different ranks
    ]
    for args in not_plain:
        assert not _plain(*args)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_attention_plain_recognised(isa, rng, monkeypatch, dtype):
    """_core.attention_plain, the C-checked form of the commonest calls (no option
    but causal, scale, num_threads and layout), computes exactly the calls _plain
    and _plain_blhd accept with those options, bit for bit as the general path,
    and returns None for every other (the Python layer then checks and raises)."""
    q, k, v = rand(rng, (2, 5, 8), dtype), rand(rng, (2, 6, 8), dtype), rand(rng, (2, 6, 4), dtype)
    taken = []
    real = _core.attention_plain

    def spy(*args):
        got = real(*args)
        taken.append(got is not None)
        return got

    monkeypatch.setattr(_core, "attention_plain", spy)
    gq, gk, gv = _strided(q), _strided(k), _strided(v)
    for args in [(q, k, v), (q[0], k[0], v[0]), (q[None, None], k[None, None], v[None, None])]:
        for kw in [{}, dict(causal=True), dict(scale=0.3), dict(scale=-2.0, causal=False), dict(num_threads=1),
                   dict(num_threads=2, layout="bhld"), dict(num_threads=10**30)]:
            taken.clear()
            got = fastattn.attention(*args, **kw)
            assert taken == [True] and got.dtype == dtype and got.shape == args[0].shape[:-1] + (4,)
            general = fastattn.attention(*(_strided(a) for a in args), **kw)
            np.testing.assert_array_equal(got, general)
            assert_close(got, reference64(*args, causal=kw.get("causal", False), scale=kw.get("scale"))[0], dtype)
    # layout "blhd": (..., n, H, d), read through the (..., H, n, d) views, the result written so
    q4, k4, v4 = rand(rng, (2, 5, 3, 8), dtype), rand(rng, (2, 6, 3, 8), dtype), rand(rng, (2, 6, 3, 4), dtype)
    for args in [(q4, k4, v4), (q4[0], k4[0], v4[0]), (np.ascontiguousarray(q4[:, :1]), k4, v4)]:
        for kw in [{}, dict(causal=True, scale=0.7), dict(num_threads=2)]:
            taken.clear()
            got = fastattn.attention(*args, layout="blhd", **kw)
            assert taken == [True] and got.dtype == dtype and got.shape == args[0].shape[:-1] + (4,)
            assert got.flags.c_contiguous
            general = fastattn.attention(*(_strided(a) for a in args), layout="blhd", **kw)
            np.testing.assert_array_equal(got, general)
            hf = [np.swapaxes(a, -3, -2) for a in args]
            want = reference64(*hf, causal=kw.get("causal", False), scale=kw.get("scale"))[0]
            assert_close(np.swapaxes(got, -3, -2), want, dtype)
    for args in [(q4, k4[:, :, :2], v4[:, :, :2]), (q4, k4, v4[:, :5]), (q4, np.ascontiguousarray(k4[..., :7]), v4),
                 (q4[0, 0], k4[0, 0], v4[0, 0]), (q4, k4[:1], v4[:1]), (q4, k4, np.ascontiguousarray(v4[:, :, :2]))]:
        assert real(*args, False, None, None, "blhd") is None
    assert real(q4, k4, v4, False, None, None, "BLHD") is None
    # d_k = 0: the default scale of reference.default_scale (1), every key alike
    z = np.zeros((2, 5, 0), dtype)
    taken.clear()
    got = fastattn.attention(z, np.zeros((2, 6, 0), dtype), v)
    assert taken == [True]
    np.testing.assert_array_equal(got, fastattn.attention(_strided(z), _strided(np.zeros((2, 6, 0), dtype)), v))
    assert_close(got, np.broadcast_to(v.astype(np.float64).mean(-2, keepdims=True), got.shape), dtype)
    empty = fastattn.attention(q[:, :0], k, v)
    assert empty.shape == (2, 0, 4) and empty.dtype == dtype
    np.testing.assert_array_equal(fastattn.attention(q, k[:, :0], v[:, :0]), np.zeros((2, 5, 4), dtype))

    class Sub(np.ndarray):
        pass

    other = dtype is F32 and F64 or F32
    none_args = [
        (gq, gk, gv), (q.view(Sub), k, v), (q, k.astype(other), v), (q, k, v.astype(other)),
        (q.astype(q.dtype.newbyteorder()), k, v), (q, k, np.asfortranarray(v)), (q.tolist(), k, v),
        (q[:1], k, v), (q, k[:1], v), (q, k, np.ascontiguousarray(v[:, :5])), (q, np.ascontiguousarray(k[..., :7]), v),
        (q, k[None], v[None]), (q[0, 0], k, v[:, :, 0]), (q.astype(np.float16), k.astype(np.float16), v),
        (q.astype(np.float16),) * 3, (q, k.astype(np.float16), v.astype(np.float16)),
        (q.astype(np.int32), k, v)]
    for args in none_args:
        assert real(*args, False, None, None, "bhld") is None
    for causal, scale, threads, layout in [
            (np.bool_(True), None, None, "bhld"), (1, None, None, "bhld"), ("upper_left", None, None, "bhld"),
            (None, None, None, "bhld"), (False, np.float32(0.5), None, "bhld"), (False, 1, None, "bhld"),
            (False, float("nan"), None, "bhld"), (False, float("inf"), None, "bhld"),
            (False, None, 0, "bhld"), (False, None, -1, "bhld"), (False, None, True, "bhld"),
            (False, None, np.int64(2), "bhld"), (False, None, 2.0, "bhld"),
            (False, None, None, "bhdl"), (False, None, None, None), (False, None, None, b"bhld")]:
        assert real(q, k, v, causal, scale, threads, layout) is None
    # the Python layer's errors, from the general path
    with pytest.raises(ValueError, match="num_threads"):
        fastattn.attention(q, k, v, num_threads=0)
    with pytest.raises(ValueError, match="scale must be finite"):
        fastattn.attention(q, k, v, scale=float("nan"))
    with pytest.raises(ValueError, match="layout"):
        fastattn.attention(q, k, v, layout="bhdl")
    # any other option: the Python layer
    for kw in [dict(mask=np.ones((5, 6), bool)), dict(out=np.empty((2, 5, 4), dtype)), dict(return_lse=True),
               dict(enable_gqa=True), dict(window=(2, 0)), dict(softcap=3.0), dict(kv_lengths=[6, 6]),
               dict(q_lengths=[5, 5]), dict(alibi_slopes=[0.1, 0.2])]:
        taken.clear()
        fastattn.attention(q, k, v, **kw)
        assert taken == []


def test_plain_out_recognised(rng):
    """An out= that the plain call writes into as it is; any other goes the
    general way, with the same result (and the same errors)."""
    from fastattn._attention import _plain, _plain_out

    class Sub(np.ndarray):
        pass

    q, k, v = rand(rng, (2, 5, 8)), rand(rng, (2, 6, 8)), rand(rng, (2, 6, 4))
    want = fastattn.attention(q, k, v)
    assert _plain_out(np.empty((2, 5, 4), F32), q, k, v)
    ro = np.empty((2, 5, 4), F32)
    ro.flags.writeable = False
    not_plain = [
        np.empty((2, 5, 4), F32).view(Sub),                   # a subclass
        np.empty((2, 5, 4), F64),                             # another dtype (cast to)
        np.empty((2, 5, 4), ">f4"),                           # byte-swapped (cast to)
        np.empty((2, 4, 5), F32).transpose(0, 2, 1),          # not C-contiguous
        np.empty((2, 5, 8), F32)[..., :4],                    # not contiguous
        np.empty((5, 4), F32),                                # another shape
        ro,                                                   # read-only
        [[0.0] * 4] * 5,                                      # not an ndarray
        np.empty((2, 5, 4), np.int32),                        # a dtype the result does not cast to
    ]
    for out in not_plain:
        assert not _plain_out(out, q, k, v)
    for bad, exc in [(not_plain[8], TypeError), (not_plain[5], ValueError), (ro, ValueError),
                     (not_plain[7], TypeError)]:
        with pytest.raises(exc):
            fastattn.attention(q, k, v, out=bad)
    for out in not_plain[1:5]:
        assert fastattn.attention(q, k, v, out=out) is out
        np.testing.assert_array_equal(out, want.astype(out.dtype))
    # an out that overlaps an input (q, k or v): the general path computes into
    # a temporary, so the input is read whole before out is written
    for i in range(3):
        args = [q, k, v]
        x = args[i]
        buf = np.zeros(x.size + 40, F32)
        buf[:x.size] = x.ravel()
        args[i] = buf[:x.size].reshape(x.shape)
        out = buf[x.size - 20:x.size + 20].reshape(2, 5, 4)   # x's last 20 values, then 20 more
        assert _plain(*args) and not _plain_out(out, *args)
        assert fastattn.attention(*args, out=out) is out
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("threads", [1, 2])
def test_plain_masked_call_matches_general_path(isa, rng, dtype, threads):
    """A plain call with a bool mask, or a float mask of q's dtype, that the C
    core reads as it is skips the general preparation too: the same result as
    the general path (the same inputs as strided views), for every mask shape
    that broadcasts to the scores without growing the leading dims, and as the
    reference."""
    from fastattn import _attention
    b, h, nq, nk = 2, 3, 9, 70
    q, k, v = rand(rng, (b, h, nq, 16), dtype), rand(rng, (b, h, nk, 16), dtype), rand(rng, (b, h, nk, 8), dtype)
    gq, gk, gv = _strided(q), _strided(k), _strided(v)
    keep = rng.random((b, h, nq, nk)) < 0.7
    keep[..., 0, :] = False                                    # a row that sees nothing
    bias = np.where(keep, rng.standard_normal(keep.shape), -np.inf).astype(dtype)
    masks = []
    for m in (keep, bias):
        masks += [m, m[0, 0], m[:, :1], m[:1, :, :1], m[:1, :1, :, :1], m[0, :, :1, :],
                  m[0, 0, ::-1], np.swapaxes(m, -1, -2).copy().swapaxes(-1, -2)[0],
                  np.broadcast_to(m[0, 0, :1], (nq, nk))]
    masks += [np.triu(np.full((nq, nk), -np.inf, dtype), 1)[None]]   # 0/-inf, too little reused to convert
    for mask in masks:
        kind = _core.MASK_BOOL if mask.dtype == bool else _core.MASK_ADD
        assert _attention._plain_mask(mask, q, k) == kind, mask.shape
        for causal in (False, True):
            got, lse = check(q, k, v, dtype, mask=mask, causal=causal, num_threads=threads)
            with team_check(threads):
                g_got, g_lse = fastattn.attention(gq, gk, gv, mask=mask, causal=causal, num_threads=threads,
                                                  return_lse=True)
            np.testing.assert_array_equal(got, g_got)
            np.testing.assert_array_equal(lse, g_lse)
            out = np.full(got.shape, np.nan, dtype)
            assert fastattn.attention(q, k, v, mask=mask, causal=causal, num_threads=threads, out=out) is out
            np.testing.assert_array_equal(out, got)


def test_plain_mask_recognised(rng):
    """_plain_mask takes exactly the masks that the C core reads as they are in a
    plain call; any other goes the general way, with its conversions, its
    errors and the same result."""
    from fastattn import _attention
    from fastattn._prepare import _prepare

    class Sub(np.ndarray):
        pass

    q, k, v = rand(rng, (2, 5, 8)), rand(rng, (2, 6, 8)), rand(rng, (2, 6, 4))
    keep = rng.random((2, 5, 6)) < 0.8
    bias = rand(rng, (2, 5, 6))
    assert _attention._plain_mask(keep, q, k) == _core.MASK_BOOL
    assert _attention._plain_mask(bias, q, k) == _core.MASK_ADD
    packed = np.zeros((5, 6), [("m", F32), ("flag", np.uint8)])
    packed["m"] = bias[0]
    odd = packed["m"]                              # strides (30, 5) bytes: not whole float32s
    odd_bool = np.zeros((5, 6), [("m", bool), ("x", F32)])["m"]   # (any strides are whole bools)
    general = [
        (keep.tolist(), None),                       # a list
        (keep.view(Sub), None),                      # an ndarray subclass
        (keep.astype(np.uint8), TypeError),          # an integer mask
        (bias.astype(F64), None),                    # another float dtype: converted
        (bias.astype(np.float16), None),
        (bias.astype(">f4"), None),                  # byte-swapped
        (keep[0, 0], None),                          # 1-D (n_k,)
        (keep[None], None),                          # more dims than q: adds a leading dim
        (np.ones((3, 5, 6), bool), ValueError),      # a leading dim that does not broadcast
        (np.ones((2, 4, 6), bool), ValueError),      # n_q differs
        (np.ones((2, 5, 7), bool), ValueError),      # n_k differs
        (np.ones((2, 5, 6), complex), TypeError),
        (odd, None),                                 # copied by the general path
    ]
    for mask, exc in general:
        assert _attention._plain_mask(mask, q, k) == _core.MASK_NONE
        if exc is not None:
            with pytest.raises(exc):
                fastattn.attention(q, k, v, mask=mask)
        else:
            m = np.asarray(mask)
            want = fastattn.attention(_strided(q), _strided(k), _strided(v), mask=m)
            np.testing.assert_array_equal(fastattn.attention(q, k, v, mask=mask), want)
    assert _attention._plain_mask(odd_bool, q, k) == _core.MASK_BOOL
    np.testing.assert_array_equal(fastattn.attention(q, k, v, mask=odd_bool),
                                  fastattn.attention(q, k, v, mask=np.zeros((5, 6), bool)))
    # a float mask that the conversion to bool may pay for (0 and -inf, shared by the
    # heads of a call with enough scores) goes the general way, which converts it
    qq, kk, vv = rand(rng, (8, 64, 8)), rand(rng, (8, 64, 8)), rand(rng, (8, 64, 4))
    tri = np.triu(np.full((64, 64), -np.inf, F32), 1)
    assert _attention._plain_mask(tri, qq, kk) == _core.MASK_NONE
    assert _prepare(qq, kk, vv, tri, False, None, False, None, None, None, None, None).mask_kind \
        == _core.MASK_BOOL
    np.testing.assert_array_equal(fastattn.attention(qq, kk, vv, mask=tri), fastattn.attention(qq, kk, vv, causal=True))


HALF = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]


@pytest.mark.parametrize("half", HALF, ids=["float16", "bfloat16"])
@pytest.mark.parametrize("nq,nk", [(1, 300), (9, 70)])
def test_plain_call_half_kv(isa, rng, half, nq, nk):
    """float32 q with 16-bit K and V of one dtype is a plain call too (the C core
    reads them as stored, as the general path hands them over): the general
    path's result bit for bit, and the reference's on the rounded values."""
    from fastattn._attention import _plain
    q = rand(rng, (2, 3, nq, 24))
    k, v = rand(rng, (2, 3, nk, 24)).astype(half), rand(rng, (2, 3, nk, 40)).astype(half)
    assert _plain(q, k, v)
    assert not _plain(q.astype(F64), k, v) and not _plain(q, k, v.astype(np.float16 if half == HALF[1] else HALF[1]))
    assert not _plain(q.astype(half), k, v)                  # 16-bit q: the general path
    for causal in (False, True):
        got, lse = check(q, k, v, F32, causal=causal, num_threads=[1, 2])
        g_got, g_lse = fastattn.attention(_strided(q), _strided(k), _strided(v), causal=causal, return_lse=True)
        np.testing.assert_array_equal(got, g_got)
        np.testing.assert_array_equal(lse, g_lse)


def _gqa_general(q, k, v, **kw):
    """The same GQA call through the general path (q as a strided view)."""
    from fastattn._attention import _plain_gqa
    gq = _strided(q)
    assert not _plain_gqa(gq, k, v)
    return fastattn.attention(gq, k, v, enable_gqa=True, return_lse=True, **kw)


@pytest.mark.parametrize("kv_dtype", [F32, F64] + HALF, ids=["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("lead,heads", [((), (8, 2)), ((2,), (6, 3)), ((1, 2), (4, 1))])
@pytest.mark.parametrize("nq", [1, 3])
def test_plain_gqa_call(isa, rng, kv_dtype, lead, heads, nq):
    """Grouped-query decoding without a mask is a plain call (_plain_gqa: the
    group's query heads folded into one item's rows, as _prepare and _call
    fold them): the general path's result bit for bit, out= and return_lse,
    and the reference's."""
    from fastattn._attention import _plain_gqa
    H, Hkv = heads
    dtype = F64 if kv_dtype == F64 else F32
    q = rand(rng, lead + (H, nq, 24), dtype)
    k, v = rand(rng, lead + (Hkv, 150, 24), kv_dtype), rand(rng, lead + (Hkv, 150, 40), kv_dtype)
    assert _plain_gqa(q, k, v)
    for causal, scale in [(False, None), (True, 0.3)]:
        got, lse = check(q, k, v, dtype, causal=causal, scale=scale, enable_gqa=True, num_threads=[1, 2])
        g_got, g_lse = _gqa_general(q, k, v, causal=causal, scale=scale)
        np.testing.assert_array_equal(got, g_got)
        np.testing.assert_array_equal(lse, g_lse)
        out = np.full(got.shape, np.nan, dtype)
        res, lse2 = fastattn.attention(q, k, v, causal=causal, scale=scale, enable_gqa=True, out=out,
                                       return_lse=True)
        assert res is out
        np.testing.assert_array_equal(out, got)
        np.testing.assert_array_equal(lse2, lse)
        np.testing.assert_array_equal(fastattn.attention(q, k, v, causal=causal, scale=scale, enable_gqa=True), got)


def test_plain_gqa_recognised(rng):
    """_plain_gqa takes the folded GQA calls that need no conversion; the others
    (a mask, equal head counts, rows beyond the fold, a head count that does not
    divide, broadcast leading dims) go the general way, with its errors and
    the same results."""
    from fastattn._attention import _plain_gqa
    q, k, v = rand(rng, (2, 8, 1, 16)), rand(rng, (2, 2, 40, 16)), rand(rng, (2, 2, 40, 8))
    assert _plain_gqa(q, k, v)
    many = rand(rng, (2, 8, 600, 16))
    assert not _core.gqa_fold(600, k.nbytes + v.nbytes) and not _plain_gqa(many, k, v)
    np.testing.assert_array_equal(fastattn.attention(many, k, v, enable_gqa=True, causal=True),
                                  fastattn.attention(many, np.repeat(k, 4, 1), np.repeat(v, 4, 1), causal=True))
    not_plain = [
        (q, rand(rng, (2, 8, 40, 16)), rand(rng, (2, 8, 40, 8))),     # H == H_kv: the plain call
        (q, rand(rng, (2, 3, 40, 16)), rand(rng, (2, 3, 40, 8))),     # 8 heads over 3: an error
        (q[:1], k, v),                                                # broadcast leading dims
        (q, k[None], v[None]),                                        # different ranks
        (q, k, v.astype(F64)),                                        # mixed dtypes
        (q, np.asfortranarray(k), v),                                 # not C-contiguous
    ]
    for args in not_plain:
        assert not _plain_gqa(*args)
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        fastattn.attention(*not_plain[1], enable_gqa=True)
    for args in (not_plain[0], not_plain[2], not_plain[4], not_plain[5]):
        want = reference64(*args, enable_gqa=True)[0]
        assert_close(fastattn.attention(*args, enable_gqa=True), want, F32)
    # a mask per query head goes the general way (it folds the mask with the rows)
    mask = rng.random((2, 8, 1, 40)) < 0.5
    got = fastattn.attention(q, k, v, mask=mask, enable_gqa=True)
    assert_close(got, reference64(q, k, v, mask=mask, enable_gqa=True)[0], F32)


def _plain_only(monkeypatch, q, k, v, **kw):
    """fastattn.attention(q, k, v, return_lse=True, **kw) with the general path's
    _prepare made to fail: the call must take the plain path."""
    def general(*args, **kwargs):
        raise AssertionError("the general path (_prepare) was taken")
    with monkeypatch.context() as m:
        m.setattr(fastattn._attention, "_prepare", general)
        return fastattn.attention(q, k, v, return_lse=True, **kw)


def _general(q, k, v, **kw):
    """The same call through the general path (q as a strided view)."""
    from fastattn._attention import _plain, _plain_gqa
    gq = _strided(q)
    assert not _plain(gq, k, v) and not _plain_gqa(gq, k, v)
    return fastattn.attention(gq, k, v, return_lse=True, **kw)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("shape", [(), (1,), (3, 1), (3, 4), (4,)], ids=lambda s: f"kvl{s}")
@pytest.mark.parametrize("int_dtype", [np.int64, np.int32, np.uint16])
def test_plain_kv_lengths(isa, rng, monkeypatch, dtype, shape, int_dtype):
    """kv_lengths of any integer dtype that broadcast to the leading dims (B=3, H=4)
    take the plain call (_plain_lengths): the general path's result bit for bit,
    the reference's, keys beyond a length hidden (0 keys: a zero row)."""
    from fastattn._attention import _plain_lengths
    B, H, nq, nk = 3, 4, 2, 70
    q, k, v = rand(rng, (B, H, nq, 24), dtype), rand(rng, (B, H, nk, 24), dtype), rand(rng, (B, H, nk, 16), dtype)
    kvl = rng.integers(0, nk + 1, shape).astype(int_dtype)
    if kvl.size > 1:
        kvl.flat[0], kvl.flat[1] = 0, nk
    got_kvl = _plain_lengths(kvl, (B, H), nk, False)
    assert got_kvl is not None and got_kvl.dtype == np.int64 and np.array_equal(got_kvl, kvl)
    for causal in (False, True):
        got, lse = check(q, k, v, dtype, causal=causal, kv_lengths=kvl, num_threads=[1, 2])
        p_got, p_lse = _plain_only(monkeypatch, q, k, v, causal=causal, kv_lengths=kvl)
        np.testing.assert_array_equal(p_got, got)
        g_got, g_lse = _general(q, k, v, causal=causal, kv_lengths=kvl)
        np.testing.assert_array_equal(got, g_got)
        np.testing.assert_array_equal(lse, g_lse)
        out = np.full(got.shape, np.nan, dtype)
        assert fastattn.attention(q, k, v, causal=causal, kv_lengths=kvl, out=out) is out
        np.testing.assert_array_equal(out, got)
    if kvl.size > 1:   # (flat[0] is 0)
        zero = np.broadcast_to(kvl, (B, H)) == 0
        assert zero.any() and np.all(got[zero] == 0)


@pytest.mark.parametrize("kv_dtype", [F32, F64, HALF[0]], ids=["float32", "float64", "float16"])
@pytest.mark.parametrize("nq", [1, 3])
@pytest.mark.parametrize("mask_shape,mask_dtype", [(None, None)] + [
    (s, t) for s in [(2, 1, 1, 90), (2, 1, "nq", 90), ("nq", 90), (1, 90)] for t in (bool, "float")],
    ids=lambda x: f"{x}" if not isinstance(x, type) else x.__name__)
def test_plain_gqa_lengths_and_masks(isa, rng, monkeypatch, kv_dtype, nq, mask_shape, mask_dtype):
    """Grouped-query decoding with kv_lengths one per batch and a mask with a
    head axis of 1 (a key-padding mask, rows per position) is a plain call
    (_plain_gqa, _plain_mask, _plain_lengths): the mask's rows repeated for the
    group's folded heads, the general path's result bit for bit, and the
    reference's."""
    from fastattn._attention import _plain_mask
    B, H, Hkv, nk = 2, 8, 2, 90
    dtype = F64 if kv_dtype == F64 else F32
    q = rand(rng, (B, H, nq, 32), dtype)
    k, v = rand(rng, (B, Hkv, nk, 32), kv_dtype), rand(rng, (B, Hkv, nk, 24), kv_dtype)
    mask = None
    if mask_shape is not None:
        shape = tuple(nq if x == "nq" else x for x in mask_shape)
        seen = rng.random(shape) < 0.7
        mask = seen if mask_dtype is bool else np.where(seen, rng.standard_normal(shape), -np.inf).astype(dtype)
    kvl = np.array([[nk - 7], [31]])
    for causal in (False, True):
        got, lse = check(q, k, v, dtype, causal=causal, enable_gqa=True, mask=mask, kv_lengths=kvl,
                         num_threads=[1, 2])
        if mask is None or _plain_mask(mask, q, k, True) != _core.MASK_NONE:   # (a float mask read as bool: not)
            p_got, p_lse = _plain_only(monkeypatch, q, k, v, causal=causal, enable_gqa=True, mask=mask,
                                       kv_lengths=kvl)
            np.testing.assert_array_equal(p_got, got)
            np.testing.assert_array_equal(p_lse, lse)
        g_got, g_lse = _general(q, k, v, causal=causal, enable_gqa=True, mask=mask, kv_lengths=kvl)
        np.testing.assert_array_equal(got, g_got)
        np.testing.assert_array_equal(lse, g_lse)
        out = np.full(got.shape, np.nan, dtype)
        assert fastattn.attention(q, k, v, causal=causal, enable_gqa=True, mask=mask, kv_lengths=kvl, out=out) is out
        np.testing.assert_array_equal(out, got)


@pytest.mark.parametrize("kv_dtype", [F32, F64, HALF[0]], ids=["float32", "float64", "float16"])
@pytest.mark.parametrize("lead", [(2, 4), (3,)], ids=["B2H4", "H3"])
@pytest.mark.parametrize("nq", [1, 5])
@pytest.mark.parametrize("extra", ["none", "bool mask", "float mask", "kv_lengths"])
def test_plain_gqa_equal_heads(isa, rng, monkeypatch, kv_dtype, lead, nq, extra):
    """enable_gqa with as many key/value heads as query heads is multi-head
    attention: a plain call (_gqa_equal_heads), the result of the same call
    without enable_gqa and of the general path bit for bit, and the reference's."""
    dtype = F64 if kv_dtype == F64 else F32
    nk = 70
    q = rand(rng, lead + (nq, 32), dtype)
    k, v = rand(rng, lead + (nk, 32), kv_dtype), rand(rng, lead + (nk, 24), kv_dtype)
    kw = {}
    if extra == "bool mask":
        kw["mask"] = rng.random(lead[:-1] + (1, 1, nk)) < 0.7
    elif extra == "float mask":
        kw["mask"] = np.where(rng.random((nq, nk)) < 0.7, rng.standard_normal((nq, nk)), -np.inf).astype(dtype)
    elif extra == "kv_lengths":
        kw["kv_lengths"] = rng.integers(0, nk + 1, lead[:-1] + (1,))
    for causal in (False, True):
        got, lse = check(q, k, v, dtype, causal=causal, enable_gqa=True, num_threads=[1, 2], **kw)
        p_got, p_lse = _plain_only(monkeypatch, q, k, v, causal=causal, enable_gqa=True, **kw)
        m_got, m_lse = fastattn.attention(q, k, v, causal=causal, return_lse=True, **kw)
        g_got, g_lse = _general(q, k, v, causal=causal, enable_gqa=True, **kw)
        for a, b in ((p_got, got), (p_lse, lse), (m_got, got), (m_lse, lse), (g_got, got), (g_lse, lse)):
            np.testing.assert_array_equal(a, b)
        out = np.full(got.shape, np.nan, dtype)
        assert fastattn.attention(q, k, v, causal=causal, enable_gqa=True, out=out, **kw) is out
        np.testing.assert_array_equal(out, got)


def test_plain_gqa_equal_heads_errors(rng):
    """The calls with enable_gqa that are not multi-head attention in disguise
    still take the general path, to its errors: no head axis, zero heads, k and
    v with different head counts."""
    from fastattn._attention import _gqa_equal_heads
    q2, k2 = rand(rng, (1, 16)), rand(rng, (5, 16))
    assert not _gqa_equal_heads(q2, k2)
    with pytest.raises(ValueError, match="needs a head axis"):
        fastattn.attention(q2, k2, k2, enable_gqa=True)
    q0, k0 = rand(rng, (2, 0, 1, 16)), rand(rng, (2, 0, 5, 16))
    assert not _gqa_equal_heads(q0, k0)
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        fastattn.attention(q0, k0, k0, enable_gqa=True)
    q, k, v = rand(rng, (2, 4, 1, 16)), rand(rng, (2, 4, 5, 16)), rand(rng, (2, 3, 5, 16))
    assert _gqa_equal_heads(q, k)
    with pytest.raises(ValueError, match="different head counts"):
        fastattn.attention(q, k, v, enable_gqa=True)
    assert not _gqa_equal_heads(q.tolist(), k)   # lists: the general path's conversion
    assert_close(fastattn.attention(q.tolist(), k, k, enable_gqa=True), reference64(q, k, k)[0], F64)


@pytest.mark.parametrize("kv_dtype", [F32, F64, HALF[0]], ids=["float32", "float64", "float16"])
@pytest.mark.parametrize("lead", [(2,), (1, 2)], ids=["B2", "1x2"])
@pytest.mark.parametrize("nq", [1, 5])
@pytest.mark.parametrize("extra", ["none", "bool mask", "float mask", "kv_lengths", "enable_gqa"])
def test_plain_blhd(isa, rng, monkeypatch, kv_dtype, lead, nq, extra):
    """layout="blhd" with C-contiguous (..., n, H, d) arrays is a plain call
    (_plain_blhd): read through the (..., H, n, d) views as the general path
    reads them, the result (..., n_q, H, d_v) written through its view, the
    general path's result bit for bit (out= and the head-major lse too), and
    the reference's.  Masks and kv_lengths are head-major, as there."""
    from fastattn._attention import _plain_blhd
    dtype = F64 if kv_dtype == F64 else F32
    H, nk = 3, 70
    q = rand(rng, lead + (nq, H, 32), dtype)
    k, v = rand(rng, lead + (nk, H, 32), kv_dtype), rand(rng, lead + (nk, H, 24), kv_dtype)
    assert _plain_blhd(q, k, v, False)
    kw = {"layout": "blhd"}
    if extra == "bool mask":
        kw["mask"] = rng.random(lead + (1, 1, nk)) < 0.7
    elif extra == "float mask":
        kw["mask"] = np.where(rng.random((H, nq, nk)) < 0.7, rng.standard_normal((H, nq, nk)),
                              -np.inf).astype(dtype)
    elif extra == "kv_lengths":
        kw["kv_lengths"] = rng.integers(0, nk + 1, lead + (H,))
    elif extra == "enable_gqa":
        kw["enable_gqa"] = True
    for causal in (False, True):
        got, lse = check(q, k, v, dtype, causal=causal, num_threads=[1, 2], **kw)
        assert got.shape == lead + (nq, H, 24) and lse.shape == lead + (H, nq)
        p_got, p_lse = _plain_only(monkeypatch, q, k, v, causal=causal, **kw)
        g_got, g_lse = fastattn.attention(_strided(q), k, v, causal=causal, return_lse=True, **kw)
        assert not _plain_blhd(_strided(q), k, v, False)
        for a, b in ((p_got, got), (p_lse, lse), (g_got, got), (g_lse, lse)):
            np.testing.assert_array_equal(a, b)
        out = np.full(got.shape, np.nan, dtype)
        assert fastattn.attention(q, k, v, causal=causal, out=out, **kw) is out
        np.testing.assert_array_equal(out, got)


@pytest.mark.parametrize("kv_dtype", [F32, F64] + HALF, ids=["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("lead,heads", [((2,), (6, 3)), ((1, 2), (4, 1)), ((), (8, 2))])
@pytest.mark.parametrize("nq", [1, 3])
@pytest.mark.parametrize("extra", ["none", "bool mask", "float mask", "kv_lengths"])
def test_plain_gqa_blhd(isa, rng, monkeypatch, kv_dtype, lead, heads, nq, extra):
    """layout="blhd" with enable_gqa and C-contiguous (..., n, H, d) arrays is a
    plain call (_plain_arrays, _gqa_fold_shapes on the heads-first views): the
    folded C call of the general path on the same views, the result (..., n_q,
    H, d_v) written through its view (rows copied back where n_q > 1 leaves no
    view of them): the general path's result bit for bit (out= and the
    head-major lse too), and the reference's.  Masks (a head axis of 1) and
    kv_lengths (one per batch entry) as there."""
    H, Hkv = heads
    dtype = F64 if kv_dtype == F64 else F32
    nk = 90
    q = rand(rng, lead + (nq, H, 24), dtype)
    k, v = rand(rng, lead + (nk, Hkv, 24), kv_dtype), rand(rng, lead + (nk, Hkv, 16), kv_dtype)
    kw = {"layout": "blhd", "enable_gqa": True}
    if extra == "bool mask":
        kw["mask"] = rng.random(lead + (1, 1, nk)) < 0.7
    elif extra == "float mask":
        kw["mask"] = np.where(rng.random((1, nq, nk)) < 0.7, rng.standard_normal((1, nq, nk)), -np.inf).astype(dtype)
    elif extra == "kv_lengths":
        kw["kv_lengths"] = rng.integers(0, nk + 1, lead + (1,))
    for causal, scale in ((False, None), (True, 0.3)):
        got, lse = check(q, k, v, dtype, causal=causal, scale=scale, num_threads=[1, 2], **kw)
        assert got.shape == lead + (nq, H, 16) and lse.shape == lead + (H, nq)
        p_got, p_lse = _plain_only(monkeypatch, q, k, v, causal=causal, scale=scale, **kw)
        g_got, g_lse = fastattn.attention(_strided(q), k, v, causal=causal, scale=scale, return_lse=True, **kw)
        for a, b in ((p_got, got), (p_lse, lse), (g_got, got), (g_lse, lse)):
            np.testing.assert_array_equal(a, b)
        out = np.full(got.shape, np.nan, dtype)
        res, lse2 = fastattn.attention(q, k, v, causal=causal, scale=scale, out=out, return_lse=True, **kw)
        assert res is out
        np.testing.assert_array_equal(out, got)
        np.testing.assert_array_equal(lse2, lse)


def test_plain_gqa_blhd_recognised(rng, monkeypatch):
    """GQA in layout "blhd" takes the plain call where the arrays and options
    allow; the rest goes the general way, to its errors or its results: a mask
    per query head, kv_lengths per head, causal strings, a window, softcap,
    broadcast batch, mixed dtypes, non-contiguous views, rows beyond the fold."""
    q, k, v = rand(rng, (2, 1, 8, 16)), rand(rng, (2, 40, 2, 16)), rand(rng, (2, 40, 2, 8))
    kw = {"layout": "blhd", "enable_gqa": True}
    _plain_only(monkeypatch, q, k, v, **kw)
    general = [
        (dict(mask=rng.random((2, 8, 1, 40)) < 0.5), (q, k, v)),
        (dict(kv_lengths=rng.integers(0, 41, (2, 8))), (q, k, v)),
        (dict(causal="upper_left"), (q, k, v)),
        (dict(window=(5, 0)), (q, k, v)),
        (dict(softcap=2.0), (q, k, v)),
        ({}, (q[:1], k, v)),
        ({}, (q, k, v.astype(F64))),
        ({}, (q, np.asfortranarray(k), v)),
        ({}, (rand(rng, (2, 600, 8, 16)), k, v)),
    ]
    for extra, args in general:
        with pytest.raises(AssertionError, match="general path"):
            _plain_only(monkeypatch, *args, **kw, **extra)
        want = reference64(*args, **kw, **extra)[0]
        assert_close(fastattn.attention(*args, **kw, **extra), want, F64 if args[2].dtype == F64 else F32)
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        fastattn.attention(q, rand(rng, (2, 40, 3, 16)), rand(rng, (2, 40, 3, 8)), **kw)
    with pytest.raises(ValueError, match="out"):
        fastattn.attention(q, k, v, out=np.empty((2, 8, 1, 8), F32), **kw)   # bhld's shape


def test_plain_blhd_recognised(rng):
    """_plain_blhd takes equal leading dims and heads; the rest goes the general
    way, to its errors or its results (GQA, broadcast batch, views)."""
    from fastattn._attention import _plain_blhd
    q, k, v = rand(rng, (2, 1, 4, 16)), rand(rng, (2, 9, 4, 16)), rand(rng, (2, 9, 4, 8))
    assert _plain_blhd(q, k, v, False) and _plain_blhd(q, k, v, True)
    kv2 = rand(rng, (2, 9, 2, 16)), rand(rng, (2, 9, 2, 8))
    assert not _plain_blhd(q, *kv2, True)   # GQA: the general path's fold
    assert_close(fastattn.attention(q, *kv2, layout="blhd", enable_gqa=True),
                 reference64(q, *kv2, layout="blhd", enable_gqa=True)[0], F32)
    assert not _plain_blhd(q[:1], k, v, False)   # broadcast batch
    assert_close(fastattn.attention(q[:1], k, v, layout="blhd"), reference64(q[:1], k, v, layout="blhd")[0], F32)
    assert not _plain_blhd(q[..., 0, :], k[..., 0, :], v[..., 0, :], False)   # no head axis: an error there
    with pytest.raises(ValueError, match="blhd"):
        fastattn.attention(q[0, :, 0], k[0, :, 0], v[0, :, 0], layout="blhd")
    q0, k0 = rand(rng, (2, 1, 0, 16)), rand(rng, (2, 9, 0, 16))
    assert _plain_blhd(q0, k0, k0, False) and not _plain_blhd(q0, k0, k0, True)
    assert fastattn.attention(q0, k0, k0, layout="blhd").shape == (2, 1, 0, 16)
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        fastattn.attention(q0, k0, k0, layout="blhd", enable_gqa=True)
    bad_out = np.empty((2, 4, 1, 8), F32)   # bhld's shape: the general path's error
    with pytest.raises(ValueError, match="out"):
        fastattn.attention(q, k, v, layout="blhd", out=bad_out)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("nq,nk", [(1, 70), (9, 40)])
def test_plain_scalar_options(isa, rng, monkeypatch, dtype, layout, nq, nk):
    """The plain call takes the scalar options too: causal as a bool, NumPy bool
    or alignment string, a window, a softcap (with a mask and kv_lengths), each
    checked by the general path's own function: its result bit for bit, the
    reference's, and its errors."""
    B, H = 2, 3
    heads = (lambda n, d: (B, H, n, d)) if layout == "bhld" else (lambda n, d: (B, n, H, d))
    q, k, v = rand(rng, heads(nq, 32), dtype), rand(rng, heads(nk, 32), dtype), rand(rng, heads(nk, 16), dtype)
    mask = rng.random((B, 1, 1, nk)) < 0.8
    kvl = np.array([[nk], [nk - 5]])
    cases = [dict(causal="upper_left"), dict(causal="lower_right", window=(6, 0)), dict(causal=np.bool_(True)),
             dict(window=(3, 2), softcap=5.0), dict(softcap=2.5, mask=mask, kv_lengths=kvl),
             dict(causal="upper_left", window=(None, 4), softcap=30.0)]
    for kw in cases:
        kw = dict(kw, layout=layout)
        got, lse = check(q, k, v, dtype, num_threads=[1, 2], **kw)
        p_got, p_lse = _plain_only(monkeypatch, q, k, v, **kw)
        g_got, g_lse = fastattn.attention(_strided(q), k, v, return_lse=True, **kw)
        for a, b in ((p_got, got), (p_lse, lse), (g_got, got), (g_lse, lse)):
            np.testing.assert_array_equal(a, b)
    bad = [dict(window=(1, 2, 3)), dict(window=("a", 1)), dict(window=(True, 1)), dict(softcap=0),
           dict(softcap=float("inf")), dict(softcap="1"), dict(causal="bottom_right"), dict(causal=2.0),
           dict(causal="upper_left", window=5)]
    for kw in bad:
        kw = dict(kw, layout=layout)
        with pytest.raises((TypeError, ValueError)) as general_err:
            fastattn.attention(_strided(q), k, v, **kw)
        with pytest.raises(type(general_err.value), match=None) as plain_err:
            fastattn.attention(q, k, v, **kw)
        assert str(plain_err.value) == str(general_err.value)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("nq,nk", [(1, 70), (9, 40)])
def test_plain_alibi(isa, rng, monkeypatch, dtype, layout, nq, nk):
    """The plain call takes ALiBi slopes that broadcast to the leading dims (B, H)
    without growing them (_plain_slopes; any real dtype, converted as the general
    path converts them), with the other options: the general path's result bit
    for bit, the reference's; slopes that grow the leading dims, a GQA fold, or
    out= sharing their memory go the general way; bad slopes raise its errors,
    after a bad mask's."""
    from fastattn._attention import _plain_slopes
    B, H = 2, 3
    heads = (lambda n, d: (B, H, n, d)) if layout == "bhld" else (lambda n, d: (B, n, H, d))
    q, k, v = rand(rng, heads(nq, 32), dtype), rand(rng, heads(nk, 32), dtype), rand(rng, heads(nk, 16), dtype)
    slopes = [np.linspace(0.05, 0.6, H), np.array(0.25, F32), np.array([[0.1], [0.7]]),
              rng.random((B, H)).astype(dtype), np.array([1, 2, 3], np.int16)]
    for s in slopes:
        assert _plain_slopes(s, q if layout == "bhld" else np.swapaxes(q, 1, 2)) is not None
        for kw in (dict(causal=True), dict(causal="upper_left", window=(5, 0), softcap=4.0),
                   dict(mask=rng.random((B, 1, 1, nk)) < 0.8, kv_lengths=np.array([[nk], [nk - 3]]))):
            kw = dict(kw, layout=layout, alibi_slopes=s)
            got, lse = check(q, k, v, dtype, num_threads=[1, 2], **kw)
            p_got, p_lse = _plain_only(monkeypatch, q, k, v, **kw)
            g_got, g_lse = fastattn.attention(_strided(q), k, v, return_lse=True, **kw)
            for a, b in ((p_got, got), (p_lse, lse), (g_got, got), (g_lse, lse)):
                np.testing.assert_array_equal(a, b)
    with pytest.raises(AssertionError, match="general path"):        # slopes that grow the leading dims
        _plain_only(monkeypatch, q, k, v, layout=layout, alibi_slopes=np.ones((3, B, H)))
    with pytest.raises(ValueError, match="alibi_slopes of shape"):    # or do not broadcast: its error
        fastattn.attention(q, k, v, layout=layout, alibi_slopes=np.ones((4,)))
    qg = rand(rng, heads(nq, 32)[:-3] + ((2 * H, nq) if layout == "bhld" else (nq, 2 * H)) + (32,), dtype)
    with pytest.raises(AssertionError, match="general path"):        # a GQA fold: per-head slopes
        _plain_only(monkeypatch, qg, k, v, layout=layout, enable_gqa=True, alibi_slopes=np.ones(2 * H))
    buf = np.zeros(q.shape[:-1] + (16,), dtype)      # out= over the slopes: the general path's temporary
    s = buf.reshape(-1)[:H]
    with pytest.raises(AssertionError, match="general path"):
        _plain_only(monkeypatch, q, k, v, layout=layout, alibi_slopes=s, out=buf)
    want = fastattn.attention(q, k, v, layout=layout, alibi_slopes=s.copy())
    np.testing.assert_array_equal(fastattn.attention(q, k, v, layout=layout, alibi_slopes=s, out=buf), want)
    bad = [dict(alibi_slopes="x"), dict(alibi_slopes=np.array([1j, 2j, 3j])),
           dict(alibi_slopes="x", mask=np.ones((B, H, nq, nk), np.int8)), dict(alibi_slopes="x", kv_lengths=1.5)]
    for kw in bad:
        kw = dict(kw, layout=layout)
        with pytest.raises((TypeError, ValueError)) as general_err:
            fastattn.attention(_strided(q), k, v, **kw)
        with pytest.raises(type(general_err.value)) as plain_err:
            fastattn.attention(q, k, v, **kw)
        assert str(plain_err.value) == str(general_err.value)


def test_plain_lengths_recognised(rng):
    """_plain_lengths takes integer arrays that broadcast to the leading dims
    without growing them and lie in [0, n_k]; anything else goes the general
    way, with its errors (or, for a fold, its per-head lengths) and the same
    results."""
    from fastattn._attention import _plain_lengths
    lead, nk = (3, 4), 50
    ok = [np.array(7), np.array([1, 2, 3, 4]), np.array([[1], [2], [3]]), np.zeros((3, 4), np.int8)]
    for x in ok:
        assert _plain_lengths(x, lead, nk, False) is not None
    not_plain = [
        7,                                     # a Python int (np.asarray in the general path)
        np.int64(7),                           # a NumPy scalar, likewise
        [[1], [2], [3]],                       # a list
        np.array([[1.0], [2], [3]]),           # floats: a TypeError there
        np.array([True, False, True, True]),   # bool: a TypeError there
        np.array([[1], [2]]),                  # does not broadcast: a ValueError there
        np.ones((2, 3, 4), np.int64),          # grows the leading dims: a ValueError there
        np.array([1, 2, 3, nk + 1]),           # beyond n_k: a ValueError there
        np.array([[-1], [2], [3]]),            # negative: a ValueError there
    ]
    for x in not_plain[:3] + not_plain[5:7]:
        assert _plain_lengths(x, lead, nk, False) is None
    for x, exc in [(not_plain[3], TypeError), (not_plain[4], TypeError), (not_plain[7], ValueError),
                   (not_plain[8], ValueError)]:   # _lengths's checks: the general path's errors
        with pytest.raises(exc, match="kv_lengths"):
            _plain_lengths(x, lead, nk, False)
    assert _plain_lengths(np.array([1, 2, 3, 4]), lead, nk, True) is None   # per head: no fold
    assert _plain_lengths(np.array([[1], [2], [3]]), lead, nk, True) is not None
    q, k, v = rand(rng, lead + (1, 16)), rand(rng, lead + (nk, 16)), rand(rng, lead + (nk, 8))
    for x, exc in [(not_plain[3], TypeError), (not_plain[4], TypeError), (not_plain[5], ValueError),
                   (not_plain[6], ValueError), (not_plain[7], ValueError), (not_plain[8], ValueError)]:
        with pytest.raises(exc, match="kv_lengths"):
            fastattn.attention(q, k, v, kv_lengths=x)
    for x in not_plain[:3]:
        assert_close(fastattn.attention(q, k, v, kv_lengths=x), reference64(q, k, v, kv_lengths=x)[0], F32)
    # GQA: lengths per query head, or a mask per query head, take the general path's fold
    gq, gk, gv = rand(rng, (3, 8, 1, 16)), rand(rng, (3, 2, nk, 16)), rand(rng, (3, 2, nk, 8))
    per_head = rng.integers(0, nk + 1, (3, 8))
    mask = rng.random((3, 8, 1, nk)) < 0.6
    for kw in (dict(kv_lengths=per_head), dict(mask=mask), dict(mask=mask, kv_lengths=per_head[:, :1])):
        assert_close(fastattn.attention(gq, gk, gv, enable_gqa=True, **kw),
                     reference64(gq, gk, gv, enable_gqa=True, **kw)[0], F32)
