"""Self-tuning: measure the plan's main thresholds on this machine and keep them.

fastattn.tune() times the kernels against each other on this CPU (20-30 s on
two cores), puts the result in place of the built-in table and saves it in the
user's cache directory under a name keyed by the CPU (CPUID vendor, family,
model, stepping), the SIMD path and fastattn's version.  From the next import
on, fastattn reads it back (``load``), unless FASTATTN_TUNING=off.
show_config() says which table is in use.  FFTW's wisdom is the model.

What it measures (the fields of src_c/internal.h's fa_tuning; docs/tuning.md):
  rows_max, rows_max_dk, rows_max_big (rows_max_big_dk where the table sets it), rows_full
        the row kernel against the tiled kernel at 2-24 query rows, K and V in
        cache (d64, d128) and from memory (d128), float32 and float64;
  tail_max
        the row kernel as the tiled kernel's tail, against a whole vector;
  fuse  the tiled kernel's fused exp;
  stream, kv_far_bytes, decode_far
        the row kernel's prefetch across passes and its far prefetch, K and V
        from memory (decoding, 4 and 8 rows); then decoding's far or near;
  decode_pf
        decoding's own prefetch of K and V, from memory and in cache, float32
        and float64;
  bk_tiled, bk_tiled_mem, bk_rows, bk_decode
        the tiled kernel's keys a tile, in cache and (few rows) from memory; the
        row kernel's, for several rows and for one (decoding);
  tile_pf_l1
        with bk_tiled_mem: the tiled kernel's prefetch into L1 or L2 (16 and 32
        rows from memory);
  q_tile_bytes, q_tile_bytes_band
        the tiled kernel's query rows a block at d128 and d256 (float32); the
        same under a causal band (d128, 2048 rows);
  group_chunks_rows, group_tile_bytes, group_bk_max, group_touch
        the group kernel (heads of a (B, n, H, d) cache from memory): whether
        items of several rows take chunks of keys, its key tiles, and how it
        reads the next tile ahead (loads or software prefetch).
  bwd_bq, bwd_bk
        the backward's query rows a block and keys a unit (float32, d64 and d128).
The GQA fold, rows_full_dk, rows_max_kv, tail_mem, tile_spread, group_rows, pipe_rows, pipe_pf_l2, decode_inorder,
bq_tiled and kv_mem_bytes keep the built-in table's values (kv_far_bytes is only turned off or on: on, the
built-in size or 16 MiB).

A choice replaces the built-in one only where it measured at least TIE (2 %)
faster in total, TIE / 4 for the row thresholds and the tail (summed over many
rows, each normalised), so that noise leaves the built-in table as it is.
"""

import contextlib
import json
import os
import sys
import time
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from . import _core
from ._version import __version__

ENV = "FASTATTN_TUNING"      # "off" (or 0, no, false): the built-in table, no file read
ENV_DIR = "FASTATTN_CACHE_DIR"
TIE = 0.02                   # a choice must beat the built-in one by this fraction of the total
ROWS = tuple(range(2, 25))   # the query rows the row thresholds are measured at

# what load() found: source "built-in" or "tuned", the file, and why a file was not used
state: Dict[str, Any] = {"source": "built-in", "path": None, "note": None}


def disabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("off", "0", "no", "false")


def cache_dir() -> str:
    """Where tuning files go: FASTATTN_CACHE_DIR, else the platform's user cache
    directory (XDG_CACHE_HOME or ~/.cache on Linux, ~/Library/Caches on macOS,
    LOCALAPPDATA on Windows), under "fastattn"."""
    if os.environ.get(ENV_DIR):
        return os.environ[ENV_DIR]
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or os.path.expanduser("~\\AppData\\Local")
    elif sys.platform == "darwin":
        base = os.path.expanduser("~/Library/Caches")
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "fastattn")


def cpu_key() -> str:
    """This CPU and SIMD path, as a file name part: vendor-family-model-stepping-isa."""
    c = _core.cpu_info()
    vendor = "".join(ch for ch in c["vendor"] if ch.isalnum()) or "unknown"
    return f"{vendor}-{c['family']}-{c['model']}-{c['stepping']}-{_core.isa_name()}"


