"""The tuning tables (src_c/dispatch.c): chosen by CPU, replaced by set_tuning and
by fastattn.tune()'s saved measurements (fastattn/_tune.py), read back at import
unless FASTATTN_TUNING=off, and named by show_config."""
import itertools
import json
import os

import ml_dtypes
import numpy as np
import pytest
from conftest import rand
from helpers import F32, F64, check, run_script

import fastattn
from fastattn import _core, _tune
from fastattn._attention import _plan


def test_cpu_info_and_the_table_in_use():
    c = _core.cpu_info()
    assert set(c) == {"vendor", "brand", "family", "model", "stepping", "l2_bytes", "l3_bytes"}
    if _core.isa_available("avx2"):            # x86: CPUID answered
        assert c["vendor"] and c["family"] > 0 and c["l2_bytes"] >= 0 and c["l3_bytes"] >= 0
    t = _core.isa_table()
    assert set(_core.TUNING_FIELDS) <= set(t) and t["isa"] == _core.isa_name()
    if _tune.state["source"] == "built-in":
        assert t == dict(_core.builtin_tuning(), isa=t["isa"], lanes=t["lanes"])


def test_a_default_table_sizes_follow_the_l3_up_to_32_mib(isa):
    """A CPU without a table of its own (on this path): kv_mem_bytes and kv_far_bytes
    are 1.5 and 0.5 times its L3, counted as at most 32 MiB (a larger L3 is a socket's,
    shared by many cores)."""
    l3, t = _core.cpu_info()["l3_bytes"], _core.isa_table()
    if t["name"] not in ("avx512", "avx2", "generic"):
        assert t["kv_mem_bytes"] > 0 and t["kv_far_bytes"] > 0   # a measured table: its own sizes
    elif l3 < 4 << 20:
        assert (t["kv_mem_bytes"], t["kv_far_bytes"]) == (48 << 20, 16 << 20)   # unknown: the default's
    else:
        l3 = min(l3, 32 << 20)
        assert (t["kv_mem_bytes"], t["kv_far_bytes"]) == (l3 // 2 * 3, l3 // 2)


def test_set_tuning_changes_the_plan_and_restores(rng, tuning):
    k, v = rand(rng, (2, 1000, 64)), rand(rng, (2, 1000, 64))
    q = rand(rng, (2, 5, 64))
    tuning(rows_max=(4, 4), rows_full=(0, 0))
    assert _plan(q, k, v)["kernel"] == "tiled"
    check(q, k, v)
    tuning(rows_max=(5, 5))
    assert _plan(q, k, v)["kernel"] == "rows"
    tuning(bk_tiled=32)
    assert _plan(rand(rng, (2, 100, 64)), k, v)["bk"] == 32
    _core.reset_tuning()
    assert _core.isa_table()["name"] == _core.builtin_tuning()["name"]


def test_tuning_sizes_and_switches_reach_the_plan(rng, tuning):
    """kv_mem_bytes moves the line of 'from memory', kv_far_bytes the far prefetch,
    stream the prefetch across passes, bk_tiled_mem the tiled kernel's key tiles for
    few rows from memory; results agree with the reference either way."""
    k, v = rand(rng, (4, 2000, 64)), rand(rng, (4, 2000, 64))   # 4 MB
    q1, q20 = rand(rng, (4, 1, 64)), rand(rng, (4, 20, 64))
    tuning(kv_mem_bytes=1 << 20, kv_far_bytes=1 << 20, decode_far=1, stream=1, bk_tiled_mem=16, rows_max_big=(8, 8),
           tile_pf_l1=0)   # (its own key tiles: test_tile_pf_l1_from_the_table)
    p = _plan(q1, k, v)
    assert p["from_memory"] and p["stream"] and p["far"]
    p = _plan(q20, k, v)
    assert p["kernel"] == "tiled" and p["bk"] == 16
    check(q1, k, v)
    check(q20, k, v, causal=True)
    tuning(stream=0, kv_far_bytes=2 ** 63 - 1, bk_tiled_mem=48)
    p = _plan(q1, k, v)
    assert p["from_memory"] and not p["stream"] and not p["far"]
    assert _plan(q20, k, v)["bk"] == 48
    check(q1, k, v)
    check(q20, k, v, causal=True)
    tuning(kv_mem_bytes=1 << 30)
    assert not _plan(q1, k, v)["from_memory"]


@pytest.mark.parametrize("dtype", [F32, F64])
def test_query_block_from_the_table(isa, rng, tuning, dtype):
    """q_tile_bytes: the tiled kernel's query rows a block, bq_tiled (here 128) halved (down to 32)
    while its transposed queries (dk rows of them) exceed that many bytes; results
    agree with the reference at every size."""
    esz = np.dtype(dtype).itemsize
    q, k, v = (rand(rng, (4, 300, 128), dtype) for _ in range(3))
    for q_tile, bq in ((128 * 128 * esz, 128), (128 * 128 * esz - 1, 64), (64 * 128 * esz, 64), (4096, 32)):
        tuning(q_tile_bytes=q_tile, bq_tiled=128)
        assert _plan(q, k, v)["bq"] == bq, (q_tile, bq)
        check(q, k, v, dtype)
        check(q, k, v, dtype, causal=True)
    assert _plan(rand(rng, (4, 300, 4), dtype), k[..., :4], v)["bq"] == 128   # 4 x 128 x 8 bytes: within 4096


@pytest.mark.parametrize("dtype", [F32, F64])
def test_long_query_blocks_without_a_mask(isa, rng, tuning, dtype):
    """bq_tiled: the tiled kernel's query rows a block on a call without a mask or a
    band (with one, at most 128), halved as q_tile_bytes says; blocks of 512 rows
    and a partial last one (1100 rows: 512, 512, 76) agree with the reference, with
    kv lengths and with a jump in the scores (the fused exp rescales), and so do
    masked and causal calls beside them; a value out of its range, or not a power
    of two, is refused."""
    esz = np.dtype(dtype).itemsize
    q, k, v = rand(rng, (4, 1100, 40), dtype), rand(rng, (4, 700, 40), dtype), rand(rng, (4, 700, 24), dtype)
    mask = rng.random((1100, 700)) < 0.9
    for bq_tiled, bq in ((512, 512), (256, 256), (32, 32), (128, 128)):
        tuning(bq_tiled=bq_tiled, q_tile_bytes=1 << 22)
        assert _plan(q, k, v, num_threads=2)["bq"] == bq, bq_tiled
        assert _plan(q, k, v, mask=mask, num_threads=2)["bq"] == min(bq, 128)
        assert _plan(q, k, v, mask=mask.astype(dtype), num_threads=2)["bq"] == min(bq, 128)
        check(q, k, v, dtype)
        check(q, k, v, dtype, mask=mask)
        check(q, k, v, dtype, mask=np.where(mask, rand(rng, mask.shape, dtype), -np.inf).astype(dtype))
        check(q, k, v, dtype, kv_lengths=np.array([700, 333, 1, 650]), q_lengths=np.array([1100, 901, 1100, 17]))
        jump = q.copy()
        jump[:, 600:] *= 30                          # far above the reference max of the first rows
        check(jump, k, v, dtype)
    tuning(bq_tiled=512, q_tile_bytes=256 * 40 * esz)   # halved once: 512 x 40 elements exceed it
    assert _plan(q, k, v, num_threads=2)["bq"] == 256
    tuning(bq_tiled=512, q_tile_bytes_band=1 << 22)     # a band: at most 128 rows, then halved as before
    assert _plan(q, k, v, causal=True, num_threads=2)["bq"] == 128
    assert _plan(q, k, v, window=(2000, 0), num_threads=2)["bq"] == 128
    check(q, k, v, dtype, causal=True)
    tuning(q_tile_bytes_band=64 * 40 * esz)
    assert _plan(q, k, v, causal=True, num_threads=2)["bq"] == 64
    for bad in (16, 48, 513):
        with pytest.raises(ValueError, match="bq_tiled is out of range"):
            _core.set_tuning(dict(_core.builtin_tuning(), bq_tiled=bad))


@pytest.mark.parametrize("dtype", [F32, F64])
def test_query_block_under_a_band(isa, rng, tuning, dtype):
    """q_tile_bytes_band takes q_tile_bytes' place under a causal band or a window
    (not a narrow one: 32 rows there); results agree with the reference."""
    esz = np.dtype(dtype).itemsize
    q, k, v = (rand(rng, (4, 300, 128), dtype) for _ in range(3))
    for q_tile, band_tile, bq, band_bq in ((128 * 128 * esz, 64 * 128 * esz, 128, 64),
                                           (64 * 128 * esz, 128 * 128 * esz, 64, 128)):
        tuning(q_tile_bytes=q_tile, q_tile_bytes_band=band_tile)
        assert _plan(q, k, v)["bq"] == bq
        for kw in (dict(causal=True), dict(window=(2000, 0)), dict(window=(-1, 10))):
            assert _plan(q, k, v, **kw)["bq"] == band_bq, kw
            check(q, k, v, dtype, **kw)
        assert _plan(q, k, v, window=(100, 0))["bq"] == 32
        check(q, k, v, dtype)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_decode_prefetch_from_the_table(rng, tuning, dtype):
    """decode_pf turns decoding's prefetch of float32 or float64 K and V on or off
    (the pair by dtype); 16-bit K and V prefetch whatever it says; results agree
    with the reference either way."""
    x = int(dtype == F64)
    q, k, v = rand(rng, (3, 1, 64), dtype), rand(rng, (3, 700, 64), dtype), rand(rng, (3, 700, 48), dtype)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    for on in (0, 1):
        tuning(decode_pf=(on, 1 - on) if x == 0 else (1 - on, on), bk_decode=128)   # 6 key tiles
        assert _plan(q, k, v)["decode_pf"] == bool(on) and _plan(q, k, v)["bk"] == 128
        assert _plan(q.astype(F32), k16, v16)["decode_pf"]
        check(q, k, v, num_threads=1)
        check(q, k, v, kv_lengths=np.array([0, 300, 700]), num_threads=2)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_long_row_kernel_tiles_agree_with_the_reference(isa, rng, tuning, dtype):
    """The row kernel's key tiles as long as a table may make them (bk_rows,
    bk_decode up to 4096) and as short (8): one row and several, a tail tile,
    causal, a bool mask, kv_lengths, a window, the key splits of decoding."""
    k, v = rand(rng, (2, 3, 2500, 40), dtype), rand(rng, (2, 3, 2500, 24), dtype)
    for bk_rows, bk_decode in ((4096, 4096), (512, 1024), (8, 8)):
        tuning(bk_rows=bk_rows, bk_decode=bk_decode)
        for nq in (1, 3):   # (3: the row kernel on every path)
            q = rand(rng, (2, 3, nq, 40), dtype)
            p = _plan(q, k, v)
            assert p["kernel"] == "rows" and p["bk"] == min(2500, bk_decode if nq == 1 else bk_rows)
            check(q, k, v)
            check(q, k, v, causal=True, num_threads=2)
            check(q, k, v, mask=rng.random((nq, 2500)) < 0.5)
            check(q, k, v, kv_lengths=np.array([0, 1, 2499]), window=(300, 0), causal=True, num_threads=2)
            check(q[:1, :1], k[:1, :1], v[:1, :1], num_threads=2)   # one item: keys split between threads


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_group_kernel_tiles_from_the_table(isa, rng, tuning, force, dtype):
    """The group kernel's key tiles for items of several rows come from the table
    (about group_tile_bytes of the group's K and V, 8 to group_bk_max keys): the
    shortest and the longest a table may give, against the reference, GQA folded
    and several tokens a head, causal and kv_lengths."""
    force.set(group=1)
    k, v = rand(rng, (2, 700, 4, 24), dtype), rand(rng, (2, 700, 4, 24), dtype)   # (B, n, H, d)
    for tile_bytes, bk_max, want_bk in ((1, 64, 8), (1 << 30, 1024, 700), (256 << 10, 64, 64)):
        tuning(group_tile_bytes=tile_bytes, group_bk_max=bk_max)
        q = rand(rng, (2, 3, 4, 24), dtype)
        p = _plan(q, k, v, layout="blhd")
        assert p["kernel"] == "group" and p["bk"] == want_bk
        force.reset_counts()
        check(q, k, v, layout="blhd", causal=True, num_threads=2)
        assert force.group_runs > 0
        check(q, k, v, layout="blhd", kv_lengths=np.array([[5], [699]]), num_threads=2)
        qg = rand(rng, (2, 2, 8, 24), dtype)    # 8 query heads on 4: two rows an item, folded
        check(qg, k, v, layout="blhd", enable_gqa=True, causal=True, num_threads=2)


def test_group_touch_from_the_table(rng, tuning, force):
    """group_touch (the group kernel reads its next tile ahead by loads) comes from
    the table unless forced, and the plan says which; the same results either way."""
    k, v = rand(rng, (1, 300, 4, 16)), rand(rng, (1, 300, 4, 16))
    q = rand(rng, (1, 2, 4, 16))
    force.set(group=1)
    outs = []
    for on in (0, 1):
        tuning(group_touch=on)
        assert _core.isa_table()["group_touch"] is bool(on)
        assert _plan(q, k, v, layout="blhd")["group_touch"] is bool(on)
        force.set(group_touch=1 - on)
        assert _plan(q, k, v, layout="blhd")["group_touch"] is bool(1 - on)
        force.set(group_touch=-1)
        outs.append(check(q, k, v, layout="blhd", causal=True)[0])
    np.testing.assert_array_equal(outs[0], outs[1])


def test_group_chunks_rows_from_the_table(rng, tuning, force):
    """group_chunks_rows: the group kernel's items of several rows (here GQA's two
    query heads a K and V head, folded) take chunks of keys where the table says
    so, and key tiles where not; the plan says which; both agree with the reference."""
    k, v = rand(rng, (1, 300, 4, 16)), rand(rng, (1, 300, 4, 16))
    q = rand(rng, (1, 1, 8, 16))
    force.set(group=1)
    for on in (0, 1):
        tuning(group_chunks_rows=on)
        assert _core.isa_table()["group_chunks_rows"] is bool(on)
        assert _plan(q, k, v, layout="blhd", enable_gqa=True)["chunks_rows"] is bool(on)
        force.reset_counts()
        check(q, k, v, layout="blhd", enable_gqa=True, num_threads=2)
        assert force.group_runs > 0
        assert force.chunk_rows == (8 * force.group_runs if on else 0)   # each run: 4 items of 2 rows


@pytest.mark.parametrize("dtype", [F32, F64])
def test_group_rows_from_the_table(isa, rng, tuning, force, dtype):
    """group_rows: the query rows of a (B, n, H, d) cache from memory take the
    group kernel up to that many, past rows_max_big (0: rows_max_big decides);
    not K and V in cache, head-major ones, nor more rows than it says.  Every
    result against the reference, and the group kernel's bit for bit as forcing
    rows_max gives it."""
    tuning(rows_max=(2, 2), rows_max_big=(2, 2), rows_max_dk=(2, 2), rows_full=(0, 0), kv_mem_bytes=1 << 10)
    k, v = rand(rng, (1, 300, 4, 16), dtype), rand(rng, (1, 300, 4, 24), dtype)
    for nq in (3, 5, 8):
        q = rand(rng, (1, nq, 4, 16), dtype)
        for limit, causal in ((0, False), (8, False), (8, True), (nq - 1, False), (nq, True)):
            tuning(group_rows=(limit, limit))
            assert _core.isa_table()["group_rows"] == (limit, limit)
            p = _plan(q, k, v, layout="blhd", causal=causal)
            takes = limit >= nq
            assert p["kernel"] == ("group" if takes else "tiled"), (nq, limit)
            force.reset_counts()
            got = check(q, k, v, layout="blhd", causal=causal, num_threads=[1, 2])[0]
            assert (force.group_runs > 0) is takes
            if takes:   # the same computation as the row kernel forced over the group
                force.set(rows_max=nq)
                np.testing.assert_array_equal(fastattn.attention(q, k, v, layout="blhd", causal=causal), got)
                force.set(rows_max=0)
        tuning(group_rows=(8, 8))
        hm = [np.ascontiguousarray(a.swapaxes(1, 2)) for a in (q, k, v)]   # head-major: not the group's
        assert _plan(*hm, causal=False)["kernel"] == "tiled"
        tuning(kv_mem_bytes=1 << 30)   # in cache
        assert _plan(q, k, v, layout="blhd")["kernel"] == "tiled"
        tuning(kv_mem_bytes=1 << 10)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_rows_max_big_dk_from_the_table(isa, rng, tuning, force, dtype):
    """rows_max_big_dk: with K and V from memory and dk >= 128, where set (> 0), the
    row kernel takes up to that many query rows in place of rows_max_big's (more or
    fewer); below dk 128, in cache, and where it is 0, rows_max_big and the others
    decide.  Each result against the reference, and bit for bit the forced kernel's."""
    tuning(rows_max=(2, 2), rows_max_big=(2, 2), rows_max_dk=(2, 2), rows_full=(0, 0), kv_mem_bytes=1 << 10,
           pipe_rows=(6, 6))
    for d, nk in ((128, 300), (64, 300), (160, 130)):
        k, v = rand(rng, (2, nk, d), dtype), rand(rng, (2, nk, 40), dtype)
        for nq in (2, 3, 6, 7):
            q = rand(rng, (2, nq, d), dtype)
            for limit, mem in ((0, True), (6, True), (6, False), (1, True)):
                tuning(rows_max_big_dk=(limit, limit), kv_mem_bytes=(1 << 10) if mem else (1 << 40))
                assert _core.isa_table()["rows_max_big_dk"] == (limit, limit)
                most = limit if limit > 0 and mem and d >= 128 else 2
                want = "rows" if nq <= most else "tiled"
                assert _plan(q, k, v)["kernel"] == want, (d, nq, limit, mem)
                got = check(q, k, v, num_threads=[1, 2])[0]
                force.set(rows_max=nq if want == "rows" else 1)   # the same kernel, forced
                np.testing.assert_array_equal(fastattn.attention(q, k, v), got)
                force.set(rows_max=0)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_pipe_rows_from_the_table(isa, rng, tuning, force, dtype):
    """pipe_rows: with K and V from memory, up to that many query rows of the
    row kernel take its pipelined loop (1: decoding only); in cache decoding only;
    the forcing overrides both.  The results against the reference; the loop
    chosen told apart by its rounding (bit for bit as forcing pipe_rows)."""
    tuning(rows_max=(8, 8), rows_max_big=(8, 8), rows_max_dk=(8, 8), rows_full=(0, 0), kv_mem_bytes=1 << 10,
           bk_rows=64)
    k, v = rand(rng, (2, 500, 40), dtype), rand(rng, (2, 500, 24), dtype)
    for nq in (2, 5, 8):
        q = rand(rng, (2, nq, 40), dtype)
        force.set(pipe_rows=1)
        tile_loop = fastattn.attention(q, k, v)
        force.set(pipe_rows=nq)
        pipelined = fastattn.attention(q, k, v)
        force.set(pipe_rows=0)
        assert not np.array_equal(tile_loop, pipelined)
        for limit in (1, nq - 1, nq, 24):
            tuning(pipe_rows=(limit, limit), kv_mem_bytes=1 << 10)
            assert _core.isa_table()["pipe_rows"] == (limit, limit)
            assert _plan(q, k, v)["pipe_rows"] == limit
            got = check(q, k, v, num_threads=[1, 2])[0]
            np.testing.assert_array_equal(got, pipelined if limit >= nq else tile_loop)
            tuning(kv_mem_bytes=1 << 30)   # in cache: decoding only
            assert _plan(q, k, v)["pipe_rows"] == 1
            np.testing.assert_array_equal(fastattn.attention(q, k, v), tile_loop)
    tuning(pipe_rows=(24, 24), kv_mem_bytes=1 << 10)
    q = rand(rng, (2, 40, 40), dtype)   # the tiled kernel: its tail rows keep the tile-by-tile loop
    assert _plan(q, k, v)["kernel"] == "tiled" and _plan(q, k, v)["pipe_rows"] == 1
    force.set(pipe_rows=1 << 40)   # a forcing: at most the row kernel's cap
    assert _plan(q, k, v)["pipe_rows"] == 24


@pytest.mark.parametrize("dtype", [F32, F64])
def test_pipe_pf_l2_from_the_table(isa, rng, tuning, dtype):
    """pipe_pf_l2: the pipelined loop of several rows prefetches K and V into L2,
    further ahead, rather than into L1.  Each setting in the plan as the table
    has it; the results against the reference, with rows that abut and rows that
    do not (the prefetch's tail line), a tail of keys past the last 4, prefetches
    that reach past a tile's end (up to the last key the rows see), a cache
    shorter than one tile, and bit for bit the same either way (a prefetch
    changes no value); with float32 q also float16 and bfloat16 K and V, whose
    rows are half as long."""
    tuning(rows_max=(8, 8), rows_max_big=(8, 8), rows_max_dk=(8, 8), rows_full=(0, 0), kv_mem_bytes=1 << 10,
           bk_rows=64, pipe_rows=(8, 8), rows_max_kv=8)
    halves = (None, np.float16, ml_dtypes.bfloat16) if dtype == F32 else (None,)
    for (nk, strided), half in itertools.product(((501, False), (130, True), (7, False)), halves):
        k, v = rand(rng, (2, nk, 128), dtype), rand(rng, (2, nk, 40), dtype)
        if strided:
            k, v = rand(rng, (2, nk, 136), dtype)[..., 3:131], rand(rng, (2, nk, 48), dtype)[..., 1:41]
        if half is not None:
            k, v = k.astype(half), v.astype(half)
        for nq in (2, 5, 8):
            q = rand(rng, (2, nq, 128), dtype)
            got = {}
            for on in (1, 0):
                tuning(pipe_pf_l2=on)
                assert _core.isa_table()["pipe_pf_l2"] is bool(on)
                plan = _plan(q, k, v)
                assert plan["pipe_pf_l2"] is bool(on) and plan["kernel"] == "rows" and plan["pipe_rows"] == 8
                got[on] = check(q, k, v, dtype, num_threads=[1, 2])[0]
            np.testing.assert_array_equal(got[1], got[0])


@pytest.mark.parametrize("half", [False, True])
def test_rows_full_dk_from_the_table(rng, tuning, rows_max, half):
    """rows_full_dk: where set, rows_full's rows keep the row kernel from that dk on,
    and for 16-bit K and V from memory at any dk, where K's and V's rows are
    contiguous (not a (B, n, H, d) cache); 0: rows_full everywhere.  Each result bit for
    bit that of the kernel the plan names, forced, and against the reference."""
    lanes = _core.isa_table()["lanes"][0]
    full = max(lanes - 2, 2)
    kv = (lambda a: a.astype(np.float16)) if half else (lambda a: a)
    cases = []   # (q, k, v, layout, from memory, dk)
    for d, nk in ((64, 300), (128, 300)):
        k, v = rand(rng, (2, nk, d)), rand(rng, (2, nk, 32))
        cases.append((rand(rng, (2, full, d)), kv(k), kv(v), "bhld", False, d))
        k4, v4 = rand(rng, (1, nk, 2, d)), rand(rng, (1, nk, 2, 32))
        cases.append((rand(rng, (1, full, 2, d)), kv(k4), kv(v4), "blhd", False, d))
    for c in list(cases):   # the same from memory (the line moved below their bytes)
        cases.append(c[:4] + (True, c[5]))
    for on in (0, 128):
        for q, k, v, layout, mem, d in cases:
            tuning(rows_max=(lanes, lanes), rows_max_big=(lanes, lanes), rows_max_dk=(lanes, lanes),
                   rows_max_big_dk=(0, 0), rows_full=(full, 0), rows_full_dk=on,
                   kv_mem_bytes=(1 << 10) if mem else (1 << 40))
            assert _core.isa_table()["rows_full_dk"] == on
            p = _plan(q, k, v, layout=layout)
            keeps_rows = on and layout == "bhld" and (d >= on or (half and mem))
            skips_full = (mem and d > 128) or (half and d >= 128)   # the plan's own exceptions
            want = "rows" if keeps_rows or skips_full else "tiled"
            assert p["kernel"] in ((want,) if want == "tiled" else ("rows", "group")), (on, layout, mem, d, p["kernel"])
            out = check(q, k, v, layout=layout)[0]
            rows_max(lanes if want != "tiled" else 1)
            np.testing.assert_array_equal(out, fastattn.attention(q, k, v, layout=layout))
            rows_max(0)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_rows_max_kv_from_the_table(isa, rng, tuning, dtype):
    """rows_max_kv: where set, 16-bit K and V take the row kernel up to that many query
    rows in every regime (in cache, dk >= 128, from memory), in place of rows_max,
    rows_max_dk and rows_max_big, which float32 K and V keep; 0: the float32 limits.
    Results against the reference either way."""
    for limit in (0, 10):
        for d, mem in ((64, False), (128, False), (64, True)):
            tuning(rows_max=(4, 4), rows_max_big=(4, 4), rows_max_dk=(4, 4), rows_full=(0, 0), tail_max=(0, 0),
                   rows_max_kv=limit, kv_mem_bytes=(1 << 10) if mem else (1 << 40))
            for nq in (4, 5, 10, 11):
                q, k, v = rand(rng, (2, nq, d)), rand(rng, (2, 150, d)), rand(rng, (2, 150, 24))
                k16, v16 = k.astype(dtype), v.astype(dtype)
                assert _plan(q, k, v)["kernel"] == ("rows" if nq <= 4 else "tiled")
                assert _plan(q, k16, v16)["kernel"] == ("rows" if nq <= (limit or 4) else "tiled"), (limit, d, mem, nq)
                check(q, k16, v16, F32, num_threads=(1, 2), causal=True)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_tail_mem_from_the_table(isa, rng, tuning, dtype):
    """tail_mem 0: no tail after a single block of whole vectors with K and V from memory
    (the block takes the row, padded); a tail in cache, after two blocks (65 rows: 32-row
    blocks for two heads on two threads), or with tail_mem 1.  Results against the
    reference either way."""
    lanes = _core.isa_table()["lanes"][int(dtype == F64)]
    for on in (0, 1):
        for mem in (False, True):
            tuning(rows_max=(1, 1), rows_max_big=(1, 1), rows_max_dk=(1, 1), rows_full=(0, 0),
                   tail_max=(lanes - 1, lanes - 1), tail_mem=on, kv_mem_bytes=(1 << 10) if mem else (1 << 40))
            assert _core.isa_table()["tail_mem"] == bool(on)
            for nq in (17, 65):
                q, k, v = rand(rng, (2, nq, 40), dtype), rand(rng, (2, 300, 40), dtype), rand(rng, (2, 300, 24), dtype)
                p = _plan(q, k, v, num_threads=2)
                want = bool(on or not mem or nq == 65)
                assert p["kernel"] == "tiled" and p["tail"] == want, (on, mem, nq, p["bq"], p["n_qb"], p["tail"])
                check(q, k, v, dtype, num_threads=(1, 2))


@pytest.mark.parametrize("dtype", [F32, F64])
def test_tile_pf_l1_from_the_table(isa, rng, tuning, dtype):
    """tile_pf_l1: the tiled kernel's items of at most 32 rows with K and V from memory
    prefetch into L1, with key tiles of at most bk_tiled_mem rows of 512 bytes (d_k 200:
    10 float32 keys, and at least 8, not 4, float64 ones), of float32 rows up to 256
    bytes 1.5 bk_tiled_mem; not in cache, not over 32 rows,
    not for K and V rows at the heads' stride (blhd) nor for 16-bit K and V.  Results
    against the reference either way, with tiles' tails and the last block's."""
    esz = 4 if dtype == F32 else 8
    for on in (0, 1):
        for mem in (False, True):
            tuning(rows_max=(1, 1), rows_max_big=(1, 1), rows_max_dk=(1, 1), rows_full=(0, 0), bk_tiled_mem=16,
                   q_tile_bytes=1 << 20, tile_pf_l1=on, kv_mem_bytes=(1 << 10) if mem else (1 << 40))
            assert _core.isa_table()["tile_pf_l1"] == bool(on)
            for h, nq, layout in ((2, 17, "bhld"), (2, 30, "blhd"), (16, 65, "bhld")):
                q, k = rand(rng, (h, nq, 200), dtype), rand(rng, (h, 301, 200), dtype)
                v = rand(rng, (h, 301, 24), dtype)
                if layout == "blhd":
                    q, k, v = (np.ascontiguousarray(x.swapaxes(0, 1)) for x in (q, k, v))
                p = _plan(q, k, v, num_threads=2, layout=layout)
                few = p["bq"] <= 32
                assert few == (nq <= 32), (nq, p["bq"])
                want = bool(on and mem and few and layout == "bhld")
                assert p["kernel"] == "tiled" and p["pf_l1"] == want, (on, mem, nq, layout, p["bq"])
                assert p["bk"] == (max(8, 16 * 512 // (200 * esz)) if want else 16 if mem and few else 64)
                check(q, k, v, dtype, num_threads=(1, 2), layout=layout)
                check(q, k, v, dtype, num_threads=2, layout=layout, mask=rand(rng, (nq, 301), dtype))   # tile_pf's m
                if dtype == F32 and layout == "bhld":
                    k16, v16 = k.astype(np.float16), v.astype(np.float16)
                    assert not _plan(q, k16, v16, num_threads=2)["pf_l1"]
                    check(q, k16, v16, F32, num_threads=2)
            if on and mem:   # rows of 256 bytes or fewer: float32 takes 24 keys a tile, float64 16
                for dk in (32, 64, 96, 128):
                    q, k = rand(rng, (2, 16, dk), dtype), rand(rng, (2, 301, dk), dtype)
                    v = rand(rng, (2, 301, 24), dtype)
                    fit = 16 * 512 // (dk * esz)
                    want = 24 if fit >= 32 and esz == 4 else min(fit, 16)
                    p = _plan(q, k, v, num_threads=2)
                    assert p["pf_l1"] and p["bk"] == want, (dk, p["bk"])
                    check(q, k, v, dtype, num_threads=(1, 2))


@pytest.mark.parametrize("dtype", [F32, F64])
def test_decode_far_from_the_table(isa, rng, tuning, dtype):
    """decode_far 0: decoding (one row, the row kernel) prefetches near, into L1, even
    beyond kv_far_bytes; two rows and 16-bit K and V keep the far prefetch.  Results
    against the reference either way (a key tile's tail and a padded cache)."""
    for on in (0, 1):
        for far_bytes in (1 << 10, 1 << 40):
            tuning(kv_far_bytes=far_bytes, decode_far=on, decode_pf=(1, 1))
            assert _core.isa_table()["decode_far"] == bool(on)
            for nq in (1, 2):
                q, k, v = rand(rng, (3, nq, 64), dtype), rand(rng, (3, 700, 64), dtype), rand(rng, (3, 700, 40), dtype)
                p = _plan(q, k, v, num_threads=2)
                assert p["kernel"] == "rows" and p["far"] == (far_bytes == 1 << 10 and (on or nq > 1)), (on, nq)
                check(q, k, v, dtype, num_threads=(1, 2), kv_lengths=np.array([700, 333, 1]))
                if dtype == F32:
                    k16, v16 = k.astype(np.float16), v.astype(np.float16)
                    assert _plan(q, k16, v16, num_threads=2)["far"] == (far_bytes == 1 << 10)
                    check(q, k16, v16, F32, num_threads=2)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_decode_inorder_from_the_table(isa, rng, tuning, dtype):
    """decode_inorder: decoding with the far prefetch (beyond kv_far_bytes) reads each
    of its four K and V rows whole, in address order (rows.h, decode_step); never
    near, nor 16-bit K and V.  Results against the reference either way: several key
    tiles with a tail past fours, dv in whole register blocks of 8 vectors with and
    without a rest of vectors and of scalars, dv of 4, 8 and 16 whole vectors (the
    rolled loop, decode_step_rolled) on each ISA, dk with a rest of scalars, a bool
    mask, a padded cache."""
    for on in (0, 1):
        for far_bytes in (1 << 10, 1 << 40):
            tuning(kv_far_bytes=far_bytes, decode_far=1, decode_pf=(1, 1), decode_inorder=on, bk_decode=64)
            assert _core.isa_table()["decode_inorder"] == bool(on)
            for d, dv in ((128, 128), (72, 40), (64, 264), (72, 64), (40, 32), (128, 256), (24, 16), (12, 8)):
                q, k, v = rand(rng, (3, 1, d), dtype), rand(rng, (3, 301, d), dtype), rand(rng, (3, 301, dv), dtype)
                p = _plan(q, k, v, num_threads=2)
                assert p["kernel"] == "rows" and p["inorder"] == (on and far_bytes == 1 << 10), (on, far_bytes)
                check(q, k, v, dtype, num_threads=(1, 2), kv_lengths=np.array([301, 150, 1]))
                check(q, k, v, dtype, num_threads=1, mask=rng.random((3, 1, 301)) < 0.8)
                if dtype == F32:   # 16-bit K and V keep the old order
                    k16, v16 = k.astype(np.float16), v.astype(np.float16)
                    assert not _plan(q, k16, v16, num_threads=2)["inorder"]
                    check(q, k16, v16, F32, num_threads=2)


@pytest.mark.parametrize("fields, word", [
    ({"rows_max": (0, 4)}, "out of range"), ({"rows_max": (25, 4)}, "out of range"),
    ({"tail_max": (-1, 0)}, "out of range"), ({"rows_full": (17, 0)}, "out of range"),
    ({"rows_full_dk": -1}, "out of range"), ({"rows_max_kv": 25}, "out of range"), ({"tail_mem": 2}, "out of range"),
    ({"tile_pf_l1": 2}, "out of range"), ({"decode_far": -1}, "out of range"),
    ({"decode_inorder": 2}, "out of range"),
    ({"bk_tiled": 4}, "out of range"), ({"bk_rows": 5000}, "out of range"),
    ({"bk_decode": 0}, "out of range"), ({"group_bk_max": 4}, "out of range"),
    ({"group_tile_bytes": 0}, "out of range"), ({"group_touch": 2}, "out of range"),
    ({"group_chunks_rows": -1}, "out of range"),
    ({"pipe_pf_l2": 2}, "pipe_pf_l2 is out of range"), ({"group_rows": (9, 0)}, "group_rows is out of range"),
    ({"group_rows": (0, -1)}, "group_rows is out of range"),
    ({"pipe_rows": (0, 8)}, "pipe_rows is out of range"), ({"pipe_rows": (8, 25)}, "pipe_rows is out of range"),
    ({"rows_max_big_dk": (-1, 0)}, "rows_max_big_dk is out of range"),
    ({"rows_max_big_dk": (0, 25)}, "rows_max_big_dk is out of range"),
    ({"bk_tiled_mem": 1024}, "out of range"), ({"fuse": 2}, "out of range"),
    ({"kv_mem_bytes": -1}, "out of range"), ({"rows_max": (4,)}, "pair"), ({"rows_maxx": (4, 4)}, "rows_maxx"),
    ({"bk_rows": 12.5}, "bk_rows must be an integer"), ({"bk_rows": 2 ** 40}, "bk_rows is out of range"),
    ({"kv_mem_bytes": float("inf")}, "kv_mem_bytes must be an integer"), ({"rows_max": (4, "8")}, "integer"),
    ({"kv_far_bytes": 2 ** 63}, "kv_far_bytes is out of range"), ({"tail_max": (0, 99)}, "tail_max is out of range"),
    ({"decode_pf": (2, 0)}, "decode_pf is out of range"), ({"decode_pf": (1, -1)}, "decode_pf is out of range"),
    ({"bwd_bq": 4}, "out of range"), ({"bwd_bk": 2048}, "out of range"),
    ({"q_tile_bytes": 1024}, "out of range"), ({"q_tile_bytes": 1 << 23}, "out of range"),
    ({"bq_tiled": 16}, "out of range"), ({"bq_tiled": 1024}, "out of range"), ({"bq_tiled": 96}, "out of range"),
    ({"q_tile_bytes_band": 1024}, "out of range"), ({"q_tile_bytes_band": 1 << 23}, "out of range"),
])
def test_set_tuning_rejects_bad_fields(fields, word):
    before = _core.isa_table()
    with pytest.raises(ValueError, match=word):
        _core.set_tuning(fields)
    assert _core.isa_table() == before


def test_rows_choice_takes_the_faster_kernel_per_regime():
    """fastattn._tune's choice of rows_max and rows_full from measured times."""
    rows = dict.fromkeys(_tune.ROWS)
    # the row kernel faster up to 9 rows in cache, 20 from memory; the tiled kernel in between
    times = {"cache": {n: (1.0, 2.0 if n <= 9 else 0.5) for n in rows},
             "mem_wide": {n: (1.0, 2.0 if n <= 20 else 0.5) for n in rows}}
    pick, full, cost, base = _tune._rows_choice(times, 16, {"cache": 12, "mem_wide": 24}, 14)
    assert pick == {"cache": 9, "mem_wide": 20} and full == 0 and cost == len(rows) * 2 < base
    # the tiled kernel faster at 13-16 rows (one vector) only: rows_full 13
    times = {"cache": {n: (1.0, 0.5 if 13 <= n <= 16 else 2.0) for n in rows}}
    pick, full, cost, base = _tune._rows_choice(times, 16, {"cache": 12}, 0)
    assert pick == {"cache": 24} and full == 13 and cost == len(rows)
    # ... and in a regime where rows_full does not apply (rows_full_dk) as well: there
    # the row kernel keeps 13-16 rows (twice the time of the tiled kernel at 4 rows, less
    # than giving it 13-24), and rows_full comes from the other regime's times
    times = {"cache": {n: (1.0, 0.5 if 13 <= n <= 16 else 2.0) for n in rows},
             "mem_wide": {n: (1.0, 0.5 if 13 <= n <= 16 else 2.0) for n in rows}}
    pick, full, cost, base = _tune._rows_choice(times, 16, {"cache": 12, "mem_wide": 24}, 14, ["mem_wide"])
    assert pick == {"cache": 24, "mem_wide": 24} and full == 13
    assert cost == 2 * len(rows) + 4 and base == len(rows) + 8 + (len(rows) + 4)


def _saved(tmp_path, tuning, **extra):
    """A tuning file for this CPU, SIMD path and version under tmp_path; the
    environment that makes a fresh fastattn read it."""
    doc = dict({"fastattn": fastattn.__version__, "cpu_key": _tune.cpu_key(), "tuning": tuning}, **extra)
    name = os.path.basename(_tune.tuning_path())
    (tmp_path / name).write_text(json.dumps(doc))
    return {"FASTATTN_CACHE_DIR": str(tmp_path), "FASTATTN_TUNING": ""}


SHOW = """
    import json, warnings
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as w:
        import fastattn
    from fastattn import _core
    fastattn.show_config()
    print(json.dumps({"table": _core.isa_table(), "warnings": [str(x.message) for x in w]}))
"""


def test_a_saved_tuning_is_read_at_import(tmp_path):
    env = _saved(tmp_path, {"rows_max": [3, 2], "tail_max": [1, 1], "stream": 0})
    r = run_script(tmp_path, SHOW, env=env)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["table"]["name"] == "tuned" and got["table"]["rows_max"] == [3, 2]
    assert got["table"]["tail_max"] == [1, 1] and got["table"]["stream"] is False and not got["warnings"]
    assert "tuning:         tuned on this machine (" + str(tmp_path) in r.stdout
    r = run_script(tmp_path, SHOW, env=dict(env, FASTATTN_TUNING="off"))
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["table"]["name"] != "tuned" and "FASTATTN_TUNING=off" in r.stdout


@pytest.mark.parametrize("bad, why", [
    ("{not json", "Expecting"), ({"rows_max": [0, 2]}, "out of range"), ({"rows_max": 3}, "pair"),
    ({"kv_mem_bytes": float("inf")}, "integer"), ({"bk_rows": 2 ** 40}, "out of range"), ("[]", "no attribute"),
    ({"speed": 1}, "speed"), ("other cpu", "another CPU"), ("no tuning", "tuning"),
])
def test_a_tuning_file_that_cannot_be_used_warns(tmp_path, bad, why):
    """A broken, foreign or out-of-range file: a RuntimeWarning naming the file and
    why, and the built-in table."""
    if bad in ("{not json", "[]"):
        env = _saved(tmp_path, {})
        next(tmp_path.glob("tuning-*.json")).write_text(bad)
    elif bad == "other cpu":
        env = _saved(tmp_path, {"rows_max": [3, 3]}, cpu_key="GenuineIntel-6-85-7-avx512")
    elif bad == "no tuning":
        env = _saved(tmp_path, {})
        next(tmp_path.glob("tuning-*.json")).write_text(json.dumps({"fastattn": fastattn.__version__,
                                                                     "cpu_key": _tune.cpu_key()}))
    else:
        env = _saved(tmp_path, bad)
    r = run_script(tmp_path, SHOW, env=env)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["table"]["name"] != "tuned" and len(got["warnings"]) == 1
    assert "tuning-" in got["warnings"][0] and why in got["warnings"][0]
    assert "not used" in r.stdout


def test_tune_measures_saves_and_the_next_import_reads_it(tmp_path):
    """fastattn-bench --tune --quick in a fresh process (one round, float32 only,
    the same code path as the full tuning): a file that the next import puts in
    place, field for field."""
    env = {"FASTATTN_CACHE_DIR": str(tmp_path), "FASTATTN_TUNING": ""}
    r = run_script(tmp_path, """
        import sys
        from fastattn.bench import main
        sys.exit(main(["--tune", "--quick", "--json"]))
    """, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "rows, float32, cache: tiled / row kernel at 2-24 rows:" in r.stderr
    assert out["path"] == str(tmp_path / os.path.basename(_tune.tuning_path()))
    saved = json.loads(open(out["path"]).read())
    assert saved["cpu_key"] == _tune.cpu_key() and saved["fastattn"] == fastattn.__version__
    assert sorted(saved["changed"]) == sorted(out["changed"])
    r = run_script(tmp_path, SHOW, env=env)
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["table"]["name"] == "tuned" and not got["warnings"]
    for field in _core.TUNING_FIELDS:
        want = saved["tuning"][field]
        assert (list(got["table"][field]) if isinstance(want, list) else int(got["table"][field])) == want, field


@pytest.fixture
def quick_tune(monkeypatch, tmp_path):
    """fastattn.tune without its measurements (each replaced by `measure`, which
    may change the choice or raise), its file under tmp_path; the tuning and
    _tune.state as they were, after."""
    before, state = _core.isa_table(), dict(_tune.state)
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path))
    calls = {}

    def use(measure=lambda chosen: None):
        calls["measure"] = measure
    monkeypatch.setattr(_tune, "_measure_tiles", lambda b, chosen: calls["measure"](chosen))
    for name in ("_measure_rows", "_measure_tail", "_measure_decode_pf", "_measure_fuse", "_measure_backward"):
        monkeypatch.setattr(_tune, name, lambda *a: None)
    use()
    yield use
    _core.set_tuning(before)
    _tune.state.clear()
    _tune.state.update(state)


def test_tune_interrupted_leaves_the_tuning_as_it_was(quick_tune, tuning):
    tuning(rows_max=(5, 5), name="before")
    before, state = _core.isa_table(), dict(_tune.state)

    def interrupted(chosen):
        raise KeyboardInterrupt
    quick_tune(interrupted)
    with pytest.raises(KeyboardInterrupt):
        fastattn.tune()
    assert _core.isa_table() == before and _tune.state == state
    with pytest.raises(ValueError, match="dtypes"):
        fastattn.tune(dtypes=())


def test_tune_unsaved_and_unwritable(quick_tune, tmp_path, monkeypatch):
    """save=False, or a cache directory that cannot be made: the tuning in use in
    this process, no file, and show_config says so (a warning for the second)."""
    quick_tune(lambda chosen: chosen.update(bk_rows=96))
    r = fastattn.tune(save=False)
    assert r["path"] is None and r["changed"] == {"bk_rows": 96} and _core.isa_table()["bk_rows"] == 96
    assert "not saved" in _tune.describe() and not list(tmp_path.glob("tuning-*"))
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path / "file" / "below"))
    with pytest.warns(RuntimeWarning, match="could not be saved"):
        r = fastattn.tune()
    assert r["path"] is None and _core.isa_table()["name"] == "tuned" and "could not be written" in _tune.describe()
