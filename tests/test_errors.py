"""Public behaviour: bad input to fastattn.attention raises before any work, with a
message that names what was wrong (and, for the common slips, how to pass it).
The errors of one feature (GQA, windows, lengths, varlen, merge, layers) are in
that feature's file."""

import numpy as np
import pytest
from conftest import rand
from helpers import F32, check

import fastattn


def _qkv(rng):
    return rand(rng, (2, 5, 8)), rand(rng, (2, 6, 8)), rand(rng, (2, 6, 4))


@pytest.mark.parametrize("change,exc,msg", [
    (dict(k=np.zeros((2, 6, 7), F32)), ValueError, "d_k differs"),
    (dict(v=np.zeros((2, 7, 4), F32)), ValueError, "n_k differs"),
    (dict(k=np.zeros((3, 6, 8), F32), v=np.zeros((3, 6, 4), F32)), ValueError, "leading dims do not broadcast"),
    (dict(k=np.zeros(8, F32)), ValueError, "k must have shape"),
    (dict(q=np.float32(1)), ValueError, "q must have shape"),
    (dict(v=np.float32(1)), ValueError, "v must have shape"),
    (dict(mask=np.ones((5, 5), bool)), ValueError, "does not broadcast"),
    (dict(mask=np.ones((3, 5, 6), bool)), ValueError, "leading dims do not broadcast"),
    (dict(mask=np.ones((5, 6), np.int64)), TypeError, "integer dtype"),
    (dict(mask=np.ones((5, 6), complex)), TypeError, "mask must be bool or floating"),
    (dict(q=np.ones((2, 5, 8), complex)), TypeError, "complex"),
    (dict(k=np.ones((2, 6, 8), object)), TypeError, "object"),
    (dict(v=np.full((2, 6, 4), "a")), TypeError, "not supported"),
    (dict(q=None), TypeError, "q must be an array"),
    (dict(num_threads=0), ValueError, "num_threads"),
    (dict(num_threads=np.int64(0)), ValueError, "num_threads"),
    (dict(num_threads=1.5), TypeError, "num_threads"),
    (dict(num_threads=True), TypeError, "num_threads"),
    (dict(scale=np.inf), ValueError, "scale must be finite"),
    (dict(scale=np.nan), ValueError, "scale must be finite"),
    (dict(scale="x"), TypeError, "scale"),
    (dict(scale="1"), TypeError, "scale must be a real number, got str"),           # float() would parse it
    (dict(scale=True), TypeError, "scale must be a real number, got bool"),
    (dict(scale=np.bool_(True)), TypeError, "scale must be a real number, got bool"),
    (dict(scale=np.complex128(0.5)), TypeError, "got complex128 of dtype complex128"),  # float() drops 0j
    (dict(scale=np.array([0.5])), TypeError, "scale must be a real number, got ndarray"),
    (dict(scale=np.array("1")), TypeError, "got ndarray of dtype <U1"),
    (dict(softcap="30"), TypeError, "softcap must be None or a positive number, got str"),
    (dict(softcap=True), TypeError, "softcap must be None or a positive number, got bool"),
    (dict(softcap=1j), TypeError, "softcap must be None or a positive number, got complex"),
    (dict(out=np.empty((2, 5, 5), F32)), ValueError, "out has shape"),
    (dict(out=np.empty((2, 5, 4), np.int32)), TypeError, "out has dtype int32, which the result's dtype float32"),
    (dict(out=np.empty((2, 5, 4), bool)), TypeError, "out has dtype bool"),
    (dict(out=[[0.0]]), TypeError, "out must be a numpy.ndarray"),
])
def test_bad_input(rng, change, exc, msg):
    q, k, v = _qkv(rng)
    args = dict(q=q, k=k, v=v)
    kw = {}
    for name, val in change.items():
        (args if name in args else kw)[name] = val
    with pytest.raises(exc, match=msg):
        fastattn.attention(args["q"], args["k"], args["v"], **kw)


