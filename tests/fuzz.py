"""Differential fuzzing: random attention problems against the float64 reference.

    python tests/fuzz.py --seconds 600            # from the checkout, after an install
    python tests/fuzz.py --seed 258 --count 1 -v  # one case again, with its arguments

Wider than the property tests (test_properties.py), and meant to run for
minutes, not in CI: shapes up to 700 x 2100 (several tiles, split keys, the row
kernel), B and H with broadcast K and V, GQA, every mask kind and layout (bool,
float, float masks of only 0 and -inf or a large negative number (with padding
rows of it), causal ones, key padding, column-major and reversed), causal
aligned either way, window, softcap, ALiBi, kv_lengths, q_lengths, scale (0
too), float16 to float64, NaN and inf planted in q, k and v, transposed (B, N,
H, d) views, out=, attention_weights, layout="blhd" on the same arrays (bit
for bit), the batch again as packed sequences of random lengths
(attention_varlen), and the backward pass of cases with finite inputs
(attention_backward, with the same options and tiles; beside 16-bit K and V, its do and out
of their dtype half the time); on a random SIMD path and thread count, with
the tiles, the fused exp, the far prefetch, the row kernel's limit, the bool
mask's packing and the row kernel over a (B, n, H, d) cache's heads forced at random.
Each failure prints its seed; a seed reproduces its case exactly.  Three bugs
were found this way (in 443c525 and f48d0b1).  The suite runs seeds 0-149
(test_properties.py: test_fuzz_cases).
"""

import argparse
import os
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import ISAS, RTOL, assert_close, reference64  # noqa: E402

import fastattn  # noqa: E402
from fastattn import _core, _float_mask  # noqa: E402
from fastattn import reference as ref  # noqa: E402


