"""fastattn.attention_varlen: packed sequences, each attending within itself as if
alone, against reference.attention_varlen (check_varlen) on every kernel path."""

import numpy as np
import pytest
from conftest import assert_close, rand
from helpers import F32, F64, check_varlen, packed, rows_limits, team_check

import fastattn
from fastattn import _core
from fastattn import reference as ref

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
        _core.attention(_core.Args(q, k, v, np.ones((4, 4), np.uint8), _core.MASK_BOOL, (1,), False, 1.0, 1,
                                   q_start=starts, kv_start=starts), out, None)
    _core.attention(_core.Args(q, k, v, None, _core.MASK_NONE, (1,), False, 1.0, 1, q_start=starts, kv_start=starts),
                    out, None)
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
    assert half.dtype == F32                                              # 16-bit inputs give float32
    assert_close(half, ref.attention_varlen(q16.astype(F64), k16.astype(F64), v16.astype(F64), cq, cq), F32)
    out16 = np.empty(half.shape, np.float16)                              # written through a float32 temporary
    assert fastattn.attention_varlen(q16, k16, v16, cq, cq, out=out16) is out16
    np.testing.assert_array_equal(out16, half.astype(np.float16))
    ints = fastattn.attention_varlen(np.ones((3, 2, 4), int), np.ones((3, 1, 4), int), np.arange(3)[:, None, None] *
                                     np.ones((3, 1, 2), int), [0, 1, 3], [0, 2, 3])
    assert ints.dtype == F64                                              # every head and column: the mean of v
    assert_close(ints, np.broadcast_to(np.array([0.5, 2, 2])[:, None, None], (3, 2, 2)), F64)
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
    call of its own would (helpers.rows_limits): its rows are
    bitwise those of that kernel, forced, and all agree with the reference."""
    lq, lk = [200, 16, 15, 14, 13, 5], [300, 700, 700, 700, 700, 700]
    q, k, v, cq, ck = packed(rng, lq, lk, 2, 2, dtype, d=128, dv=24)
    out, _ = check_varlen(q, k, v, cq, ck, dtype, num_threads=2)
    forced = {}
    try:
        for n in (1, 24):
            force.set(rows_max=n)
            with team_check(2):
                forced[n] = fastattn.attention_varlen(q, k, v, cq, ck, num_threads=2)
    finally:
        force.set(rows_max=0)
    limit, full = rows_limits(dtype, 2, contiguous=False)   # (packed: K rows at the heads' stride)
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


def test_varlen_out_overlapping_a_non_array_input(monkeypatch):
    """attention_varlen's out= sharing memory with q given as a memoryview, out one
    row further on: the overlap is seen through the view, so the C core writes a
    temporary (never the memory it reads q from), and the result is what a
    separate out= gives."""
    rng = np.random.default_rng(43)
    cu = np.array([0, 6, 16])
    buf = rng.standard_normal((17, 2, 8))
    k, v = (rng.standard_normal((16, 2, 8)) for _ in range(2))
    want = fastattn.attention_varlen(buf[:16].copy(), k, v, cu, cu, causal=True)
    written = []
    real = _core.attention

    def spy(p, out, lse, **kw):
        written.append(np.shares_memory(out, buf))
        return real(p, out, lse, **kw)

    monkeypatch.setattr(_core, "attention", spy)
    got = fastattn.attention_varlen(memoryview(buf[:16]), k, v, cu, cu, causal=True, out=buf[1:])
    assert written == [False]
    assert np.allclose(got, want, rtol=0, atol=1e-12)
