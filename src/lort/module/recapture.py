"""How an ORTModule schema entry captures new input sizes, and what happens when Dynamo
will capture no more.

ORTModule captures with ``fullgraph=True``. The first shape change captures the entry
again with the changed dims dynamic (Dynamo's automatic dynamic shapes). A forward that
reads a size as a Python value (``for i in range(x.size(0))``) specializes on it, so
each new size is captured again, and at Dynamo's recompile limit
(``torch._dynamo.config.recompile_limit``, 8) ``fullgraph=True`` turns into an exception
(``FailOnRecompileLimitHit``) in the user's loop. ``SizePolicy`` instead:

1. captures the entry once more with every size dynamic (``dynamic=True``) as soon as a
   dim that already made Dynamo capture again changes and does so again (the forward
   specializes on it), or when the limit is reached first;
2. captures it once more with static sizes (``dynamic=False``, a graph per size) when a
   capture after the first call fails: Dynamo's automatic dynamic shapes made a size
   symbolic where the forward needs it as a number (``math.factorial(x.size(0))``);
3. where that second capture fails too, goes back to the first function; past the
   recompile limit, a call whose sizes have no compiled graph runs in PyTorch, with one
   warning that says why and what to do, while sizes already compiled keep running in
   ORT; any other failed capture is the fallback policy's (``Options.fallback``).

Dynamo's own warning at its limit (five lines, on every refused call) is dropped for
ORTModule's functions: the warning above says it once, with Dynamo's last reason.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import sys
import warnings
from typing import Any

import torch

from ..compile import lifetime
from ..errors import LortError
from . import debug_files, io

logger = logging.getLogger("lort.module")

#: The name of every function ORTModule compiles starts so (transition._make_flat_fn).
CODE_PREFIX = "lort_ortmodule_s"
#: Input sizes known to have no compiled graph past the limit, per entry (run in PyTorch
#: without asking Dynamo again); the least recently seen go first.
MAX_UNCOMPILED_SIZES = 256

#: Dynamo's exception at its recompile limit under fullgraph=True; not a
#: TorchDynamoException (torch 2.13), so named here.
_LIMIT_ERRORS = tuple(cls for cls in (getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", None),)
                      if isinstance(cls, type))


def is_recompile_limit(error: BaseException) -> bool:
    """``error`` is Dynamo's refusal to capture a frame past its recompile limit."""
    return bool(_LIMIT_ERRORS) and isinstance(error, _LIMIT_ERRORS)


def is_capture_failure(error: BaseException) -> bool:
    """``error`` is Dynamo's or lort's: the capture or compile failed."""
    return isinstance(error, (LortError, torch._dynamo.exc.TorchDynamoException))


def recompile_limit() -> int:
    """Dynamo's recompile limit per code object."""
    cfg = torch._dynamo.config
    return int(getattr(cfg, "recompile_limit", getattr(cfg, "cache_size_limit", 8)))


def one_line(error: BaseException) -> str:
    error = getattr(error, "inner_exception", None) or error  # Dynamo's BackendCompilerFailed: lort's error
    text = str(error).strip().splitlines()
    first = next((line for line in text if line.strip()), type(error).__name__)
    return f"{type(error).__name__}: {first}"


def user_stacklevel() -> int:
    """The stacklevel of ``warnings.warn`` (called in module/) that names the user's call:
    the first frame outside lort and torch.nn's Module call machinery."""
    skip = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
            torch.nn.Module.__call__.__code__.co_filename)
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


def shape_changes(last_shapes: list | None, tensors: list, paths: list[str]) -> tuple[list[str], set]:
    """The inputs whose shape changed since ``last_shapes``, as text, and the changed
    (input index, dim) pairs."""
    parts: list[str] = []
    dims: set[tuple[int, int]] = set()
    for i, (path, old, t) in enumerate(zip(paths, last_shapes or (), tensors)):
        new = tuple(t.shape)
        if tuple(old) != new:
            parts.append(f"input '{path}' shape changed {tuple(old)} -> {new}")
            if len(old) == len(new):
                dims.update((i, d) for d, (a, b) in enumerate(zip(old, new)) if a != b)
    return parts, dims