def tuning_path() -> str:
    """The tuning file of this CPU, SIMD path and fastattn version."""
    return os.path.join(cache_dir(), f"tuning-{cpu_key()}-fastattn{__version__}.json")


def load() -> None:
    """At import: the saved tuning of this CPU, SIMD path and version in place of
    the built-in table, if there is one (a file that cannot be used: a warning,
    and the built-in table)."""
    state.update(source="built-in", path=None, note=None)
    if disabled():
        state["note"] = f"{ENV}=off"
        return
    path = tuning_path()
    if not os.path.exists(path):
        return
    try:
        with open(path) as f:
            saved = json.load(f)
        if saved.get("cpu_key") != cpu_key() or saved.get("fastattn") != __version__:
            raise ValueError("it was measured on another CPU, SIMD path or fastattn version")
        _core.set_tuning(dict(saved["tuning"], name="tuned"))
    except (OSError, ValueError, TypeError, KeyError, AttributeError, ArithmeticError) as e:
        _core.reset_tuning()
        state["note"] = f"{path} not used: {e}"
        warnings.warn(f"fastattn: the tuning file {path} was not used ({e}); using the built-in table. "
                      f"Run fastattn.tune() again, or delete the file.", RuntimeWarning, stacklevel=3)
        return
    state.update(source="tuned", path=path)


def describe() -> str:
    """One line for show_config: the table in use and where it came from."""
    t = _core.isa_table()
    if state["source"] == "tuned":
        where = state["path"] or f"in this process, not saved: {state['note']}"
        return f"tuned on this machine ({where}; {ENV}=off for the built-in table)"
    c = _core.cpu_info()
    what = (f"'{t['name']}', the built-in table of this CPU" if t["name"] not in ("avx512", "avx2", "generic")
            else f"'{t['name']}', the default of the {t['isa']} path (no table measured on family "
                 f"{c['family']} model {c['model']}; fastattn.tune() measures one)")
    return what + (f"; {state['note']}" if state["note"] else "")


# ---------------------------------------------------------------------------
# timing

class _Variant:
    """A call under a context (a forcing block, a tuning in place) that _race enters
    once a sample, not once a call."""

    def __init__(self, call: Callable[[], Any], context: Callable[[], Any]):
        self.call, self.context = call, context


def _race(fns: Sequence[Any], rounds: int = 5, min_time: float = 0.01) -> List[float]:
    """The best seconds a call of each fn (a callable or a _Variant), the fns
    interleaved round by round (a neighbour on a shared machine slows the rounds,
    not one fn)."""
    def sample(f: Any, n: int) -> float:
        call, context = (f.call, f.context()) if isinstance(f, _Variant) else (f, contextlib.nullcontext())
        with context:
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            return (time.perf_counter() - t0) / n

    inner = []
    for f in fns:
        sample(f, 1)
        inner.append(max(1, int(min_time / max(sample(f, 1), 1e-7))))
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, f in enumerate(fns):
            best[i] = min(best[i], sample(f, inner[i]))
    return best


def _forced(call: Callable[[], Any], **overrides: int) -> _Variant:
    """call inside a forcing block of `overrides`."""
    return _Variant(call, lambda: _core.forcing(**overrides))


@contextlib.contextmanager
def _tuning_in_place(table: Dict[str, Any], base: Dict[str, Any]) -> Iterator[None]:
    _core.set_tuning(table)
    try:
        yield
    finally:
        _core.set_tuning(base)


def _tuned(call: Callable[[], Any], fields: Dict[str, Any], base: Dict[str, Any]) -> _Variant:
    """call with the tuning `base` and `fields` in place (`base` restored after)."""
    return _Variant(call, lambda: _tuning_in_place(dict(base, **fields), base))


# ---------------------------------------------------------------------------
# the choices

