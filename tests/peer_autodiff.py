"""The autodiff adapters: fastattn.torch (a torch.autograd.Function) and
fastattn.jax (jax.custom_vjp over callbacks), against each framework
differentiating the plain formula, gradcheck in float64, jit.  Not collected
by `pytest` (it needs PyTorch and JAX): CI installs both and runs
`pytest tests/peer_autodiff.py`."""

import numpy as np
import pytest


def test_torch_gradcheck_and_sdpa():
    import torch

    from fastattn.torch import attention
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 9, 5, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.rand(9, 9) > 0.2
    assert torch.autograd.gradcheck(lambda q, k, v: attention(q, k, v, causal=True, mask=mask), (q, k, v))
    # float32 against PyTorch's own SDPA and its autograd, GQA and a bool mask
    q = torch.randn(2, 8, 70, 32, requires_grad=True)
    k, v = (torch.randn(2, 2, 90, 32, requires_grad=True) for _ in range(2))
    m = torch.rand(70, 90) > 0.3
    do = torch.randn(2, 8, 70, 32)
    got = attention(q, k, v, mask=m, enable_gqa=True)
    got.backward(do)
    g1 = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
    want.backward(do)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for a, t in zip(g1, (q, k, v)):
        torch.testing.assert_close(a, t.grad, rtol=1e-4, atol=1e-4)


def test_torch_errors():
    import torch

    from fastattn.torch import attention
    q = torch.randn(4, 8)
    with pytest.raises(TypeError, match="return_lse"):
        attention(q, q, q, return_lse=True)
    with pytest.raises(TypeError, match="torch.Tensor"):
        attention(np.ones((4, 8)), q, q)


def test_torch_half_kv():
    """float16 and bfloat16 K and V (a 16-bit KV cache) with float32 q: read as they
    are; the output float32, the gradients in the inputs' dtypes (torch casts them)."""
    import torch

    from fastattn.torch import attention
    torch.manual_seed(0)
    for dt in (torch.float16, torch.bfloat16):
        q = torch.randn(2, 4, 3, 16, requires_grad=True)
        k = torch.randn(2, 4, 40, 16).to(dt).requires_grad_()
        v = torch.randn(2, 4, 40, 16).to(dt).requires_grad_()
        out = attention(q, k, v, causal=True)
        want = torch.nn.functional.scaled_dot_product_attention(
            q.double(), k.double(), v.double(), is_causal=False,
            attn_mask=torch.ones(3, 40, dtype=torch.bool).tril(37))
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
        out.sum().backward()
        assert k.grad.dtype == dt and v.grad.dtype == dt and q.grad.dtype == torch.float32


def _jax_reference(q, k, v, causal):
    """The plain formula in jax.numpy, which JAX differentiates itself."""
    import jax
    import jax.numpy as jnp
    s = q @ jnp.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return jax.nn.softmax(s, axis=-1) @ v


def test_jax_grad_and_jit():
    import jax
    import jax.numpy as jnp

    from fastattn.jax import attention
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.standard_normal((2, 3, 40, 16)), jnp.float32) for _ in range(3))
    w = jnp.asarray(r.standard_normal((2, 3, 40, 16)), jnp.float32)

    def loss(f):
        return lambda q, k, v: jnp.sum(w * f(q, k, v))
    ours = loss(lambda q, k, v: attention(q, k, v, causal=True))
    plain = loss(lambda q, k, v: _jax_reference(q, k, v, True))
    np.testing.assert_allclose(ours(q, k, v), plain(q, k, v), rtol=1e-4)
    g1 = jax.grad(ours, argnums=(0, 1, 2))(q, k, v)
    g2 = jax.grad(plain, argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    g3 = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(g1, g3):
        np.testing.assert_array_equal(a, b)
    # the (B, n, H, d) layout, shapes of the result
    qb = jnp.swapaxes(q, 1, 2)
    out = attention(qb, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), layout="blhd")
    assert out.shape == (2, 40, 3, 16)


def test_jax_errors():
    import jax.numpy as jnp

    from fastattn.jax import attention
    q = jnp.ones((4, 8))
    with pytest.raises(TypeError, match="return_lse"):
        attention(q, q, q, return_lse=True)
    with pytest.raises(ValueError, match="d_k differs"):
        attention(q, jnp.ones((4, 6)), q)
    with pytest.raises(TypeError, match="unexpected keyword"):
        attention(q, q, q, casual=True)


def test_gradients_page_framework_examples():
    """docs/gradients.md's PyTorch and JAX examples run."""
    import pathlib
    import re
    page = pathlib.Path(__file__).resolve().parent.parent / "docs" / "gradients.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    torch_block, = (b for b in blocks if "fastattn.torch" in b)
    jax_block, = (b for b in blocks if "fastattn.jax" in b)
    ns = {}
    exec(compile(torch_block, str(page), "exec"), ns)
    assert ns["q"].grad.shape == (1, 8, 512, 64)
    exec(compile(jax_block, str(page), "exec"), ns)
    assert [g.shape for g in ns["grads"]] == [(1, 8, 512, 64)] * 3


def test_jax_half_kv():
    """A bfloat16 KV cache from JAX: read as stored, float32 output, gradients in the
    inputs' dtypes; jit gives the same."""
    import jax
    import jax.numpy as jnp

    from fastattn.jax import attention
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((2, 4, 3, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 4, 20, 16)), jnp.bfloat16) for _ in range(2))
    out = attention(q, k, v, causal=True)
    s = np.asarray(q, np.float64) @ np.swapaxes(np.asarray(k, np.float64), -1, -2) / 4.0
    s = np.where(np.arange(20) <= np.arange(3)[:, None] + 17, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ np.asarray(v, np.float64)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)
    grads = jax.grad(lambda q, k, v: attention(q, k, v, causal=True).sum(), argnums=(0, 1, 2))(q, k, v)
    assert [g.dtype for g in grads] == [jnp.float32, jnp.bfloat16, jnp.bfloat16]
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda q, k, v: attention(q, k, v, causal=True))(q, k, v)),
                                  np.asarray(out))
