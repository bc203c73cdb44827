"""The row kernel (few query rows, decoding): which calls take it (rows_limits),
its register tiles, its prefetch for K and V from memory, the decode loop's
pipeline, and the padding it trims."""

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_close, rand
from helpers import F32, F64, check, rows_limits, tail_rows, team_check

import fastattn
from fastattn import reference as ref


# ---------------------------------------------------------------------------
# which kernel takes few rows
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
@pytest.mark.parametrize("kv_mib, d", [(1, 64), (40, 64), (50, 64), (1, 127), (1, 128), (1, 200), (50, 200)])
def test_row_kernel_choice(isa, rng, rows_max, dtype, kv_mib, d, force, tuning):
    """Which kernel takes 2 to 24 query rows depends on the SIMD path, the
    dtype, whether K and V exceed 48 MiB (then they come from memory, and the
    tiled kernel takes 32-key tiles up to 32 rows) and the head dim (from 128
    on, long dot products hide the row kernel's horizontal sums): the output is bitwise that
    of the kernel forced by rows_max, and both agree with the reference.  Rows
    that fill (nearly) one vector take the tiled kernel (rows_limits: rows_full).  K and
    V broadcast over a leading axis (shared by two query heads) count once (40
    MiB, not 80).  (Not enable_gqa, which folds a group's heads into the rows
    of one item up to 8 rows per head: test_gqa.py.)"""
    h_kv = 2
    nk = (kv_mib << 20) // (2 * h_kv * d * np.dtype(dtype).itemsize)
    k, v = rand(rng, (h_kv, nk, d), dtype), rand(rng, (h_kv, nk, d), dtype)
    k64, v64 = k.astype(F64), v.astype(F64)   # the reference's inputs, converted once (not per check)
    kind = 1 if kv_mib > 48 else 2 if d >= 128 else 0
    # this CPU's table may put the line elsewhere (its L3); tile_spread off, whose
    # register tiles would round a one-vector block apart from the forced one of 17+ rows
    tuning(kv_mem_bytes=48 << 20, tile_spread=0)
    limit, full = rows_limits(dtype, kind, d)
    for nq in (2, 3, 4, 6, 7, 9, 11, 13, 14, 15, 16, 17, 20, 21, 24):
        q = rand(rng, (2, h_kv, nq, d), dtype)
        force.reset_counts()
        with team_check(2):
            out, lse = fastattn.attention(q, k, v, num_threads=2, return_lse=True)
        tails = force.tail_rows
        rows_max(24)
        by_rows = fastattn.attention(q, k, v, num_threads=2)
        rows_max(1)
        tiled = fastattn.attention(q, k, v, num_threads=2)
        rows_max(0)
        assert not np.array_equal(by_rows, tiled)    # the two kernels can be told apart
        few = nq <= limit and not (full and full[0] <= nq <= full[1])
        tail = 0 if few else tail_rows(isa, dtype, nq, one_block_from_memory=kind == 1)   # (nq < any block)
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


