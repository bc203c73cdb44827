"""kv_lengths and q_lengths: padded batches whose entries end at their own lengths,
on every kernel path (PATHS), against the reference and against each entry alone."""

import numpy as np
import pytest
from conftest import assert_close, rand
from helpers import F32, F64, PATHS, check, team_check

import fastattn
from fastattn import reference as ref


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
    with team_check(threads):
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
        with team_check(threads):
            padded = fastattn.attention(qp, k, v, q_lengths=q_len, kv_lengths=kv_len, causal=causal,
                                        num_threads=threads)
        np.testing.assert_array_equal(padded, out)
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
