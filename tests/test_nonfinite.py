"""Public behaviour: extreme scores and non-finite inputs.  NaN and inf reach only
the rows that see them; a key a row may not see adds nothing, even inf or NaN; a
key it sees adds its inf or NaN even at weight 0; values near the dtype's limit
give a finite mean (the careful redo).  Every kernel, split keys too."""

import numpy as np
import pytest
from conftest import assert_close, rand
from helpers import F32, F64, check, team_check

import fastattn
from fastattn import reference as ref

# ---------------------------------------------------------------------------
# extreme scores, NaN and inf where a row sees them
# ---------------------------------------------------------------------------

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
    out = check(q, kn, v, mask=mask)[0]
    assert np.isfinite(out).all()
    vn = v.copy()
    vn[100, 2] = np.inf
    out = check(q, k, vn)[0]
    assert np.isinf(out[:, 2]).all() and np.isfinite(np.delete(out, 2, axis=1)).all()


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


# ---------------------------------------------------------------------------
# hidden keys add nothing
# ---------------------------------------------------------------------------

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
    assert np.isfinite(out[1, :, 4]).all() and np.isinf(out[2, :, 4]).all()
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
        with team_check(threads):
            clean = fastattn.attention(q[:h], k[:h], v[:h], mask=mask, num_threads=threads)
        assert_close(out, clean, dtype)
        # the fast kernels skipped the hidden keys; too many stretches: the careful redo did
        assert (redone > 0) if layout == "many" else (redone == 0), redone


# ---------------------------------------------------------------------------
# underflowed weights, values near the dtype's limit (the careful redo)
# ---------------------------------------------------------------------------

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
