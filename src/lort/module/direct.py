"""ORTModule's direct inference (Options.direct_inference): a no-grad call of a schema
runs a graph captured by torch.export, without Dynamo's per-call guards.

The transition manager's schema key already covers the input structure, non-tensor
inputs, dtypes, ranks, devices, grad mode and the module state (training flags, plain
attributes, parameters, buffers, submodules, hooks). A ``DirectRunner`` is one exported
graph of a schema for one set of input shapes and strides; each call it also checks, at
C speed where it can:

- the inputs' shapes and strides (another set gets its own runner);
- each weight as its module's registry holds it now (a weight replaced there, by an
  attribute set or by a direct write such as torch.func.functional_call's, is run on,
  and frozen again by the frozen-weight guard, unless its dtype, shape, stride or device
  differs: then the runner is stale);
- the weights' data pointers: a moved weight (``p.data = t``) with another dtype, shape,
  stride or device makes the runner stale; one with the same is seen by the frozen-weight
  guard (runtime/frozen.py), which freezes it again;
- the plain attributes of the objects the modules hold (a Hugging Face config): a change
  makes the runner stale.

A stale runner is exported again. What no check sees: Python globals, closures,
containers mutated in place (a list attribute appended to), and what module/watch.py
lists (``__dict__`` written directly, a non-container's submodule registry written
directly); Options.direct_inference=False keeps Dynamo for such modules."""

from __future__ import annotations

import logging
import operator
from typing import Callable

import torch

from ..backend import LortBackend
from ..capture.export import ExportedGraph, ExportRefused, decomposition_table, export_inference
from ..compile import disk_cache
from ..compile.engines import EngineSwitch
from ..compile.graph_executor import ChooseOnFirstCall
from ..fusion import support
from ..runtime.frozen import picker
from ..runtime.group import OrtGroup
from . import io
from .state import PLAIN, same_snapshot

logger = logging.getLogger("lort.module")

try:  # Dynamo's C++ tensor check (lane's input check; the Python comparison without it)
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - depends on the torch build
    _TensorGuards = None

_SHAPE = operator.attrgetter("shape")
_STRIDE = torch.Tensor.stride
_DATA_PTR = torch.Tensor.data_ptr
#: Runners (input shapes) per schema; calls with further shapes go through Dynamo.
MAX_RUNNERS = 4


class Stale(Exception):
    """A runner's graph no longer describes the module (the reason is the message)."""


class _Box:
    value = None


class _Flat(torch.nn.Module):
    """``module`` as a function of a schema's flat input tensors, returning its output
    tensors (the output's structure is kept in ``out_spec`` while tracing: in a list, as
    torch.export restores the module's attributes after tracing)."""

    def __init__(self, module: torch.nn.Module, spec: tuple):
        super().__init__()
        self.m = module
        self._spec = spec
        self._out = _Box()

    def forward(self, *flat):
        args, kwargs = io.unflatten(self._spec, flat)
        tensors, self._out.value = io.flatten(self.m(*args, **kwargs))
        return tuple(tensors)

    @property
    def out_spec(self):
        return self._out.value


def shape_key(tensors: list[torch.Tensor]) -> tuple:
    return tuple(map(_SHAPE, tensors)), tuple(map(_STRIDE, tensors))


