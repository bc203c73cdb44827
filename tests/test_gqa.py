"""Grouped-query attention (enable_gqa): against the reference on every kernel path,
and the fold of a group's query heads into the rows of one item (row_group in
the C core), what it folds and what it leaves one item per head."""

import numpy as np
import pytest
from conftest import assert_close, rand, reference64
from helpers import F32, F64, PATHS, check

import fastattn
from fastattn import _core
from fastattn import reference as ref


# ---------------------------------------------------------------------------
# enable_gqa
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
    out = check(q, k, v, dtype, enable_gqa=True)[0]          # the default team
    assert out.shape == (2, 6, nq, 12)


@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("group", [0, 1])
@pytest.mark.parametrize("contiguous", [True, False])
def test_gqa_equal_heads_is_multi_head(isa, rng, force, layout, group, contiguous):
    """enable_gqa with as many key/value heads as query heads is multi-head
    attention on every path: the same plan and the same bits as without the
    flag, with K and V contiguous (the plain call) or views of a (B, n, H, d)
    cache (the general path; the group kernel forced on or off), with a mask,
    softcap and kv_lengths per batch entry on three threads (split keys)."""
    from fastattn._attention import _plan
    force.set(group=group)
    B, H, nk = 4, 4, 255
    q, k, v = rand(rng, (B, H, 1, 64)), rand(rng, (B, H, nk, 64)), rand(rng, (B, H, nk, 64))
    if not contiguous:   # (B, H, n, d) views of (B, n, H, d) caches
        k, v = (np.swapaxes(np.ascontiguousarray(np.swapaxes(a, 1, 2)), 1, 2) for a in (k, v))
    if layout == "blhd":
        q, k, v = (np.swapaxes(a, 1, 2) for a in (q, k, v))
    kw = dict(layout=layout, mask=np.ones((1, 1, 1), bool), softcap=1.0, kv_lengths=np.array([[79], [62], [83], [174]]),
              scale=0.01, num_threads=3, return_lse=True)
    got = fastattn.attention(q, k, v, enable_gqa=True, **kw)
    want = fastattn.attention(q, k, v, **kw)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    plan_kw = {x: kw[x] for x in ("layout", "mask", "softcap", "kv_lengths", "scale", "num_threads")}
    assert _plan(q, k, v, enable_gqa=True, **plan_kw) == _plan(q, k, v, **plan_kw)


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


def test_gqa_reads_kv_in_place(rng):
    """K and V reach the kernel as views with a size-1 (broadcast) group axis: no copy, no repeat."""
    from fastattn._prepare import _prepare
    q, k, v = rand(rng, (2, 8, 5, 16)), rand(rng, (2, 2, 7, 16)), rand(rng, (2, 2, 7, 16))
    p = _prepare(q, k, v, None, False, None, True, None, None, None, None, None)
    assert p.lead == (2, 2, 4)
    for given, seen in ((k, p.k), (v, p.v)):
        assert np.shares_memory(given, seen) and seen.shape[-3] == 1   # size 1: broadcast (stride 0)
    assert np.shares_memory(q, p.q)


# ---------------------------------------------------------------------------
# the fold: a group's query heads as the rows of one item
# ---------------------------------------------------------------------------

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
            call = _core.Args(qf, k, vv, mf, _core.MASK_NONE if m is None else _core.MASK_BOOL, (B,),
                              extra.get("causal", False), 0.25, 2, win_left=-1 if wl is None else wl,
                              win_right=-1 if wr is None else wr, slopes=extra.get("alibi_slopes"),
                              kvl=None if "kv_lengths" not in extra else kvl.astype(np.int64), row_group=G)
            _core.attention(call, out, lse)
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
    assert out.dtype == F32   # 16-bit inputs compute in and give float32
    assert_close(out, ref.attention(*(a.astype(np.float16).astype(F64) for a in (q, k, v)), enable_gqa=True,
                                    causal=True), F32)
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
