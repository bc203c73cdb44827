"""Optional peers of the benchmark (``fastattn-bench --peers``): ONNX Runtime's
``com.microsoft`` MultiHeadAttention op and OpenVINO's scaled_dot_product_attention
op, each built once per workload as a one-node model on the workload's arrays,
on the same threads, in float32 (OpenVINO pinned to f32: its default can be
lower on CPUs with bf16 units); and llama.cpp's ggml_flash_attn_ext (ggml-python),
the peer of the 16-bit K and V rows (and of the plain float32 rows it can run).

Grouped-query attention goes to ONNX Runtime's GroupQueryAttention op, as a
decoder runs it: the keys but the last n_q as its KV cache (past_key and
past_value, (B, H_kv, n_k, d), bound by IOBinding to the same buffers as the
present outputs, so that the cache is not copied), the last n_q as the new
tokens; always causal, so for one query row or causal rows.

Each maker returns a zero-argument call that returns the output as
(B, H, n_q, d_v), or None where the peer is not installed or cannot run the
workload as fastattn does: float64, GQA (OpenVINO; ONNX Runtime without a
causal mask or one row), windows, softcap, ALiBi, lengths, packed sequences,
causal with n_q != n_k (their causal masks align top-left; GQA excepted), NaN
in K or V, 16-bit K and V (but ggml); ggml runs no mask and no causal rows
here.  The inputs go in each peer's own layout, converted before timing, as a
user of that peer would hold them.
"""

import functools
import importlib
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

PEERS = ("torch", "onnxruntime", "openvino", "ggml")
_UNSUPPORTED = ("window", "softcap", "alibi", "kv_lengths", "q_lengths", "packed", "kv", "qkv")


def _supported(w: dict, name: str) -> bool:
    B, H, nq, nk, d = w["shape"]
    if name == "ggml":   # ggml_flash_attn_ext: no mask, no causal here; K and V float32 or 16-bit
        extra = set(k for k, x in w["options"].items() if x) - {"gqa", "kv"}
        return w["dtype"] == "float32" and not extra and w["mask"] is None and not w["causal"]
    if w["dtype"] != "float32" or any(w["options"].get(o) for o in _UNSUPPORTED) or w["mask"] == "pad":
        return False
    if w["options"].get("gqa"):   # ONNX Runtime's GroupQueryAttention: no mask, causal bottom-right
        return name == "onnxruntime" and w["mask"] is None and (nq == 1 or bool(w["causal"])) and nq <= nk
    return not w["causal"] or nq == nk


def _bias(mask: Optional[np.ndarray]) -> Optional[np.ndarray]:
    """A mask as an additive float32 bias (0 or -inf for a bool mask)."""
    if mask is None:
        return None
    m = np.asarray(mask)
    if m.dtype == bool:
        return np.where(m, np.float32(0), np.float32(-np.inf)).astype(np.float32)
    return m.astype(np.float32)


def _onnxruntime(w: dict, inputs: Any, threads: int, ort: Any, onnx: Any) -> Callable[[], np.ndarray]:
    """ONNX Runtime's MultiHeadAttention (inputs (B, n, H d); unidirectional=1 for causal)."""
    TensorProto, helper = onnx.TensorProto, onnx.helper
    q, k, v, mask, kw = inputs
    B, H, nq, nk, d = w["shape"]
    dv = v.shape[-1]
    blhd = kw.get("layout") == "blhd"

    def packed(a):   # (B, H, n, d) or (B, n, H, d) -> (B, n, H d)
        a = a if blhd else np.swapaxes(a, 1, 2)
        return np.ascontiguousarray(a).reshape(a.shape[0], a.shape[1], -1)
    feeds = {"q": packed(q), "k": packed(k), "v": packed(v)}
    names = ["q", "k", "v"]
    shapes = {"q": [B, nq, H * d], "k": [B, nk, H * d], "v": [B, nk, H * dv]}
    bias = _bias(mask)
    if bias is not None:
        bias = np.ascontiguousarray(np.broadcast_to(bias, np.broadcast_shapes(bias.shape, (1, 1, nq, nk))))
        feeds["bias"] = bias
        shapes["bias"] = list(bias.shape)
        names += ["", "", "bias"]     # (projection bias, key_padding_mask) unused; attention_bias
    node = helper.make_node("MultiHeadAttention", names, ["out"], domain="com.microsoft", num_heads=H,
                            unidirectional=int(bool(w["causal"])))
    graph = helper.make_graph([node], "mha",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, shapes[n]) for n in feeds],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [B, nq, H * dv])])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return lambda: sess.run(None, feeds)[0].reshape(B, nq, H, dv).transpose(0, 2, 1, 3)


