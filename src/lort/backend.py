"""The ``lort`` torch.compile backend: options -> capture (Dynamo, AOTAutograd) ->
compile (support check, fusion, group compiles, the tuner's choices) -> runtime.

See ARCHITECTURE.md for the stages and the data that flows between them."""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
import warnings
import weakref
from typing import Any, Callable, Mapping

import torch
import torch.fx

from .capture import aot_backend
from .capture import autograd_function, decompositions, distributed
from .capture import weights as weights_mod
from .capture.export import ExportedGraph
from .compile import call_floor, disk_cache, engines, lifetime
from .compile.graph_compiler import GraphCompiler, captured_seconds
from .compile.graph_executor import ChooseOnFirstCall
from .compile.tuner import Tuner
from .diagnostics.records import GraphRecord
from .fusion import support
from .options import RUN_MODES, Options
from .runtime import providers

logger = logging.getLogger("lort")


class LortBackend:
    """A torch.compile backend. ``records`` holds what happened to each captured graph.
    ``tuner`` times and makes the executor and thread choices (compile/tuner.py)."""

    def __init__(self, options: Options | Mapping[str, Any] | None = None, tuner: Tuner | None = None):
        self.options = Options.resolve(options)
        if self.options.providers:
            providers.for_device(torch.device("cpu"), self.options.providers)  # raises if unknown
        self.tuner = tuner if tuner is not None else Tuner()
        self.checker = support.SupportChecker(self.options.providers)
        self.compiler = GraphCompiler(self.options, self.tuner, self.checker)
        self.records: list[GraphRecord] = []
        #: The graphs whose engine executor="auto" picks among lort, eager and inductor
        #: (compile/engines.py), weakly: each ``EngineSwitch`` says ``engine`` once chosen.
        self.switches: list[weakref.ref] = []
        self._count = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        """Compile one Dynamo graph (torch.compile's backend protocol): returns the callable
        Dynamo runs in its place, forward and backward through lort."""
        entries = autograd_function.entries_in(gm)
        timed = self._times_whole_graph(example_inputs, entries)
        cache = disk_cache.for_options(self.options) if timed else None
        choice_key = disk_cache.inputs_key(gm, example_inputs, self.options, "graph executor") if cache else None
        choice = cache.load_record(choice_key) if cache else None
        no_inductor = engines.wants_inductor(self.options, example_inputs) if timed else None
        inductor = timed and no_inductor is None
        if choice and choice.get("executor") == "inductor" and not inductor:
            choice = None  # inductor cannot run here now: chosen again among the others
        if choice and choice.get("executor") in ("pytorch", "inductor"):
            record = self._record_eager_graph(gm, choice.get("times", {}), cached=True,
                                              inductor=choice["executor"] == "inductor")
            self._save_files_of_eager_graph(gm, example_inputs)
            if inductor:
                # Eager PyTorch until inductor is ready (if it is the choice), or inductor
                # timed against eager where it never was.
                return self._with_inductor(gm, example_inputs, gm.forward, [record], cache, choice_key, choice)
            return gm.forward
        if timed:
            # A small graph eager PyTorch runs faster than any call through lort: left
            # uncompiled (compile/call_floor.py).
            below = call_floor.eager_below_floor(self.tuner, self.options, gm.forward, example_inputs)
            if below is not None:
                if cache is not None:
                    cache.store_record(choice_key, {"executor": "pytorch", "times": below})
                self._record_eager_graph(gm, below, cached=False)
                self._save_files_of_eager_graph(gm, example_inputs)
                return gm.forward
        # This Dynamo graph's ATen graphs (forward, backward or inference), in compile order.
        own: list[GraphRecord] = []
        capture_start = time.perf_counter()
        weights = weights_mod.module_weights(gm, example_inputs)
        # The real inputs, for an inference graph's frozen weights, compiled within
        # aot_backend's call; a backward, compiled later, needs none of them, and what it
        # compiles with is kept by AOTAutograd for good (it kept every model's weights).
        real = {"inputs": example_inputs}

        def compile_aot(aot_gm, aot_inputs, kind):
            inputs = real.get("inputs")
            # The weights by placeholder: an inference graph freezes them, a forward
            # graph times on them (a backward's inputs are activations and saved values).
            frozen = _aligned(weights, inputs, aot_inputs) if kind != "backward" and inputs else None
            fn, record = self.compile_graph(
                aot_gm, aot_inputs, kind, captured_seconds(capture_start, kind), weights=frozen
            )
            own.append(record)
            return fn

        with autograd_function.capturing():
            names = support.implemented_overload_names(disk_cache.for_options(self.options))
            decomps = decompositions.table(self.options.decompose_conv_backward, names)
            compiled = aot_backend(compile_aot, decomps)(gm, example_inputs)
        real.clear()
        if timed and not choice:
            settled = self.tuner.settled_by_groups(own)
            if settled is None:
                compiled = ChooseOnFirstCall(gm.forward, compiled, own, self.tuner, cache, choice_key,
                                             self.options.progress)
            else:
                self._settled_by_groups(own, settled, cache, choice_key)
        if inductor:
            compiled = self._with_inductor(gm, example_inputs, compiled, own, cache, choice_key, choice)
        elif timed and "inductor" in self.options.engines:  # asked for, but no candidate: explain says why
            for record in own:
                record.engine_notes.append(f"no inductor candidate: {no_inductor}")
        # Dynamo keeps what a backend returns for good: the graph's sessions and frozen
        # weights go when the module whose weights it reads is collected.
        for owner in weights_mod.owners(gm):
            lifetime.release_with(owner, own)
        if any(g.frozen_count for r in own for g in r.group_modules.values()):
            weights_mod.guard_owner_identity(gm)
        if entries:
            # Opaque autograd.Function calls: their entries (non-tensor arguments) live as
            # long as the compiled callable.
            try:
                compiled._lort_opaque_entries = entries
            except AttributeError:
                inner = compiled

                def compiled(*args):
                    return inner(*args)

                compiled._lort_opaque_entries = entries
        return compiled

    def compile_graph(
        self, gm: torch.fx.GraphModule, example_inputs: list, kind: str, captured_s: float | None = None,
        weights: dict | None = None,
    ) -> tuple[Callable, GraphRecord]:
        """One ATen graph: its callable and its record (also appended to ``records``).
        ``weights``: placeholder index -> (name, tensor) an inference graph may freeze."""
        self._count += 1
        fn, record = self.compiler.compile(gm, kind, f"g{self._count}_{kind}", captured_s, weights)
        self.records.append(record)
        return fn, record

    def compile_exported(self, exported: ExportedGraph, eager: Callable) -> Callable:
        """An inference graph captured by torch.export (capture/export.py; lort.ORTModule's
        direct inference): compiled as the Dynamo path compiles its inference graphs, with
        its weights frozen as Options.freeze says, and with executor="auto" timed against
        ``eager`` (the module itself, over the same arguments) on the first call, and
        against inductor once its background compile is ready (compile/engines.py)."""
        gm, inputs = exported.gm, exported.example_inputs
        weights = exported.weights
        timed = self._times_whole_graph(inputs, ())
        no_inductor = engines.wants_inductor(self.options, inputs) if timed else None
        inductor = timed and no_inductor is None
        cache = disk_cache.for_options(self.options) if timed else None
        key = disk_cache.inputs_key(gm, inputs, self.options, "graph executor") if cache else None
        choice = cache.load_record(key) if cache else None
        if choice and choice.get("executor") == "inductor":
            if inductor:  # eager PyTorch until inductor is ready, then inductor without timing
                record = self._record_eager_graph(gm, choice.get("times", {}), cached=True, inductor=True)
                return self._with_inductor(gm, inputs, eager, [record], cache, key, choice, eager=eager)
            choice = None  # inductor cannot run here now: chosen again among the others
        if timed:
            below = call_floor.eager_below_floor(self.tuner, self.options, eager, inputs)
            if below is not None:
                self._record_eager_graph(gm, below, cached=False)
                self._save_files_of_eager_graph(gm, inputs, exported=True)
                return eager
        # lort's compile rewrites the graph in place; inductor traces the graph as exported.
        original = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph)) if inductor else None
        _, record = self.compile_graph(gm, inputs, "inference", None, weights)
        compiled = record.partitioned if record.partitioned is not None else gm
        if not timed:
            return compiled
        if choice and choice.get("executor") in ("pytorch", "ort"):
            if choice["executor"] == "ort":
                record.executor_times = dict(choice.get("times", {}))
                current = compiled
            else:
                record.ran_whole_in_pytorch(choice.get("times", {}), cached=True)
                current = eager
        else:
            settled = self.tuner.settled_by_groups([record])
            if settled is not None:
                self._settled_by_groups([record], settled, cache, key)
                current = compiled
            else:
                current = ChooseOnFirstCall(eager, compiled, [record], self.tuner, cache, key, self.options.progress)
        if inductor:
            return self._with_inductor(original, inputs, current, [record], cache, key, choice, eager=eager)
        if "inductor" in self.options.engines:  # asked for, but no candidate: explain says why
            record.engine_notes.append(f"no inductor candidate: {no_inductor}")
        return current

    def _with_inductor(self, gm: torch.fx.GraphModule, example_inputs: list, current: Callable, records: list,
                       cache, key, choice: dict | None, eager: Callable | None = None) -> Callable:
        """``current`` (lort's graph, its first-call choice, or eager PyTorch), with
        inductor compiled in the background and taken where faster (compile/engines.py);
        ``current`` itself where the disk cache says inductor was timed slower.
        ``eager``: the graph in eager PyTorch (``gm.forward`` unless given)."""
        times = dict(choice.get("times", {})) if choice else {}
        decided = choice.get("executor") if choice else None
        if decided in ("ort", "pytorch") and "inductor" in times:
            return current
        name = "+".join(r.name for r in records) or "graph"
        switch = engines.EngineSwitch(gm, example_inputs, current, eager or gm.forward, records, self.tuner, cache,
                                      key, name, decided="inductor" if decided == "inductor" else None, times=times)
        if eager is None:  # a Dynamo graph (an exported one lives as long as its ORTModule)
            for owner in weights_mod.owners(gm):
                weakref.finalize(owner, switch.drop)
        self.switches = [ref for ref in self.switches if ref() is not None] + [weakref.ref(switch)]
        return switch

    def _settled_by_groups(self, records: list, times: dict, cache, key) -> None:
        """The groups' timings chose ORT for the whole graph (Tuner.settled_by_groups):
        recorded, and stored as the graph's choice, without timing it again."""
        for record in records:
            record.executor_times = dict(times)
        if cache is not None:
            cache.store_record(key, {"executor": "ort", "times": times})
        logger.info("lort: %s: runs through lort: its ORT groups took %.3f ms, %.3f ms in PyTorch (not timed "
                    "again as a whole)", "+".join(r.name for r in records), times["ort"] * 1e3,
                    times["pytorch"] * 1e3)

    def _times_whole_graph(self, example_inputs: list, entries) -> bool:
        """executor="auto" also weighs the whole graph against eager PyTorch (on CPU or
        one CUDA device; never with opaque autograd.Functions, whose side effects,
        collectives say, must not run at compile time)."""
        opts = self.options
        if opts.executor != "auto" or opts.mode != "ort" or entries:
            return False
        tensors = [a for a in example_inputs if isinstance(a, torch.Tensor)]
        # One device, CPU or CUDA (timed with a device sync around each sample).
        return bool(tensors) and len({a.device for a in tensors}) == 1 and tensors[0].device.type in ("cpu", "cuda")

    # -- ONNX files of a graph that runs in eager PyTorch --------------------------------
    def _saves_files(self) -> bool:
        """The user asked for every graph's ONNX files (Options.save_onnx)."""
        return bool(self.options.save_onnx)

    def _files_backend(self, options: Options) -> "LortBackend":
        """A backend with ``options`` that writes the same files as this one."""
        return LortBackend(options, self.tuner)

    def _save_files_of_eager_graph(self, gm: torch.fx.GraphModule, example_inputs: list,
                                   exported: bool = False) -> None:
        """A graph lort chose to run in eager PyTorch (under its cheapest call, or by a
        choice in the disk cache) is compiled nothing for: where files were asked for,
        it is translated for them alone (every group in ORT, the backward too, weights
        not frozen), and the sessions built for that are released at once. A failure is
        a warning that names the files left unwritten; the graph still runs in PyTorch."""
        if not self._saves_files():
            return
        opts = dataclasses.replace(self.options, executor="ort", freeze=False)
        files = self._files_backend(opts)
        files._count = self._count
        try:
            if exported:  # an inference graph of torch.export (no AOTAutograd)
                files.compile_graph(gm, example_inputs, "inference")
            else:
                # AOTAutograd compiles a backward when it first runs; these never run.
                with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                    files(gm, example_inputs)
            logger.info("lort: %s runs in eager PyTorch; its ONNX files were written all the same (save_onnx)",
                        self.records[-1].name)
        except Exception as e:  # noqa: BLE001 - files only: the graph runs in PyTorch all the same
            msg = (f"lort: {self.records[-1].name} runs in eager PyTorch (lort's choice), and its ONNX files "
                   f"({self._files_wanted()}) could not be written: {type(e).__name__}: {str(e).strip()[:300]}")
            warnings.warn(msg, stacklevel=2)
            logger.warning("%s", msg)
        finally:
            lifetime.release(files.records)

    def _files_wanted(self) -> str:
        return f"the groups' models in {self.options.save_onnx}"

    def _record_eager_graph(self, gm: torch.fx.GraphModule, times: dict, cached: bool,
                            inductor: bool = False) -> GraphRecord:
        """The record of a graph lort compiles nothing for: eager PyTorch runs it, or
        inductor (a choice from the disk cache, compile/engines.py)."""
        self._count += 1
        record = GraphRecord(kind="graph", name=f"g{self._count}_graph", graph_module=gm)
        if inductor:
            record.ran_whole_in_inductor(times, cached=cached)
        else:
            record.ran_whole_in_pytorch(times, cached=cached)
        self.records.append(record)
        logger.info("lort: %s runs in %s (%s)", record.name, "inductor" if inductor else "eager PyTorch",
                    record.fallbacks[0][1] if record.fallbacks else "choice read from the disk cache")
        return record


