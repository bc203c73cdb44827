"""The layers (self_attention, multihead_attention) against their twins in
fastattn.reference: biases, GQA, masks, seq_lengths, num_threads, errors."""

import numpy as np
import pytest
from conftest import assert_close, rand
from helpers import F32, F64

import fastattn
from fastattn import _core
from fastattn import reference as ref


@pytest.mark.parametrize("dtype", [F32, F64])
def test_self_attention(rng, dtype):
    x = rand(rng, (2, 13, 24), dtype)
    wq, wk, wv = rand(rng, (24, 16), dtype, 0.3), rand(rng, (24, 16), dtype, 0.3), rand(rng, (24, 10), dtype, 0.3)
    biases = dict(b_q=rand(rng, (16,), dtype), b_k=rand(rng, (16,), dtype), b_v=rand(rng, (10,), dtype))
    c = lambda a: a.astype(F64)  # noqa: E731
    for kw in (dict(), dict(causal=True), dict(mask=rng.random((13, 13)) < 0.7, scale=0.5),
               dict(biases, causal=True), dict(b_v=biases["b_v"])):
        got = fastattn.self_attention(x, wq, wk, wv, **kw)
        assert got.shape == (2, 13, 10) and got.dtype == dtype
        kw64 = {n: c(a) if n.startswith("b_") else a for n, a in kw.items()}
        assert_close(got, ref.self_attention(c(x), c(wq), c(wk), c(wv), **kw64), dtype)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (4, 1), (3, None)])
def test_multihead_attention(rng, dtype, H, Hkv):
    d_head, d_model = 6, 20
    x = rand(rng, (2, 11, d_model), dtype)
    kv = Hkv or H
    wq, wo = rand(rng, (d_model, H * d_head), dtype, 0.3), rand(rng, (H * d_head, d_model), dtype, 0.3)
    wk, wv = rand(rng, (d_model, kv * d_head), dtype, 0.3), rand(rng, (d_model, kv * d_head), dtype, 0.3)
    c = lambda a: a.astype(F64)  # noqa: E731
    biases = dict(b_q=rand(rng, (H * d_head,), dtype), b_k=rand(rng, (kv * d_head,), dtype),
                  b_v=rand(rng, (kv * d_head,), dtype), b_o=rand(rng, (d_model,), dtype))
    for kw in (dict(), dict(causal=True), dict(mask=rng.random((H, 11, 11)) < 0.7), dict(biases, causal=True),
               dict(b_k=biases["b_k"], b_o=biases["b_o"])):
        got = fastattn.multihead_attention(x, wq, wk, wv, wo, num_heads=H, num_kv_heads=Hkv, **kw)
        assert got.shape == (2, 11, d_model) and got.dtype == dtype
        kw64 = {n: c(a) if n.startswith("b_") else a for n, a in kw.items()}
        want = ref.multihead_attention(c(x), c(wq), c(wk), c(wv), c(wo), num_heads=H, num_kv_heads=Hkv, **kw64)
        assert_close(got, want, dtype)
    if Hkv is None:   # the biases are those of y = x W + b, per head: two heads' columns swapped swap their outputs
        p = np.r_[d_head:2 * d_head, 0:d_head, 2 * d_head:H * d_head]
        got = fastattn.multihead_attention(x, wq, wk, wv, wo, num_heads=H, **biases)
        swapped = dict(biases, b_q=biases["b_q"][p], b_k=biases["b_k"][p], b_v=biases["b_v"][p])
        assert_close(fastattn.multihead_attention(x, wq[:, p], wk[:, p], wv[:, p], wo[p], num_heads=H, **swapped),
                     got.astype(F64), dtype)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_layers_seq_lengths(rng, dtype):
    """A right-padded batch through the layers: each sequence's real tokens as if it
    were alone (the padding neither seen nor changing anything), padding tokens zero;
    against the reference, with GQA, causal or not, per-batch and scalar lengths."""
    n, d_model, H, d_head = 40, 24, 4, 6
    x = rand(rng, (3, n, d_model), dtype)
    lengths = np.array([40, 17, 0])
    wq, wo = rand(rng, (d_model, H * d_head), dtype, 0.3), rand(rng, (H * d_head, d_model), dtype, 0.3)
    wk, wv = rand(rng, (d_model, 2 * d_head), dtype, 0.3), rand(rng, (d_model, 2 * d_head), dtype, 0.3)
    c = lambda a: np.asarray(a).astype(F64)  # noqa: E731
    xp = x.copy()
    for b, m in enumerate(lengths):
        xp[b, m:] = np.nan                                 # padding tokens are never read
    b_o = rand(rng, (d_model,), dtype)
    for causal in (False, True):
        got = fastattn.multihead_attention(xp, wq, wk, wv, wo, num_heads=H, num_kv_heads=2, causal=causal,
                                           seq_lengths=lengths)
        want = ref.multihead_attention(c(x), c(wq), c(wk), c(wv), c(wo), num_heads=H, num_kv_heads=2,
                                       causal=causal, seq_lengths=lengths)
        assert_close(got, want, dtype)
        got_b = fastattn.multihead_attention(xp, wq, wk, wv, wo, num_heads=H, num_kv_heads=2, causal=causal,
                                             seq_lengths=lengths, b_o=b_o, b_v=wv[0])
        want_b = ref.multihead_attention(c(x), c(wq), c(wk), c(wv), c(wo), num_heads=H, num_kv_heads=2,
                                         causal=causal, seq_lengths=lengths, b_o=c(b_o), b_v=c(wv[0]))
        assert_close(got_b, want_b, dtype)
        got_v = fastattn.multihead_attention(xp, wq, wk, wv, wo, num_heads=H, num_kv_heads=2, causal=causal,
                                             seq_lengths=lengths, b_v=wv[0])
        for b, m in enumerate(lengths):   # the output bias on real tokens only
            assert np.all(got_b[b, m:] == 0)
            assert_close(got_b[b, :m], got_v[b, :m].astype(F64) + c(b_o), dtype)
        one = fastattn.self_attention(xp, wq, wo.T, wv, causal=causal, seq_lengths=lengths)
        assert_close(one, ref.self_attention(c(x), c(wq), c(wo.T), c(wv), causal=causal, seq_lengths=lengths), dtype)
        for b, m in enumerate(lengths):
            alone = fastattn.multihead_attention(x[b, :m], wq, wk, wv, wo, num_heads=H, num_kv_heads=2, causal=causal)
            assert_close(got[b, :m], alone.astype(F64), dtype)
            assert np.all(got[b, m:] == 0) and np.all(one[b, m:] == 0)
    got = fastattn.self_attention(x, wq, wo.T, wv, seq_lengths=9)          # a scalar: every sequence
    assert_close(got, ref.self_attention(c(x), c(wq), c(wo.T), c(wv), seq_lengths=9), dtype)


