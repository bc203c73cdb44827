# cython: language_level=3, boundscheck=False, wraparound=False
"""Binding to the C core (src_c/).

Takes arrays that fastattn/_prepare.py has already validated, broadcast and
converted, fills the C argument structs with their pointers and element
strides, and calls the C core with the GIL released.  Nothing here checks
shapes: the Python layer (_validate.py, _prepare.py) does.
"""
from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport malloc, free
from libc.math cimport sqrt, isfinite
from cpython.exc cimport PyErr_CheckSignals
from cpython.pythread cimport PyThread_get_thread_ident
cimport numpy as cnp
import numpy as np
import numbers
import os
import signal
import sys
import threading

cnp.import_array()

cdef extern from "fastattn.h" nogil:
    enum:
        FA_MAX_DIMS
        FA_OK
        FA_ENOMEM
        FA_EINVAL
        FA_EINTR
        FA_F32
        FA_F64
        FA_KV_SAME
        FA_KV_F16
        FA_KV_BF16
        FA_MASK_NONE
        FA_MASK_BOOL
        FA_MASK_ADD

    ctypedef struct fa_overrides:
        int64_t bq, bk, rows_max, pipe_rows
        int fuse, stream, far, decode_pf, group, group_touch, mask_pack, head_turns, mask_cache
        int64_t split_keys, parts_bytes

    ctypedef struct fa_stats:
        int64_t group_runs, tail_rows, redo_rows, kv_widened, chunk_rows

    ctypedef struct fa_attention_args:
        int n_lead
        int64_t lead_shape[FA_MAX_DIMS]
        int64_t q_lead[FA_MAX_DIMS]
        int64_t k_lead[FA_MAX_DIMS]
        int64_t v_lead[FA_MAX_DIMS]
        int64_t o_lead[FA_MAX_DIMS]
        int64_t m_lead[FA_MAX_DIMS]
        int64_t lse_lead[FA_MAX_DIMS]
        int64_t nq, nk, dk, dv
        int64_t q_rs, k_rs, v_rs, o_rs
        int64_t m_rs, m_cs
        int64_t lse_rs
        const void *q
        const void *k
        const void *v
        const void *mask
        void *out
        void *lse
        int dtype
        int kv_dtype
        int q_kv
        int mask_kind
        int causal
        int top_left
        int64_t row_group
        double scale
        double softcap
        int64_t win_left, win_right
        const void *slopes
        int64_t slope_lead[FA_MAX_DIMS]
        const int64_t *kv_len
        int64_t kvl_lead[FA_MAX_DIMS]
        const int64_t *q_len
        int64_t qln_lead[FA_MAX_DIMS]
        const int64_t *q_start
        int64_t qst_lead[FA_MAX_DIMS]
        const int64_t *kv_start
        int64_t kst_lead[FA_MAX_DIMS]
        int num_threads
        const volatile int *stop
        const fa_overrides *force
        fa_stats *stats

    ctypedef struct fa_softmax_args:
        int n_lead
        int64_t lead_shape[FA_MAX_DIMS]
        int64_t x_lead[FA_MAX_DIMS]
        int64_t o_lead[FA_MAX_DIMS]
        int64_t n, x_s, o_s
        const void *x
        void *out
        int dtype
        int num_threads
        const volatile int *stop

    ctypedef struct fa_backward_args:
        const void *dout
        void *dq
        void *dk
        void *dv
        int64_t do_lead[FA_MAX_DIMS]
        int64_t dq_lead[FA_MAX_DIMS]
        int64_t dk_lead[FA_MAX_DIMS]
        int64_t dv_lead[FA_MAX_DIMS]
        int64_t do_rs
        int64_t dq_rs
        int64_t dk_rs
        int64_t dv_rs
        int do_kv
        int o_kv

    int fa_attention(const fa_attention_args *a)
    int fa_attention_weights(const fa_attention_args *a)
    int fa_attention_backward(const fa_attention_args *a, const fa_backward_args *b)
    int fa_softmax(const fa_softmax_args *a)
    const char *fa_isa_name()
    int fa_set_isa(const char *name)
    int fa_isa_available(const char *name)
    int fa_openmp_enabled()
    int fa_max_threads()
    uint64_t fa_stream_read(const void *x, int64_t n, int num_threads)
    int fa_mask_keep(int dtype, const void *x, int64_t rows, int64_t len, double floor, unsigned char *keep,
                     double pad_floor, unsigned char *pad, int num_threads, int *all_ok)
    int fa_abs_max(int dtype, const void *x, int64_t n, int num_threads, double *out)
    int fa_merge(int dtype, int n_parts, const void *const *outs, const void *const *lses, int64_t rows,
                 int64_t d, void *out, void *lse, int num_threads)
    int fa_mask_as_bool(int dtype, const void *q, int64_t nq_el, const void *k, int64_t nk_el, const void *v,
                        int64_t nv_el, double dk_scale, double slope_term, int try_neginf, int allow_finite,
                        double margin, double pad_absorb, int mask_dtype, const void *x, int64_t rows,
                        int64_t len, unsigned char *keep, unsigned char *pad, int num_threads, int *mode)
    int fa_last_threads()
    int fa_fork_serial()
    void fa_init()
    const volatile int *fa_interrupt_begin()
    void fa_interrupt_end()
    int fa_thread_cap()
    const char *fa_openmp_library()
    const char *fa_build_info()

cdef extern from "internal.h" nogil:
    int fa_exp(int dtype, int which, const void *x, void *y, int64_t n)
    int fa_kv_widen(int kv_dtype, const void *x, float *y, int64_t n)

cdef extern from "runtime.h" nogil:
    double FA_TEAM_MIN_WORK

    enum:
        FA_KERNEL_TILED
        FA_KERNEL_ROWS
        FA_KERNEL_WEIGHTS

    ctypedef struct fa_tiles:
        int64_t bq, bk, bqp, ld, q_main
        int fuse, stream, far, pf_l1, spread, decode_pf, inorder, pipe_rows, pipe_pf_l2, group_touch, chunks_rows
        int64_t kv_rows, mt_off

    ctypedef struct fa_plan:
        int kernel
        fa_tiles tiles
        int64_t lanes, rows_max, full_lo, full_hi, tail_max, kv_bytes
        int from_memory, tail, few
        int64_t group, n_groups, n_lead, n_qb, n_items, n_splits, long_splits, chunk, part_elems, wave
        int mask_pack
        int64_t head_turns
        int threads
        int64_t scratch_elems
        double q_rows, work

    ctypedef struct fa_tuning:
        char name[32]
        int rows_max[2]
        int rows_max_big[2]
        int rows_max_dk[2]
        int rows_max_big_dk[2]
        int rows_full[2]
        int rows_full_dk
        int rows_max_kv
        int tail_max[2]
        int tail_mem
        int tile_pf_l1
        int tile_spread
        int pipe_pf_l2
        int decode_pf[2]
        int decode_far
        int decode_inorder
        int fuse, stream, bk_tiled, bk_tiled_mem, bq_tiled, q_tile_bytes, q_tile_bytes_band, bk_rows, bk_decode
        int group_bk_max, group_touch, group_chunks_rows
        int group_rows[2]
        int pipe_rows[2]
        int fold_rows, fold_rows_big
        int64_t group_tile_bytes, fold_big_bytes, kv_mem_bytes, kv_far_bytes
        int bwd_bq, bwd_bk

    ctypedef struct fa_isa_table:
        const char *name
        int lanes[2]

    ctypedef struct fa_cpu:
        char vendor[16]
        char brand[64]
        int family, model, stepping
        int64_t l2_bytes, l3_bytes

    const fa_isa_table *fa_isa_current()
    const fa_tuning *fa_tuning_current()
    int fa_tuning_set(const fa_tuning *t)
    int fa_tuning_check(const fa_tuning *t)
    void fa_tuning_reset()
    void fa_tuning_builtin(fa_tuning *out)
    void fa_cpu_info(fa_cpu *out)
    int fa_attention_plan(const fa_attention_args *a, int weights, fa_plan *p)
    int fa_gqa_fold(int64_t n_q, int64_t kv_bytes)

