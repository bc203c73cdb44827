"""The tiled kernel: tile sizes (forced), the fused exp and its lagging reference
max, the tail rows it hands to the row kernel, and masks read per tile (bool
masks packed into bits or read as bytes, float masks transposed in registers,
hidden tiles skipped)."""

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_close, rand
from helpers import F32, F64, check, tail_rows, team_check

import fastattn
from fastattn import reference as ref


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


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("nq,bq", [(3, 3), (4, 4), (5, 5), (8, 8), (6, 1), (7, 2)])
@pytest.mark.parametrize("dv", [13, 27])
def test_single_vector_items(isa, rng, force, dtype, nq, bq, dv):
    """Items of at most one vector of query rows (PV_ROWS on AVX2: the
    accumulator in rows): dv by two-vector column tiles, a one-vector tile and
    a rest (13 and 27 against 4 and 8 lanes); items of bq rows, 1-3 of them
    past a group of four; a bool mask whose tiles P.V takes in runs; a float
    mask; two threads; scores rising by 40 a 16-key tile, past the lagging max
    at every tile (the rows rescaled, with their total after FOLD_KEYS).  The
    tiled kernel forced (rows_max 1): the row kernel takes so few rows by
    default."""
    force.set(bq=bq, bk=16, rows_max=1)
    nk = 1300
    q, k, v = rand(rng, (2, nq, 24), dtype), rand(rng, (2, nk, 24), dtype), rand(rng, (2, nk, dv), dtype)
    mask = rng.random((nq, nk)) < 0.7
    mask[:, 100:140] = False                   # keys no row sees: runs in a tile
    check(q, k, v, dtype)
    check(q, k, v, dtype, mask=mask, causal=True)
    check(q, k, v, dtype, mask=rng.standard_normal((nq, nk)).astype(dtype), num_threads=2)
    q, k, v = _scored_inputs(rng, dtype, nq, nk, 40 * np.arange(nk) / 16, dv=dv)
    check(q, k, v, dtype, scale=1.0)
    check(q, k, v, dtype, scale=1.0, num_threads=2, causal=True)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("nq", [2, 9, 16])
@pytest.mark.parametrize("d,dv,bk", [(128, 128, 16), (64, 40, 24), (100, 16, 64), (24, 56, 40)])
@pytest.mark.parametrize("mem", [False, True])
def test_spread_tiles(isa, rng, tuning, fused, force, dtype, nq, d, dv, bk, mem):
    """tile_spread (float32 on AVX-512; elsewhere the same calls take the usual
    tiles): items of one query vector take 16-key and 16-column register tiles
    that spread the next pass's prefetch over their products.  Key tiles of 16,
    24, 40 and 64 (16 each, then 8 or 24 keys past them, and a partial last tile
    of the 700 keys), dk of 128, 100 and 24, dv of 16 to 128 (whole 16-column
    tiles and a rest), in cache and from memory (the prefetch into L1), K and V
    with their own rows or at the heads' stride (then the prefetch is not
    spread), scores rising by 40 a 16-key tile (the lagging max raised in the
    first register tile), causal, two threads; against the reference, and
    within rounding of the same calls with tile_spread off."""
    nk = 700
    tuning(kv_mem_bytes=1 << 10 if mem else 1 << 40)
    force.set(bk=bk, rows_max=1)
    q, k, v = rand(rng, (2, nq, d), dtype), rand(rng, (2, nk, d), dtype), rand(rng, (2, nk, dv), dtype)
    qs, ks, vs = _scored_inputs(rng, dtype, nq, nk, 40 * np.arange(nk) / 16, dv=dv, dk=d)
    hm = [np.ascontiguousarray(np.swapaxes(a, 0, 1)) for a in (q, k, v)]   # (n, H, d): rows H d apart
    got = {}
    for spread in (1, 0):
        tuning(tile_spread=spread)
        # the plan says so where the kernel takes them: float32 on AVX-512
        assert fastattn._attention._plan(q, k, v)["spread"] == (bool(spread) and isa == "avx512" and dtype == F32)
        got[spread] = [check(q, k, v, dtype, num_threads=[1, 2])[0],
                       check(q, k, v, dtype, causal=True)[0],
                       check(qs, ks, vs, dtype, scale=1.0)[0],
                       check(*hm, dtype, layout="blhd")[0]]
    for a, b in zip(got[1], got[0]):
        assert_close(a, b, dtype)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("H,d", [(1, 64), (1, 128), (2, 32), (4, 32), (2, 64), (3, 40)],
                         ids=["d64", "d128", "H2d32", "H4d32", "H2d64", "H3d40"])
