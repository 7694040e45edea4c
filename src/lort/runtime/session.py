"""ORT sessions for fusion groups and zero-copy execution with IOBinding."""

from __future__ import annotations

import collections
import logging
import math
import os
import tempfile
import threading
import time
from dataclasses import dataclass

import onnx
import onnxruntime as ort
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..errors import SessionCreationError
from ..numpy_views import numpy_view
from ..options import Options
from ..ort_model import OnnxModel, model_bytes as _proto
from . import cuda, offload, openmp, prepacked, providers
from .binding import FastBinding
from .dtypes import ELEMENT_TYPES
from .memory import _shared_cpu_arena, _shared_cuda_arena, _shared_cuda_pinned

logger = logging.getLogger("lort")

_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


class _Stats:
    """``lort.stats``: counters a test or benchmark can read, for the whole process.
    ``sessions_created``: ORT sessions built for running groups (the short-lived ones
    that time thread counts are not counted); ``ort_runs``: ORT session runs.
    ``snapshot()`` returns both as a tuple."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sessions_created = 0
        self.ort_runs = 0

    def add_session(self) -> None:
        with self._lock:
            self.sessions_created += 1

    def snapshot(self) -> tuple[int, int]:
        return self.sessions_created, self.ort_runs

    def restore(self, snapshot: tuple[int, int]) -> None:
        """Back to ``snapshot()``'s counts: lort's own sessions and runs (compile/call_floor.py)
        are not the user's."""
        with self._lock:
            self.sessions_created, self.ort_runs = snapshot


stats = _Stats()




def session_options(options: Options, threads: int | None = None, quiet: bool = False) -> ort.SessionOptions:
    so = ort.SessionOptions()
    if options.share_cpu_arena and _shared_cpu_arena():
        so.add_session_config_entry("session.use_env_allocators", "1")
    so.graph_optimization_level = _LEVELS[options.graph_optimization_level]
    so.intra_op_num_threads = threads or options.intra_op_num_threads or torch.get_num_threads()
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # Timing runs on synthetic inputs may fail (an integer divisor of 0): not worth a log.
    so.log_severity_level = 4 if quiet else 3
    # "inference" reaches only inference graphs' sessions (compile/graph_compiler.py).
    spin = "0" if options.allow_spinning is False else "1"
    so.add_session_config_entry("session.intra_op.allow_spinning", spin)
    so.add_session_config_entry("session.inter_op.allow_spinning", spin)
    so.add_session_config_entry("session.force_spinning_stop", "1" if options.force_spinning_stop else "0")
    return so


#: Outputs up to this many bytes get a template of their own (runtime/session.py, _prepare).
_SMALL_OUTPUT = 1 << 16


@dataclass
class OutputSpec:
    dtype: torch.dtype
    shape: tuple[int, ...] | None  # None when symbolic: ORT allocates


def _ort_device(device: torch.device) -> tuple[str, int]:
    if device.type == "cuda":
        return "cuda", device.index if device.index is not None else torch.cuda.current_device()
    return "cpu", 0