class DirectRunner:
    """One exported graph: ``run(tensors)`` returns the module's output."""

    def __init__(self, fn: Callable, exported: ExportedGraph, out_spec, shapes: tuple, modules: list,
                 root: torch.nn.Module, epoch: int, eager: Callable | None = None):
        self._fn = fn
        self._eager = eager
        #: executor="auto" chose eager PyTorch for the whole graph: the caller then runs
        #: the module itself (nothing of the graph's to check).
        self.runs_eager = False
        self.shapes = shapes
        #: The module's output from the graph's output tensors; ``single``: it is the one
        #: output tensor itself.
        self.single = out_spec[0] == "tensor"
        self.output = (lambda outs: outs[0]) if self.single else (lambda outs: io.unflatten(out_spec, outs))
        self._weights = [exported.example_inputs[i] for i in sorted(exported.weights)]
        self._weight_names = [exported.weights[i][0] for i in sorted(exported.weights)]
        # Where each weight is read on every call: its module's parameter or buffer dict,
        # or ``__dict__`` (registries written directly, as torch.func.functional_call
        # does, are no attribute set: module/watch.py does not see them).
        self._owners, self._keys = _owners(root, exported, sorted(exported.weights))
        self._meta = [_meta(t) for t in self._weights]
        self._ptrs = list(map(_DATA_PTR, self._weights))
        # The k-th of (*weights, *tensors) is placeholder order[k].
        self._order = sorted(exported.weights) + exported.user_inputs
        self._call = self._general(fn)
        # After the first call, where the graph is one ORT group holding every weight
        # frozen: tensors -> outputs, or None to take the full path (_route).
        self._steady: Callable | None = None
        self._settled = False
        # What the module state's token does not cover: the objects held as attributes
        # (their identity, checked when the module tree changed, and their attributes,
        # checked on every call).
        self._held = held_objects(modules)
        self._held_dicts = [obj.__dict__ for *_, obj in self._held]
        self._held_values = [tuple(d.values()) for d in self._held_dicts]
        self.epoch = epoch

    @property
    def settled(self) -> bool:
        """Whether the graph's executor is chosen (after the first call)."""
        return self._settled

    def matches(self, tensors: list[torch.Tensor]) -> bool:
        return shape_key(tensors) == self.shapes

    def run(self, tensors: list[torch.Tensor], epoch: int, steady_tried: bool = False):
        """The module's output; ``epoch`` counts the changes the transition manager saw
        in the module tree (attributes set, replaced or deleted). ``steady_tried``: the
        caller (the lane) already tried the settled route for this call, which declined."""
        if epoch != self.epoch:
            self._replaced()
            self.epoch = epoch
        if self._held and not same_snapshot(self._held_values, [tuple(d.values()) for d in self._held_dicts]):
            raise Stale(self._held_change())
        if self._steady is not None and not steady_tried:
            outs = self._steady(tensors)
            if outs is not None:
                return self.output(outs)
        try:
            current = list(map(operator.getitem, self._owners, self._keys))
        except KeyError:
            raise Stale("a weight was removed from its module") from None
        if not all(map(operator.is_, current, self._weights)):
            self._weights_replaced(current)
        weights = self._weights
        if list(map(_DATA_PTR, weights)) != self._ptrs:
            self._weights_moved()
        outs = self._call(weights, tensors)
        if not self._settled:
            self._settle(fn=self._fn)
        return self.output(outs)

    # -- the call ----------------------------------------------------------------------
    def _general(self, fn: Callable) -> Callable:
        """Calls ``fn`` (the graph, or eager PyTorch over the same arguments) with the
        placeholders in their order."""
        order = self._order
        if order == list(range(len(order))):
            return lambda weights, tensors: list(fn(*weights, *tensors))

        def call(weights, tensors):
            args = [None] * len(order)
            for pos, t in zip(order, (*weights, *tensors)):
                args[pos] = t
            return list(fn(*args))

        return call

    def _settle(self, fn: Callable) -> None:
        """After each call until executor="auto" has chosen (the first call; with inductor
        among the engines, the call that finds its compile ready and times it): a graph
        that is one ORT group is then called without the FX graph around it."""
        if isinstance(fn, EngineSwitch):
            if fn.chosen is None:
                return
            fn = fn.chosen
        if isinstance(fn, ChooseOnFirstCall):
            if fn.chosen is None:
                return
            fn = fn.chosen
        self._settled = True
        if fn is self._eager:
            self.runs_eager = True
            return
        single = _single_group(fn)
        if single is None:
            self._call = self._general(fn)
            return
        group, arg_places, out_index = single
        source = {pos: k for k, pos in enumerate(self._order)}  # placeholder -> index in (*weights, *tensors)
        picks = [source[p] for p in arg_places]
        pick, forward = picker(picks), group.forward
        select = None if out_index == list(range(len(group.where))) else picker(out_index)

        def call(weights, tensors):
            outs = forward(*pick((*weights, *tensors)))
            if self._steady is not None:  # the group's route as it is now (weights frozen again)
                self._steady = self._route(group, picks, out_index)
            return outs if select is None else select(outs)

        self._call = call
        self._steady = self._route(group, picks, out_index)

    def _route(self, group, picks: list[int], out_index: list[int] | None) -> Callable | None:
        """``tensors -> outputs or None``: the group's shortest route
        (runtime/group.py, steady_run), where the group takes every weight the graph reads
        frozen (the graph reads no other: BatchNorm's num_batches_tracked in eval) and
        only the call's tensors as inputs. Its frozen-weight guard reads the weights from
        their registries (module/watch.py does not see a registry written directly) and
        checks them (identity, version, data pointer), which covers the runner's own
        identity and pointer checks."""
        split, n = group.steady_inputs(), len(self._weights)
        if split is None:
            return None
        frozen, live = [picks[j] for j in split[0]], [picks[j] for j in split[1]]
        if not (all(k < n for k in frozen) and all(k >= n for k in live) and set(frozen) >= {k for k in picks if k < n}):
            return None
        return group.steady_run([self._owners[k] for k in frozen], [self._keys[k] for k in frozen],
                                [k - n for k in live], out_index)

    def _weights_replaced(self, current: list[torch.Tensor]) -> None:
        """Weights replaced in their registries: the call runs on the new ones (the
        frozen-weight guard freezes them again) unless one differs in dtype, shape,
        stride or device."""
        for name, t, meta in zip(self._weight_names, current, self._meta):
            if not isinstance(t, torch.Tensor):
                raise Stale(f"weight {name} replaced by a {type(t).__name__}")
            if _meta(t) != meta:
                raise Stale(f"weight {name} replaced by a {t.dtype}{list(t.shape)} tensor on {t.device} (was "
                            f"{meta[0]}{list(meta[1])} on {meta[3]})")
        self._weights = current

    def _weights_moved(self) -> None:
        for name, t, meta in zip(self._weight_names, self._weights, self._meta):
            if _meta(t) != meta:
                raise Stale(f"weight {name} changed to {t.dtype}{list(t.shape)} on {t.device} (was {meta[0]}"
                            f"{list(meta[1])} on {meta[3]})")
        self._ptrs = list(map(_DATA_PTR, self._weights))

    def _held_change(self) -> str:
        for (where, *_), d, values in zip(self._held, self._held_dicts, self._held_values):
            if not same_snapshot([values], [tuple(d.values())]):
                return f"an attribute of {where} changed"
        return "an attribute of an object the module holds changed"

    def _replaced(self) -> None:
        for where, d, key, obj in self._held:
            if d.get(key, None) is not obj:
                raise Stale(f"attribute {where} replaced")


