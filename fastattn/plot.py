"""Heatmaps of attention weights (matplotlib is an optional extra:
`pip install matplotlib`)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
from numpy.typing import ArrayLike

from ._validate import _causal

__all__ = ["attention_map"]


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "fastattn.plot needs matplotlib, an optional dependency: pip install matplotlib "
            "(or pip install \"fastattn[plot]\")") from None
    return plt


def attention_map(weights: ArrayLike, query_labels: Optional[Sequence[str]] = None,
                  key_labels: Optional[Sequence[str]] = None, ax: Any = None, *, title: Optional[str] = None,
                  annotate: Optional[bool] = None, mask: Optional[ArrayLike] = None,
                  causal: Any = False) -> Any:
    """Draw attention weights as a heatmap: one row per query, one column per key.

    Parameters
    ----------
    weights : array_like, shape (n_q, n_k)
        For example from `fastattn.attention_weights` (one head).
    query_labels, key_labels : sequence of str, optional
        Token labels for the rows and the columns.
    ax : matplotlib Axes, optional
        Where to draw; a new figure when None.
    title : str, optional
    annotate : bool, optional
        Write each weight in its cell (default: when the map has at most 20 x 20 cells).
    mask : array_like of bool, shape (n_q, n_k), optional
        The mask the weights were computed with (True = may attend): hidden cells
        are drawn grey and hatched, apart from a visible key whose weight is 0.
    causal : bool or str, default False
        Hide the cells the causal rule hides, as `causal` in `fastattn.attention`:
        True (or "lower_right") aligned bottom-right, "upper_left" top-left;
        together with `mask`.

    Returns
    -------
    matplotlib Axes

    Raises
    ------
    ImportError
        When matplotlib is not installed, saying how to install it.
    ValueError
        When weights is not 2-D, a label list has the wrong length or the mask
        does not broadcast to the weights.

    Examples
    --------
    >>> import numpy as np, fastattn
    >>> from fastattn.plot import attention_map
    >>> words = ["I", "am", "hungry"]
    >>> x = np.random.default_rng(0).standard_normal((3, 4))
    >>> w = fastattn.attention_weights(x, x, causal=True)
    >>> ax = attention_map(w, words, words, causal=True)  # doctest: +SKIP
    >>> ax.figure.savefig("map.png")  # doctest: +SKIP
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 2:
        raise ValueError(f"weights must be 2-D (n_q, n_k), got shape {w.shape}; pick one head, "
                         f"e.g. weights[0, h]")
    for labels, n, name in ((query_labels, w.shape[0], "query_labels"), (key_labels, w.shape[1], "key_labels")):
        if labels is not None and len(labels) != n:
            raise ValueError(f"{name} has {len(labels)} labels for {n} {'rows' if name[0] == 'q' else 'columns'}")
    seen = np.ones(w.shape, bool)
    if mask is not None:
        m = np.asarray(mask)
        if m.dtype != bool:
            raise TypeError(f"mask must be bool (True = may attend), got dtype {m.dtype}")
        try:
            seen &= np.broadcast_to(m, w.shape)
        except ValueError:
            raise ValueError(f"mask of shape {m.shape} does not broadcast to the weights {w.shape}") from None
    on, top_left = _causal(causal)
    if on:   # query i sees key j <= i + n_k - n_q (bottom-right), or j <= i ("upper_left")
        seen &= np.tri(w.shape[0], w.shape[1], 0 if top_left else w.shape[1] - w.shape[0], dtype=bool)
    plt = _pyplot()
    if ax is None:
        _, ax = plt.subplots(figsize=(1.0 + 0.55 * w.shape[1], 0.8 + 0.5 * w.shape[0]))
    cmap = plt.get_cmap("viridis").with_extremes(bad="#d0d0d0")   # hidden cells: grey, hatched where annotated
    shown = np.ma.masked_array(w, mask=~seen)
    top = float(np.nanmax(w[seen])) if seen.any() else 1.0
    im = ax.imshow(shown, cmap=cmap, vmin=0.0, vmax=max(1e-12, top), aspect="auto")
    ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    ax.set_xticks(range(w.shape[1]), key_labels if key_labels is not None else range(w.shape[1]),
                  rotation=45, ha="right")
    ax.set_yticks(range(w.shape[0]), query_labels if query_labels is not None else range(w.shape[0]))
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if annotate is None:
        annotate = w.shape[0] <= 20 and w.shape[1] <= 20
    if annotate:
        from matplotlib.patches import Rectangle
        for i in range(w.shape[0]):
            for j in range(w.shape[1]):
                if not seen[i, j]:
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="///",
                                           edgecolor="#909090", linewidth=0))
                    continue
                ax.text(j, i, f"{w[i, j]:.2f}", ha="center", va="center", fontsize=8,
                        color="white" if w[i, j] < 0.6 * top else "black")
    if title:
        ax.set_title(title)
    return ax