class GroupSession:
    """One ORT session of one group for one argument spec."""

    def __init__(
        self,
        model: OnnxModel | bytes,
        device: torch.device,
        outputs: list[OutputSpec],
        options: Options,
        name: str,
        threads: int | None = None,
        tf32: bool = False,
        count: bool = True,
    ):
        """``count``: counted in ``stats.sessions_created`` now (else the caller counts
        it once it keeps it)."""
        self.name = name
        self.device = device
        self.outputs = outputs
        self.session = create_session(model, device, options, name, threads, count=count, tf32=tf32, group=True)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self._ort_device = _ort_device(device)
        self._run_options = ort.RunOptions()
        # CUDA: ORT runs on lort's stream, ordered with PyTorch's current stream by
        # events, not by a host sync at the end of each run (runtime/cuda.py).
        self._order = None
        #: Releases PyTorch's spinning OpenMP workers before a run expected to be long
        #: (its last one took openmp.MIN_RUN_S or more), on CPU where Options.release_openmp
        #: resolved to True (runtime/openmp.py); None: never.
        release = options.release_openmp is True and device.type == "cpu"
        self._release = openmp.release_function() if release else None
        self._last_s = 0.0
        if device.type == "cuda":
            self._order = cuda.StreamOrder(self._ort_device[1])
            self._run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        #: Whether output shapes are known before a run (outputs are bound to torch memory).
        self.static_outputs = all(o.shape is not None for o in outputs)
        # A persistent binding: inputs are rebound only when a tensor's memory changed
        # (parameters keep theirs across calls and optimizer steps), outputs every call.
        self._binding = FastBinding(self.session, self._ort_device)
        #: Its mappings of a pre-packed weight store (runtime/prepacked.py), or None.
        self._mapped = prepacked.member(self.session)
        self._bound: list = [None] * len(self.input_names)
        self._lock = threading.Lock()
        # Sessions are built while tracing (under FakeTensorMode); real buffers are made
        # on the first run.
        self._placeholder: torch.Tensor | None = None

    def __del__(self) -> None:
        # A CUDA session that ran is freed only after its stream has run ORT's end-of-run
        # host function (runtime/cuda.py: drain). getattr: __init__ may have failed.
        order = getattr(self, "_order", None)
        if order is not None and getattr(self, "_placeholder", None) is not None:
            try:
                cuda.drain(order.index)
            except Exception:  # noqa: BLE001 - at interpreter exit this module's globals may be gone
                pass

    def run(self, args) -> list[torch.Tensor]:
        """Run on torch tensors (and Python int/float scalars), sharing memory with ORT."""
        with self._lock:
            binding = self._binding
            if not self.static_outputs:
                # ORT allocates these outputs: the last run's are let go (the tensors made
                # of them keep theirs), so no run writes into memory a caller holds; the
                # inputs stay bound (rebinding all of a decode step's ~150 took 0.7 ms a
                # GPT-2 token).
                binding.clear_outputs()
            if self._placeholder is None:
                self._prepare()
            if self._mapped is not None:
                self._mapped.activate()
            keep = self._bind_inputs(args, binding)  # temporaries whose memory ORT reads
            if self.static_outputs:
                # Each output in new memory (the caller keeps it), laid out as its
                # template: empty_like parses no shape or dtype.
                bind, device, empty_like = binding.bind_output_raw, binding.device, torch.empty_like
                results = []
                for name, etype, shape, template, empty in self._out_binds:
                    out = empty_like(template)
                    bind(name, device, etype, shape, self._placeholder_ptr if empty else out.data_ptr())
                    results.append(out)
                if self._order is None and self._release is None:
                    binding.run(self._run_options)
                else:
                    self._run(binding)
            else:
                for name in self.output_names:
                    binding.bind_output_device(name)
                self._run(binding)
                results = [_as_dtype(t, spec.dtype) for t, spec in zip(binding.output_tensors(), self.outputs)]
            stats.ort_runs += 1
            del keep
            return results

    def _prepare(self) -> None:
        """On the first run (sessions are built while tracing, under FakeTensorMode):
        the buffer empty tensors are bound to, and one template per static output."""
        self._placeholder = torch.empty(8, dtype=torch.float64, device=self.device)
        self._placeholder_ptr = self._placeholder.data_ptr()
        if self.static_outputs:
            self._out_binds = []
            for name, spec in zip(self.output_names, self.outputs):
                # A small output's template is a tensor of its own (empty_like copies its
                # layout, the fastest); a large one's is one element expanded (its
                # memory is not worth keeping; empty_like makes it contiguous).
                size = math.prod(spec.shape) * spec.dtype.itemsize
                template = (torch.empty(spec.shape, dtype=spec.dtype, device=self.device) if size <= _SMALL_OUTPUT
                            else torch.empty((1,) * len(spec.shape), dtype=spec.dtype, device=self.device).expand(spec.shape))
                # ORT refuses a null pointer, which empty tensors have.
                self._out_binds.append((name, ELEMENT_TYPES[spec.dtype], spec.shape, template, template.numel() == 0))

    def _bind_inputs(self, args, binding: "FastBinding") -> list | None:
        """Bind the inputs whose memory, shape or dtype changed since the last run; the
        temporaries made for non-contiguous tensors and scalars, which must outlive it."""
        keep = None
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.is_contiguous():
                t = a
            else:
                t = a.contiguous() if isinstance(a, torch.Tensor) else torch.tensor(
                    a, dtype=torch.int64 if isinstance(a, int) else torch.float32, device=self.device)
                keep = [t] if keep is None else keep + [t]
            # ORT refuses a null pointer, which empty tensors have: point it at a
            # valid buffer it will not read.
            key = (t.data_ptr() if t.numel() else self._placeholder_ptr, t.shape, t.dtype)
            if key != self._bound[i]:
                binding.bind_input(self.input_names[i], ELEMENT_TYPES[t.dtype], tuple(t.shape), key[0])
                self._bound[i] = key
        return keep

    def _run(self, binding: "FastBinding") -> None:
        if self._order is None:
            if self._release is None:
                binding.run(self._run_options)
                return
            if self._last_s >= openmp.MIN_RUN_S:
                self._release()
            start = time.perf_counter()
            binding.run(self._run_options)
            self._last_s = time.perf_counter() - start
            return
        current = self._order.before_run()
        try:
            binding.run(self._run_options)
        finally:
            self._order.after_run(current)


