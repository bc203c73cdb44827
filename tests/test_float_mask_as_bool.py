"""Float masks that hide keys with -inf or a large negative number reach the C core
as the bool mask `mask == 0` where that gives the same result (fastattn/_float_mask.py),
and the C helpers of that conversion (_core.abs_max, _core.mask_keep)."""

import math
import warnings

import numpy as np
import pytest
from conftest import assert_close, rand
from helpers import F32, F64, check

import fastattn
from fastattn import _core, _float_mask
from fastattn import reference as ref
from fastattn._prepare import _prepare

# ---------------------------------------------------------------------------
# the C helpers
# ---------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------
# the conversion, against the reference and with it turned off
# ---------------------------------------------------------------------------

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
    assert fastattn.attention(q, k, v, mask=mask, out=dst) is dst
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
# the check in one team (_core.mask_as_bool) against its pass-by-pass form: it
# gives what the passes give, on masks that go to bool either way (0 and -inf; a
# large negative number, with padding rows) and on those that must stay float (a
# bias, a NaN or inf that could meet a hidden key, causal with a finite floor)
# ---------------------------------------------------------------------------

def both_forms(q, k, v, mask, causal=False, slopes=None):
    """(one-team result, pass-by-pass result) of the check for this call's mask."""
    _float_mask._FLOAT_MASKS_AS_BOOL = False   # _prepare keeps the float mask: the check runs here instead
    try:
        p = _prepare(q, k, v, mask, causal, None, False, None, None, slopes, None, 2)
    finally:
        _float_mask._FLOAT_MASKS_AS_BOOL = True
    core = np.ascontiguousarray(mask)
    neginf_only = _float_mask._keep_of(core[..., -1, :], -math.inf, 1) is not None
    sl = None if slopes is None else np.asarray(slopes, p.comp)
    return (_float_mask._check_in_one_team(core, p, sl, neginf_only),
            _float_mask._check_in_passes(core, p, sl, neginf_only))


def same(a, b):
    if a is None or b is None:
        return a is None and b is None
    return np.array_equal(a[0], b[0]) and (a[1] is None) == (b[1] is None) and (
        a[1] is None or np.array_equal(a[1], b[1]))


@pytest.mark.parametrize("dtype,mask_dtype", [(F32, F32), (F64, F64), (F32, F64)])
def test_one_team_check_agrees(rng, dtype, mask_dtype):
    B, H, n, d = 2, 3, 70, 16
    q, k, v = rand(rng, (B, H, n, d), dtype), rand(rng, (B, H, n, d), dtype), rand(rng, (B, H, n, d), dtype)
    low = np.finfo(dtype).min                         # (in the compute dtype: a float64 mask is cast)
    triu = np.triu(np.full((n, n), -np.inf, mask_dtype), 1)
    hf = np.where(np.tril(np.ones((n, n), bool)), 0, low).astype(mask_dtype)
    padded = hf.copy()
    padded[:5] = low                                  # padding query rows: one constant throughout
    bias = rng.standard_normal((n, n)).astype(mask_dtype)
    cases = {
        "-inf": (triu, {}, 1), "finfo.min": (hf, {}, 2), "padding rows": (padded, {}, 2),
        "alibi": (hf, {"slopes": np.linspace(0.1, 0.5, H)}, 2),
        "bias": (bias, {}, 0), "causal finite floor": (hf, {"causal": True}, 0),
        "causal -inf": (triu, {"causal": True}, 1),
    }
    for name, (mask, kw, mode) in cases.items():
        one, passes = both_forms(q, k, v, mask, **kw)
        assert same(one, passes), name
        assert (one is None) == (mode == 0), name
        if mode:
            np.testing.assert_array_equal(one[0], mask == 0, err_msg=name)
            assert (one[1] is None) == (mode == 1), name
        if name == "padding rows":
            np.testing.assert_array_equal(one[1], np.arange(n) < 5)
    qn, vi = q.copy(), v.copy()
    qn[1, 2, 3, 4] = np.nan                           # a NaN score could meet a hidden key: float
    vi[0, 0, 9, 1] = np.inf                           # a finite floor needs v finite
    for name, args, mode in (("nan q", (qn, k, v, triu), 0), ("inf v, -inf", (q, k, vi, triu), 1),
                             ("inf v, finfo.min", (q, k, vi, hf), 0)):
        one, passes = both_forms(*args)
        assert same(one, passes) and (one is None) == (mode == 0), name