@pytest.mark.parametrize("nq", [16, 40])
def test_key_row_strides(isa, rng, force, fused, dtype, H, d, nq):
    """K's row stride 64 or 128 elements takes copies of qk_block with the
    stride a constant (QK_CONST_KRS on AVX-512): contiguous d64 and d128, and
    (B, n, H, d) rows of d32 or d64 whose stride H*d is 64 or 128, not d; H3
    d40 (stride 120) the general copy.  One and two vectors of query rows
    (16, 40), keys past the last 12- and 4-row register tiles (nk 77), fused
    and unfused, a float mask; 16-bit K and V, whose rows the kernel widens
    into its scratch at stride d (d64: the 64 copy).  The tiled kernel forced
    (rows_max 1)."""
    force.set(rows_max=1)
    nk = 77
    q, k, v = rand(rng, (2, nq, H, d), dtype), rand(rng, (2, nk, H, d), dtype), rand(rng, (2, nk, H, 24), dtype)
    check(q, k, v, dtype, layout="blhd", num_threads=[1, 2])
    check(q, k, v, dtype, layout="blhd", causal=True,
          mask=rng.standard_normal((H, nq, nk)).astype(dtype))
    if dtype == F32:
        for half in (np.float16, ml_dtypes.bfloat16):
            check(q, k.astype(half), v.astype(half), F32, layout="blhd", num_threads=[1, 2])


# ---------------------------------------------------------------------------
# the fused exp (kernel_body.h, FUSE_LAG): a key tile takes its probabilities
# against a reference max that may lag the true one by up to 24; a register
# tile whose scores rise further raises it and rescales l, Ot and the tile's
# rows already written; after a few such rescales the item goes on unfused.
# Unfused (the fixture's other half), tile_softmax lags by the same 24 and
# rescales l and Ot only where a tile's max rises further (vstep_begin_lag)
# ---------------------------------------------------------------------------
def _scored_inputs(rng, dtype, nq, nk, scores, dv=6, dk=4):
    """q, k, v with q_i . k_j = scores[j] (rounded to eighths) + 0 or r_j, for
    r_j in [-1, 1) also in eighths, so that every score is exact in float32:
    large scores carry no rounding of their own into the weights (dk >= 2)."""
    d = dk
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
# the tail: the last block's rows past its last whole vector
# ---------------------------------------------------------------------------

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
    is the one the tuning table gives (tail_rows).  The tail with the
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


# ---------------------------------------------------------------------------
# masks, tile by tile
# ---------------------------------------------------------------------------

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
    out = check(q, kn, v, mask=mask)[0]
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
    with team_check(threads):
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
    with team_check(threads):
        out = fastattn.attention(qs, kb, v, mask=mask, num_threads=threads)
    assert np.isnan(out[1, ::2]).all() and np.isfinite(out[1, 1::2]).all() and np.isfinite(out[0]).all()
    assert_close(out, ref.attention(qs, kb, v, mask=mask), dtype)
    causal = np.triu(np.full((nq, nk), -np.inf, dtype), nk - nq + 1)
    out = check(q, k, v, mask=causal, num_threads=threads)[0]
    with team_check(threads):
        by_causal = fastattn.attention(q, k, v, causal=True, num_threads=threads)
    assert_close(out, by_causal, dtype)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("threads", [1, 2])
