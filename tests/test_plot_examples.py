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
    with pytest.raises(ImportError, match=r"pip install matplotlib"):
        plot.attention_map(np.ones((2, 2)))


def test_attention_map_hidden_cells():
    """Cells a mask or causality hides are drawn apart (grey, hatched), not as weight 0;
    a visible key of weight 0 stays a coloured cell."""
    w = fastattn.attention_weights(np.eye(3) * 3, np.eye(3) * 3, causal=True)
    w[2, 1] = 0.0                                    # a visible cell of weight 0
    ax = plot.attention_map(w, causal=True)
    img = ax.images[0].get_array()
    np.testing.assert_array_equal(np.ma.getmaskarray(img), ~np.tri(3, dtype=bool))
    assert not np.ma.getmaskarray(img)[2, 1]
    hatched = [p for p in ax.patches if p.get_hatch()]
    assert len(hatched) == 3                         # the three cells above the diagonal
    cmap = ax.images[0].get_cmap()
    assert tuple(cmap.get_bad()[:3]) != tuple(cmap(0.0)[:3])       # grey, not the colour of 0
    ax = plot.attention_map(np.full((2, 4), 0.5), causal="upper_left")       # j <= i, not bottom-right
    np.testing.assert_array_equal(~np.ma.getmaskarray(ax.images[0].get_array()), np.tri(2, 4, dtype=bool))
    ax = plot.attention_map(np.full((2, 4), 0.5), causal=True)                # j <= i + 2
    np.testing.assert_array_equal(~np.ma.getmaskarray(ax.images[0].get_array()), np.tri(2, 4, 2, dtype=bool))
    mask = np.array([[True, False, True, True]] * 2)
    ax = plot.attention_map(np.full((2, 4), 1 / 3), mask=mask)
    np.testing.assert_array_equal(np.ma.getmaskarray(ax.images[0].get_array()), ~mask)
    with pytest.raises(ValueError, match="does not broadcast"):
        plot.attention_map(np.ones((2, 4)), mask=np.ones((3, 4), bool))
    with pytest.raises(TypeError, match="bool"):
        plot.attention_map(np.ones((2, 4)), mask=np.ones((2, 4)))


def test_seeds_example(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["seeds.py", "--out", str(tmp_path)])
    ns = runpy.run_path(str(EXAMPLES / "seeds.py"), run_name="not_main")
    paths = ns["main"](["--out", str(tmp_path)])
    # the fruit lookup prints the README's numbers
    out = capsys.readouterr().out
    assert "weights [0.495 0.436 0.068]" in out and "answer 7.272" in out, out
    assert [pathlib.Path(p).name for p in paths] == ["fruit_lookup.png", "i_am_hungry.png", "riley_heads.png"]
    for p in paths:
        assert _is_png(p)