def test_layers_num_threads(rng):
    """num_threads reaches the attention (the call's team), with the same result."""
    x = rand(rng, (4, 256, 64))
    w = [rand(rng, (64, 64), F32, 0.2) for _ in range(4)]
    for nt in (1, 2):
        got = fastattn.multihead_attention(x, *w, num_heads=4, causal=True, num_threads=nt)
        assert _core.last_threads() == (nt if _core.openmp_enabled() else 1)
        want = ref.multihead_attention(x.astype(F64), *(a.astype(F64) for a in w), num_heads=4, causal=True)
        assert_close(got, want, F32)
        one = fastattn.self_attention(x, *w[:3], causal=True, num_threads=nt)
        assert _core.last_threads() == (nt if _core.openmp_enabled() else 1)
        assert_close(one, ref.self_attention(x.astype(F64), *(a.astype(F64) for a in w[:3]), causal=True), F32)
    for bad in (0, 1.5):
        with pytest.raises((ValueError, TypeError), match="num_threads"):
            fastattn.multihead_attention(x, *w, num_heads=4, num_threads=bad)
        with pytest.raises((ValueError, TypeError), match="num_threads"):
            fastattn.self_attention(x, *w[:3], num_threads=bad)


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("lengths,exc,msg", [
    (np.array([3, 4]), ValueError, r"seq_lengths of shape \(2,\) does not broadcast to x's leading dims \(3,\)"),
    (np.array([3, 4, 9]), ValueError, r"seq_lengths must lie in \[0, n=8\]"),
    (np.array([3.0, 4, 5]), TypeError, "seq_lengths must be integers"),
])
def test_layers_seq_lengths_errors(lengths, exc, msg):
    x, w = np.ones((3, 8, 4)), np.ones((4, 4))
    with pytest.raises(exc, match=msg):
        fastattn.self_attention(x, w, w, w, seq_lengths=lengths)
    with pytest.raises(exc, match=msg):
        fastattn.multihead_attention(x, w, w, w, w, num_heads=2, seq_lengths=lengths)


