"""Public behaviour: masks (bool and float, every broadcast shape, dtypes, strides),
fully masked rows, and causal masking aligned bottom-right (True) or top-left
("upper_left").  Float masks that reach the C core as bool: test_float_mask_as_bool.py."""

import numpy as np
import pytest
from conftest import assert_close, rand
from helpers import F32, F64, PATHS, check

import fastattn
from fastattn import reference as ref

# ---------------------------------------------------------------------------
# mask shapes, dtypes, strides
# ---------------------------------------------------------------------------
MASK_SHAPES = [(), (37,), (1, 37), (23, 1), (23, 37), (3, 1, 37), (2, 1, 23, 37), (2, 3, 23, 37), (1, 3, 1, 1)]


@pytest.mark.parametrize("mshape", MASK_SHAPES)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("causal", [False, True])
def test_mask_broadcast(isa, mask_pack, rng, mshape, kind, causal):
    q, k, v = rand(rng, (2, 3, 23, 16)), rand(rng, (2, 3, 37, 16)), rand(rng, (2, 3, 37, 8))
    if kind == "bool":
        mask = rng.random(mshape) < 0.7
    else:
        mask = rng.standard_normal(mshape).astype(F32)
        mask[rng.random(mshape) < 0.2] = -np.inf
    check(q, k, v, mask=mask, causal=causal)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_mask_dtype_mixed(rng, dtype):
    """A float mask of another float dtype is used in the compute dtype."""
    q, k, v = (rand(rng, (2, 30, 8), dtype) for _ in range(3))
    check(q, k, v, mask=rng.standard_normal((30, 30)).astype(F64 if dtype is F32 else F32))
    check(q, k, v, mask=rng.standard_normal((30, 30)).astype(np.float16))


def test_converted_broadcast_not_expanded(rng):
    """A float64 mask broadcast over rows (key padding) or heads, with float32
    inputs, is converted one broadcast entry at a time: it stays a stride-0 view
    (not an n_q x n_k copy), and the result agrees with the reference."""
    from fastattn._validate import _as_compute
    q, k, v = rand(rng, (2, 3, 40, 8)), rand(rng, (2, 3, 50, 8)), rand(rng, (2, 3, 50, 8))
    pad = np.where(rng.random(50) < 0.8, rng.standard_normal(50), -np.inf)
    for mask in (np.broadcast_to(pad, (40, 50)), np.broadcast_to(rng.standard_normal((2, 1, 40, 50)), (2, 3, 40, 50))):
        conv = _as_compute(mask, np.dtype(F32), unit_last=False)
        assert conv.dtype == F32 and 0 in conv.strides and conv.base is not None
        assert np.array_equal(conv, mask.astype(F32))
        check(q, k, v, mask=mask)
    k64 = np.broadcast_to(rand(rng, (1, 1, 50, 8), np.float64), (2, 3, 50, 8))   # inputs alike
    conv = _as_compute(k64, np.dtype(F32))
    assert conv.strides[:2] == (0, 0) and np.array_equal(conv, k64.astype(F32))
    check(q.astype(np.float64), k64, v)


def test_mask_strided_views(mask_pack, rng):
    q, k, v = rand(rng, (2, 40, 8)), rand(rng, (2, 50, 8)), rand(rng, (2, 50, 8))
    big = rng.random((2, 100, 150)) < 0.6
    check(q, k, v, mask=big[:, ::-2][:, :40, 1::3][:, :, :50])
    check(q, k, v, mask=np.swapaxes(rng.random((2, 50, 40)) < 0.6, -1, -2))


def test_large_mask_every_tile(isa, mask_pack, rng):
    """A random N x N bool mask over several query blocks and key tiles."""
    q, k, v = (rand(rng, (1, 300, 32)) for _ in range(3))
    check(q, k, v, mask=rng.random((300, 300)) < 0.5)
    check(q, k, v, mask=rng.random((300, 300)) < 0.5, causal=True)

@pytest.mark.parametrize("dtype", [F32, F64])
def test_fully_masked_rows(isa, rng, dtype):
    q, k, v = rand(rng, (2, 70, 16), dtype), rand(rng, (2, 300, 16), dtype), rand(rng, (2, 300, 16), dtype)
    mask = rng.random((70, 300)) < 0.5
    mask[[0, 5, 69]] = False
    out, lse = check(q, k, v, mask=mask)
    assert np.all(out[:, [0, 5, 69]] == 0) and np.all(np.isneginf(lse[:, [0, 5, 69]]))
    fmask = np.where(mask, 0.0, -np.inf).astype(dtype)
    out2, lse2 = check(q, k, v, mask=fmask)
    assert np.all(out2[:, [0, 5, 69]] == 0) and np.all(np.isneginf(lse2[:, [0, 5, 69]]))