def _rows_choice(times: Dict[str, Dict[int, Tuple[float, float]]], lanes: int, builtin: Dict[str, int],
                 full_builtin: int, full_off: Sequence[str] = ()) -> Tuple[Dict[str, int], int, float, float]:
    """The row thresholds (one rows_max per regime) and rows_full that take the least
    total time over the measured rows, each row's time relative to its faster kernel.
    times[regime][n] = (row kernel, tiled kernel) seconds; full_off: the regimes where
    rows_full does not apply (the table's rows_full_dk).  Returns the choice, its
    rows_full, its cost and the built-in table's cost."""
    def cost(regime: str, rows_max: int, full: int) -> float:
        total = 0.0
        applies = regime not in full_off
        for n, (t_rows, t_tiled) in times[regime].items():
            rows = n <= rows_max and not (applies and full and full <= n <= lanes)   # (d128: the plan's full range)
            total += (t_rows if rows else t_tiled) / min(t_rows, t_tiled)
        return total

    best: Tuple[Dict[str, int], int, float] = ({}, 0, float("inf"))
    for full in [0] + list(range(2, lanes + 1)):
        pick: Dict[str, int] = {}
        total = 0.0
        for regime in times:
            c, r = min((cost(regime, r, full), r) for r in range(1, max(ROWS) + 1))
            pick[regime], total = r, total + c
        if total < best[2] - 1e-12:
            best = (pick, full, total)
    base = sum(cost(regime, builtin[regime], full_builtin) for regime in times)
    return best[0], best[1], best[2], base


def _kv(rng, heads: int, nk: int, d: int, dtype) -> Tuple[np.ndarray, np.ndarray]:
    return (rng.standard_normal((1, heads, nk, d)).astype(dtype),
            rng.standard_normal((1, heads, nk, d)).astype(dtype))


class _Bench:
    """What every measurement shares: the random inputs, the threads, the rounds,
    the built-in tuning (the baseline) and the log."""

    def __init__(self, threads: int, rounds: int, base: Dict[str, Any], mem_bytes: int, say):
        from . import attention
        self.attention, self.threads, self.rounds, self.base, self.say = attention, threads, rounds, base, say
        self.mem_bytes = mem_bytes
        self.rng = np.random.default_rng(0)

    def q(self, heads: int, n: int, d: int, dtype) -> np.ndarray:
        return self.rng.standard_normal((1, heads, n, d)).astype(dtype)

    def call(self, q, k, v, **options) -> Callable[[], Any]:
        return lambda: self.attention(q, k, v, num_threads=self.threads, **options)

    def race(self, fns) -> List[float]:
        return _race(fns, self.rounds)


def _measure_rows(b: _Bench, dt, lanes: int, chosen: Dict[str, Any], notes: Dict[str, Any]) -> None:
    """rows_max, rows_max_dk, rows_max_big and rows_full of one dtype.  The tiled kernel
    as the plan would run it, with its tail (the table's thresholds at 1 row), not
    forced: a forced rows_max turns the tail off, and from memory a tail reads K and V
    a second time."""
    x, esz = int(dt == np.float64), dt.itemsize
    # from memory at d128, the table's rows_max_big_dk where set stands in for rows_max_big
    mem_wide = "rows_max_big_dk" if b.base["rows_max_big_dk"][x] > 0 else "rows_max_big"
    names = {"cache": "rows_max", "cache_wide": "rows_max_dk", "mem_wide": mem_wide}
    tiled = {f: _set(b.base[f], x, 1) for f in names.values()}
    times: Dict[str, Dict[int, Tuple[float, float]]] = {}
    for regime in names:
        heads, d = (32, 128) if regime == "mem_wide" else (8, 64 if regime == "cache" else 128)
        nk = b.mem_bytes // (2 * heads * d * esz) if regime == "mem_wide" else 1024
        k, v = _kv(b.rng, heads, nk, d, dt)
        times[regime] = {}
        for n in ROWS:
            call = b.call(b.q(heads, n, d, dt), k, v)
            t_rows, t_tiled = b.race([_forced(call, rows_max=max(ROWS)), _tuned(call, tiled, b.base)])
            times[regime][n] = (t_rows, t_tiled)
        b.say(f"  rows, {dt.name}, {regime}: tiled / row kernel at {ROWS[0]}-{ROWS[-1]} rows: "
              + " ".join(f"{t[1] / t[0]:.2f}" for t in times[regime].values()))
    built = {r: int(b.base[f][x]) for r, f in names.items()}
    full_dk = int(b.base["rows_full_dk"])   # (kept from the built-in table; these regimes are head-major)
    full_off = [r for r in names if 0 < full_dk <= (64 if r == "cache" else 128)]
    pick, full, c_new, c_base = _rows_choice(times, lanes, built, int(b.base["rows_full"][x]), full_off)
    notes[f"rows_{dt.name}"] = {"cost": c_new, "builtin_cost": c_base}
    if c_new < c_base * (1 - TIE / 4):   # many rows, each normalised: a smaller margin
        for r, f in names.items():
            chosen[f] = _set(chosen[f], x, pick[r])
        chosen["rows_full"] = _set(chosen["rows_full"], x, full)