def problem(rng):
    """q, k, v and the keyword arguments of one random case."""
    dt = rng.choice([np.float16, np.float32, np.float32, np.float64, np.float64])
    big = rng.random() < 0.3
    nq = int(rng.integers(100, 700) if big else rng.choice([1, 1, 2, 3, 5, 8, 13, 24, 25, 33, 64, 65, 129, 300]))
    nk = int(rng.integers(100, 1500) if big else rng.choice([0, 1, 7, 31, 64, 65, 255, 257, 700, 1100, 2100]))
    dk = int(rng.choice([1, 3, 8, 16, 17, 24, 32, 64, 80, 128, 130]))
    dv = dk if rng.random() < 0.6 else int(rng.choice([1, 5, 16, 20, 64, 128]))
    H = int(rng.choice([1, 2, 3, 4, 8]))
    gqa = rng.random() < 0.25
    hkv = int(rng.choice([h for h in (1, 2, 4) if H % h == 0])) if gqa else H
    lead = ((int(rng.choice([1, 2])),) if rng.random() < 0.5 else ()) + (H,)
    lead_kv = lead[:-1] + (1 if not gqa and rng.random() < 0.3 else hkv,)
    q = rng.standard_normal(lead + (nq, dk)) * rng.choice([0.3, 1.0, 3.0])
    k = rng.standard_normal(lead_kv + (nk, dk))
    v = rng.standard_normal(lead_kv + (nk, dv))
    kw = {"enable_gqa": True} if gqa else {}
    if rng.random() < 0.3:
        kw["causal"] = True

    def mask_shape():
        ms = list(lead) if rng.random() < 0.3 else ([] if rng.random() < 0.5 else [1] * len(lead))
        if ms and rng.random() < 0.5:
            ms[-1] = 1
        return tuple(ms) + (nq if rng.random() < 0.8 else 1, nk if rng.random() < 0.9 else 1)

    kind = rng.choice(["none", "bool", "float", "zero_or_neginf", "zero_or_neginf", "key_padding"])
    if kind == "bool":
        kw["mask"] = rng.random(mask_shape()) < rng.choice([0.05, 0.5, 0.9, 1.0])
    elif kind == "float":
        m = rng.standard_normal(mask_shape()) * 3
        m[rng.random(m.shape) < rng.choice([0.0, 0.3, 0.9])] = -np.inf
        kw["mask"] = m.astype(rng.choice([dt, np.float64]))
    elif kind == "zero_or_neginf":
        s = mask_shape()
        if rng.random() < 0.5 and s[-2:] == (nq, nk):
            m = np.broadcast_to(np.triu(np.full((nq, nk), -np.inf), int(rng.integers(-5, 20))), s).copy()
        else:
            m = np.where(rng.random(s) < rng.choice([0.1, 0.5, 0.95]), 0.0, -np.inf)
        if rng.random() < 0.2:
            m[m == 0] = -0.0
        if rng.random() < 0.4:  # "hidden" as a large finite negative number (Hugging Face's finfo.min, -1e9)
            c = max(float(rng.choice([np.finfo(dt).min, -1e9, -1e4, -3000.0, -1000.0])), float(np.finfo(dt).min))
            m[np.isneginf(m) & (rng.random(s) < rng.choice([0.5, 1.0]))] = c
            if c == float(np.finfo(dt).min) and rng.random() < 0.4:  # padding query rows, c throughout
                m[..., rng.random(s[-2]) < 0.2, :] = c
        kw["mask"] = m.astype(rng.choice([dt, np.float64]))
    elif kind == "key_padding":
        keep = np.arange(nk) < rng.integers(0, nk + 1, lead[:-1] + (1, 1, 1))
        kw["mask"] = keep if rng.random() < 0.5 else np.where(keep, 0.0, -np.inf).astype(dt)
    if "mask" in kw and rng.random() < 0.15:
        kw["mask"] = np.asfortranarray(kw["mask"]) if rng.random() < 0.5 else kw["mask"][..., ::-1][..., ::-1]
    if rng.random() < 0.15:
        kw["window"] = (int(rng.choice([-1, 0, 3, 50, 300])), int(rng.choice([-1, 0, 5, 100])))
    if rng.random() < 0.15:
        kw["softcap"] = float(rng.choice([1.0, 5.0, 30.0]))
    if rng.random() < 0.15 and not gqa:
        kw["alibi_slopes"] = rng.random(H) * rng.choice([0.1, 1.0])
    if rng.random() < 0.15:
        kw["kv_lengths"] = rng.integers(0, nk + 1, (lead[0], 1) if len(lead) > 1 and rng.random() < 0.7 else lead)
    if rng.random() < 0.15:
        kw["q_lengths"] = rng.integers(0, nq + 1, (lead[0], 1) if len(lead) > 1 and rng.random() < 0.7 else lead)
    if rng.random() < 0.2:
        kw["scale"] = float(rng.choice([0.0, -0.5, 2.0, 0.01]))
    for a in (q, k, v):   # NaN and inf
        if a.size and rng.random() < 0.15:
            a[tuple(rng.integers(0, s) for s in a.shape)] = rng.choice([np.nan, np.inf, -np.inf])
    q, k, v = q.astype(dt), k.astype(dt), v.astype(dt)
    if rng.random() < 0.15:
        q = np.swapaxes(np.ascontiguousarray(np.swapaxes(q, -2, -3)), -2, -3)
    if rng.random() < 0.15:   # (B, N, H, d) read as (B, H, N, d)
        k = np.swapaxes(np.ascontiguousarray(np.swapaxes(k, -2, -3)), -2, -3)
        v = np.swapaxes(np.ascontiguousarray(np.swapaxes(v, -2, -3)), -2, -3)
    return q, k, v, kw


def settings(rng):
    """The SIMD path, threads and forced kernel choices of one case."""
    tiles = (0, 0) if rng.random() < 0.5 else (int(rng.choice([0, 16, 24, 40, 64, 128])),
                                                int(rng.choice([0, 16, 40, 64, 128, 256])))
    return dict(isa=str(rng.choice(ISAS)), threads=int(rng.choice([1, 2, 3])), tiles=tiles,
                fused=int(rng.choice([-1, 0, 1])), stream=int(rng.choice([-1, -1, 0, 1])),
                rows_max=int(rng.choice([0, 0, 1, 8, 24])), float_masks_as_bool=bool(rng.random() < 0.7),
                out=bool(rng.random() < 0.2), weights=bool(rng.random() < 0.1),
                varlen=bool(rng.random() < 0.25), mask_pack=int(rng.choice([-1, 0, 1])),
                layout=bool(rng.random() < 0.2), group=int(rng.choice([-1, -1, 0, 1])))


