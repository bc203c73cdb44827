"""attention_backward: the gradients against the NumPy reference's materialised
formula (reference.attention_backward), which finite differences check in
float64; every option the forward takes, both layouts, broadcasting, GQA, both
thread modes of the driver (whole leading indices, or key blocks shared), each
SIMD path, and bitwise determinism."""


import ml_dtypes
import numpy as np
import pytest
from conftest import tol

import fastattn
from fastattn import _core
from fastattn import reference as ref

F32, F64 = np.float32, np.float64


def problem(rng, q_shape, k_shape, v_shape=None, dtype=F64):
    q = rng.standard_normal(q_shape).astype(dtype)
    k = rng.standard_normal(k_shape).astype(dtype)
    v = rng.standard_normal(v_shape or k_shape).astype(dtype)
    return q, k, v


def grads(q, k, v, do=None, seed=1, num_threads=None, **kw):
    """fastattn's gradients and the reference's (float64), for do (or a random one)."""
    out, lse = fastattn.attention(q, k, v, return_lse=True, num_threads=num_threads, **kw)
    if do is None:
        do = np.random.default_rng(seed).standard_normal(out.shape).astype(out.dtype)
    got = fastattn.attention_backward(do, q, k, v, out, lse, num_threads=num_threads, **kw)
    c = lambda a: np.asarray(a, np.float64)  # noqa: E731
    kw64 = {n: (c(x) if n == "mask" and np.asarray(x).dtype != bool else x) for n, x in kw.items()}
    want = ref.attention_backward(c(do), c(q), c(k), c(v), c(out), **kw64)
    return got, want


def check(got, want, inputs, dtype):
    for g, w, x, name in zip(got, want, inputs, ("dq", "dk", "dv")):
        assert g.shape == np.shape(x), f"{name}: shape {g.shape} != {np.shape(x)}"
        assert g.dtype == np.result_type(*inputs), f"{name}: dtype {g.dtype}"
        assert np.isfinite(g).all(), name
        scale = max(1.0, float(np.abs(w).max()))
        err = float(np.abs(g.astype(F64) - w).max())
        assert err <= 4 * tol(dtype) * scale, f"{name}: max error {err:.3g} (scale {scale:.3g})"


def test_reference_against_finite_differences():
    """The reference's formula is the gradient: central differences in float64,
    with a mask, causal, ALiBi and a softcap (the reference differentiates it)."""
    rng = np.random.default_rng(0)
    q, k, v = problem(rng, (2, 5, 4), (2, 7, 4), (2, 7, 3))
    mask = rng.random((5, 7)) > 0.2
    kw = dict(mask=mask, causal=True, alibi_slopes=np.array([0.3, 0.1])[:, None], softcap=2.0)
    do = rng.standard_normal((2, 5, 3))
    out = ref.attention(q, k, v, **kw)
    got = ref.attention_backward(do, q, k, v, out, **kw)
    for x, g in zip((q, k, v), got):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            h = 1e-6
            x[idx] += h
            up = np.sum(do * ref.attention(q, k, v, **kw))
            x[idx] -= 2 * h
            down = np.sum(do * ref.attention(q, k, v, **kw))
            x[idx] += h
            num[idx] = (up - down) / (2 * h)
        np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("tiles", [None, (32, 64), (64, 256), (24, 40)])
@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("causal", [False, True, "upper_left"])
@pytest.mark.parametrize("n_q, n_k, d", [(1, 1, 1), (37, 130, 24), (150, 64, 40), (64, 200, 64), (33, 33, 7),
                                         (140, 530, 40)])
def test_shapes_and_tails(isa, tiles, dtype, causal, n_q, n_k, d):
    """Block tails, head dims off the vector width, one row, each SIMD path: with
    the tuning's tiles (bwd_bq, bwd_bk; two leading indices share each one's key
    blocks, so units of 256 keys are halved), and forced: the AVX-512 tables' 32 x
    64, the avx2 and generic tables' 64 x 256 unhalved, tiles off the vector width."""
    rng = np.random.default_rng(n_q * 1000 + n_k)
    inputs = problem(rng, (2, n_q, d), (2, n_k, d), (2, n_k, d + 3), dtype)
    with _core.forcing(**dict(zip(("bq", "bk"), tiles or (0, 0)))):
        got, want = grads(*inputs, causal=causal)
    check(got, want, inputs, dtype)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("lead", [(1,), (2, 3)])
