"""The ``lort`` torch.compile backend: options -> AOTAutograd -> fusion -> ORT groups."""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
import time
import warnings
from typing import Any, Callable, Mapping

import torch
import torch.fx
from torch._functorch.aot_autograd import make_boxed_func

from .capture import aot_backend
from .capture import autograd_function, decompositions, distributed
from .diagnostics import progress
from .diagnostics.report import GraphRecord
from .errors import LortError, SessionCreationError, TranslationError
from .fusion import fuser, support
from .options import Options
from .runtime import disk_cache, graph_choice, providers
from .runtime.group import OrtGroup
from .translate import onnx_export

logger = logging.getLogger("lort")

#: How many times a graph is re-fused after finding nodes that fail to translate.
_MAX_REFUSE = 8
#: Reasons given to nodes found unsupported by translating their group (not by the
#: support check); they are warned about.
_FOUND_BY_TRANSLATING = ("translation failed", "its group failed as a whole")


class LortBackend:
    """A torch.compile backend. ``records`` holds what happened to each captured graph."""

    #: Marks lort backends for Dynamo's autograd.Function hook (capture/autograd_function.py).
    _lort_backend = True

    def __init__(self, options: Options | Mapping[str, Any] | None = None):
        self.options = Options.resolve(options)
        if self.options.providers:
            providers.for_device(torch.device("cpu"), self.options.providers)  # raises if unknown
        self.records: list[GraphRecord] = []
        self._count = 0
        self._capture_start: float | None = None  # when AOTAutograd got the Dynamo graph

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        entries = autograd_function.entries_in(gm)
        timed = self._times_whole_graph(example_inputs, entries)
        cache = disk_cache.for_options(self.options) if timed else None
        choice_key = disk_cache.inputs_key(gm, example_inputs, self.options, "graph executor") if cache else None
        choice = cache.load_record(choice_key) if cache else None
        if choice and choice.get("executor") == "pytorch":
            self._record_eager_graph(gm, choice.get("times", {}), cached=True)
            return gm.forward
        first_record = len(self.records)
        self._capture_start = time.perf_counter()
        with autograd_function.capturing():
            decomps = decompositions.table(
                self.options.decompose_conv_backward, decompositions.implemented_names(self.options)
            )
            compiled = aot_backend(self.compile_graph, decomps)(gm, example_inputs)
        if timed and not choice:
            # Timed on the first call (Dynamo's compile context is no place to run the
            # graph and compile its backward), then fixed.
            own = self.records[first_record:]
            compiled = _ChooseOnFirstCall(self, gm, compiled, own, cache, choice_key)
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

    def _record_eager_graph(self, gm: torch.fx.GraphModule, times: dict, cached: bool) -> None:
        self._count += 1
        record = GraphRecord(kind="graph", name=f"g{self._count}_graph", graph_module=gm)
        record.ran_whole_in_pytorch(times, cached=cached)
        self.records.append(record)
        logger.info("lort: %s runs in eager PyTorch (%s)", record.name, "choice read from the disk cache")

    # -- one ATen graph ------------------------------------------------------------
    def compile_graph(self, gm: torch.fx.GraphModule, example_inputs: list, kind: str) -> Callable:
        self._count += 1
        prefix = f"g{self._count}_{kind}"
        start, self._capture_start = getattr(self, "_capture_start", None), None
        captured = None if start is None or kind == "backward" else time.perf_counter() - start
        progress.log_captured(self.options, prefix, gm, captured)
        record = GraphRecord(kind=kind, name=prefix, graph_module=gm)
        cache = disk_cache.for_options(self.options) if self.options.mode != "pytorch" else None
        plan_key = disk_cache.graph_key(gm, self.options, what="plan") if cache else None
        unsupported = self._cached_plan(gm, cache.load_record(plan_key)) if cache else None
        cached = unsupported is not None
        if unsupported is None:
            unsupported = {}
            for node in gm.graph.nodes:
                if node.op == "call_function":
                    reason = support.unsupported_reason(node)
                    if reason is None:
                        reason = self._device_reason(node)
                    if reason is not None:
                        unsupported[node] = reason
        groups, modules = self._fuse_and_prepare(gm, unsupported, prefix)
        if cache and not cached:
            cache.store_record(plan_key, {"unsupported": {n.name: r for n, r in unsupported.items()}})
        record.set_result(groups, modules, unsupported)
        for name, mod in modules.items():
            mod.on_run_failure = functools.partial(record.group_failed_at_run, name)
        self.records.append(record)
        logger.info("lort: %s", record.summary())
        if not groups:
            return make_boxed_func(gm.forward)
        part = fuser.replace_groups(gm, groups, modules)
        record.partitioned = part
        return make_boxed_func(part.forward)

    def _cached_plan(self, gm: torch.fx.GraphModule, record: dict | None) -> dict[torch.fx.Node, str] | None:
        """The nodes a previous compile of this very graph (same code, metadata, options
        and versions) left to PyTorch, and why: the support check, which needs
        torch_lib's registry, is skipped. Nodes found by translating are warned about
        (or raised on) again, as on the first compile."""
        entries = record.get("unsupported") if record else None
        if not isinstance(entries, dict):
            return None
        by_name = {n.name: n for n in gm.graph.nodes}
        if not all(isinstance(r, str) and name in by_name for name, r in entries.items()):
            return None
        unsupported = {by_name[name]: reason for name, reason in entries.items()}
        warned = set()
        for node, reason in unsupported.items():
            if not reason.startswith(_FOUND_BY_TRANSLATING) or node.target is operator.getitem:
                continue
            if reason.startswith("translation failed"):
                self._fail_node(node, reason)
            elif reason not in warned:  # one warning per failed group, as the first time
                warned.add(reason)
                self._fail_message(f"lort: a group runs in PyTorch: {reason}", TranslationError)
        logger.debug("lort: partition of %d nodes read from the disk cache", len(by_name))
        return unsupported

    def _device_reason(self, node: torch.fx.Node) -> str | None:
        val = node.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else [val]
        for v in vals:
            if isinstance(v, torch.Tensor):
                if self.options.providers:
                    return None
                return providers.device_check(v.device)
        return None

    def _fuse_and_prepare(self, gm, unsupported, prefix):
        steps = progress.PrepareProgress(self.options, prefix)
        try:
            groups, modules = self._fuse_rounds(gm, unsupported, prefix, steps)
        finally:
            steps.close()
        steps.log(groups, modules)
        return groups, modules

    def _fuse_rounds(self, gm, unsupported, prefix, steps: progress.PrepareProgress):
        opts = self.options
        for _ in range(_MAX_REFUSE):
            groups = fuser.find_groups(
                gm.graph, lambda n: n not in unsupported, opts.max_group_args, prefix=prefix
            )
            if opts.mode != "pytorch":
                steps.start_round(len(groups))
            modules: dict[str, OrtGroup] = {}
            found_new = False
            for grp in groups:
                sub, where = fuser.build_group_module(gm, grp)
                mod = OrtGroup(grp.name, sub, where, opts)
                if opts.mode != "pytorch":
                    try:
                        mod.prepare()
                    except (TranslationError, SessionCreationError) as e:
                        bad = self._find_failing_nodes(grp)
                        if bad:
                            unsupported.update(bad)
                            found_new = True
                        else:
                            self._fail(grp, e)
                            for n in grp.nodes:
                                unsupported[n] = f"its group failed as a whole: {e}"
                            found_new = True
                        continue
                    finally:
                        steps.group_done(mod)
                modules[grp.name] = mod
            if not found_new:
                return groups, modules
        groups = [g for g in groups if g.name in modules]
        return groups, modules

    def _find_failing_nodes(self, grp: fuser.FusionGroup) -> dict[torch.fx.Node, str]:
        bad = {}
        # A probe only needs to know whether the node translates and ORT accepts it.
        probe_options = dataclasses.replace(
            self.options, ort_fusions=False, intra_op_num_threads=1, save_onnx=None, disk_cache=False
        )
        for n in grp.nodes:
            if n.target is operator.getitem:
                continue
            single = onnx_export.single_node_graph(n)
            probe = OrtGroup(f"{grp.name}_probe", single, None, probe_options)
            try:
                probe.prepare()
            except (TranslationError, SessionCreationError) as e:
                reason = f"translation failed: {e}"
                self._fail_node(n, reason)
                bad[n] = reason
                for u in n.users:
                    if u.target is operator.getitem:
                        bad[u] = reason
        return bad

    def _fail(self, grp: fuser.FusionGroup, error: LortError) -> None:
        if self.options.fallback == "raise":
            raise error
        warnings.warn(f"lort: group {grp.name} runs in PyTorch: {error}", stacklevel=3)

    def _fail_node(self, node: torch.fx.Node, reason: str) -> None:
        self._fail_message(f"lort: {support.op_name(node)} runs in PyTorch: {reason}", TranslationError)

    def _fail_message(self, msg: str, error: type[LortError]) -> None:
        if self.options.fallback == "raise":
            raise error(msg)
        warnings.warn(msg, stacklevel=4)


