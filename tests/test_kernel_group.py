"""The group kernel: decoding from a (B, n, H, d) cache with the heads of a batch
entry taken together, key tile by key tile (forced on, and by default from
memory); counted by force.group_runs."""

import numpy as np
import pytest
from conftest import assert_close, rand, reference64
from helpers import F32, F64, check, heads_last, team_check

import fastattn
from fastattn import _core
from fastattn._attention import _plan


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("B,nk", [(1, 2), (2, 7), (1, 150), (1, 1030), (3, 1100)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_group_chunks(isa, rng, group, dtype, B, nk, threads, prefetch, force):
    """One-row items with plain scores over the same keys: chunks of 32 keys with
    one softmax step across the heads (group.h, group_chunks), with and without
    its prefetch (decode_pf).  Against the reference with the options that move
    every head's keys alike (causal, a window, kv_lengths per batch entry with an
    empty one), 64 heads (whole vectors of them, at most one group) and 67 (two
    groups, a partial vector), and NaN and inf in one head's scores (the others
    stay finite; NaN reaches the merge of split keys): a chunk past the last whole
    one, key tails of 1-3, the block flush past 1,024 keys, split keys."""
    group(1)
    force.set(decode_pf=prefetch)
    H, d, dv = 5, 24, 12
    qh, kh, vh = rand(rng, (B, H, 1, d), dtype), rand(rng, (B, H, nk, d), dtype), rand(rng, (B, H, nk, dv), dtype)
    q, k, v = heads_last(qh), heads_last(kh), heads_last(vh)

    def both(q, k, v, **kw):
        force.reset_counts()
        check(q, k, v, dtype, layout="blhd", num_threads=threads, **kw)
        assert force.group_runs >= 1

    both(q, k, v)
    both(q, k, v, causal=True)
    both(q, k, v, window=(nk // 3, 0))
    both(q, k, v, kv_lengths=np.array([[nk // 2 + 1], [0], [nk]])[:B])
    for heads in (64, 67):
        both(rand(rng, (B, 1, heads, 16), dtype), rand(rng, (B, nk, heads, 16), dtype),
             rand(rng, (B, nk, heads, 16), dtype))
    for bad in (np.nan, np.inf):
        kb = kh.copy()
        kb[0, 2, nk // 2, 0] = bad
        both(q, heads_last(kb), v)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("B,nk", [(1, 2), (2, 7), (1, 150), (1, 1030), (3, 1100)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("touch", [0, 1])
def test_group_rows(isa, rng, group, dtype, B, nk, threads, touch, force):
    """Decoding from a (B, n, H, d) cache with the heads of a batch entry taken
    together, key tile by key tile (forced on: by default only from memory):
    against the reference with every option that moves a row's keys (causal, a
    window, kv_lengths per batch entry and per head, q_lengths that leave a row
    out), masks of both kinds, softcap, ALiBi and the lse; a key tile past the
    last whole one (nk 1, 7, 150, 1030), split keys (one batch entry, or three on
    two threads) and a dv that is no whole number of vectors.  inf and NaN values
    where a row sees them and where only a mask hides them (the careful redo).
    130 heads run as three groups (at most 64 a group), whose keys two threads
    split when there are 1024 or more.  Not with more than 8 query rows an
    item (test_group_rows_several), nor head-major K and V: counted by
    force.group_runs.  The next key tile read ahead by loads or by software
    prefetch (group_touch)."""
    group(1)
    force.set(group_touch=touch)
    H, d, dv = 5, 24, 12
    qh, kh, vh = rand(rng, (B, H, 1, d), dtype), rand(rng, (B, H, nk, d), dtype), rand(rng, (B, H, nk, dv), dtype)
    q, k, v = heads_last(qh), heads_last(kh), heads_last(vh)

    def both(**kw):
        force.reset_counts()
        check(q, k, v, dtype, layout="blhd", num_threads=threads, **kw)
        assert force.group_runs >= 1

    both()
    both(causal=True, alibi_slopes=np.linspace(0.01, 0.5, H))
    both(window=(nk // 3, 0), softcap=3.0, kv_lengths=rng.integers(0, nk + 1, (B, 1)))
    both(kv_lengths=rng.integers(0, nk + 1, (B, H)), q_lengths=np.array([[1], [0], [1]])[:B])
    both(mask=rng.random((B, 1, 1, nk)) < 0.7)
    both(mask=np.where(rng.random((B, H, 1, nk)) < 0.6, 0.0, -np.inf).astype(dtype))
    hide = rng.random((B, 1, 1, nk)) < 0.5
    hide[..., 0] = False
    vh[..., hide[0, 0, 0], 1] = np.inf                                  # only hidden keys: the result is finite
    v = heads_last(vh)
    both(mask=~hide)
    vh[0, 1, -1, 0] = np.nan                                            # a row sees it: NaN there
    v = heads_last(vh)
    both()

    qw, kw_, vw = rand(rng, (1, 1, 130, 8), dtype), rand(rng, (1, nk, 130, 8), dtype), rand(rng, (1, nk, 130, 8), dtype)
    force.reset_counts()
    with team_check(threads):
        out = fastattn.attention(qw, kw_, vw, layout="blhd", num_threads=threads)
    assert force.group_runs == 3 * (2 if threads == 2 and nk >= 1024 else 1)   # 3 groups: split in 2
    want = reference64(*(np.swapaxes(a, 1, 2) for a in (qw, kw_, vw)))[0]
    assert_close(out, np.swapaxes(want, 1, 2), dtype)

    for qq, kk, vv, lay in ((rand(rng, (B, 9, H, d), dtype), k, v, "blhd"), (qh, kh, vh, "bhld")):
        force.reset_counts()
        check(qq, kk, vv, dtype, layout=lay, num_threads=threads)
        assert force.group_runs == 0
    group(0)
    force.reset_counts()
    check(q, k, v, dtype, layout="blhd", num_threads=threads)
    assert force.group_runs == 0


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("B,nk", [(1, 2), (2, 7), (1, 150), (1, 1030), (3, 1100)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("touch", [0, 1])
def test_group_rows_several(isa, rng, group, rows_max, dtype, B, nk, threads, touch, force):
    """The group row kernel (forced on) for items of several query rows: a few
    new tokens a head (2, 3 and 8, the most it takes; causal, so that the rows
    see different keys) and GQA's heads folded into one item's rows (2 and 4
    query heads a key/value head).  Against the reference with the options of
    test_group_rows (q_lengths leave rows out), inf only a mask hides and NaN a
    row sees.  Its key tiles hold 64 keys here: nk 150, 1030 and 1100 end in a
    partial one.  The heads go into groups of at most 64 rows: 40 heads of 3
    rows run as two groups.  The row kernel is forced up to 8 rows (some paths
    give 8 rows the tiled kernel by default).  The next key tile read ahead by
    loads or by software prefetch (group_touch)."""
    group(1)
    rows_max(8)
    force.set(group_touch=touch)
    H, d, dv = 5, 24, 12

    def run(nq, hq=H, nkv=nk, **kw):
        qh = rand(rng, (B, hq, nq, d), dtype)
        kh, vh = rand(rng, (B, H, nkv, d), dtype), rand(rng, (B, H, nkv, dv), dtype)
        if kw.pop("inf_hidden", False):                     # only hidden keys hold inf: finite results
            hide = rng.random((B, 1, 1, nkv)) < 0.5
            hide[..., 0] = False
            vh[..., hide[0, 0, 0], 1] = np.inf
            kw["mask"] = ~hide
        if kw.pop("nan_seen", False):
            vh[0, 1, -1, 0] = np.nan
        force.reset_counts()
        check(heads_last(qh), heads_last(kh), heads_last(vh), dtype, layout="blhd", num_threads=threads,
              enable_gqa=hq != H, **kw)
        assert force.group_runs >= 1

    run(3)
    run(2, causal=True)
    run(8, causal=True, alibi_slopes=np.linspace(0.01, 0.5, H))
    run(3, causal=True, window=(nk // 3, 0), softcap=3.0, kv_lengths=rng.integers(0, nk + 1, (B, 1)))
    run(3, causal=True, kv_lengths=rng.integers(0, nk + 1, (B, H)), q_lengths=np.array([[2], [0], [3]])[:B])
    run(3, mask=rng.random((B, 1, 3, nk)) < 0.7)
    run(2, mask=np.where(rng.random((B, H, 2, nk)) < 0.6, 0.0, -np.inf).astype(dtype))
    run(3, causal=True, inf_hidden=True)
    run(2, nan_seen=True)
    run(1, hq=2 * H)                                      # GQA: 2 rows an item
    run(1, hq=4 * H, causal=True, kv_lengths=rng.integers(0, nk + 1, (B, 1)))
    run(2, hq=4 * H, causal=True)                         # 8 rows an item
    run(1, hq=2 * H, mask=rng.random((B, 1, 1, nk)) < 0.7)
    run(1, hq=2 * H, inf_hidden=True)

    qw, kw_, vw = rand(rng, (1, 3, 40, 8), dtype), rand(rng, (1, nk, 40, 8), dtype), rand(rng, (1, nk, 40, 8), dtype)
    force.reset_counts()
    with team_check(threads):
        out = fastattn.attention(qw, kw_, vw, layout="blhd", causal=True, num_threads=threads)
    assert force.group_runs == 2                   # 120 rows: 2 groups (a thread each)
    want = reference64(*(np.swapaxes(a, 1, 2) for a in (qw, kw_, vw)), causal=True)[0]
    assert_close(out, np.swapaxes(want, 1, 2), dtype)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("B,nk", [(1, 2), (2, 7), (1, 150), (1, 1030), (3, 1100)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_group_chunks_several(isa, rng, group, rows_max, tuning, dtype, B, nk, threads, prefetch, force):
    """Items of several query rows in chunks (group.h, group_chunks: a lane per
    row) where every row of an item sees the item's keys: GQA's heads folded into
    one item (2, 4 and 8 rows, causal decoding: one position), rows without
    causal or a window, kv_lengths per batch entry, 40 heads of 3 rows (two
    groups of 60 rows: a partial vector), NaN in one head's K (that head's rows
    NaN, the others not).  Against the reference, with force.chunk_rows counting
    every row (times the key splits); rows at different positions under causal,
    masks, softcap, ALiBi and kv_lengths per head take the key tiles (0 rows).
    Where the table leaves group_chunks_rows off, they all take the key tiles."""
    tuning(group_chunks_rows=1)
    group(1)
    rows_max(8)
    force.set(decode_pf=prefetch)
    H, d, dv = 5, 24, 12

    def run(nq, hq=H, chunked=True, heads=H, nan=False, **kw):
        qh = rand(rng, (B, hq, nq, d), dtype)
        kh, vh = rand(rng, (B, heads, nk, d), dtype), rand(rng, (B, heads, nk, dv), dtype)
        if nan:
            kh[0, 1, nk // 2, 0] = np.nan
        force.reset_counts()
        check(heads_last(qh), heads_last(kh), heads_last(vh), dtype, layout="blhd", num_threads=threads,
              enable_gqa=hq != heads, **kw)
        assert force.group_runs >= 1
        if chunked:
            assert force.chunk_rows >= B * hq * nq
        else:
            assert force.chunk_rows == 0

    run(1, hq=2 * H)
    run(1, hq=4 * H, causal=True)
    run(1, hq=8 * H, causal=True, kv_lengths=rng.integers(0, nk + 1, (B, 1)))
    run(3)
    run(2, hq=4 * H)                                        # 8 rows an item, two positions
    run(1, hq=40, heads=40)
    run(3, hq=40, heads=40)                                 # 120 rows: two groups of 60
    run(1, hq=4 * H, nan=True)
    run(3, causal=True, chunked=False)                      # a row's keys: its position's
    run(2, hq=4 * H, causal=True, chunked=False)
    run(1, hq=2 * H, mask=rng.random((B, 1, 1, nk)) < 0.7, chunked=False)
    run(1, hq=2 * H, softcap=3.0, chunked=False)
    run(3, kv_lengths=np.tile(np.arange(H) % (nk + 1), (B, 1)), chunked=False)   # keys that differ by head
    tuning(group_chunks_rows=0)
    run(1, hq=4 * H, chunked=False)
    run(3, chunked=False)
    run(1, hq=H)                                            # one row an item: chunks whatever the table


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("pipe", [1, 8])
def test_group_chunks_pv_rx4(isa, rng, group, rows_max, tuning, dtype, pipe, force):
    """Items of 2, 3 and 4 rows in chunks (GQA's heads folded) take P . V four keys
    a step by the pipelined row kernel's pv_rx4 where pipe_rows covers their rows
    (pipe 8: up to PV4_ROWS rows), rows_pv's tiles where not (pipe 1).  Against the
    reference, with V rows of a tail alone (dv 12), whole vectors and a tail (40),
    whole vectors (128), a key tail of 3 past the last 4 (1,031 keys: also the
    block flush), on one and two threads."""
    tuning(group_chunks_rows=1)
    group(1)
    rows_max(8)
    force.set(pipe_rows=pipe)
    H, d, nk = 3, 24, 1031
    for dv in (12, 40, 128):
        for r in (2, 3, 4):
            qh = rand(rng, (1, r * H, 1, d), dtype)
            kh, vh = rand(rng, (1, H, nk, d), dtype), rand(rng, (1, H, nk, dv), dtype)
            force.reset_counts()
            check(heads_last(qh), heads_last(kh), heads_last(vh), dtype, layout="blhd", enable_gqa=True,
                  num_threads=[1, 2])
            assert force.group_runs >= 1 and force.chunk_rows >= r * H


@pytest.mark.parametrize("nq,heads,groups", [(6, 32, 4), (5, 12, 1), (5, 13, 2), (8, 9, 2), (1, 130, 3)])
def test_group_rows_at_most_group_max(rng, group, rows_max, tuning, force, nq, heads, groups):
    """A group holds at most FA_GROUP_MAX (64) rows, the heads spread evenly over
    the fewest groups that allow it (32 heads of 6 rows: 4 groups of 8, not 3 of
    11, whose 66 rows the chunks cannot take); every row runs in chunks."""
    group(1)
    rows_max(8)
    tuning(group_chunks_rows=1)
    q, k, v = rand(rng, (1, nq, heads, 8)), rand(rng, (1, 40, heads, 8)), rand(rng, (1, 40, heads, 8))
    p = _plan(q, k, v, layout="blhd")
    assert p["n_groups"] == groups and p["group"] * nq <= 64 and p["group"] * groups >= heads
    force.reset_counts()
    check(q, k, v, layout="blhd", num_threads=2)
    assert force.group_runs == groups and force.chunk_rows == nq * heads


@pytest.mark.parametrize("nq", [1, 3])
def test_group_rows_empty_head_dims(isa, group, nq, force):
    """d_k = d_v = 0 from views whose heads lie apart (slices of a wider cache),
    with the group kernel forced: every key scores 0, so the lse is log(n_k) and
    the output has no columns (as the reference), and no key tile is sized by
    zero bytes a key."""
    group(1)
    wide = np.ones((1, 5, 4, 8), F32)
    q, k, v = np.ones((1, nq, 4, 8), F32)[..., :0], wide[..., :0], wide[..., 1:1]
    force.reset_counts()
    out, lse = fastattn.attention(q, k, v, layout="blhd", return_lse=True, causal=nq > 1)
    assert force.group_runs == 1
    want, want_lse = reference64(*(np.swapaxes(a, 1, 2) for a in (q, k, v)), causal=nq > 1)
    assert out.shape == (1, nq, 4, 0)
    assert_close(out, np.swapaxes(want, 1, 2), F32)
    assert_close(lse, want_lse, F32, "lse")
    np.testing.assert_allclose(lse[..., -1], np.log(5), rtol=1e-6)      # the last row sees all 5 keys


def test_group_rows_default(rng, force, tuning):
    """By default the heads of a (B, n, H, d) cache are taken together only when
    K and V come from memory (beyond 48 MiB): then against the reference, with one
    query row a head and with GQA's two query heads a key/value head folded into
    one item's rows (d64: whole vectors, and the next tiles prefetched in step)."""
    tuning(kv_mem_bytes=48 << 20)   # this CPU's table may put the line elsewhere (its L3)
    q, k, v = rand(rng, (1, 1, 16, 64)), rand(rng, (1, 6200, 16, 64)), rand(rng, (1, 6200, 16, 64))
    force.reset_counts()
    with team_check(2):
        out = fastattn.attention(q, k, v, layout="blhd", num_threads=2)
    assert force.group_runs == 2                    # one group, its keys split between the threads
    assert _core.last_threads() == (2 if _core.openmp_enabled() else 1)
    want = reference64(*(np.swapaxes(a, 1, 2) for a in (q, k, v)))[0]
    assert_close(out, np.swapaxes(want, 1, 2), F32)
    q2 = rand(rng, (1, 1, 32, 64))
    force.reset_counts()
    with team_check(2):
        out = fastattn.attention(q2, k, v, layout="blhd", enable_gqa=True, causal=True, num_threads=2)
    assert force.group_runs == 2                    # 16 items of 2 rows: one group, split
    assert _core.last_threads() == (2 if _core.openmp_enabled() else 1)
    want = reference64(*(np.swapaxes(a, 1, 2) for a in (q2, k, v)), enable_gqa=True, causal=True)[0]
    assert_close(out, np.swapaxes(want, 1, 2), F32)
    force.reset_counts()
    check(q, k[:, :1000], v[:, :1000], F32, layout="blhd", num_threads=2)
    assert force.group_runs == 0