@pytest.mark.parametrize("change,exc,msg", [
    (dict(x=np.ones(20)), ValueError, "x must have shape"),
    (dict(w_q=np.ones((19, 24))), ValueError, "w_q has 19 rows"),
    (dict(w_q=np.ones((20, 23))), ValueError, "not a multiple of num_heads"),
    (dict(w_k=np.ones((20, 24))), ValueError, "w_k has 24 columns"),
    (dict(w_v=np.ones((20, 12, 1))), ValueError, "2-D"),
    (dict(w_o=np.ones((24, 21))), ValueError, "w_o has 21 columns"),
    (dict(num_heads=0), ValueError, "positive"),
    (dict(num_kv_heads=3), ValueError, "multiple of num_kv_heads"),
    (dict(num_heads=2.0), TypeError, "num_heads must be an int"),
])
def test_multihead_errors(change, exc, msg):
    args = dict(x=np.ones((5, 20)), w_q=np.ones((20, 24)), w_k=np.ones((20, 12)), w_v=np.ones((20, 12)),
                w_o=np.ones((24, 20)), num_heads=4, num_kv_heads=2)
    args.update(change)
    with pytest.raises(exc, match=msg):
        fastattn.multihead_attention(args.pop("x"), args.pop("w_q"), args.pop("w_k"), args.pop("w_v"),
                                     args.pop("w_o"), **args)


@pytest.mark.parametrize("name,shape,msg", [
    ("b_q", (23,), r"b_q has shape \(23,\); it must be \(24,\), as w_q has 24 columns"),
    ("b_k", (24,), r"b_k has shape \(24,\); it must be \(12,\)"),
    ("b_v", (1, 12), r"b_v has shape \(1, 12\)"),
    ("b_o", (24,), r"b_o has shape \(24,\); it must be \(20,\), as w_o has 20 columns"),
])
def test_layer_bias_errors(name, shape, msg):
    args = dict(w_q=np.ones((20, 24)), w_k=np.ones((20, 12)), w_v=np.ones((20, 12)), w_o=np.ones((24, 20)))
    with pytest.raises(ValueError, match=msg):
        fastattn.multihead_attention(np.ones((5, 20)), *args.values(), num_heads=4, num_kv_heads=2,
                                     **{name: np.ones(shape)})
    if name != "b_o":
        with pytest.raises(ValueError, match=name + " has shape"):
            fastattn.self_attention(np.ones((5, 20)), np.ones((20, 12)), np.ones((20, 12)), np.ones((20, 12)),
                                    **{name: np.ones((13,))})
    with pytest.raises(TypeError, match=name):
        fastattn.multihead_attention(np.ones((5, 20)), *args.values(), num_heads=4, num_kv_heads=2,
                                     **{name: np.ones(shape, complex)})


def test_self_attention_errors():
    with pytest.raises(ValueError, match="w_k has 5 columns"):
        fastattn.self_attention(np.ones((3, 4)), np.ones((4, 6)), np.ones((4, 5)), np.ones((4, 2)))
    with pytest.raises(ValueError, match="w_v has 3 rows"):
        fastattn.self_attention(np.ones((3, 4)), np.ones((4, 6)), np.ones((4, 6)), np.ones((3, 2)))


@pytest.mark.parametrize("kw", [dict(num_heads=True), dict(num_heads=2, num_kv_heads=True),
                                dict(num_heads=np.bool_(True)), dict(num_heads=2.0), dict(num_heads=None)])
def test_counts_refuse_bools(kw):
    x, w = np.ones((2, 3, 4)), np.eye(4)
    with pytest.raises(TypeError, match="num_(kv_)?heads must be"):
        fastattn.multihead_attention(x, w, w, w, w, **kw)
