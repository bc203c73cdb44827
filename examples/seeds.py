"""The classic explanations of attention, computed with fastattn, drawn as PNGs.

    python examples/seeds.py [--out DIR] [--seed N]

1. The key-value lookup: the query "fruit" against the keys apple, banana and
   chair, whose values are 10, 5 and 2.  Attention is a soft dictionary lookup:
   the answer is mostly apple's and banana's values (the README's first example,
   with its numbers: 7.272, weights 0.495, 0.436, 0.068).
2. Self-attention over "I am hungry": every word's query is compared with every
   word's key; the output is a weighted sum of the values.
3. Causal multi-head self-attention over "Evan's dog Riley is so hyper, she
   never stops moving": a word sees only itself and earlier words, and four
   heads look at the sentence in four ways before W_O combines them.

The word vectors of 2 and 3 are made deterministically from the seed (no trained
embedding is downloaded), so the pictures are the same on every run.  Needs matplotlib
(pip install matplotlib).
"""

from __future__ import annotations

import argparse
import os
import zlib
from typing import Optional, Sequence

import numpy as np
from numpy.typing import NDArray

import fastattn
from fastattn.plot import attention_map


def word_vectors(words: Sequence[str], d: int, seed: int) -> NDArray[np.float64]:
    """A fixed random vector per word: the same word gets the same vector."""
    return np.stack([np.random.default_rng([seed, zlib.crc32(w.encode())]).standard_normal(d) for w in words])


def fruit_lookup(out_dir: str, seed: int) -> str:
    """The README's first example, with its numbers (the seed plays no part here)."""
    words = ["apple", "banana", "chair"]
    keys = np.array([[1.0, 1.0], [1.0, 0.8], [0.0, -1.0]])
    values = np.array([10.0, 5.0, 2.0])
    query = np.array([1.0, 0.9])                                   # "fruit"
    answer = fastattn.attention(query, keys, values)
    weights = fastattn.attention_weights(query, keys)
    print(f"fruit lookup: weights {np.round(weights, 3)} over {words}; answer {answer:.3f}")
    import matplotlib.pyplot as plt
    ax = attention_map(weights[None, :], ["fruit"], words, title=f"query 'fruit' -> {answer:.2f}")
    path = os.path.join(out_dir, "fruit_lookup.png")
    ax.figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(ax.figure)
    return path


def i_am_hungry(out_dir: str, seed: int, d_model: int = 8, d_k: int = 4) -> str:
    words = ["I", "am", "hungry"]
    x = word_vectors(words, d_model, seed)
    rng = np.random.default_rng(seed)
    w_q, w_k, w_v = (rng.standard_normal((d_model, d_k)) / np.sqrt(d_model) for _ in range(3))
    out = fastattn.self_attention(x, w_q, w_k, w_v)
    weights = fastattn.attention_weights(x @ w_q, x @ w_k)
    print(f"'I am hungry': output {out.shape}, weights rows sum to {weights.sum(-1).round(6)}")
    import matplotlib.pyplot as plt
    ax = attention_map(weights, words, words, title="self-attention: I am hungry")
    path = os.path.join(out_dir, "i_am_hungry.png")
    ax.figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(ax.figure)
    return path


def riley(out_dir: str, seed: int, d_model: int = 16, heads: int = 4) -> str:
    words = "Evan's dog Riley is so hyper , she never stops moving".split()
    x = word_vectors(words, d_model, seed)
    d_head = d_model // heads
    rng = np.random.default_rng(seed + 1)
    w_q, w_k, w_v, w_o = (rng.standard_normal((d_model, d_model)) / np.sqrt(d_model) for _ in range(4))
    y = fastattn.multihead_attention(x, w_q, w_k, w_v, w_o, num_heads=heads, causal=True)
    # the per-head weights, for the picture: heads as a leading axis, read through strides
    split = lambda t: np.swapaxes(t.reshape(len(words), heads, d_head), 0, 1)  # noqa: E731
    weights = fastattn.attention_weights(split(x @ w_q), split(x @ w_k), causal=True)
    print(f"Riley: {heads} causal heads over {len(words)} words -> output {y.shape}")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(14, 11))
    for h, ax in enumerate(axes.flat):
        attention_map(weights[h], words, words, ax=ax, title=f"head {h}", annotate=False, causal=True)
    fig.suptitle("causal multi-head self-attention: a word sees only itself and earlier words")
    fig.tight_layout()
    path = os.path.join(out_dir, "riley_heads.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: Optional[Sequence[str]] = None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".", help="folder for the PNGs (default: here)")
    p.add_argument("--seed", type=int, default=0, help="seed of the word vectors")
    args = p.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    os.makedirs(args.out, exist_ok=True)
    paths = [fruit_lookup(args.out, args.seed), i_am_hungry(args.out, args.seed), riley(args.out, args.seed)]
    for path in paths:
        print(f"wrote {path}")
    return paths


if __name__ == "__main__":
    main()
