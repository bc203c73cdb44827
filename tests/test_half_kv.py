"""16-bit K and V (float16 and ml_dtypes' bfloat16), read as they are stored.

The row and group kernels widen them to float32 as they load them (src_c/kernel/simd.h,
vload_kv); the tiled and weights kernels widen a leading index's keys into their scratch
once a thread (src_c/kernel/tiled.h, kv_rows_widened), or a key tile at a time.  Every
path, on every SIMD path, against the float64 reference on the same (rounded) values,
within float32's tolerance: 16-bit inputs compute in and give float32.
"""

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_close, rand, reference64
from helpers import F32, F64, check, check_varlen, heads_last, packed, run_script, team_check

import fastattn
from fastattn import _core
from fastattn import reference as ref

BF16 = np.dtype(ml_dtypes.bfloat16)
HALF = [np.dtype(np.float16), BF16]
HALF_IDS = ["float16", "bfloat16"]


def half(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_widen_every_value(isa, dtype):
    """The path's widening (F16C, AVX-512 or the portable integer one) gives every one
    of the 65,536 16-bit values exactly: subnormals, infinities and NaN included."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    x = bits.view(dtype)
    got = _core.kv_widen(x)
    want = x.astype(F32)
    nan = np.isnan(want)
    assert np.isnan(got[nan]).all()
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    for n in (1, 7, 17, 33):   # the tails past whole vectors
        np.testing.assert_array_equal(_core.kv_widen(x[1000:1000 + n]), want[1000:1000 + n])


# (n_q, n_k): decoding, a few rows (the row kernel), the tiled kernel with two or more
# query blocks a leading index (its keys widened once for them; 200 rows are two or more
# blocks past any tail with each built-in table), with one query block (a key tile
# widened at a time), and split keys on either (forced: partials of 512 keys, merged)
_SHAPES = {"decode": (1, 700), "rows": (3, 300), "tiled": (200, 200), "tiled_one_block": (16, 200),
           "split": (2, 2100), "tiled_split": (70, 2100)}
_OPTIONS = {
    "plain": {},
    "causal": {"causal": True},
    "bool_mask": "bool",
    "float_mask": "float",
    "lengths": "kv_lengths",
    "window_softcap_alibi": {"window": (150, 0), "softcap": 4.0, "alibi_slopes": np.array([0.02, 0.05])},
}


def _options(rng, name, nq, nk):
    o = _OPTIONS[name]
    if o == "bool":
        return {"mask": rng.random((2, 1, nq, nk)) < 0.8}
    if o == "float":
        m = np.where(rng.random((1, 2, nq, nk)) < 0.8, rng.standard_normal((1, 2, nq, nk)), -np.inf)
        return {"mask": m.astype(F32)}
    if o == "kv_lengths":
        return {"kv_lengths": np.array([[nk // 3], [nk]])}
    return dict(o)


@pytest.mark.parametrize("opt", list(_OPTIONS))
@pytest.mark.parametrize("path", list(_SHAPES))
@pytest.mark.parametrize("q16", [False, True], ids=["q32", "q16"])
@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_paths(isa, rng, force, dtype, q16, path, opt):
    """float32 q, or q of K's 16-bit dtype (read as stored too), with a 16-bit K and V
    on each kernel (the plan's: rows or tiled), with the options: the float32 result of
    the rounded values, on 1 and 2 threads."""
    nq, nk = _SHAPES[path]
    d, dv = 72, 40   # not whole vectors: the scalar tails convert too
    q = half(rng, (2, 2, nq, d), dtype) if q16 else rand(rng, (2, 2, nq, d))
    k, v = half(rng, (2, 2, nk, d), dtype), half(rng, (2, 2, nk, dv), dtype)
    kw = _options(rng, opt, nq, nk)
    if path.endswith("split"):
        force.set(split_keys=512)   # partials of at most 512 keys, merged
    plan = fastattn._attention._plan(q, k, v, num_threads=2, **kw)
    assert plan["kernel"] == ("tiled" if path.startswith("tiled") else "rows")
    assert plan["n_splits"] > 1 if path.endswith("split") and opt != "lengths" else True
    if path == "tiled_one_block":
        assert plan["kv_rows"] == plan["bk"]
    else:   # a leading index's keys (or its window's span), past one key tile; none on the row kernel
        assert plan["kv_rows"] > plan["bk"] if path.startswith("tiled") else plan["kv_rows"] == 0
    out, _ = check(q, k, v, F32, num_threads=(1, 2), **kw)
    assert out.dtype == F32


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("nq", [4, 5, 6, 9, 12])
def test_row_kernel_four_rows_at_a_time(isa, rng, force, dtype, nq):
    """The row kernel's scores of four rows at a time over 16-bit K (16-register
    paths: rows_scores_4x2), then the rest, with a tail of the head dim past whole
    vectors and of the keys past fours; up to 12 rows (the avx2 table's rows_max_kv)."""
    d = 68
    q = rand(rng, (2, 2, nq, d))
    k, v = half(rng, (2, 2, 303, d), dtype), half(rng, (2, 2, 303, 40), dtype)
    force.set(rows_max=12)
    assert fastattn._attention._plan(q, k, v)["kernel"] == "rows"
    check(q, k, v, F32, num_threads=(1, 2), causal=True)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("d, dv", [(128, 128), (72, 40), (256, 136)])
@pytest.mark.parametrize("far", [0, 1])
def test_decoding_from_memory(isa, rng, force, tuning, dtype, d, dv, far):
    """Decoding a 16-bit K and V as from memory (far forced) and as in cache: several
    key tiles with a tail past fours, dv with a rest of vectors and of scalars; a bool
    mask and kv lengths, on 1 and 2 threads.  decode_inorder does not reach them
    (measured slower for 16-bit K and V: docs/tuning.md, decode_inorder)."""
    tuning(decode_inorder=1)
    force.set(far=far, decode_pf=1, bk=64)
    q = rand(rng, (2, 2, 1, d))
    k, v = half(rng, (2, 2, 301, d), dtype), half(rng, (2, 2, 301, dv), dtype)
    p = fastattn._attention._plan(q, k, v)
    assert p["kernel"] == "rows" and p["far"] == bool(far) and not p["inorder"]
    check(q, k, v, F32, num_threads=(1, 2))
    check(q, k, v, F32, num_threads=(1, 2), mask=rng.random((2, 1, 1, 301)) < 0.8)
    check(q, k, v, F32, num_threads=(1, 2), kv_lengths=np.array([[150], [301]]))


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("nq", [1, 4, 40])
@pytest.mark.parametrize("touch", [0, 1])
def test_gqa_and_blhd_cache(isa, rng, force, dtype, nq, touch):
    """GQA (the fold: a group's heads as one item's rows) and a (B, n, H, d) cache (the
    group kernel, items interleaved), decoding and a few rows, from 16-bit caches;
    the group kernel's next tile read ahead by loads or software prefetch, and one
    row with a mask (the tiles, not the chunks)."""
    B, H, Hkv, nk, d = 2, 8, 2, 600, 64
    q = rand(rng, (B, H, nq, d))
    k, v = half(rng, (B, Hkv, nk, d), dtype), half(rng, (B, Hkv, nk, d), dtype)
    check(q, k, v, F32, num_threads=(1, 2), enable_gqa=True, causal=True)
    check(q.astype(dtype), k, v, F32, enable_gqa=True, kv_lengths=np.array([[nk // 2], [nk]]))
    qb, kb, vb = heads_last(q), heads_last(half(rng, (B, H, nk, d), dtype)), heads_last(half(rng, (B, H, nk, d), dtype))
    force.set(group=1, group_touch=touch).reset_counts()
    got = fastattn.attention(qb, kb, vb, layout="blhd")
    want = reference64(q, np.swapaxes(kb, 1, 2), np.swapaxes(vb, 1, 2))[0]
    assert_close(got, heads_last(want), F32)
    mask = rng.random((B, 1, nq, nk)) < 0.7
    got = fastattn.attention(qb, kb, vb, layout="blhd", mask=mask, num_threads=2)
    want = reference64(q, np.swapaxes(kb, 1, 2), np.swapaxes(vb, 1, 2), mask=mask)[0]
    assert_close(got, heads_last(want), F32)
    got = fastattn.attention(qb.astype(dtype), kb, vb, layout="blhd")   # 16-bit q too
    want = reference64(q.astype(dtype), np.swapaxes(kb, 1, 2), np.swapaxes(vb, 1, 2))[0]
    assert_close(got, heads_last(want), F32)
    if nq == 1:
        assert force.group_runs > 0


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("nk", [150, 1030])
@pytest.mark.parametrize("pipe", [1, 8])
def test_group_chunks_several_rows(isa, rng, force, tuning, dtype, nk, pipe):
    """Items of several rows in the group kernel's chunks (group_chunks_rows on) from
    16-bit (B, n, H, d) caches: GQA's four query heads a K and V head folded (one
    position), and three tokens a head without causal; one and two threads (nk 1030:
    split keys); P . V by pv_rx4 where pipe_rows covers the rows (pipe 8) and by
    rows_pv's tiles (pipe 1).  bfloat16 takes the chunks on every path, float16 on
    avx2 only (group_step elsewhere: group.h)."""
    tuning(group_chunks_rows=1)
    force.set(group=1, pipe_rows=pipe)
    B, Hkv, d = 2, 3, 40
    for nq, H, causal in ((1, 4 * Hkv, True), (3, Hkv, False)):
        q = rand(rng, (B, H, nq, d))
        k, v = half(rng, (B, Hkv, nk, d), dtype), half(rng, (B, Hkv, nk, 24), dtype)
        force.reset_counts()
        check(heads_last(q), heads_last(k), heads_last(v), F32, layout="blhd", enable_gqa=H != Hkv,
              causal=causal, num_threads=(1, 2))
        assert force.group_runs > 0
        if dtype == BF16 or isa == "avx2":
            assert force.chunk_rows >= B * H * nq


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_weights_varlen_and_strided(rng, force, dtype):
    """attention_weights (the weights kernel), packed sequences (decoding, and longer
    queries on the tiled kernel), and K and V as strided views of a larger cache."""
    q, k = rand(rng, (2, 3, 20, 16)), half(rng, (2, 3, 50, 16), dtype)
    for qq in (q, q.astype(dtype)):
        w = fastattn.attention_weights(qq, k, causal=True)
        assert w.dtype == F32
        assert_close(w, ref.attention_weights(qq.astype(F64), k.astype(F64), causal=True), F32)

    for lq in ([1, 1, 1], [5, 30, 2]):
        qv, kv_, vv, cq, ck = packed(rng, lq, [40, 90, 7], 4, 2, F32)
        kv_, vv = kv_.astype(dtype), vv.astype(dtype)
        check_varlen(qv, kv_, vv, cq, ck, F32, num_threads=(1, 2), causal=True)
        check_varlen(qv.astype(dtype), kv_, vv, cq, ck, F32, num_threads=(1, 2), causal=True)

    cache = half(rng, (2, 2, 300, 2, 32), dtype)   # a K and V cache side by side: strided views
    k_view, v_view = cache[:, :, :250, 0], cache[:, :, :250, 1]
    q = rand(rng, (2, 2, 1, 32))
    check(q, k_view, v_view, F32, kv_lengths=np.array([[200], [250]]))
    check(rand(rng, (2, 2, 60, 32)), k_view, v_view, F32, causal=True)


def test_nonfinite_values(isa, rng):
    """inf and NaN in 16-bit V and K propagate as in the reference (the row kernel's
    careful redo reads the 16-bit values too); a value beyond float16's range is inf
    there, as NumPy's cast makes it."""
    q = rand(rng, (1, 2, 2, 16))
    k, v = half(rng, (1, 2, 300, 16), np.float16), half(rng, (1, 2, 300, 16), np.float16)
    v[0, 0, 10, 3] = np.inf
    with np.errstate(over="ignore"):
        v[0, 1, 20, 5] = np.float16(70000.0)   # inf in float16
    k[0, 1, 250, 0] = np.nan
    check(q, k, v, F32)
    check(q, k, v, F32, mask=np.arange(300) != 250)   # a hidden NaN key adds nothing
    check(q.astype(np.float16), k, v, F32)   # the careful redo reads a 16-bit q too
    check(rand(rng, (1, 2, 40, 16)).astype(np.float16), k, v, F32)   # ... and the tiled kernel's


def test_mixed_and_refused_dtypes(rng, force):
    """16-bit q with 16-bit K and V computes in float32; K and V of different 16-bit
    kinds, or with float64 q, are converted to the compute dtype first; bfloat16 is
    recognised by its dtype, so another 2-byte void dtype is refused."""
    q, k, v = rand(rng, (2, 3, 16)), half(rng, (2, 40, 16), np.float16), half(rng, (2, 40, 16), BF16)
    for qq, kk, vv, res in ((q.astype(np.float16), k, k, F32), (q.astype(BF16), v, v, F32), (q, k, v, F32),
                            (q.astype(F64), k, k, F64), (q, k.astype(F64), v, F64)):
        check(qq, kk, vv, res)
    out16 = np.empty((2, 3, 16), np.float16)
    assert fastattn.attention(q, k, k, out=out16) is out16
    np.testing.assert_array_equal(out16, fastattn.attention(q, k, k).astype(np.float16))
    for bad in (np.dtype("V2"), np.dtype([("x", np.uint16)])):
        with pytest.raises(TypeError, match="dtype"):
            fastattn.attention(q, np.zeros((2, 40, 16), bad), k)
    before = k.copy()
    fastattn.attention(rand(rng, (2, 70, 16)), k, k)   # the tiled kernel widens tiles of k: k stays
    np.testing.assert_array_equal(k.view(np.uint16), before.view(np.uint16))


BACKWARD_OPTS = [
    {}, {"causal": True}, {"softcap": 4.0}, {"window": (9, 3)}, {"kv_lengths": np.array([[0], [23]])},
    {"mask": "bool"}, {"alibi_slopes": np.array([0.5, 0.25])}, {"enable_gqa": True, "causal": True},
]


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("q16", [False, True], ids=["q32", "q16"])
@pytest.mark.parametrize("tiles", [(0, 0), (16, 16), (64, 256)], ids=["table", "16x16", "64x256"])
@pytest.mark.parametrize("opt", BACKWARD_OPTS, ids=lambda o: "-".join(o) or "plain")
def test_backward_reads_half_kv(isa, rng, force, dtype, q16, tiles, opt):
    """The backward pass reads 16-bit K and V as stored (each unit's rows widened once
    into its scratch: kv_widened counts every key of every leading index once), and a
    16-bit q too (each query block's rows widened as it is packed): float32 gradients,
    bitwise those of the same values in float32, and the float64 reference's within
    float32's tolerance."""
    B, H, nq, nk, d = 2, 2, 37, 45, 24
    kw = dict(opt)
    Hk = 1 if kw.get("enable_gqa") else H
    q = rand(rng, (B, H, nq, d)).astype(dtype if q16 else F32)
    k, v = half(rng, (B, Hk, nk, d), dtype), half(rng, (B, Hk, nk, 20), dtype)
    if kw.get("mask") == "bool":
        kw["mask"] = rng.random((B, 1, nq, nk)) < 0.7
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    do = rand(rng, out.shape)
    force.set(bq=tiles[0], bk=tiles[1])
    for threads in (1, 2):
        force.reset_counts()
        got = fastattn.attention_backward(do, q, k, v, out, lse, num_threads=threads, **kw)
        assert force.kv_widened == B * H * nk   # every unit's keys, once (GQA: each query head's leading index)
        q32, k32, v32 = (a.astype(F32) for a in (q, k, v))
        same = fastattn.attention_backward(do, q32, k32, v32, out, lse, num_threads=threads, **kw)
        for g, s, a in zip(got, same, (q, k, v)):
            assert g.dtype == F32 and g.shape == a.shape
            np.testing.assert_array_equal(g, s)
    q64, k64, v64 = (a.astype(F64) for a in (q, k, v))
    want = ref.attention_backward(do.astype(F64), q64, k64, v64, ref.attention(q64, k64, v64, **kw), **kw)
    for g, w in zip(got, want):
        assert_close(g, w, F32)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("stored", ["do", "out", "both"])
@pytest.mark.parametrize("q16", [False, True], ids=["q32", "q16"])
@pytest.mark.parametrize("heads", [(2, 2), (1, 1)], ids=["B2H2", "B1H1"])
@pytest.mark.parametrize("tiles", [(0, 0), (16, 16)], ids=["table", "16x16"])
@pytest.mark.parametrize("opt", [{}, {"causal": True}, {"enable_gqa": True, "causal": True},
                                 {"q_lengths": np.array([[37], [20]])}, {"layout": "blhd", "softcap": 4.0}],
                         ids=["plain", "causal", "gqa-causal", "q_lengths", "blhd-softcap"])
def test_backward_reads_half_do_and_out(isa, rng, force, dtype, stored, q16, heads, tiles, opt):
    """A 16-bit do or out (or both) beside K and V of its dtype, with q of that dtype or
    float32, is read as stored: the gradients are bitwise those of float32 copies of
    the same values (D = rowsum(do * out) from the same numbers in the same order), on
    1 and 2 threads (B1 H1: the team shares the one head's key blocks and its D), and the
    float64 reference's on the rounded values within float32's tolerance."""
    (B, H), nq, nk, d = heads, 37, 45, 24
    kw = dict(opt)
    if "q_lengths" in kw:
        kw["q_lengths"] = kw["q_lengths"][:B]
    Hk = 1 if kw.get("enable_gqa") else H
    q, k, v = half(rng, (B, H, nq, d), dtype), half(rng, (B, Hk, nk, d), dtype), half(rng, (B, Hk, nk, 20), dtype)
    q = q if q16 else q.astype(F32)
    if kw.get("layout") == "blhd":
        q, k, v = (a.swapaxes(1, 2) for a in (q, k, v))   # views: (B, n, H, d) strides
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    do = rand(rng, out.shape)
    do16, out16 = (a.astype(dtype) if stored in (name, "both") else a for a, name in ((do, "do"), (out, "out")))
    force.set(bq=tiles[0], bk=tiles[1])
    for threads in (1, 2):
        got = fastattn.attention_backward(do16, q, k, v, out16, lse, num_threads=threads, **kw)
        same = fastattn.attention_backward(do16.astype(F32), q, k, v, out16.astype(F32), lse, num_threads=threads,
                                           **kw)
        for g, s_, a in zip(got, same, (q, k, v)):
            assert g.dtype == F32 and g.shape == a.shape
            np.testing.assert_array_equal(g, s_)
    q64, k64, v64, do64, out64 = (a.astype(F64) for a in (q, k, v, do16, out16))
    want = ref.attention_backward(do64, q64, k64, v64, out64, **kw)
    for g, w in zip(got, want):
        assert_close(g, w, F32)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("q16", [False, True], ids=["q32", "q16"])
@pytest.mark.parametrize("opt", [{}, {"causal": True}, {"window": (9, 3), "softcap": 4.0}],
                         ids=["plain", "causal", "window-softcap"])
@pytest.mark.parametrize("tiles", [(0, 0), (16, 32)], ids=["table", "16x32"])
@pytest.mark.parametrize("do16", [False, True], ids=["do32", "do16"])
def test_varlen_reads_half(isa, rng, force, dtype, q16, opt, tiles, do16):
    """attention_varlen and its backward over 16-bit K and V, and q of their dtype or
    float32, read as stored: the results of float32 copies (whose agreement with the
    reference test_backward and test_varlen hold), within float32's rounding forward
    (a row's dot products may sum in another order) and bitwise backward, on 1 and 2
    threads, with the table's tiles and small ones; sequences with tails past a query
    block and a key block, one without keys; the backward's do and out in float32 or,
    read as stored too, in K's dtype (do16)."""
    len_q, len_k = [70, 1, 33, 5], [130, 1, 64, 0]
    cq, ck = np.cumsum([0] + len_q), np.cumsum([0] + len_k)
    q = half(rng, (cq[-1], 4, 24), dtype) if q16 else rand(rng, (cq[-1], 4, 24))
    k, v = half(rng, (ck[-1], 2, 24), dtype), half(rng, (ck[-1], 2, 16), dtype)
    q32, k32, v32 = (a.astype(F32) for a in (q, k, v))
    force.set(bq=tiles[0], bk=tiles[1])   # the table's tiles, or tails past 16-row and 32-key blocks
    for threads in (1, 2):
        out, lse = fastattn.attention_varlen(q, k, v, cq, ck, return_lse=True, num_threads=threads, **opt)
        out32, lse32 = fastattn.attention_varlen(q32, k32, v32, cq, ck, return_lse=True, num_threads=threads, **opt)
        assert out.dtype == lse.dtype == F32
        assert_close(out, out32, F32)
        assert_close(lse, lse32, F32)
        do = rand(rng, out.shape)
        do, o = (do.astype(dtype), out.astype(dtype)) if do16 else (do, out)   # read as stored, or float32
        got = fastattn.attention_varlen_backward(do, q, k, v, o, lse, cq, ck, num_threads=threads, **opt)
        same = fastattn.attention_varlen_backward(do.astype(F32), q32, k32, v32, o.astype(F32), lse, cq, ck,
                                                  num_threads=threads, **opt)
        for g, s_, a in zip(got, same, (q, k, v)):
            assert g.dtype == F32 and g.shape == a.shape
            np.testing.assert_array_equal(g, s_)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_backward_copies_no_half_input(rng, dtype):
    """The backward pass over 16-bit q, K and V makes no float32 copy of them, nor of
    a 16-bit do and out (nor does attention_varlen's): the NumPy memory it allocates (tracemalloc sees NumPy's
    buffers, not the C core's scratch) is the gradients (the output), with a margin
    well under a copy of q."""
    import tracemalloc

    def peak_of(fn):
        tracemalloc.start()
        try:
            res = fn()
            return res, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    q = half(rng, (1, 2, 4096, 64), dtype)
    k, v = half(rng, (1, 2, 64, 64), dtype), half(rng, (1, 2, 64, 64), dtype)
    out, lse = fastattn.attention(q, k, v, return_lse=True)
    do = rand(rng, out.shape)
    (dq, dk, dv), peak = peak_of(lambda: fastattn.attention_backward(do, q, k, v, out, lse))
    grads = dq.nbytes + dk.nbytes + dv.nbytes
    assert dq.dtype == F32 and dq.shape == q.shape
    assert grads <= peak < grads + q.size * 4 // 2, (peak, grads)

    qp, kp, vp = (np.ascontiguousarray(a[0].swapaxes(0, 1)) for a in (q, k, v))   # one packed sequence
    cq, ck = np.array([0, 4096]), np.array([0, 64])
    (out, lse), peak = peak_of(lambda: fastattn.attention_varlen(qp, kp, vp, cq, ck, return_lse=True))
    assert out.dtype == F32 and out.nbytes + lse.nbytes <= peak < out.nbytes + lse.nbytes + qp.size * 2, peak
    (dq, dk, dv), peak = peak_of(lambda: fastattn.attention_varlen_backward(do[0].swapaxes(0, 1), qp, kp, vp,
                                                                            out, lse, cq, ck))
    grads = dq.nbytes + dk.nbytes + dv.nbytes
    assert grads <= peak < grads + qp.size * 4 // 2, (peak, grads)

    # a 16-bit do and out too (each a float32 copy the size of q's: 2 MiB)
    out, lse4 = fastattn.attention(q, k, v, return_lse=True)
    do16, out16 = do.astype(dtype), out.astype(dtype)
    (dq, dk, dv), peak = peak_of(lambda: fastattn.attention_backward(do16, q, k, v, out16, lse4))
    grads = dq.nbytes + dk.nbytes + dv.nbytes
    assert grads <= peak < grads + q.size * 4 // 2, (peak, grads)
    dop, outp = (np.ascontiguousarray(a[0].swapaxes(0, 1)) for a in (do16, out16))
    (dq, dk, dv), peak = peak_of(lambda: fastattn.attention_varlen_backward(dop, qp, kp, vp, outp, lse, cq, ck))
    grads = dq.nbytes + dk.nbytes + dv.nbytes
    assert grads <= peak < grads + qp.size * 4 // 2, (peak, grads)


def test_threads_and_layouts(rng):
    """The result of a 16-bit cache agrees on 1 and 2 threads and in both layouts."""
    q, k, v = rand(rng, (1, 4, 1, 64)), half(rng, (1, 4, 5000, 64), np.float16), half(rng, (1, 4, 5000, 64),
                                                                                          np.float16)
    with team_check(1):
        one = fastattn.attention(q, k, v, num_threads=1)
    two = fastattn.attention(q, k, v, num_threads=2)
    assert_close(one, two, F32)
    blhd = fastattn.attention(heads_last(q), heads_last(k), heads_last(v), layout="blhd")
    assert_close(blhd, heads_last(one), F32)


def test_no_ml_dtypes_import(tmp_path):
    """fastattn never imports ml_dtypes (bfloat16 arrays exist only once it is imported):
    float16 K and V work without it, and float64 is not taken for bfloat16 then."""
    proc = run_script(tmp_path, """
        import sys
        import numpy as np
        import fastattn
        q = np.ones((2, 1, 8), np.float32)
        k = np.ones((2, 9, 8), np.float16)
        assert fastattn.attention(q, k, k).dtype == np.float32
        q64, k64 = q.astype(np.float64), k.astype(np.float64)   # (no dtype compared with None: float64 to NumPy)
        assert np.allclose(fastattn.attention(q64, k64, k64), fastattn.reference.attention(q64, k64, k64))
        assert "ml_dtypes" not in sys.modules
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_tiled_widened_rows(isa, rng, force, dtype):
    """The tiled kernel keeps a leading index's widened keys for its next query block
    (causal: each block widens only the keys past the last one's, so each key is widened
    once a thread), starts again where a window moves past the rows it keeps, widens a
    key tile at a time where K and V exceed FA_KV_CACHE_BYTES, and never reuses the rows
    of an earlier call, even for the same K array changed in place."""
    force.set(bq=32)   # many query blocks a leading index
    q = rand(rng, (2, 2, 200, 24))
    k, v = half(rng, (2, 2, 260, 24), dtype), half(rng, (2, 2, 260, 24), dtype)
    force.reset_counts()
    check(q, k, v, F32, num_threads=1, causal=True)
    assert force.kv_widened == 4 * 260   # each head's keys once (one thread)
    for kw in ({}, {"window": (20, 0)}, {"window": (50, 10)}, {"kv_lengths": np.array([[100], [260]])}):
        force.reset_counts()
        check(q, k, v, F32, num_threads=(1, 2), **kw)
        assert 0 < force.kv_widened
    w = fastattn.attention_weights(q, k, causal=True)
    assert_close(w, ref.attention_weights(q.astype(F64), k.astype(F64), causal=True), F32)
    # One head, two calls of the binding on one thread: nothing allocates between them, so
    # the thread's scratch comes back at the same address with the first call's kept rows,
    # which match the second call's K and V pointers (without the header cleared: an error
    # of 0.4)
    q1, k1, v1 = q[:1, :1], k[:1, :1].copy(), v[:1, :1].copy()
    out = np.empty(q1.shape, F32)
    _core.attention(_core.Args(q1, k1, v1, None, _core.MASK_NONE, (1, 1), False, 0.2, 1), out, None)
    k1[..., 100:, :] = half(rng, (1, 1, 160, 24), dtype)   # K changed in place
    _core.attention(_core.Args(q1, k1, v1, None, _core.MASK_NONE, (1, 1), False, 0.2, 1), out, None)
    assert_close(out, reference64(q1, k1, v1, scale=0.2)[0], F32)
    force.set(bq=0)
    big_q = rand(rng, (1, 1, 40, 256))   # 5,000 keys x (256 + 256) float32: beyond 8 MiB
    big_k, big_v = half(rng, (1, 1, 5000, 256), dtype, 0.05), half(rng, (1, 1, 5000, 256), dtype)
    plan = fastattn._attention._plan(big_q, big_k, big_v, num_threads=1)
    assert plan["kernel"] == "tiled"
    force.reset_counts()
    check(big_q, big_k, big_v, F32, num_threads=1)
    blocks = plan["n_qb"] - plan["tail"]   # (a tail runs on the row kernel)
    assert force.kv_widened == blocks * 5000   # a key tile at a time: every block widens every key
    check(big_q, big_k, big_v, F32, num_threads=2, causal=True)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_rows_full_keeps_the_row_kernel_from_d128(isa, rng, dtype):
    """The table's rows_full rows (one vector of the tiled kernel for float32) take the
    row kernel for 16-bit K and V from dk = 128 on, which the tiled kernel would widen
    first; below d128 the tiled kernel, and for float32 K and V too unless the table's
    rows_full_dk gives them the row kernel.  Results against the reference either way."""
    from fastattn._attention import _plan
    t = _core.isa_table()
    full, lanes = t["rows_full"][0], t["lanes"][0]
    rows = range(full, lanes + 1) if full else [lanes]
    for d in (64, 128):
        k, v = half(rng, (2, 300, d), dtype), half(rng, (2, 300, 48), dtype)
        for nq in rows:
            q = rand(rng, (2, nq, d))
            p16, p32 = _plan(q, k, v), _plan(q, k.astype(F32), v.astype(F32))
            limit = t["rows_max_dk" if d >= 128 else "rows_max"][0]
            if full and nq <= limit:
                assert p32["kernel"] == ("rows" if 0 < t["rows_full_dk"] <= d else "tiled"), (d, nq)
                assert p16["kernel"] == ("rows" if d >= 128 else "tiled"), (d, nq)
            check(q, k, v, num_threads=2)
            check(q, k, v, causal=True, num_threads=1)


def test_byte_swapped_float16(rng):
    """float16 of the other byte order is a 16-bit float too (computed in float32), but
    converted first: the C core reads only native 16-bit K and V as stored."""
    q, k = rand(rng, (2, 5, 16)), half(rng, (2, 40, 16), np.float16)
    kb = k.astype(k.dtype.newbyteorder())
    out = fastattn.attention(q.astype(kb.dtype), kb, kb)
    assert out.dtype == F32
    assert_close(out, reference64(q.astype(np.float16), k, k)[0], F32)


def test_dask_chunks_of_a_half_cache(rng):
    """fastattn.dask over a bfloat16 cache chunked by keys: the tasks read their chunks as
    stored and the merged result is float32, as the single-process call's."""
    import dask.array as da

    import fastattn.dask as fdask
    q = rand(rng, (2, 4, 64, 16))
    k, v = half(rng, (2, 4, 96, 16), BF16), half(rng, (2, 4, 96, 16), BF16)
    lazy = fdask.attention(da.from_array(q, chunks=(1, 2, 32, 16)), da.from_array(k, chunks=(1, 2, 48, 16)),
                           da.from_array(v, chunks=(1, 2, 48, 16)), causal=True)
    assert lazy.dtype == F32
    got = lazy.compute(scheduler="threads")
    assert_close(got, fastattn.attention(q, k, v, causal=True), F32)
    assert_close(got, reference64(q, k, v, causal=True)[0], F32)
