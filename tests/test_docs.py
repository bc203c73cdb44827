"""The examples in the docstrings, the README and the user guide run and say what they claim."""

import doctest
import pathlib
import re

import numpy as np

import fastattn
from fastattn import _attention, _merge, _softmax, _varlen

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
GUIDE = README.parent / "docs" / "guide.md"


def test_docstring_examples():
    import fastattn.dask
    from fastattn import layers, reference
    for mod, least in ((_attention, 8), (_softmax, 2), (_varlen, 7), (_merge, 7), (layers, 2), (reference, 9),
                       (fastattn.dask, 1)):
        result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert result.attempted >= least and result.failed == 0, mod.__name__


def _run_blocks(path, least, first_only=False, first=None):
    """Run the ```python blocks of a Markdown file in order, in one namespace (the
    first one only, or the `first` few); return it."""
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
    assert len(blocks) >= least, path
    ns = {}
    for block in blocks[:1] if first_only else blocks[:first] if first else blocks:
        exec(compile(block, str(path), "exec"), ns)
    return ns


def test_readme_python_blocks_run():
    ns = _run_blocks(README, 2)
    # the multi-head example: shapes, and agreement with the reference
    y, o = ns["y"], ns["o"]
    assert y.shape == (4, 128, 256) and o.shape == (4, 8, 128, 32)
    want = fastattn.reference.attention(*(a.astype(np.float64) for a in (ns["q"], ns["k"], ns["v"])), causal=True)
    assert np.max(np.abs(o - want)) < 1e-5 * max(1, np.max(np.abs(want)))
    o_l = ns["o_l"]                                     # layout="blhd": the same heads, in (B, n, H, d)
    assert o_l.shape == (4, 128, 8, 32) and o_l.flags.c_contiguous
    assert np.array_equal(o_l, o.transpose(0, 2, 1, 3)) and np.allclose(ns["y_l"], y, rtol=1e-6, atol=1e-6)
    assert abs(float(fastattn.attention(ns["fruit"], ns["keys"], ns["values"])) - 7.2718) < 1e-4
    # the right-padded batch: each sequence as if alone, zeros after its length
    for b, n_b in enumerate(ns["seq_len"][:, 0]):
        alone = fastattn.attention(*(ns[name][b, :, :n_b] for name in "qkv"), causal=True)
        assert np.max(np.abs(ns["o_pad"][b, :, :n_b] - alone)) < 1e-6 and not ns["o_pad"][b, :, n_b:].any()
    # ... and packed (attention_varlen): the same rows
    cu = ns["cu"]
    for b, n_b in enumerate(ns["seq_len"][:, 0]):
        got = ns["o_packed"][cu[b]:cu[b + 1]].transpose(1, 0, 2)
        assert np.max(np.abs(got - ns["o_pad"][b, :, :n_b])) < 1e-5
    full = fastattn.attention(ns["qs"], ns["ks"], ns["vs"])
    assert np.max(np.abs(ns["out"] - full)) < 1e-12        # the merge example
    t = fastattn.attention(ns["qs"], ns["ks"], ns["vs"], return_lse=True)[1]
    assert np.max(np.abs(ns["lse"] - t)) < 1e-12
    # the speculative-decoding example: per sequence, the drafts against its own keys
    for b, n_b in enumerate(ns["lengths"]):
        kb, vb = (ns[name][b, :, :n_b].astype(np.float64) for name in ("cache_k", "cache_v"))
        want = fastattn.reference.attention(ns["drafts"][b].astype(np.float64), kb, vb, causal=True, enable_gqa=True)
        assert np.max(np.abs(ns["o_draft"][b] - want)) < 1e-5 * max(1, np.max(np.abs(want)))


def test_readme_is_a_short_guide():
    """The README is a user guide of at most 15 KB; the details are in docs/."""
    text = README.read_text()
    assert len(text.encode()) <= 15 * 1024
    assert 'layout="blhd"' in text and "without an" in text      # the layout warning at the first example
    for page in ("guide.md", "api.rst", "install.md", "design.md", "tuning.md", "benchmarks.md"):
        assert f"docs/{page}" in text and (README.parent / "docs" / page).is_file()


def test_guide_python_blocks_run():
    """docs/guide.md's examples run in order and give what the reference gives."""
    ns = _run_blocks(GUIDE, 5)
    want = fastattn.reference.attention(*(a.astype(np.float64) for a in (ns["q"], ns["k"], ns["v"])), causal=True)
    assert np.max(np.abs(ns["o"] - want)) < 1e-5 * max(1, np.max(np.abs(want)))
    assert np.max(np.abs(ns["out"] - fastattn.attention(ns["qs"], ns["ks"], ns["vs"]))) < 1e-12


def test_readme_first_example_prints(tmp_path):
    """The README's first example, run as a script, prints its results."""
    import subprocess
    import sys
    block = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    path = tmp_path / "first.py"
    path.write_text(block)
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, check=True).stdout
    assert "7.271" in out and "0.495" in out, out


def test_dask_page_example():
    """docs/dask.md's first example runs and matches fastattn.attention."""
    ns = _run_blocks(README.parent / "docs" / "dask.md", 2, first_only=True)
    want = fastattn.attention(ns["q"], ns["k"], ns["v"], causal=True)
    assert np.max(np.abs(ns["result"] - want)) < 1e-5


def test_gradients_page_example():
    """docs/gradients.md's NumPy example runs and matches the reference's gradients."""
    ns = _run_blocks(README.parent / "docs" / "gradients.md", 3, first_only=True)
    c = [ns[n].astype(np.float64) for n in ("do", "q", "k", "v", "out")]
    want = fastattn.reference.attention_backward(*c, causal=True)
    for got, w in zip((ns["dq"], ns["dk"], ns["dv"]), want):
        assert np.max(np.abs(got - w)) < 1e-4 * max(1, np.max(np.abs(w)))


def test_gradients_page_packed_example():
    """docs/gradients.md's packed-sequence example: each sequence's gradients as the
    reference gives them on its own rows."""
    ns = _run_blocks(README.parent / "docs" / "gradients.md", 3, first=2)
    cu, out = ns["cu"], ns["out"]
    for b in range(len(cu) - 1):
        s = slice(cu[b], cu[b + 1])
        c = [x[s].astype(np.float64) for x in (np.ones_like(out), ns["qp"], ns["kp"], ns["vp"], out)]
        want = fastattn.reference.attention_backward(*c, causal=True, layout="blhd")
        for got, w in zip((ns["dq"][s], ns["dk"][s], ns["dv"][s]), want):
            assert np.max(np.abs(got - w)) < 1e-4 * max(1, np.max(np.abs(w)))