# ---------------------------------------------------------------------------
# causal
# ---------------------------------------------------------------------------

def test_causal_more_queries_than_keys(isa, rng):
    """Bottom-right alignment: the first n_q - n_k rows see no key."""
    q, k, v = rand(rng, (100, 8)), rand(rng, (30, 8)), rand(rng, (30, 8))
    out, lse = check(q, k, v, causal=True)
    assert np.all(out[:70] == 0) and np.all(np.isneginf(lse[:70]))
    assert np.all(np.isfinite(lse[70:]))


def test_causal_alignment_is_bottom_right(rng):
    q, k, v = rand(rng, (2, 8)), rand(rng, (5, 8)), rand(rng, (5, 3))
    # query 0 sees keys 0..3, query 1 sees all five (flash-attn's docstring example)
    w0 = ref.softmax(ref.scores(q[:1], k[:4]).astype(F64))
    want0 = w0 @ v[:4].astype(F64)
    out = fastattn.attention(q, k, v, causal=True)
    assert_close(out[:1], want0, F32)
    np.testing.assert_array_equal(ref.causal_mask(2, 5), [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])

@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("path", list(PATHS))
def test_causal_upper_left(isa, rng, dtype, path):
    """causal="upper_left" (PyTorch's is_causal): query i sees keys j <= i for any
    n_q and n_k, as the explicit lower-triangular mask gives; window, ALiBi,
    kv_lengths, q_lengths and GQA (folded when few rows) follow the position i;
    on every kernel path (the split keys too, where most parts see nothing)."""
    nq, nk, threads = PATHS[path]
    shapes = [(nq, nk)] + ([(nk, nq)] if path == "tiled" else [])       # fewer and more queries than keys
    for n_q, n_k in shapes:
        q, k, v = rand(rng, (3, 2, n_q, 16), dtype), rand(rng, (3, 2, n_k, 16), dtype), rand(rng, (3, 2, n_k, 8), dtype)
        out = check(q, k, v, dtype, causal="upper_left", num_threads=threads)[0]
        tril = np.tril(np.ones((n_q, n_k), bool))
        want = ref.attention(q.astype(F64), k.astype(F64), v.astype(F64), mask=tril)    # an independent oracle
        assert_close(out, want, dtype)
        check(q, k, v, dtype, mask=tril, num_threads=threads)
        if n_q != n_k:   # not the bottom-right rule
            assert not np.allclose(out, fastattn.attention(q, k, v, causal=True))
        kv_len = np.array([[n_k], [n_k // 3], [0]])
        check(q, k, v, dtype, causal="upper_left", window=(40, 2), num_threads=threads)
        check(q, k, v, dtype, causal="upper_left", alibi_slopes=np.array([0.5, 0.25]), kv_lengths=kv_len,
              num_threads=threads)
        check(q, k, v, dtype, causal="upper_left", q_lengths=np.array([[n_q], [n_q // 2], [1]]), kv_lengths=kv_len,
              mask=rng.random((n_q, n_k)) < 0.8, num_threads=threads)
        check(q, k[:, :1], v[:, :1], dtype, causal="upper_left", enable_gqa=True, kv_lengths=kv_len,
              num_threads=threads)
        w = fastattn.attention_weights(q, k, causal="upper_left", window=(40, 2))
        assert_close(w, ref.attention_weights(q.astype(F64), k.astype(F64), causal="upper_left", window=(40, 2)),
                     dtype)


def test_causal_values():
    """causal: False, True, "lower_right" (= True), "upper_left", NumPy bools and
    0/1 and None (False); anything else is an error naming the choices."""
    q, k, v = np.ones((2, 4)), np.ones((5, 4)), np.arange(5.0)[:, None]
    bottom = fastattn.attention(q, k, v, causal=True)
    assert np.array_equal(fastattn.attention(q, k, v, causal="lower_right"), bottom)
    assert np.array_equal(fastattn.attention(q, k, v, causal=np.True_), bottom)
    assert np.array_equal(fastattn.attention(q, k, v, causal=1), bottom)
    assert np.array_equal(fastattn.attention(q, k, v, causal=None), fastattn.attention(q, k, v))
    np.testing.assert_allclose(fastattn.attention(q, k, v, causal="upper_left")[:, 0], [0.0, 0.5])
    for bad, exc in (("top_left", ValueError), ("", ValueError), (2, TypeError), ([True], TypeError),
                     (0.5, TypeError)):
        with pytest.raises(exc, match='causal must be False, True, "lower_right" or "upper_left"'):
            fastattn.attention(q, k, v, causal=bad)
        with pytest.raises(exc, match="causal must be"):
            fastattn.attention_varlen(q[:, None], k[:, None], v[:, None], [0, 2], [0, 5], causal=bad)
