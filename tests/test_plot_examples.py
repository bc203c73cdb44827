"""fastattn.plot and examples/seeds.py render real PNG files (Agg backend)."""

import builtins
import pathlib
import runpy
import sys

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

import fastattn  # noqa: E402
from fastattn import plot  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _is_png(path, min_bytes=2000):
    data = pathlib.Path(path).read_bytes()
    return data[:8] == PNG_MAGIC and len(data) >= min_bytes


def test_attention_map_writes_png(tmp_path):
    words = ["I", "am", "hungry"]
    w = fastattn.attention_weights(np.eye(3) * 3, np.eye(3) * 3, causal=True)
    ax = plot.attention_map(w, words, words, title="test")
    path = tmp_path / "map.png"
    ax.figure.savefig(path)
    assert _is_png(path)
    assert [t.get_text() for t in ax.get_xticklabels()] == words
    assert ax.images[0].get_array().shape == (3, 3)
    np.testing.assert_allclose(ax.images[0].get_array(), w)


def test_attention_map_errors():
    with pytest.raises(ValueError, match="2-D"):
        plot.attention_map(np.ones((2, 3, 4)))
    with pytest.raises(ValueError, match="query_labels has 2 labels for 3 rows"):
        plot.attention_map(np.ones((3, 4)), query_labels=["a", "b"])


def test_attention_map_without_matplotlib(monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match=r'pip install "fastattn\[plot\]"'):
        plot.attention_map(np.ones((2, 2)))


def test_seeds_example(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["seeds.py", "--out", str(tmp_path)])
    ns = runpy.run_path(str(EXAMPLES / "seeds.py"), run_name="not_main")
    paths = ns["main"](["--out", str(tmp_path)])
    assert [pathlib.Path(p).name for p in paths] == ["fruit_lookup.png", "i_am_hungry.png", "riley_heads.png"]
    for p in paths:
        assert _is_png(p)
