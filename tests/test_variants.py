"""Modern attention variants (GQA, windows, softcap, ALiBi, kv_lengths, q_lengths, packed
sequences), the weights, merging, and the layers, each against its twin in fastattn.reference."""

import numpy as np
import pytest
from conftest import assert_close, rand

import fastattn
from fastattn import _core
from fastattn import reference as ref

F32, F64 = np.float32, np.float64


def check(q, k, v, dtype, **kw):
    threads = kw.pop("num_threads", None)
    out, lse = fastattn.attention(q, k, v, return_lse=True, num_threads=threads, **kw)
    c = lambda a: np.asarray(a).astype(F64)  # noqa: E731
    mask = kw.pop("mask", None)
    if mask is not None and np.asarray(mask).dtype != bool:
        mask = c(mask)
    want, want_lse = ref.attention(c(q), c(k), c(v), mask=mask, return_lse=True, **kw)
    assert_close(out, want, dtype)
    assert_close(lse, want_lse, dtype, "lse")
    return out, lse


# shapes that go through the tiled kernel, the few-rows kernel, and the split-key merge
PATHS = {"tiled": (150, 300, 1), "rows": (3, 300, 1), "split": (2, 2100, 2)}


# ---------------------------------------------------------------------------
# GQA
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("hkv", [1, 2, 6])
@pytest.mark.parametrize("path", list(PATHS))
def test_gqa(isa, rng, dtype, hkv, path):
    nq, nk, threads = PATHS[path]
    q = rand(rng, (2, 6, nq, 16), dtype)
    k, v = rand(rng, (2, hkv, nk, 16), dtype), rand(rng, (2, hkv, nk, 12), dtype)
    check(q, k, v, dtype, enable_gqa=True, num_threads=threads)
    check(q, k, v, dtype, enable_gqa=True, causal=True, num_threads=threads)
    mask = rng.random((6, nq, nk)) < 0.7       # a per-query-head mask
    check(q, k, v, dtype, enable_gqa=True, mask=mask, num_threads=threads)
    check(q, k, v, dtype, enable_gqa=True, mask=rng.random((1, nq, nk)) < 0.7)
    out = fastattn.attention(q, k, v, enable_gqa=True)
    assert out.shape == (2, 6, nq, 12)


def test_gqa_out_lse_and_broadcast(rng):
    q, k, v = rand(rng, (4, 5, 8)), rand(rng, (2, 7, 8)), rand(rng, (2, 7, 3))
    out = np.empty((4, 5, 3), F32)
    res, lse = fastattn.attention(q, k, v, enable_gqa=True, out=out, return_lse=True)
    assert res is out and lse.shape == (4, 5)
    want, want_lse = ref.attention(q.astype(F64), k.astype(F64), v.astype(F64), enable_gqa=True, return_lse=True)
    assert_close(out, want, F32)
    assert_close(lse, want_lse, F32)
    strided = np.zeros((4, 3, 10), F32).transpose(0, 2, 1)[:, ::2]     # (4, 5, 3), any strides
    fastattn.attention(q, k, v, enable_gqa=True, out=strided)
    assert_close(strided, want, F32)


@pytest.mark.parametrize("qs,ks,vs,msg", [
    ((6, 5, 8), (4, 7, 8), (4, 7, 3), "multiple of the key/value heads"),
    ((6, 5, 8), (2, 7, 8), (3, 7, 3), "different head counts"),
    ((5, 8), (7, 8), (7, 3), "needs a head axis"),
])
def test_gqa_errors(rng, qs, ks, vs, msg):
    with pytest.raises(ValueError, match=msg):
        fastattn.attention(rand(rng, qs), rand(rng, ks), rand(rng, vs), enable_gqa=True)
    with pytest.raises(ValueError, match="heads on axis"):
        fastattn.attention(rand(rng, (6, 5, 8)), rand(rng, (2, 7, 8)), rand(rng, (2, 7, 3)), enable_gqa=True,
                           mask=np.ones((3, 5, 7), bool))


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
# softcap, ALiBi
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


