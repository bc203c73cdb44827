"""What adversarial probing found: out= sharing memory with a mask, slopes or
itself; thread counts that crash the OpenMP runtime; float32 rows of more than
2^24 keys; Ctrl-C during a long call; more than 32 leading dims; masked arrays;
bools for counts.  (The fork cases are in test_attention.py, test_fork_*.)"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import assert_close, rand, reference64

import fastattn
from fastattn import _core
from fastattn import reference as ref

F32, F64 = np.float32, np.float64


def _run_script(tmp_path, code, timeout=120, env=None):
    """Run code in a fresh Python (the fastattn these tests import) and return it."""
    where = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join([where] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(code))
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path, env=env)


# ---------------------------------------------------------------------------
# out= that shares memory with an input read after out is first written
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["float", "bool"])
@pytest.mark.parametrize("nthreads", [1, 2])
def test_out_overlapping_mask(kind, nthreads):
    """The plain path checked only q, k, v for overlap with out: a mask in out's
    buffer was overwritten while still being read (wrong by 0.81)."""
    rng = np.random.default_rng(0)
    q, k, v = rand(rng, (300, 16)), rand(rng, (64, 16)), rand(rng, (64, 64))
    buf = rand(rng, (301, 64))
    if kind == "float":
        mask = buf[:-1]
    else:   # a bool mask stored in the first bytes of the same buffer
        mask = buf.reshape(-1).view(np.uint8)[:300 * 64].reshape(300, 64).view(bool)
        mask[...] = rng.random((300, 64)) < 0.7
    mask0 = mask.copy()      # out's writes change the mask: it is read before them
    want = fastattn.attention(q, k, v, mask=mask0, num_threads=nthreads)
    got = fastattn.attention(q, k, v, mask=mask, out=buf[1:], num_threads=nthreads)
    assert np.shares_memory(got, buf)
    np.testing.assert_array_equal(got, want)
    assert_close(got, reference64(q, k, v, mask=mask0)[0], F32)


def test_varlen_out_overlapping_slopes():
    """attention_varlen did not check alibi_slopes for overlap with out (wrong by 3.34)."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((400, 4, 8)) for _ in range(3))
    cu = np.array([0, 100, 250, 400])
    buf = np.zeros(400 * 4 * 8)
    out = buf.reshape(400, 4, 8)
    slopes = buf[:12].reshape(3, 4)          # (B, H), in the first 12 elements of out's buffer
    slopes[...] = rng.random((3, 4))
    want = fastattn.attention_varlen(q, k, v, cu, cu, causal=True, alibi_slopes=slopes.copy())
    got = fastattn.attention_varlen(q, k, v, cu, cu, causal=True, alibi_slopes=slopes, out=out)
    assert got is out
    np.testing.assert_array_equal(got, want)


def test_varlen_out_overlapping_qkv():
    rng = np.random.default_rng(2)
    buf = rng.standard_normal(3 * 60 * 2 * 8)
    q, k, v = (buf[i * 960:(i + 1) * 960].reshape(60, 2, 8) for i in range(3))
    cu = np.array([0, 25, 60])
    want = fastattn.attention_varlen(q.copy(), k.copy(), v.copy(), cu, cu)
    got = fastattn.attention_varlen(q, k, v, cu, cu, out=q)
    np.testing.assert_allclose(got, want, rtol=0, atol=0)