fa_init()

# A call whose plan's work is below this runs on one thread (src_c/runtime.h).
TEAM_MIN_WORK = FA_TEAM_MIN_WORK
MASK_NONE = FA_MASK_NONE
MASK_BOOL = FA_MASK_BOOL
MASK_ADD = FA_MASK_ADD


cdef int _dtype_code(cnp.ndarray a) except -1:
    if a.dtype.num == cnp.NPY_FLOAT32:
        return FA_F32
    if a.dtype.num == cnp.NPY_FLOAT64:
        return FA_F64
    raise TypeError(f"internal: the C core takes float32 or float64, got {a.dtype}")


def bfloat16_dtype():
    """ml_dtypes' bfloat16 dtype when ml_dtypes is imported, else None: an array
    can only hold bfloat16 once ml_dtypes is imported, so fastattn never imports it."""
    mld = sys.modules.get("ml_dtypes")
    return np.dtype(mld.bfloat16) if mld is not None else None


cdef bint _is_bf16(object dt):
    """Is dt ml_dtypes' bfloat16 (by dtype; never `dt == None`, which NumPy reads as float64)?"""
    bf = bfloat16_dtype()
    return bf is not None and dt == bf


cdef int _kv_code(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, bint weights) except -1:
    """How k and v are stored (fastattn.h, FA_KV_*): q's dtype, or 16-bit floats
    (both of one kind) with float32 q or q of their kind (q_kv)."""
    cdef int code = 0
    if k.dtype.isnative:   # (another byte order: the Python layer converts it)
        code = FA_KV_F16 if k.dtype.num == cnp.NPY_FLOAT16 else FA_KV_BF16 if _is_bf16(k.dtype) else 0
    if code != 0 and (weights or v.dtype == k.dtype) and (q.dtype.num == cnp.NPY_FLOAT32 or q.dtype == k.dtype):
        return code
    if code == 0 and k.dtype == q.dtype and (weights or v.dtype == q.dtype):
        return FA_KV_SAME
    raise TypeError(f"internal: k and v of {k.dtype} and {v.dtype} with q of {q.dtype}")


cdef inline int64_t _estride(cnp.ndarray a, int axis):
    # element stride of an axis (the Python layer guarantees divisibility)
    return cnp.PyArray_STRIDES(a)[axis] // cnp.PyArray_ITEMSIZE(a)


cdef int _check(int status) except -1:
    if status == FA_OK:
        return 0
    if status == FA_ENOMEM:
        raise MemoryError("fastattn: could not allocate the per-thread scratch")
    raise ValueError(f"fastattn: the C core rejected its arguments (status {status})")


# Calls of at least this much work (rows x keys x (d_k + d_v)), about a millisecond,
# made from the main thread while SIGINT has Python's default handler (which raises
# KeyboardInterrupt), stop on Ctrl-C (fa_interrupt_begin): the two sigaction calls
# that takes cost about a microsecond.  Another handler is left to run when the call
# returns: a call stopped part-way could not be resumed (out= may alias an input).
cdef double _INTERRUPTIBLE_WORK = 1 << 26
cdef unsigned long _main_ident = threading.main_thread().ident


def _after_fork_in_child():
    global _main_ident
    _main_ident = threading.main_thread().ident


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