setattr(LortBackend, autograd_function.BACKEND_MARKER, True)


def _aligned(weights: dict[int, str], real: list, fake: list) -> dict[int, tuple[str, torch.Tensor]] | None:
    """The weights by AOTAutograd placeholder: an inference graph's placeholders are
    the Dynamo graph's inputs in order (checked: same count, and each weight's shape,
    dtype and strides); None where they are not."""
    if not weights or len(real) != len(fake):
        return None
    out = {}
    for i, name in weights.items():
        r, f = real[i], fake[i]
        if not isinstance(f, torch.Tensor) or (r.shape, r.dtype, r.stride()) != (f.shape, f.dtype, f.stride()):
            return None
        out[i] = (name, r)
    return out


def lort_backend(gm: torch.fx.GraphModule, example_inputs: list, options: Any = None, mode: str | None = None) -> Callable:
    """Entry point of ``torch.compile(model, backend="lort", options={...})``;
    ``torch.compile(..., mode="debug")`` (or "ort", "pytorch") sets lort's run mode, and
    torch.compile's own modes (inductor's: "default", "reduce-overhead", "max-autotune",
    ...) are accepted and mean nothing here (one INFO line)."""
    return LortBackend(options_for_mode(mode, options, "lort"))(gm, example_inputs)


#: The modes torch.compile documents: inductor's, which users pass by habit.
TORCH_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_ignored_modes: set[str] = set()