def test_threads_and_determinism(threads, lead):
    """One leading index (the team shares its key blocks and sums dQ in thread
    order) or several (each thread whole ones): correct, and bitwise the same
    from run to run."""
    rng = np.random.default_rng(3)
    inputs = problem(rng, lead + (300, 32), lead + (300, 32), dtype=F32)
    do = rng.standard_normal(lead + (300, 32)).astype(F32)
    got, want = grads(*inputs, do=do, num_threads=threads, causal=True)
    check(got, want, inputs, F32)
    again, _ = grads(*inputs, do=do, num_threads=threads, causal=True)
    for a, b in zip(got, again):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("kind", ["bool", "float", "window", "alibi", "softcap", "kv_lengths", "q_lengths",
                                  "all_hidden"])
def test_options(dtype, kind):
    """Each score option the forward takes; rows that see nothing get zeros."""
    rng = np.random.default_rng(5)
    B, H, n, d = 2, 3, 90, 16
    inputs = problem(rng, (B, H, n, d), (B, H, n + 10, d), dtype=dtype)
    kw = {
        "bool": dict(mask=rng.random((B, 1, n, n + 10)) > 0.3),
        "float": dict(mask=np.where(rng.random((n, n + 10)) > 0.3, rng.standard_normal((n, n + 10)), -np.inf)),
        "window": dict(window=(20, 5)),
        "alibi": dict(alibi_slopes=np.array([0.5, 0.25, 0.125]), causal=True),
        "softcap": dict(softcap=1.5, mask=rng.random((n, n + 10)) > 0.2),
        "kv_lengths": dict(kv_lengths=np.array([[40], [100]])),
        "q_lengths": dict(q_lengths=np.array([[30], [90]]), causal=True),
        "all_hidden": dict(mask=np.arange(n)[:, None] % 3 > 0),
    }[kind]
    got, want = grads(*inputs, **kw)
    check(got, want, inputs, dtype)
    if kind == "all_hidden":   # rows 0, 3, 6, ... see no key: no gradient
        assert not got[0][..., ::3, :].any()
    if kind == "kv_lengths":   # keys past a batch entry's length: no gradient
        assert not got[1][0, :, 40:].any() and not got[2][0, :, 40:].any()


