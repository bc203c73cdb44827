"""Train a causal self-attention layer in plain NumPy, gradients from fastattn.

    python examples/train.py [--steps N] [--seed N]

The layer of the classic explanations (examples/seeds.py, part 3): token and
position embeddings, queries, keys and values projected by W_Q, W_K, W_V,
four heads of causal attention, W_O combining them, then a linear read-out to
the vocabulary.  The task: at each position, say the token one position back
(a copy with a shift), which the layer can only solve by learning to attend
from each position to the one before it.  The forward is fastattn.attention,
the backward fastattn.attention_backward; everything else is NumPy by hand,
with Adam.  It prints a falling loss and the accuracy, in a few seconds.
"""

from __future__ import annotations

import argparse
from typing import Dict

import numpy as np

import fastattn

VOCAB, T, D, HEADS, BATCH = 12, 24, 48, 4, 64


def init(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
    return {"E": w(VOCAB, D), "P": w(T, D), "W_Q": w(D, D), "W_K": w(D, D), "W_V": w(D, D), "W_O": w(D, D),
            "U": w(D, VOCAB)}


def step(p: Dict[str, np.ndarray], tokens: np.ndarray, target: np.ndarray):
    """The loss (cross-entropy over positions 1..T-1), accuracy and gradients."""
    B = tokens.shape[0]
    x = p["E"][tokens] + p["P"]                                   # (B, T, D)
    heads = lambda a: a.reshape(B, T, HEADS, D // HEADS)          # noqa: E731  (B, T, H, d): layout "blhd"
    q, k, v = heads(x @ p["W_Q"]), heads(x @ p["W_K"]), heads(x @ p["W_V"])
    a, lse = fastattn.attention(q, k, v, causal=True, layout="blhd", return_lse=True)
    a2 = a.reshape(B, T, D)
    h = x + a2 @ p["W_O"]
    logits = (h @ p["U"])[:, 1:]                                  # position 0 has nothing before it
    z = logits - logits.max(-1, keepdims=True)
    prob = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    n = B * (T - 1)
    pick = np.take_along_axis(prob, target[:, 1:, None], -1)[..., 0]
    loss = float(-np.log(pick).mean())
    acc = float((prob.argmax(-1) == target[:, 1:]).mean())

    g: Dict[str, np.ndarray] = {}
    dlogits = prob
    np.put_along_axis(dlogits, target[:, 1:, None], pick[..., None] - 1, -1)
    dlogits = np.concatenate([np.zeros((B, 1, VOCAB), np.float32), dlogits / n], 1)
    g["U"] = np.einsum("btd,btv->dv", h, dlogits)
    dh = dlogits @ p["U"].T
    g["W_O"] = np.einsum("btd,bte->de", a2, dh)
    da = heads(dh @ p["W_O"].T)
    dq, dk, dv = fastattn.attention_backward(da, q, k, v, a, lse, causal=True, layout="blhd")
    dx = dh.copy()                                                # the residual
    for name, dproj in (("W_Q", dq), ("W_K", dk), ("W_V", dv)):
        dproj = dproj.reshape(B, T, D)
        g[name] = np.einsum("btd,bte->de", x, dproj)
        dx += dproj @ p[name].T
    g["P"] = dx.sum(0)
    g["E"] = np.zeros_like(p["E"])
    np.add.at(g["E"], tokens, dx)
    return loss, acc, g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    p = init(rng)
    m = {n: np.zeros_like(w) for n, w in p.items()}
    s = {n: np.zeros_like(w) for n, w in p.items()}
    lr, b1, b2 = 3e-3, 0.9, 0.999
    for t in range(1, args.steps + 1):
        tokens = rng.integers(0, VOCAB, (BATCH, T))
        target = np.roll(tokens, 1, axis=1)                       # the token one position back
        loss, acc, g = step(p, tokens, target)
        for n in p:                                               # Adam
            m[n] = b1 * m[n] + (1 - b1) * g[n]
            s[n] = b2 * s[n] + (1 - b2) * g[n] * g[n]
            p[n] -= (lr * (m[n] / (1 - b1 ** t)) / (np.sqrt(s[n] / (1 - b2 ** t)) + 1e-8)).astype(np.float32)
        if t == 1 or t % 50 == 0:
            print(f"step {t:4d}  loss {loss:.3f}  accuracy {acc:.2f}", flush=True)
    print(f"chance: loss {np.log(VOCAB):.3f}, accuracy {1 / VOCAB:.2f}")


if __name__ == "__main__":
    main()