def _measure_tail(b: _Bench, dt, lanes: int, chosen: Dict[str, Any]) -> None:
    """tail_max of one dtype: 32 + r rows, the last r by the row kernel or one more vector."""
    x = int(dt == np.float64)
    k, v = _kv(b.rng, 8, 1024, 64, dt)
    on_off = {}
    for r in range(1, lanes):
        call = b.call(b.q(8, 32 + r, 64, dt), k, v)
        on_off[r] = b.race([_tuned(call, {"tail_max": _set(b.base["tail_max"], x, lanes - 1)}, b.base),
                            _tuned(call, {"tail_max": _set(b.base["tail_max"], x, 0)}, b.base)])

    def cost(m: int) -> float:
        return sum((on if r <= m else off) / min(on, off) for r, (on, off) in on_off.items())
    m_best = min(range(lanes), key=cost)
    if cost(m_best) < cost(int(b.base["tail_max"][x])) * (1 - TIE / 4):
        chosen["tail_max"] = _set(chosen["tail_max"], x, m_best)
    b.say(f"  tail, {dt.name}: tail / whole vector at 1-{lanes - 1} rows: "
          + " ".join(f"{on / off:.2f}" for on, off in on_off.values()) + f" -> tail_max {chosen['tail_max'][x]}")


def _measure_fuse(b: _Bench, dtypes, chosen: Dict[str, Any]) -> None:
    """fuse: the tiled kernel's fused exp, B1 H8 N1024 d64 in each dtype."""
    cost = [0.0, 0.0]
    for dt in dtypes:
        call = b.call(*(b.q(8, 1024, 64, dt) for _ in range(3)))
        r = b.race([_forced(call, fuse=0), _forced(call, fuse=1)])
        cost = [cost[0] + r[0] / min(r), cost[1] + r[1] / min(r)]
    fuse, now = int(cost[1] < cost[0]), int(b.base["fuse"])
    if fuse != now and cost[fuse] < cost[now] * (1 - TIE):
        chosen["fuse"] = bool(fuse)
    b.say(f"  fuse: unfused / fused time {cost[0] / cost[1]:.3f} -> {bool(chosen['fuse'])}")


