"""ORTModule's graph transition manager (seed 002): for each call, flatten the inputs
into a schema, decide whether a compiled entry can be reused or the module must be
captured again (and say why), run, and rebuild the outputs.

A schema key is what a graph depends on besides shapes:

- the input structure and every non-tensor input (``io.flatten_call``'s spec); an
  object that holds state (a DynamicCache) counts by its class only: it is passed to
  the compiled function, and Dynamo guards on what the graph reads from it,
- each input tensor's dtype, rank, device and ``requires_grad``,
- grad mode,
- the module's state: ``training`` of every submodule, every plain attribute (bool, int,
  float, str, None), which parameters, buffers and submodules are registered, and the
  number of hooks.

Each key owns an entry: a function over the flat list of input tensors (unflatten with
the schema's constants, call the module, flatten the outputs) compiled with
``torch.compile(fullgraph=True)`` and a ``LortBackend`` of its own, on a code object of
its own, so Dynamo's cache of one entry never serves or evicts another. Shapes are not in
the key: they follow the core's dynamic-shape rules (the first shape change re-captures
the entry with dynamic dims). Any re-capture Dynamo makes inside an entry (a shape
change, or a guard on something outside the key, like ``model.config``) is counted and
logged with its reason too. A forward that specializes on a size is captured once more
with every size dynamic, and never reaches the user's loop as Dynamo's recompile-limit
error (module/recapture.py). Entries live in a bounded LRU cache.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import logging
import os
import types
import warnings
from typing import Any, Callable

import torch

from ..backend import LortBackend
from ..compile import lifetime
from ..errors import CaptureError, QuantizationError
from ..options import Options
from . import debug_files, direct, io, logging_calls, recapture
from .recapture import is_capture_failure as _is_capture_failure, one_line as _one_line
from .recapture import user_stacklevel as _user_stacklevel
from .state import ModuleState

logger = logging.getLogger("lort.module")

# -- schema keys and entries -----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SchemaKey:
    """Everything a compiled graph depends on except input shapes."""

    spec: tuple
    tensors: tuple  # (dtype, rank, device, requires_grad) per input tensor
    grad_enabled: bool
    state: int  # the module state's token (equal states share a token)


@dataclasses.dataclass
class Capture:
    """One capture: which entry, and why."""

    entry: int
    reason: str


class Entry:
    """A schema's compiled function, its backend (graph records) and its fallback state."""

    def __init__(self, index: int, key: SchemaKey, fn: Callable, backend: LortBackend | None):
        self.index = index
        self.key = key
        self.fn = fn
        self.backend = backend
        self.calls = 0
        self.eager = False  # capture failed: runs the module in PyTorch
        self.last_shapes: list | None = None
        self.code: types.CodeType | None = None  # the code object Dynamo caches this entry on
        self.size = recapture.SizeState()  # how new input sizes are captured (module/recapture.py)
        # Direct inference (no grad): runners by input shapes, the last one used, and why
        # the entry cannot take the direct path (it then goes through Dynamo).
        self.direct = not key.grad_enabled
        self.runners: dict[tuple, direct.DirectRunner] = {}
        self.runner: direct.DirectRunner | None = None
        self.direct_refused: str | None = None

    @property
    def records(self) -> list:
        live = [r for records in self.size.retired for r in records]
        return live + (list(self.backend.records) if self.backend is not None else [])

    def graph_count(self) -> int:
        if self.backend is None:
            return 0
        return sum(1 for r in self.backend.records if r.kind != "backward")


def _make_flat_fn(module: torch.nn.Module, spec: tuple, tag: str) -> Callable:
    """``fn(objects, *tensors) -> (output tensors, output spec)`` for one schema, on a
    fresh code object named ``tag`` (Dynamo caches and counts recompiles per code object);
    ``objects``: the call's ``("object", cls)`` leaves (io.flatten_call)."""

    def call(objects, *flat):
        args, kwargs = io.unflatten(spec, flat, objects)
        out = module(*args, **kwargs)
        tensors, out_spec = io.flatten(out)
        return tuple(tensors), out_spec

    code = call.__code__.replace(co_name=tag, co_qualname=tag) if hasattr(call.__code__, "co_qualname") \
        else call.__code__.replace(co_name=tag)
    # Globals of its own: Dynamo installs each compiled graph as a global of the frame it
    # compiles (``__compiled_fn_...``, never removed, torch._dynamo.reset() included);
    # in this module's globals, every dropped ORTModule's graphs and ORT sessions stayed.
    return types.FunctionType(code, {"io": io, "__builtins__": __builtins__}, tag, None, call.__closure__)