def packed_problem(rng, q, k, v, kw):
    """The case's batch as packed sequences (attention_varlen) of random lengths:
    q, k, v (total, heads, d), cu_seqlens_q and _k, and the options that carry over."""
    H, nq, nk = q.shape[-3], q.shape[-2], k.shape[-2]
    B = q.shape[0] if q.ndim == 4 else 1
    hkv = k.shape[-3] if kw.get("enable_gqa") else H

    def rows(a, h, n, lengths):   # (B, h, n, d) -> the first lengths[b] rows of each b, (total, h, d)
        a = np.broadcast_to(a, (B, h, n, a.shape[-1]))
        return np.concatenate([a[b, :, :m].transpose(1, 0, 2) for b, m in enumerate(lengths)])

    lq = rng.integers(0, nq + 1, B) if rng.random() < 0.8 else np.full(B, nq)
    lk = rng.integers(0, nk + 1, B) if rng.random() < 0.8 else np.full(B, nk)
    options = {n: kw[n] for n in ("causal", "window", "softcap", "alibi_slopes", "scale") if n in kw}
    return (rows(q, H, nq, lq), rows(k, hkv, nk, lk), rows(v, hkv, nk, lk),
            np.cumsum(np.r_[0, lq]), np.cumsum(np.r_[0, lk]), options)


def tolerance(scores, dtype):
    """The relative tolerance of a case whose largest finite score is in `scores`:
    float32 rounds a score s to about |s| * 6e-8, which exp carries into the weights."""
    big = np.abs(scores[np.isfinite(scores)])
    rtol = RTOL[np.dtype(np.float32) if dtype == np.float16 else dtype] * max(1.0, float(big.max(initial=0)) / 16)
    return max(rtol, RTOL[np.dtype(np.float16)]) if dtype == np.float16 else rtol