# ---------------------------------------------------------------------------
# kv_lengths
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("path", list(PATHS))
def test_kv_lengths(isa, rng, dtype, path):
    nq, nk, threads = PATHS[path]
    q, k, v = rand(rng, (3, 2, nq, 16), dtype), rand(rng, (3, 2, nk, 16), dtype), rand(rng, (3, 2, nk, 8), dtype)
    lengths = np.array([[nk], [nk // 3], [0]])                  # (B, 1): per batch entry
    out, lse = check(q, k, v, dtype, kv_lengths=lengths, num_threads=threads)
    assert np.all(out[2] == 0) and np.all(np.isneginf(lse[2]))
    check(q, k, v, dtype, kv_lengths=lengths, causal=True, num_threads=threads)
    check(q, k, v, dtype, kv_lengths=rng.integers(0, nk + 1, (3, 2)), causal=True, window=(50, 0),
          num_threads=threads)
    # the padding beyond a length is never read: NaN there changes nothing
    kp = k.copy()
    kp[1, :, nk // 3:] = np.nan
    out2 = fastattn.attention(q, kp, v, kv_lengths=lengths, num_threads=threads)
    assert_close(out2, out.astype(F64), dtype)


def test_scalar_lengths_and_slopes_without_leading_dims(isa, rng):
    """A scalar kv_lengths or ALiBi slope with inputs that have no leading dims
    (q (n_q, d) or (d,)): leading dims () take a scalar as any others do (it was
    once turned into shape (1,) and refused)."""
    q, k, v = rand(rng, (5, 16)), rand(rng, (40, 16)), rand(rng, (40, 8))
    check(q, k, v, F32, kv_lengths=23)
    check(q, k, v, F32, kv_lengths=np.int64(30), causal=True)
    check(q, k, v, F32, kv_lengths=0)
    check(q, k, v, F32, alibi_slopes=0.5)
    check(q, k, v, F32, alibi_slopes=np.float32(0.25), kv_lengths=17, causal=True)
    out = fastattn.attention(q[0], k, v, kv_lengths=11)
    assert_close(out, ref.attention(q[0].astype(F64), k.astype(F64), v.astype(F64), kv_lengths=11), F32)


@pytest.mark.parametrize("name,axis,n", [("kv_lengths", "n_k", 6), ("q_lengths", "n_q", 4)])
def test_lengths_errors(rng, name, axis, n):
    q, k, v = rand(rng, (2, 3, 4, 8)), rand(rng, (2, 3, 6, 8)), rand(rng, (2, 3, 6, 2))
    with pytest.raises(ValueError, match=rf"{name} must lie in \[0, {axis}={n}\], got values from 2 to {n + 1}"):
        fastattn.attention(q, k, v, **{name: np.array([[n + 1], [2]])})
    with pytest.raises(ValueError, match=f"{name} must lie"):
        fastattn.attention(q, k, v, **{name: -1})
    with pytest.raises(TypeError, match=f"{name} must be integers"):
        fastattn.attention(q, k, v, **{name: np.array([2.5, 3.0])})
    with pytest.raises(ValueError, match=rf"{name} of shape \(2,\) .*\(B, 1\)"):
        fastattn.attention(q, k, v, **{name: np.array([2, 3])})     # (B,) aligns with the heads
    with pytest.raises(ValueError, match=name):
        fastattn.attention_weights(q, k, **{name: np.ones((4, 2, 3), int)})   # would grow the leading dims


# ---------------------------------------------------------------------------
# q_lengths
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("path", list(PATHS))
def test_q_lengths(isa, rng, dtype, path):
    """Right-padded queries (batched prefill of sequences of different lengths):
    the rows from q_lengths on are padding (zeros, lse -inf) and causal and
    window alignment use q_lengths in place of n_q, so that a batch entry gives
    what its real rows give alone; with kv_lengths, windows, ALiBi, softcap and
    masks, on every path (the split keys too: one or two rows, lengths 0-2)."""
    nq, nk, threads = PATHS[path]
    q, k, v = rand(rng, (3, 2, nq, 16), dtype), rand(rng, (3, 2, nk, 16), dtype), rand(rng, (3, 2, nk, 8), dtype)
    q_len = np.array([[nq], [nq // 2], [0]])                   # (B, 1): per batch entry
    kv_len = np.array([[nk], [nq // 2 + nk // 3], [nk // 2]])
    out, lse = check(q, k, v, dtype, q_lengths=q_len, num_threads=threads)
    assert np.all(out[1, :, nq // 2:] == 0) and np.all(np.isneginf(lse[1, :, nq // 2:]))
    assert np.all(out[2] == 0) and np.all(np.isneginf(lse[2]))
    assert np.all(np.isfinite(lse[0])) and np.all(np.isfinite(lse[1, :, :nq // 2]))
    for causal in (False, True):
        out = check(q, k, v, dtype, q_lengths=q_len, kv_lengths=kv_len, causal=causal, num_threads=threads)[0]
        for b in range(3):   # each entry alone, on its real rows: the same
            ql = q_len[b, 0]
            alone = fastattn.attention(q[b, :, :ql], k[b], v[b], kv_lengths=kv_len[b, 0], causal=causal)
            assert_close(out[b, :, :ql], alone.astype(F64), dtype)
        # the padding rows are never read: NaN there changes nothing
        qp = q.copy()
        qp[1, :, nq // 2:] = np.nan
        qp[2] = np.nan
        np.testing.assert_array_equal(fastattn.attention(qp, k, v, q_lengths=q_len, kv_lengths=kv_len,
                                                         causal=causal, num_threads=threads), out)
    check(q, k, v, dtype, q_lengths=rng.integers(0, nq + 1, (3, 2)), kv_lengths=rng.integers(0, nk + 1, (3, 2)),
          causal=True, window=(50, 0), num_threads=threads)
    check(q, k, v, dtype, q_lengths=q_len, alibi_slopes=np.array([0.5, 0.25]), softcap=3.0, causal=True,
          num_threads=threads)
    check(q, k, v, dtype, q_lengths=q_len, mask=rng.random((nq, nk)) < 0.7, num_threads=threads)
    fmask = np.where(rng.random((3, 1, nq, nk)) < 0.3, -np.inf, rng.standard_normal((3, 1, nq, nk)))
    check(q, k, v, dtype, q_lengths=q_len, mask=fmask.astype(dtype), causal=True, num_threads=threads)
    for lengths in (q_len, rng.integers(0, nq + 1, (3, 2))):   # GQA: per batch (folded when few rows), per head
        check(q, k[:, :1], v[:, :1], dtype, enable_gqa=True, q_lengths=lengths, kv_lengths=kv_len, causal=True,
              num_threads=threads)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("bq,bk", [(0, 0), (16, 32), (40, 72), (7, 5)])
def test_q_lengths_tiles(isa, fused, tiles, rng, dtype, bq, bk):
    """Lengths that end inside a query block (an item with some real rows and
    some padding), at its edges, and at 0 and n_q, for every tile size, fused
    exp or not, with return_lse, out= of any layout and the weights."""
    tiles(bq, bk)
    nq, nk = 150, 300
    q, k, v = rand(rng, (6, nq, 16), dtype), rand(rng, (6, nk, 16), dtype), rand(rng, (6, nk, 8), dtype)
    q_len = np.array([0, 1, 39, 40, 61, 150])
    check(q, k, v, dtype, q_lengths=q_len, causal=True)
    check(q, k, v, dtype, q_lengths=q_len, kv_lengths=q_len + 100, causal=True, mask=rng.random((nq, nk)) < 0.8)
    want = ref.attention(q.astype(F64), k.astype(F64), v.astype(F64), q_lengths=q_len, causal=True)
    out = np.full((6, 8, nq), np.nan, dtype).transpose(0, 2, 1)           # any strides
    assert fastattn.attention(q, k, v, q_lengths=q_len, causal=True, out=out) is out
    assert_close(out, want, dtype)
    w = fastattn.attention_weights(q, k, q_lengths=q_len, causal=True)
    assert_close(w, ref.attention_weights(q.astype(F64), k.astype(F64), q_lengths=q_len, causal=True), dtype)
    for b, ql in enumerate(q_len):
        assert np.all(w[b, ql:] == 0) and np.all(out[b, ql:] == 0)


def test_q_lengths_1d_and_scalar(rng):
    """A 1-D q (one query) takes q_lengths 0 or 1; a scalar broadcasts."""
    q, k, v = rand(rng, (16,)), rand(rng, (40, 16)), rand(rng, (40, 8))
    assert np.all(fastattn.attention(q, k, v, q_lengths=0) == 0)
    assert_close(fastattn.attention(q, k, v, q_lengths=1), ref.attention(q.astype(F64), k.astype(F64),
                                                                           v.astype(F64)), F32)
    q2 = rand(rng, (5, 16))
    check(q2, k, v, F32, q_lengths=3, kv_lengths=3, causal=True)
    check(q2, k, v, F32, q_lengths=np.int32(5))


# ---------------------------------------------------------------------------
# causal="upper_left": top-left alignment
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("path", list(PATHS))
def test_causal_upper_left(isa, rng, dtype, path):
    """causal="upper_left" (PyTorch's is_causal): query i sees keys j <= i for any
    n_q and n_k, as the explicit lower-triangular mask gives; window, ALiBi,
    kv_lengths, q_lengths and GQA (folded when few rows) follow the position i;
    on every kernel path (the split keys too, where most parts see nothing)."""
    nq, nk, threads = PATHS[path]
    shapes = [(nq, nk)] + ([(nk, nq)] if path == "tiled" else [])       # fewer and more queries than keys
    for n_q, n_k in shapes:
        q, k, v = rand(rng, (3, 2, n_q, 16), dtype), rand(rng, (3, 2, n_k, 16), dtype), rand(rng, (3, 2, n_k, 8), dtype)
        out = check(q, k, v, dtype, causal="upper_left", num_threads=threads)[0]
        tril = np.tril(np.ones((n_q, n_k), bool))
        want = ref.attention(q.astype(F64), k.astype(F64), v.astype(F64), mask=tril)    # an independent oracle
        assert_close(out, want, dtype)
        assert_close(fastattn.attention(q, k, v, mask=tril, num_threads=threads), want, dtype)
        if n_q != n_k:   # not the bottom-right rule
            assert not np.allclose(out, fastattn.attention(q, k, v, causal=True))
        kv_len = np.array([[n_k], [n_k // 3], [0]])
        check(q, k, v, dtype, causal="upper_left", window=(40, 2), num_threads=threads)
        check(q, k, v, dtype, causal="upper_left", alibi_slopes=np.array([0.5, 0.25]), kv_lengths=kv_len,
              num_threads=threads)
        check(q, k, v, dtype, causal="upper_left", q_lengths=np.array([[n_q], [n_q // 2], [1]]), kv_lengths=kv_len,
              mask=rng.random((n_q, n_k)) < 0.8, num_threads=threads)
        check(q, k[:, :1], v[:, :1], dtype, causal="upper_left", enable_gqa=True, kv_lengths=kv_len,
              num_threads=threads)
        w = fastattn.attention_weights(q, k, causal="upper_left", window=(40, 2))
        assert_close(w, ref.attention_weights(q.astype(F64), k.astype(F64), causal="upper_left", window=(40, 2)),
                     dtype)


def test_causal_values():
    """causal: False, True, "lower_right" (= True), "upper_left", NumPy bools and
    0/1 and None (False); anything else is an error naming the choices."""
    q, k, v = np.ones((2, 4)), np.ones((5, 4)), np.arange(5.0)[:, None]
    bottom = fastattn.attention(q, k, v, causal=True)
    assert np.array_equal(fastattn.attention(q, k, v, causal="lower_right"), bottom)
    assert np.array_equal(fastattn.attention(q, k, v, causal=np.True_), bottom)
    assert np.array_equal(fastattn.attention(q, k, v, causal=1), bottom)
    assert np.array_equal(fastattn.attention(q, k, v, causal=None), fastattn.attention(q, k, v))
    np.testing.assert_allclose(fastattn.attention(q, k, v, causal="upper_left")[:, 0], [0.0, 0.5])
    for bad, exc in (("top_left", ValueError), ("", ValueError), (2, TypeError), ([True], TypeError),
                     (0.5, TypeError)):
        with pytest.raises(exc, match='causal must be False, True, "lower_right" or "upper_left"'):
            fastattn.attention(q, k, v, causal=bad)
        with pytest.raises(exc, match="causal must be"):
            fastattn.attention_varlen(q[:, None], k[:, None], v[:, None], [0, 2], [0, 5], causal=bad)


# ---------------------------------------------------------------------------
# attention_varlen: packed sequences
# ---------------------------------------------------------------------------
def packed(rng, lq, lk, H, Hkv, dtype, d=16, dv=8):
    cq, ck = np.cumsum([0] + list(lq)), np.cumsum([0] + list(lk))
    return (rand(rng, (cq[-1], H, d), dtype), rand(rng, (ck[-1], Hkv, d), dtype), rand(rng, (ck[-1], Hkv, dv), dtype),
            cq, ck)


def check_varlen(q, k, v, cq, ck, dtype, **kw):
    threads = kw.pop("num_threads", None)
    out, lse = fastattn.attention_varlen(q, k, v, cq, ck, return_lse=True, num_threads=threads, **kw)
    c = lambda a: np.asarray(a).astype(F64)  # noqa: E731
    want, want_lse = ref.attention_varlen(c(q), c(k), c(v), cq, ck, return_lse=True, **kw)
    assert_close(out, want, dtype)
    assert_close(lse, want_lse, dtype, "lse")
    return out, lse


# sequence lengths (queries, keys) that take the tiled kernel, the few-rows kernel and
# the split-key merge (one head, one sequence with queries: fewer items than threads),
# with threads
VARLEN_PATHS = {"tiled": ([150, 0, 97, 1, 64], [300, 5, 97, 0, 64], 4, 2),
                "rows": ([3, 1, 0, 2], [300, 40, 7, 0], 4, 1),
                "split": ([0, 2, 0], [5, 2100, 0], 1, 2),
                # decoding (one query a sequence): with H_kv < H, a group's heads folded into rows
                "decode": ([1, 1, 1, 1], [300, 0, 2100, 7], 4, 2),
                "decode split": ([1], [2100], 4, 2)}


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("path", list(VARLEN_PATHS))
def test_varlen(isa, rng, dtype, path):
    """Each sequence attends within itself, as if alone: against the reference (a
    loop of attention over the slices) and against attention on each slice, with
    GQA, empty query and key sequences, causal (aligned at each sequence's own
    ends), windows, softcap and ALiBi, on every kernel path."""
    lq, lk, H, threads = VARLEN_PATHS[path]
    for Hkv in sorted({H, 1}):
        q, k, v, cq, ck = packed(rng, lq, lk, H, Hkv, dtype)
        for causal in (False, True):
            out, lse = check_varlen(q, k, v, cq, ck, dtype, causal=causal, num_threads=threads)
            for b in range(len(lq)):
                rows, keys = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
                alone, alone_lse = fastattn.attention(q[rows].transpose(1, 0, 2), k[keys].transpose(1, 0, 2),
                                                      v[keys].transpose(1, 0, 2), causal=causal, return_lse=True,
                                                      enable_gqa=True)
                np.testing.assert_array_equal(np.isneginf(lse[:, rows]), np.isneginf(alone_lse))
                assert_close(out[rows], alone.transpose(1, 0, 2).astype(F64), dtype)
            if lk[-1] == 0:
                assert np.all(out[cq[-2]:] == 0) and np.all(np.isneginf(lse[:, cq[-2]:]))
        check_varlen(q, k, v, cq, ck, dtype, causal=True, window=(20, 3), num_threads=threads)
        check_varlen(q, k, v, cq, ck, dtype, causal="upper_left", window=(20, 3), num_threads=threads)
        check_varlen(q, k, v, cq, ck, dtype, softcap=2.0, alibi_slopes=rng.random(H), num_threads=threads)
        check_varlen(q, k, v, cq, ck, dtype, causal=True, alibi_slopes=rng.random((len(lq), H)),
                     num_threads=threads)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("bq,bk", [(0, 0), (16, 32), (40, 72), (7, 5)])
def test_varlen_tiles(isa, fused, tiles, rng, dtype, bq, bk):
    """Sequences that end inside a query block, at its edges, or hold one row,
    for every tile size, fused exp or not: no item reads or writes another
    sequence's rows (out= starts as NaN, and every row must come out right)."""
    tiles(bq, bk)
    lq = [39, 1, 40, 61, 0, 150, 7]
    lk = [39, 300, 41, 5, 3, 150, 7]
    q, k, v, cq, ck = packed(rng, lq, lk, 2, 2, dtype)
    check_varlen(q, k, v, cq, ck, dtype, causal=True)
    check_varlen(q, k, v, cq, ck, dtype)
    buf = np.full((8, 2, cq[-1] + 150), np.nan, dtype)
    out = buf[..., :cq[-1]].transpose(2, 1, 0)                               # any strides
    assert fastattn.attention_varlen(q, k, v, cq, ck, causal=True, out=out) is out
    assert_close(out, ref.attention_varlen(q.astype(F64), k.astype(F64), v.astype(F64), cq, ck, causal=True), dtype)
    assert np.isnan(buf[..., cq[-1]:]).all()          # nothing written past the last sequence's rows


def test_varlen_core_refuses_a_mask(rng):
    """The C core takes no mask with packed sequences: an error, not a misread mask."""
    q, k, v = rand(rng, (1, 4, 8)), rand(rng, (1, 4, 8)), rand(rng, (1, 4, 8))
    out, starts = np.empty((1, 4, 8), F32), np.zeros(1, np.int64)
    with pytest.raises(ValueError, match="rejected its arguments"):
        _core.attention(q, k, v, np.ones((4, 4), np.uint8), _core.MASK_BOOL, out, None, (1,), False, 1.0, 1,
                        q_start=starts, kv_start=starts)
    _core.attention(q, k, v, None, _core.MASK_NONE, out, None, (1,), False, 1.0, 1, q_start=starts, kv_start=starts)
    assert_close(out, ref.attention(q.astype(F64), k.astype(F64), v.astype(F64), scale=1.0), F32)


def test_varlen_layouts_and_dtypes(rng):
    """Views of one packed qkv buffer (strided rows, read in place), a
    non-contiguous last axis (copied), float16 and integer inputs (computed in
    float32 and float64), out= through a temporary (float16, or overlapping q),
    and empty batches."""
    lq = [5, 9, 2]
    cq = np.cumsum([0] + lq)
    qkv = rand(rng, (cq[-1], 3, 4, 16))                                   # (T, 3, H, d)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    out = check_varlen(q, k, v, cq, cq, F32, causal=True)[0]
    check_varlen(np.asfortranarray(q), k, v, cq, cq, F32, causal=True)
    q16, k16, v16 = q.astype(np.float16), k.astype(np.float16), v.astype(np.float16)
    half = fastattn.attention_varlen(q16, k16, v16, cq, cq)
    assert half.dtype == np.float16
    assert_close(half, ref.attention_varlen(q16.astype(F64), k16.astype(F64), v16.astype(F64), cq, cq), np.float16)
    out16 = np.empty(half.shape, np.float16)                              # written through a float32 temporary
    assert fastattn.attention_varlen(q16, k16, v16, cq, cq, out=out16) is out16
    np.testing.assert_array_equal(out16, half)
    ints = fastattn.attention_varlen(np.ones((3, 2, 4), int), np.ones((3, 1, 4), int), np.arange(3)[:, None, None] *
                                     np.ones((3, 1, 2), int), [0, 1, 3], [0, 2, 3])
    assert ints.dtype == F64 and np.allclose(ints[:, 0, 0], [0.5, 2, 2])
    inplace = qkv[:, 0].copy()                                            # out= overlapping q: a temporary
    assert fastattn.attention_varlen(inplace, k, v, cq, cq, causal=True, out=inplace) is inplace
    np.testing.assert_array_equal(inplace, out)
    empty, lse = fastattn.attention_varlen(np.ones((0, 2, 4)), np.ones((0, 1, 4)), np.ones((0, 1, 3)), [0], [0],
                                           return_lse=True)
    assert empty.shape == (0, 2, 3) and lse.shape == (2, 0)
    out, lse = fastattn.attention_varlen(np.ones((4, 2, 4)), np.ones((0, 1, 4)), np.ones((0, 1, 3)), [0, 4],
                                         [0, 0], return_lse=True)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


@pytest.mark.parametrize("rows_max", [0, 1, 24])
def test_varlen_mixed_prefill_and_decode(isa, rng, rows_max, force):
    """A serving batch: one prefill chunk beside decoding sequences with long caches.
    The longest sequence takes the tiled kernel; the short ones' items the row
    kernel (up to rows_max rows: forced to 1 and 24, and the default)."""
    force.set(rows_max=rows_max)
    try:
        for H, Hkv in ((4, 4), (4, 2)):
            q, k, v, cq, ck = packed(rng, [200, 1, 3, 1, 0, 30], [200, 1500, 700, 0, 9, 30], H, Hkv, F32)
            for causal in (True, "upper_left"):
                check_varlen(q, k, v, cq, ck, F32, causal=causal)
            check_varlen(q, k, v, cq, ck, F32, window=(100, 0), softcap=4.0, num_threads=1)
    finally:
        force.set(rows_max=0)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_varlen_short_sequences_take_the_kernel_a_call_would(isa, rng, dtype, force):
    """Beside a long sequence (the tiled kernel), each short one takes the kernel a
    call of its own would (test_attention.py: rows_limits): its rows are
    bitwise those of that kernel, forced, and all agree with the reference."""
    from test_attention import rows_limits
    lq, lk = [200, 16, 15, 14, 13, 5], [300, 700, 700, 700, 700, 700]
    q, k, v, cq, ck = packed(rng, lq, lk, 2, 2, dtype, d=128, dv=24)
    out, _ = check_varlen(q, k, v, cq, ck, dtype, num_threads=2)
    forced = {}
    try:
        for n in (1, 24):
            force.set(rows_max=n)
            forced[n] = fastattn.attention_varlen(q, k, v, cq, ck, num_threads=2)
    finally:
        force.set(rows_max=0)
    limit, full = rows_limits(dtype, 2)
    for b, n in enumerate(lq[1:], 1):
        few = n <= limit and not (full and full[0] <= n <= full[1])
        rows = slice(cq[b], cq[b + 1])
        assert not np.array_equal(forced[1][rows], forced[24][rows])
        np.testing.assert_array_equal(out[rows], forced[24 if few else 1][rows], err_msg=f"{n} rows")


def test_varlen_decode_folds_heads(rng, core_calls):
    """Decoding with GQA (one query a sequence): one C call with leading dims
    (B, H_kv), each item the G query heads of a group as rows (row_group G); with
    ALiBi (slopes per head) or more queries, one item per head."""
    q, k, v, cq, ck = packed(rng, [1, 1, 1], [40, 0, 300], 8, 2, F32)
    check_varlen(q, k, v, cq, ck, F32, causal=True)
    assert core_calls[-1][0] == (3, 2) and core_calls[-1][2] == 4
    check_varlen(q, k, v, cq, ck, F32, alibi_slopes=rng.random(8))
    assert core_calls[-1][0] == (3, 2, 4) and core_calls[-1][2] == 1
    q, k, v, cq, ck = packed(rng, [1, 2, 1], [40, 9, 300], 8, 2, F32)
    check_varlen(q, k, v, cq, ck, F32, causal=True)
    assert core_calls[-1][0] == (3, 2, 4) and core_calls[-1][2] == 1


@pytest.mark.parametrize("change,exc,msg", [
    (dict(q=np.ones((5, 16))), ValueError, r"q must have shape \(total_q, H, d_k\)"),
    (dict(v=np.ones((7, 2, 8, 1))), ValueError, r"v must have shape"),
    (dict(k=np.ones((7, 2, 8))), ValueError, "d_k differs"),
    (dict(v=np.ones((6, 2, 8))), ValueError, "same rows and heads"),
    (dict(k=np.ones((7, 3, 16)), v=np.ones((7, 3, 8))), ValueError, r"query heads \(4\) must be a multiple"),
    (dict(cq=[0, 2.0, 5]), TypeError, "cu_seqlens_q must be integers"),
    (dict(cq=None), TypeError, "cu_seqlens_q must be an array"),
    (dict(cq=[[0, 2, 5]]), ValueError, "cu_seqlens_q must be 1-D"),
    (dict(cq=[]), ValueError, "cu_seqlens_q must be 1-D"),
    (dict(cq=[1, 2, 5]), ValueError, "must start at 0, got 1"),
    (dict(cq=[0, 3, 2, 5]), ValueError, "non-decreasing, got 3 then 2 at index 1"),
    (dict(cq=[0, 2, 6]), ValueError, r"end at the number of packed rows of q \(5\), got 6"),
    (dict(ck=[0, 7]), ValueError, "different numbers of sequences: 2 and 1"),
    (dict(ck=[0, 3, 8]), ValueError, r"rows of k and v \(7\)"),
    (dict(alibi_slopes=np.ones(3)), ValueError, r"does not broadcast to \(B, H\) = \(2, 4\)"),
    (dict(alibi_slopes=np.ones(4, complex)), TypeError, "alibi_slopes must be real"),
    (dict(out=np.ones((5, 4, 7), F32)), ValueError, "out has shape"),
    (dict(out=np.ones((5, 4, 8), np.int64)), TypeError, "out has dtype int64"),
    (dict(q=np.ones((5, 4, 16), complex)), TypeError, "q has dtype complex128"),
    (dict(num_threads=0), ValueError, "num_threads"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(window=(1, 2, 3)), ValueError, "window"),
    (dict(max_seqlen_q=2), ValueError, r"max_seqlen_q=2 is shorter than the longest sequence of q \(3 rows\)"),
    (dict(max_seqlen_k=3), ValueError, r"max_seqlen_k=3 is shorter than the longest sequence of k and v \(4 rows\)"),
    (dict(max_seqlen_q=3.0), TypeError, "max_seqlen_q must be None or an int, got float"),
    (dict(max_seqlen_k=True), TypeError, "max_seqlen_k must be None or an int, got a bool"),
])
def test_varlen_errors(change, exc, msg):
    args = dict(q=np.ones((5, 4, 16), F32), k=np.ones((7, 2, 16), F32), v=np.ones((7, 2, 8), F32),
                cq=[0, 2, 5], ck=[0, 3, 7])
    args.update(change)
    q, k, v, cq, ck = (args.pop(n) for n in ("q", "k", "v", "cq", "ck"))
    with pytest.raises(exc, match=msg):
        fastattn.attention_varlen(q, k, v, cq, ck, **args)


def test_varlen_takes_flash_attn_max_seqlen(rng):
    """flash_attn_varlen_func's positional max_seqlen_q and max_seqlen_k (the
    longest sequences, or more; numpy ints too) carry over and change nothing."""
    q, k, v = rand(rng, (9, 4, 16)), rand(rng, (12, 2, 16)), rand(rng, (12, 2, 8))
    cq, ck = np.array([0, 2, 2, 9], np.int32), np.array([0, 5, 7, 12], np.int32)
    want = fastattn.attention_varlen(q, k, v, cq, ck, causal=True)
    for mq, mk in ((7, 5), (np.int32(7), np.int64(5)), (100, 6), (None, 5), (7, None)):
        out = fastattn.attention_varlen(q, k, v, cq, ck, mq, mk, causal=True)
        np.testing.assert_array_equal(out, want)
        out = fastattn.attention_varlen(q, k, v, cq, ck, max_seqlen_q=mq, max_seqlen_k=mk, causal=True)
        np.testing.assert_array_equal(out, want)


# ---------------------------------------------------------------------------
# attention_weights
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(7, 2)), dict(softcap=2.0),
                                dict(alibi_slopes=np.array([0.5, 0.25])), dict(kv_lengths=np.array([[40], [13]])),
                                dict(causal=True, window=(20, 0), softcap=3.0)])
def test_attention_weights(isa, rng, dtype, kw):
    q, k = rand(rng, (2, 2, 70, 16), dtype), rand(rng, (2, 2, 90, 16), dtype)
    mask = rng.random((70, 90)) < 0.8
    mask[3] = False
    w = fastattn.attention_weights(q, k, mask=mask, **kw)
    assert w.shape == (2, 2, 70, 90) and w.dtype == dtype
    want = ref.attention_weights(q.astype(F64), k.astype(F64), mask=mask, **kw)
    assert_close(w, want, dtype)
    sums = w.astype(F64).sum(-1)
    visible = want.sum(-1) > 0
    assert_close(sums[visible], np.ones(visible.sum()), dtype)
    assert np.all(w[..., 3, :] == 0)


def test_attention_weights_gqa_1d_and_float_mask(rng):
    q, k = rand(rng, (2, 6, 5, 8)), rand(rng, (2, 3, 11, 8))
    w = fastattn.attention_weights(q, k, enable_gqa=True)
    assert w.shape == (2, 6, 5, 11)
    assert_close(w, ref.attention_weights(q.astype(F64), k.astype(F64), enable_gqa=True), F32)
    w1 = fastattn.attention_weights(rand(rng, (8,)), rand(rng, (11, 8)), mask=np.arange(11) < 6)
    assert w1.shape == (11,) and np.all(w1[6:] == 0) and abs(w1.sum() - 1) < 1e-6
    fm = rng.standard_normal((5, 11)).astype(F32)
    assert_close(fastattn.attention_weights(q, np.repeat(k, 2, axis=1), mask=fm),
                 ref.attention_weights(q.astype(F64), np.repeat(k, 2, axis=1).astype(F64), mask=fm.astype(F64)), F32)


def test_weights_times_v_is_attention(rng):
    q, k, v = rand(rng, (3, 40, 8), F64), rand(rng, (3, 60, 8), F64), rand(rng, (3, 60, 5), F64)
    w = fastattn.attention_weights(q, k, causal=True)
    assert_close(w @ v, fastattn.attention(q, k, v, causal=True), F64)


# ---------------------------------------------------------------------------
# merge_attention
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("cuts", [[], [70], [30, 100], [0, 50, 50, 130]])
def test_merge(rng, dtype, cuts):
    """Attention over 1, 2, 3 (and an empty) key parts, merged, equals attention over all keys."""
    q, k, v = rand(rng, (2, 20, 8), dtype), rand(rng, (2, 130, 8), dtype), rand(rng, (2, 130, 4), dtype)
    bounds = [0] + cuts + [130]
    parts = [fastattn.attention(q, k[:, a:b], v[:, a:b], return_lse=True, causal=False)
             for a, b in zip(bounds[:-1], bounds[1:])]
    out, lse = fastattn.merge_attention([p[0] for p in parts], [p[1] for p in parts])
    want, want_lse = ref.attention(q.astype(F64), k.astype(F64), v.astype(F64), return_lse=True)
    assert out.dtype == dtype
    assert_close(out, want, dtype)
    assert_close(lse, want_lse, dtype, "lse")
    rout, rlse = ref.merge_attention([p[0] for p in parts], [p[1] for p in parts])
    assert_close(out, rout, dtype)
    assert_close(lse, rlse, dtype, "lse")


def test_merge_masked_parts(rng):
    q, k, v = rand(rng, (6, 8)), rand(rng, (40, 8)), rand(rng, (40, 4))
    mask = np.ones((6, 40), bool)
    mask[0, :20] = False        # row 0 sees nothing in part 1
    mask[1] = False             # row 1 sees nothing at all
    o1, l1 = fastattn.attention(q, k[:20], v[:20], mask=mask[:, :20], return_lse=True)
    o2, l2 = fastattn.attention(q, k[20:], v[20:], mask=mask[:, 20:], return_lse=True)
    o1[0] = np.nan              # a part with lse = -inf contributes nothing, even NaN
    out, lse = fastattn.merge_attention([o1, o2], [l1, l2])
    want, want_lse = ref.attention(q.astype(F64), k.astype(F64), v.astype(F64), mask=mask, return_lse=True)
    assert_close(out, want, F32)
    assert_close(lse, want_lse, F32)
    assert np.all(out[1] == 0) and np.isneginf(lse[1])


@pytest.mark.parametrize("dtype", [F32, F64])
def test_merge_underflowed_part_keeps_nonfinite(rng, dtype):
    """A part whose weight underflows to 0 next to another still saw its keys:
    its inf and NaN reach the merged result, as in attention() over all keys."""
    d = 8
    q = rand(rng, (3, d), dtype)
    q[:, 0] = 1 + np.abs(q[:, 0])
    k, v = rand(rng, (40, d), dtype), rand(rng, (40, 4), dtype)
    k[3] = 0
    k[3, 0] = 1000 * np.sqrt(d)                # part 1 holds a key scored >= 1000 above the rest
    v[25, 1], v[30, 2] = np.inf, np.nan        # part 2: weight 0 after the merge
    o1, l1 = fastattn.attention(q, k[:20], v[:20], return_lse=True)
    o2, l2 = fastattn.attention(q, k[20:], v[20:], return_lse=True)
    out, lse = fastattn.merge_attention([o1, o2], [l1, l2])
    whole = fastattn.attention(q, k, v)
    want = ref.attention(q.astype(F64), k.astype(F64), v.astype(F64))
    assert np.isposinf(out[:, 1]).all() and np.isnan(out[:, 2]).all()
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(want))
    np.testing.assert_array_equal(np.isfinite(whole), np.isfinite(want))
    assert_close(out[:, [0, 3]], want[:, [0, 3]], dtype)


def test_merge_errors(rng):
    o, lse = rand(rng, (3, 4)), rand(rng, (3,))
    with pytest.raises(ValueError, match="at least one"):
        fastattn.merge_attention([], [])
    with pytest.raises(ValueError, match="outputs but"):
        fastattn.merge_attention([o, o], [lse])
    with pytest.raises(ValueError, match="lse 0 has shape"):
        fastattn.merge_attention([o], [rand(rng, (4,))])
    with pytest.raises(ValueError, match="output 1 has shape"):
        fastattn.merge_attention([o, rand(rng, (3, 5))], [lse, lse])


@pytest.mark.parametrize("dtype", [F32, F64])
def test_merge_layout_blhd(rng, dtype):
    """Split keys in flash-attn's layout: attention(layout="blhd") gives (B, n, H, d)
    outputs and (B, H, n) lse, which merge_attention(layout="blhd") merges into the
    attention over all keys, in that layout; the reference does the same."""
    B, H, nq, nk = 2, 3, 17, 90
    q, k, v = rand(rng, (B, nq, H, 8), dtype), rand(rng, (B, nk, H, 8), dtype), rand(rng, (B, nk, H, 5), dtype)
    parts = [fastattn.attention(q, k[:, a:b], v[:, a:b], layout="blhd", return_lse=True)
             for a, b in ((0, 40), (40, 41), (41, nk))]
    outs, lses = [p[0] for p in parts], [p[1] for p in parts]
    out, lse = fastattn.merge_attention(outs, lses, layout="blhd")
    assert out.shape == (B, nq, H, 5) and out.flags.c_contiguous and lse.shape == (B, H, nq)
    c = lambda a: a.astype(F64)  # noqa: E731
    want, want_lse = ref.attention(c(q), c(k), c(v), layout="blhd", return_lse=True)
    assert want.shape == (B, nq, H, 5)
    assert_close(out, want, dtype)
    assert_close(lse, want_lse, dtype, "lse")
    whole = fastattn.attention(q, k, v, layout="blhd")
    assert_close(out, whole, dtype)
    rout, rlse = ref.merge_attention(outs, lses, layout="blhd")
    assert_close(out, rout, dtype)
    assert_close(lse, rlse, dtype, "lse")
    with pytest.raises(ValueError, match=r'lse 1 has shape \(2, 17, 3\); with layout="blhd" it must be the '
                                         r"output's \(\.\.\., H, n_q\), \(2, 3, 17\)"):
        fastattn.merge_attention(outs, [lses[0], np.swapaxes(lses[1], 1, 2), lses[2]], layout="blhd")
    with pytest.raises(ValueError, match=r"output 2 has shape \(2, 17, 3, 4\), output 0 has shape \(2, 17, 3, 5\)"):
        fastattn.merge_attention([outs[0], outs[1], outs[2][..., :4]], lses, layout="blhd")
    with pytest.raises(ValueError, match=r'layout="blhd" takes output 0 of shape \(\.\.\., n, H, d\)'):
        fastattn.merge_attention([o[0, :, 0] for o in outs], [x[0, 0] for x in lses], layout="blhd")
    with pytest.raises(ValueError, match="layout must be"):
        fastattn.merge_attention(outs, lses, layout="bshd")


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


# ---------------------------------------------------------------------------
# layers
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, F64])
def test_self_attention(rng, dtype):
    x = rand(rng, (2, 13, 24), dtype)
    wq, wk, wv = rand(rng, (24, 16), dtype, 0.3), rand(rng, (24, 16), dtype, 0.3), rand(rng, (24, 10), dtype, 0.3)
    biases = dict(b_q=rand(rng, (16,), dtype), b_k=rand(rng, (16,), dtype), b_v=rand(rng, (10,), dtype))
    c = lambda a: a.astype(F64)  # noqa: E731
    for kw in (dict(), dict(causal=True), dict(mask=rng.random((13, 13)) < 0.7, scale=0.5),
               dict(biases, causal=True), dict(b_v=biases["b_v"])):
        got = fastattn.self_attention(x, wq, wk, wv, **kw)
        assert got.shape == (2, 13, 10) and got.dtype == dtype
        kw64 = {n: c(a) if n.startswith("b_") else a for n, a in kw.items()}
        assert_close(got, ref.self_attention(c(x), c(wq), c(wk), c(wv), **kw64), dtype)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (4, 1), (3, None)])
def test_multihead_attention(rng, dtype, H, Hkv):
    d_head, d_model = 6, 20
    x = rand(rng, (2, 11, d_model), dtype)
    kv = Hkv or H
    wq, wo = rand(rng, (d_model, H * d_head), dtype, 0.3), rand(rng, (H * d_head, d_model), dtype, 0.3)
    wk, wv = rand(rng, (d_model, kv * d_head), dtype, 0.3), rand(rng, (d_model, kv * d_head), dtype, 0.3)
    c = lambda a: a.astype(F64)  # noqa: E731
    biases = dict(b_q=rand(rng, (H * d_head,), dtype), b_k=rand(rng, (kv * d_head,), dtype),
                  b_v=rand(rng, (kv * d_head,), dtype), b_o=rand(rng, (d_model,), dtype))
    for kw in (dict(), dict(causal=True), dict(mask=rng.random((H, 11, 11)) < 0.7), dict(biases, causal=True),
               dict(b_k=biases["b_k"], b_o=biases["b_o"])):
        got = fastattn.multihead_attention(x, wq, wk, wv, wo, num_heads=H, num_kv_heads=Hkv, **kw)
        assert got.shape == (2, 11, d_model) and got.dtype == dtype
        kw64 = {n: c(a) if n.startswith("b_") else a for n, a in kw.items()}
        want = ref.multihead_attention(c(x), c(wq), c(wk), c(wv), c(wo), num_heads=H, num_kv_heads=Hkv, **kw64)
        assert_close(got, want, dtype)
    if Hkv is None:   # the biases are those of y = x W + b, per head: two heads' columns swapped swap their outputs
        p = np.r_[d_head:2 * d_head, 0:d_head, 2 * d_head:H * d_head]
        got = fastattn.multihead_attention(x, wq, wk, wv, wo, num_heads=H, **biases)
        swapped = dict(biases, b_q=biases["b_q"][p], b_k=biases["b_k"][p], b_v=biases["b_v"][p])
        assert_close(fastattn.multihead_attention(x, wq[:, p], wk[:, p], wv[:, p], wo[p], num_heads=H, **swapped),
                     got.astype(F64), dtype)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_layers_seq_lengths(rng, dtype):
    """A right-padded batch through the layers: each sequence's real tokens as if it
    were alone (the padding neither seen nor changing anything), padding tokens zero;
    against the reference, with GQA, causal or not, per-batch and scalar lengths."""
    n, d_model, H, d_head = 40, 24, 4, 6
    x = rand(rng, (3, n, d_model), dtype)
    lengths = np.array([40, 17, 0])
    wq, wo = rand(rng, (d_model, H * d_head), dtype, 0.3), rand(rng, (H * d_head, d_model), dtype, 0.3)
    wk, wv = rand(rng, (d_model, 2 * d_head), dtype, 0.3), rand(rng, (d_model, 2 * d_head), dtype, 0.3)
    c = lambda a: np.asarray(a).astype(F64)  # noqa: E731
    xp = x.copy()
    for b, m in enumerate(lengths):
        xp[b, m:] = np.nan                                 # padding tokens are never read
    b_o = rand(rng, (d_model,), dtype)
    for causal in (False, True):
        got = fastattn.multihead_attention(xp, wq, wk, wv, wo, num_heads=H, num_kv_heads=2, causal=causal,
                                           seq_lengths=lengths)
        want = ref.multihead_attention(c(x), c(wq), c(wk), c(wv), c(wo), num_heads=H, num_kv_heads=2,
                                       causal=causal, seq_lengths=lengths)
        assert_close(got, want, dtype)
        got_b = fastattn.multihead_attention(xp, wq, wk, wv, wo, num_heads=H, num_kv_heads=2, causal=causal,
                                             seq_lengths=lengths, b_o=b_o, b_v=wv[0])
        want_b = ref.multihead_attention(c(x), c(wq), c(wk), c(wv), c(wo), num_heads=H, num_kv_heads=2,
                                         causal=causal, seq_lengths=lengths, b_o=c(b_o), b_v=c(wv[0]))
        assert_close(got_b, want_b, dtype)
        got_v = fastattn.multihead_attention(xp, wq, wk, wv, wo, num_heads=H, num_kv_heads=2, causal=causal,
                                             seq_lengths=lengths, b_v=wv[0])
        for b, m in enumerate(lengths):   # the output bias on real tokens only
            assert np.all(got_b[b, m:] == 0)
            assert_close(got_b[b, :m], got_v[b, :m].astype(F64) + c(b_o), dtype)
        one = fastattn.self_attention(xp, wq, wo.T, wv, causal=causal, seq_lengths=lengths)
        assert_close(one, ref.self_attention(c(x), c(wq), c(wo.T), c(wv), causal=causal, seq_lengths=lengths), dtype)
        for b, m in enumerate(lengths):
            alone = fastattn.multihead_attention(x[b, :m], wq, wk, wv, wo, num_heads=H, num_kv_heads=2, causal=causal)
            assert_close(got[b, :m], alone.astype(F64), dtype)
            assert np.all(got[b, m:] == 0) and np.all(one[b, m:] == 0)
    got = fastattn.self_attention(x, wq, wo.T, wv, seq_lengths=9)          # a scalar: every sequence
    assert_close(got, ref.self_attention(c(x), c(wq), c(wo.T), c(wv), seq_lengths=9), dtype)


@pytest.mark.parametrize("lengths,exc,msg", [
    (np.array([3, 4]), ValueError, r"seq_lengths of shape \(2,\) does not broadcast to x's leading dims \(3,\)"),
    (np.array([3, 4, 9]), ValueError, r"seq_lengths must lie in \[0, n=8\]"),
    (np.array([3.0, 4, 5]), TypeError, "seq_lengths must be integers"),
])
def test_layers_seq_lengths_errors(lengths, exc, msg):
    x, w = np.ones((3, 8, 4)), np.ones((4, 4))
    with pytest.raises(exc, match=msg):
        fastattn.self_attention(x, w, w, w, seq_lengths=lengths)
    with pytest.raises(exc, match=msg):
        fastattn.multihead_attention(x, w, w, w, w, num_heads=2, seq_lengths=lengths)


@pytest.mark.parametrize("change,exc,msg", [
    (dict(x=np.ones(20)), ValueError, "x must have shape"),
    (dict(w_q=np.ones((19, 24))), ValueError, "w_q has 19 rows"),
    (dict(w_q=np.ones((20, 23))), ValueError, "not a multiple of num_heads"),
    (dict(w_k=np.ones((20, 24))), ValueError, "w_k has 24 columns"),
    (dict(w_v=np.ones((20, 12, 1))), ValueError, "2-D"),
    (dict(w_o=np.ones((24, 21))), ValueError, "w_o has 21 columns"),
    (dict(num_heads=0), ValueError, "positive"),
    (dict(num_kv_heads=3), ValueError, "multiple of num_kv_heads"),
    (dict(num_heads=2.0), TypeError, "num_heads must be an int"),
])
def test_multihead_errors(change, exc, msg):
    args = dict(x=np.ones((5, 20)), w_q=np.ones((20, 24)), w_k=np.ones((20, 12)), w_v=np.ones((20, 12)),
                w_o=np.ones((24, 20)), num_heads=4, num_kv_heads=2)
    args.update(change)
    with pytest.raises(exc, match=msg):
        fastattn.multihead_attention(args.pop("x"), args.pop("w_q"), args.pop("w_k"), args.pop("w_v"),
                                     args.pop("w_o"), **args)


@pytest.mark.parametrize("name,shape,msg", [
    ("b_q", (23,), r"b_q has shape \(23,\); it must be \(24,\), as w_q has 24 columns"),
    ("b_k", (24,), r"b_k has shape \(24,\); it must be \(12,\)"),
    ("b_v", (1, 12), r"b_v has shape \(1, 12\)"),
    ("b_o", (24,), r"b_o has shape \(24,\); it must be \(20,\), as w_o has 20 columns"),
])
def test_layer_bias_errors(name, shape, msg):
    args = dict(w_q=np.ones((20, 24)), w_k=np.ones((20, 12)), w_v=np.ones((20, 12)), w_o=np.ones((24, 20)))
    with pytest.raises(ValueError, match=msg):
        fastattn.multihead_attention(np.ones((5, 20)), *args.values(), num_heads=4, num_kv_heads=2,
                                     **{name: np.ones(shape)})
    if name != "b_o":
        with pytest.raises(ValueError, match=name + " has shape"):
            fastattn.self_attention(np.ones((5, 20)), np.ones((20, 12)), np.ones((20, 12)), np.ones((20, 12)),
                                    **{name: np.ones((13,))})
    with pytest.raises(TypeError, match=name):
        fastattn.multihead_attention(np.ones((5, 20)), *args.values(), num_heads=4, num_kv_heads=2,
                                     **{name: np.ones(shape, complex)})


def test_layers_num_threads(rng):
    """num_threads reaches the attention (the call's team), with the same result."""
    x = rand(rng, (4, 256, 64))
    w = [rand(rng, (64, 64), F32, 0.2) for _ in range(4)]
    for nt in (1, 2):
        got = fastattn.multihead_attention(x, *w, num_heads=4, causal=True, num_threads=nt)
        assert _core.last_threads() == (nt if _core.openmp_enabled() else 1)
        want = ref.multihead_attention(x.astype(F64), *(a.astype(F64) for a in w), num_heads=4, causal=True)
        assert_close(got, want, F32)
        one = fastattn.self_attention(x, *w[:3], causal=True, num_threads=nt)
        assert _core.last_threads() == (nt if _core.openmp_enabled() else 1)
        assert_close(one, ref.self_attention(x.astype(F64), *(a.astype(F64) for a in w[:3]), causal=True), F32)
    for bad in (0, 1.5):
        with pytest.raises((ValueError, TypeError), match="num_threads"):
            fastattn.multihead_attention(x, *w, num_heads=4, num_threads=bad)
        with pytest.raises((ValueError, TypeError), match="num_threads"):
            fastattn.self_attention(x, *w[:3], num_threads=bad)


def test_self_attention_errors():
    with pytest.raises(ValueError, match="w_k has 5 columns"):
        fastattn.self_attention(np.ones((3, 4)), np.ones((4, 6)), np.ones((4, 5)), np.ones((4, 2)))
    with pytest.raises(ValueError, match="w_v has 3 rows"):
        fastattn.self_attention(np.ones((3, 4)), np.ones((4, 6)), np.ones((4, 6)), np.ones((3, 2)))


def test_gqa_reads_kv_in_place(rng):
    """K and V reach the kernel as views with a size-1 (broadcast) group axis: no copy, no repeat."""
    from fastattn._prepare import _prepare
    q, k, v = rand(rng, (2, 8, 5, 16)), rand(rng, (2, 2, 7, 16)), rand(rng, (2, 2, 7, 16))
    p = _prepare(q, k, v, None, False, None, True, None, None, None, None, None)
    assert p.lead == (2, 2, 4)
    for given, seen in ((k, p.k), (v, p.v)):
        assert np.shares_memory(given, seen) and seen.shape[-3] == 1   # size 1: broadcast (stride 0)
    assert np.shares_memory(q, p.q)


@pytest.fixture
def core_calls(monkeypatch):
    """The (lead, q shape, row_group) of each call into the C core."""
    calls = []
    real = _core.attention

    def spy(q, k, v, mask, mask_kind, out, lse, lead, causal, *rest, **kw):
        calls.append((lead, q.shape, rest[8] if len(rest) > 8 else kw.get("row_group", 1)))
        return real(q, k, v, mask, mask_kind, out, lse, lead, causal, *rest, **kw)

    monkeypatch.setattr(_core, "attention", spy)
    return calls


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("hkv", [1, 2, 4])
@pytest.mark.parametrize("nq", [1, 3, 8])
@pytest.mark.parametrize("nk, threads", [(1, 1), (300, 2), (2100, 1), (2100, 2)])
def test_gqa_decode_folds_heads(isa, rng, core_calls, dtype, hkv, nq, nk, threads):
    """GQA decoding (1 to 8 query rows per head): the query heads of a group
    reach the kernel as the n_q * g rows of one item over their K and V (lead
    (B, Hkv), position-major, row_group g), with causal, bool and float masks of
    every head and row layout alone and with causal, kv_lengths per batch and
    scalar, windows, softcap, out= of any layout and return_lse; against the reference.
    From 1 to 64 rows (the row kernel and the tiled one), split keys on 2
    threads."""
    g = 8 // hkv
    q = rand(rng, (2, 8, nq, 16), dtype)
    k, v = rand(rng, (2, hkv, nk, 16), dtype), rand(rng, (2, hkv, nk, 12), dtype)
    kw = dict(enable_gqa=True, num_threads=threads)
    fmask = np.where(rng.random((8, 1, nk)) < 0.3, -np.inf, rng.standard_normal((8, 1, nk)))
    fmask[:, :, 0] = 0.0
    fmask_rows = rng.standard_normal((2, 8, nq, nk)).astype(dtype)
    for extra in (dict(), dict(causal=True), dict(mask=rng.random(nk) < 0.6),
                  dict(mask=rng.random((2, 1, 1, nk)) < 0.6), dict(mask=rng.random((2, 8, 1, nk)) < 0.6),
                  dict(mask=rng.random((nq, nk)) < 0.6), dict(mask=rng.random((2, 8, nq, nk)) < 0.6),
                  dict(mask=rng.random((2, 1, nq, nk)) < 0.6, causal=True),
                  dict(mask=rng.random((8, 1, nk)) < 0.6, causal=True),
                  dict(mask=fmask), dict(mask=fmask, causal=True), dict(mask=fmask_rows, causal=True),
                  dict(kv_lengths=rng.integers(0, nk + 1, (2, 1))),
                  dict(kv_lengths=rng.integers(0, nk + 1, (2, 1)), causal=True),
                  dict(kv_lengths=np.array(nk // 2), causal=True), dict(softcap=2.0, causal=True),
                  dict(window=(100, 0)), dict(window=(2, 1), kv_lengths=rng.integers(0, nk + 1, (2, 1))),
                  dict(causal=True, window=(50, None), mask=rng.random((2, 1, nq, nk)) < 0.6),
                  dict(q_lengths=rng.integers(0, nq + 1, (2, 1)), causal=True),
                  dict(q_lengths=np.array(nq - 1), kv_lengths=rng.integers(0, nk + 1, (2, 1)), causal=True)):
        core_calls.clear()
        check(q, k, v, dtype, **kw, **extra)
        assert core_calls == [((2, hkv), (2, hkv, nq * g, 16), g)], extra
    out = np.empty((2, 8, nq, 12), dtype)
    strided = np.zeros((2, 8, 12, nq + 2), dtype).transpose(0, 1, 3, 2)[:, :, :nq]  # (2, 8, nq, 12)
    bnhd = np.zeros((2, nq, 8, 12), dtype).transpose(0, 2, 1, 3)   # rows of a group: no view of them
    want = ref.attention(q.astype(F64), k.astype(F64), v.astype(F64), enable_gqa=True, causal=True)
    for o in (out, strided, bnhd):
        assert fastattn.attention(q, k, v, out=o, causal=True, **kw) is o
        assert_close(o, want, dtype)
    qt = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)   # (B, N, H, d) read as (B, H, N, d)
    assert_close(fastattn.attention(qt, k, v, causal=True, **kw), want, dtype)


def test_gqa_fold_broadcasts(rng, core_calls):
    """The fold (3 query rows per head) with leading dims broadcast (q or K and V
    over the batch), masks broadcast along their rows or keys, float16, more
    query rows than keys under causal (early rows see nothing) and no keys."""
    q, k, v = rand(rng, (1, 8, 3, 16)), rand(rng, (2, 2, 50, 16)), rand(rng, (2, 2, 50, 12))
    check(q, k, v, F32, enable_gqa=True, causal=True)
    check(rand(rng, (2, 8, 3, 16)), k[:1], v[:1], F32, enable_gqa=True, causal=True)
    for m in (rng.random((2, 1, 3, 1)) < 0.7, rng.random((8, 3, 1)) < 0.7, rng.random((8, 1, 50)) < 0.7):
        check(q, k, v, F32, enable_gqa=True, causal=True, mask=m)
    out = fastattn.attention(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16),
                             enable_gqa=True, causal=True)
    assert out.dtype == np.float16
    assert_close(out, ref.attention(q.astype(F64), k.astype(F64), v.astype(F64), enable_gqa=True, causal=True),
                 np.float16)
    check(rand(rng, (2, 8, 7, 16)), k[:, :, :4], v[:, :, :4], F32, enable_gqa=True, causal=True)
    out, lse = fastattn.attention(q, k[:, :, :0], v[:, :, :0], enable_gqa=True, causal=True, return_lse=True)
    assert (out == 0).all() and np.isneginf(lse).all()
    assert [call[2] for call in core_calls] == [4] * 8   # every call folded (row_group 4)


def test_gqa_decode_fold_many_rows_and_exclusions(rng, core_calls):
    """32 query heads on one K and V fold into 32 rows (the tiled kernel, keys
    split on 2 threads).  What the rows of a group would not share stays one
    item per head: ALiBi slopes, kv_lengths or q_lengths per head, more than 8
    query rows over small K and V, the weights."""
    fold_rows = _core.isa_table()["fold_rows"]
    q, k, v = rand(rng, (1, 32, 1, 16)), rand(rng, (1, 1, 2100, 16)), rand(rng, (1, 1, 2100, 16))
    check(q, k, v, F32, enable_gqa=True, num_threads=2)
    assert core_calls == [((1, 1), (1, 1, 32, 16), 32)]
    q, k, v = rand(rng, (2, 8, 2, 16)), rand(rng, (2, 2, 300, 16)), rand(rng, (2, 2, 300, 12))
    q9 = rand(rng, (2, 8, fold_rows + 1, 16))
    for qq, extra in ((q, dict(alibi_slopes=rng.random(8))),
                      (q, dict(kv_lengths=rng.integers(0, 301, (2, 8)))), (q9, dict(causal=True)), (q9, dict()),
                      (q, dict(q_lengths=np.array([[1, 2, 0, 2, 1, 1, 2, 2], [2] * 8]), causal=True))):
        core_calls.clear()
        check(qq, k, v, F32, enable_gqa=True, **extra)
        assert core_calls == [((2, 2, 4), qq.shape[:1] + (2, 4) + qq.shape[2:], 1)]
    core_calls.clear()
    w = fastattn.attention_weights(q, k, enable_gqa=True)
    assert_close(w, ref.attention_weights(q.astype(F64), k.astype(F64), enable_gqa=True), F32)
    assert core_calls[0][:2] == ((2, 2, 4), (2, 2, 4, 2, 16))


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("nq", [9, 12, 13])
def test_gqa_fold_up_to_12_rows_with_large_kv(isa, rng, core_calls, dtype, nq):
    """9 to 12 query rows per head fold too (the SIMD path's fold_rows_big) where K
    and V hold at least fold_big_bytes (4 MiB), on the avx512 and avx2 paths (not
    the portable one); 13 rows, or K and V one key short, stay one item per head.
    Causal or not, a bool mask, kv_lengths with a window, against the reference
    (output and lse).  The thresholds are the table's (_core.isa_table), checked
    against the values the tuning measured."""
    t = _core.isa_table()
    assert (t["fold_rows"], t["fold_rows_big"]) == ((8, 8) if isa == "generic" else (8, 12))
    nk = (4 << 20) // (2 * 2 * 16 * np.dtype(dtype).itemsize)   # K and V of 2 heads, d16: 4 MiB
    q = rand(rng, (1, 8, nq, 16), dtype)
    k, v = rand(rng, (1, 2, nk, 16), dtype), rand(rng, (1, 2, nk, 16), dtype)
    folded, per_head = ((1, 2), (1, 2, nq * 4, 16), 4), ((1, 2, 4), (1, 2, 4, nq, 16), 1)
    want = folded if nq <= t["fold_rows_big"] and nk * 2 * 2 * 16 * np.dtype(dtype).itemsize >= t["fold_big_bytes"] \
        else per_head
    for extra in (dict(causal=True), dict(), dict(mask=rng.random((nq, nk)) < 0.6, causal=True),
                  dict(kv_lengths=np.array([[nk - 7]]), window=(300, 0), causal=True)):
        core_calls.clear()
        check(q, k, v, dtype, enable_gqa=True, **extra)
        assert core_calls == [want], extra
    core_calls.clear()
    check(q, k[:, :, 1:], v[:, :, 1:], dtype, enable_gqa=True, causal=True)
    assert core_calls == [((1, 2, 4), (1, 2, 4, nq, 16), 1)]


# ---------------------------------------------------------------------------
# the tiling: results do not depend on the tile sizes
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("bq,bk", [(1, 1), (1, 37), (7, 5), (33, 31), (16, 32), (200, 64), (64, 1000)])
def test_tile_sizes(isa, rng, tiles, dtype, bq, bk):
    """Odd tiles: one-row and one-key tiles, tiles that do not divide the sizes,
    key tiles shorter than a 32-bit mask word, tiles larger than the problem."""
    tiles(bq, bk)
    nq, nk = 45, 130
    q, k, v = rand(rng, (2, nq, 12), dtype), rand(rng, (2, nk, 12), dtype), rand(rng, (2, nk, 7), dtype)
    mask = rng.random((nq, nk)) < 0.7
    mask[:, 40:80] = False                     # whole tiles forbidden (for small bk)
    check(q, k, v, dtype)
    check(q, k, v, dtype, causal=True, mask=mask)
    check(q, k, v, dtype, mask=rng.standard_normal((nq, nk)).astype(dtype), window=(20, 3))
    check(q, k, v, dtype, window=(20, None))   # no mask: fused tiles between the edges
    check(q, k, v, dtype, softcap=2.0, alibi_slopes=0.3, kv_lengths=np.array([100, nk]), causal=True)
    w = fastattn.attention_weights(q, k, mask=mask, causal=True)
    assert_close(w, ref.attention_weights(q.astype(F64), k.astype(F64), mask=mask, causal=True), dtype)
