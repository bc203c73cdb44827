"""Random shapes, masks, options and SIMD paths (hypothesis) against the reference."""

import numpy as np
from conftest import ISAS, assert_close, reference64, tol
from hypothesis import given, settings
from hypothesis import strategies as st

import fastattn
from fastattn import _core
from fastattn import reference as ref

LEAD = st.lists(st.integers(1, 3), min_size=0, max_size=3)


@st.composite
def problems(draw):
    lead = tuple(draw(LEAD))
    # each operand keeps a random suffix of the leading dims, some set to 1 (broadcast)
    def sub(shape):
        n = draw(st.integers(0, len(shape)))
        return tuple(d if draw(st.booleans()) else 1 for d in shape[len(shape) - n:])
    nq, nk = draw(st.integers(1, 80)), draw(st.integers(0, 150))
    dk, dv = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(sub(lead) + (nq, dk)).astype(dtype)
    k = rng.standard_normal(sub(lead) + (nk, dk)).astype(dtype)
    v = rng.standard_normal(sub(lead) + (nk, dv)).astype(dtype)
    kw = dict(causal=draw(st.booleans()))
    mask_kind = draw(st.sampled_from([None, "bool", "float"]))
    if mask_kind:
        mshape = sub(lead) + (draw(st.sampled_from([1, nq])), draw(st.sampled_from([1, nk])))
        if mask_kind == "bool":
            kw["mask"] = rng.random(mshape) < draw(st.floats(0.0, 1.0))
        else:
            m = rng.standard_normal(mshape) * 3
            m[rng.random(mshape) < 0.3] = -np.inf
            kw["mask"] = m.astype(dtype)
    if draw(st.booleans()):
        kw["scale"] = draw(st.floats(-2.0, 2.0))
    kw["num_threads"] = draw(st.sampled_from([None, 1, 2]))
    return q, k, v, kw, draw(st.sampled_from(ISAS))


@settings(max_examples=150, deadline=None)
@given(problems())
def test_random_problems(p):
    q, k, v, kw, isa = p
    before = _core.isa_name()
    _core.set_isa(isa)   # every SIMD path this CPU has
    try:
        out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    finally:
        _core.set_isa(before)
    kw.pop("num_threads")
    want, want_lse = reference64(q, k, v, **kw)
    assert_close(out, want, q.dtype)
    assert_close(lse, want_lse, q.dtype, "lse")


@st.composite
def problems_with_options(draw):
    """(B, H) heads (GQA too), every score option, float masks of only 0 and
    -inf shared by the heads (which may go to the C core as bool masks), scale
    0, and NaN or inf planted in q, k or v; tiles, the fused exp and the row
    kernel's limit forced to random values."""
    B, H = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 4]))
    hkv = draw(st.sampled_from([h for h in (1, 2, 4) if H % h == 0]))
    gqa = hkv < H
    nq, nk = draw(st.integers(1, 90)), draw(st.integers(0, 200))
    dk, dv = draw(st.integers(1, 40)), draw(st.integers(1, 24))
    dtype = draw(st.sampled_from([np.float16, np.float32, np.float64]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((B, H, nq, dk))
    k = rng.standard_normal((B, hkv, nk, dk))
    v = rng.standard_normal((B, hkv, nk, dv))
    for a in (q, k, v):
        if a.size and draw(st.integers(0, 5)) == 0:
            a[tuple(rng.integers(0, s) for s in a.shape)] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    kw = dict(causal=draw(st.booleans()), enable_gqa=gqa)
    mask_kind = draw(st.sampled_from([None, "bool", "float", "zero_or_neginf", "causal"]))
    mshape = (draw(st.sampled_from([1, H])), nq, draw(st.sampled_from([1, nk])))
    if mask_kind == "bool":
        kw["mask"] = rng.random(mshape) < draw(st.floats(0.0, 1.0))
    elif mask_kind == "float":
        m = rng.standard_normal(mshape) * 3
        m[rng.random(mshape) < 0.3] = -np.inf
        kw["mask"] = m.astype(draw(st.sampled_from([dtype, np.float64])))
    elif mask_kind == "zero_or_neginf":
        kw["mask"] = np.where(rng.random(mshape) < draw(st.floats(0.0, 1.0)), 0.0, -np.inf)
    elif mask_kind == "causal":
        kw["mask"] = np.triu(np.full((nq, nk), -np.inf), draw(st.integers(-3, 5)))
    if draw(st.booleans()):
        kw["scale"] = draw(st.sampled_from([0.0, -0.7, 0.05, 1.5]))
    if draw(st.integers(0, 3)) == 0:
        kw["window"] = (draw(st.sampled_from([None, 0, 4, 40])), draw(st.sampled_from([None, 0, 3])))
    if draw(st.integers(0, 3)) == 0:
        kw["softcap"] = draw(st.sampled_from([0.5, 5.0]))
    if draw(st.integers(0, 3)) == 0:
        kw["alibi_slopes"] = rng.random(H) * draw(st.sampled_from([0.05, 1.0]))
    if draw(st.integers(0, 3)) == 0:
        kw["kv_lengths"] = rng.integers(0, nk + 1, (B, 1))
    kw["num_threads"] = draw(st.sampled_from([1, 2, 3]))
    forced = dict(tiles=(draw(st.sampled_from([0, 16, 40])), draw(st.sampled_from([0, 16, 40, 64]))),
                  fused=draw(st.sampled_from([-1, 0, 1])), rows_max=draw(st.sampled_from([0, 1, 8])))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), kw, forced, draw(st.sampled_from(ISAS))


@settings(max_examples=300, deadline=None)
@given(problems_with_options())
def test_random_problems_with_options(p):
    q, k, v, kw, forced, isa = p
    before = _core.isa_name()
    _core.set_isa(isa)
    _core._set_tiles(*forced["tiles"])
    _core._set_fused(forced["fused"])
    _core._set_rows_max(forced["rows_max"])
    try:
        out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    finally:
        _core.set_isa(before)
        _core._set_tiles(0, 0)
        _core._set_fused(-1)
        _core._set_rows_max(0)
    kw.pop("num_threads")
    want, want_lse = reference64(q, k, v, **kw)
    # float32 rounds a score s to about |s| * 6e-8, which exp carries into the weights:
    # the tolerance grows with the largest finite score
    mask = kw.pop("mask", None)
    with np.errstate(all="ignore"):
        s = ref.scores(q.astype(np.float64), k.astype(np.float64), mask=mask if mask is None or mask.dtype == bool
                       else mask.astype(np.float64), **kw)
    s = np.abs(s[np.isfinite(s)])
    dtype = np.result_type(q, k, v)
    rtol = tol(dtype) * max(1.0, float(s.max(initial=0.0)) / 16)
    assert_close(out, want, dtype, rtol=rtol)
    assert_close(lse, want_lse, dtype, "lse", rtol=rtol)
