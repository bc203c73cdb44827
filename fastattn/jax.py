"""fastattn on JAX arrays, with gradients (``pip install jax``).

    from fastattn.jax import attention
    loss = lambda q, k, v: attention(q, k, v, causal=True).sum()
    dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)     # jax.jit works too

A ``jax.custom_vjp``: the forward calls `fastattn.attention` (keeping its lse),
the backward `fastattn.attention_backward`, each through ``jax.pure_callback``
on the CPU, with the GIL released while the C core runs.  The options are
`fastattn.attention`'s, fixed per call (arrays among them, such as a mask, are
read as they are and get no gradient).
"""

from typing import Any, Dict, Tuple

import jax
import numpy as np

from ._attention import attention as _attention
from ._backward import attention_backward as _attention_backward
from ._prepare import _prepare
from ._validate import _blhd

__all__ = ["attention"]

_REFUSED = ("return_lse", "out")


def _shapes(q: Any, k: Any, v: Any, options: Dict[str, Any]) -> Tuple[Tuple[int, ...], Tuple[int, ...], Any]:
    """The output's and lse's shapes and the result dtype of attention(q, k, v,
    **options), from the shapes and dtypes alone (the checks of a call run here,
    at trace time)."""
    def stand_in(a):   # no memory: one zero broadcast to the shape
        return np.broadcast_to(np.zeros((), np.dtype(a.dtype)), a.shape)
    o = dict(options)
    blhd = _blhd(o.pop("layout", "bhld"))
    qs, ks, vs = (stand_in(a) for a in (q, k, v))
    if blhd:
        qs, ks, vs = (np.swapaxes(a, -3, -2) for a in (qs, ks, vs))
    p = _prepare(qs, ks, vs, o.pop("mask", None), o.pop("causal", False), o.pop("scale", None),
                 o.pop("enable_gqa", False), o.pop("window", None), o.pop("softcap", None),
                 o.pop("alibi_slopes", None), o.pop("kv_lengths", None), o.pop("num_threads", None),
                 q_lengths=o.pop("q_lengths", None), blhd=blhd, mask_as_bool=False)
    if o:
        raise TypeError(f"fastattn.jax.attention: unexpected keyword {sorted(o)[0]!r}")
    lead = p.lead[:-2] + (p.gqa[0],) if p.gqa else p.lead
    out = lead + ((p.n_q,) if not p.q1 else ()) + ((p.d_v,) if not p.v1 else ())
    if blhd:
        out = out[:-3] + (out[-2], out[-3], out[-1])
    return out, lead + ((p.n_q,) if not p.q1 else ()), p.res


def attention(q: Any, k: Any, v: Any, **options: Any) -> Any:
    """`fastattn.attention` on JAX arrays, differentiable in q, k and v.

    Parameters
    ----------
    q, k, v : jax.Array
        Shapes and dtypes as for `fastattn.attention` (float16, bfloat16, float32,
        float64; the gradients come back in the inputs' dtypes).
    **options
        The keywords of `fastattn.attention` but `return_lse` and `out`.

    Returns
    -------
    jax.Array
        The output; its gradient comes from `fastattn.attention_backward`.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from fastattn.jax import attention
    >>> q = k = v = jnp.ones((2, 16, 8))
    >>> jax.grad(lambda q: attention(q, k, v, causal=True).sum())(q).shape
    (2, 16, 8)
    """
    for name in _REFUSED:
        if name in options:
            raise TypeError(f"fastattn.jax.attention does not take {name}=")
    opts = {n: (np.asarray(x) if isinstance(x, jax.Array) else x) for n, x in options.items()}
    out_shape, lse_shape, res = _shapes(q, k, v, opts)
    out_sds, lse_sds = jax.ShapeDtypeStruct(out_shape, res), jax.ShapeDtypeStruct(lse_shape, res)

    def forward_host(qa, ka, va):
        out, lse = _attention(np.asarray(qa), np.asarray(ka), np.asarray(va), return_lse=True, **opts)
        return np.asarray(out, res), np.asarray(lse, res)

    def backward_host(do, qa, ka, va, out, lse):
        return _attention_backward(np.asarray(do), np.asarray(qa), np.asarray(ka), np.asarray(va), np.asarray(out),
                                   np.asarray(lse), **opts)

    @jax.custom_vjp
    def f(q, k, v):
        return jax.pure_callback(forward_host, (out_sds, lse_sds), q, k, v)[0]

    def f_fwd(q, k, v):
        out, lse = jax.pure_callback(forward_host, (out_sds, lse_sds), q, k, v)
        return out, (q, k, v, out, lse)

    def f_bwd(saved, do):
        q, k, v, out, lse = saved
        shapes = tuple(jax.ShapeDtypeStruct(a.shape, res) for a in (q, k, v))
        dq, dk, dv = jax.pure_callback(backward_host, shapes, do, q, k, v, out, lse)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    f.defvjp(f_fwd, f_bwd)
    return f(q, k, v)