def test_float_mask_cache(isa, fused, tiles, force, rng, dtype, threads):
    """Under head_turns, the first item on a query block's mask rows keeps the
    tiles it transposed and the next heads add them to their scores as the
    products store them (mask_cache in tiled.h): bit for bit the result without,
    and the reference's, with hidden tiles (skipped, or computed where a head's
    NaN key meets them), keys every row hides, a partial last block and vector,
    and causal rows; a mask changed in place between two calls is read again;
    not under a softcap or ALiBi, nor (unless forced) beyond FA_MT_CACHE_BYTES or
    where a thread would take fewer than two heads of a block."""
    from fastattn._attention import _plan
    tiles(64, 128)
    lead, nq, nk, d = (2, 3), 150, 700, 24
    q, k, v = rand(rng, lead + (nq, d), dtype), rand(rng, lead + (nk, d), dtype), rand(rng, lead + (nk, 20), dtype)
    mask = rand(rng, (nq, nk), dtype)
    mask[:, 256:384] = -np.inf                # a hidden tile
    mask[:, 600:650] = -np.inf                # keys that P.V leaves out
    mask[::5, 10] = -np.inf
    kb = k.copy()
    kb[1, 2, 300, 0] = np.nan                 # the third head meets the hidden tile with a NaN key
    force.set(head_turns=1)
    for kw in (dict(), dict(causal=True), dict(window=(300, 0))):   # a window: items whose keys start past 0
        got = []
        for cache in (0, 1):
            force.set(mask_cache=cache)
            assert _plan(q, kb, v, mask=mask, **kw)["mask_cache"] == bool(cache)
            got.append(check(q, kb, v, mask=mask, num_threads=threads, **kw))
        np.testing.assert_array_equal(got[0][0], got[1][0])
        np.testing.assert_array_equal(got[0][1], got[1][1])
        if "window" not in kw:                # (the window hides the NaN key from the last rows)
            assert np.isnan(got[1][0][1, 2]).all() and np.isfinite(got[1][0][1, :2]).all()
    force.set(mask_cache=1)
    mask[:, :5] = -np.inf                     # the same array, other values: kept tiles are not reused
    check(q, k, v, mask=mask, num_threads=threads)
    force.set(mask_cache=-1)
    for n in (1, 2):                          # where each thread takes two heads of a block or more
        plan = _plan(q, k, v, mask=mask, num_threads=n)
        assert plan["mask_cache"] == (plan["head_turns"] >= 2 * plan["threads"]), plan
    assert _plan(q, k, v, mask=mask, num_threads=1)["mask_cache"]
    assert not _plan(q, k, v, mask=mask, softcap=30.0, num_threads=1)["mask_cache"]
    assert not _plan(q, k, v, mask=mask, alibi_slopes=np.ones(3, dtype), num_threads=1)["mask_cache"]
    big = rand(rng, (1, 3, 40_000, d), dtype)  # past FA_MT_CACHE_BYTES
    assert _plan(q[:1], big, big, mask=np.zeros((nq, 40_000), dtype), num_threads=1)["mask_cache"] is False
    force.set(mask_cache=0, head_turns=0)
    assert not _plan(q, k, v, mask=mask)["mask_cache"]


@pytest.mark.parametrize("dtype", [F32, F64])
def test_float_mask_head_turns(isa, force, rng, dtype):
    """A float mask that the heads share: the items by query block, the heads in
    turn (head_turns in plan.c), give the head-by-head result bit for bit, with
    whole blocks, a partial block, a tail for the row kernel, causal rows and a
    mask per batch; the plan takes that order where an item's mask rows
    outweigh its K and V, and never for a bool mask, a mask per head or 16-bit
    K and V (whose widened rows are kept for one head at a time)."""
    from fastattn._attention import _plan
    cases = [((2, 3), 333, 517, 40, (333, 517)), ((2, 3), 333, 517, 40, (2, 1, 333, 517)),
             ((5,), 1025, 200, 16, (1025, 200))]
    for lead, nq, nk, d, mshape in cases:
        q, k, v = rand(rng, lead + (nq, d), dtype), rand(rng, lead + (nk, d), dtype), rand(rng, lead + (nk, d), dtype)
        mask = rand(rng, mshape, dtype)
        mask[..., ::7, 3] = -np.inf
        force.set(head_turns=-1)
        plan = _plan(q, k, v, mask=mask)
        mine = plan["bq"] >= 2 * d      # an item's mask rows (bq nk) against its K and V (nk 2d)
        assert plan["head_turns"] == (lead[-1] if mine else 0)
        if nq == 1025:
            assert plan["tail"]
        for causal in (False, True):
            got = []
            for turns in (0, 1):
                force.set(head_turns=turns)
                assert _plan(q, k, v, mask=mask, causal=causal)["head_turns"] == (lead[-1] if turns else 0)
                got.append(check(q, k, v, mask=mask, causal=causal, num_threads=[1, 2]))
            np.testing.assert_array_equal(got[0][0], got[1][0])
            np.testing.assert_array_equal(got[0][1], got[1][1])
    q, k, v = rand(rng, (3, 300, 16), dtype), rand(rng, (3, 300, 16), dtype), rand(rng, (3, 300, 16), dtype)
    force.set(head_turns=1)
    assert _plan(q, k, v, mask=rng.random((300, 300)) < 0.5)["head_turns"] == 0            # bool
    assert _plan(q, k, v, mask=rand(rng, (3, 300, 300), dtype))["head_turns"] == 0        # a mask per head
    if dtype == F32:
        half = k.astype(np.float16), v.astype(np.float16)
        assert _plan(q, *half, mask=rand(rng, (300, 300), dtype))["head_turns"] == 0       # 16-bit K and V
        force.set(head_turns=-1)
        assert _plan(q, *half, mask=rand(rng, (300, 300), dtype))["head_turns"] == 0