def create_session(
    model: OnnxModel | bytes,
    device: torch.device,
    options: Options,
    name: str,
    threads: int | None,
    count: bool = True,
    tf32: bool = False,
    so: ort.SessionOptions | None = None,
    group: bool = False,
):
    """An ORT session of ``model``; its external initializers (an ``OnnxModel``'s frozen
    weights) are read from their tensors' memory (``share_initializers``). ``group``: a
    group's own session (``GroupSession``), not a short-lived one that only times."""
    # Pre-packed weights mapped from a file (runtime/prepacked.py): the CPU sessions groups
    # run, of a model quantized with quantize_offload_dir.
    mapped = group and so is None and device.type == "cpu" and options.quantize_offload_dir is not None
    so = session_options(options, threads, quiet=not count) if so is None else so
    if device.type == "cuda":
        index = _ort_device(device)[1]
        # Each registered in ORT's environment once; a session with use_env_allocators
        # takes whichever of them is there (a shared CPU arena too, Options.share_cpu_arena).
        shared_arena = options.share_cuda_arena and _shared_cuda_arena(index)
        shared_pinned = options.cuda_pinned_memory == "process" and _shared_cuda_pinned(index)
        if shared_arena or shared_pinned:
            so.add_session_config_entry("session.use_env_allocators", "1")
    chosen = providers.for_device(device, options.providers, tf32)
    try:
        with unset_fake_temporarily():  # sessions are built while compiling, under FakeTensorMode
            session = _mapped_session(model, chosen, options, threads) if mapped else None
            if session is None:
                shared = share_initializers(so, model.external) if isinstance(model, OnnxModel) else ()
                session = ort.InferenceSession(_proto(model), sess_options=so, providers=chosen)
            else:
                session, shared = session
    except Exception as e:
        raise SessionCreationError(f"ONNX Runtime could not build a session for group {name!r}: {e}") from e
    finally:
        offload.page_out()  # what the session's optimizer and pre-packing read of offloaded memory
    # onnxruntime's Python wrapper keeps the model bytes to rebuild the session on a
    # provider failure; lort handles run failures itself (runtime/group.py).
    session.disable_fallback()
    if hasattr(session, "_model_bytes"):
        session._model_bytes = None
    # What ORT reads in place: it lives as long as the session.
    session._lort_shared_initializers = shared
    if count:
        stats.add_session()
    return session


def _mapped_session(model, chosen, options: Options, threads: int | None) -> tuple | None:
    """``model``'s session with its initializers and pre-packed weights mapped from the
    store in Options.quantize_offload_dir, and what must outlive it; None (and a warning)
    where the store cannot take it: the session is then built in memory. The first build
    reads the shared initializers from the tensors' memory; the session that runs reads
    every initializer from the store (ORT 1.31 mapped none of a file's data for a session
    given initializers of its own: it read them all into its memory)."""
    keep = []

    def first() -> ort.SessionOptions:
        so = session_options(options, threads)
        if isinstance(model, OnnxModel):
            keep.append(share_initializers(so, model.external))
        return so

    try:
        return prepacked.load(options.quantize_offload_dir, _proto(model), first,
                              lambda: session_options(options, threads), chosen), ()
    except Exception as e:  # noqa: BLE001 - the session built in memory is the same session
        logger.warning("lort: pre-packed weights stay in this session's memory (%s: %s)", type(e).__name__, e)
        return None


