"""The ``lort`` torch.compile backend: options -> AOTAutograd -> fusion -> ORT groups."""

from __future__ import annotations

import dataclasses
import logging
import operator
import warnings
from typing import Any, Callable, Mapping

import torch
import torch.fx
from torch._functorch.aot_autograd import make_boxed_func

from .capture import aot_backend
from .capture import autograd_function
from .diagnostics.report import GraphRecord
from .errors import LortError, SessionCreationError, TranslationError
from .fusion import fuser, support
from .options import Options
from .runtime import providers
from .runtime.group import OrtGroup
from .translate import onnx_export

logger = logging.getLogger("lort")

#: How many times a graph is re-fused after finding nodes that fail to translate.
_MAX_REFUSE = 8


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

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        with autograd_function.capturing():
            compiled = aot_backend(self.compile_graph, self.options.decompose_conv_backward)(gm, example_inputs)
        entries = autograd_function.entries_in(gm)
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

    # -- one ATen graph ------------------------------------------------------------
    def compile_graph(self, gm: torch.fx.GraphModule, example_inputs: list, kind: str) -> Callable:
        self._count += 1
        prefix = f"g{self._count}_{kind}"
        record = GraphRecord(kind=kind, name=prefix, graph_module=gm)
        unsupported: dict[torch.fx.Node, str] = {}
        for node in gm.graph.nodes:
            if node.op == "call_function":
                reason = support.unsupported_reason(node)
                if reason is None:
                    reason = self._device_reason(node)
                if reason is not None:
                    unsupported[node] = reason
        groups, modules = self._fuse_and_prepare(gm, unsupported, prefix)
        record.set_result(groups, modules, unsupported)
        self.records.append(record)
        logger.info("lort: %s", record.summary())
        if not groups:
            return make_boxed_func(gm.forward)
        part = fuser.replace_groups(gm, groups, modules)
        record.partitioned = part
        return make_boxed_func(part.forward)

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
        opts = self.options
        for _ in range(_MAX_REFUSE):
            groups = fuser.find_groups(
                gm.graph, lambda n: n not in unsupported, opts.max_group_args, prefix=prefix
            )
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
        msg = f"lort: {support.op_name(node)} runs in PyTorch: {reason}"
        if self.options.fallback == "raise":
            raise TranslationError(msg)
        warnings.warn(msg, stacklevel=3)


def lort_backend(gm: torch.fx.GraphModule, example_inputs: list, options: Any = None) -> Callable:
    """Entry point of ``torch.compile(model, backend="lort", options={...})``."""
    return LortBackend(options)(gm, example_inputs)


lort_backend._lort_backend = True
# Importing the backend (torch.compile(backend="lort") does) lets Dynamo run untraceable
# autograd.Functions opaquely in graphs compiled by lort; other backends are unaffected.
autograd_function.install()