def _measure_tiles(b: _Bench, chosen: Dict[str, Any]) -> None:
    """The key tiles and the row kernel's prefetch, float32: bk_tiled (in cache),
    q_tile_bytes (the query blocks at d128 and d256, in cache) and q_tile_bytes_band (causal),
    bk_rows and bk_decode (in cache and from memory), then with K and V from memory
    bk_tiled_mem with tile_pf_l1 and the prefetch across passes (stream) and far (into L2)."""
    call = b.call(*(b.q(8, 2048, 64, np.float32) for _ in range(3)))
    chosen["bk_tiled"] = _pick_size(b, "bk_tiled", (32, 64, 128), [call])
    calls = [b.call(*(b.q(h, 1024, d, np.float32) for _ in range(3))) for h, d in ((8, 128), (4, 256))]
    chosen["q_tile_bytes"] = _pick_size(b, "q_tile_bytes", (32 << 10, 64 << 10, 128 << 10), calls)
    call = b.call(*(b.q(8, 2048, 128, np.float32) for _ in range(3)), causal=True)
    chosen["q_tile_bytes_band"] = _pick_size(b, "q_tile_bytes_band", (32 << 10, 64 << 10), [call])
    k, v = _kv(b.rng, 32, b.mem_bytes // (2 * 32 * 128 * 4), 128, np.float32)
    kc, vc = _kv(b.rng, 8, 1024, 128, np.float32)
    for field, rows, sizes in (("bk_decode", (1,), (128, 256, 512, 1024)),
                               ("bk_rows", (4, 8, 12), (64, 128, 256, 512, 1024))):
        calls = [b.call(b.q(kk.shape[1], n, 128, np.float32), kk, vv) for n in rows for kk, vv in ((k, v), (kc, vc))]
        chosen[field] = _pick_size(b, field, sizes, calls)
    # few rows from memory: 32 and 16 (the tiled kernel forced) rows, prefetched into L2 or L1
    calls = [b.call(b.q(32, n, 128, np.float32), k, v) for n in (32, 16)]
    pf_l1, chosen["bk_tiled_mem"] = _pick_combo(b, ("tile_pf_l1", "bk_tiled_mem"),
                                                [(p, n) for p in (0, 1) for n in (16, 32, 64)], calls,
                                                also={"rows_max_big": (1, 1)})
    chosen["tile_pf_l1"] = bool(pf_l1)
    # the group kernel's tiles: heads of a (B, n, H, d) cache from memory, GQA 32/8 one
    # token (four rows an item) and H32 two and four tokens (q: (1, n, H, d))
    kb, vb = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (k, v))     # (1, n_k, 32, 128)
    nk = kb.shape[1]
    kg, vg = (x.reshape(1, nk * 4, 8, 128) for x in (kb, vb))                   # 8 heads, 4 n_k
    group_calls = [b.call(b.q(1, 32, 128, np.float32), kg, vg, layout="blhd", enable_gqa=True)]
    group_calls += [b.call(b.q(n, 32, 128, np.float32), kb, vb, layout="blhd") for n in (2, 4)]
    chosen["group_chunks_rows"] = bool(_pick_size(b, "group_chunks_rows", (0, 1), group_calls))
    chosen["group_tile_bytes"], chosen["group_bk_max"] = _pick_combo(
        b, ("group_tile_bytes", "group_bk_max"), [(256 << 10, 64), (512 << 10, 128), (1 << 20, 256), (2 << 20, 256)],
        group_calls)
    chosen["group_touch"] = bool(_pick_size(b, "group_touch", (0, 1), group_calls))
    del kb, vb, kg, vg
    combos = [(s, f) for s in (1, 0) for f in (1, 0)]
    cost = dict.fromkeys(combos, 0.0)
    for n in (1, 4, 8):
        call = b.call(b.q(32, n, 128, np.float32), k, v)
        r = b.race([_forced(call, stream=s, far=f) for s, f in combos])
        for c, t in zip(combos, r):
            cost[c] += t / min(r)
    never = 2 ** 63 - 1
    far_bytes = int(b.base["kv_far_bytes"])
    now = (int(b.base["stream"]), int(far_bytes != never))
    best = min(combos, key=lambda c: cost[c])
    if best != now and cost[best] < cost[now] * (1 - TIE):
        chosen["stream"] = bool(best[0])
        chosen["kv_far_bytes"] = (far_bytes if far_bytes != never else 16 << 20) if best[1] else never
    b.say("  prefetch from memory (stream, far) time, relative: "
          + ", ".join(f"{c}: {cost[c] / 3:.3f}" for c in combos)
          + f" -> stream {bool(chosen['stream'])}, far {chosen['kv_far_bytes'] != never}")
    if chosen["kv_far_bytes"] != never:   # decoding's own: far, or near at any size
        call = b.call(b.q(32, 1, 128, np.float32), k, v)
        chosen["decode_far"] = bool(_pick_size(b, "decode_far", (0, 1), [call], also={
            "stream": chosen["stream"], "kv_far_bytes": chosen["kv_far_bytes"]}))