def share_initializers(so: ort.SessionOptions, external) -> tuple:
    """Hand ORT each external initializer ``(name, tensor, ONNX type)`` from the
    tensor's own memory, twice: as the initializer's data for ORT's graph optimizer
    (``add_external_initializers``: ORT copies it while it builds the session and frees
    the copy after), and as the initializer the session runs on (``add_initializer``:
    shared, never copied; ORT pre-packs its own copy only for the kernels that pack).
    The optimizer never sees a placeholder: folding reads the real values. Returns the
    OrtValues and tensors, which must outlive the session."""
    if not external:
        return ()
    names, graph_values, keep = [], [], []
    for name, tensor, onnx_type in external:
        # The optimizer reads the data on the CPU (a copy for a CUDA tensor); the session
        # runs on the tensor's own device memory.
        host = tensor if tensor.device.type == "cpu" else tensor.cpu()
        graph_value = _ort_value(host, onnx_type)
        run_value = graph_value if host is tensor else _ort_value(tensor, onnx_type)
        so.add_initializer(name, run_value)
        names.append(name)
        graph_values.append(graph_value)
        keep.append((tensor, host, graph_value, run_value))
    so.add_external_initializers(names, graph_values)
    return tuple(keep)


def _ort_value(tensor: torch.Tensor, onnx_type: int) -> ort.OrtValue:
    """An OrtValue over ``tensor``'s memory, of ONNX element type ``onnx_type`` (the
    tensor may be an integer stand-in of the same width for a type torch lacks)."""
    if tensor.device.type == "cpu":
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(numpy_view(tensor), onnx_type)
    return ort.OrtValue.from_dlpack(tensor)


def save_optimized(model: OnnxModel | bytes, path: str, device: torch.device, options: Options,
                   threads: int | None, tf32: bool = False) -> None:
    """Write ORT's optimized graph of ``model`` (a session built as the group's would be)
    to ``path``, initializers of 1 KiB or more to ``path + ".data"`` beside it."""
    so = session_options(options, threads, quiet=True)
    so.optimized_model_filepath = path
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                os.path.basename(path) + ".data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    create_session(model, device, options, "optimizer record", threads, count=False, tf32=tf32, so=so)


def optimizer_changes(
    model: OnnxModel | bytes, device: torch.device, options: Options, threads: int | None, tf32: bool = False
) -> dict[str, int]:
    """How ORT's optimizer changes ``model_bytes`` in a session like the group's: per op
    type ("Conv", "com.microsoft:FusedConv"), how many more (> 0) or fewer (< 0) nodes
    the optimized graph has. Builds a second session that writes its optimized graph to
    a temporary directory (initializers to a file beside it, not read back)."""

    def ops(model: onnx.ModelProto) -> collections.Counter:
        return collections.Counter(f"{n.domain}:{n.op_type}" if n.domain else n.op_type for n in model.graph.node)

    with tempfile.TemporaryDirectory(prefix="lort-ort-graph-") as tmp:
        path = os.path.join(tmp, "optimized.onnx")
        save_optimized(model, path, device, options, threads, tf32)
        after = ops(onnx.load(path, load_external_data=False))
    before = ops(onnx.load_from_string(_proto(model)))
    changes = {op: after[op] - before[op] for op in sorted(set(after) | set(before))}
    return {op: d for op, d in changes.items() if d}


def _as_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` as ``dtype``: DLPack gives ORT's bool tensors as uint8, read as bool
    without a copy."""
    if tensor.dtype == dtype:
        return tensor
    return tensor.view(dtype) if dtype == torch.bool and tensor.dtype == torch.uint8 else tensor.to(dtype)