def test_readonly_out(rng):
    q, k, v = _qkv(rng)
    out = np.empty((2, 5, 4), F32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        fastattn.attention(q, k, v, out=out)


def test_longdouble_rejected(rng):
    q, k, v = _qkv(rng)
    if np.dtype(np.longdouble).itemsize > 8:
        with pytest.raises(TypeError, match="float32 or float64"):
            fastattn.attention(q.astype(np.longdouble), k, v)


def test_masked_arrays_refused():
    """np.ma.MaskedArray inputs were computed with the data under their mask."""
    x = np.ma.MaskedArray(np.ones((2, 4)), mask=[[0, 1, 0, 0], [0, 0, 0, 0]])
    plain = np.ones((2, 4))
    for call in (lambda: fastattn.attention(x, plain, plain),
                 lambda: fastattn.attention(plain, plain, x),
                 lambda: fastattn.attention(plain, plain, plain, mask=np.ma.MaskedArray(np.ones((2, 2), bool))),
                 lambda: fastattn.attention(plain[None], plain[None], plain[None],
                                            kv_lengths=np.ma.MaskedArray([2])),
                 lambda: fastattn.softmax(x),
                 lambda: fastattn.attention_weights(x, plain),
                 lambda: fastattn.merge_attention([x], [np.zeros(2)]),
                 lambda: fastattn.self_attention(x, np.eye(4), np.eye(4), np.eye(4))):
        with pytest.raises(TypeError, match=r"MaskedArray.*\.filled\("):
            call()


def test_layout_errors(rng):
    """A layout other than "bhld" and "blhd" (any case), an input of fewer than 3
    dims with "blhd", and out= in the other layout raise, naming what was wrong."""
    q, k, v = rand(rng, (2, 5, 3, 8)), rand(rng, (2, 6, 3, 8)), rand(rng, (2, 6, 3, 4))
    for bad in ("bshd", "", "bhl"):
        with pytest.raises(ValueError, match=f'layout must be "bhld" .* or "blhd" .*, got {bad!r}'):
            fastattn.attention(q, k, v, layout=bad)
        with pytest.raises(ValueError, match="layout must be"):
            fastattn.attention_weights(q, k, layout=bad)
    with pytest.raises(TypeError, match='layout must be "bhld" or "blhd", got NoneType'):
        fastattn.attention(q, k, v, layout=None)
    with pytest.raises(ValueError, match=r'layout="blhd" takes k of shape \(\.\.\., n, H, d\), got shape \(6, 8\)'):
        fastattn.attention(q, k[0, :, 0], v, layout="blhd")
    with pytest.raises(ValueError, match=r'layout="blhd" takes q of shape .*, got shape \(8,\)'):
        fastattn.attention_weights(q[0, 0, 0], k, layout="blhd")
    with pytest.raises(ValueError, match=r"out has shape \(2, 3, 5, 4\), the result has shape \(2, 5, 3, 4\)"):
        fastattn.attention(q, k, v, layout="blhd", out=np.empty((2, 3, 5, 4), F32))
    assert np.array_equal(fastattn.attention(q, k, v, layout="BLHD"), fastattn.attention(q, k, v, layout="blhd"))
    qh, kh, vh = (np.swapaxes(a, 1, 2) for a in (q, k, v))
    assert np.array_equal(fastattn.attention(qh, kh, vh, layout="BHLD"), fastattn.attention(qh, kh, vh))
    # the other errors name the shapes as given, in that layout
    with pytest.raises(ValueError, match=r"d_k differs: q has shape \(2, 5, 3, 8\) \(d_k=8\), "
                                         r"k has shape \(2, 6, 3, 4\)"):
        fastattn.attention(q, k[..., :4], v, layout="blhd")
    with pytest.raises(ValueError, match=r"n_k differs: k has shape \(2, 6, 3, 8\) \(n_k=6\), "
                                         r"v has shape \(2, 4, 3, 4\)"):
        fastattn.attention(q, k, v[:, :4], layout="blhd")
    with pytest.raises(ValueError, match=r"k and v have different head counts: k \(2, 6, 3, 8\), v \(2, 6, 1, 4\)"):
        fastattn.attention(q, k, v[:, :, :1], layout="blhd", enable_gqa=True)
    with pytest.raises(ValueError, match=r"leading dims do not broadcast: q \(2, 5, 3, 8\), k \(2, 6, 2, 8\)"):
        fastattn.attention_weights(q, k[:, :, :2], layout="blhd")


# ---------------------------------------------------------------------------
# hints for the common slips
# ---------------------------------------------------------------------------

def test_gqa_hint(rng):
    """Fewer key/value heads than query heads, dividing them, without enable_gqa:
    the error says to pass enable_gqa=True (in either layout, and for the weights);
    not when they do not divide, or when enable_gqa is already given."""
    q, k, v = rand(rng, (2, 4, 5, 8)), rand(rng, (2, 2, 6, 8)), rand(rng, (2, 2, 6, 4))
    hint = r"\(q has 4 heads, k and v 2: for grouped-query attention pass enable_gqa=True\)"
    with pytest.raises(ValueError, match=r"leading dims do not broadcast: q \(2, 4, 5, 8\), .*" + hint):
        fastattn.attention(q, k, v)
    with pytest.raises(ValueError, match=r"q \(2, 5, 4, 8\), k \(2, 6, 2, 8\), v \(2, 6, 2, 4\) " + hint):
        fastattn.attention(*(np.swapaxes(a, 1, 2) for a in (q, k, v)), layout="blhd")
    with pytest.raises(ValueError, match=r"\(q has 4 heads, k 2: for grouped-query attention pass enable_gqa=True\)"):
        fastattn.attention_weights(q, k)
    assert check(q, k, v, enable_gqa=True)[0].shape == (2, 4, 5, 4)          # the hint, followed
    for kk, vv in ((k[:, :1].repeat(3, 1), v[:, :1].repeat(3, 1)),   # 3 does not divide 4
                   (k[:1, :1], v[:1, :2]),                           # k and v differ
                   (rand(rng, (3, 4, 6, 8)), rand(rng, (3, 4, 6, 4)))):  # the heads agree, the batch not
        with pytest.raises(ValueError, match="leading dims do not broadcast") as e:
            fastattn.attention(q, kk, vv)
        assert "enable_gqa" not in str(e.value)


def test_key_padding_mask_hint():
    """A PyTorch-style key-padding mask (B, n_k) is refused with the way to pass it."""
    q = np.ones((2, 4, 5, 8), F32)
    with pytest.raises(ValueError, match=r"mask\[:, None, None, :\].*kv_lengths"):
        fastattn.attention(q, q, q, mask=np.ones((2, 5), bool))
    keep = np.array([[True] * 5, [True, True, True, False, False]])
    got = fastattn.attention(q, q, q, mask=keep[:, None, None, :])          # the hint, followed
    np.testing.assert_array_equal(got, fastattn.attention(q, q, q, kv_lengths=np.array([[5], [3]])))
