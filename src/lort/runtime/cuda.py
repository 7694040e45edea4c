"""CUDA specifics of running ORT sessions beside PyTorch: stream order and TF32.

Stream order. ORT's CUDA execution provider runs its kernels on streams of its own, so
it could read a bound input before the PyTorch kernel on the current stream that
writes it has finished (measured on an H100: relative errors of 0.9 to 1.6 with a long
matmul right before the call). lort gives every session of a device one stream it
owns, as the provider's ``user_compute_stream`` (ORT ignores a null one, and PyTorch's
default stream is null, so PyTorch's own stream cannot be passed), and orders it with
PyTorch's current stream on each run, with no host synchronization:

    lort_stream.wait_stream(current)    # inputs written before ORT reads them
    run (RunOptions disable_synchronize_execution_providers=1: no end-of-run sync)
    current.wait_stream(lort_stream)    # outputs written before PyTorch reads them

Memory ORT still reads is safe from PyTorch's caching allocator: a freed block is
reused only by work ordered on the stream that allocated it, and that stream waits for
lort's stream after every run.

TF32. ORT's CUDA provider uses TF32 for float32 GEMMs and convolutions unless told not
to (``use_tf32``), where PyTorch does not by default for matmuls. PyTorch has a flag for
each (``torch.backends.cuda.matmul.allow_tf32`` or ``torch.set_float32_matmul_precision``
"high"/"medium" for matmuls, ``torch.backends.cudnn.allow_tf32`` for convolutions, on by
default); ORT has one switch for a session. So a group's session uses TF32 where PyTorch
allows it for every kind of TF32 work the group has (``tf32_kinds``): a group of
convolutions alone follows the cuDNN flag (PyTorch's defaults: TF32, as eager's
convolutions), one of matmuls alone the matmul flag, one with both needs both, and one
with neither never uses it. Where the two flags differ when a graph is compiled, the
fuser puts convolutions and matmuls in groups of their own (``tf32_flags_differ``), so
each kind gets the precision PyTorch gives it. The flag is part of a session's key:
changing PyTorch's setting builds (or reuses) the matching session.
"""

from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_streams: dict[int, "torch.cuda.Stream"] = {}


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def lort_stream(index: int) -> "torch.cuda.Stream":
    """The stream every lort session on CUDA device ``index`` runs on (made once)."""
    stream = _streams.get(index)
    if stream is None:
        with _lock:
            stream = _streams.get(index)
            if stream is None:
                stream = _streams[index] = torch.cuda.Stream(device=index)
    return stream


#: ATen ops whose float32 work ORT runs as cuDNN convolutions, and as cuBLAS GEMMs.
_CONVOLUTIONS = frozenset({"aten::convolution", "aten::convolution_backward", "aten::_convolution",
                           "aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::conv_transpose1d",
                           "aten::conv_transpose2d", "aten::conv_transpose3d"})
_MATMULS = frozenset({"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm", "aten::matmul",
                      "aten::linear", "aten::mv", "aten::addmv", "aten::dot", "aten::vdot", "aten::einsum",
                      "aten::tensordot", "aten::_scaled_dot_product_flash_attention",
                      "aten::_scaled_dot_product_efficient_attention", "aten::scaled_dot_product_attention",
                      "aten::_scaled_dot_product_attention_math", "aten::_scaled_dot_product_cudnn_attention"})
CUDNN, MATMUL = "cudnn", "matmul"


def tf32_kind(node: torch.fx.Node) -> str | None:
    """``CUDNN`` for a float32 convolution, ``MATMUL`` for a float32 GEMM, None for any
    other node (TF32 concerns float32 only: autocast's float16 and bfloat16 work has no
    kind). An op missing from both lists counts as neither: its session then uses TF32
    only where the listed ops allow it, or never (float32 precision, never less)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return None
    kind = CUDNN if schema.name in _CONVOLUTIONS else MATMUL if schema.name in _MATMULS else None
    if kind is None:
        return None
    val = next((a.meta.get("val") for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)),
               None)
    return kind if val is None or val.dtype == torch.float32 else None


def tf32_kinds(gm: torch.fx.GraphModule) -> frozenset:
    """The kinds of TF32 work a group's graph has (``tf32_kind`` of its nodes)."""
    return frozenset(k for k in map(tf32_kind, gm.graph.nodes) if k is not None)


def tf32_flags_differ() -> bool:
    """Whether PyTorch allows TF32 for one of matmuls and convolutions and not the other
    right now (its defaults: convolutions only). A group holding both would then run
    both in float32 (ORT's one switch), so the fuser keeps them in groups of their own."""
    return tf32_enabled(frozenset({MATMUL})) != tf32_enabled(frozenset({CUDNN}))