def test_out_self_overlapping_refused():
    """An out whose elements overlap (stride 0, overlapping strides) would come out as
    whichever write was last: refused with a ValueError, on every entry point."""
    rng = np.random.default_rng(3)
    q, k, v = rand(rng, (4, 8)), rand(rng, (6, 8)), rand(rng, (6, 8))
    base = np.zeros(256, F32)
    s = base.itemsize
    bad = [np.lib.stride_tricks.as_strided(base, (4, 8), (0, s), writeable=True),       # rows alike
           np.lib.stride_tricks.as_strided(base, (4, 8), (s, s), writeable=True),       # rows one apart
           np.lib.stride_tricks.as_strided(base, (4, 8), (8 * s, 0), writeable=True),   # columns alike
           np.lib.stride_tricks.as_strided(base, (4, 8), (3 * s, 2 * s), writeable=True)]  # interleaved, overlapping
    for out in bad:
        with pytest.raises(ValueError, match="overlap one another"):
            fastattn.attention(q, k, v, out=out)
        with pytest.raises(ValueError, match="overlap one another"):
            fastattn.softmax(q, out=out)
    with pytest.raises(ValueError, match="overlap one another"):
        fastattn.attention(q[:, None], k[:, None], v[:, None], layout="blhd",
                           out=np.lib.stride_tricks.as_strided(base, (4, 1, 8), (0, 0, s), writeable=True))
    qv = rand(rng, (5, 2, 8))
    with pytest.raises(ValueError, match="overlap one another"):
        fastattn.attention_varlen(qv, qv, qv, [0, 2, 5], [0, 2, 5],
                                  out=np.lib.stride_tricks.as_strided(base, (5, 2, 8), (0, 8 * s, s),
                                                                      writeable=True))
    # interleaved strides whose elements do not overlap: accepted and right
    inter = np.lib.stride_tricks.as_strided(base, (2, 3), (3 * s, 2 * s), writeable=True)  # offsets 0,2,4,3,5,7
    got = fastattn.attention(q[:2, :3], k[:, :3], v[:, :3], out=inter)
    assert got is inter
    assert_close(got, reference64(q[:2, :3], k[:, :3], v[:, :3])[0], F32)


# ---------------------------------------------------------------------------
# thread counts
# ---------------------------------------------------------------------------
def test_num_threads_capped():
    """A huge num_threads runs on at most thread_cap() threads (the runtime crashed
    setting up 65536), with the right result."""
    rng = np.random.default_rng(4)
    q = rand(rng, (4, 256, 32))
    cap = _core.thread_cap()
    assert 8 <= cap <= 1024 and cap >= min(os.cpu_count() or 1, 1024)
    want = reference64(q, q, q)[0]
    for n in (cap + 1, 65536, 1 << 40):
        got = fastattn.attention(q, q, q, num_threads=n)
        assert_close(got, want, F32)
        if _core.openmp_enabled():
            assert 1 < _core.last_threads() <= cap
    assert _core.max_threads() <= cap


