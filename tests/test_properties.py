"""Random problems against the reference: hypothesis over shapes, masks, options and SIMD paths, and
the first cases of the differential fuzzer (tests/fuzz.py)."""

import fuzz
import numpy as np
import pytest
from conftest import ISAS
from helpers import check
from hypothesis import given, settings
from hypothesis import strategies as st

from fastattn import _core

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
        check(q, k, v, q.dtype, **kw)   # output, lse, dtypes and the team of kw's num_threads
    finally:
        _core.set_isa(before)



@pytest.mark.parametrize("seed", range(150))
def test_fuzz_cases(seed):
    """Cases 0-149 of the differential fuzzer (tests/fuzz.py): B and H with GQA,
    every mask kind and layout (float masks of only 0 and -inf too, which may
    reach the C core as bool masks), window, softcap, ALiBi, kv_lengths, scale
    0, float16 to float64, NaN and inf in q, k and v, transposed views, out=
    and attention_weights, on a random SIMD path and thread count with tiles,
    the fused exp, the far prefetch and the row kernel's limit forced; each
    against the reference."""
    fuzz.run_case(seed)