# ---------------------------------------------------------------------------
# register tiles, streaming, the decode pipeline
# ---------------------------------------------------------------------------

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
@pytest.mark.parametrize("nq", [1, 2, 3, 5, 8, 10])
@pytest.mark.parametrize("nk", [1, 303, 513])
@pytest.mark.parametrize("dk, dv", [(72, 40), (128, 128), (7, 3)])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("kind", ["both", "across", "far", "none"])
def test_row_kernel_streaming(isa, rng, force, rows_max, dtype, nq, nk, dk, dv, strided, kind):
    """The row kernel (forced for every nq here) as it runs on K and V from
    memory (forced on small ones): K and V rows prefetched into L2 further
    ahead, V rows prefetched during the scores and the next tile's K during
    P.V, for 1 to 5 key tiles (128 keys; one row, decoding: 256) with a tail,
    P.V tiles with and without whole vectors of dv, row groups with
    remainders.  Plain, causal, a bool mask and kv_lengths.  strided: K and V
    rows that do not abut (column slices of wider rows, starting one element in,
    as a (B, n, H, d) cache's heads), whose prefetch also takes each row's last
    line (prefetch.h, prefetch_l2); the tiled kernel's prefetch of them too.
    kind: both prefetches (stream and far), the one across passes alone, the far
    one alone (the tuning tables turn each on or off by CPU), or neither, and
    then no prefetch by decoding either (decode_pf, also by CPU)."""
    force.set(stream=int(kind in ("both", "across")), far=int(kind in ("both", "far")), decode_pf=int(kind != "none"),
              bk=128 if nq > 1 else 256)   # the tiles above whatever the CPU's table
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
@pytest.mark.parametrize("bk", [1, 3, 4, 5, 7, 64])
@pytest.mark.parametrize("nk", [1, 4, 9, 130])
@pytest.mark.parametrize("nq", [1, 2, 3, 4, 5, 8])
def test_decode_pipeline_tiles(isa, rng, tiles, rows_max, force, dtype, bk, nk, nq):
    """The pipelined loop: the scores of key tile t + 1 computed while P . V of
    tile t is added, four keys of each at a time (decode_step for one row,
    rows_step for several, forced here up to nq rows: pipe_rows, by CPU from
    memory).  Key tiles forced to 1-64 keys, so that a tile or its next has a
    tail after the 4-key blocks; one tile or many; rows in groups with every
    remainder (4 a score tile with AVX-512, 2 otherwise; P . V 4 or 2); dk and dv
    with scalar columns (72, 40 and 3); every score modifier, applied per tile
    between the steps; a bool mask that hides keys from every row (those keys
    skipped); two heads with different kv lengths; strided K and V rows."""
    tiles(0, bk)
    rows_max(24)
    force.set(pipe_rows=nq)
    q = rand(rng, (2, nq, 72), dtype)
    k = rand(rng, (2, nk, 72), dtype)
    for dv in (40, 3):
        v = rand(rng, (2, nk, dv), dtype)
        check(q, k, v, num_threads=1)
        check(q, k, v, mask=rng.random((2, nq, nk)) < 0.6, num_threads=1)
        check(q, k, v, mask=rng.random((2, 1, nk)) < 0.6, num_threads=1)
        check(q, k, v, mask=rng.standard_normal((nq, nk)).astype(dtype), num_threads=1)
    check(q, k, v, causal=True, num_threads=1)
    check(q, k, v, softcap=2.0, num_threads=1)
    check(q, k, v, alibi_slopes=np.array([0.5, 0.125]), num_threads=1)
    check(q, k, v, window=(nk // 2, 0), causal=True, num_threads=1)
    check(q, k, v, kv_lengths=np.array([nk, (nk + 1) // 2]), num_threads=2)
    ks = rand(rng, (2, nk, 80), dtype)[..., 1:73]   # rows that do not abut: the prefetch's tail
    vs = rand(rng, (2, nk, 48), dtype)[..., 1:41]
    got = check(q, ks, vs, num_threads=1)[0]
    if nq > 1 and nk > 2 * bk > 8:   # the forcing reaches the kernel: the tile-by-tile loop (tiles of more
        # than 4 keys) rounds otherwise
        force.set(pipe_rows=1)
        assert not np.array_equal(fastattn.attention(q, ks, vs, num_threads=1), got)


@pytest.mark.parametrize("nq", [2, 4, 7])
def test_pipelined_rows_half_kv(rng, rows_max, force, nq):
    """rows_step with 16-bit K and V (float16 and bfloat16), widened as read:
    several tiles with tails, a bool mask, causal."""
    rows_max(24)
    force.set(pipe_rows=nq, bk=64)
    q = rand(rng, (2, nq, 72), F32)
    for half in (np.float16, ml_dtypes.bfloat16):
        k, v = rand(rng, (2, 301, 72), F32).astype(half), rand(rng, (2, 301, 40), F32).astype(half)
        check(q, k, v, F32, num_threads=1)
        check(q, k, v, F32, mask=rng.random((nq, 301)) < 0.7, num_threads=1)
        check(q, k, v, F32, causal=True, num_threads=2)


def test_decode_batched_heads_with_mask(isa, rng):
    q, k, v = rand(rng, (2, 4, 1, 64)), rand(rng, (2, 4, 700, 64)), rand(rng, (2, 4, 700, 64))
    mask = rng.random((2, 1, 1, 700)) < 0.8
    check(q, k, v, mask=mask)
    check(q, k, v, mask=mask.astype(F32) - 1.0)


# ---------------------------------------------------------------------------
# padding trimmed
# ---------------------------------------------------------------------------

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
        with team_check(threads):
            out = fastattn.attention(qs, kb, v, mask=mask, num_threads=threads)
        assert np.isnan(out[1, ::2]).all() and np.isfinite(out[1, 1::2]).all()
        assert_close(out, ref.attention(qs, kb, v, mask=mask), dtype)
