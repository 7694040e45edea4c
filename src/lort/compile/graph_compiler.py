"""Compiling one ATen graph (forward, backward or inference): support check, fusion,
group compiles, and the bisect that finds nodes failing to translate.

Returns the graph's callable (groups replaced by ``OrtGroup`` modules) and its
``GraphRecord``: what ran where, and why (typed reasons, lort.reasons).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import time
import warnings
from typing import Callable

import torch
import torch.fx
from torch._functorch.aot_autograd import make_boxed_func

from ..capture import attention, symbolic_sizes
from ..diagnostics import progress
from ..diagnostics.records import GraphRecord
from ..errors import LortError, QuantizationError, SessionCreationError, TranslationError
from ..fusion import fuser, input_views, support
from ..options import Options
from ..reasons import Reason, ReasonKind
from ..runtime import cuda
from ..runtime.group import OrtGroup
from ..runtime.memory import give_back_memory
from ..translate import fx_graphs, onnx_export
from . import disk_cache
from .group_compiler import GroupCompiler
from .tuner import Tuner

logger = logging.getLogger("lort")

#: How many times a graph is re-fused after finding nodes that fail to translate.
MAX_REFUSE = 8


class GraphCompiler:
    """Compiles ATen graphs for one options set, support checker and tuner."""

    def __init__(self, options: Options, tuner: Tuner, checker: support.SupportChecker):
        self.options = options
        self.checker = checker
        self.groups = GroupCompiler(options, tuner)
        self.cache = disk_cache.for_options(options) if options.mode != "pytorch" else None
        #: Compiles training graphs where their options differ: allow_spinning="inference"
        #: (their threads do not spin), release_openmp="training" (their long runs release
        #: PyTorch's OpenMP workers first).
        self._training: GraphCompiler | None = None

    def compile(
        self, gm: torch.fx.GraphModule, kind: str, name: str, captured_s: float | None,
        weights: dict[int, tuple[str, torch.Tensor]] | None = None,
    ) -> tuple[Callable, GraphRecord]:
        """``weights``: placeholder index -> (name, tensor) of the module weights: an
        inference graph may freeze them, any graph times its groups on them (Options.freeze)."""
        if kind != "inference" and (self.options.allow_spinning == "inference"
                                    or self.options.release_openmp == "training"):
            if self._training is None:
                spin, release = self.options.allow_spinning, self.options.release_openmp
                training = dataclasses.replace(self.options, allow_spinning=False if spin == "inference" else spin,
                                               release_openmp=True if release == "training" else release)
                self._training = GraphCompiler(training, self.groups.tuner, self.checker)
            return self._training.compile(gm, kind, name, captured_s, weights)
        progress.log_captured(self.options, name, gm, captured_s)
        if self.options.mode != "pytorch":
            symbolic_sizes.sizes_from_inputs(gm)
            if kind == "inference":
                attention.elementwise_safe_softmax(gm)
        record = GraphRecord(kind=kind, name=name, graph_module=gm)
        plan_key = disk_cache.graph_key(gm, self.options, what="plan") if self.cache else None
        unsupported = self._cached_plan(gm, self.cache.load_record(plan_key)) if self.cache else None
        cached = unsupported is not None
        if unsupported is None:
            unsupported = {}
            for node in gm.graph.nodes:
                if node.op == "call_function":
                    reason = self.checker.reason(node)
                    if reason is not None:
                        unsupported[node] = reason
        made = input_views.split_input_views(gm.graph, unsupported) if self.options.mode != "pytorch" else set()
        if made:
            gm.recompile()
        by_node = _weight_nodes(gm, weights) if self.options.mode != "pytorch" else {}
        # Only an inference graph freezes its weights; any graph times on them.
        freezable = kind == "inference" and self.options.freeze is not False
        if self.options.quantize is not None:
            _check_quantizable(kind, gm, self.options.quantize)
        refused = self._freeze_refused(by_node) if freezable else None
        groups, modules = self._fuse_and_compile(gm, unsupported, name, by_node, refused, freezable,
                                                 kind == "inference")
        if self.cache and not cached:
            self.cache.store_record(plan_key, {"unsupported": {n.name: r.to_json() for n, r in unsupported.items()
                                                               if n not in made}})
        record.set_result(groups, modules, unsupported)
        for mod in modules.values():
            mod.refreeze = self.groups.refreezer(mod.compiled)
            mod.on_run_failure = lambda reason, group=mod.name: record.group_failed_at_run(group, reason)
            if self.cache:
                mod.on_change = self.groups.remember
        logger.info("lort: %s", record.summary())
        give_back_memory()  # what translation, sessions and timing runs freed
        if not groups:
            return make_boxed_func(gm.forward), record
        record.partitioned = fuser.replace_groups(gm, groups, modules)
        return make_boxed_func(record.partitioned.forward), record

    def _cached_plan(self, gm: torch.fx.GraphModule, entry: dict | None) -> dict[torch.fx.Node, Reason] | None:
        """The nodes a previous compile of this very graph (same code, metadata, options
        and versions) left to PyTorch, and why: the support check, which needs
        torch_lib's registry, is skipped. Nodes found by translating are warned about
        (or raised on) again, as on the first compile."""
        entries = entry.get("unsupported") if entry else None
        if not isinstance(entries, dict):
            return None
        by_name = {n.name: n for n in gm.graph.nodes}
        unsupported = {}
        for name, data in entries.items():
            reason = Reason.from_json(data)
            if reason is None or name not in by_name:
                return None
            unsupported[by_name[name]] = reason
        warned = set()
        for node, reason in unsupported.items():
            if not reason.kind.found_by_translating or node.target is operator.getitem:
                continue
            if reason.kind is ReasonKind.TRANSLATION_FAILED:
                self._fail_node(node, reason)
            elif reason not in warned:  # one warning per failed group, as the first time
                warned.add(reason)
                self._fail_message(f"lort: a group runs in PyTorch: {reason.detail}", TranslationError)
        logger.debug("lort: partition of %d nodes read from the disk cache", len(by_name))
        return unsupported

    def _freeze_refused(self, weights: dict) -> str | None:
        """Why freeze="auto" keeps this graph's weights as inputs (they exceed
        Options.freeze_max_mb), or None."""
        if self.options.freeze != "auto" or not weights or self.options.quantize is not None:
            return None  # quantized, ORT holds a copy of a quarter or an eighth of their size
        storages = {}
        for _, t in weights.values():
            storages[(t.device, t.untyped_storage().data_ptr())] = t.untyped_storage().nbytes()
        total_mb = sum(storages.values()) / 2**20
        if total_mb <= self.options.freeze_max_mb:
            return None
        return (f"the graph's weights ({total_mb:.0f} MiB) exceed freeze_max_mb ({self.options.freeze_max_mb:g}); "
                "frozen, ORT would keep its own pre-packed copy of them (freeze=True freezes them)")

    def _fuse_and_compile(self, gm, unsupported, prefix, weights, refused, freezable, inference: bool):
        steps = progress.PrepareProgress(self.options, prefix)
        try:
            with self.groups.alike():  # a transformer's layers fall in many groups
                groups, modules = self._fuse_rounds(gm, unsupported, prefix, steps, weights, refused, freezable,
                                                    inference)
        finally:
            steps.close()
        steps.log(groups, modules)
        return groups, modules

    def _fuse_rounds(self, gm, unsupported, prefix, steps: progress.PrepareProgress, weights: dict, refused,
                     freezable: bool, inference: bool):
        opts = self.options
        # On CUDA, where PyTorch's TF32 flags differ for matmuls and convolutions, each
        # kind in groups of its own (a session has one TF32 switch: runtime/cuda.py).
        apart = cuda.tf32_kind if _on_cuda(gm) and cuda.tf32_flags_differ() else None
        for _ in range(MAX_REFUSE):
            # Frozen weights are no inputs of a group's session: they do not count
            # towards max_group_args.
            groups = fuser.find_groups(
                gm.graph, lambda n: n not in unsupported, opts.max_group_args, prefix=prefix,
                free_inputs=set(weights) if freezable and not refused else set(), apart=apart,
            )
            if opts.mode != "pytorch":
                steps.start_round(len(groups))
            modules: dict[str, OrtGroup] = {}
            found_new = False
            for grp in groups:
                sub, where = fuser.build_group_module(gm, grp)
                if opts.mode == "pytorch":
                    modules[grp.name] = OrtGroup(self.groups.unbuilt(grp.name, sub, where), opts)
                    continue
                times: dict = {}
                try:
                    own = {k: weights[n] for k, n in enumerate(grp.inputs) if n in weights}
                    compiled = self.groups.compile(grp.name, sub, where, times, own if freezable else None, refused,
                                                   real={k: t for k, (_, t) in own.items()},
                                                   inference=inference)
                except (TranslationError, SessionCreationError) as e:
                    steps.group_done(False, times)
                    bad = self._find_failing_nodes(grp)
                    if not bad:
                        self._fail(grp, e)
                        reason = support.group_failed(e)
                        bad = {n: reason for n in grp.nodes}
                    unsupported.update(bad)
                    found_new = True
                    continue
                steps.group_done(compiled.from_cache, times)
                modules[grp.name] = OrtGroup(compiled, opts)
            if not found_new:
                return groups, modules
        groups = [g for g in groups if g.name in modules]
        return groups, modules

    def _find_failing_nodes(self, grp: fuser.FusionGroup) -> dict[torch.fx.Node, Reason]:
        bad = {}
        # A probe only needs to know whether the node translates and ORT accepts it.
        probe = GroupCompiler(
            dataclasses.replace(
                self.options, ort_fusions=False, intra_op_num_threads=1, save_onnx=None, disk_cache=False
            ),
            self.groups.tuner,
        )
        for n in grp.nodes:
            if n.target is operator.getitem:
                continue
            try:
                probe.compile(f"{grp.name}_probe", fx_graphs.single_node_graph(n), None)
            except (TranslationError, SessionCreationError) as e:
                reason = support.translation_failed(e)
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

    def _fail_node(self, node: torch.fx.Node, reason: Reason) -> None:
        self._fail_message(f"lort: {support.op_name(node)} runs in PyTorch: {reason}", TranslationError)

    def _fail_message(self, msg: str, error: type[LortError]) -> None:
        if self.options.fallback == "raise":
            raise error(msg)
        warnings.warn(msg, stacklevel=4)


def _weight_nodes(gm: torch.fx.GraphModule, weights: dict | None) -> dict:
    """Placeholder node -> (name, tensor) of the weights to freeze; a placeholder the
    graph returns as it is (an alias of an output) stays an input."""
    if not weights:
        return {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    returned = set(output.all_input_nodes)
    return {placeholders[i]: w for i, w in weights.items() if i < len(placeholders) and placeholders[i] not in returned}


def captured_seconds(start: float | None, kind: str) -> float | None:
    """Seconds from AOTAutograd receiving the Dynamo graph to this graph (None for a
    backward, compiled later)."""
    return None if start is None or kind == "backward" else time.perf_counter() - start


def _on_cuda(gm: torch.fx.GraphModule) -> bool:
    return any(isinstance(v := n.meta.get("val"), torch.Tensor) and v.device.type == "cuda"
               for n in gm.graph.nodes if n.op == "placeholder")


def _check_quantizable(kind: str, gm: torch.fx.GraphModule, scheme: str) -> None:
    """Options.quantize covers float32 inference on CPU: anything else is a clear error
    (a float16 weight would otherwise stay unquantized without a word)."""
    if kind != "inference":
        raise QuantizationError(
            f"lort option quantize={scheme!r} is for inference only, and this graph trains (a {kind} graph: "
            "some input requires grad). Call the model under torch.no_grad() or torch.inference_mode(), or leave "
            "quantize unset to train")
    if _on_cuda(gm):
        raise QuantizationError(
            f"lort option quantize={scheme!r} runs on CPU only for now, and this graph's tensors are on CUDA: "
            "move the model and inputs to the CPU, or leave quantize unset")
    # 0-d inputs are scalars, not weights: under dynamic=True Dynamo passes a module's
    # float attributes (a norm's epsilon) as 0-d float64 tensors.
    other = sorted({str(v.dtype).replace("torch.", "") for n in gm.graph.nodes if n.op == "placeholder"
                    if isinstance(v := n.meta.get("val"), torch.Tensor) and v.is_floating_point()
                    and v.dtype != torch.float32 and v.dim() > 0})
    if other:
        raise QuantizationError(
            f"lort option quantize={scheme!r} quantizes float32 models, and this graph has {', '.join(other)} "
            "tensors (ORT's quantized products take float32 activations and quantize float32 weights): call "
            "model.float() and pass float32 inputs, or leave quantize unset")