def _forward_arg_names(module: torch.nn.Module) -> list[str]:
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


class TransitionManager(recapture.SizePolicy):
    """Owns ORTModule's state machine: schema -> cached entry, reuse or re-capture with
    a reason, fallback, output restoration. ``captures`` lists every capture. How new
    input sizes are captured, and what happens past Dynamo's recompile limit, is
    ``recapture.SizePolicy``'s."""

    def __init__(self, module: torch.nn.Module, options: Options, name: str = "",
                 save_onnx: tuple[str, str] | None = None):
        self.module = module
        self.options = options
        self.name = name or type(module).__name__
        self._save_onnx = save_onnx
        self._arg_names = _forward_arg_names(module)
        self.entries: collections.OrderedDict[SchemaKey, Entry] = collections.OrderedDict()
        self.captures: list[Capture] = []
        self._next_index = 0
        self._last_key: SchemaKey | None = None
        self._last_entry: Entry | None = None  # the entry of _last_key
        # Module state: the modules walked, the last state seen and its token.
        self._tree = ModuleState(module)  # the module state and its change counter
        #: ``lane(args)`` (direct.lane): the output of a call made as the last direct one,
        #: or direct.MISS (then call ``full``); None where there is none.
        self.lane: Callable | None = None

    # -- bookkeeping ---------------------------------------------------------------
    @property
    def records(self) -> list:
        """Every graph lort compiled for this module (GraphRecords, all entries)."""
        return [r for e in self.entries.values() for r in e.records]

    def invalidate(self, reason: str) -> None:
        """Forget every entry (e.g. the module was converted by ``to()``): the next call
        captures again, logging ``reason``."""
        self.entries.clear()
        self.lane = None
        self._last_key = None
        self._last_entry = None
        self._pending_reason = reason
        self._tree.refresh()

    _pending_reason: str | None = None

    # -- a call ----------------------------------------------------------------------
    # An ORTModule compiles its module itself: under an outer torch.compile (of the wrapper
    # or of code that calls it) Dynamo would trace this manager and fail deep in its own
    # code generation; the call runs as one step outside the outer graph instead.
    @torch.compiler.disable
    def __call__(self, args: tuple, kwargs: dict) -> Any:
        if self.lane is not None and not kwargs:  # direct inference's steady state
            out = self.lane(args)
            if out is not direct.MISS:
                return out
        return self.full(args, kwargs)

    def full(self, args: tuple, kwargs: dict) -> Any:
        """A call by the full path (the schema key, the entry, its runner or Dynamo)."""
        objects: list = []
        tensors, spec = io.flatten_call(args, kwargs, self._arg_names, objects=objects)
        meta = tuple((t.dtype, t.dim(), t.device, t.requires_grad) for t in tensors)
        grad, state = torch.is_grad_enabled(), self._tree.token()
        last, entry = self._last_key, self._last_entry
        # The same schema as the last call (the common case): its entry, without building
        # and hashing a key.
        if not (entry is not None and last.spec == spec and last.tensors == meta and last.grad_enabled == grad
                and last.state == state):
            key = SchemaKey(spec, meta, grad, state)
            entry = self.entries.get(key)
            if entry is None:
                entry = self._new_entry(key)
            else:
                self.entries.move_to_end(key)
            self._last_key, self._last_entry = key, entry
        if entry.eager:
            return self.module(*args, **kwargs)
        if entry.direct and self.options.direct_inference and not _autocast():
            runner = entry.runner
            if runner is None or not runner.matches(tensors):
                runner = self._direct_runner(entry, tensors)
            if runner is not None:
                if runner.runs_eager:  # executor="auto" timed eager PyTorch faster
                    return self.module(*args, **kwargs)
                out = self._run_direct(entry, runner, tensors)
                runner = entry.runner
                if spec is io.tensor_call_spec(len(tensors)) and runner is not None and runner.settled \
                        and not runner.runs_eager:
                    self.lane = direct.lane(entry, runner, tensors, grad, state, self._tree)
                return out
        return self._run(entry, tensors, args, kwargs, tuple(objects))

    # -- direct inference (module/direct.py) -------------------------------------------
    def _direct_runner(self, entry: Entry, tensors: list) -> "direct.DirectRunner | None":
        """The entry's runner for these input shapes, exported now if new; None where
        the call goes through Dynamo."""
        shapes = direct.shape_key(tensors)
        runner = entry.runners.get(shapes)
        if runner is None and entry.direct_refused is None:
            if len(entry.runners) >= direct.MAX_RUNNERS:
                entry.direct_refused = f"more than {direct.MAX_RUNNERS} input shapes"
                logger.info("lort.ORTModule(%s): schema s%d: %s; further shapes go through Dynamo",
                            self.name, entry.index, entry.direct_refused)
                return None
            if entry.runners:
                last = entry.runner or next(reversed(entry.runners.values()))
                reason = direct.describe_change(last.shapes, shapes, io.arg_paths(entry.key.spec, self._arg_names))
                self._log_capture(entry, f"{reason} (exported for these shapes)")
            runner = self._build_direct(entry, tensors)
        entry.runner = runner
        return runner

    def _build_direct(self, entry: Entry, tensors: list) -> "direct.DirectRunner | None":
        try:
            runner = direct.build(self.module, entry.key.spec, tensors, entry.backend,
                                  self._tree.named(), self._tree.epoch)
        except direct.ExportRefused as e:
            entry.direct_refused = str(e)
            logger.info("lort.ORTModule(%s): schema s%d goes through Dynamo: %s", self.name, entry.index, e)
            return None
        entry.runners[runner.shapes] = runner
        logger.info("lort.ORTModule(%s): schema s%d exported for direct inference", self.name, entry.index)
        return runner

    def _run_direct(self, entry: Entry, runner: "direct.DirectRunner", tensors: list) -> Any:
        try:
            out = runner.run(tensors, self._tree.epoch)
        except direct.Stale as e:
            entry.runners.pop(runner.shapes, None)
            entry.runner = None
            self._log_capture(entry, f"{e} (exported again)")
            runner = self._build_direct(entry, tensors)
            if runner is None:
                return self._run(entry, tensors, *io.unflatten(entry.key.spec, tensors))
            entry.runner = runner
            out = runner.run(tensors, self._tree.epoch)
        entry.calls += 1
        return out

    def _log_capture(self, entry: Entry, reason: str) -> None:
        self.captures.append(Capture(entry.index, reason))
        logger.info("lort.ORTModule(%s): re-capture of schema s%d: %s", self.name, entry.index, reason)

    def _new_entry(self, key: SchemaKey) -> Entry:
        self.lane = None  # it may hold an entry this one evicts
        reason = self._reason(key)
        self._pending_reason = None
        self._next_index += 1
        index = self._next_index
        mode = "train" if self.module.training else "eval"
        save = None
        if self._save_onnx is not None:
            directory, prefix = self._save_onnx
            # onnxruntime-training's file names say the module's mode, as its
            # training manager runs only in train mode with grad enabled.
            names = "training" if self.module.training and key.grad_enabled else "inference"
            save = debug_files.Save(directory, f"{prefix}_{mode}_s{index}", prefix, names)
            self._write_schema(directory, save.stem, key)
        entry = Entry(index, key, None, None)
        self._compile_fn(entry, debug_files.ModuleBackend(self.options, save), dynamic=None)
        self.entries[key] = entry
        while len(self.entries) > self.options.schema_cache_size:
            old_key, old = self.entries.popitem(last=False)
            if old is self._last_entry:
                self._last_entry = None
            logger.info("lort.ORTModule(%s): schema s%d evicted (cache size %d)",
                        self.name, old.index, self.options.schema_cache_size)
        self.captures.append(Capture(index, reason))
        logger.info("lort.ORTModule(%s): capture of schema s%d (%s): %s", self.name, index, mode, reason)
        strings = io.string_paths(key.spec, self._arg_names)
        if strings:
            logger.info(
                "lort.ORTModule(%s): schema s%d: input(s) %s of type str/bytes are constants of the graph, which "
                "reads no tensor from them (a call with another value captures again); consider moving constant "
                "arguments to the module's constructor", self.name, index,
                ", ".join(f"{p or 'input'}={v!r:.40}" for p, v in strings),
            )
        return entry

    def _compile_fn(self, entry: Entry, backend: debug_files.ModuleBackend, dynamic: bool | None) -> None:
        """The entry's function over flat tensors, compiled by ``backend`` on a code object
        of its own (``dynamic`` as torch.compile's: None for automatic dynamic shapes,
        True for every size dynamic, False for static sizes)."""
        tag = f"{recapture.CODE_PREFIX}{entry.index}" + {None: "", True: "_dynamic", False: "_static"}[dynamic]
        raw = _make_flat_fn(self.module, entry.key.spec, tag)
        entry.fn = torch.compile(raw, backend=backend, fullgraph=True, dynamic=dynamic)
        entry.backend = backend
        entry.code = raw.__code__
        # The entry's sessions and frozen weights go with it (evicted, or the ORTModule
        # dropped), though Dynamo keeps its compiled graphs (compile/lifetime.py).
        lifetime.release_with(entry, backend.records)

    def _write_schema(self, directory: str, stem: str, key: SchemaKey) -> None:
        os.makedirs(directory, exist_ok=True)
        paths = io.arg_paths(key.spec, self._arg_names)
        lines = [f"inputs: {io.describe(key.spec)}", f"grad enabled: {key.grad_enabled}",
                 f"training: {self.module.training}"]
        for p, (dtype, rank, device, rg) in zip(paths, key.tensors):
            lines.append(f"  {p}: {dtype}, rank {rank}, {device}, requires_grad={rg}")
        with open(os.path.join(directory, f"{stem}_schema.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")

    def _run(self, entry: Entry, tensors: list, args: tuple, kwargs: dict, objects: tuple = ()) -> Any:
        size = entry.size
        if size.past_limit and self._known_uncompiled(entry, tensors):
            return self.module(*args, **kwargs)
        before = entry.graph_count()
        try:
            with logging_calls.ignored():  # a call may capture (module/logging_calls.py)
                out_tensors, out_spec = entry.fn(objects, *tensors)
        except Exception as e:
            inner = getattr(e, "inner_exception", e)  # Dynamo wraps a backend's error
            if isinstance(inner, QuantizationError):  # the options' mistake: no module to fall back to
                raise inner from e
            new_fn = size.mode in ("dynamic", "static") and entry.last_shapes is None  # a second capture's first call
            if entry.calls > 0 and (new_fn or recapture.is_recompile_limit(e) or _is_capture_failure(e)):
                return self._recapture_failed(entry, e, new_fn, tensors, args, kwargs, objects)
            # Dynamo's and lort's errors are capture or compile failures; on an entry's
            # first call, so is anything else (its graph has never run).
            if entry.calls == 0 or _is_capture_failure(e):
                return self._fallback(entry, e, args, kwargs)
            raise
        specialized = None
        if entry.graph_count() != before and entry.calls > 0 and not size.announced:
            reason, dims = self._recapture_reason(entry, tensors)
            self._log_capture(entry, reason)
            specialized = size.specialized(dims)
        size.announced = False
        entry.calls += 1
        entry.last_shapes = [t.shape for t in tensors]
        if specialized:
            self._specializes(entry, specialized)
        return io.unflatten(out_spec, out_tensors)

    def _fallback(self, entry: Entry, error: BaseException, args: tuple, kwargs: dict) -> Any:
        msg = (f"lort.ORTModule({self.name}): capture or compile failed for schema s{entry.index} "
               f"({_one_line(error)}); running the module in PyTorch")
        if self.options.fallback == "raise":
            raise CaptureError(
                msg.replace("; running the module in PyTorch", "") +
                " (fallback policy 'raise'; set fallback='warn' or LORT_FALLBACK_POLICY=warn to run it in PyTorch)"
            ) from error
        warnings.warn(msg, stacklevel=_user_stacklevel())
        logger.warning("%s", msg)
        entry.eager = True
        entry.fn = None
        entry.backend = None
        return self.module(*args, **kwargs)

    # -- reasons ---------------------------------------------------------------------
    def _reason(self, key: SchemaKey) -> str:
        if self._pending_reason is not None:
            return self._pending_reason
        last = self._last_key
        if last is None:
            return "first call"
        parts: list[str] = []
        if last.state != key.state:
            parts += self._tree.diff(last.state, key.state)
        if last.grad_enabled != key.grad_enabled:
            parts.append(f"grad mode {'enabled' if key.grad_enabled else 'disabled'}")
        if last.spec != key.spec:
            parts += io.diff_call(last.spec, key.spec, self._arg_names)
        old = dict(zip(io.arg_paths(last.spec, self._arg_names), last.tensors))
        new = dict(zip(io.arg_paths(key.spec, self._arg_names), key.tensors))
        for path, (dtype, rank, device, rg) in new.items():
            if path not in old:
                continue
            o_dtype, o_rank, o_device, o_rg = old[path]
            if o_dtype != dtype:
                parts.append(f"input '{path}' dtype changed {_dt(o_dtype)} -> {_dt(dtype)}")
            if o_rank != rank:
                parts.append(f"input '{path}' rank changed {o_rank} -> {rank}")
            if o_device != device:
                parts.append(f"input '{path}' device changed {o_device} -> {device}")
            if o_rg != rg:
                parts.append(f"input '{path}' requires_grad changed {o_rg} -> {rg}")
        if not parts:
            return "schema not in the cache (evicted or never seen)"
        return "; ".join(parts)


def _autocast() -> bool:
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
