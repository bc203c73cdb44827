"""The float-mask-as-bool check (fastattn/_float_mask.py): its one-team form in
the C core (_core.mask_as_bool: the largest |q|, |k|, |v| and the mask pass in one
OpenMP team) gives what its pass-by-pass form gives, on masks that go to bool
either way (0 and -inf; a large negative number, with padding rows) and on those
that must stay float (a bias, a NaN or inf that could meet a hidden key, causal
with a finite floor)."""
import math

import numpy as np
import pytest
from conftest import rand

from fastattn import _float_mask
from fastattn._prepare import _prepare

F32, F64 = np.float32, np.float64


def both_forms(q, k, v, mask, causal=False, slopes=None):
    """(one-team result, pass-by-pass result) of the check for this call's mask."""
    _float_mask._FLOAT_MASKS_AS_BOOL = False   # _prepare keeps the float mask: the check runs here instead
    try:
        p = _prepare(q, k, v, mask, causal, None, False, None, None, slopes, None, 2)
    finally:
        _float_mask._FLOAT_MASKS_AS_BOOL = True
    core = np.ascontiguousarray(mask)
    neginf_only = _float_mask._keep_of(core[..., -1, :], -math.inf, 1) is not None
    sl = None if slopes is None else np.asarray(slopes, p.comp)
    return (_float_mask._check_in_one_team(core, p, sl, neginf_only),
            _float_mask._check_in_passes(core, p, sl, neginf_only))


def same(a, b):
    if a is None or b is None:
        return a is None and b is None
    return np.array_equal(a[0], b[0]) and (a[1] is None) == (b[1] is None) and (
        a[1] is None or np.array_equal(a[1], b[1]))


@pytest.mark.parametrize("dtype,mask_dtype", [(F32, F32), (F64, F64), (F32, F64)])
def test_one_team_check_agrees(rng, dtype, mask_dtype):
    B, H, n, d = 2, 3, 70, 16
    q, k, v = rand(rng, (B, H, n, d), dtype), rand(rng, (B, H, n, d), dtype), rand(rng, (B, H, n, d), dtype)
    low = np.finfo(dtype).min                         # (in the compute dtype: a float64 mask is cast)
    triu = np.triu(np.full((n, n), -np.inf, mask_dtype), 1)
    hf = np.where(np.tril(np.ones((n, n), bool)), 0, low).astype(mask_dtype)
    padded = hf.copy()
    padded[:5] = low                                  # padding query rows: one constant throughout
    bias = rng.standard_normal((n, n)).astype(mask_dtype)
    cases = {
        "-inf": (triu, {}, 1), "finfo.min": (hf, {}, 2), "padding rows": (padded, {}, 2),
        "alibi": (hf, {"slopes": np.linspace(0.1, 0.5, H)}, 2),
        "bias": (bias, {}, 0), "causal finite floor": (hf, {"causal": True}, 0),
        "causal -inf": (triu, {"causal": True}, 1),
    }
    for name, (mask, kw, mode) in cases.items():
        one, passes = both_forms(q, k, v, mask, **kw)
        assert same(one, passes), name
        assert (one is None) == (mode == 0), name
        if mode:
            np.testing.assert_array_equal(one[0], mask == 0, err_msg=name)
            assert (one[1] is None) == (mode == 1), name
        if name == "padding rows":
            np.testing.assert_array_equal(one[1], np.arange(n) < 5)
    qn, vi = q.copy(), v.copy()
    qn[1, 2, 3, 4] = np.nan                           # a NaN score could meet a hidden key: float
    vi[0, 0, 9, 1] = np.inf                           # a finite floor needs v finite
    for name, args, mode in (("nan q", (qn, k, v, triu), 0), ("inf v, -inf", (q, k, vi, triu), 1),
                             ("inf v, finfo.min", (q, k, vi, hf), 0)):
        one, passes = both_forms(*args)
        assert same(one, passes) and (one is None) == (mode == 0), name
