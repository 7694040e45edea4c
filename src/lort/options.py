"""lort's options: one dataclass, defaults, environment variables and validation."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from .offload_dir import problem as _offload_dir_problem

RUN_MODES = ("ort", "pytorch", "debug")
FALLBACK_POLICIES = ("warn", "raise")
OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "all")
EXECUTORS = ("ort", "auto")
#: What executor="auto" may run a captured graph in (compile/engines.py).
ENGINES = ("ort", "pytorch", "inductor")

# Environment variables, named as in the seed accelerator.
ENV_RUN_TYPE = "LORT_RUN_TYPE"
ENV_RTOL = "LORT_RELATIVE_TOLERANCE"
ENV_ATOL = "LORT_ABSOLUTE_TOLERANCE"
ENV_FALLBACK = "LORT_FALLBACK_POLICY"
ENV_EXECUTOR = "LORT_EXECUTOR"
ENV_DISK_CACHE = "LORT_DISK_CACHE"
ENV_CACHE_DIR = "LORT_CACHE_DIR"
ENV_PROGRESS = "LORT_PROGRESS"
ENV_FREEZE = "LORT_FREEZE"
ENV_FREEZE_MAX_MB = "LORT_FREEZE_MAX_MB"
ENV_ENGINES = "LORT_ENGINES"
FREEZE_MODES = ("auto", True, False)
CUDA_PINNED_MEMORY = ("process", "session")
QUANTIZE_SCHEMES = (None, "int4", "int8", "int8_dynamic")
QUANTIZE_BLOCK_SIZES = (16, 32, 64, 128, 256)


def _env_freeze() -> "str | bool":
    raw = os.environ.get(ENV_FREEZE, "").strip().lower()
    if not raw or raw == "auto":
        return "auto"
    return _env_bool(ENV_FREEZE, True)


def _env_engines() -> tuple:
    raw = os.environ.get(ENV_ENGINES, "").strip()
    if not raw:
        return ENGINES
    return tuple(part.strip().lower() for part in raw.split(",") if part.strip())


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"environment variable {name}={raw!r} is not a boolean (use 1 or 0)")


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get(ENV_CACHE_DIR) or os.path.join(base, "lort")


def _env_str(name: str, default: str) -> str:
    return os.environ.get(name, default).strip().lower() or default


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from None


def _provider_entry(p: Any) -> "str | tuple | None":
    """An entry of ``Options.providers`` as ORT takes it: a provider name, or a
    (name, options dict) pair given as a tuple or a list (JSON has no tuples); None if
    it is neither."""
    if isinstance(p, str):
        return p
    if isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], Mapping):
        return (p[0], dict(p[1]))
    return None


@dataclasses.dataclass(frozen=True)
class Options:
    """How lort compiles and runs a model.

    Pass as ``torch.compile(model, backend="lort", options={...})`` or ``Options(...)``
    (``lort.ORTModule(model, options=...)`` takes the same). Frozen: change a copy with
    ``dataclasses.replace``. An unknown key raises ``TypeError`` listing the valid ones;
    a bad value raises ``ValueError``. Each field below gives its accepted values, its
    default and, where one exists, the environment variable that sets the default.
    """

    #: Run mode. ``"ort"`` runs fusion groups in ONNX Runtime; ``"pytorch"`` runs them in
    #: PyTorch (for bisecting); ``"debug"`` runs both and compares each group's outputs,
    #: raising ``lort.MismatchError`` beyond ``rtol``/``atol``. One of ``"ort"``,
    #: ``"pytorch"``, ``"debug"``; default ``"ort"``, env ``LORT_RUN_TYPE``.
    mode: str = dataclasses.field(default_factory=lambda: _env_str(ENV_RUN_TYPE, "ort"))
    #: Relative tolerance of debug mode: a number >= 0; default ``1e-4``, env
    #: ``LORT_RELATIVE_TOLERANCE``.
    rtol: float = dataclasses.field(default_factory=lambda: _env_float(ENV_RTOL, 1e-4))
    #: Absolute tolerance of debug mode: a number >= 0; default ``1e-5``, env
    #: ``LORT_ABSOLUTE_TOLERANCE``.
    atol: float = dataclasses.field(default_factory=lambda: _env_float(ENV_ATOL, 1e-5))
    #: When a group fails to translate or to build a session (or ORT fails to run it),
    #: ``"warn"`` runs it in PyTorch with one warning and ``"raise"`` raises. One of
    #: ``"warn"``, ``"raise"``; default ``"warn"``, env ``LORT_FALLBACK_POLICY``.
    fallback: str = dataclasses.field(default_factory=lambda: _env_str(ENV_FALLBACK, "warn"))
    #: ORT execution providers, overriding the choice made from the tensors' device (CPU
    #: for CPU tensors; CUDA, then CPU, for CUDA tensors). A list of provider names or
    #: ``(name, options dict)`` pairs; default ``None`` (chosen from the device).
    providers: tuple | None = None
    #: The most inputs plus outputs a fusion group may have (frozen weights do not
    #: count; the seed's subgraph_arg_limit). An int >= 2; default ``128``.
    max_group_args: int = 128
    #: ORT graph optimization level of each session. One of ``"disable"``, ``"basic"``,
    #: ``"extended"``, ``"all"``; default ``"all"``.
    graph_optimization_level: str = "all"
    #: ORT intra-op threads. ``None`` (the default) chooses per group between
    #: ``torch.get_num_threads()`` and 1 by timing both at compile time (small groups run
    #: faster on one thread); an int >= 1 fixes the count for every group.
    intra_op_num_threads: int | None = None
    #: Where groups run. With ``"auto"`` each group is timed at compile time in ORT and in
    #: PyTorch on inputs of its real shapes, and runs in PyTorch when that is faster by
    #: the tuner's margin (compile/tuner.py; explain reports the times); then, on its first call on CPU, the whole
    #: compiled graph (forward and backward) is timed against eager PyTorch running the
    #: Dynamo graph, and the graph runs in eager PyTorch when that is faster. ``"ort"``:
    #: every group in ORT, no timing. Debug mode always runs ORT. One of ``"auto"``,
    #: ``"ort"``; default ``"auto"``, env ``LORT_EXECUTOR``.
    executor: str = dataclasses.field(default_factory=lambda: _env_str(ENV_EXECUTOR, "auto"))
    #: With ``executor="auto"``, the engines a captured graph may run in, chosen by
    #: measurement on the real inputs: ``"ort"`` (lort's graph: its groups in ORT, the
    #: rest in PyTorch's kernels), ``"pytorch"`` (eager PyTorch) and ``"inductor"``
    #: (PyTorch compiled by inductor, in the background after the first call, swapped in
    #: where measured faster: compile/engines.py). Leave ``"inductor"`` out where no C++
    #: toolchain is installed or its compile time is not wanted. A list of engines, each
    #: once, always with ``"ort"`` and ``"pytorch"``; default
    #: ``("ort", "pytorch", "inductor")``, env ``LORT_ENGINES``, comma-separated
    #: (``ort,pytorch``).
    engines: tuple = dataclasses.field(default_factory=_env_engines)
    #: Apply onnxscript's ORT fusion rewrites (GELU, skip layer norm, attention, fused
    #: matmul, ...) to each group before ORT's own optimizations. A bool; default ``True``.
    ort_fusions: bool = True
    #: ORT's intra-op threads spin while they wait for work inside a run, instead of being
    #: woken for each parallel op. ``"inference"``: in inference graphs, not in training
    #: graphs, whose groups alternate with PyTorch's kernels (benchmarks/studies/threads.md).
    #: One of ``"inference"``, ``True``, ``False``; default ``"inference"``.
    allow_spinning: "bool | str" = "inference"
    #: Stop spinning threads when a run returns (ORT's ``session.force_spinning_stop``);
    #: ``False`` lets them spin on, stealing the cores of the PyTorch code that follows
    #: (training 0.46x eager against 0.85x). A bool; default ``True``.
    force_spinning_stop: bool = True
    #: Before an ORT run on CPU whose session's last run took 10 ms or more, release the
    #: calling thread's OpenMP workers (OpenMP 5.0's ``omp_pause_resource_all``): after
    #: each PyTorch op they spin for milliseconds on the cores ORT's threads need
    #: (runtime/openmp.py). ``"training"``: in training graphs, whose ORT groups alternate
    #: with PyTorch's kernels; ``True``: inference graphs too; ``False``: never. Measured on
    #: all-ORT training steps (benchmarks/studies/openmp_spin.md): BERT-base and GPT-2
    #: small gained 7-13% in quiet runs, ViT-S/16 and ResNet-50 moved between -7% and
    #: +7%, and a run on a loaded machine lost 5% on GPT-2, so it is off by default. One
    #: of ``"training"``, ``True``, ``False``; default ``False``.
    release_openmp: "bool | str" = False
    #: Every lort session on CPU allocates from one ORT arena shared by the process,
    #: instead of an arena per session that keeps its peak for good, which lowers peak
    #: RSS in training (benchmarks/results/memory.md, before and after). A bool; default
    #: ``True``.
    share_cpu_arena: bool = True
    #: Every lort session on a CUDA device allocates from one ORT arena per device,
    #: instead of an arena per session. On an H200 it took BERT's 10 training steps from
    #: a 9,180 MiB peak to 5,616 MiB (benchmarks/results/cuda_memory.md), and its test
    #: matched eager on two GPU runs. A bool; default ``True``.
    share_cuda_arena: bool = True
    #: Who owns the pinned host memory lort's CUDA sessions copy small host arrays from.
    #: ``"process"``: one pinned allocator per device in ORT's environment, never freed,
    #: which no end-of-run host function of a freed session can own last. ``"session"``:
    #: ORT's pinned arena of each session (ORT's own default); a session freed while its
    #: stream still holds ORT's end-of-run host function can leave that function the
    #: arena's last owner, and ORT then aborts the process (CUDA error 800,
    #: ``cudaFreeHost``). On an H200 (benchmarks/results/cuda.md, fourth run) the test
    #: that drops a model while its last run is queued aborted with ``"session"`` and
    #: passed with ``"process"``, and BERT's 10 training steps peaked at 5,312 MiB with
    #: it (5,616 with ``"session"`` on an earlier run); its speed against ``"session"``
    #: is not yet measured apart. Registered for the process: once a session asks for
    #: it, every later lort CUDA session that uses ORT's environment allocators
    #: (``share_cpu_arena`` or ``share_cuda_arena``, both on by default) takes it too.
    #: One of ``"process"``, ``"session"``; default ``"process"``.
    cuda_pinned_memory: str = "process"
    #: Quantize frozen weight matrices for inference: each product of an activation by a
    #: float32 weight matrix runs as ORT's ``MatMulNBits`` over the weight quantized in
    #: blocks along its input dimension (compile/quantize.py; onnxruntime's quantizer
    #: computes the numbers). ``"int4"``, ``"int8"``: 4- or 8-bit weights, float32
    #: activations (what decoding wants: its speed is bytes of weights per token).
    #: ``"int8_dynamic"``: 8-bit weights, one scale and zero point per output column,
    #: and activations quantized to 8 bits on each call (ORT's ``DynamicQuantizeMatMul``,
    #: integer products: what encoders and batched inputs want); uint8 weights, whose
    #: products no x86-64 CPU saturates (int8 weights saturate on CPUs without VNNI).
    #: Results then differ from eager's by the quantization's own error.
    #: Inference on CPU only, with ``executor="ort"`` (a quantized group must run in ORT)
    #: and frozen weights (``freeze`` not ``False``; freeze_max_mb does not apply: ORT
    #: holds the quantized copy only). One of ``None``, ``"int4"``, ``"int8"``,
    #: ``"int8_dynamic"``; default ``None`` (off).
    quantize: str | None = None
    #: Weights per quantization block (one scale, and one zero point unless
    #: ``quantize_symmetric``), along the weight's input dimension ("int4", "int8";
    #: "int8_dynamic" has one block per output column). One of 16, 32, 64, 128, 256;
    #: default ``32``.
    quantize_block_size: int = 32
    #: Symmetric (no zero points, as llama.cpp's Q4_0, ORT GenAI's default; int4 decodes ~13% faster
    #: on AVX2; "int8_dynamic": uint8 weights' zero point 128) or asymmetric. A bool; default ``False``.
    quantize_symmetric: bool = False
    #: MatMulNBits' ``accuracy_level``: the precision its CPU kernel computes in: 0
    #: (unset: the kernel's default), 1 (float32), 2 (float16), 3 (bfloat16), 4 (int8:
    #: activations quantized per block, the fastest where the CPU has VNNI/AVX-512);
    #: "int8_dynamic" has none. An int 0-4; default ``4``.
    quantize_accuracy_level: int = 4
    #: A directory on disk: the float32 weight matrices ``quantize`` replaced, the
    #: quantized arrays once ORT has pre-packed them, and the embedding tables (frozen
    #: weights a graph only looks rows up in) are written to unlinked files there and
    #: mapped back at the same addresses (runtime/offload.py), so they leave the
    #: process's resident memory while the module, its values and lort's checks stay as
    #: they were; a read pages them back in. Linux only; not a tmpfs. Needs ``quantize``.
    #: A directory path or ``None``; default ``None`` (everything stays in memory).
    quantize_offload_dir: str | None = None
    #: Write convolution_backward as convolutions so it runs in ORT. Off by default:
    #: slower than PyTorch's kernels on CPU (benchmarks/studies/conv_backward.md). A bool;
    #: default ``False``.
    decompose_conv_backward: bool = False
    #: Keep translated groups (the ONNX model and the timed choices) on disk, so a new
    #: process skips translation and timing. A bool; default ``True``, env
    #: ``LORT_DISK_CACHE`` (``0`` turns it off).
    disk_cache: bool = dataclasses.field(default_factory=lambda: _env_bool(ENV_DISK_CACHE, True))
    #: Where the disk cache lives: a directory path. Default env ``LORT_CACHE_DIR``, else
    #: ``$XDG_CACHE_HOME/lort`` or ``~/.cache/lort``.
    cache_dir: str = dataclasses.field(default_factory=_default_cache_dir)
    #: Size limit of the disk cache in MiB; least recently used entries go first. An int
    #: >= 1; default ``1024``.
    cache_max_mb: int = 1024
    #: A directory to write every translated group's ONNX model to, or ``None`` (the
    #: default: nothing written).
    save_onnx: str | None = None
    #: Callables applied, in order, to each group's ONNX model (an ``onnx.ModelProto``,
    #: changed in place) before ORT builds a session of it: DORT's option of this name.
    #: Every session runs the transformed model (timing, runs, frozen weights). A
    #: transform is code lort cannot hash, so with any the disk cache is not used. A list
    #: of callables; default ``()``.
    pre_ort_model_transforms: tuple = ()
    #: Record, per group, how ORT's own optimizer changed the graph it runs (ops it added,
    #: such as FusedConv, and ops it removed, such as a BatchNormalization folded into a
    #: convolution). Builds each group's session a second time to read the optimized
    #: graph, so it is off except in lort.explain. A bool; default ``False``.
    record_ort_graph: bool = False
    #: ``lort.ORTModule``: how many input schemas (structure, dtypes, constants,
    #: train/eval, ...) keep their compiled graphs; the least recently used is dropped
    #: first. An int >= 1; default ``8``.
    schema_cache_size: int = 8
    #: ``lort.ORTModule``: calls without grad (torch.no_grad, torch.inference_mode) are
    #: captured with torch.export instead of Dynamo and then run without Dynamo's
    #: per-call guards. lort checks instead, on every call: the input structure, non-tensor
    #: inputs, tensor dtypes, devices, shapes and strides, grad mode, autocast, every
    #: submodule's training flag, plain attributes, parameters, buffers, submodules and
    #: hooks, the plain attributes of objects the modules hold (a Hugging Face config), and
    #: the weights' memory and version (frozen weights as Options.freeze says). What it
    #: does not see: Python globals and closures read by ``forward``. ``False`` keeps
    #: Dynamo (and its guards) for them too. A bool; default ``True``.
    direct_inference: bool = True
    #: Progress of compiles. One INFO line on the "lort" logger per graph for capture,
    #: translation, session building and timing, and a progress bar over the groups of a
    #: graph with many of them when stderr is a terminal (with tqdm installed). A bool;
    #: default ``True``, env ``LORT_PROGRESS`` (``0`` turns both off).
    progress: bool = dataclasses.field(default_factory=lambda: _env_bool(ENV_PROGRESS, True))
    #: Frozen weights, in inference graphs (no grad). Parameters and buffers the graph
    #: only reads become ORT initializers instead of inputs, so ORT folds, fuses and
    #: pre-packs them. Each call first checks that every frozen tensor is still the one
    #: frozen: same object, data pointer and version counter (in-place ops, optimizer
    #: steps, load_state_dict, buffer updates, a new Parameter or ``p.data = t``), and
    #: with ``"auto"`` also one sampled element of each CPU tensor (catches most writes
    #: through ``p.data`` or NumPy, which bump no version); a change re-freezes with the
    #: new values. ``"auto"`` freezes only what it can sample (weights in CUDA memory
    #: stay inputs) and only up to ``freeze_max_mb``; ``True`` freezes on every device
    #: at any size and skips the sampled element; ``False`` keeps weights as inputs. One
    #: of ``"auto"``, ``True``, ``False``; default ``"auto"``, env ``LORT_FREEZE``
    #: (``auto``, ``1``, ``0``).
    freeze: "str | bool" = dataclasses.field(default_factory=_env_freeze)
    #: With ``freeze="auto"``, a graph's weights are frozen only while they total at
    #: most this many MiB (each tensor counted once). ORT reads frozen weights in place,
    #: but keeps its own pre-packed copy of the ones its GEMM and convolution kernels
    #: pack, and of the ones it folds (batch norm into a convolution): up to one more
    #: copy of the weights. Above the limit they stay inputs and ORT holds none of them
    #: (BERT-base's 418 MiB: benchmarks/results/scale.md). A number >= 0; default
    #: ``128``, env ``LORT_FREEZE_MAX_MB``.
    freeze_max_mb: float = dataclasses.field(default_factory=lambda: _env_float(ENV_FREEZE_MAX_MB, 128.0))

    def __post_init__(self) -> None:
        if self.mode not in RUN_MODES:
            raise ValueError(f"lort option mode={self.mode!r} is not one of {RUN_MODES}")
        if self.fallback not in FALLBACK_POLICIES:
            raise ValueError(f"lort option fallback={self.fallback!r} is not one of {FALLBACK_POLICIES}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"lort option executor={self.executor!r} is not one of {EXECUTORS}")
        engines = self.engines
        if isinstance(engines, (str, bytes)) or not isinstance(engines, (tuple, list)) or not all(
                isinstance(e, str) and e in ENGINES for e in engines) or len(set(engines)) != len(engines) \
                or not {"ort", "pytorch"} <= set(engines):
            raise ValueError(
                f"lort option engines={engines!r} must be a list of engines from {ENGINES}, each once, with "
                "'ort' and 'pytorch' (always candidates): ('ort', 'pytorch', 'inductor') lets executor='auto' "
                "choose inductor too, ('ort', 'pytorch') leaves it out (env LORT_ENGINES=ort,pytorch)"
            )
        object.__setattr__(self, "engines", tuple(engines))
        if self.cuda_pinned_memory not in CUDA_PINNED_MEMORY:
            raise ValueError(
                f"lort option cuda_pinned_memory={self.cuda_pinned_memory!r} is not one of {CUDA_PINNED_MEMORY}"
            )
        self._check_quantize()
        if self.graph_optimization_level not in OPTIMIZATION_LEVELS:
            raise ValueError(
                f"lort option graph_optimization_level={self.graph_optimization_level!r} "
                f"is not one of {OPTIMIZATION_LEVELS}"
            )
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"lort option {name}={value!r} must be a number >= 0")
        if not isinstance(self.cache_max_mb, int) or self.cache_max_mb < 1:
            raise ValueError(f"lort option cache_max_mb={self.cache_max_mb!r} must be an int >= 1")
        if not isinstance(self.schema_cache_size, int) or isinstance(self.schema_cache_size, bool) \
                or self.schema_cache_size < 1:
            raise ValueError(f"lort option schema_cache_size={self.schema_cache_size!r} must be an int >= 1")
        if not any(self.freeze is m if isinstance(m, bool) else self.freeze == m for m in FREEZE_MODES):
            raise ValueError(f"lort option freeze={self.freeze!r} is not one of {FREEZE_MODES}")
        if isinstance(self.freeze_max_mb, bool) or not isinstance(self.freeze_max_mb, (int, float)) \
                or not self.freeze_max_mb >= 0:
            raise ValueError(f"lort option freeze_max_mb={self.freeze_max_mb!r} must be a number >= 0")
        if not (isinstance(self.allow_spinning, bool) or self.allow_spinning == "inference"):
            raise ValueError(f"lort option allow_spinning={self.allow_spinning!r} must be 'inference', True or False")
        if not (isinstance(self.release_openmp, bool) or self.release_openmp == "training"):
            raise ValueError(f"lort option release_openmp={self.release_openmp!r} must be 'training', True or False")
        if not isinstance(self.force_spinning_stop, bool):
            raise ValueError(f"lort option force_spinning_stop={self.force_spinning_stop!r} must be True or False")
        if not isinstance(self.direct_inference, bool):
            raise ValueError(f"lort option direct_inference={self.direct_inference!r} must be True or False")
        if not isinstance(self.progress, bool):
            raise ValueError(f"lort option progress={self.progress!r} must be True or False")
        if not isinstance(self.max_group_args, int) or self.max_group_args < 2:
            raise ValueError(f"lort option max_group_args={self.max_group_args!r} must be an int >= 2")
        if self.intra_op_num_threads is not None and (
            not isinstance(self.intra_op_num_threads, int) or self.intra_op_num_threads < 1
        ):
            raise ValueError(
                f"lort option intra_op_num_threads={self.intra_op_num_threads!r} must be None or an int >= 1"
            )
        transforms = self.pre_ort_model_transforms
        if callable(transforms) or isinstance(transforms, (str, bytes)) or not all(
            callable(t) for t in (transforms or ())
        ):
            raise ValueError(
                f"lort option pre_ort_model_transforms={transforms!r} must be a list of callables, each taking "
                "an onnx.ModelProto to change in place"
            )
        object.__setattr__(self, "pre_ort_model_transforms", tuple(transforms or ()))
        if self.providers is not None:
            entries = None if isinstance(self.providers, (str, bytes, Mapping)) else [
                _provider_entry(p) for p in self.providers]
            if entries is None or any(e is None for e in entries):
                raise ValueError(
                    f"lort option providers={self.providers!r} must be a list of ORT provider names "
                    f"or (name, options dict) pairs, e.g. ['CPUExecutionProvider'] or "
                    f"[('CUDAExecutionProvider', {{'arena_extend_strategy': 'kSameAsRequested'}}), "
                    f"'CPUExecutionProvider']"
                )
            object.__setattr__(self, "providers", tuple(entries))

    def _check_quantize(self) -> None:
        if self.quantize not in QUANTIZE_SCHEMES:
            raise ValueError(f"lort option quantize={self.quantize!r} is not one of {QUANTIZE_SCHEMES}: 'int4' or "
                             "'int8' quantizes frozen weight matrices for inference, 'int8_dynamic' also each "
                             "call's activations, None leaves them float32")
        if not isinstance(self.quantize_block_size, int) or isinstance(self.quantize_block_size, bool) \
                or self.quantize_block_size not in QUANTIZE_BLOCK_SIZES:
            raise ValueError(f"lort option quantize_block_size={self.quantize_block_size!r} is not one of "
                             f"{QUANTIZE_BLOCK_SIZES} (the block sizes ORT's MatMulNBits takes)")
        if not isinstance(self.quantize_symmetric, bool):
            raise ValueError(f"lort option quantize_symmetric={self.quantize_symmetric!r} must be True or False")
        if not isinstance(self.quantize_accuracy_level, int) or isinstance(self.quantize_accuracy_level, bool) \
                or self.quantize_accuracy_level not in range(5):
            raise ValueError(f"lort option quantize_accuracy_level={self.quantize_accuracy_level!r} must be an int "
                             "0-4 (MatMulNBits' accuracy_level; 4: int8 compute)")
        if self.quantize_offload_dir is not None:
            why = _offload_dir_problem(self.quantize_offload_dir)
            if why is None and self.quantize is None:
                why = "it only holds what quantize replaced: set quantize too"
            if why is not None:
                raise ValueError(f"lort option quantize_offload_dir={self.quantize_offload_dir!r} cannot be used: {why}")
        if self.quantize is None:
            return
        if self.executor != "ort":
            raise ValueError(f"lort option quantize={self.quantize!r} needs executor='ort' (got "
                             f"{self.executor!r}): a quantized group must run in ORT, where 'auto' may place it "
                             "in PyTorch with float32 weights")
        if self.mode != "ort":
            raise ValueError(f"lort option quantize={self.quantize!r} needs mode='ort' (got {self.mode!r}): "
                             "'pytorch' runs no ORT, and 'debug' compares with eager, which quantization changes")
        if self.freeze is False:
            raise ValueError(f"lort option quantize={self.quantize!r} needs frozen weights: freeze='auto' or True, "
                             "not False (a weight ORT takes as an input each call cannot be quantized ahead)")

    @classmethod
    def valid_keys(cls) -> list[str]:
        """The names of every option, in field order (what an unknown key's error lists)."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def resolve(cls, options: "Options | Mapping[str, Any] | None" = None, **overrides: Any) -> "Options":
        """Options from an Options, a mapping, or None (environment and defaults), with
        ``overrides`` applied. An unknown key raises ``TypeError`` naming the valid ones;
        a bad value raises ``ValueError``."""
        if options is None:
            options = {}
        if isinstance(options, Options):
            return dataclasses.replace(options, **overrides) if overrides else options
        if not isinstance(options, Mapping):
            raise TypeError(f"lort options must be a dict or lort.Options, not {type(options).__name__}")
        merged = {**options, **overrides}
        unknown = sorted(set(merged) - set(cls.valid_keys()))
        if unknown:
            raise TypeError(
                f"unknown lort option(s) {unknown}; valid options are: {', '.join(cls.valid_keys())}"
            )
        return cls(**merged)