class _ChooseOnFirstCall:
    """executor="auto" for a whole graph: on the first call, lort's compiled graph and
    eager PyTorch are timed (runtime/graph_choice.py); every call then goes to the
    faster, and the records say which."""

    def __init__(self, backend: LortBackend, gm, compiled, records: list, cache, key):
        self._backend, self._gm, self._compiled = backend, gm, compiled
        self._records, self._cache, self._key = records, cache, key
        self._fn = None

    def __call__(self, *args):
        fn = self._fn
        if fn is None:
            fn = self._fn = self._choose(list(args))
        return fn(*args)

    def _choose(self, args: list) -> Callable:
        compiled, eager = self._compiled, self._gm.forward
        before = len(self._backend.records)
        start = time.perf_counter()
        times = graph_choice.time_candidates({"lort": compiled, "pytorch": eager}, args)
        seconds = time.perf_counter() - start
        # The timing ran this graph's backward, compiling it: its record is this graph's.
        self._records += self._backend.records[before:]
        executor = "pytorch" if times and times["pytorch"] < graph_choice.MARGIN * times["lort"] else "lort"
        if self._cache is not None and times:
            self._cache.store_record(self._key, {"executor": executor, "times": times})
        if times and (executor == "pytorch" or self._backend.options.progress):
            logger.info(
                "lort: %s: whole graph timed in %.2f s: %.3f ms through lort, %.3f ms in eager PyTorch; "
                "runs %s",
                "+".join(r.name for r in self._records) or "graph", seconds, times["lort"] * 1e3,
                times["pytorch"] * 1e3, "through lort" if executor == "lort" else "in eager PyTorch",
            )
        if executor == "lort":
            for record in self._records:
                record.executor_times = dict(times or {})
            return compiled
        for record in self._records:
            record.ran_whole_in_pytorch(times)
        self._compiled = None  # its ORT sessions go
        return eager


def lort_backend(gm: torch.fx.GraphModule, example_inputs: list, options: Any = None) -> Callable:
    """Entry point of ``torch.compile(model, backend="lort", options={...})``."""
    return LortBackend(options)(gm, example_inputs)


lort_backend._lort_backend = True
# Importing the backend (torch.compile(backend="lort") does) lets Dynamo run untraceable
# autograd.Functions opaquely in graphs compiled by lort; other backends are unaffected.
autograd_function.install()
# ... and warns where torch.compile(DDP(model), backend="lort") gives lort no graph.
distributed.install()
