"""fastattn.attention against the float64 NumPy reference."""

import ctypes
import json
import os
import subprocess
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import assert_close, rand, reference64

import fastattn
from fastattn import _core
from fastattn import reference as ref

F32, F64 = np.float32, np.float64


def check(q, k, v, dtype=None, **kw):
    """Run fastattn and the reference; compare output and lse."""
    dtype = dtype or np.result_type(q, k, v)
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    kw.pop("num_threads", None)
    want, want_lse = reference64(q, k, v, **kw)
    expect_dtype = np.result_type(q, k, v)
    if expect_dtype.kind != "f":
        expect_dtype = np.dtype(F64)
    assert out.dtype == expect_dtype
    assert_close(out, want, dtype)
    assert_close(lse, want_lse, dtype, "lse")
    return out, lse


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
# broadcasting of leading dims
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


# ---------------------------------------------------------------------------
# masks
# ---------------------------------------------------------------------------
MASK_SHAPES = [(), (37,), (1, 37), (23, 1), (23, 37), (3, 1, 37), (2, 1, 23, 37), (2, 3, 23, 37), (1, 3, 1, 1)]


@pytest.mark.parametrize("mshape", MASK_SHAPES)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("causal", [False, True])
def test_mask_broadcast(isa, mask_pack, rng, mshape, kind, causal):
    q, k, v = rand(rng, (2, 3, 23, 16)), rand(rng, (2, 3, 37, 16)), rand(rng, (2, 3, 37, 8))
    if kind == "bool":
        mask = rng.random(mshape) < 0.7
    else:
        mask = rng.standard_normal(mshape).astype(F32)
        mask[rng.random(mshape) < 0.2] = -np.inf
    check(q, k, v, mask=mask, causal=causal)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_mask_dtype_mixed(rng, dtype):
    """A float mask of another float dtype is used in the compute dtype."""
    q, k, v = (rand(rng, (2, 30, 8), dtype) for _ in range(3))
    check(q, k, v, mask=rng.standard_normal((30, 30)).astype(F64 if dtype is F32 else F32))
    check(q, k, v, mask=rng.standard_normal((30, 30)).astype(np.float16))


def test_converted_broadcast_not_expanded(rng):
    """A float64 mask broadcast over rows (key padding) or heads, with float32
    inputs, is converted one broadcast entry at a time: it stays a stride-0 view
    (not an n_q x n_k copy), and the result agrees with the reference."""
    from fastattn._validate import _as_compute
    q, k, v = rand(rng, (2, 3, 40, 8)), rand(rng, (2, 3, 50, 8)), rand(rng, (2, 3, 50, 8))
    pad = np.where(rng.random(50) < 0.8, rng.standard_normal(50), -np.inf)
    for mask in (np.broadcast_to(pad, (40, 50)), np.broadcast_to(rng.standard_normal((2, 1, 40, 50)), (2, 3, 40, 50))):
        conv = _as_compute(mask, np.dtype(F32), unit_last=False)
        assert conv.dtype == F32 and 0 in conv.strides and conv.base is not None
        assert np.array_equal(conv, mask.astype(F32))
        check(q, k, v, mask=mask)
    k64 = np.broadcast_to(rand(rng, (1, 1, 50, 8), np.float64), (2, 3, 50, 8))   # inputs alike
    conv = _as_compute(k64, np.dtype(F32))
    assert conv.strides[:2] == (0, 0) and np.array_equal(conv, k64.astype(F32))
    check(q.astype(np.float64), k64, v)


def test_mask_strided_views(mask_pack, rng):
    q, k, v = rand(rng, (2, 40, 8)), rand(rng, (2, 50, 8)), rand(rng, (2, 50, 8))
    big = rng.random((2, 100, 150)) < 0.6
    check(q, k, v, mask=big[:, ::-2][:, :40, 1::3][:, :, :50])
    check(q, k, v, mask=np.swapaxes(rng.random((2, 50, 40)) < 0.6, -1, -2))


def test_large_mask_every_tile(isa, mask_pack, rng):
    """A random N x N bool mask over several query blocks and key tiles."""
    q, k, v = (rand(rng, (1, 300, 32)) for _ in range(3))
    check(q, k, v, mask=rng.random((300, 300)) < 0.5)
    check(q, k, v, mask=rng.random((300, 300)) < 0.5, causal=True)


# ---------------------------------------------------------------------------
# fully masked rows, empty key sets
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, F64])
def test_fully_masked_rows(isa, rng, dtype):
    q, k, v = rand(rng, (2, 70, 16), dtype), rand(rng, (2, 300, 16), dtype), rand(rng, (2, 300, 16), dtype)
    mask = rng.random((70, 300)) < 0.5
    mask[[0, 5, 69]] = False
    out, lse = check(q, k, v, mask=mask)
    assert np.all(out[:, [0, 5, 69]] == 0) and np.all(np.isneginf(lse[:, [0, 5, 69]]))
    fmask = np.where(mask, 0.0, -np.inf).astype(dtype)
    out2, lse2 = check(q, k, v, mask=fmask)
    assert np.all(out2[:, [0, 5, 69]] == 0) and np.all(np.isneginf(lse2[:, [0, 5, 69]]))


def test_causal_more_queries_than_keys(isa, rng):
    """Bottom-right alignment: the first n_q - n_k rows see no key."""
    q, k, v = rand(rng, (100, 8)), rand(rng, (30, 8)), rand(rng, (30, 8))
    out, lse = check(q, k, v, causal=True)
    assert np.all(out[:70] == 0) and np.all(np.isneginf(lse[:70]))
    assert np.all(np.isfinite(lse[70:]))


def test_causal_alignment_is_bottom_right(rng):
    q, k, v = rand(rng, (2, 8)), rand(rng, (5, 8)), rand(rng, (5, 3))
    # query 0 sees keys 0..3, query 1 sees all five (flash-attn's docstring example)
    w0 = ref.softmax(ref.scores(q[:1], k[:4]).astype(F64))
    want0 = w0 @ v[:4].astype(F64)
    out = fastattn.attention(q, k, v, causal=True)
    assert_close(out[:1], want0, F32)
    np.testing.assert_array_equal(ref.causal_mask(2, 5), [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])


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
    if out.size:
        check(q, k, v)


# ---------------------------------------------------------------------------
# scale, extreme logits, NaN and inf
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