def _onnxruntime_gqa(w: dict, inputs: Any, threads: int, ort: Any, onnx: Any) -> Callable[[], np.ndarray]:
    """ONNX Runtime's GroupQueryAttention (query (B, n_q, H d); the KV cache
    (B, H_kv, n_k, d) shared between past and present: see the module docstring)."""
    TensorProto, helper = onnx.TensorProto, onnx.helper
    q, k, v, mask, kw = inputs
    B, H, nq, nk, d = w["shape"]
    blhd = kw.get("layout") == "blhd"
    heads_first = (lambda a: np.ascontiguousarray(np.swapaxes(a, 1, 2))) if blhd else np.ascontiguousarray
    qh, kh, vh = heads_first(q), heads_first(k), heads_first(v)          # (B, H or H_kv, n, d)
    Hkv, dv = kh.shape[1], vh.shape[-1]

    def tokens(a):   # (B, h, n, d) -> (B, n, h d)
        return np.ascontiguousarray(np.swapaxes(a, 1, 2)).reshape(a.shape[0], a.shape[2], -1)
    feeds = {"query": tokens(qh), "key": tokens(kh[:, :, nk - nq:]), "value": tokens(vh[:, :, nk - nq:]),
             "past_key": kh.copy(), "past_value": vh.copy(),
             "seqlens_k": np.full((B,), nk - 1, np.int32), "total_sequence_length": np.array(nk, np.int32)}
    node = helper.make_node("GroupQueryAttention", list(feeds), ["out", "present_key", "present_value"],
                            domain="com.microsoft", num_heads=H, kv_num_heads=Hkv)
    ins = [helper.make_tensor_value_info(n, TensorProto.INT32 if a.dtype == np.int32 else TensorProto.FLOAT,
                                         list(a.shape)) for n, a in feeds.items()]
    outs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, [B, nq, H * dv]),
            helper.make_tensor_value_info("present_key", TensorProto.FLOAT, list(feeds["past_key"].shape)),
            helper.make_tensor_value_info("present_value", TensorProto.FLOAT, list(feeds["past_value"].shape))]
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(helper.make_graph([node], "gqa", ins, outs), opset_imports=opsets, ir_version=10)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    io = sess.io_binding()
    values = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in feeds.items()}
    for n, val in values.items():
        io.bind_ortvalue_input(n, val)
    out = np.empty((B, nq, H * dv), np.float32)
    io.bind_output("out", "cpu", 0, np.float32, list(out.shape), out.ctypes.data)
    io.bind_ortvalue_output("present_key", values["past_key"])      # the cache in place: no copy
    io.bind_ortvalue_output("present_value", values["past_value"])

    def call():
        sess.run_with_iobinding(io)
        return out.reshape(B, nq, H, dv).transpose(0, 2, 1, 3)
    return call


def _openvino(w: dict, inputs: Any, threads: int, ov: Any, ops: Any) -> Callable[[], np.ndarray]:
    """OpenVINO's scaled_dot_product_attention op (inputs (B, H, n, d)), f32."""
    q, k, v, mask, kw = inputs
    heads_first = (lambda a: np.ascontiguousarray(np.swapaxes(a, 1, 2))) if kw.get("layout") == "blhd" \
        else np.ascontiguousarray
    arrays = [heads_first(a) for a in (q, k, v)]
    params = [ops.parameter(list(a.shape), ov.Type.f32) for a in arrays]
    bias = _bias(mask)
    args = list(params)
    if bias is not None:
        arrays.append(np.ascontiguousarray(bias))
        params.append(ops.parameter(list(bias.shape), ov.Type.f32))
        args.append(params[-1])
    node = ops.scaled_dot_product_attention(*args, causal=bool(w["causal"]))
    model = ov.Model([node], params)
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": threads,
                                                       "INFERENCE_PRECISION_HINT": "f32"})
    req = compiled.create_infer_request()

    def call():
        req.infer(arrays)
        return req.get_output_tensor(0).data
    return call


