"""Public behaviour: threads.  num_threads and the team that ran, the thread cap,
concurrent Python threads and the GIL, fork after a team (fastattn's or another
library's), threadpoolctl's limit across a fork, and Ctrl-C during a long call."""

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import assert_close, rand, reference64
from helpers import F32, F64, check, run_script, team_check

import fastattn
from fastattn import _core


# ---------------------------------------------------------------------------
# num_threads and the team that ran
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts(isa, rng, threads):
    """num_threads is the team that runs a call with enough work (here 4 heads of
    300 rows), and the result agrees with one thread's."""
    q, k, v = (rand(rng, (2, 2, 300, 32)) for _ in range(3))
    a = check(q, k, v, causal=True, num_threads=threads)[0]
    assert _core.last_threads() == (threads if _core.openmp_enabled() else 1)
    with team_check(1):
        b = fastattn.attention(q, k, v, causal=True, num_threads=1)
    assert_close(a, b.astype(F64), F32)

def test_num_threads_capped():
    """A huge num_threads runs on at most thread_cap() threads (the runtime crashed
    setting up 65536), with the right result."""
    rng = np.random.default_rng(4)
    q = rand(rng, (4, 256, 32))
    cap = _core.thread_cap()
    assert 8 <= cap <= 1024 and cap >= min(os.cpu_count() or 1, 1024)
    want = reference64(q, q, q)[0]
    for n in (cap + 1, 65536, 1 << 40):
        with team_check(n):                           # num_threads reaches the core as cap
            got = fastattn.attention(q, q, q, num_threads=n)
        assert_close(got, want, F32)
        if _core.openmp_enabled():
            assert 1 < _core.last_threads() <= cap
    assert _core.max_threads() <= cap