#: What a lane returns where it does not serve the call.
MISS = object()
_META = operator.attrgetter("dtype", "device", "requires_grad", "shape")
# Autocast on for any device type (torch's own check where it has one).
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"))


def lane(entry, runner: DirectRunner, tensors: list, grad: bool, state: int, tree) -> Callable:
    """ORTModule's steady state: ``lane(args)`` is the output of a call made as the one
    that built it, or MISS (the transition manager then takes its full path, which
    decides and says why). The same call: positional tensors only, of the same count,
    types, dtypes, devices, requires_grad, shapes and strides, the same grad mode and
    module state token (``tree``: module/state.py's ModuleState), no autocast, and the
    entry still runs ``runner``. The runner's own checks (weights, held objects) follow;
    one that finds it stale gives MISS before running anything."""
    same_tensors = _same_tensors(tensors)
    token, run, is_grad_enabled = tree.token, runner.run, torch.is_grad_enabled
    # The runner's settled route, taken here where run() would take it first (nothing
    # replaced in the module tree since, no held objects whose attributes it compares).
    shortcut, output, single = not runner._held, runner.output, runner.single

    def call(args):
        if (is_grad_enabled() != grad or entry.runner is not runner or entry.eager or _any_autocast()
                or token() != state or not same_tensors(args)):
            return MISS
        tried = False
        if shortcut and tree.epoch == runner.epoch:
            steady = runner._steady
            if steady is not None:
                outs, tried = steady(args), True
                if outs is not None:
                    entry.calls += 1
                    return outs[0] if single else output(outs)
        try:
            out = run(args, tree.epoch, tried)  # (a declined route is not tried twice)
        except Stale:
            return MISS
        entry.calls += 1
        return out

    return call


def _same_tensors(tensors: list) -> Callable[[tuple], bool]:
    """``same(args)``: whether ``args`` are as many tensors as ``tensors``, of the same
    Python types, dtypes, devices, requires_grad, shapes and strides. Dynamo's C++ tensor
    check (its TENSOR_MATCH guard, which also compares the dispatch keys: a tensor made
    under torch.inference_mode, or a call under it, gives False) where torch has it: one
    C call instead of the Python comparison it falls back to."""
    guards = None
    if _TensorGuards is not None:
        try:
            guards = _TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                                   dynamic_dims_strides=[list(t.stride()) for t in tensors])
            if not guards.check(*tensors):  # a torch whose check means something else
                guards = None
        except Exception:  # noqa: BLE001 - its signature changed: the Python comparison
            guards = None
    if guards is not None:
        n, check = len(tensors), guards.check
        return lambda args: len(args) == n and check(*args)
    types, meta, strides = tuple(map(type, tensors)), tuple(map(_META, tensors)), tuple(map(_STRIDE, tensors))
    return lambda args: (tuple(map(type, args)) == types and tuple(map(_META, args)) == meta
                         and tuple(map(_STRIDE, args)) == strides)


