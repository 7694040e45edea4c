"""Memory ORT holds for lort's sessions: the arenas sessions share (one CPU arena per
process, Options.share_cpu_arena; one CUDA arena per device, Options.share_cuda_arena;
one pinned host allocator per device, Options.cuda_pinned_memory) and handing freed memory back to the system after compiling or releasing a graph."""

from __future__ import annotations

import ctypes
import logging
import threading

import numpy as np
import onnxruntime as ort

logger = logging.getLogger("lort")


_arena_lock = threading.Lock()
#: "cpu", "cuda:N" -> whether ORT took the shared arena (absent: not tried yet).
_arenas: dict[str, bool] = {}


def _register_once(key: str, what: str, register) -> bool:
    """Call ``register`` (which registers an arena in ORT's environment) once per process
    for ``key``; whether ORT took it (sessions keep their own arenas where it did not)."""
    with _arena_lock:
        if key not in _arenas:
            try:
                register()
                _arenas[key] = True
            except Exception as e:  # noqa: BLE001 - e.g. registered by the application, or no CUDA provider
                logger.info("lort: no shared %s arena (%s); each session keeps its own", what, e)
                _arenas[key] = False
        return _arenas[key]


def _shared_cpu_arena() -> bool:
    """Register, once per process, a CPU arena in ORT's environment that sessions built
    with ``session.use_env_allocators`` share. False if ORT refused it."""

    def register():
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        # max_mem 0 and -1 for the rest: ORT's defaults for an arena.
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))

    return _register_once("cpu", "CPU", register)


def _shared_cuda_arena(index: int) -> bool:
    """Register, once per process and device, a CUDA arena in ORT's environment that
    sessions built with ``session.use_env_allocators`` share (Options.share_cuda_arena).
    False if ORT refused it (the CPU build has no CUDA allocator to register)."""

    def register():
        info = ort.OrtMemoryInfo("Cuda", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, index, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator_v2("CUDAExecutionProvider", info, {"device_id": str(index)},
                                             ort.OrtArenaCfg(0, -1, -1, -1))

    return _register_once(f"cuda:{index}", f"CUDA (device {index})", register)


def _shared_cuda_pinned(index: int) -> bool:
    """Register, once per process and device, a CUDA pinned host allocator in ORT's
    environment that sessions built with ``session.use_env_allocators`` use instead of a
    pinned arena of their own (Options.cuda_pinned_memory="process"): ORT's environment
    owns it until the process ends, so no end-of-run host function of a freed session
    can hold it last. ``"CudaPinned"`` names ORT's host-accessible memory of an NVIDIA
    device. False if ORT refused it (the CPU build has no CUDA allocator to register)."""

    def register():
        info = ort.OrtMemoryInfo("CudaPinned", ort.OrtAllocatorType.ORT_DEVICE_ALLOCATOR, index, ort.OrtMemType.CPU)
        ort.create_and_register_allocator_v2("CUDAExecutionProvider", info, {"device_id": str(index)},
                                             ort.OrtArenaCfg(0, -1, -1, -1))

    return _register_once(f"cuda_pinned:{index}", f"CUDA pinned (device {index})", register)


_shrinker: list = []  # the one tiny session that shrinks the shared arena, once made


def shrink_shared_cpu_arena() -> None:
    """Hand back to the system the shared CPU arena's chunks no session is using: it
    keeps the peak of every run otherwise (BERT-base's graphs timed at compile time and
    then run in eager PyTorch kept 19-27 MB). One run of a tiny session on that arena
    with ORT's shrinkage run option; nothing where no arena is shared."""
    if not _arenas.get("cpu"):
        return
    with _arena_lock:
        if not _shrinker:
            from onnx import TensorProto, helper

            graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "lort_shrink",
                                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
            so = ort.SessionOptions()
            so.add_session_config_entry("session.use_env_allocators", "1")
            so.log_severity_level = 3
            run_options = ort.RunOptions()
            run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
            sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
            _shrinker.append((sess, run_options, {"x": np.zeros(1, np.float32)}))
        sess, run_options, feed = _shrinker[0]
    try:
        sess.run(None, feed, run_options)
    except Exception as e:  # noqa: BLE001 - memory handed back or not, nothing fails
        logger.debug("lort: the shared arena did not shrink (%s)", e)


def give_back_memory() -> None:
    """After compiling (translation, sessions, timing runs allocate and free far more
    than a compiled graph keeps) or releasing a graph: the shared arena's unused chunks
    and glibc's free heap go back to the system (BERT-base's compile left 45-60 MB of
    freed heap in the process otherwise)."""
    shrink_shared_cpu_arena()
    if _libc is not None:
        _libc.malloc_trim(0)


def _load_libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # glibc only
        return libc
    except (OSError, AttributeError):
        return None


_libc = _load_libc()
