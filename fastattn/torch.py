"""fastattn on PyTorch CPU tensors, with gradients (``pip install torch``).

    from fastattn.torch import attention
    out = attention(q, k, v, causal=True)      # q, k, v: CPU tensors, requires_grad or not
    out.sum().backward()                       # q.grad, k.grad, v.grad from fastattn's backward

A ``torch.autograd.Function``: the forward calls `fastattn.attention` (keeping
its lse), the backward `fastattn.attention_backward`, both on the tensors'
memory through ``.numpy()`` (no copy for CPU tensors) and with the GIL
released.  The options are `fastattn.attention`'s; tensor options (a mask,
lengths, ALiBi slopes) are read as arrays and get no gradient.
"""

from typing import Any, Dict, Tuple

import numpy as np
import torch

from ._attention import attention as _attention
from ._backward import attention_backward as _attention_backward

__all__ = ["attention"]

_REFUSED = ("return_lse", "out")


def _array(t: torch.Tensor, name: str) -> np.ndarray:
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}; fastattn runs on the CPU: pass {name}.cpu()")
    if t.dtype == torch.bfloat16:  # NumPy's bfloat16 is ml_dtypes': the same bits, viewed
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(f"{name} is bfloat16, which NumPy reads through the ml_dtypes package: "
                            f"pip install ml_dtypes, or pass {name}.float()") from None
        return t.detach().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.detach().numpy()


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                options: Dict[str, Any]) -> torch.Tensor:
        qa, ka, va = _array(q, "q"), _array(k, "k"), _array(v, "v")
        out, lse = _attention(qa, ka, va, return_lse=True, **options)
        out_t, lse_t = torch.from_numpy(out), torch.from_numpy(np.asarray(lse))
        ctx.save_for_backward(q, k, v, out_t, lse_t)
        ctx.options = options
        return out_t

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> Tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _attention_backward(_array(do, "the output's gradient"), _array(q, "q"), _array(k, "k"),
                                         _array(v, "v"), out.numpy(), lse.numpy(), **ctx.options)
        return torch.from_numpy(dq), torch.from_numpy(dk), torch.from_numpy(dv), None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> torch.Tensor:
    """`fastattn.attention` on CPU tensors, differentiable in q, k and v.

    Parameters
    ----------
    q, k, v : torch.Tensor
        CPU tensors, float16, bfloat16 (with ml_dtypes installed), float32 or float64,
        shapes as for `fastattn.attention`.
    **options
        The keywords of `fastattn.attention` but `return_lse` and `out`; tensors
        among them (mask, kv_lengths, q_lengths, alibi_slopes) are read as arrays.

    Returns
    -------
    torch.Tensor
        The output, in the result dtype; its backward is `fastattn.attention_backward`.

    Examples
    --------
    >>> import torch
    >>> from fastattn.torch import attention
    >>> q, k, v = (torch.randn(2, 4, 64, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    >>> attention(q, k, v, causal=True).square().sum().backward()
    >>> q.grad.shape
    torch.Size([2, 4, 64, 16])
    """
    for name in _REFUSED:
        if name in options:
            raise TypeError(f"fastattn.torch.attention does not take {name}=")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    opts = {n: (_array(x, n) if isinstance(x, torch.Tensor) else x) for n, x in options.items()}
    return _Attention.apply(q, k, v, opts)
