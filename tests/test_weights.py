"""fastattn.attention_weights against the reference: every score modifier, GQA, the
1-D form and float masks; the weights times v are the attention."""

import numpy as np
import pytest
from conftest import assert_close, rand
from helpers import F32, F64

import fastattn
from fastattn import reference as ref


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(7, 2)), dict(softcap=2.0),
                                dict(alibi_slopes=np.array([0.5, 0.25])), dict(kv_lengths=np.array([[40], [13]])),
                                dict(causal=True, window=(20, 0), softcap=3.0)])
def test_attention_weights(isa, rng, dtype, kw):
    q, k = rand(rng, (2, 2, 70, 16), dtype), rand(rng, (2, 2, 90, 16), dtype)
    mask = rng.random((70, 90)) < 0.8
    mask[3] = False
    w = fastattn.attention_weights(q, k, mask=mask, **kw)
    assert w.shape == (2, 2, 70, 90) and w.dtype == dtype
    want = ref.attention_weights(q.astype(F64), k.astype(F64), mask=mask, **kw)
    assert_close(w, want, dtype)
    sums = w.astype(F64).sum(-1)
    visible = want.sum(-1) > 0
    assert_close(sums[visible], np.ones(visible.sum()), dtype)
    assert np.all(w[..., 3, :] == 0)


def test_attention_weights_gqa_1d_and_float_mask(rng):
    q, k = rand(rng, (2, 6, 5, 8)), rand(rng, (2, 3, 11, 8))
    w = fastattn.attention_weights(q, k, enable_gqa=True)
    assert w.shape == (2, 6, 5, 11)
    assert_close(w, ref.attention_weights(q.astype(F64), k.astype(F64), enable_gqa=True), F32)
    q1, k1, m1 = rand(rng, (8,)), rand(rng, (11, 8)), np.arange(11) < 6
    w1 = fastattn.attention_weights(q1, k1, mask=m1)
    assert w1.shape == (11,) and np.all(w1[6:] == 0) and abs(w1.sum() - 1) < 1e-6
    assert_close(w1, ref.attention_weights(q1.astype(F64), k1.astype(F64), mask=m1), F32)
    fm = rng.standard_normal((5, 11)).astype(F32)
    assert_close(fastattn.attention_weights(q, np.repeat(k, 2, axis=1), mask=fm),
                 ref.attention_weights(q.astype(F64), np.repeat(k, 2, axis=1).astype(F64), mask=fm.astype(F64)), F32)


def test_weights_times_v_is_attention(rng):
    q, k, v = rand(rng, (3, 40, 8), F64), rand(rng, (3, 60, 8), F64), rand(rng, (3, 60, 5), F64)
    w = fastattn.attention_weights(q, k, causal=True)
    assert_close(w @ v, fastattn.attention(q, k, v, causal=True), F64)