@pytest.mark.skipif(not _core.openmp_enabled(), reason="a build without OpenMP starts no threads")
def test_num_threads_cap_in_process(tmp_path):
    """In a fresh process: 2048 threads asked from a thread with a 256 KiB stack, and
    OMP_NUM_THREADS=100000 (each crashed the process), run on at most thread_cap()."""
    proc = run_script(tmp_path, """
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
# Python threads
# ---------------------------------------------------------------------------

def test_concurrent_python_threads(rng):
    cases = [tuple(rand(rng, (2, 150, 16), dt) for _ in range(3)) for dt in (F32, F64) * 4]
    wants = [reference64(*c, causal=True)[0] for c in cases]
    with ThreadPoolExecutor(max_workers=4) as ex:
        for _ in range(3):
            gots = list(ex.map(lambda c: fastattn.attention(*c, causal=True), cases))
            for c, got, want in zip(cases, gots, wants):
                assert_close(got, want, c[0].dtype)


def test_gil_released(rng):
    """Another Python thread runs while the C core works."""
    q, k, v = (rand(rng, (4, 8, 1024, 64)) for _ in range(3))
    count = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    try:
        fastattn.attention(q, k, v, num_threads=1)   # warm-up: the spinner is surely running
        before = count[0]
        with team_check(1):
            fastattn.attention(q, k, v, num_threads=1)
        during = count[0] - before
    finally:
        stop.set()
        t.join()
    assert during > 1000, f"the other thread advanced only {during} steps during the call"


# ---------------------------------------------------------------------------
# fork
# ---------------------------------------------------------------------------
# A fresh process: forks a child before any team, runs a team of GNU libgomp's
# own (GOMP_parallel) and forks a child, calls on two threads (a team), forks a
# child again; each child calls on two threads and reports.  A child that
# does not report within 60 s is killed: None; one that exits without a report
# gives its exit status.
_FORK_SCRIPT = r"""
import contextlib, ctypes, io, json, os, signal, time, warnings
import numpy as np
import fastattn
from fastattn import _core
from fastattn import reference as ref
warnings.simplefilter("ignore", DeprecationWarning)  # Python >= 3.12 on fork with threads
rng = np.random.default_rng(1)
q, k, v = (rng.standard_normal((2, 4, 256, 32)) for _ in range(3))
want = ref.attention(q, k, v, causal=True)

def err():
    out = fastattn.attention(q, k, v, causal=True, num_threads=2)
    return float(np.max(np.abs(out - want)))

def in_child():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            e = err()
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                fastattn.show_config()
            rep = dict(err=e, threads=_core.last_threads(), serial=_core.fork_serial(),
                       max=_core.max_threads(), config=buf.getvalue())
            os.write(w, json.dumps(rep).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    end = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > end:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.02)
    data = b""
    while True:
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
    os.close(r)
    return json.loads(data) if data else dict(died=status)

def foreign_team():
    # a team of another library on the same OpenMP runtime, as PyTorch's ops start:
    # GOMP_parallel(free, NULL, 2, 0) runs free(NULL) on two threads
    gomp = ctypes.CDLL(_core.openmp_library())
    if not hasattr(gomp, "GOMP_parallel"):
        return False
    free = ctypes.cast(ctypes.CDLL(None).free, ctypes.c_void_p)
    gomp.GOMP_parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    gomp.GOMP_parallel(free, None, 2, 0)
    return True

rep = dict(before=in_child())
rep.update(gomp=foreign_team(), foreign=in_child())
rep.update(parent_err=err(), parent_threads=_core.last_threads())
rep.update(after=in_child(), parent_err_after=err(), parent_threads_after=_core.last_threads())
print(json.dumps(rep))
"""

@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_fork_after_threads(tmp_path):
    """A child forked after an OpenMP team ran, fastattn's or another library's on the
    same runtime (GOMP_parallel through ctypes, as PyTorch's ops run), computes on its
    own team (GNU libgomp's would wait for the parent's threads forever: multiprocessing's
    fork hung): fastattn frees the pool before the fork (omp_pause_resource_all), and
    runtimes without it give the child one thread."""
    proc = run_script(tmp_path, _FORK_SCRIPT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout.splitlines()[-1])
    before, foreign, after = rep["before"], rep["foreign"], rep["after"]
    assert before is not None, "a child forked before any team hung"
    assert foreign is not None, "a child forked after another library's team hung"
    assert after is not None, "a child forked after a team hung"
    assert "died" not in before and "died" not in after and "died" not in foreign, rep
    team = 2 if _core.openmp_enabled() else 1
    lib = _core.openmp_library()
    # libgomp without omp_pause_resource_all (before GCC 9): one thread after fork
    serial = team == 2 and "gomp" in lib and not hasattr(ctypes.CDLL(lib), "omp_pause_resource_all")
    assert rep["gomp"] or "gomp" not in lib
    assert rep["parent_threads"] == rep["parent_threads_after"] == team
    assert before["threads"] == team and not before["serial"] and before["max"] == _core.max_threads()
    for child in (foreign, after):
        assert child["serial"] == serial
        assert child["threads"] == (1 if serial else team)
        assert child["max"] == (1 if serial else _core.max_threads())
        assert ("forked" in child["config"]) == serial
    assert "forked" not in before["config"]
    for e in (before["err"], foreign["err"], after["err"], rep["parent_err"], rep["parent_err_after"]):
        assert e < 1e-12


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


# ---------------------------------------------------------------------------
# Ctrl-C
# ---------------------------------------------------------------------------
_INTERRUPT_SCRIPT = """
import os, signal, sys, threading, time
import numpy as np, fastattn
# Python's own handler, as at an interactive prompt: a process started in the
# background by a shell without job control inherits SIGINT ignored
signal.signal(signal.SIGINT, signal.default_int_handler)
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
    proc = run_script(tmp_path, _INTERRUPT_SCRIPT.replace("sys.argv[1]", repr(which)), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    words = proc.stdout.split()
    assert words[0] == "interrupted", proc.stdout
    took, threads, ok = float(words[1]), int(words[2]), words[3] == "True"
    assert took < 0.3 + 1.5, f"KeyboardInterrupt {took - 0.3:.2f} s after the signal"
    assert threads == 1 and ok


@pytest.mark.parametrize("handler", ["own", "ignored"])
def test_sigint_not_pythons_handler(tmp_path, handler):
    """SIGINT with a handler of the user's own, or ignored (SIG_IGN: a background
    job of a shell without job control, a daemon), not Python's default: the call
    is not stopped (it could not be resumed: out= may alias an input); it returns
    the whole result, the handler stays in place, and the user's runs once, after
    the call."""
    proc = run_script(tmp_path, f"""
        import os, signal, threading, time
        import numpy as np, fastattn
        hits = []
        handler = signal.SIG_IGN if {handler == "ignored"} else (lambda *a: hits.append(1))
        signal.signal(signal.SIGINT, handler)
        x = np.ones((1 << 12, 1 << 16), np.float32)
        fastattn.softmax(x)
        def fire():
            time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGINT)
        threading.Thread(target=fire).start()
        t = time.monotonic()
        y = fastattn.softmax(x)
        took = time.monotonic() - t
        print(len(hits), bool((y == np.float32(2.0 ** -16)).all()), signal.getsignal(signal.SIGINT) == handler, took)
    """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    hits, right, kept, took = proc.stdout.split()
    assert int(hits) == (1 if handler == "own" else 0)
    assert right == "True" and kept == "True" and float(took) > 0.02


def test_interrupt_handler_restored():
    """A call that watched for Ctrl-C puts Python's SIGINT handler back."""
    before = signal.getsignal(signal.SIGINT)
    kv = np.broadcast_to(np.ones((1, 16), F32), (1 << 20, 16))
    fastattn.attention(np.ones((64, 16), F32), kv, kv)
    assert signal.getsignal(signal.SIGINT) is before