def tf32_enabled(kinds: frozenset = frozenset({CUDNN, MATMUL})) -> bool:
    """Whether PyTorch lets every kind of TF32 work in ``kinds`` use TF32 right now
    (False for none: the session's switch then changes nothing, so it stays off)."""
    if not kinds:
        return False
    if MATMUL in kinds and not (torch.backends.cuda.matmul.allow_tf32
                                or torch.get_float32_matmul_precision() != "highest"):
        return False
    return not (CUDNN in kinds and not torch.backends.cudnn.allow_tf32)


_default_logger_quieted = False


def _quiet_ort_default_logger() -> None:
    """onnxruntime-gpu 1.31 logs "No registered plugin EP device found for
    'CUDAExecutionProvider'" as a warning on ORT's default logger for every session built
    with the CUDA provider, which then runs as always (its plugin-EP lookup; seen on an
    H200: one line per session, dozens per model). lort's sessions log errors only; the
    first time lort makes CUDA provider options it sets ORT's default logger to errors
    too (``onnxruntime.set_default_logger_severity(3)``; call it again after to undo)."""
    global _default_logger_quieted
    if not _default_logger_quieted:
        _default_logger_quieted = True
        import onnxruntime as ort

        ort.set_default_logger_severity(3)


def provider_options(index: int, tf32: bool, user: dict | None = None) -> dict:
    """CUDA execution provider options for a lort session on device ``index``; options
    the user passed (``Options.providers``) are kept, except the stream, which lort owns.

    ``enable_skip_layer_norm_strict_mode``: ORT's CUDA SkipLayerNormalization (which
    onnxscript's and ORT's own fusions make of a residual add and a layer norm) by default
    takes the variance in one pass, E[x^2] - mean^2 in float32
    (contrib_ops/cuda/bert/layer_norm.cuh), which loses the digits of a row whose mean is
    large against its spread (rows of 768 values with a mean 100 times their standard
    deviation, that formula in float32 emulated in NumPy: relative error in the variance
    5e-4 median, 2e-3 at worst of 200), where PyTorch's layer norm does not. ORT documents
    strict mode as the more accurate one, so lort asks for it unless the user's options say
    otherwise. Its cost on a GPU is not measured yet (benchmarks/results/cuda.md)."""
    _quiet_ort_default_logger()
    opts = {str(k): str(v) for k, v in (user or {}).items()}
    opts.setdefault("device_id", str(index))
    opts.setdefault("use_tf32", "1" if tf32 else "0")
    opts.setdefault("enable_skip_layer_norm_strict_mode", "1")
    opts["user_compute_stream"] = str(lort_stream(index).cuda_stream)
    return opts


class StreamOrder:
    """Orders one device's ORT runs with PyTorch's current stream (see the module doc)."""

    def __init__(self, index: int):
        self.index = index
        self.stream = lort_stream(index)

    def before_run(self) -> "torch.cuda.Stream":
        current = torch.cuda.current_stream(self.index)
        self.stream.wait_stream(current)
        return current

    def after_run(self, current: "torch.cuda.Stream") -> None:
        current.wait_stream(self.stream)


def drain(index: int) -> None:
    """Wait until the work queued on lort's stream of device ``index`` has run, before a
    session that ran on it is freed (``GroupSession.__del__``).

    ORT's CUDA provider frees the pinned host buffers of a run (the small host arrays
    its kernels copy to the GPU) from a host function it queues on the run's stream at
    the end of the run (``CudaStream::CleanUpOnRunEnd``); that function holds a
    reference to the session's pinned-memory arena. Where the session is freed first,
    the host function drops the last reference, and the arena's destructor calls
    ``cudaFreeHost`` inside a CUDA host function, where the CUDA API is not permitted:
    error 800, and ORT's exception ends the process ("terminate called ...", seen on an
    H200 when a dropped model's sessions were released). Once the stream has run the
    host function, the session holds the last reference and frees the arena on the
    thread that drops it. Not enough: the third GPU run aborted the same way with this
    drain in place, likely because ORT's stream destructor queues the host function
    again while the session is freed, after any drain (Options.cuda_pinned_memory=
    "process" takes the arena away from the sessions; benchmarks/results/cuda.md). Skipped while the current stream is capturing a CUDA graph
    (a synchronize would break the capture)."""
    stream = _streams.get(index)
    if stream is None:
        return
    try:
        if torch.cuda.is_current_stream_capturing():
            return
        stream.synchronize()
    except Exception:  # noqa: BLE001 - at interpreter exit torch's CUDA state may be gone
        pass


def synchronize(device: torch.device | None) -> None:
    """Host sync for timing (never on the run path); nothing off CUDA."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