@pytest.mark.parametrize("dtype", [F32, F64])
def test_extreme_logits(isa, rng, dtype):
    """Scores near +-1e4 neither overflow nor lose the winner."""
    n, d = 50, 8
    k = rand(rng, (n, d), dtype)
    q = (k[[3, 17, 40]] * (1e4 / np.sum(k[[3, 17, 40]] ** 2, axis=1, keepdims=True))).astype(dtype)
    v = rand(rng, (n, 4), dtype)
    out, lse = check(q, k, v, scale=1.0)
    assert np.all(np.isfinite(out)) and np.all(lse > 5e3)
    check(-q, k, v, scale=1.0)  # scores near -1e4
    check(q, k, v, scale=1.0, mask=rng.standard_normal((3, n)).astype(dtype) * 1e4)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_nan_reaches_only_its_rows(isa, rng, dtype):
    q, k, v = rand(rng, (90, 16), dtype), rand(rng, (300, 16), dtype), rand(rng, (300, 8), dtype)
    qn = q.copy()
    qn[7, 3] = np.nan
    out = fastattn.attention(qn, k, v)
    assert np.isnan(out[7]).all() and np.isfinite(np.delete(out, 7, axis=0)).all()
    check(qn, k, v)
    # a NaN key is seen only by the rows that may attend it
    kn = k.copy()
    kn[250, 0] = np.nan
    out = fastattn.attention(q, kn, v, causal=True)   # off = 210: rows i >= 40 see key 250
    assert np.isfinite(out[:40]).all() and np.isnan(out[40:]).all()
    check(q, kn, v, causal=True)
    mask = np.ones((90, 300), bool)
    mask[:, 250] = False
    out = fastattn.attention(q, kn, v, mask=mask)
    assert np.isfinite(out).all()
    vn = v.copy()
    vn[100, 2] = np.inf
    out = fastattn.attention(q, k, vn)
    assert np.isinf(out[:, 2]).all() and np.isfinite(np.delete(out, 2, axis=1)).all()


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("nq", [1, 5, 12, 40, 200])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_hidden_nonfinite_values_add_nothing(isa, fused, mask_pack, rng, dtype, nq, bad):
    """A value row whose key a query may not see adds nothing to that query's
    row, even inf or NaN, also inside a key tile the kernel visits for other
    rows (0 * NaN would be NaN): mask, causal, window, split keys, both kernels."""
    nk = 300
    # d_v = 20: whole vectors and a tail in the finiteness check of every path
    q, k, v = rand(rng, (2, nq, 16), dtype), rand(rng, (2, nk, 16), dtype), rand(rng, (2, nk, 20), dtype)
    hidden = [3, 150, 299]
    vb = v.copy()
    vb[:, hidden, 1] = bad
    vb[1, 151, 5] = bad                  # visible: reaches every row of head 1, column 5 only
    mask = np.ones((nq, nk), bool)
    mask[:, hidden] = False
    mask[nq // 2] = False                # a row that sees nothing: zeros
    fmask = np.where(mask, 0, -np.inf).astype(dtype)
    for m in (mask, fmask):
        out = check(q, k, vb, mask=m)[0]
        assert np.isfinite(out[0]).all() and (out[:, nq // 2] == 0).all()
        assert np.isfinite(np.delete(out[1], 5, axis=-1)).all()
        if bad == bad:
            assert np.isinf(np.delete(out[1], nq // 2, axis=0)[:, 5]).all()
    vc = v.copy()
    vc[:, -1] = bad                      # the last key: causal hides it from all rows but the last
    out = check(q, k, vc, causal=True)[0]
    assert np.isfinite(out[:, :-1]).all() and not np.isfinite(out[:, -1]).any()
    vw = v.copy()
    vw[:, 0] = bad                       # the first key: a window of 20 hides it from late rows
    out = check(q, k, vw, window=(20, None))[0]
    p = np.arange(nq) + nk - nq
    assert np.isfinite(out[:, p > 20]).all() and not np.isfinite(out[:, p <= 20]).any()


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("threads", [1, 2, 4, 6])
def test_hidden_nonfinite_values_split_keys(isa, rng, dtype, threads):
    """The same across split-key parts (flash-decoding: fewer heads than
    threads), where a part whose keys are all hidden adds nothing."""
    q, k, v = rand(rng, (3, 1, 32), dtype), rand(rng, (3, 4000, 32), dtype), rand(rng, (3, 4000, 16), dtype)
    v[:, [7, 2222, 3999], 2] = np.nan
    v[:, 3000:, 4] = np.inf
    mask = np.ones((1, 4000), bool)
    mask[:, [7, 2222, 3999]] = False
    mask[:, 3000:] = False
    out = check(q, k, v, mask=mask, num_threads=threads)[0]
    assert np.isfinite(out).all()
    q40 = rand(rng, (1, 40, 32), dtype)     # 40 rows, one head: the tiled kernel's split-key parts
    out = check(q40, k[:1], v[:1], mask=mask, num_threads=threads)[0]
    assert np.isfinite(out).all()
    vk = rand(rng, (3, 4000, 16), dtype)
    vk[:, 2222, 2] = np.nan
    vk[:, 3000:, 4] = np.inf
    kv = np.array([2222, 2223, 4000])            # kv_lengths: key 2222 exists for heads 1 and 2
    out = check(q, k, vk, kv_lengths=kv, num_threads=threads)[0]
    assert np.isfinite(out[0]).all() and np.isnan(out[1:, :, 2]).all()
    assert np.isfinite(out[1, :, 4]) and np.isinf(out[2, :, 4])
    # keys 800 below the row max weigh exactly 0 (exp underflows in both
    # dtypes), but the row sees them: their true weight is positive, so their
    # inf values make the result inf (exact), in whichever part they fall
    kb = k.copy()
    q0 = q[:, 0].astype(F64)
    kb[:, 100] = q0 * (800 * np.sqrt(32) / np.sum(q0 * q0, axis=-1, keepdims=True))
    vi = rand(rng, (3, 4000, 16), dtype)
    vi[:, 3000:, 4] = np.inf
    out = check(q, kb, vi, num_threads=threads)[0]
    assert np.isposinf(out[..., 4]).all() and np.isfinite(np.delete(out, 4, axis=-1)).all()
    kb[:, 3500], kb[:, 100] = kb[:, 100], k[:, 100]   # the max comes after the inf keys
    vi[:, 3000:, 4], vi[:, :500, 4] = 0, -np.inf
    out = check(q, kb, vi, num_threads=threads)[0]
    assert np.isneginf(out[..., 4]).all() and np.isfinite(np.delete(out, 4, axis=-1)).all()
    vi[:, 7, 5] = np.nan                               # and NaN, 800 below the max, too
    out = check(q, kb, vi, num_threads=threads)[0]
    assert np.isnan(out[..., 5]).all()


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("nq", [1, 3, 9, 40, 130])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layout", ["end", "start", "both", "middle", "many"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_padding_mask_skips_hidden_keys(isa, rng, dtype, nq, threads, layout, kind, force):
    """Keys that a mask hides from every row (padding: False, or -inf in a
    float mask) are left out of P.V by ranges (visible_runs and mask_tile in
    the tiled kernel, mask_runs in the row kernel and its decode loop): NaN
    and inf in their V rows (and, under a bool mask, K rows) stay out of the
    result, at the start, at the end, across a key tile edge, and with more
    hidden stretches per tile than there are ranges (the whole tile, then the
    careful redo); one head with two threads splits the keys.  (A NaN key
    under a float mask's -inf is NaN + -inf = NaN, as in the reference.)"""
    nk = 700  # key tiles of 64 (tiled), 128 (row kernel) or 256 (one row), the last one partial
    q, k, v = rand(rng, (2, nq, 24), dtype), rand(rng, (2, nk, 24), dtype), rand(rng, (2, nk, 20), dtype)
    hidden = np.zeros(nk, bool)
    if layout in ("end", "both"):
        hidden[nk - 230:] = True
    if layout in ("start", "both"):
        hidden[:37] = True
    if layout == "middle":
        hidden[240:300] = True
    if layout == "many":
        hidden[5::9] = True
    mask = np.ones((nq, nk), bool)
    mask[:, hidden] = False
    mask[-1, 300] = nq == 1           # with several rows: hidden from one row only (finite there)
    kb, vb = k.copy(), v.copy()
    if kind == "bool":
        kb[:, hidden] = np.nan
    else:
        mask = np.where(mask, rng.standard_normal((nq, nk)), -np.inf).astype(dtype)
    vb[:, hidden, ::3] = np.inf
    vb[:, hidden, 1::3] = np.nan
    vb[:, hidden, 2::3] = -np.inf
    for h in (2, 1):
        force.reset_counts()
        out = check(q[:h], kb[:h], vb[:h], mask=mask, num_threads=threads)[0]
        redone = force.redo_rows
        assert np.isfinite(out).all()
        assert_close(out, fastattn.attention(q[:h], k[:h], v[:h], mask=mask, num_threads=threads), dtype)
        # the fast kernels skipped the hidden keys; too many stretches: the careful redo did
        assert (redone > 0) if layout == "many" else (redone == 0), redone


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("nq", [1, 2, 3, 8])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_row_kernel_trims_padding(isa, rng, dtype, nq, threads, kind, force):
    """The row kernel drops the keys at either end that a mask hides from every
    row (mask_trim): their scores and P.V are never computed, so NaN in their K
    and V rows stays out under a bool mask (no careful redo).  Under a float
    mask a NaN key there gives NaN (NaN + -inf), as in the reference, and a
    score that overflows to +inf there too: the trim checks their K rows first
    (2 rows or more; one row keeps the keys and leaves them out of P.V).  One
    head on two threads splits the keys, so a split may lie wholly in the
    padding."""
    nk = 700
    q, k, v = rand(rng, (2, nq, 24), dtype), rand(rng, (2, nk, 24), dtype), rand(rng, (2, nk, 20), dtype)
    seen = np.ones((nq, nk), bool)
    seen[:, :37] = seen[:, 470:] = False      # padding at both ends
    seen[:, 200:230] = False                  # and a stretch inside
    seen[-1, 600] = True                      # one row sees a key past the end padding
    mask = seen if kind == "bool" else np.where(seen, rng.standard_normal((nq, nk)), -np.inf).astype(dtype)
    pad = np.zeros(nk, bool)
    pad[:37] = pad[470:600] = pad[601:] = True
    for h in (2, 1):
        check(q[:h], k[:h], v[:h], mask=mask, num_threads=threads)
        vb = v.copy()
        vb[:, pad] = np.nan
        kb = k.copy()
        if kind == "bool":
            kb[:, pad] = np.nan
        force.reset_counts()
        out = check(q[:h], kb[:h], vb[:h], mask=mask, num_threads=threads)[0]
        assert np.isfinite(out).all()
        assert force.redo_rows == 0
    if kind == "float":
        kb = k.copy()
        kb[0, 650, 5] = np.nan                # NaN + -inf = NaN in every row of head 0
        out = check(q, kb, v, mask=mask, num_threads=threads)[0]
        assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()
        kb, qs = k.copy(), q.copy()
        kb[1, 10] = np.finfo(dtype).max / 2   # +inf scores in the even rows of head 1
        qs[1, ::2] = np.abs(q[1, ::2])
        qs[1, 1::2] = -np.abs(q[1, 1::2])
        out = fastattn.attention(qs, kb, v, mask=mask, num_threads=threads)
        assert np.isnan(out[1, ::2]).all() and np.isfinite(out[1, 1::2]).all()
        assert_close(out, ref.attention(qs, kb, v, mask=mask), dtype)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("nq", [1, 5, 40])
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("big_first", [True, False])
def test_underflowed_weights_keep_nonfinite_values(isa, rng, dtype, nq, threads, big_first):
    """A key that a row sees has a positive weight, however far its score lies
    below the row max: when the weight underflows to 0, its inf and NaN values
    still reach the row (inf * tiny = inf), its finite values add nothing.  A
    hidden key adds nothing at all.  Row kernel (1 and 5 rows), tiled kernel
    (40 rows), split keys (1 row, 2-4 threads), and the big score before the
    inf keys (their weights underflow) or after them (the accumulator's scale
    underflows)."""
    d, nk = 16, 3000
    q = rand(rng, (2, nq, d), dtype)
    q[..., 0] = 1 + np.abs(q[..., 0])
    k, v = rand(rng, (2, nk, d), dtype), rand(rng, (2, nk, 6), dtype)
    big = 10 if big_first else nk - 10
    k[:, big] = 0
    k[:, big, 0] = 1000 * np.sqrt(d)          # scores >= 1000: every other weight underflows, in float64 too
    lo, hi = (1500, 2500) if big_first else (100, 1100)
    v[:, lo:hi, 1] = np.inf                   # seen, weight 0
    v[:, lo + 7, 2] = np.nan                  # seen, weight 0
    v[:, lo + 8, 3] = -np.inf                 # hidden by the mask
    v[:, lo + 9, 4] = np.nan                  # hidden by the mask
    mask = np.ones((nq, nk), bool)
    mask[:, [lo + 8, lo + 9]] = False
    out = check(q, k, v, mask=mask, num_threads=threads)[0]
    assert np.isposinf(out[..., 1]).all() and np.isnan(out[..., 2]).all()
    assert np.isfinite(out[..., [0, 3, 4, 5]]).all()
    # the big key's weight is 1, every other's 0: the finite columns are its value row
    assert_close(out[..., [0, 3, 4, 5]], np.repeat(v[:, None, big][..., [0, 3, 4, 5]], nq, axis=1), dtype)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("nq,threads", [(1, 1), (1, 2), (5, 2), (40, 1), (40, 2), (300, 2)])
@pytest.mark.parametrize("kind", ["plain", "causal", "bool", "rising"])
def test_values_near_the_dtype_limit(isa, fused, rng, dtype, nq, threads, kind):
    """Values up to half the dtype's largest number, over 3000 keys of nearly
    equal weight: the output, a weighted mean of them, is finite, but their
    weighted sum is not.  The fast kernels' unnormalised accumulators overflow,
    and the careful redo keeps the running mean instead.  Row kernel (1 and 5
    rows), tiled kernel, split keys, whose partial means are merged (1 and 5
    rows on 2 threads); "rising": the later keys score 6 higher, so the
    split-key parts have different maxima."""
    nk, big = 3000, np.finfo(dtype).max / 2
    q, k = rand(rng, (2, nq, 16), dtype) * 0.1, rand(rng, (2, nk, 16), dtype)
    if kind == "rising":
        q[..., 0] = 1
        k[:, nk // 2:, 0] += 6
    v = big * rng.uniform(0.5, 1, (2, nk, 8)).astype(dtype)
    v[..., ::2] *= -1
    kw = {"causal": True} if kind == "causal" else {}
    if kind == "bool":
        kw["mask"] = rng.random((nq, nk)) < 0.9
    out, _ = check(q, k, v, dtype, num_threads=threads, **kw)
    assert np.isfinite(out).all()


def test_reference_hidden_nonfinite_values():
    """The reference's rule, against a plain loop over the visible keys."""
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((6, 4)), rng.standard_normal((9, 4)), rng.standard_normal((9, 3))
    v[8, 0], v[7, 1], v[6, 2], v[5, 2] = np.nan, np.inf, -np.inf, np.inf
    w = ref.attention_weights(q, k, causal=True)
    with np.errstate(invalid="ignore"):   # inf + -inf
        want = np.array([[sum(w[i, j] * v[j, c] for j in range(9) if w[i, j] > 0) for c in range(3)]
                         for i in range(6)])
    got = ref.attention(q, k, v, causal=True)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert np.isnan(got[5, 0]) and np.isinf(got[4, 1]) and np.isnan(got[3:, 2]).all()


@pytest.mark.parametrize("dtype", [F32, F64])
def test_nan_score_row_is_nan_throughout(isa, rng, dtype):
    """A row with a NaN score (an inf key under a float mask's -inf: +inf +
    -inf) has NaN weights, so its output is NaN in every column, also in one
    where a key it sees holds inf (the reference gave inf there before)."""
    q, k, v = rand(rng, (1, 6, 8), dtype), rand(rng, (1, 40, 8), dtype), rand(rng, (1, 40, 5), dtype)
    q[0, :3, 0] = -1 - np.abs(q[0, :3, 0])   # rows 0-2: score +inf with key 7
    q[0, 3:, 0] = 1 + np.abs(q[0, 3:, 0])    # rows 3-5: -inf
    k[0, 7, 0] = -np.inf
    mask = np.zeros((6, 40), dtype)
    mask[:, 7] = -np.inf                      # +inf + -inf = NaN in rows 0-2; -inf in rows 3-5
    v[0, 20, 2] = np.inf                      # seen by every row
    out = check(q, k, v, mask=mask)[0]
    assert np.isnan(out[0, :3]).all()
    assert np.isposinf(out[0, 3:, 2]).all() and np.isfinite(np.delete(out[0, 3:], 2, axis=-1)).all()
    want = ref.attention(q.astype(F64), k.astype(F64), v.astype(F64), mask=mask.astype(F64))
    assert np.isnan(want[0, :3]).all() and np.isposinf(want[0, 3:, 2]).all()


# ---------------------------------------------------------------------------
# the fused exp (kernel_body.h, FUSE_LAG): a key tile takes its probabilities
# against a reference max that may lag the true one by up to 24; a register
# tile whose scores rise further raises it and rescales l, Ot and the tile's
# rows already written; after a few such rescales the item goes on unfused
# ---------------------------------------------------------------------------
def _scored_inputs(rng, dtype, nq, nk, scores, dv=6):
    """q, k, v with q_i . k_j = scores[j] (rounded to eighths) + 0 or r_j, for
    r_j in [-1, 1) also in eighths, so that every score is exact in float32:
    large scores carry no rounding of their own into the weights."""
    d = 4
    q = np.zeros((2, nq, d), dtype)
    q[..., 0] = 1
    q[..., 1] = rng.integers(0, 2, (2, nq))
    k = np.zeros((2, nk, d), dtype)
    k[..., 0] = np.round(np.asarray(scores) * 8) / 8
    k[..., 1] = rng.integers(-8, 8, (2, nk)) / 8
    return q, k, rand(rng, (2, nk, dv), dtype)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("growth", [0.5, 5.0, 15.0, 40.0, 100.0, 200.0])
@pytest.mark.parametrize("nq,threads", [(40, 1), (300, 1), (20, 2), (300, 2)])
def test_fused_exp_growing_scores(isa, fused, rng, tiles, dtype, growth, nq, threads):
    """Scores that grow by `growth` over each 64-key tile: the reference max
    lags behind and probabilities exceed 1; it is raised now and then (15), or
    at every few register tiles until the item goes on unfused (40 and more).
    One item per row block, split keys (20 rows on 2 threads), causal, and
    lse."""
    tiles(0, 64)
    nk = 640
    q, k, v = _scored_inputs(rng, dtype, nq, nk, growth * np.arange(nk) / 64)
    check(q, k, v, dtype, scale=1.0, num_threads=threads)
    check(q, k, v, dtype, scale=1.0, num_threads=threads, causal=True)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("jump", [3.0, 16.0, 23.5, 24.5, 30.0, 100.0, 1000.0, np.inf, np.nan])
def test_fused_exp_one_big_score(isa, fused, rng, dtype, jump):
    """One key in the middle of a later tile (default tiles) scores `jump`
    above all the others, for some rows: kept against the lagging max (up to
    24), or the max is raised there, and the rows before it in the tile, l and
    the output accumulator are rescaled.  inf and NaN scores as in the
    reference (NaN rows)."""
    nq, nk = 130, 1100
    q, k, v = _scored_inputs(rng, dtype, nq, nk, rng.standard_normal(nk))
    q[:, ::3, 2] = 1                          # every third row sees the jump
    k[:, 700, 2] = jump
    out, _ = check(q, k, v, dtype, scale=1.0)
    if np.isfinite(jump) and jump >= 100:     # the jump's weight is 1, the others' below 1e-40
        assert_close(out[:, ::3], np.repeat(v[:, None, 700], len(range(0, nq, 3)), axis=1), dtype)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_exp_values_near_overflow(isa, fused, rng, dtype, threads):
    """Against a reference max about 7 below the true one, probabilities up to
    e^8 times values near the dtype's limit overflow the accumulator: such a
    row comes out non-finite from the fast pass and is computed again
    carefully, so the result is the finite weighted mean of the values (see
    also test_values_near_the_dtype_limit)."""
    nq, nk = 64, 1024
    scores = np.zeros(nk)
    scores[600:] = 7                          # later tiles, 7 (+-1) above the first keys' max
    q, k, v = _scored_inputs(rng, dtype, nq, nk, scores)
    big = np.finfo(dtype).max / (8 * nk)
    v = np.full_like(v, big)
    v[..., 1] = -big
    out, _ = check(q, k, v, dtype, scale=1.0, num_threads=threads)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("dtype", [F32, F64])
def test_fused_exp_many_keys_far_above(isa, fused, rng, dtype):
    """20000 keys score 79 above the first 64: against a reference max that
    lagged by 79, their weights e^79 would sum past float32's limit.  The lag
    is bounded (24), so the row sum cannot overflow."""
    nk = 20064
    scores = np.full(nk, 79.0)
    scores[:64] = 0
    q, k, v = _scored_inputs(rng, dtype, 40, nk, scores)
    check(q, k, v, dtype, scale=1.0)


# ---------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------
def test_float16(isa, rng):
    q, k, v = (rand(rng, (2, 50, 16), np.float16) for _ in range(3))
    out, lse = fastattn.attention(q, k, v, return_lse=True)
    assert out.dtype == np.float16 and lse.dtype == F32
    want, want_lse = reference64(q, k, v)
    assert_close(out, want, np.float16)
    assert_close(lse, want_lse, F32, "lse")


@pytest.mark.parametrize("dts,expect", [
    ((F32, F32, F32), F32), ((F32, F64, F32), F64), ((np.float16, F32, np.float16), F32),
    ((np.int64, np.int64, np.int64), F64), ((np.int32, F32, np.int8), F64), ((bool, bool, bool), F64),
    ((np.uint8, np.float16, np.float16), np.float16),
])
def test_result_dtype(rng, dts, expect):
    q = (rng.standard_normal((6, 4)) * 3).astype(dts[0])
    k = (rng.standard_normal((9, 4)) * 3).astype(dts[1])
    v = (rng.standard_normal((9, 5)) * 3).astype(dts[2])
    out = fastattn.attention(q, k, v)
    assert out.dtype == np.dtype(expect) == (np.result_type(q, k, v) if np.result_type(q, k, v).kind == "f" else F64)
    want, _ = reference64(q, k, v)
    assert_close(out, want, expect)


def test_integer_inputs(rng):
    q, k, v = rng.integers(-3, 4, (2, 10, 6)), rng.integers(-3, 4, (2, 12, 6)), rng.integers(0, 9, (2, 12, 2))
    check(q, k, v)


def test_lists_accepted():
    out = fastattn.attention([[1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]], [[1.0], [2.0]])
    assert out.shape == (1, 1)


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
    out = fastattn.attention(q2, k, v1)
    assert out.shape == (3, 1)
    out, lse = fastattn.attention(q1, k, v1, return_lse=True)
    assert out.shape == (3,) and lse.shape == (3,)
    want, want_lse = reference64(q1, k, v1)
    assert_close(out, want, F32)
    assert_close(lse, want_lse, F32)
    mask = np.array([True, False, True, True, False, True, True])
    assert_close(fastattn.attention(q1, k, v1, mask=mask), reference64(q1, k, v1, mask=mask)[0], F32)


# ---------------------------------------------------------------------------
# strides and views
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


# ---------------------------------------------------------------------------
# out=
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
    fastattn.attention(q, k, v, out=out_t)
    assert_close(out_t, reference64(q, k, v)[0], F32)
    q16, k16, v16 = (a.astype(np.float16) for a in (q, k, v))
    out16 = np.empty((2, 20, 6), np.float16)
    assert fastattn.attention(q16, k16, v16, out=out16) is out16
    assert_close(out16, reference64(q16, k16, v16)[0], np.float16)


# (inputs, out): out's dtype differs from the result's, and the result casts to it under
# NumPy's same_kind rule
_OUT_CASTS = [(F32, F64), (F64, F32), (F32, ">f4"), (F64, ">f8"), (np.float16, F32), (np.float16, F64),
              (F32, np.float16), (F64, np.complex128), (np.int16, F32)]


def _compute_dtype(dt):
    return F32 if np.dtype(dt) in (np.dtype(F32), np.dtype(np.float16)) else F64


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
    comp = _compute_dtype(np.result_type(q, k, v))
    plain = fastattn.attention(*(a.astype(comp) for a in (q, k, v)), **kw)
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
    comp = _compute_dtype(x.dtype)
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


def test_out_aliasing_an_input(rng):
    q, k, v = rand(rng, (2, 20, 8)), rand(rng, (2, 20, 8)), rand(rng, (2, 20, 8))
    want = reference64(q, k, v, causal=True)[0]
    qq = q.copy()
    fastattn.attention(qq, k, v, causal=True, out=qq)   # out is q itself
    assert_close(qq, want, F32)


def test_out_one_dim_forms(rng):
    k, v = rand(rng, (3, 7, 5)), rand(rng, (7,))
    out = np.empty(3, F32)
    assert fastattn.attention(rand(rng, (5,)), k, v, out=out) is out


# ---------------------------------------------------------------------------
# the plain call (contiguous ndarrays of one float dtype, equal leading dims,
# no options) skips the general preparation: same checks, same result
# ---------------------------------------------------------------------------
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
        got = fastattn.attention(q, k, v, causal=causal, scale=scale, num_threads=threads)
        assert got.dtype == dtype and got.shape == lead + (nq, 40)
        gq, gk, gv = _strided(q), _strided(k), _strided(v)
        assert not _plain(gq, gk, gv)
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
            got, lse = fastattn.attention(q, k, v, mask=mask, causal=causal, num_threads=threads, return_lse=True)
            g_got, g_lse = fastattn.attention(gq, gk, gv, mask=mask, causal=causal, num_threads=threads,
                                              return_lse=True)
            np.testing.assert_array_equal(got, g_got)
            np.testing.assert_array_equal(lse, g_lse)
            want, want_lse = reference64(q, k, v, mask=mask, causal=causal)
            assert_close(got, want, dtype)
            assert_close(lse, want_lse, dtype, "lse")
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


# ---------------------------------------------------------------------------
# threads
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts(isa, rng, threads):
    q, k, v = (rand(rng, (2, 2, 300, 32)) for _ in range(3))
    a = check(q, k, v, causal=True, num_threads=threads)[0]
    b = fastattn.attention(q, k, v, causal=True, num_threads=1)
    assert_close(a, b.astype(F64), F32)


def test_concurrent_python_threads(rng):
    cases = [tuple(rand(rng, (2, 150, 16), dt) for _ in range(3)) for dt in (F32, F64) * 4]
    wants = [reference64(*c, causal=True)[0] for c in cases]
    with ThreadPoolExecutor(max_workers=4) as ex:
        for _ in range(3):
            gots = list(ex.map(lambda c: fastattn.attention(*c, causal=True), cases))
            for c, got, want in zip(cases, gots, wants):
                assert_close(got, want, c[0].dtype)


def test_gil_released(rng):
    """Another Python thread runs while the C core works."""
    q, k, v = (rand(rng, (4, 8, 1024, 64)) for _ in range(3))
    count = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    try:
        fastattn.attention(q, k, v, num_threads=1)   # warm-up: the spinner is surely running
        before = count[0]
        fastattn.attention(q, k, v, num_threads=1)
        during = count[0] - before
    finally:
        stop.set()
        t.join()
    assert during > 1000, f"the other thread advanced only {during} steps during the call"


# A fresh process: forks a child before any team, runs a team of GNU libgomp's
# own (GOMP_parallel) and forks a child, calls on two threads (a team), forks a
# child again; each child calls on two threads and reports.  A child that
# does not report within 60 s is killed: None; one that exits without a report
# gives its exit status.
_FORK_SCRIPT = r"""
import contextlib, ctypes, io, json, os, signal, time, warnings
import numpy as np
import fastattn
from fastattn import _core
from fastattn import reference as ref
warnings.simplefilter("ignore", DeprecationWarning)  # Python >= 3.12 on fork with threads
rng = np.random.default_rng(1)
q, k, v = (rng.standard_normal((2, 4, 256, 32)) for _ in range(3))
want = ref.attention(q, k, v, causal=True)

def err():
    out = fastattn.attention(q, k, v, causal=True, num_threads=2)
    return float(np.max(np.abs(out - want)))

def in_child():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            e = err()
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                fastattn.show_config()
            rep = dict(err=e, threads=_core.last_threads(), serial=_core.fork_serial(),
                       max=_core.max_threads(), config=buf.getvalue())
            os.write(w, json.dumps(rep).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    end = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > end:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.02)
    data = b""
    while True:
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
    os.close(r)
    return json.loads(data) if data else dict(died=status)

def foreign_team():
    # a team of another library on the same OpenMP runtime, as PyTorch's ops start:
    # GOMP_parallel(free, NULL, 2, 0) runs free(NULL) on two threads
    gomp = ctypes.CDLL(_core.openmp_library())
    if not hasattr(gomp, "GOMP_parallel"):
        return False
    free = ctypes.cast(ctypes.CDLL(None).free, ctypes.c_void_p)
    gomp.GOMP_parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    gomp.GOMP_parallel(free, None, 2, 0)
    return True

rep = dict(before=in_child())
rep.update(gomp=foreign_team(), foreign=in_child())
rep.update(parent_err=err(), parent_threads=_core.last_threads())
rep.update(after=in_child(), parent_err_after=err(), parent_threads_after=_core.last_threads())
print(json.dumps(rep))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_fork_after_threads(tmp_path):
    """A child forked after an OpenMP team ran, fastattn's or another library's on the
    same runtime (GOMP_parallel through ctypes, as PyTorch's ops run), computes on its
    own team (GNU libgomp's would wait for the parent's threads forever: multiprocessing's
    fork hung): fastattn frees the pool before the fork (omp_pause_resource_all), and
    runtimes without it give the child one thread."""
    # the fastattn these tests import (not a source folder in the working directory)
    where = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([where] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run([sys.executable, "-c", _FORK_SCRIPT], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout.splitlines()[-1])
    before, foreign, after = rep["before"], rep["foreign"], rep["after"]
    assert before is not None, "a child forked before any team hung"
    assert foreign is not None, "a child forked after another library's team hung"
    assert after is not None, "a child forked after a team hung"
    assert "died" not in before and "died" not in after and "died" not in foreign, rep
    team = 2 if _core.openmp_enabled() else 1
    lib = _core.openmp_library()
    # libgomp without omp_pause_resource_all (before GCC 9): one thread after fork
    serial = team == 2 and "gomp" in lib and not hasattr(ctypes.CDLL(lib), "omp_pause_resource_all")
    assert rep["gomp"] or "gomp" not in lib
    assert rep["parent_threads"] == rep["parent_threads_after"] == team
    assert before["threads"] == team and not before["serial"] and before["max"] == _core.max_threads()
    for child in (foreign, after):
        assert child["serial"] == serial
        assert child["threads"] == (1 if serial else team)
        assert child["max"] == (1 if serial else _core.max_threads())
        assert ("forked" in child["config"]) == serial
    assert "forked" not in before["config"]
    for e in (before["err"], foreign["err"], after["err"], rep["parent_err"], rep["parent_err_after"]):
        assert e < 1e-12


# ---------------------------------------------------------------------------
# inputs are never modified
# ---------------------------------------------------------------------------
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
# bad input: raised before any work, with a clear message
# ---------------------------------------------------------------------------
def _qkv(rng):
    return rand(rng, (2, 5, 8)), rand(rng, (2, 6, 8)), rand(rng, (2, 6, 4))


@pytest.mark.parametrize("change,exc,msg", [
    (dict(k=np.zeros((2, 6, 7), F32)), ValueError, "d_k differs"),
    (dict(v=np.zeros((2, 7, 4), F32)), ValueError, "n_k differs"),
    (dict(k=np.zeros((3, 6, 8), F32), v=np.zeros((3, 6, 4), F32)), ValueError, "leading dims do not broadcast"),
    (dict(k=np.zeros(8, F32)), ValueError, "k must have shape"),
    (dict(q=np.float32(1)), ValueError, "q must have shape"),
    (dict(v=np.float32(1)), ValueError, "v must have shape"),
    (dict(mask=np.ones((5, 5), bool)), ValueError, "does not broadcast"),
    (dict(mask=np.ones((3, 5, 6), bool)), ValueError, "leading dims do not broadcast"),
    (dict(mask=np.ones((5, 6), np.int64)), TypeError, "integer dtype"),
    (dict(mask=np.ones((5, 6), complex)), TypeError, "mask must be bool or floating"),
    (dict(q=np.ones((2, 5, 8), complex)), TypeError, "complex"),
    (dict(k=np.ones((2, 6, 8), object)), TypeError, "object"),
    (dict(v=np.full((2, 6, 4), "a")), TypeError, "not supported"),
    (dict(q=None), TypeError, "q must be an array"),
    (dict(num_threads=0), ValueError, "num_threads"),
    (dict(num_threads=np.int64(0)), ValueError, "num_threads"),
    (dict(num_threads=1.5), TypeError, "num_threads"),
    (dict(num_threads=True), TypeError, "num_threads"),
    (dict(scale=np.inf), ValueError, "scale must be finite"),
    (dict(scale=np.nan), ValueError, "scale must be finite"),
    (dict(scale="x"), TypeError, "scale"),
    (dict(scale="1"), TypeError, "scale must be a real number, got str"),           # float() would parse it
    (dict(scale=True), TypeError, "scale must be a real number, got bool"),
    (dict(scale=np.bool_(True)), TypeError, "scale must be a real number, got bool"),
    (dict(scale=np.complex128(0.5)), TypeError, "got complex128 of dtype complex128"),  # float() drops 0j
    (dict(scale=np.array([0.5])), TypeError, "scale must be a real number, got ndarray"),
    (dict(scale=np.array("1")), TypeError, "got ndarray of dtype <U1"),
    (dict(softcap="30"), TypeError, "softcap must be None or a positive number, got str"),
    (dict(softcap=True), TypeError, "softcap must be None or a positive number, got bool"),
    (dict(softcap=1j), TypeError, "softcap must be None or a positive number, got complex"),
    (dict(out=np.empty((2, 5, 5), F32)), ValueError, "out has shape"),
    (dict(out=np.empty((2, 5, 4), np.int32)), TypeError, "out has dtype int32, which the result's dtype float32"),
    (dict(out=np.empty((2, 5, 4), bool)), TypeError, "out has dtype bool"),
    (dict(out=[[0.0]]), TypeError, "out must be a numpy.ndarray"),
])
def test_bad_input(rng, change, exc, msg):
    q, k, v = _qkv(rng)
    args = dict(q=q, k=k, v=v)
    kw = {}
    for name, val in change.items():
        (args if name in args else kw)[name] = val
    with pytest.raises(exc, match=msg):
        fastattn.attention(args["q"], args["k"], args["v"], **kw)


def test_real_arguments_of_any_real_type(rng):
    """scale and softcap take any real number: Python's int, float and Fraction,
    NumPy's scalars and 0-d arrays; each gives what its float gives."""
    from fractions import Fraction
    q, k, v = _qkv(rng)
    for value in (Fraction(1, 4), 0.25, np.float32(0.25), np.float64(0.25), np.array(0.25), np.array(0.25, F32)):
        assert np.array_equal(fastattn.attention(q, k, v, scale=value), fastattn.attention(q, k, v, scale=0.25))
    for value in (2, np.int64(2), np.uint8(2), np.array(2)):
        assert np.array_equal(fastattn.attention(q, k, v, scale=value), fastattn.attention(q, k, v, scale=2.0))
        assert np.array_equal(fastattn.attention(q, k, v, softcap=value), fastattn.attention(q, k, v, softcap=2.0))


def test_readonly_out(rng):
    q, k, v = _qkv(rng)
    out = np.empty((2, 5, 4), F32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        fastattn.attention(q, k, v, out=out)


def test_longdouble_rejected(rng):
    q, k, v = _qkv(rng)
    if np.dtype(np.longdouble).itemsize > 8:
        with pytest.raises(TypeError, match="float32 or float64"):
            fastattn.attention(q.astype(np.longdouble), k, v)


# ---------------------------------------------------------------------------
# few query rows (the row kernel) and split keys (flash-decoding merge)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("nq", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
@pytest.mark.parametrize("nk", [1, 9, 511, 513, 1024, 1537, 5000])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_decode_rows_and_splits(isa, rng, dtype, nq, nk, threads):
    """One head: few query rows take the row kernel, more the tiled one (up to
    6 with AVX2, float64 3; 10 on the portable path; 12 with AVX-512; see
    rows_limits): both sides of the limit on every path; with 2 or 4 threads
    and n_k >= 1024 the keys are split across threads and merged by the
    logsumexp rule."""
    d = 72  # not a multiple of the vector width: exercises the dot-product tails
    q, k, v = rand(rng, (1, nq, d), dtype), rand(rng, (1, nk, d), dtype), rand(rng, (1, nk, 40), dtype)
    check(q, k, v, num_threads=threads)
    check(q, k, v, causal=True, num_threads=threads)




@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("nq", range(1, 25))
@pytest.mark.parametrize("dk, dv", [(128, 128), (64, 48), (72, 40), (16, 112), (7, 3), (100, 136), (256, 8)])
def test_row_kernel_register_tiles(isa, rng, rows_max, dtype, nq, dk, dv):
    """The row kernel (forced up to 24 rows, its cap) and its register tiles:
    rows in groups of 4 (scores with AVX-512) or 2 (scores otherwise) and of
    8 (P.V with AVX-512) or 4 (P.V otherwise), with every remainder and several
    groups (nq 1..24), P.V tiles of 8, 6, 5, 4, 3 or 2 vectors with every
    narrower last tile (dv / lanes = 0..17, for 2, 4, 8 and 16 lanes) and the
    scalar columns after them, dot products with and without a dk tail, and a
    key count that leaves a tail after the 4-key blocks (303)."""
    rows_max(24)
    q, k, v = rand(rng, (2, nq, dk), dtype), rand(rng, (2, 303, dk), dtype), rand(rng, (2, 303, dv), dtype)
    check(q, k, v, num_threads=1)
    check(q, k, v, causal=True, num_threads=1)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("G, P, nk", [(2, 5, 40), (3, 7, 300), (4, 8, 2100), (8, 1, 300)])
@pytest.mark.parametrize("kernel", ["rows", "tiled", "odd tiles"])
def test_row_group(isa, rng, rows_max, tiles, dtype, G, P, nk, kernel):
    """The C core's row_group: G consecutive rows share a position, as the query
    heads of a GQA group that fastattn.attention folds into the rows of one item
    (position-major).  Causal, windows and ALiBi (which the fold leaves per
    head), kv_lengths, a bool mask, NaN in the last key's value row (hidden from
    the rows before the last position: they are recomputed carefully, row by
    row); one item with split keys on 2 threads and two items; the row kernel,
    the tiled one, and tiles of 3 and 5 rows that start inside a group.  Against
    the reference per head."""
    rows_max(24 if kernel == "rows" else 1)
    if kernel == "odd tiles":
        tiles(3 if G > 2 else 5, 37)
    for B in (1, 2):
        q = rand(rng, (B, G, P, 16), dtype)
        k, v = rand(rng, (B, nk, 16), dtype), rand(rng, (B, nk, 12), dtype)
        qf = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).reshape(B, P * G, 16)   # row r: position r // G
        slopes = rng.random(B).astype(dtype)
        kvl = rng.integers(P, nk + 1, B)
        mask = rng.random((B, P, nk)) < 0.7
        v_nan = v.copy()
        v_nan[:, -1, 0] = np.nan
        for extra in (dict(causal=True), dict(window=(20, 3)), dict(causal=True, window=(7, None)),
                      dict(causal=True, alibi_slopes=slopes), dict(causal=True, kv_lengths=kvl),
                      dict(causal=True, mask=mask), dict(causal=True, v=v_nan)):
            vv = extra.pop("v", v)
            out, lse = np.empty((B, P * G, 12), dtype), np.empty((B, P * G), dtype)
            wl, wr = extra.get("window", (None, None))
            m = extra.get("mask")
            mf = None if m is None else np.repeat(m, G, axis=1).view(np.uint8)   # (B, P * G, nk)
            _core.attention(qf, k, vv, mf, _core.MASK_NONE if m is None else _core.MASK_BOOL, out, lse, (B,),
                            extra.get("causal", False), 0.25, 2, 0.0, -1 if wl is None else wl,
                            -1 if wr is None else wr, extra.get("alibi_slopes"),
                            None if "kv_lengths" not in extra else kvl.astype(np.int64), False, G)
            kw = dict(extra)
            for name in ("alibi_slopes", "kv_lengths"):
                if name in kw:
                    kw[name] = kw[name][:, None]          # per batch: (B, 1) against (B, G)
            if m is not None:
                kw["mask"] = m[:, None]
            want, want_lse = reference64(q, k[:, None], vv[:, None], scale=0.25, **kw)   # (B, G, P, ...)
            assert_close(out.reshape(B, P, G, 12).transpose(0, 2, 1, 3), want, dtype)
            assert_close(lse.reshape(B, P, G).transpose(0, 2, 1), want_lse, dtype, "lse")




@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("nq", [1, 2, 3, 5, 8, 10])
@pytest.mark.parametrize("nk", [1, 303, 513])
@pytest.mark.parametrize("dk, dv", [(72, 40), (128, 128), (7, 3)])
@pytest.mark.parametrize("strided", [False, True])
def test_row_kernel_streaming(isa, rng, stream, rows_max, dtype, nq, nk, dk, dv, strided):
    """The row kernel (forced for every nq here) as it runs on K and V from
    memory (forced on small ones): K and V rows prefetched into L2 further
    ahead, V rows prefetched during the scores and the next tile's K during
    P.V, for 1 to 5 key tiles (128 keys; one row, decoding: 256) with a tail,
    P.V tiles with and without whole vectors of dv, row groups with
    remainders.  Plain, causal, a bool mask and kv_lengths.  strided: K and V
    rows that do not abut (column slices of wider rows, starting one element in,
    as a (B, n, H, d) cache's heads), whose prefetch also takes each row's last
    line (kernel_body.h, prefetch_l2); the tiled kernel's prefetch of them too."""
    stream(1)
    rows_max(24)
    q = rand(rng, (2, nq, dk), dtype)
    if strided:
        k = rand(rng, (2, nk, dk + 6), dtype)[..., 1:dk + 1]
        v = rand(rng, (2, nk, dv + 6), dtype)[..., 1:dv + 1]
    else:
        k, v = rand(rng, (2, nk, dk), dtype), rand(rng, (2, nk, dv), dtype)
    check(q, k, v, num_threads=1)
    check(q, k, v, causal=True, num_threads=2)
    check(q, k, v, mask=rng.random((nq, nk)) < 0.7, num_threads=1)
    check(q, k, v, kv_lengths=rng.integers(0, nk + 1, (2,)), num_threads=2)
    if strided:
        rows_max(1)   # the tiled kernel (from one row up; decoding keeps the row kernel)
        check(q, k, v, causal=True, num_threads=2)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("nq", [13, 17, 24])
def test_row_kernel_many_rows_split_keys(isa, rng, rows_max, dtype, nq):
    """13 to 24 rows in the row kernel (the AVX-512 limit from memory) with one
    head on 2 threads: the keys are split and the parts' means merged.  Plain,
    causal and a bool mask."""
    rows_max(24)
    q, k, v = rand(rng, (nq, 64), dtype), rand(rng, (3000, 64), dtype), rand(rng, (3000, 48), dtype)
    check(q, k, v, num_threads=2)
    check(q, k, v, causal=True, num_threads=2)
    check(q, k, v, mask=rng.random((nq, 3000)) < 0.5, num_threads=2)


def rows_limits(dtype, kind):
    """The most query rows that take the row kernel on the SIMD path in use, and
    the (lo, hi) rows that take the tiled kernel below it (None: none), read from
    its table (_core.isa_table, what the plan reads).  kind: 0 K and V within 48
    MiB and dk < 128 (rows_max), 1 K and V beyond 48 MiB (rows_max_big), 2 within
    48 MiB and dk >= 128 (rows_max_dk)."""
    t, x = _core.isa_table(), int(dtype == F64)
    limit = t[("rows_max", "rows_max_big", "rows_max_dk")[kind]][x]
    full = t["rows_full"][x]
    return limit, ((full, t["lanes"][x]) if full else None)


def tail_rows(isa, dtype, nq):
    """The rows of nq that the row kernel takes as the tiled kernel's tail (with
    enough blocks for the threads; the blocks are whole vectors but the last)."""
    t, x = _core.isa_table(), int(dtype == F64)
    assert t["name"] == isa
    r = nq % t["lanes"][x]
    return r if 0 < r <= t["tail_max"][x] and nq - r >= 16 else 0


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("kv_mib, d", [(1, 64), (40, 64), (50, 64), (1, 127), (1, 128), (1, 200), (50, 200)])
def test_row_kernel_choice(isa, rng, rows_max, dtype, kv_mib, d, force):
    """Which kernel takes 2 to 24 query rows depends on the SIMD path, the
    dtype, whether K and V exceed 48 MiB (then they come from memory, and the
    tiled kernel takes 32-key tiles up to 32 rows) and the head dim (from 128
    on, long dot products hide the row kernel's horizontal sums): the output is bitwise that
    of the kernel forced by rows_max, and both agree with the reference.  Rows
    that fill (nearly) one vector take the tiled kernel (rows_limits: rows_full).  K and
    V broadcast over a leading axis (shared by two query heads) count once (40
    MiB, not 80).  (Not enable_gqa, which folds a group's heads into the rows
    of one item up to 8 rows per head: test_variants.py.)"""
    h_kv = 2
    nk = (kv_mib << 20) // (2 * h_kv * d * np.dtype(dtype).itemsize)
    k, v = rand(rng, (h_kv, nk, d), dtype), rand(rng, (h_kv, nk, d), dtype)
    k64, v64 = k.astype(F64), v.astype(F64)   # the reference's inputs, converted once (not per check)
    kind = 1 if kv_mib > 48 else 2 if d >= 128 else 0
    limit, full = rows_limits(dtype, kind)
    if kv_mib > 48 and d > 128:
        full = None
    for nq in (2, 3, 4, 6, 7, 9, 11, 13, 14, 15, 16, 17, 20, 21, 24):
        q = rand(rng, (2, h_kv, nq, d), dtype)
        force.reset_counts()
        out, lse = fastattn.attention(q, k, v, num_threads=2, return_lse=True)
        tails = force.tail_rows
        rows_max(24)
        by_rows = fastattn.attention(q, k, v, num_threads=2)
        rows_max(1)
        tiled = fastattn.attention(q, k, v, num_threads=2)
        rows_max(0)
        assert not np.array_equal(by_rows, tiled)    # the two kernels can be told apart
        few = nq <= limit and not (full and full[0] <= nq <= full[1])
        tail = 0 if few else tail_rows(isa, dtype, nq)
        main = nq - tail   # the tiled kernel's rows; the rest: the row kernel's tail
        np.testing.assert_array_equal(out[..., :main, :], (by_rows if few else tiled)[..., :main, :],
                                      err_msg=f"{nq} rows")
        if tail:
            assert not np.array_equal(out[..., main:, :], tiled[..., main:, :]), f"{nq} rows"
        assert tails == q.size // (nq * d) * tail, f"{nq} rows"
        if nq in (13, 16, 24) or tail:
            want, want_lse = ref.attention(q.astype(F64), k64, v64, return_lse=True)
            assert_close(out, want, dtype, f"{nq} rows")
            assert_close(lse, want_lse, dtype, f"{nq} rows, lse")


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("nq", [17, 20, 33, 100, 259])
@pytest.mark.parametrize("threads", [1, 2])
def test_tiled_tail(isa, rng, stream, dtype, nq, threads, force):
    """The rows of the tiled kernel's last block past its last whole vector
    (17 = 16 + 1 on every path; 20 = 16 + 4 on AVX-512 and AVX2 float32, AVX-512
    float64; 100 and 259 past 96 and 256 in blocks of 128) take the row kernel
    after the block before them, on the same thread: against the reference with
    every option that moves a row's keys (causal either way, a window, kv_lengths,
    q_lengths whose padding falls in the tail or before it), masks of both kinds,
    softcap and ALiBi, GQA's folded rows, and the lse; the number of tail rows
    is the one the SIMD path's table gives (tail_rows).  The tail with the
    row kernel's prefetch for K and V from memory (forced on).  Then the
    tests' forced tiles and row-kernel limit, which keep the tiled kernel
    whole (no tail)."""
    tail = tail_rows(isa, dtype, nq)
    nk = 150
    q, k, v = rand(rng, (2, 3, nq, 40), dtype), rand(rng, (2, 3, nk, 40), dtype), rand(rng, (2, 3, nk, 24), dtype)
    force.reset_counts()
    check(q, k, v, num_threads=threads)
    assert force.tail_rows == 6 * tail
    check(q, k, v, causal=True, num_threads=threads)
    check(q, k, v, causal="upper_left", num_threads=threads)
    check(q, k, v, window=(9, 3), softcap=4.0, num_threads=threads)
    check(q, k, v, alibi_slopes=np.linspace(0.1, 1.0, 3), causal=True, num_threads=threads)
    check(q, k, v, mask=rng.random((nq, nk)) < 0.6, num_threads=threads)
    check(q, k, v, mask=np.where(rng.random((2, 1, nq, nk)) < 0.6, 0.0, -np.inf).astype(dtype),
          num_threads=threads)
    check(q, k, v, kv_lengths=np.array([[0, 7, nk], [nk - 1, 64, 1]]), causal=True, num_threads=threads)
    check(q, k, v, q_lengths=np.array([[nq, nq - 1, nq - tail - 1], [0, 16, nq]]), num_threads=threads)
    gq = rand(rng, (2, 6, nq, 40), dtype)   # 2 query heads a K/V head: rows folded by position
    check(gq, k, v, enable_gqa=True, causal=True, num_threads=threads)
    stream(1)
    force.reset_counts()
    check(q, k, v, mask=rng.random((nq, nk)) < 0.6, num_threads=threads)
    assert force.tail_rows == 6 * tail
    stream(-1)
    force.reset_counts()
    force.set(rows_max=1)
    try:
        check(q, k, v, causal=True, num_threads=threads)
    finally:
        force.set(rows_max=0)
    assert force.tail_rows == 0


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("bk", [32, 64])
@pytest.mark.parametrize("nq", [7, 16, 33])
@pytest.mark.parametrize("threads", [2, 3])
def test_split_keys_tiled_short_tiles(isa, rng, tiles, dtype, bk, nq, threads):
    """One head, more threads than items: the tiled kernel's keys are split and
    merged, with the key tiles it takes by default (64, and 32 from memory, forced
    here on K and V in cache); 3000 keys leave a partial last tile per split, and
    dv 128 and 20 leave register-tile tails."""
    tiles(0, bk)
    for dv in (128, 20):
        q, k, v = rand(rng, (1, nq, 40), dtype), rand(rng, (1, 3000, 40), dtype), rand(rng, (1, 3000, dv), dtype)
        check(q, k, v, dtype, num_threads=threads)
        check(q, k, v, dtype, causal=True, mask=rng.random((nq, 3000)) < 0.8, num_threads=threads)


@pytest.mark.parametrize("threads", [2, 3])
def test_split_with_masks_and_empty_splits(isa, mask_pack, rng, threads):
    nk = 3000
    q, k, v = rand(rng, (2, 16)), rand(rng, (nk, 16)), rand(rng, (nk, 8))
    mask = rng.random((2, nk)) < 0.3
    mask[:, 1000:] = False            # later splits see no key at all
    check(q, k, v, mask=mask, num_threads=threads)
    fmask = np.where(rng.random((1, nk)) < 0.5, 0.0, -np.inf).astype(F32)
    check(q, k, v, mask=fmask, num_threads=threads)
    mask[:] = False                    # every split empty: zeros, lse -inf
    out, lse = check(q, k, v, mask=mask, num_threads=threads)
    assert np.all(out == 0) and np.all(np.isneginf(lse))
    qn = q.copy()
    qn[1, 0] = np.nan                  # NaN survives the merge, in its row only
    out = fastattn.attention(qn, k, v, num_threads=threads)
    assert np.isnan(out[1]).all() and np.isfinite(out[0]).all()


@pytest.mark.parametrize("dtype", [F32, F64])
def test_split_tiled_kernel(isa, rng, dtype):
    """Many query rows but a single work item (n_q <= 64): the tiled kernel's
    partial results are merged too."""
    q, k, v = rand(rng, (40, 32), dtype), rand(rng, (4000, 32), dtype), rand(rng, (4000, 24), dtype)
    for threads in (1, 2, 4):
        check(q, k, v, num_threads=threads)
        check(q, k, v, causal=True, num_threads=threads)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("bk", [1, 3, 4, 5, 7, 64])
@pytest.mark.parametrize("nk", [1, 4, 9, 130])
def test_decode_pipeline_tiles(isa, rng, tiles, dtype, bk, nk):
    """One query row: the decode loop computes the scores of key tile t + 1 while
    it adds P . V of tile t (decode_step).  Key tiles forced to 1-64 keys, so that
    a tile or its next has a tail after the 4-key blocks; one tile or many; dk
    and dv with scalar columns (72, 40 and 3); every score modifier, applied per
    tile between the steps; and two heads with different kv lengths."""
    tiles(0, bk)
    q = rand(rng, (2, 1, 72), dtype)
    k = rand(rng, (2, nk, 72), dtype)
    for dv in (40, 3):
        v = rand(rng, (2, nk, dv), dtype)
        check(q, k, v, num_threads=1)
        check(q, k, v, mask=rng.random((2, 1, nk)) < 0.6, num_threads=1)
        check(q, k, v, mask=rng.standard_normal((1, nk)).astype(dtype), num_threads=1)
    check(q, k, v, softcap=2.0, num_threads=1)
    check(q, k, v, alibi_slopes=np.array([0.5, 0.125]), num_threads=1)
    check(q, k, v, window=(nk // 2, 0), causal=True, num_threads=1)
    check(q, k, v, kv_lengths=np.array([nk, (nk + 1) // 2]), num_threads=2)


def test_decode_batched_heads_with_mask(isa, rng):
    q, k, v = rand(rng, (2, 4, 1, 64)), rand(rng, (2, 4, 700, 64)), rand(rng, (2, 4, 700, 64))
    mask = rng.random((2, 1, 1, 700)) < 0.8
    check(q, k, v, mask=mask)
    check(q, k, v, mask=mask.astype(F32) - 1.0)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_bool_mask_tiles(isa, mask_pack, rng, dtype):
    """Bool masks are packed per key tile into bit words: tiles that forbid
    everything are skipped, tiles that allow everything need no masking, and
    the last word of a tile is partial."""
    nq, nk = 150, 1100
    q, k, v = rand(rng, (2, nq, 24), dtype), rand(rng, (2, nk, 24), dtype), rand(rng, (2, nk, 16), dtype)
    mask = np.ones((nq, nk), bool)
    mask[:, 0:300] = False                    # whole tiles forbidden for every row
    mask[:64, 600:] = False                   # a forbidden block for one query block
    mask[100:, 700:733] = rng.random((50, 33)) < 0.5   # a mixed patch crossing a word boundary
    check(q, k, v, mask=mask)
    check(q, k, v, mask=mask, causal=True)
    check(q, k, v, mask=np.asfortranarray(mask))           # column-major: strided words
    check(q, k, v, mask=mask[:, ::-1])                      # negative column stride
    check(q, k, v, mask=np.asfortranarray(mask)[::-1])      # column-major, negative row stride
    check(q, k, v, mask=np.asfortranarray(np.repeat(mask, 2, 0))[::2])   # row stride 2: element by element
    check(q, k, v, mask=np.broadcast_to(rng.random((nq, 1)) < 0.5, (nq, nk)))  # column stride 0
    kn = k.copy()
    kn[:, 10] = np.nan                        # NaN keys inside a skipped tile stay out
    out = fastattn.attention(q, kn, v, mask=mask)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("bq,bk", [(0, 0), (40, 72), (17, 37)])
def test_bool_mask_packed_bits(isa, mask_pack, tiles, rng, dtype, bq, bk):
    """The bool mask packed into bits once per call (mask_pack in attention.c) and
    read back per key tile: tiles that start inside a 32-key word (odd tile sizes,
    the band of a window or of causal rows, split keys), the last partial word,
    mask rows and leading dims broadcast in every combination, and the weights."""
    tiles(bq, bk)
    nq, nk = 70, 203                                        # 203 keys: six words and 11 bits
    q, k, v = rand(rng, (2, 3, nq, 16), dtype), rand(rng, (2, 3, nk, 16), dtype), rand(rng, (2, 3, nk, 8), dtype)
    for mshape in [(nq, nk), (1, nk), (2, 1, nq, nk), (1, 3, nq, nk), (2, 3, nq, nk), (2, 1, 1, nk), (3, 1, nk)]:
        mask = rng.random(mshape) < 0.6
        mask[..., 40:75] = False                            # a hidden stretch across a word boundary
        check(q, k, v, mask=mask)
        check(q, k, v, mask=mask, causal=True)
        check(q, k, v, mask=mask, window=(45, 3))
    mask = rng.random((nq, nk)) < 0.6
    check(q, k, v, mask=np.asfortranarray(mask)[::-1], causal="upper_left")   # strided rows and columns
    w = fastattn.attention_weights(q, k, mask=mask, window=(33, 0))
    assert_close(w, ref.attention_weights(q.astype(F64), k.astype(F64), mask=mask, window=(33, 0)), dtype)
    qd, kd, vd = rand(rng, (1, 2, 20, 16), dtype), rand(rng, (1, 2, 3000, 16), dtype), rand(rng, (1, 2, 3000, 8), dtype)
    check(qd, kd, vd, mask=rng.random((20, 3000)) < 0.5, num_threads=3)   # keys split across threads


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("bq,bk", [(0, 0), (40, 72), (17, 37)])
def test_float_mask_tiles(isa, fused, tiles, rng, dtype, bq, bk):
    """Float masks are read per key tile, transposed L keys by L rows in
    registers (mask_tile), and added to the scores, or, for the fused exp, to
    the accumulators of Q.K^T: every mask layout (contiguous rows, key padding
    broadcast over the rows, one value per row broadcast over the keys,
    column-major, a negative column stride, a negative row stride, neither
    stride unit), tiles whose query rows and keys
    are not whole vectors (an item of 30 rows in tiles of 40 pads to 64
    columns), a jump far above the reference max (the fused exp rescales),
    fully masked rows, and with causal, softcap and ALiBi."""
    tiles(bq, bk)
    nq, nk = 150, 1100
    q, k, v = rand(rng, (2, nq, 24), dtype), rand(rng, (2, nk, 24), dtype), rand(rng, (2, nk, 16), dtype)
    mask = rng.standard_normal((nq, nk)).astype(dtype)
    mask[rng.random((nq, nk)) < 0.2] = -np.inf
    mask[5] = -np.inf                         # a row that sees nothing
    check(q, k, v, mask=mask)
    check(q, k, v, mask=mask, causal=True)
    check(q, k, v, mask=np.asfortranarray(mask))           # column-major: strided reads
    check(q, k, v, mask=mask[:, ::-1])                      # negative column stride
    jump = mask.copy()
    jump[::3, 700:] += 60                     # far above the max so far, for every third row
    check(q, k, v, mask=jump)
    pad = np.zeros((1, nk), dtype)
    pad[:, 1000:] = -np.inf                   # key padding: the same row for every query
    pad[:, :1000] = rng.standard_normal(1000)
    check(q, k, v, mask=pad)
    check(q, k, v, mask=rng.standard_normal((nq, 1)).astype(dtype))   # column stride 0
    check(q, k, v, mask=mask, softcap=2.0)
    check(q, k, v, mask=mask, alibi_slopes=np.array([0.5, 0.25]), causal=True)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layout", ["full", "keys", "transposed"])
def test_float_mask_hidden_tiles(isa, fused, tiles, rng, dtype, threads, layout, force):
    """A key tile where a float mask is -inf for every row is skipped (its P.V
    too), and keys where it is -inf for every row are left out of P.V (tiles
    of 128 keys, the last one of 60 partly hidden: a tail of keys that are not a
    whole vector), so NaN and inf in their V rows never reach the fast
    kernels' output (no careful redo).  A tile is skipped only when no score
    there can be NaN or +inf (hidden_tile_skips): a NaN key, or one whose
    score overflows to +inf, makes the rows NaN as in the reference (NaN +
    -inf, +inf + -inf).  A causal float mask skips the tiles above the
    diagonal and agrees with causal=True."""
    tiles(64, 128)
    nq, nk = 150, 700
    q, k, v = rand(rng, (2, nq, 24), dtype), rand(rng, (2, nk, 24), dtype), rand(rng, (2, nk, 20), dtype)
    mask = rng.standard_normal((1 if layout == "keys" else nq, nk)).astype(dtype)
    mask[:, 512:698] = -np.inf                # the tile [512, 640), most of [640, 700)
    mask[:, 300:330] = -np.inf                # inside a tile that stays
    if layout == "transposed":                # the query axis contiguous: read element by element
        mask = np.asfortranarray(mask)
    vb = v.copy()
    for hidden in (slice(512, 698), slice(300, 330)):   # P.V leaves these keys out
        vb[:, hidden, ::2] = np.nan
        vb[:, hidden, 1::2] = np.inf
    force.reset_counts()
    out = check(q, k, vb, mask=mask, num_threads=threads)[0]
    assert force.redo_rows == 0
    assert np.isfinite(out).all()
    w = fastattn.attention_weights(q, k, mask=mask, num_threads=threads)
    assert_close(w, ref.attention_weights(q.astype(F64), k.astype(F64), mask=mask.astype(F64)), dtype, "weights")
    kb = k.copy()
    kb[0, 600, 3] = np.nan                    # NaN + -inf = NaN: every row of item 0
    out = check(q, kb, v, mask=mask, num_threads=threads)[0]
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()
    kb, qs = k.copy(), q.copy()
    kb[1, 650] = np.finfo(dtype).max / 2      # scores overflow there, in the dtype:
    qs[1, ::2] = np.abs(q[1, ::2])            # to +inf in the even rows (+inf + -inf = NaN),
    qs[1, 1::2] = -np.abs(q[1, 1::2])         # to -inf in the odd rows (hidden)
    out = fastattn.attention(qs, kb, v, mask=mask, num_threads=threads)
    assert np.isnan(out[1, ::2]).all() and np.isfinite(out[1, 1::2]).all() and np.isfinite(out[0]).all()
    assert_close(out, ref.attention(qs, kb, v, mask=mask), dtype)
    causal = np.triu(np.full((nq, nk), -np.inf, dtype), nk - nq + 1)
    out = check(q, k, v, mask=causal, num_threads=threads)[0]
    assert_close(out, fastattn.attention(q, k, v, causal=True, num_threads=threads), dtype)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("threads", [1, 2])
def test_abs_max(rng, dtype, threads):
    """_core.abs_max, the bound of the float mask conversion: max |x| in one
    threaded pass, for every length (the 16- and 8-element vector loops' tails,
    several work units), the max at either sign and any position, -0, inf; NaN
    anywhere gives NaN (and _float_mask._abs_max inf).  _abs_max takes NumPy's
    passes for other layouts and dtypes, with the same result."""
    from fastattn import _float_mask
    for n in (0, 1, 3, 7, 8, 9, 15, 16, 17, 100, (1 << 14) - 1, (1 << 14) + 5, 3 * (1 << 14) + 11, 700_001):
        x = rand(rng, n, dtype)
        want = float(np.abs(x).max()) if n else 0.0
        assert _core.abs_max(x, threads) == want, n
        if n > 300_000:                                      # enough work for a team
            assert _core.last_threads() == threads
        for pos in sorted({0, n // 2, n - 1}) if n else []:
            y = x.copy()
            for big in (dtype(-1e3), dtype(1e3)):
                y[pos] = big
                assert _core.abs_max(y, threads) == 1e3, (n, pos, big)
            y[pos] = -np.inf
            assert _core.abs_max(y, threads) == np.inf
            y[pos] = np.nan
            assert np.isnan(_core.abs_max(y, threads)), (n, pos)
            assert _float_mask._abs_max(y, threads) == np.inf
    assert _core.abs_max(np.array([-0.0, 0.0], dtype), threads) == 0.0
    x = rand(rng, (30, 40), dtype)
    for y in (x, x.T, x[:, ::3], x.astype(np.float16)):   # C, and NumPy's passes
        assert _float_mask._abs_max(y, threads) == float(np.abs(y).max())
    with pytest.raises(ValueError, match="abs_max"):
        _core.abs_max(x.T, threads)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("threads", [1, 2])
def test_mask_keep_pad_rows(rng, dtype, threads):
    """_core.mask_keep with pad: a row without a 0 that holds one constant c <=
    pad_floor throughout (a padding query row) passes and is marked, its keep all
    False; a row with a 0 or of only -inf is not marked; c above pad_floor, two
    constants, or c beside -inf fail.  Without pad such a row fails.  Rows of
    every length, many rows to a work unit and a row longer than one."""
    floor, pad_floor = -1000.0, -1e20
    for rows, n in ((1, 1), (4, 2), (7, 3), (6, 33), (2000, 17), (40, 1000), (3, (1 << 15) + 3)):
        x = np.where(rng.random((rows, n)) < 0.5, -1e9, 0.0).astype(dtype)
        x[:, rng.integers(0, n)] = 0.0                       # a 0 in each row
        pads = sorted({0, rows // 2, rows - 1})
        for r in pads:
            x[r] = np.finfo(dtype).min if r else pad_floor   # at pad_floor itself too
        if rows > 3:
            x[1] = -np.inf                                   # a row of only -inf: not a padding row
        keep, pad = np.ones(x.shape, bool), np.ones(rows, bool)
        assert _core.mask_keep(x, keep, floor, threads, pad, pad_floor), (rows, n)
        np.testing.assert_array_equal(keep, x == 0)
        np.testing.assert_array_equal(pad, np.isin(np.arange(rows), pads))
        assert not _core.mask_keep(x, keep, floor, threads)  # no pad: a row without a 0 fails
        assert not _core.mask_keep(x, keep, floor, threads, pad, -np.inf)
        r = pads[-1]
        others = [[np.nextafter(dtype(pad_floor), dtype(0))] * n]         # above pad_floor
        if n > 1:
            others += [[np.finfo(dtype).min] * (n - 1) + [-1e30],         # two constants
                       [-np.inf] + [np.finfo(dtype).min] * (n - 1)]       # beside -inf
        for other in others:
            y = x.copy()
            y[r] = np.asarray(other, dtype)
            assert not _core.mask_keep(y, keep, floor, threads, pad, pad_floor), (rows, n, other[0])
    with pytest.raises(ValueError, match="pad"):
        _core.mask_keep(x, keep, floor, threads, np.ones(rows + 1, bool), pad_floor)
    with pytest.raises(ValueError, match="pad_floor"):
        _core.mask_keep(x, keep, floor, threads, pad, 1.0)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("threads", [1, 2])
def test_mask_keep(rng, dtype, threads):
    """The C helper of the float mask conversion (_core.mask_keep): keep = x == 0
    and whether every entry is 0 or -inf, in one threaded pass, for every length
    (the vectorised loops' tails, several work units) and every special value:
    -0 is 0; +inf, NaN, denormals and the smallest normals are other values."""
    tiny = np.finfo(dtype).smallest_subnormal
    others = [np.inf, np.nan, tiny, -tiny, np.finfo(dtype).tiny, -1.0, np.finfo(dtype).min]
    for n in (0, 1, 2, 3, 5, 31, 32, 33, 1000, (1 << 15) + 1, 3 * (1 << 15) + 7):
        x = np.where(rng.random(n) < 0.5, -np.inf, 0.0).astype(dtype)
        x[rng.random(n) < 0.1] = -0.0
        keep = np.empty(n, bool)
        assert _core.mask_keep(x, keep, -np.inf, threads)
        np.testing.assert_array_equal(keep, x == 0)
        for pos in sorted({0, n // 2, n - 1}) if n else []:
            for other in others:
                y = x.copy()
                y[pos] = other
                keep = np.ones(n, bool)
                assert not _core.mask_keep(y, keep, -np.inf, threads), (n, pos, other)
                np.testing.assert_array_equal(keep, y == 0)
    x2 = np.triu(np.full((70, 90), -np.inf, dtype), 1)
    keep2 = np.empty(x2.shape, bool)
    assert _core.mask_keep(x2, keep2, -np.inf, threads)
    np.testing.assert_array_equal(keep2, x2 == 0)
    with pytest.raises(ValueError, match="mask_keep"):
        _core.mask_keep(x2, np.empty(5, bool), -np.inf, threads)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("threads", [1, 2])
def test_mask_keep_floor(rng, dtype, threads):
    """_core.mask_keep with a finite floor: an entry at most floor (finite or
    -inf) hides its key, anything between floor and 0 (or above 0, or NaN) makes
    the mask another one, and a row holding a finite entry <= floor needs a 0
    (a row of only -inf and 0s may hold no 0).  Rows of every length: the
    vectorised loops' tails, many rows to a work unit, a row longer than one."""
    floor = -1000.0
    lows = [floor, np.nextafter(dtype(floor), dtype(-np.inf)), -1e9, np.finfo(dtype).min]
    for rows, n in ((1, 1), (3, 2), (7, 3), (5, 33), (2000, 17), (40, 1000), (3, (1 << 15) + 3)):
        x = np.where(rng.random((rows, n)) < 0.5, np.asarray(lows, dtype)[rng.integers(0, 4, (rows, n))], 0.0)
        x = x.astype(dtype)
        x[rng.random((rows, n)) < 0.2] = -np.inf
        x[:, rng.integers(0, n, rows)[0]] = -0.0             # a 0 in each row
        keep = np.empty(x.shape, bool)
        assert _core.mask_keep(x, keep, floor, threads), (rows, n)
        np.testing.assert_array_equal(keep, x == 0)
        r = rows // 2
        for other in (np.nextafter(dtype(floor), dtype(0)), -1.0, 1.0, np.inf, np.nan):
            y = x.copy()
            y[r, n - 1] = other
            assert not _core.mask_keep(y, np.empty(x.shape, bool), floor, threads), (rows, n, other)
        y = x.copy()
        y[r] = floor                                          # a row without a 0: c + s, not hidden
        y[r, n // 2:] = -np.inf if n > 1 else floor
        assert not _core.mask_keep(y, keep, floor, threads), (rows, n)
        np.testing.assert_array_equal(keep, y == 0)
        y[r] = -np.inf                                        # all -inf: a row of zeros either way
        assert _core.mask_keep(y, keep, floor, threads), (rows, n)
        assert not _core.mask_keep(x, keep, -np.inf, threads) or (x != 0).sum() == np.isneginf(x).sum()


@pytest.mark.parametrize("dtype", [F32, F64])
def test_zero_or_neginf_float_mask_runs_as_bool(isa, rng, monkeypatch, dtype):
    """A float mask of only 0 and -inf (np.triu(np.full((n, n), -np.inf), 1))
    that the heads share reaches the C core as the bool mask `mask == 0`, but
    only where that gives the same result: no score can be NaN or +inf (q and
    k finite, d_k * max|q * scale| * max|k| within half the dtype's range,
    ALiBi slopes finite), else NaN + -inf = NaN would be lost.  Masks with
    another value, key-padding masks and masks too little reused (one per
    head) stay float.  Every case against the reference, and with the
    conversion turned off."""
    from fastattn import _float_mask
    from fastattn._prepare import _prepare
    h, n, d = 8, 100, 16
    q, k, v = rand(rng, (h, n, d), dtype), rand(rng, (h, n, d), dtype), rand(rng, (h, n, 12), dtype)
    causal = np.triu(np.full((n, n), -np.inf), 1)      # float64, as np.full makes it

    def kind(q, k, mask, **kw):
        return _prepare(q, k, v, mask, False, kw.get("scale"), False, None, None, kw.get("alibi_slopes"),
                        None, None).mask_kind

    def both(q, k, mask, **kw):
        """check() with the conversion on, then off: the same result."""
        out = check(q, k, v, dtype, mask=mask, **kw)[0]
        monkeypatch.setattr(_float_mask, "_FLOAT_MASKS_AS_BOOL", False)
        assert kind(q, k, mask, **kw) == _core.MASK_ADD
        assert_close(fastattn.attention(q, k, v, mask=mask, **kw), out, dtype)
        monkeypatch.setattr(_float_mask, "_FLOAT_MASKS_AS_BOOL", True)
        return out

    f_order = np.asfortranarray(causal.astype(dtype))   # not C-contiguous: NumPy's passes, not mask_keep
    for mask in (causal, causal.astype(dtype), np.where(causal == 0, -0.0, causal), f_order):
        assert kind(q, k, mask) == _core.MASK_BOOL
        out = both(q, k, mask)
        assert_close(out, fastattn.attention(q, k, v, causal=True), dtype)
    assert kind(q, k, causal, alibi_slopes=np.linspace(0.1, 1, h)) == _core.MASK_BOOL
    both(q, k, causal, alibi_slopes=np.linspace(0.1, 1, h))
    w = fastattn.attention_weights(q, k, mask=causal)
    assert_close(w, ref.attention_weights(q.astype(F64), k.astype(F64), mask=causal), dtype, "weights")

    mixed = causal.copy()
    mixed[n // 2, 3] = -1.0                   # one other value, in a middle row
    assert kind(q, k, mixed) == _core.MASK_ADD
    assert kind(q, k, np.asfortranarray(mixed)) == _core.MASK_ADD
    check(q, k, v, mask=mixed)
    inf_slopes = np.full(h, np.inf)
    assert kind(q, k, causal, alibi_slopes=inf_slopes) == _core.MASK_ADD
    pad = np.zeros((1, n))
    pad[:, 70:] = -np.inf                     # key padding: the float path reads it as cheaply
    assert kind(q, k, pad) == _core.MASK_ADD
    per_head = np.broadcast_to(causal, (h, n, n)).copy()   # read once per head: not worth a pass
    assert kind(q, k, per_head) == _core.MASK_ADD

    kn = k.copy()
    kn[3, 70, 0] = np.nan                     # NaN + -inf = NaN: every row of head 3
    assert kind(q, kn, causal) == _core.MASK_ADD
    out = both(q, kn, causal)
    assert np.isnan(out[3]).all() and np.isfinite(np.delete(out, 3, axis=0)).all()
    qi = q.copy()
    qi[2, 5, 1] = np.inf                      # inf q: its row NaN or inf, as in the reference
    assert kind(qi, k, causal) == _core.MASK_ADD
    both(qi, k, causal)
    ki = k.copy()
    ki[1, 90, 2] = np.inf                     # scale 0: 0 * inf = NaN scores, in every row of head 1
    assert kind(q, ki, causal, scale=0.0) == _core.MASK_ADD
    out = both(q, ki, causal, scale=0.0)
    assert np.isnan(out[1]).all() and np.isfinite(np.delete(out, 1, axis=0)).all()
    kb, qs = k.copy(), np.abs(q)
    kb[5, 80] = np.finfo(dtype).max / 2       # scores overflow to +inf in the dtype: +inf + -inf = NaN
    assert kind(qs, kb, causal) == _core.MASK_ADD
    out = fastattn.attention(qs, kb, v, mask=causal)
    assert np.isnan(out[5, :80]).all() and np.isfinite(np.delete(out, 5, axis=0)).all()
    assert_close(out, ref.attention(qs, kb, v, mask=causal.astype(dtype)), dtype)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_large_negative_float_mask_runs_as_bool(isa, rng, monkeypatch, dtype):
    """A float mask that hides keys with a large finite negative number (Hugging
    Face's np.finfo(dtype).min, -1e9, -1e4) and that the heads share reaches the
    C core as the bool mask `mask == 0` where that gives the same result: each
    hidden weight underflows to exactly 0 (the number below -(2 * max|score| +
    1024)) and each row with such a number has a 0.  A row without a 0, a number
    too close to 0 for the scores, causal, a window, kv_lengths, q_lengths or a
    non-finite v keep it float (a key it hides still adds its weight or its NaN
    there).  Every case against the reference, and with the conversion off."""
    from fastattn import _float_mask
    from fastattn._prepare import _prepare
    h, n, d = 8, 100, 16
    q, k, v = rand(rng, (h, n, d), dtype), rand(rng, (h, n, d), dtype), rand(rng, (h, n, 12), dtype)
    tril = np.tril(np.ones((n, n), bool))

    def kind(q, k, v, mask, **kw):
        return _prepare(q, k, v, mask, kw.get("causal", False), kw.get("scale"), False, kw.get("window"),
                        kw.get("softcap"), kw.get("alibi_slopes"), kw.get("kv_lengths"), None,
                        q_lengths=kw.get("q_lengths")).mask_kind

    def both(q, k, v, mask, want_kind, **kw):
        """The kind, check() with the conversion on, then off: the same result."""
        assert kind(q, k, v, mask, **kw) == want_kind
        out = check(q, k, v, dtype, mask=mask, **kw)[0]
        monkeypatch.setattr(_float_mask, "_FLOAT_MASKS_AS_BOOL", False)
        assert kind(q, k, v, mask, **kw) == _core.MASK_ADD
        assert_close(fastattn.attention(q, k, v, mask=mask, **kw), out, dtype)
        monkeypatch.setattr(_float_mask, "_FLOAT_MASKS_AS_BOOL", True)
        return out

    for c in (np.finfo(dtype).min, np.finfo(F32).min, -1e9, -1e4):
        mask = np.where(tril, 0.0, c).astype(dtype)
        out = both(q, k, v, mask, _core.MASK_BOOL)
        assert_close(out, fastattn.attention(q, k, v, causal="upper_left"), dtype)
        m2 = np.where(~tril & (rng.random((n, n)) < 0.5), -np.inf, mask)
        m2[5] = -np.inf                                                  # -inf as well, and a row of only -inf
        out = both(q, k, v, m2, _core.MASK_BOOL)
        assert (out[:, 5] == 0).all()
        both(q, k, v, np.asfortranarray(mask), _core.MASK_BOOL)         # NumPy's passes, not mask_keep
        both(q, k, v, mask, _core.MASK_BOOL, alibi_slopes=np.linspace(0.1, 1, h), softcap=5.0)
        w = fastattn.attention_weights(q, k, mask=mask)
        assert_close(w, ref.attention_weights(q.astype(F64), k.astype(F64), mask=mask.astype(F64)), dtype, "weights")
        assert (w[:, ~tril] == 0).all()
    mask = np.where(tril, 0.0, -1e4).astype(dtype)
    big = q * 80                                           # max|score| bound ~ 5000: -1e4 may not hide
    out = both(big, k, v, mask, _core.MASK_ADD)
    both(q, k, v, mask, _core.MASK_ADD, alibi_slopes=np.full(h, 60.0))   # ALiBi adds up to 60 * 200
    both(q, k, v, mask, _core.MASK_BOOL, alibi_slopes=np.full(h, 3.0))
    mixed = mask.copy()
    mixed[n // 2, -1] = -1000.0                             # above the floor: not a hidden entry
    both(q, k, v, mixed, _core.MASK_ADD)
    both(q, k, v, np.asfortranarray(mixed), _core.MASK_ADD)
    for kw in ({"causal": True}, {"window": (10, None)}, {"kv_lengths": n - 5}, {"q_lengths": n - 5}):
        both(q, k, v, np.where(tril, 0.0, -1e9).astype(dtype), _core.MASK_ADD, **kw)
    both(q, k, v, np.where(tril, 0.0, -np.inf).astype(dtype), _core.MASK_BOOL, causal=True)   # -inf: still bool

    pad = np.where(tril, 0.0, -1e9).astype(dtype)
    pad[:3] = -1e9                                          # padding query rows whose constant does not absorb
    assert kind(q, k, v, pad) == _core.MASK_ADD             # the scores: a softmax over c + s (see below)
    vn = v.copy()
    vn[2, n - 1, 0] = np.nan                                # seen by every row (at weight 0) of head 2
    out = both(q, k, vn, np.where(tril, 0.0, -1e9).astype(dtype), _core.MASK_ADD)
    assert np.isnan(out[2, :, 0]).all() and np.isfinite(np.delete(out, 2, axis=0)).all()
    monkeypatch.setattr(_float_mask, "_hidden_floor", lambda p, slopes, bound: (-1e4, -np.inf))
    for m in (mask, np.asfortranarray(mask)):   # an entry at the floor hides, in C and in NumPy's passes alike
        assert kind(q, k, v, m) == _core.MASK_BOOL


def hf_padded_mask(lengths, n, dtype, value=None):
    """Hugging Face's eager causal mask (B, 1, n, n) for left-padded sequences of
    the given lengths: 0 where a query sees a key, value (np.finfo(dtype).min)
    elsewhere, so that the padding query rows hold value throughout."""
    value = np.finfo(dtype).min if value is None else value
    j = np.arange(n)
    start = n - np.asarray(lengths)[:, None, None]            # the first real position of each sequence
    sees = (j[None, None, :] <= j[None, :, None]) & (j[None, None, :] >= start)
    return np.where(sees, 0.0, value).astype(dtype)[:, None]


@pytest.mark.parametrize("dtype", [F32, F64])
def test_padding_rows_of_large_negative_mask_run_as_bool(isa, rng, monkeypatch, dtype, force):
    """Hugging Face's eager masks with left padding: the padding query rows hold
    np.finfo(dtype).min throughout, which absorbs every score, so such a row
    attends every key alike (the mean of v, lse = c + log(n_k)).  The mask still
    goes as bool (the rows left empty by the C core, then filled): outputs, lse,
    weights, GQA, out= and the tile sizes against the reference and against the
    float path.  A constant that does not absorb the scores, two constants, or a
    constant beside -inf keep the mask float."""
    from fastattn import _float_mask
    from fastattn._prepare import _prepare
    B, H, n, d = 3, 4, 70, 16
    q, k, v = rand(rng, (B, H, n, d), dtype), rand(rng, (B, H, n, d), dtype), rand(rng, (B, H, n, 12), dtype)
    mask = hf_padded_mask([n, n - 9, 5], n, dtype)

    def kind(q, k, v, mask, **kw):
        return _prepare(q, k, v, mask, False, None, kw.get("enable_gqa", False), None, None,
                        kw.get("alibi_slopes"), None, None).mask_kind

    def float_path(f, *args, **kw):
        monkeypatch.setattr(_float_mask, "_FLOAT_MASKS_AS_BOOL", False)
        try:
            return f(*args, **kw)
        finally:
            monkeypatch.setattr(_float_mask, "_FLOAT_MASKS_AS_BOOL", True)

    assert kind(q, k, v, mask) == _core.MASK_BOOL
    out, lse = check(q, k, v, dtype, mask=mask)
    pad_rows = (mask == np.finfo(dtype).min).all(axis=-1)[:, 0]            # (B, n)
    assert pad_rows.sum() == 9 + n - 5
    mean = v.astype(F64).mean(axis=-2)                                     # (B, H, 12)
    assert_close(out[pad_rows[:, None].repeat(H, 1)], np.broadcast_to(mean[:, :, None], out.shape)[
        pad_rows[:, None].repeat(H, 1)], dtype)                            # a uniform average, not zeros
    want_out, want_lse = float_path(fastattn.attention, q, k, v, mask=mask, return_lse=True)
    assert_close(out, want_out, dtype)
    assert_close(lse, want_lse, dtype, "lse")
    assert np.all(lse[pad_rows[:, None].repeat(H, 1)] == np.finfo(dtype).min)   # c + log(n_k) rounds to c
    for bq, bk in ((16, 16), (32, 64)):                                   # tails of query and key tiles
        force.set(bq=bq, bk=bk)
        try:
            assert_close(fastattn.attention(q, k, v, mask=mask), out, dtype)
        finally:
            force.set(bq=0, bk=0)
    w = fastattn.attention_weights(q, k, mask=mask)
    assert_close(w, ref.attention_weights(q.astype(F64), k.astype(F64), mask=mask.astype(F64)), dtype, "weights")
    assert_close(w, float_path(fastattn.attention_weights, q, k, mask=mask), dtype, "weights")
    assert np.all(w[pad_rows[:, None].repeat(H, 1)] == dtype(1) / dtype(n))
    dst = np.full((B, H, n, 24), np.nan, dtype)[..., ::2]                   # out= with strides
    fastattn.attention(q, k, v, mask=mask, out=dst)
    assert_close(dst, out, dtype)
    kg, vg = k[:, :2], v[:, :2]                                           # GQA: 4 query heads on 2
    assert kind(q, kg, vg, mask, enable_gqa=True) == _core.MASK_BOOL
    out = check(q, kg, vg, dtype, mask=mask, enable_gqa=True)[0]
    assert_close(out, float_path(fastattn.attention, q, kg, vg, mask=mask, enable_gqa=True), dtype)
    out = check(q, k, v, dtype, mask=mask, alibi_slopes=np.linspace(0.1, 1, H))   # ALiBi adds to the bound
    assert kind(q, k, v, mask, alibi_slopes=np.linspace(0.1, 1, H)) == _core.MASK_BOOL

    for value in (-1e17, -1e12, -1e9, -1e4):         # absorbs no score: a softmax over c + s, not a mean
        m = hf_padded_mask([n, n - 9, 5], n, dtype, value)
        assert kind(q, k, v, m) == _core.MASK_ADD
        if dtype is F64 and value > -1e10:               # (-1e12 + s rounds s to 1e-4)
            check(q, k, v, dtype, mask=m)
    for row in ([np.finfo(dtype).min] * (n - 1) + [-1e30],              # two constants
                [-np.inf] + [np.finfo(dtype).min] * (n - 1)):           # beside -inf
        m = mask.copy()
        m[2, 0, 0] = np.asarray(row, dtype)
        assert kind(q, k, v, m) == _core.MASK_ADD
        assert kind(q, k, v, np.asfortranarray(m[:, 0])[:, None]) == _core.MASK_ADD   # NumPy's passes
        check(q, k, v, dtype, mask=m)
    m = mask.copy()
    m[2, 0, 0] = -np.inf                                    # only -inf: the row sees nothing, as before
    assert kind(q, k, v, m) == _core.MASK_BOOL
    out = check(q, k, v, dtype, mask=m)[0]
    assert np.all(out[2, :, 0] == 0)
    if dtype is F32:                                        # a float64 constant beyond float32's range
        m = mask.astype(F64)
        m[m != 0] = -1e300                                  # is -inf in float32: those rows see nothing
        assert kind(q, k, v, m) == _core.MASK_BOOL
        out = fastattn.attention(q, k, v, mask=m)
        with np.errstate(over="ignore"):                    # the float path casts the mask (NumPy warns)
            assert_close(out, float_path(fastattn.attention, q, k, v, mask=m), dtype)
        assert np.all(out[pad_rows[:, None].repeat(H, 1)] == 0)
    with warnings.catch_warnings():                         # float16's -65504 absorbs nothing here,
        warnings.simplefilter("error")                      # and NumPy's passes compare it without
        assert kind(q, k, v, hf_padded_mask([n, 5, 9], n, np.float16)) == _core.MASK_ADD   # overflow
    fm = np.asfortranarray(mask[:, 0])[:, None]             # NumPy's passes, not mask_keep
    assert not fm.flags.c_contiguous and kind(q, k, v, fm) == _core.MASK_BOOL
    assert_close(fastattn.attention(q, k, v, mask=fm), fastattn.attention(q, k, v, mask=mask), dtype)


# ---------------------------------------------------------------------------
# layout="blhd": q, k, v and the result (..., n, H, d), as flash-attn and JAX
# ---------------------------------------------------------------------------
def _heads_last(a):
    """(..., H, n, d) -> (..., n, H, d), C-contiguous: the arrays as flash-attn and JAX lay them out."""
    return np.ascontiguousarray(np.swapaxes(a, -3, -2))


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
    q, k, v = _heads_last(qh), _heads_last(kh), _heads_last(vh)
    kvl = rng.integers(1, nk + 1, (B, 1))
    for kw in (dict(), dict(causal=True), dict(mask=rng.random((B, 1, nq, nk)) < 0.8, window=(40, 3)),
               dict(kv_lengths=kvl, alibi_slopes=np.linspace(0.01, 0.1, H), softcap=5.0),
               dict(q_lengths=np.minimum(kvl, nq), kv_lengths=kvl, causal=True)):
        out, lse = fastattn.attention(q, k, v, layout="blhd", return_lse=True, num_threads=threads, **kw)
        want, want_lse = reference64(qh, kh, vh, **kw)
        assert out.shape == (B, nq, H, 12) and out.dtype == dtype and out.flags.c_contiguous
        assert_close(out, _heads_last(want), dtype)
        assert lse.shape == (B, H, nq)                                       # head-major, as flash-attn's
        assert_close(lse, want_lse, dtype, "lse")
        assert np.array_equal(out, _heads_last(fastattn.attention(qh, kh, vh, num_threads=threads, **kw)))

    kg, vg = kh[:, :Hkv], vh[:, :Hkv]                                        # GQA: 4 query heads on 2
    out = fastattn.attention(q, _heads_last(kg), _heads_last(vg), layout="blhd", enable_gqa=True, causal=True,
                             num_threads=threads)
    assert_close(out, _heads_last(reference64(qh, kg, vg, enable_gqa=True, causal=True)[0]), dtype)

    want = _heads_last(reference64(qh, kh, vh, causal=True)[0])
    for dst in (np.empty((B, nq, H, 12), dtype), np.full((B, nq, H, 24), np.nan, dtype)[..., ::2]):
        assert fastattn.attention(q, k, v, layout="blhd", causal=True, out=dst, num_threads=threads) is dst
        assert_close(dst, want, dtype)

    qkv = rand(rng, (B, nq, 3, H, d), dtype)                                 # a packed projection, split by views
    qs, ks, vs = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert_close(fastattn.attention(qs, ks, vs, layout="blhd"),
                 _heads_last(reference64(*(np.swapaxes(a, 1, 2) for a in (qs, ks, vs)))[0]), dtype)
    out = fastattn.attention(q[0], k, v, layout="blhd")                      # (nq, H, d) against (B, nk, H, d)
    assert out.shape == (B, nq, H, 12)
    assert_close(out, _heads_last(reference64(qh[0], kh, vh)[0]), dtype)

    w = fastattn.attention_weights(q, k, layout="blhd", causal=True)
    assert w.shape == (B, H, nq, nk)
    assert_close(w, ref.attention_weights(qh.astype(F64), kh.astype(F64), causal=True), dtype, "weights")




@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("B,nk", [(1, 2), (2, 7), (1, 150), (1, 1030), (3, 1100)])
@pytest.mark.parametrize("threads", [1, 2])
def test_group_rows(isa, rng, group, dtype, B, nk, threads, force):
    """Decoding from a (B, n, H, d) cache with the heads of a batch entry taken
    together, key tile by key tile (forced on: by default only from memory):
    against the reference with every option that moves a row's keys (causal, a
    window, kv_lengths per batch entry and per head, q_lengths that leave a row
    out), masks of both kinds, softcap, ALiBi and the lse; a key tile past the
    last whole one (nk 1, 7, 150, 1030), split keys (one batch entry, or three on
    two threads) and a dv that is no whole number of vectors.  inf and NaN values
    where a row sees them and where only a mask hides them (the careful redo).
    130 heads run as three groups (at most 64 a group), whose keys two threads
    split when there are 1024 or more.  Not with more than 8 query rows an
    item (test_group_rows_several), nor head-major K and V: counted by
    _take_group_count."""
    group(1)
    H, d, dv = 5, 24, 12
    qh, kh, vh = rand(rng, (B, H, 1, d), dtype), rand(rng, (B, H, nk, d), dtype), rand(rng, (B, H, nk, dv), dtype)
    q, k, v = _heads_last(qh), _heads_last(kh), _heads_last(vh)

    def both(**kw):
        force.reset_counts()
        out, lse = fastattn.attention(q, k, v, layout="blhd", return_lse=True, num_threads=threads, **kw)
        assert force.group_runs >= 1
        want, want_lse = reference64(qh, kh, vh, **kw)
        assert_close(out, _heads_last(want), dtype)
        assert_close(lse, want_lse, dtype, "lse")

    both()
    both(causal=True, alibi_slopes=np.linspace(0.01, 0.5, H))
    both(window=(nk // 3, 0), softcap=3.0, kv_lengths=rng.integers(0, nk + 1, (B, 1)))
    both(kv_lengths=rng.integers(0, nk + 1, (B, H)), q_lengths=np.array([[1], [0], [1]])[:B])
    both(mask=rng.random((B, 1, 1, nk)) < 0.7)
    both(mask=np.where(rng.random((B, H, 1, nk)) < 0.6, 0.0, -np.inf).astype(dtype))
    hide = rng.random((B, 1, 1, nk)) < 0.5
    hide[..., 0] = False
    vh[..., hide[0, 0, 0], 1] = np.inf                                  # only hidden keys: the result is finite
    v = _heads_last(vh)
    both(mask=~hide)
    vh[0, 1, -1, 0] = np.nan                                            # a row sees it: NaN there
    v = _heads_last(vh)
    both()

    qw, kw_, vw = rand(rng, (1, 1, 130, 8), dtype), rand(rng, (1, nk, 130, 8), dtype), rand(rng, (1, nk, 130, 8), dtype)
    force.reset_counts()
    out = fastattn.attention(qw, kw_, vw, layout="blhd", num_threads=threads)
    assert force.group_runs == 3 * (2 if threads == 2 and nk >= 1024 else 1)   # 3 groups: split in 2
    want = reference64(*(np.swapaxes(a, 1, 2) for a in (qw, kw_, vw)))[0]
    assert_close(out, np.swapaxes(want, 1, 2), dtype)

    for qq, kk, vv, lay in ((rand(rng, (B, 9, H, d), dtype), k, v, "blhd"), (qh, kh, vh, "bhld")):
        force.reset_counts()
        fastattn.attention(qq, kk, vv, layout=lay, num_threads=threads)
        assert force.group_runs == 0
    group(0)
    force.reset_counts()
    fastattn.attention(q, k, v, layout="blhd", num_threads=threads)
    assert force.group_runs == 0


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("B,nk", [(1, 2), (2, 7), (1, 150), (1, 1030), (3, 1100)])
@pytest.mark.parametrize("threads", [1, 2])
def test_group_rows_several(isa, rng, group, rows_max, dtype, B, nk, threads, force):
    """The group row kernel (forced on) for items of several query rows: a few
    new tokens a head (2, 3 and 8, the most it takes; causal, so that the rows
    see different keys) and GQA's heads folded into one item's rows (2 and 4
    query heads a key/value head).  Against the reference with the options of
    test_group_rows (q_lengths leave rows out), inf only a mask hides and NaN a
    row sees.  Its key tiles hold 64 keys here: nk 150, 1030 and 1100 end in a
    partial one.  The heads go into groups of at most 64 rows: 40 heads of 3
    rows run as two groups.  The row kernel is forced up to 8 rows (some paths
    give 8 rows the tiled kernel by default)."""
    group(1)
    rows_max(8)
    H, d, dv = 5, 24, 12

    def check(nq, hq=H, nkv=nk, **kw):
        qh = rand(rng, (B, hq, nq, d), dtype)
        kh, vh = rand(rng, (B, H, nkv, d), dtype), rand(rng, (B, H, nkv, dv), dtype)
        if kw.pop("inf_hidden", False):                     # only hidden keys hold inf: finite results
            hide = rng.random((B, 1, 1, nkv)) < 0.5
            hide[..., 0] = False
            vh[..., hide[0, 0, 0], 1] = np.inf
            kw["mask"] = ~hide
        if kw.pop("nan_seen", False):
            vh[0, 1, -1, 0] = np.nan
        force.reset_counts()
        out, lse = fastattn.attention(_heads_last(qh), _heads_last(kh), _heads_last(vh), layout="blhd",
                                      return_lse=True, num_threads=threads, enable_gqa=hq != H, **kw)
        count = force.group_runs
        assert count >= 1
        want, want_lse = reference64(qh, kh, vh, enable_gqa=hq != H, **kw)
        assert_close(out, _heads_last(want), dtype)
        assert_close(lse, want_lse, dtype, "lse")

    check(3)
    check(2, causal=True)
    check(8, causal=True, alibi_slopes=np.linspace(0.01, 0.5, H))
    check(3, causal=True, window=(nk // 3, 0), softcap=3.0, kv_lengths=rng.integers(0, nk + 1, (B, 1)))
    check(3, causal=True, kv_lengths=rng.integers(0, nk + 1, (B, H)), q_lengths=np.array([[2], [0], [3]])[:B])
    check(3, mask=rng.random((B, 1, 3, nk)) < 0.7)
    check(2, mask=np.where(rng.random((B, H, 2, nk)) < 0.6, 0.0, -np.inf).astype(dtype))
    check(3, causal=True, inf_hidden=True)
    check(2, nan_seen=True)
    check(1, hq=2 * H)                                      # GQA: 2 rows an item
    check(1, hq=4 * H, causal=True, kv_lengths=rng.integers(0, nk + 1, (B, 1)))
    check(2, hq=4 * H, causal=True)                         # 8 rows an item
    check(1, hq=2 * H, mask=rng.random((B, 1, 1, nk)) < 0.7)
    check(1, hq=2 * H, inf_hidden=True)

    qw, kw_, vw = rand(rng, (1, 3, 40, 8), dtype), rand(rng, (1, nk, 40, 8), dtype), rand(rng, (1, nk, 40, 8), dtype)
    force.reset_counts()
    out = fastattn.attention(qw, kw_, vw, layout="blhd", causal=True, num_threads=threads)
    assert force.group_runs == 2                   # 120 rows: 2 groups (a thread each)
    want = reference64(*(np.swapaxes(a, 1, 2) for a in (qw, kw_, vw)), causal=True)[0]
    assert_close(out, np.swapaxes(want, 1, 2), dtype)


@pytest.mark.parametrize("nq", [1, 3])
def test_group_rows_empty_head_dims(isa, group, nq, force):
    """d_k = d_v = 0 from views whose heads lie apart (slices of a wider cache),
    with the group kernel forced: every key scores 0, so the lse is log(n_k) and
    the output has no columns (as the reference), and no key tile is sized by
    zero bytes a key."""
    group(1)
    wide = np.ones((1, 5, 4, 8), F32)
    q, k, v = np.ones((1, nq, 4, 8), F32)[..., :0], wide[..., :0], wide[..., 1:1]
    force.reset_counts()
    out, lse = fastattn.attention(q, k, v, layout="blhd", return_lse=True, causal=nq > 1)
    assert force.group_runs == 1
    want, want_lse = reference64(*(np.swapaxes(a, 1, 2) for a in (q, k, v)), causal=nq > 1)
    assert out.shape == (1, nq, 4, 0)
    assert_close(lse, want_lse, F32, "lse")


def test_group_rows_default(rng, force):
    """By default the heads of a (B, n, H, d) cache are taken together only when
    K and V come from memory (beyond 48 MiB): then against the reference, with one
    query row a head and with GQA's two query heads a key/value head folded into
    one item's rows (d64: whole vectors, and the next tiles prefetched in step)."""
    q, k, v = rand(rng, (1, 1, 16, 64)), rand(rng, (1, 6200, 16, 64)), rand(rng, (1, 6200, 16, 64))
    force.reset_counts()
    out = fastattn.attention(q, k, v, layout="blhd", num_threads=2)
    assert force.group_runs == 2                    # one group, its keys split between the threads
    want = reference64(*(np.swapaxes(a, 1, 2) for a in (q, k, v)))[0]
    assert_close(out, np.swapaxes(want, 1, 2), F32)
    q2 = rand(rng, (1, 1, 32, 64))
    force.reset_counts()
    out = fastattn.attention(q2, k, v, layout="blhd", enable_gqa=True, causal=True, num_threads=2)
    assert force.group_runs == 2                    # 16 items of 2 rows: one group, split
    want = reference64(*(np.swapaxes(a, 1, 2) for a in (q2, k, v)), enable_gqa=True, causal=True)[0]
    assert_close(out, np.swapaxes(want, 1, 2), F32)
    force.reset_counts()
    fastattn.attention(q, k[:, :1000], v[:, :1000], layout="blhd", num_threads=2)
    assert force.group_runs == 0


def test_layout_errors(rng):
    """A layout other than "bhld" and "blhd" (any case), an input of fewer than 3
    dims with "blhd", and out= in the other layout raise, naming what was wrong."""
    q, k, v = rand(rng, (2, 5, 3, 8)), rand(rng, (2, 6, 3, 8)), rand(rng, (2, 6, 3, 4))
    for bad in ("bshd", "", "bhl"):
        with pytest.raises(ValueError, match=f'layout must be "bhld" .* or "blhd" .*, got {bad!r}'):
            fastattn.attention(q, k, v, layout=bad)
        with pytest.raises(ValueError, match="layout must be"):
            fastattn.attention_weights(q, k, layout=bad)
    with pytest.raises(TypeError, match='layout must be "bhld" or "blhd", got NoneType'):
        fastattn.attention(q, k, v, layout=None)
    with pytest.raises(ValueError, match=r'layout="blhd" takes k of shape \(\.\.\., n, H, d\), got shape \(6, 8\)'):
        fastattn.attention(q, k[0, :, 0], v, layout="blhd")
    with pytest.raises(ValueError, match=r'layout="blhd" takes q of shape .*, got shape \(8,\)'):
        fastattn.attention_weights(q[0, 0, 0], k, layout="blhd")
    with pytest.raises(ValueError, match=r"out has shape \(2, 3, 5, 4\), the result has shape \(2, 5, 3, 4\)"):
        fastattn.attention(q, k, v, layout="blhd", out=np.empty((2, 3, 5, 4), F32))
    assert np.array_equal(fastattn.attention(q, k, v, layout="BLHD"), fastattn.attention(q, k, v, layout="blhd"))
    qh, kh, vh = (np.swapaxes(a, 1, 2) for a in (q, k, v))
    assert np.array_equal(fastattn.attention(qh, kh, vh, layout="BHLD"), fastattn.attention(qh, kh, vh))
    # the other errors name the shapes as given, in that layout
    with pytest.raises(ValueError, match=r"d_k differs: q has shape \(2, 5, 3, 8\) \(d_k=8\), "
                                         r"k has shape \(2, 6, 3, 4\)"):
        fastattn.attention(q, k[..., :4], v, layout="blhd")
    with pytest.raises(ValueError, match=r"n_k differs: k has shape \(2, 6, 3, 8\) \(n_k=6\), "
                                         r"v has shape \(2, 4, 3, 4\)"):
        fastattn.attention(q, k, v[:, :4], layout="blhd")
    with pytest.raises(ValueError, match=r"k and v have different head counts: k \(2, 6, 3, 8\), v \(2, 6, 1, 4\)"):
        fastattn.attention(q, k, v[:, :, :1], layout="blhd", enable_gqa=True)
    with pytest.raises(ValueError, match=r"leading dims do not broadcast: q \(2, 5, 3, 8\), k \(2, 6, 2, 8\)"):
        fastattn.attention_weights(q, k[:, :, :2], layout="blhd")


def test_gqa_hint(rng):
    """Fewer key/value heads than query heads, dividing them, without enable_gqa:
    the error says to pass enable_gqa=True (in either layout, and for the weights);
    not when they do not divide, or when enable_gqa is already given."""
    q, k, v = rand(rng, (2, 4, 5, 8)), rand(rng, (2, 2, 6, 8)), rand(rng, (2, 2, 6, 4))
    hint = r"\(q has 4 heads, k and v 2: for grouped-query attention pass enable_gqa=True\)"
    with pytest.raises(ValueError, match=r"leading dims do not broadcast: q \(2, 4, 5, 8\), .*" + hint):
        fastattn.attention(q, k, v)
    with pytest.raises(ValueError, match=r"q \(2, 5, 4, 8\), k \(2, 6, 2, 8\), v \(2, 6, 2, 4\) " + hint):
        fastattn.attention(*(np.swapaxes(a, 1, 2) for a in (q, k, v)), layout="blhd")
    with pytest.raises(ValueError, match=r"\(q has 4 heads, k 2: for grouped-query attention pass enable_gqa=True\)"):
        fastattn.attention_weights(q, k)
    assert fastattn.attention(q, k, v, enable_gqa=True).shape == (2, 4, 5, 4)
    for kk, vv in ((k[:, :1].repeat(3, 1), v[:, :1].repeat(3, 1)),   # 3 does not divide 4
                   (k[:1, :1], v[:1, :2]),                           # k and v differ
                   (rand(rng, (3, 4, 6, 8)), rand(rng, (3, 4, 6, 4)))):  # the heads agree, the batch not
        with pytest.raises(ValueError, match="leading dims do not broadcast") as e:
            fastattn.attention(q, kk, vv)
        assert "enable_gqa" not in str(e.value)