def test_gqa_layout_broadcast():
    """GQA (dk, dv summed over each group's query heads), the (B, n, H, d) layout,
    and inputs broadcast along leading dims (their gradients summed there)."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 70, 8, 16))            # (B, n, H, d)
    k = rng.standard_normal((1, 80, 2, 16))            # one batch entry for both, 2 KV heads
    v = rng.standard_normal((2, 80, 2, 16))
    got, want = grads(q, k, v, enable_gqa=True, layout="blhd", causal=True)
    check(got, want, (q, k, v), F64)


def test_one_dim_and_float16():
    """A 1-D query and 1-D values drop their axes, as the forward's result does;
    float16 inputs give float32 gradients (the forward's result dtype)."""
    rng = np.random.default_rng(9)
    q, k, v = rng.standard_normal(8), rng.standard_normal((20, 8)), rng.standard_normal(20)
    got, want = grads(q, k, v)
    check(got, want, (q, k, v), F64)
    q16, k16, v16 = (rng.standard_normal((2, 40, 8)).astype(np.float16) for _ in range(3))
    got, want = grads(q16, k16, v16)
    assert all(g.dtype == F32 for g in got)
    for g, w in zip(got, want):
        assert np.abs(g.astype(F64) - w).max() <= 2e-2 * max(1.0, np.abs(w).max())


def test_inputs_not_modified_and_errors():
    rng = np.random.default_rng(11)
    q, k, v = problem(rng, (2, 10, 8), (2, 12, 8))
    out, lse = fastattn.attention(q, k, v, return_lse=True)
    do = np.ones_like(out)
    copies = [a.copy() for a in (do, q, k, v, out, lse)]
    fastattn.attention_backward(do, q, k, v, out, lse)
    for a, c in zip((do, q, k, v, out, lse), copies):
        assert np.array_equal(a, c)
    with pytest.raises(ValueError, match="do has shape"):
        fastattn.attention_backward(do[:, :5], q, k, v, out, lse)
    with pytest.raises(ValueError, match="out has shape"):
        fastattn.attention_backward(do, q, k, v, out[..., :4], lse)
    with pytest.raises(ValueError, match="lse has shape"):
        fastattn.attention_backward(do, q, k, v, out, lse[:, None])
    with pytest.raises(ValueError, match="d_k differs"):
        fastattn.attention_backward(do, q, k[..., :4], v, out, lse)


def test_training_example(capsys, monkeypatch):
    """examples/train.py: the loss falls from chance to near zero, and the layer
    learns the task (attend to the position before)."""
    import pathlib
    import runpy
    import sys
    path = pathlib.Path(__file__).resolve().parent.parent / "examples" / "train.py"
    monkeypatch.setattr(sys, "argv", [str(path), "--steps", "150"])
    runpy.run_path(str(path), run_name="__main__")
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    losses = [float(x[3]) for x in lines]
    assert losses[0] > 2.0 and losses[-1] < 0.05 and float(lines[-1][5]) > 0.99, lines


@pytest.mark.parametrize("gqa", [False, True])
def test_varlen_backward(gqa):
    """attention_varlen_backward: each packed sequence's gradients as
    attention_backward gives them on its own rows (and a sequence without queries
    gives its keys none)."""
    rng = np.random.default_rng(13)
    H, Hkv = 4, (2 if gqa else 4)
    cq, ck = np.array([0, 30, 30, 75]), np.array([0, 50, 60, 140])
    q = rng.standard_normal((75, H, 16)).astype(F32)
    k, v = (rng.standard_normal((140, Hkv, 16)).astype(F32) for _ in range(2))
    kw = dict(causal=True, alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4]))
    out, lse = fastattn.attention_varlen(q, k, v, cq, ck, return_lse=True, **kw)
    do = rng.standard_normal(out.shape).astype(F32)
    dq, dk, dv = fastattn.attention_varlen_backward(do, q, k, v, out, lse, cq, ck, **kw)
    for b in (0, 2):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        c = lambda a: a.astype(F64)  # noqa: E731
        want = ref.attention_backward(c(do[sq]), c(q[sq]), c(k[sk]), c(v[sk]), c(out[sq]), layout="blhd",
                                      enable_gqa=gqa, **kw)
        for g, w in zip((dq[sq], dk[sk], dv[sk]), want):
            assert np.abs(g - w).max() <= 4 * tol(F32) * max(1, np.abs(w).max())
    assert not dk[50:60].any() and not dv[50:60].any()
    with pytest.raises(ValueError, match="lse has shape"):
        fastattn.attention_varlen_backward(do, q, k, v, out, lse.T, cq, ck, **kw)


VARLEN_OPTIONS = {
    "none": {},
    "causal": dict(causal=True),
    "upper_left": dict(causal="upper_left"),
    "window": dict(window=(20, 3)),
    "softcap": dict(softcap=2.0, causal=True),
    "alibi": dict(alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4]), causal=True),
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("kind", sorted(VARLEN_OPTIONS))
def test_varlen_backward_packed(isa, kind, dtype, threads):
    """The packed backward (one C call over all the sequences) against the float64
    reference on each sequence's own rows: every option, GQA, sequences longer than a
    query block (32 rows) and a key block (64 keys) with tails, more queries than
    keys, a sequence without queries (its keys get zeros) and one without keys (its
    queries get zeros); the same bits on a second run."""
    rng = np.random.default_rng(29)
    H, Hkv, d = 4, 2, 24
    len_q, len_k = [70, 0, 33, 1, 9, 5], [130, 7, 64, 1, 0, 3]
    cq, ck = np.cumsum([0] + len_q), np.cumsum([0] + len_k)
    q = rng.standard_normal((cq[-1], H, d)).astype(dtype)
    k, v = (rng.standard_normal((ck[-1], Hkv, d)).astype(dtype) for _ in range(2))
    kw = VARLEN_OPTIONS[kind]
    out, lse = fastattn.attention_varlen(q, k, v, cq, ck, return_lse=True, num_threads=threads, **kw)
    do = rng.standard_normal(out.shape).astype(dtype)
    got = fastattn.attention_varlen_backward(do, q, k, v, out, lse, cq, ck, num_threads=threads, **kw)
    again = fastattn.attention_varlen_backward(do, q, k, v, out, lse, cq, ck, num_threads=threads, **kw)
    for g, x, a in zip(got, (q, k, v), again):
        assert g.shape == x.shape and g.dtype == dtype and np.array_equal(g, a)
    c = lambda a: a.astype(F64)  # noqa: E731
    for b in range(len(len_q)):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if len_q[b] == 0 or len_k[b] == 0:   # no query, or no key to see: no gradient
            assert not got[0][sq].any() and not got[1][sk].any() and not got[2][sk].any(), b
            continue
        kb = dict(kw)
        if "alibi_slopes" in kb:
            kb["alibi_slopes"] = kb["alibi_slopes"][None, :]
        want = ref.attention_backward(c(do[sq]), c(q[sq]), c(k[sk]), c(v[sk]), c(out[sq]), layout="blhd",
                                      enable_gqa=True, **kb)
        for g, w, name in zip((got[0][sq], got[1][sk], got[2][sk]), want, "qkv"):
            err = np.abs(g - w).max()
            assert err <= 4 * tol(dtype) * max(1, np.abs(w).max()), (b, "d" + name, err)


