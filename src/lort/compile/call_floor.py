"""The least a call through lort costs, and the graphs eager PyTorch runs in less.

A graph lort compiles runs through AOTAutograd's runtime wrapper and at least one ORT
session run (bound by IOBinding); a training graph also through its autograd node and its
backward's session. No graph lort compiles can run faster than a one-multiply graph on a
one-element tensor does: that call's time is lort's *floor*. executor="auto" times a small
graph's eager run before anything is compiled; where eager PyTorch runs the whole graph
(with its backward, where it trains) in less than the floor, lort could only lose, and
the graph runs in eager PyTorch without being translated, rewritten, built or timed
(onnxruntime-training's einsum tests build hundreds of such modules).

The floor is measured once per process and setting (training or not, threads, ORT's
session settings), on a thread of its own: there no Dynamo compile is under way (its
tracing context and fake mode are per thread). CPU only: on CUDA the floor's stream
synchronization would need the device, and no GPU has checked it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import torch
import torch.fx

from ..capture import aot_backend
from ..fusion import support
from ..options import Options
from ..runtime import stats
from .graph_compiler import GraphCompiler
from .tuner import Tuner, trains

logger = logging.getLogger("lort")

#: Floors by setting (see _key): a handful of keys per process, never evicted.
_floors: dict[tuple, float | None] = {}
_lock = threading.Lock()


def _key(options: Options, train: bool) -> tuple:
    return (train, torch.get_num_threads(), options.intra_op_num_threads, options.allow_spinning,
            options.release_openmp, options.force_spinning_stop, options.share_cpu_arena,
            options.graph_optimization_level, repr(options.providers))


def floor_s(options: Options, train: bool) -> float | None:
    """Seconds of lort's cheapest call (with its backward when ``train``) under
    ``options``' ORT settings; None where it could not be measured."""
    key = _key(options, train)
    with _lock:
        if key in _floors:
            return _floors[key]
        out: dict = {}
        worker = threading.Thread(target=_measure_into, args=(options, train, out), name="lort-call-floor",
                                  daemon=True)
        worker.start()
        worker.join()
        _floors[key] = out.get("s")
        return _floors[key]


def _measure_into(options: Options, train: bool, out: dict) -> None:
    # lort.stats counts the user's sessions and runs, not these (the caller waits: no
    # other lort work runs meanwhile).
    counts = stats.snapshot()
    try:
        out["s"] = _measure(options, train)
    except Exception as e:  # noqa: BLE001 - no floor: the graph is compiled as usual
        logger.info("lort: could not measure lort's own cost of a call (%s: %s)", type(e).__name__, e)
    finally:
        stats.restore(counts)


def _measure(options: Options, train: bool, samples: int = 60) -> float:
    opts = dataclasses.replace(options, executor="ort", mode="ort", disk_cache=False, progress=False,
                               save_onnx=None, pre_ort_model_transforms=(), record_ort_graph=False)
    compiler = GraphCompiler(opts, Tuner(), support.SupportChecker(opts.providers))
    graph = torch.fx.Graph()
    w, x = graph.placeholder("w"), graph.placeholder("x")
    graph.output((graph.call_function(torch.mul, (x, w)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)

    def compile_aot(aot_gm, aot_inputs, kind):
        return compiler.compile(aot_gm, kind, f"floor_{kind}", None)[0]

    with torch.set_grad_enabled(train):
        w_ = torch.ones(1, requires_grad=train)
        x_ = torch.ones(1)
        fn = aot_backend(compile_aot, {})(gm, [w_, x_])
        best = float("inf")
        for i in range(samples + 5):
            t0 = time.perf_counter()
            (y,) = fn(w_, x_)
            if train:
                torch.autograd.grad(y, [w_], torch.ones_like(y))
            if i >= 5:
                best = min(best, time.perf_counter() - t0)
    logger.info("lort: lort's cheapest %s call takes %.1f us here", "training" if train else "inference",
                best * 1e6)
    return best


def eager_below_floor(tuner: Tuner, options: Options, eager, example_inputs: list) -> dict | None:
    """``{"pytorch": s, "ort": floor, "floor": True}`` where ``eager(*example_inputs)``
    (with its backward where the graph trains) runs faster than lort's floor (by
    ``tuner.graph_eager_margin``), else None. Small CPU graphs only: one eager call
    past ``tuner.tiny_graph_s`` ends it (a large model's graph is never timed here)."""
    tensors = [a for a in example_inputs if isinstance(a, torch.Tensor)]
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return None
    if sum(t.numel() * t.element_size() for t in tensors) > tuner.tiny_inputs_bytes:
        return None
    eager_s = tuner.time_tiny_eager(eager, example_inputs)
    if eager_s is None:
        return None
    floor = floor_s(options, trains(example_inputs))
    if floor is None or eager_s >= tuner.graph_eager_margin * floor:
        return None
    return {"pytorch": eager_s, "ort": floor, "floor": True}
