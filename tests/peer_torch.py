"""Tests that need PyTorch (an optional peer): not collected by `pytest` (the file
name does not match test_*.py); CI installs torch and runs `pytest tests/peer_torch.py`."""

import os
import subprocess
import sys

import fastattn

_TORCH_FORK_SCRIPT = """
import multiprocessing as mp, numpy as np, torch, fastattn
def f(i):
    q = np.ones((1, 8, 512, 64), np.float32)
    return float(fastattn.attention(q, q, q, num_threads=2).sum()), fastattn._core.last_threads()
if __name__ == "__main__":
    torch.exp(torch.randn(4_000_000)).sum()          # a PyTorch team on its OpenMP runtime
    with mp.get_context("fork").Pool(2) as p:
        print(p.map_async(f, range(2)).get(timeout=60))
"""


def test_fork_after_torch(tmp_path):
    """Issue 46's reproducer: a fork pool's workers after a parallel PyTorch op (its
    libgomp and the system's load as one) compute, where they hung."""
    import torch  # noqa: F401  (fails, not skips, where PyTorch is missing)
    where = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([where] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    path = tmp_path / "torch_fork.py"
    path.write_text(_TORCH_FORK_SCRIPT)
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=180,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = eval(proc.stdout.splitlines()[-1])
    assert [s for s, _ in got] == [8 * 512 * 64.0] * 2