def options_for_mode(mode: str | None, options: Any, backend: str) -> Any:
    """lort's options for ``torch.compile(backend=backend, mode=mode)``: a run mode of
    lort's sets Options.mode; a mode of torch.compile's own is ignored, said once per
    mode at INFO; anything else is a clear error. (torch.compile passes either a mode
    or options, never both.)"""
    if mode is None:
        return options
    if mode in RUN_MODES:
        return {"mode": mode}
    if mode in TORCH_COMPILE_MODES:
        if mode not in _ignored_modes:
            _ignored_modes.add(mode)
            logger.info(
                "lort: torch.compile(backend=%r, mode=%r): that mode is inductor's and means nothing to lort; "
                "ignored (lort's run modes: %s)", backend, mode, ", ".join(RUN_MODES),
            )
        return options
    raise ValueError(
        f"torch.compile(backend={backend!r}, mode={mode!r}): not a mode lort knows. lort's run modes are "
        f"{RUN_MODES} (Options.mode); torch.compile's own modes {TORCH_COMPILE_MODES} are accepted and "
        "ignored. Other settings go in options={...} (lort.Options)"
    )


setattr(lort_backend, autograd_function.BACKEND_MARKER, True)
# Importing the backend (torch.compile(backend="lort") does) lets Dynamo run untraceable
# autograd.Functions opaquely in graphs compiled by lort; other backends are unaffected.
autograd_function.install()
# ... and warns where torch.compile(DDP(model), backend="lort") gives lort no graph.
distributed.install()