@pytest.mark.skipif(not _core.openmp_enabled(), reason="a build without OpenMP starts no threads")
def test_num_threads_cap_in_process(tmp_path):
    """In a fresh process: 2048 threads asked from a thread with a 256 KiB stack, and
    OMP_NUM_THREADS=100000 (each crashed the process), run on at most thread_cap()."""
    proc = _run_script(tmp_path, """
        import threading, numpy as np, fastattn, fastattn._core as c
        q = np.ones((4, 256, 32), np.float32)
        res = {}
        def call():
            fastattn.attention(q, q, q, num_threads=2048)
            res["small_stack"] = c.last_threads()
        threading.stack_size(256 * 1024)
        t = threading.Thread(target=call)
        t.start(); t.join()
        fastattn.attention(q, q, q)
        print(res["small_stack"], c.last_threads(), c.thread_cap(), c.max_threads())
    """, env={"OMP_NUM_THREADS": "100000"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    small, default, cap, mx = map(int, proc.stdout.split())
    assert 1 < small <= cap and 1 < default <= cap and mx == cap


# ---------------------------------------------------------------------------
# float32 rows of more than 2^24 keys
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("n_q", [1, 3, 40])
def test_long_rows_float32(isa, n_q):
    """Every value 3.0 over 2^25 + 5 keys (K and V broadcast, no memory): the result
    is 3.0 (was 3.33 on one thread, 2.0 at 2^27) and lse log(n_k) + the score."""
    n = (1 << 25) + 5
    kv = np.broadcast_to(np.full((1, 8), 3.0, F32), (n, 8))
    q = np.full((n_q, 8), 0.25, F32)
    for nt in (1, 2):
        out, lse = fastattn.attention(q, kv, kv, return_lse=True, num_threads=nt)
        np.testing.assert_allclose(out, 3.0, rtol=1e-6)
        np.testing.assert_allclose(lse, np.log(n) + 8 * 0.25 * 3.0 / np.sqrt(8), rtol=1e-6)




@pytest.mark.parametrize("case", ["plain", "causal_mask", "gqa_lengths", "window_alibi", "decode"])
def test_long_split_paths(isa, long_split, case):
    """The split of long rows, forced at 300 keys with waves of a few items,
    against the float64 reference: the same options as any call."""
    rng = np.random.default_rng(5)
    kw = {}
    if case == "decode":
        q, k, v = rand(rng, (2, 4, 1, 32)), rand(rng, (2, 4, 2000, 32)), rand(rng, (2, 4, 2000, 16))
    elif case == "gqa_lengths":
        q, k, v = rand(rng, (2, 4, 70, 32)), rand(rng, (2, 2, 1500, 32)), rand(rng, (2, 2, 1500, 32))
        kw = dict(enable_gqa=True, kv_lengths=np.array([[1500], [1111]]), causal=True)
    else:
        q, k, v = rand(rng, (2, 3, 130, 32)), rand(rng, (2, 3, 1500, 32)), rand(rng, (2, 3, 1500, 32))
        if case == "causal_mask":
            kw = dict(causal=True, mask=rng.random((130, 1500)) < 0.8)
        elif case == "window_alibi":
            kw = dict(window=(700, 100), alibi_slopes=np.array([0.01, 0.02, 0.04], F32))
    want, want_lse = reference64(q, k, v, **kw)
    for keys, budget in ((300, 0), (300, 20000), (1000, 1)):
        long_split(keys, budget)
        for nt in (1, 2):
            out, lse = fastattn.attention(q, k, v, return_lse=True, num_threads=nt, **kw)
            assert_close(out, want, F32, f"{case} keys {keys} budget {budget} threads {nt}")
            assert_close(lse, want_lse, F32, "lse")


def test_long_split_float64(long_split):
    """float64 rows are split too (a work unit of at most 2^20 keys, for Ctrl-C):
    against the reference at float64's tolerance, in waves."""
    rng = np.random.default_rng(6)
    q, k, v = rand(rng, (2, 50, 16), F64), rand(rng, (2, 900, 16), F64), rand(rng, (2, 900, 16), F64)
    want = reference64(q, k, v, causal=True)
    long_split(100, 1)
    out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
    assert_close(out, want[0], F64)
    assert_close(lse, want[1], F64, "lse")


# ---------------------------------------------------------------------------
# Ctrl-C
# ---------------------------------------------------------------------------
_INTERRUPT_SCRIPT = """
import os, signal, sys, threading, time
import numpy as np, fastattn
which = sys.argv[1]
def fire():
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGINT)
if which == "huge":    # (2^40, 0) keys: would run for hours
    q, k = np.ones((1, 0), np.float32), np.broadcast_to(np.zeros((1, 0), np.float32), (1 << 40, 0))
    v = np.broadcast_to(np.ones((1, 4), np.float32), (1 << 40, 4))
elif which == "prefill":
    q = np.ones((2048, 16), np.float32)
    k = v = np.broadcast_to(np.ones((1, 16), np.float32), (1 << 30, 16))
elif which == "softmax":
    x = np.ones((1 << 12, 1 << 16), np.float32)
else:                  # decoding, 2^36 keys
    q = np.ones((1, 16), np.float32)
    k = v = np.broadcast_to(np.ones((1, 16), np.float32), (1 << 36, 16))
threading.Thread(target=fire).start()
t = time.monotonic()
try:
    if which == "softmax":
        for _ in range(40):
            fastattn.softmax(x)
    else:
        fastattn.attention(q, k, v, num_threads=2)
    print("finished", time.monotonic() - t)
except KeyboardInterrupt:
    took = time.monotonic() - t
    small = np.random.default_rng(0).standard_normal((3, 20, 8))
    ok = np.allclose(fastattn.attention(small, small, small), fastattn.reference.attention(small, small, small))
    print("interrupted", took, threading.active_count(), ok)
"""


@pytest.mark.skipif(os.name != "posix", reason="SIGINT by os.kill")
@pytest.mark.parametrize("which", ["decode", "prefill", "huge", "softmax"])
def test_ctrl_c_stops_long_calls(tmp_path, which):
    """SIGINT 0.3 s into a call of minutes stops it with KeyboardInterrupt soon after
    (it came only when the call returned); no thread is left running and the next
    call is right."""
    proc = _run_script(tmp_path, _INTERRUPT_SCRIPT.replace("sys.argv[1]", repr(which)), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    words = proc.stdout.split()
    assert words[0] == "interrupted", proc.stdout
    took, threads, ok = float(words[1]), int(words[2]), words[3] == "True"
    assert took < 0.3 + 1.5, f"KeyboardInterrupt {took - 0.3:.2f} s after the signal"
    assert threads == 1 and ok


def test_sigint_handler_that_returns(tmp_path):
    """A SIGINT handler of the user's own (not Python's default): the call is not
    stopped (it could not be resumed: out= may alias an input); it returns the whole
    result and the handler runs once, after it."""
    proc = _run_script(tmp_path, """
        import os, signal, threading, time
        import numpy as np, fastattn
        hits = []
        signal.signal(signal.SIGINT, lambda *a: hits.append(1))
        x = np.ones((1 << 12, 1 << 16), np.float32)
        fastattn.softmax(x)
        def fire():
            time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGINT)
        threading.Thread(target=fire).start()
        t = time.monotonic()
        y = fastattn.softmax(x)
        print(len(hits), bool((y == np.float32(2.0 ** -16)).all()), time.monotonic() - t)
    """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    hits, right, took = proc.stdout.split()
    assert int(hits) == 1 and right == "True" and float(took) > 0.02


def test_interrupt_handler_restored():
    """A call that watched for Ctrl-C puts Python's SIGINT handler back."""
    import signal
    before = signal.getsignal(signal.SIGINT)
    kv = np.broadcast_to(np.ones((1, 16), F32), (1 << 20, 16))
    fastattn.attention(np.ones((64, 16), F32), kv, kv)
    assert signal.getsignal(signal.SIGINT) is before


# ---------------------------------------------------------------------------
# many leading dims, masked arrays, bools for counts
# ---------------------------------------------------------------------------
def test_many_leading_dims():
    """40 leading dims (30 under NumPy 1) with a mask, kv_lengths, q_lengths and ALiBi slopes (NumPy's
    broadcast_shapes stops at 32 with a RuntimeError): the same as the squeezed call."""
    rng = np.random.default_rng(7)
    q, k, v = rand(rng, (2, 3, 5, 8)), rand(rng, (2, 3, 7, 8)), rand(rng, (2, 3, 7, 4))
    mask = rng.random((3, 5, 7)) < 0.8
    kvl, qln, sl = np.array([[7], [5]]), np.array([[5], [4]]), np.array([0.1, 0.2, 0.3], F32)
    want = fastattn.attention(q, k, v, mask=mask, kv_lengths=kvl, q_lengths=qln, alibi_slopes=sl)
    # NumPy 2 arrays take up to 64 dims (the bug needed more than 32 leading ones); NumPy 1 up to 32
    extra = (1,) * (38 if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else 28)
    grow = lambda a: a.reshape(extra + a.shape)  # noqa: E731
    got = fastattn.attention(grow(q), grow(k), grow(v), mask=mask, kv_lengths=grow(kvl), q_lengths=qln,
                             alibi_slopes=sl)
    assert got.shape == extra + (2, 3, 5, 4)
    np.testing.assert_array_equal(got.reshape(want.shape), want)
    assert_close(want, ref.attention(q.astype(F64), k.astype(F64), v.astype(F64), mask=mask,
                                     kv_lengths=kvl, q_lengths=qln, alibi_slopes=sl.astype(F64)), F32)


def test_masked_arrays_refused():
    """np.ma.MaskedArray inputs were computed with the data under their mask."""
    x = np.ma.MaskedArray(np.ones((2, 4)), mask=[[0, 1, 0, 0], [0, 0, 0, 0]])
    plain = np.ones((2, 4))
    for call in (lambda: fastattn.attention(x, plain, plain),
                 lambda: fastattn.attention(plain, plain, x),
                 lambda: fastattn.attention(plain, plain, plain, mask=np.ma.MaskedArray(np.ones((2, 2), bool))),
                 lambda: fastattn.attention(plain[None], plain[None], plain[None],
                                            kv_lengths=np.ma.MaskedArray([2])),
                 lambda: fastattn.softmax(x),
                 lambda: fastattn.attention_weights(x, plain),
                 lambda: fastattn.merge_attention([x], [np.zeros(2)]),
                 lambda: fastattn.self_attention(x, np.eye(4), np.eye(4), np.eye(4))):
        with pytest.raises(TypeError, match=r"MaskedArray.*\.filled\("):
            call()


@pytest.mark.parametrize("kw", [dict(num_heads=True), dict(num_heads=2, num_kv_heads=True),
                                dict(num_heads=np.bool_(True)), dict(num_heads=2.0), dict(num_heads=None)])
def test_counts_refuse_bools(kw):
    x, w = np.ones((2, 3, 4)), np.eye(4)
    with pytest.raises(TypeError, match="num_(kv_)?heads must be"):
        fastattn.multihead_attention(x, w, w, w, w, **kw)


def test_key_padding_mask_hint():
    """A PyTorch-style key-padding mask (B, n_k) is refused with the way to pass it."""
    q = np.ones((2, 4, 5, 8), F32)
    with pytest.raises(ValueError, match=r"mask\[:, None, None, :\].*kv_lengths"):
        fastattn.attention(q, q, q, mask=np.ones((2, 5), bool))
    keep = np.array([[True] * 5, [True, True, True, False, False]])
    got = fastattn.attention(q, q, q, mask=keep[:, None, None, :])          # the hint, followed
    np.testing.assert_array_equal(got, fastattn.attention(q, q, q, kv_lengths=np.array([[5], [3]])))


@pytest.mark.skipif(not _core.openmp_enabled() or not hasattr(os, "fork"), reason="a build without OpenMP")
def test_thread_limit_outlives_a_fork():
    """Freeing libgomp's pool before a fork must not drop the thread count that
    threadpoolctl (omp_set_num_threads) set, in the parent or (under libgomp, which
    fastattn's fork handlers serve) in the child."""
    from threadpoolctl import threadpool_limits
    before = _core.max_threads()
    q = np.ones((8, 256, 32), F32)
    with threadpool_limits(limits=1, user_api="openmp"):
        assert _core.max_threads() == 1
        fastattn.attention(q, q, q, num_threads=2)                        # a pool of this thread's
        assert _core.last_threads() == 2
        subprocess.run([sys.executable, "-c", "pass"], check=True)        # fork + exec
        assert _core.max_threads() == 1
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(w, str(_core.max_threads()).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        child = os.read(r, 16)
        if "gomp" in _core.openmp_library():   # LLVM's and Intel's runtimes start afresh in a child
            assert child == b"1"
        os.close(r)
        os.close(w)
        assert _core.max_threads() == 1
    assert _core.max_threads() == before


def _misaligned(a):
    """A copy of `a` one byte past an aligned address (as an unpickled buffer can be)."""
    buf = np.zeros(a.nbytes + 65, np.uint8)
    start = (-buf.ctypes.data) % 64 + 1
    x = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    x[...] = a
    assert not x.flags.aligned
    return x


@pytest.mark.parametrize("dtype", [F32, F64])
def test_misaligned_arrays(dtype):
    """Arrays not aligned to their dtype (q, k, v, a float mask, lengths, slopes, out) are
    copied, not read in place: the C core's loads assume element alignment (UBSan)."""
    rng = np.random.default_rng(9)
    q, k, v = rand(rng, (2, 3, 20, 8), dtype), rand(rng, (2, 3, 30, 8), dtype), rand(rng, (2, 3, 30, 4), dtype)
    mask = np.where(rng.random((20, 30)) < 0.8, 0.0, -np.inf).astype(dtype)
    kvl, sl = np.array([[30], [17]], np.int64), np.array([0.1, 0.2, 0.3], dtype)
    want = fastattn.attention(q, k, v, causal=True)
    out = _misaligned(np.zeros_like(want))
    got = fastattn.attention(_misaligned(q), _misaligned(k), _misaligned(v), causal=True, out=out)
    assert got is out
    np.testing.assert_array_equal(got, want)
    kw = dict(mask=mask, kv_lengths=kvl, alibi_slopes=sl)
    want = fastattn.attention(q, k, v, **kw)
    got = fastattn.attention(_misaligned(q), _misaligned(k), _misaligned(v), mask=_misaligned(mask),
                             kv_lengths=_misaligned(kvl), alibi_slopes=_misaligned(sl))
    np.testing.assert_array_equal(got, want)
    assert_close(got, reference64(q, k, v, **kw)[0], dtype)
    x = rand(rng, (5, 40), dtype)
    np.testing.assert_array_equal(fastattn.softmax(_misaligned(x)), fastattn.softmax(x))
    qv = rand(rng, (25, 3, 8), dtype)
    cu = np.array([0, 10, 25])
    got = fastattn.attention_varlen(_misaligned(qv), qv, qv, cu, cu, alibi_slopes=_misaligned(sl))
    np.testing.assert_array_equal(got, fastattn.attention_varlen(qv, qv, qv, cu, cu, alibi_slopes=sl))