cdef int _run(void *args, int which, double work, const fa_backward_args *bwd=NULL) except -1:
    """Run a C entry point (0 attention, 1 its weights, 2 softmax, 3 the
    backward pass with bwd) with the GIL
    released; a long call from the main thread stops on Ctrl-C and raises
    KeyboardInterrupt (see _INTERRUPTIBLE_WORK)."""
    cdef const volatile int *stop = NULL
    cdef int status
    if (work >= _INTERRUPTIBLE_WORK and PyThread_get_thread_ident() == _main_ident
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
        stop = fa_interrupt_begin()
    if which == 2:
        (<fa_softmax_args *>args).stop = stop
    else:
        (<fa_attention_args *>args).stop = stop
    with nogil:
        if which == 0:
            status = fa_attention(<fa_attention_args *>args)
        elif which == 1:
            status = fa_attention_weights(<fa_attention_args *>args)
        elif which == 3:
            status = fa_attention_backward(<fa_attention_args *>args, bwd)
        else:
            status = fa_softmax(<fa_softmax_args *>args)
    if stop != NULL:
        fa_interrupt_end()
    if status == FA_EINTR:
        PyErr_CheckSignals()             # Python's handler: raises KeyboardInterrupt
        raise KeyboardInterrupt()        # (recorded before the flag was set, so not reached)
    return _check(status)


cdef inline void _lead_strides(cnp.ndarray a, int nl, int core, int64_t *out):
    """Element strides of a's leading dims (all but its `core` trailing dims),
    right-aligned to nl broadcast dims: 0 where a has no such dim or has size 1
    there (NumPy broadcasting)."""
    cdef int own = a.ndim - core
    cdef int d, od
    for d in range(nl):
        od = d - (nl - own)
        if od < 0 or a.shape[od] == 1:
            out[d] = 0
        else:
            out[d] = _estride(a, od)


cdef const void *_per_lead(object x, int nl, int64_t *strides):
    """The data of x, an array with one value per leading index (slopes, lengths,
    starts), its strides over the nl leading dims in `strides`; None: NULL."""
    if x is None:
        return NULL
    cdef cnp.ndarray arr = <cnp.ndarray>x
    _lead_strides(arr, nl, 0, strides)
    return cnp.PyArray_DATA(arr)


cdef class Args:
    """The prepared arguments of one call into the C core, typed: what
    attention() reads into fa_attention_args (fastattn.h).  Prepared (below)
    extends it with what the Python layer keeps of a call; a plain call, a
    folded call and a packed (varlen) call build an Args.

    q, k, v, mask have shape (..., rows, cols) with leading dims that broadcast
    to `lead`; slopes (compute dtype), kvl and qln (kv_lengths, q_lengths:
    int64) broadcast to `lead`.  q, k, v have unit stride on the last axis; the
    mask may have any strides.  mask_kind: MASK_NONE, MASK_BOOL (mask uint8)
    or MASK_ADD (compute dtype).  win_left, win_right: -1 for unbounded.
    row_group: consecutive rows that share a position (causal, window, ALiBi),
    a divisor of the rows (fastattn.h); top_left: positions aligned top-left,
    not bottom-right.  nthreads: 0 for the OpenMP default.
    Packed sequences (fastattn.h): q_start and kv_start (int64, broadcast to
    `lead`) are each leading index's first row of q, out, lse and of k, v (no
    mask then); n_q (with q_start) and n_k (with kv_start), when >= 0, are
    then each sequence's rows at most, where the arrays hold every sequence's
    rows (q_start + q_len <= q's rows, kv_start + kv_len <= k's).  Otherwise
    the array's rows are the item's."""
    cdef public cnp.ndarray q, k, v
    cdef public object mask, slopes, kvl, qln, q_start, kv_start
    cdef public tuple lead
    cdef public int mask_kind, nthreads
    cdef public bint causal, top_left
    cdef public double scale, softcap
    cdef public int64_t win_left, win_right, row_group, n_q, n_k

    def __cinit__(self):   # what a Prepared (whose __init__ sets the rest) leaves unset
        self.lead = ()
        self.row_group = 1
        self.n_q = self.n_k = -1

    def __init__(self, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, object mask=None, int mask_kind=FA_MASK_NONE,
                 tuple lead=(), bint causal=False, double scale=1.0, int nthreads=0, *, double softcap=0.0,
                 int64_t win_left=-1, int64_t win_right=-1, object slopes=None, object kvl=None,
                 object qln=None, object q_start=None, object kv_start=None, int64_t n_q=-1, int64_t n_k=-1,
                 bint top_left=False, int64_t row_group=1):
        self._set(q, k, v, mask, mask_kind, lead, causal, scale, nthreads, softcap, win_left, win_right, slopes,
                  kvl, qln, top_left)
        self.q_start, self.kv_start, self.n_q, self.n_k, self.row_group = q_start, kv_start, n_q, n_k, row_group

    cdef void _set(self, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, object mask, int mask_kind, tuple lead,
                   bint causal, double scale, int nthreads, double softcap, int64_t win_left, int64_t win_right,
                   object slopes, object kvl, object qln, bint top_left):
        """The fields every call has (a C call: the constructors' shared part)."""
        self.q, self.k, self.v, self.mask, self.mask_kind = q, k, v, mask, mask_kind
        self.lead, self.causal, self.scale, self.nthreads = lead, causal, scale, nthreads
        self.softcap, self.win_left, self.win_right, self.slopes = softcap, win_left, win_right, slopes
        self.kvl, self.qln, self.top_left = kvl, qln, top_left


cdef class Prepared(Args):
    """A validated, converted attention or attention_weights call, as
    fastattn._prepare._prepare returns it: the C core's arguments (Args) and
    what the Python layer keeps of the call.

    q, v and slopes are in the compute dtype (k and v may instead stay 16-bit
    floats, float16 or bfloat16 alike, for float32, and q with them: the C core
    reads them so), the mask in it too or a bool mask as uint8, the lengths
    int64: each readable by the C core as it is, with leading dims that
    broadcast to `lead`.  Under GQA the head axis is split: lead is
    (..., H_kv, g), g = H // H_kv query heads a group (K and V of size 1 there).
    q (*lead, n_q, d_k) holds a 1-D q as one row; v (*lead, n_k, d_v) a 1-D v
    as one column, and is k for attention_weights; mask_kind MASK_BOOL also
    for a float mask read as bool.

    The fields beyond Args:
    pad: a float mask read as bool, (its padding rows, their constants), or None;
    d_v: value width (1 for a 1-D v); q1, v1: q (v) was 1-D, and the result
    drops the n_q (d_v) axis; gqa: (H, H_kv) with enable_gqa, else None;
    fold: _call folds a GQA group's query heads into the rows of one item;
    res: the result's dtype (NumPy's promotion of the inputs); comp: the
    compute dtype, float32 or float64; inputs: q, k, v (as arrays) and the
    mask as given, what out= must not overlap.  n_q and n_k are the call's
    query rows (1 for a 1-D q) and keys (the C core reads the arrays' rows)."""
    cdef public object pad, gqa, res, comp, inputs
    cdef public int64_t d_v
    cdef public bint q1, v1, fold

    def __init__(self, *, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, object mask, int mask_kind, object pad,
                 object slopes, object kvl, object qln, tuple lead, int64_t n_q, int64_t n_k, int64_t d_v,
                 bint q1, bint v1, object gqa, bint fold, object res, object comp, double scale,
                 double softcap, bint causal, bint top_left, int64_t win_left, int64_t win_right, int nthreads,
                 tuple inputs):
        self._set(q, k, v, mask, mask_kind, lead, causal, scale, nthreads, softcap, win_left, win_right, slopes,
                  kvl, qln, top_left)
        self.n_q, self.n_k = n_q, n_k
        self.pad, self.d_v, self.q1, self.v1, self.gqa, self.fold = pad, d_v, q1, v1, gqa, fold
        self.res, self.comp, self.inputs = res, comp, inputs

    def folded(self, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, object mask, tuple lead, object kvl,
               object qln, int64_t row_group):
        """The Args of this call with a GQA group's query heads folded into
        the rows of one item (fastattn._attention._call gives the arrays,
        lead and lengths so reshaped); the scalars as they are."""
        cdef Args c = Args.__new__(Args)
        c._set(q, k, v, mask, self.mask_kind, lead, self.causal, self.scale, self.nthreads, self.softcap,
               self.win_left, self.win_right, self.slopes, kvl, qln, self.top_left)
        c.row_group = row_group
        return c


def attention(Args p not None, cnp.ndarray out not None, object lse, *, bint weights=False,
              bint plan_only=False, tuple backward=None):
    """Fill `out` (and `lse`) with attention over the prepared call p (Args),
    or with the attention weights when `weights` (out is then lead + (nq, nk),
    zero-filled, v unused).  out has shape lead + (nq, dv), leading dims that
    broadcast to p.lead, unit stride on its last axis; lse has exactly
    len(lead) leading dims (stride 0 where it repeats) and then nq.
    plan_only: return the plan of the call (a dict: plan.c) and compute nothing.
    backward = (dout, dq, dk, dv): the backward pass instead (fa_attention_backward):
    out and lse are the forward's result, read; dout has out's shape (dout and out
    in the compute dtype, or, with 16-bit K and V, each as k); dq, dk,
    dv have q's, k's and v's last two dims, written; each with leading dims
    that broadcast to `lead` and unit stride on its last axis (dq, dk and dv
    of distinct leading indices apart: fastattn.h).
    Inside a forcing() block of this thread, the call takes its overrides."""
    return _attention(p, out, lse, weights, plan_only, backward)


cdef object _attention(Args p, cnp.ndarray out, object lse, bint weights, bint plan_only, tuple backward):
    """attention() above, callable from this module without a Python call."""
    cdef cnp.ndarray q = p.q, k = p.k, v = p.v
    cdef tuple lead = p.lead
    if q is None or k is None or v is None:
        raise TypeError("internal: the prepared call has no q, k or v")
    cdef fa_attention_args a
    cdef fa_plan pl
    cdef Forcing f = _current_forcing() if _n_forcing else None
    cdef int nl = len(lead)
    cdef int d
    cdef cnp.ndarray m_arr, l_arr
    if nl > FA_MAX_DIMS:
        raise ValueError(f"at most {FA_MAX_DIMS} leading dims")
    a.n_lead = nl
    for d in range(nl):
        a.lead_shape[d] = lead[d]
        a.m_lead[d] = 0
        a.lse_lead[d] = 0
        a.slope_lead[d] = 0
        a.kvl_lead[d] = 0
        a.qln_lead[d] = 0
        a.qst_lead[d] = 0
        a.kst_lead[d] = 0
    _lead_strides(q, nl, 2, a.q_lead)
    _lead_strides(k, nl, 2, a.k_lead)
    _lead_strides(v, nl, 2, a.v_lead)
    _lead_strides(out, nl, 2, a.o_lead)
    a.nq = q.shape[q.ndim - 2]
    a.dk = q.shape[q.ndim - 1]
    a.nk = k.shape[k.ndim - 2]
    a.dv = 0 if weights else v.shape[v.ndim - 1]
    if p.q_start is not None and p.n_q >= 0:
        a.nq = p.n_q
    if p.kv_start is not None and p.n_k >= 0:
        a.nk = p.n_k
    a.q_rs = _estride(q, q.ndim - 2)
    a.k_rs = _estride(k, k.ndim - 2)
    a.v_rs = _estride(v, v.ndim - 2)
    a.o_rs = _estride(out, out.ndim - 2)
    a.q = cnp.PyArray_DATA(q)
    a.k = cnp.PyArray_DATA(k)
    a.v = cnp.PyArray_DATA(v)
    a.out = cnp.PyArray_DATA(out)
    a.kv_dtype = _kv_code(q, k, v, weights)
    a.q_kv = a.kv_dtype != FA_KV_SAME and q.dtype == k.dtype   # 16-bit q, read as stored
    a.dtype = FA_F32 if a.q_kv else _dtype_code(q)
    a.mask_kind = p.mask_kind
    a.mask = NULL
    a.m_rs = 0
    a.m_cs = 0
    if p.mask_kind != FA_MASK_NONE:
        m_arr = <cnp.ndarray>p.mask
        _lead_strides(m_arr, nl, 2, a.m_lead)
        a.m_rs = 0 if m_arr.shape[m_arr.ndim - 2] == 1 else _estride(m_arr, m_arr.ndim - 2)
        a.m_cs = 0 if m_arr.shape[m_arr.ndim - 1] == 1 else _estride(m_arr, m_arr.ndim - 1)
        a.mask = cnp.PyArray_DATA(m_arr)
    a.lse = NULL
    a.lse_rs = 0
    if lse is not None:
        l_arr = <cnp.ndarray>lse
        for d in range(nl):
            a.lse_lead[d] = _estride(l_arr, d)
        a.lse_rs = _estride(l_arr, nl)
        a.lse = cnp.PyArray_DATA(l_arr)
    a.slopes = _per_lead(p.slopes, nl, a.slope_lead)
    a.kv_len = <const int64_t *>_per_lead(p.kvl, nl, a.kvl_lead)
    a.q_len = <const int64_t *>_per_lead(p.qln, nl, a.qln_lead)
    a.q_start = <const int64_t *>_per_lead(p.q_start, nl, a.qst_lead)
    a.kv_start = <const int64_t *>_per_lead(p.kv_start, nl, a.kst_lead)
    a.causal = p.causal
    a.top_left = p.top_left
    a.row_group = p.row_group
    a.scale = p.scale
    a.softcap = p.softcap
    a.win_left = p.win_left
    a.win_right = p.win_right
    a.num_threads = p.nthreads
    a.force = NULL
    a.stats = NULL
    if f is not None:
        a.force = &f.ov
        a.stats = &f.st
    if plan_only:
        _check(fa_attention_plan(&a, weights, &pl))
        return _plan_dict(&pl)
    cdef double work = float(a.nq) * float(a.nk) * float(a.dk + a.dv + 1)
    for d in range(nl):
        work *= a.lead_shape[d]
    cdef fa_backward_args b
    cdef cnp.ndarray do_arr, dq_arr, dk_arr, dv_arr
    if backward is not None:
        do_arr, dq_arr, dk_arr, dv_arr = backward
        _lead_strides(do_arr, nl, 2, b.do_lead)
        _lead_strides(dq_arr, nl, 2, b.dq_lead)
        _lead_strides(dk_arr, nl, 2, b.dk_lead)
        _lead_strides(dv_arr, nl, 2, b.dv_lead)
        b.do_rs = _estride(do_arr, do_arr.ndim - 2)
        b.dq_rs = _estride(dq_arr, dq_arr.ndim - 2)
        b.dk_rs = _estride(dk_arr, dk_arr.ndim - 2)
        b.dv_rs = _estride(dv_arr, dv_arr.ndim - 2)
        b.dout = cnp.PyArray_DATA(do_arr)
        b.dq = cnp.PyArray_DATA(dq_arr)
        b.dk = cnp.PyArray_DATA(dk_arr)
        b.dv = cnp.PyArray_DATA(dv_arr)
        b.do_kv = a.kv_dtype != FA_KV_SAME and do_arr.dtype == k.dtype   # 16-bit dO and out, read as stored
        b.o_kv = a.kv_dtype != FA_KV_SAME and out.dtype == k.dtype
        comp = np.dtype(np.float32 if a.dtype == FA_F32 else np.float64)
        for arr, name, stored in ((do_arr, "dout", b.do_kv), (out, "out", b.o_kv), (dq_arr, "dq", False),
                                  (dk_arr, "dk", False), (dv_arr, "dv", False)):
            if not stored and arr.dtype != comp:
                raise TypeError(f"internal: the backward's {name} of {arr.dtype} with a {comp} computation")
        _run(&a, 3, 2.5 * work, &b)
        return
    _run(&a, 1 if weights else 0, work)


cdef inline bint _plain_array(object x, int dtype):
    """x an ndarray (not a subclass) of native-order `dtype`, C-contiguous and
    aligned: what the C core reads as it is."""
    if type(x) is not cnp.ndarray:
        return False
    cdef cnp.ndarray a = <cnp.ndarray>x
    return (cnp.PyArray_TYPE(a) == dtype and cnp.PyArray_ISNOTSWAPPED(a)
            and cnp.PyArray_CHKFLAGS(a, cnp.NPY_ARRAY_C_CONTIGUOUS | cnp.NPY_ARRAY_ALIGNED))


def attention_plain(object q, object k, object v, object causal, object scale, object num_threads,
                    object layout):
    """fastattn.attention(q, k, v, causal=causal, scale=scale,
    num_threads=num_threads, layout=layout) with no other argument, for the
    commonest calls only: q, k and v ndarrays of one native float32 or float64
    dtype, C-contiguous and aligned, shaped (..., n_q, d_k), (..., n_k, d_k),
    (..., n_k, d_v) with the same leading dims (layout "bhld"), or (..., n_q,
    H, d_k), (..., n_k, H, d_k), (..., n_k, H, d_v) read through their (..., H,
    n, d) views (layout "blhd"); causal a bool, scale None or a finite float,
    num_threads None or a positive int.  The result, or None for any other
    call: the Python layer then checks, converts and raises its errors.  The
    same C call as that layer's, with its checks in C, where they were most of
    a small call's time."""
    if not (causal is True or causal is False) or type(layout) is not str:
        return None
    cdef bint blhd = layout == "blhd"
    if not blhd and layout != "bhld":
        return None
    if type(q) is not cnp.ndarray:
        return None
    cdef int t = cnp.PyArray_TYPE(<cnp.ndarray>q)
    if t != cnp.NPY_FLOAT32 and t != cnp.NPY_FLOAT64:
        return None
    if not (_plain_array(q, t) and _plain_array(k, t) and _plain_array(v, t)):
        return None
    cdef cnp.ndarray a = <cnp.ndarray>q, b = <cnp.ndarray>k, c = <cnp.ndarray>v
    cdef int n = a.ndim, d
    cdef int rows = n - 3 if blhd else n - 2   # the axis of n_q and n_k
    if n < 2 + blhd or b.ndim != n or c.ndim != n or n > FA_MAX_DIMS + 2:
        return None
    for d in range(n):   # k and v: all but d; q: all but n_q (and d_v)
        if (d != n - 1 and b.shape[d] != c.shape[d]) or (d != rows and a.shape[d] != b.shape[d]):
            return None
    cdef double s
    cdef int64_t d_k = a.shape[n - 1]
    if scale is None:   # reference.default_scale, inline so that this path makes no Python call (tests: equal)
        s = 1.0 / sqrt(<double>d_k) if d_k > 0 else 1.0
    elif type(scale) is float and isfinite(<double>scale):
        s = <double>scale
    else:
        return None
    cdef long nt = 0
    if num_threads is not None:
        if type(num_threads) is not int or num_threads <= 0:
            return None
        nt = fa_thread_cap() if num_threads >= fa_thread_cap() else <long>num_threads
    cdef cnp.npy_intp dims[FA_MAX_DIMS + 2]
    for d in range(n):
        dims[d] = a.shape[d]
    dims[n - 1] = c.shape[n - 1]
    cdef cnp.ndarray out = cnp.PyArray_EMPTY(n, dims, t, 0)
    if cnp.PyArray_SIZE(out) == 0:
        return out
    cdef cnp.ndarray target = out
    if blhd:   # the (..., H, n, d) views, as the C core reads heads first
        a, b, c = a.swapaxes(n - 3, n - 2), b.swapaxes(n - 3, n - 2), c.swapaxes(n - 3, n - 2)
        target = out.swapaxes(n - 3, n - 2)
    cdef Args p = Args.__new__(Args)
    p._set(a, b, c, None, FA_MASK_NONE, (<object>a).shape[:n - 2], causal is True, s, <int>nt, 0.0, -1, -1, None,
           None, None, False)
    _attention(p, target, None, False, False, None)
    return out


def softmax(cnp.ndarray x, cnp.ndarray out, int num_threads):
    """Softmax along the last axis of x into out (same shape, same dtype)."""
    cdef fa_softmax_args a
    cdef int nl = x.ndim - 1
    cdef int d
    if nl > FA_MAX_DIMS:
        raise ValueError(f"at most {FA_MAX_DIMS} leading dims")
    a.n_lead = nl
    for d in range(nl):
        a.lead_shape[d] = x.shape[d]
        a.x_lead[d] = _estride(x, d)
        a.o_lead[d] = _estride(out, d)
    a.n = x.shape[nl]
    a.x_s = _estride(x, nl)
    a.o_s = _estride(out, nl)
    a.x = cnp.PyArray_DATA(x)
    a.out = cnp.PyArray_DATA(out)
    a.dtype = _dtype_code(x)
    a.num_threads = num_threads
    _run(&a, 2, float(x.size) * 8)


def mask_keep(cnp.ndarray x, cnp.ndarray keep, double floor, int num_threads, cnp.ndarray pad=None,
              double pad_floor=float("-inf")):
    """keep[...] = (x == 0) for a C-contiguous float32 or float64 x (at least
    1-D) and a C-contiguous bool keep of x's shape; returns whether every entry
    of x is 0 or at most floor (<= 0; -inf: 0 and -inf only), with a 0 in each
    row (last axis) that holds a finite entry <= floor (see _mask_as_bool in
    _float_mask.py).  With pad (a C-contiguous bool array of x.shape[:-1]), a row
    without a 0 may instead hold one constant <= pad_floor throughout: pad
    marks those rows (True) and no others."""
    if (x.ndim == 0 or keep.size != x.size or keep.itemsize != 1 or not x.flags.c_contiguous
            or not keep.flags.c_contiguous or not keep.flags.writeable):
        raise ValueError("internal: mask_keep takes a C-contiguous x of at least one axis and a "
                         "C-contiguous, writeable bool keep of its size")
    cdef int64_t length = x.shape[x.ndim - 1]
    cdef int64_t rows = x.size // length if length else 0
    if pad is not None and (pad.size != rows or pad.itemsize != 1 or not pad.flags.c_contiguous
                            or not pad.flags.writeable):
        raise ValueError("internal: mask_keep's pad must be a C-contiguous, writeable bool array "
                         "with one entry per row of x")
    if not pad_floor <= 0:
        raise ValueError("internal: mask_keep's pad_floor must be <= 0")
    cdef int dt = _dtype_code(x)
    cdef const void *px = cnp.PyArray_DATA(x)
    cdef unsigned char *pk = <unsigned char *>cnp.PyArray_DATA(keep)
    cdef unsigned char *pp = <unsigned char *>cnp.PyArray_DATA(pad) if pad is not None else NULL
    cdef int ok = 0
    cdef int status
    with nogil:
        status = fa_mask_keep(dt, px, rows, length, floor, pk, pad_floor, pp, num_threads, &ok)
    _check(status)
    return ok != 0


def mask_as_bool(cnp.ndarray x, cnp.ndarray q, cnp.ndarray k, object v, double dk_scale, double slope_term,
                 bint try_neginf, bint allow_finite, double margin, double pad_absorb, cnp.ndarray keep,
                 cnp.ndarray pad, int num_threads):
    """The float-mask-as-bool check of one call in one threaded team (see
    _mask_as_bool in _float_mask.py and fa_mask_as_bool in src_c/scans.c): x the
    mask, q, k and v (None: no finite floor) C-contiguous arrays (q, k and v of
    one float dtype, the mask float32 or float64); keep (x's size) and pad (a byte per row of x) C-contiguous bool
    arrays that it fills.  Returns 0 (the mask stays float), 1 (keep holds the
    bool mask: 0 and -inf only) or 2 (keep and pad hold it: a finite floor)."""
    cdef int mdt = _dtype_code(x)
    cdef int dt = _dtype_code(q)
    if x.ndim == 0 or not x.flags.c_contiguous or not keep.flags.c_contiguous or keep.size != x.size \
            or keep.itemsize != 1 or not keep.flags.writeable:
        raise ValueError("internal: mask_as_bool takes a C-contiguous mask and a writeable bool keep of its size")
    cdef int64_t length = x.shape[x.ndim - 1]
    cdef int64_t rows = x.size // length if length else 0
    if pad.size != rows or pad.itemsize != 1 or not pad.flags.c_contiguous or not pad.flags.writeable:
        raise ValueError("internal: mask_as_bool's pad must be a writeable bool array of a byte per mask row")
    for a in (q, k) + ((v,) if v is not None else ()):
        if _dtype_code(a) != dt or not (<cnp.ndarray>a).flags.c_contiguous:
            raise ValueError("internal: mask_as_bool takes C-contiguous q, k, v of one dtype")
    cdef cnp.ndarray va = <cnp.ndarray>v if v is not None else q
    cdef const void *px = cnp.PyArray_DATA(x)
    cdef const void *pq = cnp.PyArray_DATA(q)
    cdef const void *pk = cnp.PyArray_DATA(k)
    cdef const void *pv = cnp.PyArray_DATA(va)
    cdef int64_t nq = q.size, nk = k.size, nv = va.size if v is not None else 0
    cdef unsigned char *pkeep = <unsigned char *>cnp.PyArray_DATA(keep)
    cdef unsigned char *ppad = <unsigned char *>cnp.PyArray_DATA(pad)
    cdef int mode = 0
    cdef int status
    cdef bint finite = allow_finite and v is not None
    with nogil:
        status = fa_mask_as_bool(dt, pq, nq, pk, nk, pv, nv, dk_scale, slope_term, try_neginf, finite,
                                 margin, pad_absorb, mdt, px, rows, length, pkeep, ppad, num_threads, &mode)
    _check(status)
    return mode


def abs_max(cnp.ndarray x, int num_threads):
    """max |x| of a C-contiguous float32 or float64 x, in one threaded pass: 0.0
    when x is empty, NaN when x holds a NaN (see _abs_max in _float_mask.py)."""
    if not x.flags.c_contiguous:
        raise ValueError("internal: abs_max takes a C-contiguous x")
    cdef int dt = _dtype_code(x)
    cdef const void *px = cnp.PyArray_DATA(x)
    cdef int64_t n = x.size
    cdef double out = 0
    cdef int status
    with nogil:
        status = fa_abs_max(dt, px, n, num_threads, &out)
    _check(status)
    return out


def merge(outs, lses, int num_threads):
    """merge_attention's rule (src_c/merge.c): outs, a sequence of C-contiguous,
    aligned (rows, d) arrays of one dtype, float32 or float64, and lses, their
    (rows) lse of that dtype; returns (out (rows, d), lse (rows)) of that dtype."""
    outs, lses = tuple(outs), tuple(lses)    # held while the GIL is released
    cdef Py_ssize_t n = len(outs), i
    if n < 1 or len(lses) != n or n > 2**31 - 1:
        raise ValueError("internal: merge takes one or more outs (fewer than 2^31) and as many lses")
    cdef cnp.ndarray o0 = outs[0]
    if o0.ndim != 2:
        raise ValueError("internal: merge takes (rows, d) outs")
    cdef int dt = _dtype_code(o0)
    cdef int64_t rows = o0.shape[0], d = o0.shape[1]
    for i in range(n):
        o, x = outs[i], lses[i]
        if (not isinstance(o, np.ndarray) or not isinstance(x, np.ndarray) or o.dtype != o0.dtype
                or x.dtype != o0.dtype or o.shape != (rows, d) or x.shape != (rows,)
                or not o.flags.c_contiguous or not x.flags.c_contiguous
                or not o.flags.aligned or not x.flags.aligned):
            raise ValueError("internal: merge takes C-contiguous, aligned (rows, d) outs and (rows) lses "
                             "of one dtype")
    cdef cnp.ndarray out = np.empty((rows, d), dtype=o0.dtype)
    cdef cnp.ndarray lse = np.empty((rows,), dtype=o0.dtype)
    cdef const void **po = <const void **>malloc(2 * n * sizeof(void *))
    if po == NULL:
        raise MemoryError()
    cdef const void **pl = po + n
    for i in range(n):
        po[i] = cnp.PyArray_DATA(<cnp.ndarray>outs[i])
        pl[i] = cnp.PyArray_DATA(<cnp.ndarray>lses[i])
    cdef void *pout = cnp.PyArray_DATA(out)
    cdef void *plse = cnp.PyArray_DATA(lse)
    cdef int status, ni = <int>n
    with nogil:
        status = fa_merge(dt, ni, po, pl, rows, d, pout, plse, num_threads)
    free(po)
    _check(status)
    return out, lse


def vexp(cnp.ndarray x, bint neg=False):
    """The SIMD exp of the chosen path, elementwise (for the tests); with
    neg=True the attention kernels' variant for arguments <= 0.
    x: 1-D contiguous float32 or float64."""
    cdef cnp.ndarray y = cnp.PyArray_EMPTY(1, x.shape, x.dtype.num, 0)
    cdef int dt = _dtype_code(x)
    cdef int64_t n = x.shape[0]
    with nogil:
        fa_exp(dt, neg, cnp.PyArray_DATA(x), cnp.PyArray_DATA(y), n)
    return y


def kv_widen(cnp.ndarray x):
    """The chosen path's widening of 16-bit K and V to float32, elementwise (for
    the tests).  x: 1-D contiguous float16 or bfloat16."""
    if x.ndim != 1 or not cnp.PyArray_IS_C_CONTIGUOUS(x):
        raise ValueError("kv_widen: a 1-D contiguous array")
    cdef int code = 0
    if x.dtype.isnative:
        code = FA_KV_F16 if x.dtype.num == cnp.NPY_FLOAT16 else FA_KV_BF16 if _is_bf16(x.dtype) else 0
    if code == 0:
        raise TypeError(f"kv_widen: float16 or bfloat16, not {x.dtype}")
    cdef cnp.ndarray y = cnp.PyArray_EMPTY(1, x.shape, cnp.NPY_FLOAT32, 0)
    cdef int64_t n = x.shape[0]
    with nogil:
        fa_kv_widen(code, cnp.PyArray_DATA(x), <float *>cnp.PyArray_DATA(y), n)
    return y


def _stream_read(cnp.ndarray buf, int num_threads=0):
    """Read buf once, as a plain streaming read on num_threads threads (0: the
    default): the benchmark's memory-bandwidth ceiling.  buf: C-contiguous,
    16-byte aligned, its size in bytes a multiple of 64.  Returns a checksum."""
    if not cnp.PyArray_IS_C_CONTIGUOUS(buf) or buf.nbytes % 64 or cnp.PyArray_DATA(buf) == NULL \
            or <size_t>cnp.PyArray_DATA(buf) % 16:
        raise ValueError("_stream_read needs a C-contiguous, 16-byte aligned buffer of a multiple of 64 bytes")
    cdef const void *p = cnp.PyArray_DATA(buf)
    cdef int64_t n = buf.nbytes
    cdef uint64_t r
    with nogil:
        r = fa_stream_read(p, n, num_threads)
    return r


_forcing_local = threading.local()
cdef int _n_forcing = 0      # open forcing blocks on any thread: the calls look for theirs only then
_OVERRIDES = ("bq", "bk", "rows_max", "pipe_rows", "fuse", "stream", "far", "decode_pf", "group", "group_touch",
              "mask_pack", "head_turns", "mask_cache", "split_keys", "parts_bytes")


cdef class Forcing:
    """Overrides of the plan (fastattn.h: fa_overrides) for the attention calls
    that this thread makes inside ``with forcing(...)``, and what those calls ran.
    Tests and tuning only.  Sizes 0 and switches -1 leave the plan's choice:
      bq, bk       the tiled kernel's query rows per item and keys per tile (the
                   backward's query rows a block and keys a unit)
      rows_max     the most query rows that take the row kernel (at most 24; set,
                   it also turns off rows_full and the tail)
      pipe_rows    up to this many rows take the row kernel's pipelined loop,
                   K and V read together (1: decoding only)
      fuse         the tiled kernel's fused exp (1 on, 0 off)
      stream       the row kernel's prefetch across passes (and the far prefetch,
                   unless far is set)
      far          the row kernel's far prefetch into L2
      decode_pf    decoding's prefetch of the K and V rows it reads (one row)
      group        the group kernel over the heads of a (B, n, H, d) cache (1:
                   wherever it can run, 0: never; -1: from memory only)
      group_touch  the group kernel reads its next tile ahead by loads, not by
                   software prefetch (1 on, 0 off)
      mask_pack    a bool mask packed to bits for the tiled kernel
      head_turns   the tiled kernel's items by query block, the heads in turn (a
                   float mask they share)
      mask_cache   ... and the first item on a block's mask rows keeps its tiles
                   transposed for the next (1: whatever their size)
      split_keys   rows of more keys are split (0: 2^20)
      parts_bytes  the split partials of one wave (0: 256 MiB)
    The counts, over the calls of the block: group_runs (item groups the group
    kernel ran), tail_rows (query rows the row kernel ran as the tiled kernel's
    tails), redo_rows (rows recomputed carefully after a non-finite result),
    kv_widened (16-bit key rows the tiled and weights kernels widened), chunk_rows
    (query rows the group kernel ran in chunks of keys, group_chunks)."""
    cdef fa_overrides ov
    cdef fa_stats st

    def __cinit__(self):
        self.ov.bq = self.ov.bk = self.ov.rows_max = self.ov.pipe_rows = 0
        self.ov.fuse = self.ov.stream = self.ov.far = self.ov.decode_pf = self.ov.group = self.ov.mask_pack = -1
        self.ov.head_turns = self.ov.group_touch = self.ov.mask_cache = -1
        self.ov.split_keys = self.ov.parts_bytes = 0
        self.st.group_runs = self.st.tail_rows = self.st.redo_rows = self.st.kv_widened = self.st.chunk_rows = 0

    def set(self, **overrides):
        """Change some overrides (names as above); returns self."""
        for name, value in overrides.items():
            if name not in _OVERRIDES:
                raise TypeError(f"forcing: no override named {name!r}")
            value = int(value)
            size, switch = max(value, 0), (-1 if value < 0 else int(value != 0))
            if name == "bq":
                self.ov.bq = size
            elif name == "bk":
                self.ov.bk = size
            elif name == "rows_max":
                self.ov.rows_max = size
            elif name == "pipe_rows":
                self.ov.pipe_rows = size
            elif name == "split_keys":
                self.ov.split_keys = size
            elif name == "parts_bytes":
                self.ov.parts_bytes = size
            elif name == "fuse":
                self.ov.fuse = switch
            elif name == "stream":
                self.ov.stream = switch
            elif name == "far":
                self.ov.far = switch
            elif name == "decode_pf":
                self.ov.decode_pf = switch
            elif name == "group":
                self.ov.group = switch
            elif name == "group_touch":
                self.ov.group_touch = switch
            elif name == "head_turns":
                self.ov.head_turns = switch
            elif name == "mask_cache":
                self.ov.mask_cache = switch
            else:
                self.ov.mask_pack = switch
        return self

    @property
    def overrides(self):
        return {"bq": self.ov.bq, "bk": self.ov.bk, "rows_max": self.ov.rows_max, "pipe_rows": self.ov.pipe_rows,
                "fuse": self.ov.fuse,
                "stream": self.ov.stream, "far": self.ov.far, "decode_pf": self.ov.decode_pf, "group": self.ov.group,
                "group_touch": self.ov.group_touch, "mask_pack": self.ov.mask_pack, "head_turns": self.ov.head_turns,
                "mask_cache": self.ov.mask_cache,
                "split_keys": self.ov.split_keys, "parts_bytes": self.ov.parts_bytes}

    @property
    def group_runs(self):
        return self.st.group_runs

    @property
    def tail_rows(self):
        return self.st.tail_rows

    @property
    def redo_rows(self):
        return self.st.redo_rows

    @property
    def kv_widened(self):
        return self.st.kv_widened

    @property
    def chunk_rows(self):
        return self.st.chunk_rows

    def reset_counts(self):
        self.st.group_runs = self.st.tail_rows = self.st.redo_rows = self.st.kv_widened = self.st.chunk_rows = 0

    def __enter__(self):
        global _n_forcing
        stack = getattr(_forcing_local, "stack", None)
        if stack is None:
            stack = _forcing_local.stack = []
        stack.append(self)
        _n_forcing += 1
        return self

    def __exit__(self, *exc):
        global _n_forcing
        _forcing_local.stack.remove(self)
        _n_forcing -= 1
        return False


def forcing(**overrides):
    """A Forcing block: this thread's attention calls inside ``with forcing(...)
    as f`` take the overrides (those of an enclosing block too, unless named
    again), and f counts what they ran.  Tests and tuning only."""
    cdef Forcing f = Forcing()
    cdef Forcing outer = _current_forcing()
    if outer is not None:
        f.ov = outer.ov
    return f.set(**overrides)


cdef Forcing _current_forcing():
    stack = getattr(_forcing_local, "stack", None)
    return stack[len(stack) - 1] if stack else None   # (wraparound is off)


def plan(*args, **kwargs):
    """The plan of an attention call (src_c/plan.c) as a dict, computed and not
    run: attention(*args, plan_only=True, **kwargs).  Its fields: kernel
    ("tiled", "rows", "group", "weights"), the tiles (bq, bk, bqp, ld), the
    switches (fuse, stream, far, pf_l1, spread, decode_pf, inorder, pipe_pf_l2, group_touch,
    chunks_rows), the thresholds that applied (lanes, rows_max, rows_full, tail_max,
    pipe_rows), the tail (tail, q_main), K and V (kv_bytes, from_memory; kv_rows:
    the 16-bit keys a thread keeps widened at a time, 0 for none), the work (n_lead, n_qb,
    n_items, group, n_groups, n_splits, long_splits, chunk, wave, few), mask_pack,
    head_turns, mask_cache (a float mask's tiles kept for the next head), threads and
    scratch_elems."""
    return attention(*args, plan_only=True, **kwargs)


def gqa_fold(int64_t n_q, int64_t kv_bytes):
    """GQA: whether a group's query heads of n_q rows each become the rows of one
    work item over their K and V (kv_bytes in all), on the SIMD path in use."""
    return bool(fa_gqa_fold(n_q, kv_bytes))


# the fields of a tuning table (src_c/internal.h, fa_tuning): {float32, float64} pairs first
TUNING_PAIRS = ("rows_max", "rows_max_big", "rows_max_dk", "rows_max_big_dk", "rows_full", "tail_max", "decode_pf",
                "group_rows", "pipe_rows")   # two int each
# the other fields and the bits of their C types
_TUNING_BITS = {"rows_full_dk": 32, "rows_max_kv": 32, "tail_mem": 32, "tile_pf_l1": 32, "tile_spread": 32,
                "pipe_pf_l2": 32, "decode_far": 32, "decode_inorder": 32,
                "fuse": 32, "stream": 32, "bk_tiled": 32, "bk_tiled_mem": 32, "bq_tiled": 32, "q_tile_bytes": 32,
                "q_tile_bytes_band": 32, "bk_rows": 32, "bk_decode": 32, "group_bk_max": 32, "group_tile_bytes": 64,
                "group_touch": 32, "group_chunks_rows": 32, "fold_rows": 32, "fold_rows_big": 32,
                "fold_big_bytes": 64, "kv_mem_bytes": 64, "kv_far_bytes": 64, "bwd_bq": 32, "bwd_bk": 32}
TUNING_FIELDS = TUNING_PAIRS + tuple(_TUNING_BITS)


cdef dict _tuning_dict(const fa_tuning *t):
    cdef dict d = t[0]      # Cython's struct-to-dict conversion: name as bytes, pairs as lists
    d["name"] = d["name"].decode(errors="replace")
    for key in TUNING_PAIRS:
        d[key] = tuple(d[key])
    for key in ("fuse", "stream", "group_touch", "group_chunks_rows", "tail_mem", "tile_pf_l1", "tile_spread",
                "pipe_pf_l2", "decode_far", "decode_inorder"):
        d[key] = bool(d[key])
    return d


def isa_table():
    """The tuning the plan reads (src_c/dispatch.c; fastattn.tune may have
    replaced it), with the SIMD path's lanes: {float32, float64} pairs as
    tuples (tests take their thresholds from here and from plans, never from a
    copy)."""
    d = _tuning_dict(fa_tuning_current())
    d["isa"] = fa_isa_current().name.decode()
    d["lanes"] = tuple(fa_isa_current().lanes)
    return d


def builtin_tuning():
    """The built-in tuning of the SIMD path in use on this CPU (its own table, or
    the path's default), whatever set_tuning put in its place."""
    cdef fa_tuning t
    fa_tuning_builtin(&t)
    return _tuning_dict(&t)


cdef object _tuning_int(str key, object value, object bits):
    """value as a Python int of at most `bits` bits (signed); ValueError naming key."""
    if not isinstance(value, numbers.Integral):
        raise ValueError(f"tuning: {key} must be an integer, got {value!r}")
    v = int(value)
    if not -(1 << (bits - 1)) <= v < (1 << (bits - 1)):
        raise ValueError(f"tuning: {key} is out of range: {v}")
    return v


cdef object _tuning_value(str key, object value):
    """value checked for field key, as the struct conversion takes it (None: a key
    of isa_table's that is not a field); ValueError naming key."""
    if key == "name":
        return str(value).encode("ascii", "replace")[:31]   # (char: signed on x86)
    if key in TUNING_PAIRS:
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise ValueError(f"tuning: {key} must be a (float32, float64) pair, got {value!r}")
        return [_tuning_int(key, x, 32) for x in value]
    if key in _TUNING_BITS:
        return _tuning_int(key, value, _TUNING_BITS[key])
    if key in ("isa", "lanes"):
        return None
    raise ValueError(f"tuning: no field named {key!r}")


cdef fa_tuning _tuning_with(dict fields):
    """The built-in table with the checked `fields` in place."""
    cdef fa_tuning t
    fa_tuning_builtin(&t)
    cdef dict d = t
    for key, value in fields.items():
        value = _tuning_value(key, value)
        if value is not None:
            d[key] = value
    d["name"] = d["name"].ljust(sizeof(t.name), b"\0")   # the conversion takes the whole array
    t = d
    return t


def set_tuning(dict fields):
    """Replace the tuning in use: the built-in table with `fields` in its place
    (names as isa_table's; "name" at most 31 ASCII characters).  ValueError naming the
    field if one is unknown, not an integer (a pair of them) or out of range
    (nothing changes)."""
    cdef fa_tuning t = _tuning_with(fields)
    cdef fa_tuning one
    if fa_tuning_check(&t) != FA_OK:
        for key, value in fields.items():     # name the field
            one = _tuning_with({key: value})
            if fa_tuning_check(&one) != FA_OK:
                raise ValueError(f"tuning: {key} is out of range: {value!r}")
        raise ValueError(f"tuning: the fields are out of range together: {fields!r}")
    fa_tuning_set(&t)


def reset_tuning():
    """Go back to the built-in tuning of this CPU."""
    fa_tuning_reset()


def cpu_info():
    """What CPUID says about this CPU: vendor, brand, family, model, stepping,
    one core's L2 and the L3 in bytes (0: unknown; vendor "": not x86)."""
    cdef fa_cpu c
    fa_cpu_info(&c)
    return {"vendor": c.vendor.decode(errors="replace"), "brand": c.brand.decode(errors="replace").strip(),
            "family": c.family, "model": c.model, "stepping": c.stepping,
            "l2_bytes": c.l2_bytes, "l3_bytes": c.l3_bytes}


_KERNELS = {FA_KERNEL_TILED: "tiled", FA_KERNEL_ROWS: "rows", FA_KERNEL_WEIGHTS: "weights"}


cdef dict _plan_dict(const fa_plan *p):
    return {
        "kernel": "group" if p.group else _KERNELS[p.kernel],
        "isa": fa_isa_name().decode(),
        "bq": p.tiles.bq, "bk": p.tiles.bk, "bqp": p.tiles.bqp, "ld": p.tiles.ld,
        "fuse": bool(p.tiles.fuse), "stream": bool(p.tiles.stream), "far": bool(p.tiles.far),
        "pf_l1": bool(p.tiles.pf_l1), "spread": bool(p.tiles.spread), "decode_pf": bool(p.tiles.decode_pf),
        "inorder": bool(p.tiles.inorder),
        "pipe_rows": p.tiles.pipe_rows, "pipe_pf_l2": bool(p.tiles.pipe_pf_l2),
        "group_touch": bool(p.tiles.group_touch),
        "chunks_rows": bool(p.tiles.chunks_rows),
        "kv_rows": p.tiles.kv_rows, "lanes": p.lanes, "rows_max": p.rows_max,
        "rows_full": (p.full_lo, p.full_hi) if p.full_lo <= p.full_hi else None,
        "tail_max": p.tail_max,
        "tail": bool(p.tail), "q_main": p.tiles.q_main,
        "kv_bytes": p.kv_bytes, "from_memory": bool(p.from_memory), "few": bool(p.few),
        "group": p.group, "n_groups": p.n_groups, "n_lead": p.n_lead, "n_qb": p.n_qb,
        "n_items": p.n_items, "n_splits": p.n_splits, "long_splits": p.long_splits,
        "chunk": p.chunk, "wave": p.wave, "mask_pack": bool(p.mask_pack), "head_turns": p.head_turns,
        "mask_cache": bool(p.tiles.mt_off),
        "threads": p.threads,
        "scratch_elems": p.scratch_elems, "work": p.work,
    }


def isa_name():
    return fa_isa_name().decode()


def set_isa(str name):
    """Choose the SIMD path; ValueError if this CPU or build cannot run it."""
    if fa_set_isa(name.encode()) != FA_OK:
        raise ValueError(f"SIMD path {name!r} is not available on this CPU or build")


def isa_available(str name):
    return bool(fa_isa_available(name.encode()))


def openmp_enabled():
    return bool(fa_openmp_enabled())


def last_threads():
    """Threads the calling thread's last call to the C core ran on (0: it had
    nothing to compute, and ran none)."""
    return fa_last_threads()


def openmp_library():
    """Path of the OpenMP runtime library the core uses ("none" without OpenMP)."""
    return fa_openmp_library().decode(errors="replace")


def build_info():
    """Compiler, compile flags and OpenMP version of the C core."""
    return fa_build_info().decode(errors="replace")


def max_threads():
    """The OpenMP default team size of the calling thread, at most thread_cap() (1
    without OpenMP, and in a process forked where GNU libgomp's pool could not be
    freed: see fork_serial)."""
    return fa_max_threads()


def thread_cap():
    """The most threads a call starts: 4 a CPU (at least 8), at most 1024 and the
    OpenMP runtime's thread limit.  A larger num_threads or OMP_NUM_THREADS is
    capped to it (a runtime asked for tens of thousands of threads crashes)."""
    return fa_thread_cap()


def fork_serial():
    """True in a process forked while GNU libgomp had a pool of threads that could not
    be freed before the fork (a libgomp older than GCC 9, or a fork from inside a
    team): libgomp cannot start a team there, so every call runs on one thread."""
    return bool(fa_fork_serial())