@pytest.mark.parametrize("H, Hkv, len_q, len_k, dtype", [
    (1, 1, [3, 200], [10, 300], np.float16),     # 16-bit inputs: computed in float32
    (2, 1, [150], [260], F32),                   # GQA, one sequence
    (1, 1, [0, 120, 40], [50, 200, 0], F64),     # a sequence without queries, one without keys
])
def test_varlen_backward_team_shares_key_blocks(H, Hkv, len_q, len_k, dtype):
    """Fewer leading indices (sequences x heads) than twice the threads: the team
    shares each one's key blocks and sums its dQ rows in thread order, from a
    packed sequence's offset."""
    rng = np.random.default_rng(31)
    cq, ck = np.cumsum([0] + len_q), np.cumsum([0] + len_k)
    q = rng.standard_normal((cq[-1], H, 32)).astype(dtype)
    k, v = (rng.standard_normal((ck[-1], Hkv, 32)).astype(dtype) for _ in range(2))
    out, lse = fastattn.attention_varlen(q, k, v, cq, ck, causal=True, return_lse=True)
    do = rng.standard_normal(out.shape).astype(out.dtype)
    got = fastattn.attention_varlen_backward(do, q, k, v, out, lse, cq, ck, causal=True, num_threads=2)
    res = np.result_type(dtype, F32)
    assert [g.dtype for g in got] == [res] * 3
    assert _core.last_threads() == (2 if _core.openmp_enabled() else 1)
    c = lambda a: a.astype(F64)  # noqa: E731
    for b in range(len(len_q)):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if len_q[b] == 0 or len_k[b] == 0:
            assert not got[0][sq].any() and not got[1][sk].any() and not got[2][sk].any(), b
            continue
        want = ref.attention_backward(c(do[sq]), c(q[sq]), c(k[sk]), c(v[sk]), c(out[sq]), layout="blhd",
                                      causal=True, enable_gqa=H != Hkv)
        for g, w in zip((got[0][sq], got[1][sk], got[2][sk]), want):
            assert np.abs(g - w).max() <= 4 * tol(res) * max(1, np.abs(w).max())


def test_varlen_backward_refuses_what_does_not_fit():
    """Wrong shapes of do and out, and cu_seqlens that do not fit: a ValueError
    naming them, before any work."""
    rng = np.random.default_rng(37)
    cu = np.array([0, 5, 12])
    q, k, v = (rng.standard_normal((12, 2, 8)) for _ in range(3))
    out, lse = fastattn.attention_varlen(q, k, v, cu, cu, return_lse=True)
    do = np.ones_like(out)
    with pytest.raises(ValueError, match="do has shape"):
        fastattn.attention_varlen_backward(do[:, :1], q, k, v, out, lse, cu, cu)
    with pytest.raises(ValueError, match="out has shape"):
        fastattn.attention_varlen_backward(do, q, k, v, out[:11], lse, cu, cu)
    with pytest.raises(ValueError, match="cu_seqlens_k must end"):
        fastattn.attention_varlen_backward(do, q, k, v, out, lse, cu, np.array([0, 5, 11]))
    with pytest.raises(ValueError, match="different numbers of sequences"):
        fastattn.attention_varlen_backward(do, q, k, v, out, lse, cu, np.array([0, 12]))