def _measure_backward(b: _Bench, chosen: Dict[str, Any]) -> None:
    """bwd_bq, bwd_bk: the backward's tiles, float32 B1 H4 N1024 at d64 and d128."""
    from . import attention_backward

    def call(d: int) -> Callable[[], Any]:
        q, k, v = (b.q(4, 1024, d, np.float32) for _ in range(3))
        out, lse = b.attention(q, k, v, return_lse=True, num_threads=b.threads)
        do = b.rng.standard_normal(out.shape).astype(np.float32)
        return lambda: attention_backward(do, q, k, v, out, lse, num_threads=b.threads)

    chosen["bwd_bq"], chosen["bwd_bk"] = _pick_combo(
        b, ("bwd_bq", "bwd_bk"), [(32, 64), (64, 128), (64, 256)], [call(64), call(128)])


def _measure_decode_pf(b: "_Bench", chosen: Dict[str, Any], dtypes: Sequence[np.dtype]) -> None:
    """decode_pf of each dtype: decoding (one row, d128) with and without its
    software prefetch of K and V, from memory (H32) and in cache (H8 Nk1024),
    with the tiles chosen before."""
    for dt in dtypes:
        x = int(dt == np.float64)
        k, v = _kv(b.rng, 32, b.mem_bytes // (2 * 32 * 128 * dt.itemsize), 128, dt)
        kc, vc = _kv(b.rng, 8, 1024, 128, dt)
        calls = [b.call(b.q(kk.shape[1], 1, 128, dt), kk, vv) for kk, vv in ((k, v), (kc, vc))]
        cost = [0.0, 0.0]
        for call in calls:
            r = b.race([_forced(call, decode_pf=0), _forced(call, decode_pf=1)])
            cost = [cost[0] + r[0] / min(r), cost[1] + r[1] / min(r)]
        del k, v
        on, now = int(cost[1] < cost[0]), int(b.base["decode_pf"][x])
        if on != now and cost[on] < cost[now] * (1 - TIE):
            chosen["decode_pf"] = _set(chosen["decode_pf"], x, on)
        b.say(f"  decoding's prefetch, {dt.name}: off / on time {cost[0] / cost[1]:.3f} "
              f"-> {bool(chosen['decode_pf'][x])}")


def tune(*, save: bool = True, num_threads: Optional[int] = None, rounds: int = 5,
         dtypes: Sequence[str] = ("float32", "float64"), log: Optional[Callable[[str], None]] = None
         ) -> Dict[str, Any]:
    """Measure the plan's main thresholds and tile sizes on this machine (about a
    20-30 s), use them from now on, and (save=True) keep them for the next import
    in the user's cache directory (tuning_path()).  Returns the tuning in use and
    what was measured: {"tuning": fields, "builtin": the built-in table,
    "changed": the fields that differ, "path": the file or None, "seconds": ...}.

    num_threads: the threads to measure with (default: the default team).  The
    built-in table stays in force for every field that did not measure faster
    by a margin (TIE); FASTATTN_TUNING=off ignores the saved file at import;
    fastattn.show_config() says which table is in use."""
    if not dtypes:
        raise ValueError("tune: dtypes must name float32, float64 or both")
    t_start = time.perf_counter()
    before, before_state = _core.isa_table(), dict(state)
    _core.reset_tuning()
    builtin = _core.builtin_tuning()
    base = {k: builtin[k] for k in _core.TUNING_FIELDS}
    lanes = _core.isa_table()["lanes"]
    threads = num_threads or _core.max_threads()
    b = _Bench(threads, rounds, base, max(128 << 20, 2 * int(builtin["kv_mem_bytes"])), log or (lambda s: None))
    chosen = dict(base)
    notes: Dict[str, Any] = {}
    try:
        _measure_tiles(b, chosen)
        b.base = dict(chosen)          # the thresholds below measured with these tiles
        _core.set_tuning(b.base)
        for name in dtypes:
            dt = np.dtype(name)
            _measure_rows(b, dt, lanes[int(dt == np.float64)], chosen, notes)
            _measure_tail(b, dt, lanes[int(dt == np.float64)], chosen)
        _measure_decode_pf(b, chosen, [np.dtype(n) for n in dtypes])
        _measure_fuse(b, [np.dtype(n) for n in dtypes], chosen)
        _measure_backward(b, chosen)
    except BaseException:              # (Ctrl-C too) the tuning in use before, as it was
        _core.set_tuning(before)
        state.clear()
        state.update(before_state)
        raise

    changed = {k: chosen[k] for k in _core.TUNING_FIELDS if _norm(chosen[k]) != _norm(base[k])}
    _core.set_tuning(dict(chosen, name="tuned"))
    state.update(source="tuned", path=None, note="save=False")
    if save:
        path = tuning_path()
        doc = {"fastattn": __version__, "cpu_key": cpu_key(), "cpu": _core.cpu_info(), "isa": _core.isa_name(),
               "threads": threads, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "tuning": {k: _norm(chosen[k]) for k in _core.TUNING_FIELDS}, "changed": sorted(changed),
               "measurements": notes}
        tmp = path + f".{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "w") as out:
                json.dump(doc, out, indent=1)
            os.replace(tmp, path)   # whole or not at all: a reader never sees half a file
            state.update(path=path, note=None)
        except OSError as e:
            state["note"] = f"{path} could not be written: {e}"
            warnings.warn(f"fastattn.tune: the tuning is in use but could not be saved ({e}); set "
                          f"{ENV_DIR} to a writable directory", RuntimeWarning, stacklevel=2)
    return {"tuning": _core.isa_table(), "builtin": builtin, "changed": changed, "path": state["path"],
            "seconds": time.perf_counter() - t_start}


def _set(pair, i: int, value: int) -> Tuple[int, int]:
    p = list(pair)
    p[i] = int(value)
    return (p[0], p[1])


def _norm(value):
    """A field as saved: tuples as lists, bools as ints."""
    if isinstance(value, tuple):
        return [int(v) for v in value]
    return int(value)


def _pick_combo(b: _Bench, fields: Tuple[str, ...], combos: List[Tuple[int, ...]],
                calls: List[Callable[[], Any]], also: Optional[Dict[str, Any]] = None) -> Tuple[int, ...]:
    """The values of `fields` among `combos` (and those in use) that measured fastest
    over `calls` (each call's time over its best, summed), if by TIE; `also`: fields
    in place for every combo, not chosen."""
    now = tuple(int(b.base[f]) for f in fields)
    combos = sorted(set(combos) | {now})
    fns = [_tuned(c, dict(also or {}, **dict(zip(fields, combo))), b.base) for combo in combos for c in calls]
    t = b.race(fns)
    n = len(calls)
    best_each = [min(t[i * n + j] for i in range(len(combos))) for j in range(n)]
    cost = {combo: sum(t[i * n + j] / best_each[j] for j in range(n)) / n for i, combo in enumerate(combos)}
    best = min(combos, key=lambda c: cost[c])
    pick = best if cost[best] < cost[now] * (1 - TIE) else now
    def name(c: Tuple[int, ...]) -> str:
        return str(c[0] if len(c) == 1 else c)
    b.say(f"  {', '.join(fields)}: " + ", ".join(f"{name(c)}: {cost[c] / cost[now]:.3f}" for c in combos)
          + f" -> {name(pick)}")
    return pick


def _pick_size(b: _Bench, field: str, sizes: Sequence[int], calls: List[Callable[[], Any]],
               also: Optional[Dict[str, Any]] = None) -> int:
    """_pick_combo of one field."""
    return _pick_combo(b, (field,), [(size,) for size in sizes], calls, also)[0]