def guard_failure(code) -> str | None:
    """The last of Dynamo's guard failures recorded for ``code``, as one line with the
    source line it came from."""
    failures = torch._dynamo.utils.guard_failures.get(code)
    if not failures:
        return None
    # "0/1: module.config.problem_type is None   # if ...  # file:line in forward"
    guard = failures[-1].split("\n")[0].split(": ", 1)[-1]
    text, _, where = guard.partition("#")
    where = where.rsplit("#", 1)[-1].strip()
    return text.strip() + (f" ({where})" if where else "")


@dataclasses.dataclass
class SizeState:
    """An entry's way with input sizes. ``mode``: "auto" (Dynamo's automatic dynamic
    shapes), "dynamic" (captured again with every size dynamic), "static" (captured again
    with static sizes) or "failed" (that second capture failed: back on the first
    function). ``changed_dims``: the (input, dim) pairs whose change made Dynamo capture
    again. ``first``: the first function (fn, backend, code, last shapes) while the
    second is tried; ``retired``: the record lists of the backends replaced (a backward
    compiled after its forward's function was replaced still lands there); ``trigger``:
    what started the second capture ("specialized", "limit", "failure");
    ``announced``: the next capture is logged already; ``second_error``: why the second
    capture failed; ``uncompiled``: sizes run in PyTorch past the limit (``past_limit``,
    said once)."""

    mode: str = "auto"
    changed_dims: set = dataclasses.field(default_factory=set)
    first: tuple | None = None
    retired: list = dataclasses.field(default_factory=list)
    trigger: str | None = None
    announced: bool = False
    second_error: str | None = None
    past_limit: bool = False
    uncompiled: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)

    def specialized(self, dims: set) -> set:
        """Of the dims whose change just made Dynamo capture again, those that did so
        before (automatic dynamic shapes only): the forward specializes on them."""
        if self.mode != "auto":
            return set()
        again = dims & self.changed_dims
        self.changed_dims |= dims
        return again


def _shape_key(tensors: list) -> tuple:
    return tuple(tuple(t.shape) for t in tensors)