def _ggml(w: dict, inputs: Any, threads: int, ggml: Any) -> Callable[[], np.ndarray]:
    """llama.cpp's ggml_flash_attn_ext through ggml-python, on the CPU, as llama.cpp
    runs it: float32 q, K and V as stored (float32, float16 or bfloat16; with 16-bit
    K and V it rounds q to 16 bits too), GQA by broadcasting K and V's heads.  The
    arrays are copied into a ggml context once; a call computes the one-node graph."""
    import ctypes
    import weakref
    q, k, v, _, _ = inputs
    B, H, nq, d = q.shape
    Hkv, nk, dv = k.shape[1], k.shape[2], v.shape[-1]
    types = {"float32": ggml.GGML_TYPE_F32, "float16": ggml.GGML_TYPE_F16, "bfloat16": ggml.GGML_TYPE_BF16}
    kt = types[str(k.dtype)]
    mem = (q.nbytes + k.nbytes + v.nbytes + 4 * B * H * nq * dv + 8 * ggml.ggml_tensor_overhead()
           + ggml.ggml_graph_overhead() + (1 << 20))   # the tensors, their headers, the graph
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=mem, mem_buffer=None, no_alloc=False))
    tq = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F32, d, nq, H, B)   # ggml's dims: fastest first
    tk = ggml.ggml_new_tensor_4d(ctx, kt, d, nk, Hkv, B)
    tv = ggml.ggml_new_tensor_4d(ctx, kt, dv, nk, Hkv, B)
    for t, a in ((tq, q), (tk, k), (tv, v)):
        ctypes.memmove(ggml.ggml_get_data(t), np.ascontiguousarray(a).ctypes.data, a.nbytes)
    node = ggml.ggml_flash_attn_ext(ctx, tq, tk, tv, None, 1 / np.sqrt(d), 0.0, 0.0)
    graph = ggml.ggml_new_graph(ctx)
    ggml.ggml_build_forward_expand(graph, node)
    res = np.ctypeslib.as_array(ctypes.cast(ggml.ggml_get_data(node), ctypes.POINTER(ctypes.c_float)),
                                shape=(B, nq, H, dv))

    plan = ggml.ggml.ggml_graph_plan(graph, threads, None)   # its work buffer, once (not one a call)
    work = np.empty(max(int(plan.work_size), 1), np.uint8)
    plan.work_data = work.ctypes.data_as(ctypes.POINTER(ctypes.c_ubyte))

    def call():
        ggml.ggml_graph_compute(graph, ctypes.byref(plan))
        return res.transpose(0, 2, 1, 3)
    call.keep = work   # type: ignore[attr-defined]
    weakref.finalize(call, ggml.ggml_free, ctx)
    return call


# each peer: its builder and the modules it needs
_PEERS: Dict[str, Tuple[Callable[..., Callable[[], np.ndarray]], Tuple[str, ...]]] = {
    "onnxruntime": (_onnxruntime, ("onnxruntime", "onnx")),
    "openvino": (_openvino, ("openvino", "openvino.opset13")),
    "ggml": (_ggml, ("ggml",))}
# how closely each peer's output must agree with fastattn's (max |difference| over max(1,
# max |output|)) to be timed: ggml rounds q to 16 bits beside 16-bit K and V
TOLERANCE = {"ggml": 1e-2}


def make_call(name: str, w: dict, inputs: Any, threads: int) -> Optional[Callable[[], np.ndarray]]:
    """Peer `name`'s call on workload w (see the module docstring), or None."""
    if not _supported(w, name):
        return None
    build, modules = _PEERS[name]
    if name == "onnxruntime" and w["options"].get("gqa"):
        build = _onnxruntime_gqa
    try:
        mods = [importlib.import_module(m) for m in modules]
    except ImportError:
        return None
    return build(w, inputs, threads, *mods)


MAKERS = {name: functools.partial(make_call, name) for name in _PEERS}