def test_no_query_rows():
    """No query rows: the keys get zero gradients, written by the C core (dk and dv
    start as np.empty, over memory that held other numbers)."""
    rng = np.random.default_rng(41)
    q = rng.standard_normal((1, 2, 0, 8))
    k, v = (rng.standard_normal((1, 2, 200, 8)) for _ in range(2))
    out, lse = fastattn.attention(q, k, v, return_lse=True)
    for _ in range(3):
        junk = [np.full((1, 2, 200, 8), 7.0) for _ in range(4)]
        del junk
        dq, dk, dv = fastattn.attention_backward(np.ones_like(out), q, k, v, out, lse)
        assert dq.shape == q.shape and not dk.any() and not dv.any()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["float32", "float64", "float16 K, V", "bfloat16 K, V"])
def test_large_lse_rows(isa, kind, threads):
    """Rows whose lse is too large for exp(s - lse) to give their weights exactly get
    the weights' sum recomputed (docs/gradients.md), with nonzero dO: rows whose every
    key a large finite constant hides (finfo.min, where lse rounds to the constant
    and P = exp(s - lse) summed to n_k, -1e9 and -1e4; their q zero, so that their
    scores are the constant exactly, as in the float64 reference), a row with some keys
    hidden by it, and a row of large scores; in each of three query blocks, causal or
    not; threads on whole heads, or sharing a head's key blocks."""
    rng = np.random.default_rng(43)
    dt = F64 if kind == "float64" else F32
    half = {"float16 K, V": np.float16, "bfloat16 K, V": ml_dtypes.bfloat16}.get(kind)
    lead = (1, 1) if threads == 2 else (2, 2)
    for const in (np.finfo(dt).min, -1e9, -1e4):
        for causal in (False, True):
            q, k, v = problem(rng, lead + (70, 24), lead + (300, 24), dtype=dt)
            mask = np.zeros((70, 300), dt)
            mask[[3, 40, 69]] = const
            mask[10, 5:] = const
            q[..., [3, 40, 69], :] = 0
            q[..., 66, :] *= 60   # scores of some hundreds: |lse| >= 32
            if half:
                k, v = k.astype(half), v.astype(half)
            with _core.forcing(bq=32, bk=64):
                got, want = grads(q, k, v, mask=mask, causal=causal, num_threads=threads,
                                  seed=int(rng.integers(1 << 30)))
            check(got, want, (q, k, v), dt)
    # a peaked row of large |q|: dP - D cancels there, so D must come from the backward's
    # weights (the first case failed without); then over several key blocks
    r = np.random.default_rng(2)
    for n_k in (40, 200):
        q = r.standard_normal((1, 40, 128)).astype(F32)
        k, v = (r.standard_normal((1, n_k, 128)).astype(F32) for _ in range(2))
        q[..., 5, :] *= 90
        if half:
            k, v = k.astype(half), v.astype(half)
        with _core.forcing(bk=64):
            got, want = grads(q, k, v, do=r.standard_normal((1, 40, 128)).astype(F32), num_threads=threads)
        check(got, want, (q, k, v), F32)
    # packed sequences, rows of large scores in each: with two threads, the team shares
    # each sequence's key blocks (and query blocks in the pass)
    cu = np.array([0, 130, 300])
    q, k, v = (rng.standard_normal((300, 1, 16)).astype(dt) for _ in range(3))
    q[[5, 100, 140, 299]] *= 80
    if half:
        k, v = k.astype(half), v.astype(half)
    out, lse = fastattn.attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True, num_threads=threads)
    assert (np.abs(lse) >= 32).any()
    do = rng.standard_normal(out.shape).astype(out.dtype)
    dq, dk, dv = fastattn.attention_varlen_backward(do, q, k, v, out, lse, cu, cu, causal=True, num_threads=threads)
    for b in (0, 1):
        sl = slice(cu[b], cu[b + 1])
        c = lambda a: a.astype(F64)  # noqa: E731
        want = ref.attention_backward(c(do[sl]), c(q[sl]), c(k[sl]), c(v[sl]), c(out[sl]), layout="blhd",
                                      causal=True)
        check((dq[sl], dk[sl], dv[sl]), want, (q[sl], k[sl], v[sl]), dt)