def _single_group(fn) -> tuple | None:
    """(the OrtGroup, the placeholder each of its arguments is, which of its outputs the
    graph returns) where ``fn`` is an FX graph that only calls one OrtGroup; else None."""
    if not isinstance(fn, torch.fx.GraphModule):
        return None
    nodes = list(fn.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    calls = [n for n in nodes if n.op == "call_module"]
    if len(calls) != 1 or calls[0].kwargs or not all(a in placeholders for a in calls[0].args):
        return None
    call = calls[0]
    group = fn.get_submodule(call.target)
    out = nodes[-1].args[0] if nodes[-1].op == "output" else None
    picks = [n for n in nodes if n.op == "call_function" and n.target is operator.getitem and n.args[0] is call]
    if not isinstance(group, OrtGroup) or len(nodes) != len(placeholders) + 2 + len(picks) \
            or not isinstance(out, (tuple, list)) or not all(o in picks for o in out):
        return None
    return group, [placeholders.index(a) for a in call.args], [o.args[1] for o in out]


def _owners(root: torch.nn.Module, exported: ExportedGraph, order: list[int]) -> tuple[list[dict], list]:
    """(the dict each weight is read from per call, its key there), in ``order``: a
    module's ``_parameters``, ``_buffers`` or ``__dict__`` for a weight that is an
    attribute (of a module, or of an object a module holds), a dict of its own for a
    constant made while tracing. Raises ExportRefused for a tensor found elsewhere (a
    property, say)."""
    owners, keys = [], []
    for i in order:
        target = exported.targets.get(i)
        if target is None:
            owners.append({0: exported.example_inputs[i]})
            keys.append(0)
            continue
        path, _, key = target.rpartition(".")
        d = getattr(operator.attrgetter(path)(root), "__dict__", None)
        if not isinstance(d, dict) or key not in d and not any(key in d.get(r, ()) for r in ("_parameters", "_buffers")):
            raise ExportRefused(f"weight {target} is in no attribute dict (its changes could not be seen)")
        owner = next((d[r] for r in ("_parameters", "_buffers") if key in d.get(r, ())), d)
        owners.append(owner)
        keys.append(key)
    return owners, keys


def describe_change(old: tuple, new: tuple, paths: list[str]) -> str:
    """How two ``shape_key``s differ, naming the inputs."""
    parts = []
    for what, olds, news in (("shape", old[0], new[0]), ("strides", old[1], new[1])):
        for path, a, b in zip(paths, olds, news):
            if tuple(a) != tuple(b):
                parts.append(f"input '{path}' {what} changed {tuple(a)} -> {tuple(b)}")
    return "; ".join(parts) or "input shapes changed"


def _meta(t: torch.Tensor) -> tuple:
    return t.dtype, tuple(t.shape), tuple(t.stride()), t.device


#: Attribute values that are no plain object a forward reads settings from (containers,
#: OrderedDicts of hooks included, are compared by the module state as they are).
_NOT_HELD = (torch.Tensor, torch.nn.Module, type, dict, list, tuple, set, frozenset)


def held_objects(modules: list[tuple[str, torch.nn.Module]]) -> list[tuple[str, dict, str, object]]:
    """(where, the module's ``__dict__``, the attribute, the object) for each plain Python
    object the modules hold as an attribute (a Hugging Face config, a settings object),
    each once, whose attributes a forward may read: not tensors, modules, functions or
    containers."""
    seen, out = set(), []
    for name, m in modules:
        d = m.__dict__
        for key, v in d.items():
            if (type(v) in PLAIN or isinstance(v, _NOT_HELD) or callable(v)
                    or id(v) in seen or not isinstance(getattr(v, "__dict__", None), dict) or key.startswith("__")):
                continue
            seen.add(id(v))
            out.append((f"{name}.{key}" if name else key, d, key, v))
    return out


def build(module: torch.nn.Module, spec: tuple, tensors: list[torch.Tensor], backend: LortBackend,
          modules: list, epoch: int) -> DirectRunner:
    """Export ``module`` for a schema's call, compile it with ``backend``. Raises
    ExportRefused."""
    opaque = io.opaque_constant(spec)
    if opaque is not None:
        # The forward may change it (a DynamicCache's update): export would write its fake
        # tensors into the caller's object; Dynamo replays such changes on real ones.
        raise ExportRefused(f"an input holds a {opaque.__name__}, which export would change with fake tensors")
    opts = backend.options
    names = support.implemented_overload_names(disk_cache.for_options(opts))
    table = decomposition_table(opts.decompose_conv_backward, names)
    flat = _Flat(module, spec)
    exported = export_inference(flat, tensors, table, prefix="m.")
    out_spec = flat.out_spec
    opaque = io.opaque_constant(out_spec)
    if opaque is not None:
        # It was made while tracing (its tensors fake): only Dynamo can rebuild it per call.
        raise ExportRefused(f"the output holds a {opaque.__name__}, which lort cannot rebuild without Dynamo")
    user = exported.user_inputs

    def eager(*args):
        with torch.no_grad():
            return flat(*[args[i] for i in user])

    fn = backend.compile_exported(exported, eager)
    return DirectRunner(fn, exported, out_spec, shape_key(tensors), modules, flat, epoch, eager)


__all__ = ["DirectRunner", "ExportRefused", "MAX_RUNNERS", "Stale", "build", "describe_change", "held_objects", "shape_key"]