def run_case(seed, verbose=False):
    rng = np.random.default_rng(seed)
    q, k, v, kw = problem(rng)
    s = settings(rng)
    if kw.get("causal") and rng.random() < 0.3:
        kw["causal"] = "upper_left"
    if s["group"] == 1 and min(k.ndim, v.ndim) >= 3 and rng.random() < 0.7:   # K, V: views of a (..., n, H, d) cache
        k, v = (np.swapaxes(np.ascontiguousarray(np.swapaxes(a, -2, -3)), -2, -3) for a in (k, v))
    if verbose:
        shapes = {n: (a.shape, str(a.dtype)) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
        print(f"seed {seed}: q {q.shape} k {k.shape} v {v.shape} {q.dtype} {shapes} {s}")
    before = _core.isa_name()
    _core.set_isa(s["isa"])
    force = _core.forcing(bq=s["tiles"][0], bk=s["tiles"][1], fuse=s["fused"], stream=s["stream"],
                          rows_max=s["rows_max"], mask_pack=s["mask_pack"], group=s["group"]).__enter__()
    _float_mask._FLOAT_MASKS_AS_BOOL = s["float_masks_as_bool"]
    try:
        out, lse = fastattn.attention(q, k, v, return_lse=True, num_threads=s["threads"], **kw)
        if s["out"]:   # any strides; the result's dtype, or another it casts to (same_kind),
            # drawn apart so that the case's own draws stay those of earlier versions
            dtypes = [str(out.dtype)] * 3 + ["<f2", ">f4", ">f8", "<f4", "<f8"]
            o_dtype = np.random.default_rng([seed, 1]).choice(dtypes)
            o = np.full(out.shape[::-1], 7, o_dtype).T
            assert fastattn.attention(q, k, v, num_threads=s["threads"], out=o, **kw) is o
            if o.dtype.itemsize >= out.dtype.itemsize:   # o holds the compute dtype's values, cast once
                np.testing.assert_array_equal(o.astype(out.dtype), out)
            else:
                np.testing.assert_array_equal(o, out.astype(o.dtype))
        if s["layout"] and min(q.ndim, k.ndim, v.ndim) >= 3:   # the same arrays as (..., n, H, d) views
            t = lambda a: np.swapaxes(a, -3, -2)  # noqa: E731
            o, ls = fastattn.attention(t(q), t(k), t(v), return_lse=True, num_threads=s["threads"], layout="blhd", **kw)
            np.testing.assert_array_equal(t(o), out)
            np.testing.assert_array_equal(ls, lse)
        if s["weights"]:
            w = fastattn.attention_weights(q, k, num_threads=s["threads"], **kw)
        if s["varlen"]:
            pq, pk, pv, cq, ck, options = packed_problem(rng, q, k, v, kw)
            p_out, p_lse = fastattn.attention_varlen(pq, pk, pv, cq, ck, return_lse=True,
                                                     num_threads=s["threads"], **options)
        # the backward pass, drawn apart (the case's own draws stay those of earlier
        # versions), of cases whose inputs are finite (NaN and inf spread through the
        # gradients as the order of the sums has it)
        brng = np.random.default_rng([seed, 2])
        backward = brng.random() < 0.35 and all(np.isfinite(a).all() for a in (q, k, v))
        if backward:
            do = brng.standard_normal(out.shape).astype(out.dtype)
            b_out = out
            if k.dtype.itemsize == 2 and k.dtype == v.dtype and brng.random() < 0.5:   # read as stored
                do, b_out = do.astype(k.dtype), out.astype(k.dtype)
            grads = fastattn.attention_backward(do, q, k, v, b_out, lse, num_threads=s["threads"], **kw)
    finally:
        _core.set_isa(before)
        force.__exit__(None, None, None)
        _float_mask._FLOAT_MASKS_AS_BOOL = True
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        want, want_lse = reference64(q, k, v, **kw)
        score_kw = dict(kw)
        mask = score_kw.pop("mask", None)
        if mask is not None and mask.dtype != bool:
            mask = mask.astype(np.float64)
        scores = ref.scores(q.astype(np.float64), k.astype(np.float64), mask=mask, **score_kw)
    dtype = np.result_type(q, k, v)
    rtol = tolerance(scores, dtype)
    assert_close(out, want, dtype, rtol=rtol)
    assert_close(lse, want_lse, dtype, "lse", rtol=rtol)
    if s["weights"]:
        with np.errstate(all="ignore"):
            want_w = ref.attention_weights(q.astype(np.float64), k.astype(np.float64), mask=mask, **score_kw)
        assert_close(w, want_w, dtype, "weights", rtol=rtol)
    if backward:   # against the materialised formula, on the reference's own output
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            c64 = lambda a: np.asarray(a).astype(np.float64)  # noqa: E731
            bwd_kw = dict(kw, mask=mask) if "mask" in kw else kw   # the mask as the scores took it
            # (a 16-bit out: D from its rounded values, as the C core takes it, but
            # for rows of |lse| >= 32, whose D it forms from the weights: the
            # tolerance, which grows with the largest score, covers them)
            b_want = c64(b_out) if b_out.dtype.itemsize == 2 else want
            want_g = ref.attention_backward(c64(do), c64(q), c64(k), c64(v), b_want, **bwd_kw)
        gdt = np.result_type(dtype, np.float32)   # 16-bit inputs: float32 gradients
        for g, wg, a, name in zip(grads, want_g, (q, k, v), ("dq", "dk", "dv")):
            assert g.shape == a.shape and g.dtype == gdt, (name, g.shape, g.dtype)
            assert_close(g, wg, gdt, name, rtol=8 * tolerance(scores, gdt))
    if s["varlen"]:
        c = lambda a: a.astype(np.float64)  # noqa: E731
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            want, want_lse = ref.attention_varlen(c(pq), c(pk), c(pv), cq, ck, return_lse=True, **options)
            seqs = [ref.scores(c(pq[cq[b]:cq[b + 1]]).transpose(1, 0, 2), c(pk[ck[b]:ck[b + 1]]).transpose(1, 0, 2),
                               enable_gqa=True, **options).ravel() for b in range(len(cq) - 1)]
        rtol = tolerance(np.concatenate(seqs), dtype)
        assert_close(p_out, want, dtype, "varlen", rtol=rtol)
        assert_close(p_lse, want_lse, dtype, "varlen lse", rtol=rtol)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="stop after this long (default 60)")
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--count", type=int, default=10**9, help="at most this many cases")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each case's arguments")
    args = parser.parse_args(argv)
    t0, done, failed = time.time(), 0, []
    for seed in range(args.seed, args.seed + args.count):
        if time.time() - t0 > args.seconds:
            break
        try:
            run_case(seed, args.verbose)
        except Exception as e:  # report and go on: one seed per failure
            failed.append(seed)
            print(f"seed {seed}: {type(e).__name__}: {str(e)[:400]}", flush=True)
        done += 1
    print(f"{done} cases (seeds {args.seed}-{args.seed + done - 1}), {len(failed)} failed"
          + (f": {failed}" if failed else "") + f", {time.time() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
