"""Split keys and merging: a row's keys split across threads (flash-decoding) or in
parts of a long row, merged by the logsumexp rule, and fastattn.merge_attention,
the same rule on the user's parts."""

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_close, rand, reference64
from helpers import F32, F64, check, team_check

import fastattn
from fastattn import _core
from fastattn import reference as ref

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)

# ---------------------------------------------------------------------------
# keys split across threads
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, F64])
def test_split_tiled_kernel(isa, rng, dtype):
    """Many query rows but a single work item (n_q <= 64): the tiled kernel's
    partial results are merged too."""
    q, k, v = rand(rng, (40, 32), dtype), rand(rng, (4000, 32), dtype), rand(rng, (4000, 24), dtype)
    for threads in (1, 2, 4):
        check(q, k, v, num_threads=threads)
        check(q, k, v, causal=True, num_threads=threads)


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
    out = check(qn, k, v, num_threads=threads)[0]
    assert np.isnan(out[1]).all() and np.isfinite(out[0]).all()


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


# ---------------------------------------------------------------------------
# long rows split into parts (float32 rows of more than 2^24 keys; forced at 300 keys)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("n_q", [1, 3, 40])
def test_long_rows_float32(isa, n_q):
    """Every value 3.0 over 2^25 + 5 keys (K and V broadcast, no memory): the result
    is 3.0 (was 3.33 on one thread, 2.0 at 2^27) and lse log(n_k) + the score."""
    n = (1 << 25) + 5
    kv = np.broadcast_to(np.full((1, 8), 3.0, F32), (n, 8))
    q = np.full((n_q, 8), 0.25, F32)
    for nt in (1, 2):
        with team_check(nt):
            out, lse = fastattn.attention(q, kv, kv, return_lse=True, num_threads=nt)
        np.testing.assert_allclose(out, 3.0, rtol=1e-6)
        np.testing.assert_allclose(lse, np.log(n) + 8 * 0.25 * 3.0 / np.sqrt(8), rtol=1e-6)


@pytest.mark.parametrize("case", ["plain", "causal_mask", "gqa_lengths", "window_alibi", "decode"])
def test_long_split_paths(isa, long_split, case):
    """The split of long rows, forced at 300 keys with waves of a few items,
    against the float64 reference: the same options as any call."""
    rng = np.random.default_rng(5)
    kw = {}
    if case == "decode":
        q, k, v = rand(rng, (2, 4, 1, 32)), rand(rng, (2, 4, 2000, 32)), rand(rng, (2, 4, 2000, 16))
    elif case == "gqa_lengths":
        q, k, v = rand(rng, (2, 4, 70, 32)), rand(rng, (2, 2, 1500, 32)), rand(rng, (2, 2, 1500, 32))
        kw = dict(enable_gqa=True, kv_lengths=np.array([[1500], [1111]]), causal=True)
    else:
        q, k, v = rand(rng, (2, 3, 130, 32)), rand(rng, (2, 3, 1500, 32)), rand(rng, (2, 3, 1500, 32))
        if case == "causal_mask":
            kw = dict(causal=True, mask=rng.random((130, 1500)) < 0.8)
        elif case == "window_alibi":
            kw = dict(window=(700, 100), alibi_slopes=np.array([0.01, 0.02, 0.04], F32))
    want, want_lse = reference64(q, k, v, **kw)
    for keys, budget in ((300, 0), (300, 20000), (1000, 1)):
        long_split(keys, budget)
        check(q, k, v, F32, num_threads=(1, 2), want=(want, want_lse), what=f"{case} keys {keys} budget {budget}",
              **kw)


def test_long_split_float64(long_split):
    """float64 rows are split too (a work unit of at most 2^20 keys, for Ctrl-C):
    against the reference at float64's tolerance, in waves."""
    rng = np.random.default_rng(6)
    q, k, v = rand(rng, (2, 50, 16), F64), rand(rng, (2, 900, 16), F64), rand(rng, (2, 900, 16), F64)
    want = reference64(q, k, v, causal=True)
    long_split(100, 1)
    check(q, k, v, F64, causal=True, want=want)


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


def _merge_rule(outs, lses):
    """merge_attention's documented rule in float64 NumPy, with its inf and NaN
    cases (the oracle of src_c/merge.c): M = the largest lse (0 where it is -inf),
    w = exp(lse - M); a part with lse = -inf adds nothing, one with w = 0 (or NaN)
    adds only its inf and NaN; out = sum w out / sum w (0 where that is 0)."""
    L = np.stack([np.asarray(x, F64) for x in lses])
    P = np.stack([np.asarray(o, F64) for o in outs])
    M = np.max(L, axis=0)
    Ms = np.where(np.isneginf(M), 0, M)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        w = np.exp(L - Ms)[..., None]
        keep = np.where(np.isfinite(P) | np.isneginf(L)[..., None], 0, P)
        s = w[..., 0].sum(axis=0)
        out = np.where(w > 0, w * P, keep).sum(axis=0)
        out = np.where(s[..., None] == 0, 0, out / np.where(s == 0, 1, s)[..., None])
        return out, Ms + np.log(s)


