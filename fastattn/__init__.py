"""fastattn: fast exact scaled dot-product attention for NumPy on multicore CPUs.

    out = fastattn.attention(q, k, v, mask=None, causal=False, scale=None)

computes softmax(q k^T * scale + mask) v with a fused C kernel (streaming
softmax, O(n * d) memory, OpenMP threads, SIMD chosen at run time).
`fastattn.reference` is the plain NumPy version of the same semantics.

Where things are:
    fastattn/_attention.py   attention, attention_weights (the plain path, _call)
    fastattn/_backward.py    attention_backward, attention_varlen_backward (gradients)
    fastattn/_prepare.py     _prepare: one attention call's checks and conversions
    fastattn/_validate.py    array conversion and argument checks shared by all
    fastattn/_float_mask.py  float masks of 0 and -inf read as bool masks
    fastattn/_varlen.py      attention_varlen (packed sequences)
    fastattn/_merge.py       merge_attention
    fastattn/_softmax.py     softmax
    fastattn/_tune.py        tune: the plan's thresholds measured on this machine
    fastattn/dask.py         attention over Dask arrays (optional)
    fastattn/layers.py       self_attention, multihead_attention (projections + attention)
    fastattn/plot.py         attention_map (matplotlib, optional)
    fastattn/_core.pyx       the Cython binding to the C core
    fastattn/reference.py    the NumPy reference (the tests' oracle)
    src_c/                   the C kernels (start at src_c/fastattn.h)
"""

import os as _os
import warnings as _warnings

# How long OpenMP's idle threads spin before they sleep.  libgomp's default, 300,000
# pause loops, kept fastattn's threads busy for about 5 ms after each call, and with as
# many threads as cores they took the cores from what ran next: NumPy's matrix product
# (x @ W, 2048x512 @ 512x512) took 12.6 ms right after a fastattn call against 5.7 ms
# after a pause.  With 10,000 (about 0.2 ms) it took 5.8 ms, and fastattn's own calls
# measured the same (B1 H8 N128 to N512, BERT, decoding; back to back).  libgomp reads
# GOMP_SPINCOUNT when it is loaded, with _core below; the variable is removed again after,
# so the process's environment is unchanged.  Not set when the user set it or
# OMP_WAIT_POLICY (theirs rules), and no effect on a libgomp already loaded by then.
_SPIN_SET = "GOMP_SPINCOUNT" not in _os.environ and "OMP_WAIT_POLICY" not in _os.environ
if _SPIN_SET:
    _os.environ["GOMP_SPINCOUNT"] = "10000"
try:
    from . import _core
except ImportError as e:  # pragma: no cover - only in an unbuilt source tree
    raise ImportError(
        "fastattn's compiled core (fastattn._core) is missing. If you are in fastattn's "
        "source checkout, Python is importing the source folder instead of the installed "
        "package: run from another directory, or build in place with `pip install -e .`."
    ) from e
finally:
    if _SPIN_SET:
        _os.environ.pop("GOMP_SPINCOUNT", None)
# (after _core, for the spin count above)
from . import reference  # noqa: E402
from ._attention import attention, attention_weights  # noqa: E402
from ._backward import attention_backward, attention_varlen_backward  # noqa: E402
from ._merge import merge_attention  # noqa: E402
from ._softmax import softmax  # noqa: E402
from ._varlen import attention_varlen  # noqa: E402
from ._version import __version__  # noqa: E402
from .layers import multihead_attention, self_attention  # noqa: E402

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_varlen_backward", "attention_weights",
           "merge_attention", "softmax", "self_attention", "multihead_attention", "reference", "show_config", "tune",
           "__version__"]


# the SIMD paths a build may carry, best first
ISA_NAMES = ("avx512", "avx2", "generic")


def _choose_isa() -> None:
    """FASTATTN_ISA=generic forces the portable path; =avx2 or =avx512 asks
    for that path (with a warning if this CPU cannot run it); unset or 'auto':
    the best this CPU has (avx512, then avx2, then generic)."""
    want = _os.environ.get("FASTATTN_ISA", "auto").strip().lower()
    if want in ("", "auto"):
        return
    if want not in ISA_NAMES:
        _warnings.warn(f"FASTATTN_ISA={want!r} is not one of auto, {', '.join(ISA_NAMES)}; using "
                       f"{_core.isa_name()}", RuntimeWarning, stacklevel=2)
        return
    if not _core.isa_available(want):
        _warnings.warn(f"FASTATTN_ISA={want!r} is not available on this CPU; using "
                       f"{_core.isa_name()}", RuntimeWarning, stacklevel=2)
        return
    _core.set_isa(want)


_choose_isa()
from . import _tune  # noqa: E402
from ._tune import tune  # noqa: E402

_tune.load()   # a saved tune() of this CPU, SIMD path and version (FASTATTN_TUNING=off: none)


def show_config() -> None:
    """Print how fastattn was built and what it runs on, like numpy.show_config().

    The version, the compiler and its flags, the CPU, the SIMD path chosen at
    run time (and the ones this CPU could take), the tuning table in use (built
    in for this CPU, the path's default, or measured here by fastattn.tune()),
    the OpenMP runtime library and the default thread count.

    Examples
    --------
    >>> import fastattn
    >>> fastattn.show_config()  # doctest: +SKIP
    fastattn 0.1.0
      compiler:       gcc 12.2.0; flags: -O3 -fno-math-errno -Wall -Wextra -fopenmp; OpenMP 201511
      CPU:            AMD EPYC (AuthenticAMD family 26 model 2; L2 1 MiB; L3 32 MiB)
      SIMD path:      avx512 (available: avx512, avx2, generic; FASTATTN_ISA=auto)
      tuning:         'zen5', the built-in table of this CPU
      OpenMP:         /usr/lib/x86_64-linux-gnu/libgomp.so.1
      threads:        2 (OMP_NUM_THREADS=unset)
    """
    print(f"fastattn {__version__}")
    print(f"  compiler:       {_core.build_info()}")
    cpu = _core.cpu_info()
    caches = "; ".join(f"{n} {b / 2**20:g} MiB" for n, b in (("L2", cpu["l2_bytes"]), ("L3", cpu["l3_bytes"])) if b)
    print(f"  CPU:            {cpu['brand'] or 'unknown'} ({cpu['vendor'] or 'not x86'} family {cpu['family']} "
          f"model {cpu['model']}{'; ' + caches if caches else ''})")
    print(f"  SIMD path:      {_core.isa_name()} (available: "
          f"{', '.join(n for n in ISA_NAMES if _core.isa_available(n))}; "
          f"FASTATTN_ISA={_os.environ.get('FASTATTN_ISA', 'auto')})")
    print(f"  tuning:         {_tune.describe()}")
    print(f"  OpenMP:         {_core.openmp_library() if _core.openmp_enabled() else 'no (single-threaded build)'}")
    if _core.fork_serial():
        print("  threads:        1 (a process forked while GNU libgomp's threads could not be "
              "freed: docs/guide.md, 'Threads, fork and the thread cap')")
    else:
        print(f"  threads:        {_core.max_threads()} (OMP_NUM_THREADS="
              f"{_os.environ.get('OMP_NUM_THREADS', 'unset')}; at most {_core.thread_cap()})")