class SizePolicy:
    """The transition manager's handling of new input sizes (module docstring); mixed
    into ``TransitionManager``, whose ``name``, ``module``, ``options``, ``_arg_names``,
    ``_compile_fn``, ``_log_capture``, ``_run`` and ``_fallback`` it uses."""

    def _specializes(self, entry, dims: set) -> None:
        paths = io.arg_paths(entry.key.spec, self._arg_names)
        where = ", ".join(f"input '{paths[i]}' dim {d}" for i, d in sorted(dims) if i < len(paths))
        self._capture_again(entry, f"the forward specializes on {where} (each new size was captured again)",
                            "specialized")

    def _capture_again(self, entry, reason: str, trigger: str) -> None:
        """Capture the entry again: with every size dynamic, or with static sizes after a
        failed capture. The first function's sessions are released (it is kept to go back
        to if this capture fails)."""
        size, old = entry.size, entry.backend
        dynamic = trigger != "failure"
        size.first = (entry.fn, old, entry.code, entry.last_shapes)
        lifetime.release(old.records)
        # Numbered on past the old backend's graphs, and past the backward it may still
        # compile for its last forward.
        backend = debug_files.ModuleBackend(self.options, old.save, first_graph=old.graph_number + 1)
        self._compile_fn(entry, backend, dynamic=dynamic)
        size.retired = size.retired + [old.records]
        size.mode, size.trigger, size.announced = ("dynamic" if dynamic else "static"), trigger, True
        entry.last_shapes = None
        how = "every size dynamic" if dynamic else "static sizes (a graph per size)"
        self._log_capture(entry, f"{reason}; captured again with {how}")

    def _back_to_first(self, entry, error: BaseException) -> None:
        """The second capture failed: the entry's first function again (its sessions are
        built again as its graphs run)."""
        size, failed = entry.size, entry.backend
        entry.fn, entry.backend, entry.code, entry.last_shapes = size.first
        size.first = None
        size.retired = [rs for rs in size.retired if rs is not entry.backend.records] + [failed.records]
        lifetime.release(failed.records)
        how = "every size dynamic" if size.mode == "dynamic" else "static sizes"
        size.mode, size.announced, size.second_error = "failed", False, f"with {how} ({one_line(error)})"
        logger.info("lort.ORTModule(%s): schema s%d: the capture %s failed", self.name, entry.index,
                    size.second_error)

    def _recapture_failed(self, entry, error: BaseException, new_fn: bool, tensors: list, args: tuple,
                          kwargs: dict, objects: tuple) -> Any:
        """A capture after the entry's first call failed (``new_fn``: the first call of
        its second function), or Dynamo refused one past its recompile limit."""
        size = entry.size
        if new_fn:
            self._back_to_first(entry, error)
            if size.trigger == "failure":  # the first function cannot capture it either
                return self._fallback(entry, error, args, kwargs)
            return self._run(entry, tensors, args, kwargs, objects)
        limit = is_recompile_limit(error)
        what = (f"captured {recompile_limit()} times, Dynamo's recompile limit (last reason: "
                f"{guard_failure(entry.code) or 'new input sizes'})" if limit
                else f"capture failed ({one_line(error)})")
        if size.mode == "auto":
            self._capture_again(entry, what, "limit" if limit else "failure")
            return self._run(entry, tensors, args, kwargs, objects)
        if not limit:
            return self._fallback(entry, error, args, kwargs)
        if not size.past_limit:
            size.past_limit = True
            what += {"dynamic": ", with every size dynamic", "static": ", with static sizes"}.get(
                size.mode, f"; the capture {size.second_error} failed")
            msg = (f"lort.ORTModule({self.name}): schema s{entry.index}: {what}. Calls with input sizes not "
                   "compiled yet run in PyTorch from now on (those compiled keep running in ORT). To keep every "
                   "size in ORT, pad inputs to a few fixed sizes, avoid using a tensor's size as a Python "
                   "number in forward, or raise torch._dynamo.config.recompile_limit")
            warnings.warn(msg, stacklevel=user_stacklevel())
            logger.warning("%s", msg)
        size.uncompiled[_shape_key(tensors)] = True
        while len(size.uncompiled) > MAX_UNCOMPILED_SIZES:
            size.uncompiled.popitem(last=False)
        return self.module(*args, **kwargs)

    def _known_uncompiled(self, entry, tensors: list) -> bool:
        """Past the limit: these sizes were refused before (run them in PyTorch at once)."""
        key = _shape_key(tensors)
        if key in entry.size.uncompiled:
            entry.size.uncompiled.move_to_end(key)
            return True
        return False

    def _recapture_reason(self, entry, tensors: list) -> tuple[str, set]:
        """Why Dynamo captured an entry again: a shape change (dynamic shapes), or one of
        Dynamo's guards on something outside the schema key; and the changed dims."""
        paths = io.arg_paths(entry.key.spec, self._arg_names)
        parts, dims = shape_changes(entry.last_shapes, tensors, paths)
        if parts:
            how = {"auto": "dynamic shapes", "static": "static sizes"}.get(entry.size.mode,
                                                                          "the sizes it specializes on")
            return "; ".join(parts) + f" (captured again with {how})", dims
        guard = guard_failure(entry.code)
        return (f"Dynamo guard failed: {guard}" if guard else "Dynamo captured the entry again"), dims


class _DropLimitWarnings(logging.Filter):
    """Drops Dynamo's recompile-limit warning for ORTModule's functions (said by lort)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "hit config" not in str(record.msg):
            return True
        return not any(isinstance(a, str) and f"'{CODE_PREFIX}" in a for a in (record.args or ()))


logging.getLogger("torch._dynamo.convert_frame").addFilter(_DropLimitWarnings())