@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64])
@pytest.mark.parametrize("threads", [1, 2, None])
@pytest.mark.parametrize("n_parts, d", [(1, 8), (2, 1), (5, 33), (9, 64), (3, 0)])
def test_merge_kernel_against_rule(rng, dtype, threads, n_parts, d):
    """The C merge over many parts, every thread count and a d of 0, with
    lse of -inf, NaN and +inf, far-apart lse (weights that underflow to 0) and
    inf and NaN outputs, against the rule in float64; finite entries to a few
    ulps, the rest exactly where they are non-finite.  16-bit parts give float32."""
    rows = 57
    res = F32 if dtype in (F16, BF16) else dtype
    lses = [(rng.standard_normal(rows) * 3).astype(dtype) for _ in range(n_parts)]
    outs = [rng.standard_normal((rows, d)).astype(dtype) for _ in range(n_parts)]
    lses[0][:4] = -np.inf                      # rows 0-3: part 0 saw nothing
    lses[-1][2:4] = -np.inf                    # row 2: with fewer than 3 parts, no part saw a key
    for x in lses:
        x[3] = -np.inf                         # row 3: no part saw a key
    lses[0][5] = np.nan
    lses[-1][6] = np.inf
    lses[0][7] = 60000 if dtype == F16 else 1000  # the other parts' weights underflow to 0
    if d:
        outs[0][0, 0] = np.nan                 # in a part that saw no key: ignored
        outs[-1][7, 0] = np.inf                # underflowed part's inf and NaN are kept (n_parts > 1)
        outs[-1][7, -1] = np.nan
        outs[0][8, 0] = -np.inf
    out, lse = fastattn.merge_attention(outs, lses, num_threads=threads)
    want, want_lse = _merge_rule(outs, lses)
    assert out.dtype == res and lse.dtype == res and out.shape == (rows, d) and lse.shape == (rows,)
    big = 4 * rows * (d + 1) * n_parts >= _core.TEAM_MIN_WORK
    want_team = 1 if threads == 1 or not big else min(threads or _core.max_threads(), _core.thread_cap())
    assert _core.last_threads() == (want_team if _core.openmp_enabled() else 1)
    for got, ref_ in ((out, want), (lse, want_lse)):
        ref_ = ref_.astype(res).astype(F64)   # the rule in float64, rounded once to the result's dtype
        got = got.astype(F64)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref_))
        fin = np.isfinite(ref_)
        np.testing.assert_array_equal(got[~fin & ~np.isnan(ref_)], ref_[~fin & ~np.isnan(ref_)])
        np.testing.assert_allclose(got[fin], ref_[fin], rtol=4 * np.finfo(res).eps, atol=16 * np.finfo(res).eps)
    assert np.all(out[3] == 0) and np.isneginf(lse[3])
    assert np.isneginf(lse[2]) == (n_parts < 3)


def test_merge_kernel_compensated_sums():
    """float64 parts 1e16, 1 and -1e16 of equal weight: the compensated sum keeps
    the 1 (1/3; a plain float64 sum gives 0)."""
    outs = [np.array([[1e16]]), np.array([[1.0]]), np.array([[-1e16]])]
    out, lse = fastattn.merge_attention(outs, [np.zeros(1)] * 3)
    np.testing.assert_allclose(out, 1 / 3, rtol=1e-15)
    np.testing.assert_allclose(lse, np.log(3), rtol=1e-15)


def test_merge_inputs_as_given(rng):
    """Mixed dtypes (float32 outputs, float64 lse: float64 results), non-contiguous
    and misaligned parts (an unpickled buffer can be), and no rows, against the rule."""
    outs = [rng.standard_normal((6, 5, 4)).astype(F32) for _ in range(3)]
    lses = [rng.standard_normal((6, 5)) for _ in range(3)]
    out, lse = fastattn.merge_attention(outs, lses)
    assert out.dtype == F64 and lse.dtype == F64
    want, want_lse = _merge_rule(outs, lses)
    np.testing.assert_allclose(out, want, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-14)
    wide = [rng.standard_normal((5, 9)) for _ in range(2)]
    strided = [w[:, ::2] for w in wide]                       # (5, 5), every other column
    buf = np.zeros(5 * 5 * 8 + 4, np.uint8)
    odd = np.frombuffer(buf.data, F64, 25, offset=4).reshape(5, 5)  # misaligned
    odd[...] = wide[1][:, :5]
    assert not odd.flags.aligned
    got = fastattn.merge_attention([strided[0], odd], [np.zeros(5), np.ones(5)])
    want = _merge_rule([strided[0], odd], [np.zeros(5), np.ones(5)])
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-14)
    out, lse = fastattn.merge_attention([np.zeros((0, 3))] * 2, [np.zeros(0)] * 2)
    assert out.shape == (0, 3) and lse.shape == (0,)


def test_merge_kernel_many_parts():
    """2,000 parts of weight 1 and one of 1e8 in float32: the kernel's float64
    sums keep every part (float32 sums would lose all the small ones)."""
    n = 2000
    outs = [np.ones((1, 2), F32) for _ in range(n)]
    lses = [np.zeros(1, F32) for _ in range(n)]
    outs.append(np.full((1, 2), -1, F32))
    lses.append(np.full(1, np.log(1e8), F32))
    out, lse = fastattn.merge_attention(outs, lses)
    want = (n - 1e8) / (n + 1e8)
    np.testing.assert_allclose(out, want, rtol=2e-7)
    np.testing.assert_allclose(lse, np.log(n + 1e8), rtol=2e-7)


def test_merge_single_row():
    """Outputs (d,) with 0-d lse merge into (d,) and a 0-d lse."""
    out, lse = fastattn.merge_attention([np.ones(3), np.zeros(3)], [np.array(0.0), np.array(0.0)])
    assert out.shape == (3,) and lse.shape == ()
    np.testing.assert_allclose(out, 0.5)
    np.testing.assert_allclose(lse, np.log(2))


def test_merge_does_not_modify_inputs(rng):
    outs = [rng.standard_normal((3, 5, 4)) for _ in range(3)]
    lses = [rng.standard_normal((3, 5)) for _ in range(3)]
    keep = [o.copy() for o in outs], [x.copy() for x in lses]
    fastattn.merge_attention(outs, lses, num_threads=2)
    for a, b in zip(outs + lses, keep[0] + keep[1]):
        np.testing.assert_array_equal(a, b)
