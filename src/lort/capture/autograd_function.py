"""Custom ``torch.autograd.Function`` support under lort (ORTModule's PythonOp/PythonOpGrad).

Traceable functions need nothing from here: Dynamo inlines their forward and custom
backward into the graph and their ops join ORT groups like any other.

A function Dynamo cannot trace (``.item()``, numpy, data-dependent Python, side effects,
collectives, ...) would make Dynamo break the graph. Under a lort backend it becomes one
opaque node of the single graph instead:

* forward: ``lort::python_op(handle, tensors) -> [outputs..., token]``. Its kernel calls
  ``Function.apply`` on the real tensors with autograd on (inputs that need grad are
  detached leaves), so the function's ctx is PyTorch's own: ``save_for_backward``,
  ``needs_input_grad``, ``mark_dirty``, ``mark_non_differentiable``,
  ``set_materialize_grads`` and attributes behave as in eager (PythonOp).
* backward: ``lort::python_op_backward(handle, token, grads) -> [grads of inputs]`` runs
  ``torch.autograd.grad`` through that ctx, i.e. the function's own backward (PythonOpGrad).
* ``handle`` is a key of ``_ENTRIES``, which holds what the graph cannot: the Function
  class, the non-tensor arguments (scalars, tuples, arbitrary objects, None) and the output
  metadata. Entries are held by the FX node that calls the op and by the compiled callable
  (``LortBackend`` keeps them, see :func:`entries_in`), so they live as long as the compiled
  graph; the registry itself holds them weakly.
* ``token`` is a one-element int64 tensor from numpy whose base array carries the real
  ctx; AOTAutograd saves it for backward, and when it is freed the ctx goes with it.
* Output metadata (for FakeTensor propagation) comes from running ``forward`` once under
  fake tensors at capture time or, when that fails, on real dummy tensors of the same
  metadata; run-time outputs are checked against it (:class:`OpaqueFunctionError`).

Steering Dynamo: :func:`install` wraps Dynamo's ``AutogradFunctionVariable.call_apply``.
For graphs compiled by another backend it calls the original unchanged. Under a lort
backend, when the original raises ``Unsupported`` (a graph break), the Function class is
remembered as opaque and Dynamo restarts the frame (``RestartAnalysis``, as Dynamo does
itself), and the restarted trace emits the opaque op. This module is the ONLY place lort
touches Dynamo's variable trackers and dispatch-key TLS; :func:`check_torch_internals`
fails with :class:`UnsupportedVersionError` if a torch release moved them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import warnings
import weakref
from typing import Any, Iterator, Optional

import numpy as np
import torch

from ..errors import OpaqueFunctionError, UnsupportedVersionError

logger = logging.getLogger("lort")

__all__ = ["is_capturing", "capturing", "install", "entries_in", "OpaqueFunctionError", "opaque_functions"]


# -- is_capturing ------------------------------------------------------------------------

_state = threading.local()


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Marks the enclosed code as lort capture (``is_capturing()`` is True inside)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def _is_capturing() -> bool:
    return getattr(_state, "depth", 0) > 0


@torch._dynamo.disable(reason="lort.is_capturing() is answered outside traced code")
def is_capturing() -> bool:
    """True while lort captures a model: AOTAutograd tracing, and the fake-tensor and dummy
    runs of an opaque autograd.Function's forward that find its output metadata. False
    while compiled code runs.

    Code that must not run during capture (a collective, I/O) can skip itself::

        if not lort.is_capturing():
            torch.distributed.all_reduce(t)

    Dynamo cannot trace this call: inside an autograd.Function under lort, the function is
    then run opaquely (its real forward runs with ``is_capturing() == False``); elsewhere
    the call is a graph break.
    """
    return _is_capturing()


# -- registry of opaque calls ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Position ``index`` of the op's tensor list, in a function's argument template."""

    index: int


@dataclasses.dataclass(frozen=True)
class _TensorMeta:
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> "_TensorMeta":
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.device)

    def empty(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)

    def describe(self) -> str:
        return f"{self.dtype} {list(self.shape)} on {self.device}"


class _Entry:
    """One opaque call site of a compiled graph: the Function and its non-tensor args."""

    def __init__(self, fn_cls: type, template: list, in_meta: list[_TensorMeta], needs_grad: tuple[bool, ...]):
        self.fn_cls = fn_cls
        self.template = template  # arguments, tensors replaced by _Slot
        self.in_meta = in_meta
        self.needs_grad = needs_grad  # per tensor input, at capture time
        self.out_meta: list[_TensorMeta] = []
        self.out_spec: Any = None  # ("t", i) | ("c", value) | ("tuple"|"list", [specs])
        self.non_differentiable: set[int] = set()
        self.dirty: dict[int, int] = {}  # output index -> tensor input index
        self.metadata_from = ""  # "fake" or "dummy run"
        self.handle = -1

    @property
    def name(self) -> str:
        return f"{self.fn_cls.__module__}.{self.fn_cls.__qualname__}"

    def args(self, tensors: list) -> list:
        return [tensors[a.index] if isinstance(a, _Slot) else a for a in self.template]

    def flatten_outputs(self, result: Any, check: bool) -> list[torch.Tensor]:
        """The tensors of ``result`` in spec order (checked against the spec if asked)."""
        tensors: list[torch.Tensor] = []

        def walk(value: Any, spec: Any) -> None:
            kind = spec[0]
            if kind == "t":
                if not isinstance(value, torch.Tensor):
                    self._mismatch(f"output {spec[1]} is {type(value).__name__}, was a tensor at capture")
                tensors.append(value)
            elif kind == "c":
                if check and not _same_constant(value, spec[1]):
                    self._mismatch(f"returned {value!r} where capture saw {spec[1]!r}")
            else:
                if not isinstance(value, (tuple, list)) or len(value) != len(spec[1]):
                    self._mismatch(f"output structure changed (got {type(value).__name__})")
                for v, s in zip(value, spec[1]):
                    walk(v, s)

        walk(result, self.out_spec)
        if check:
            for i, (t, m) in enumerate(zip(tensors, self.out_meta)):
                concrete = all(isinstance(s, int) for s in m.shape)
                if t.dtype != m.dtype or t.device != m.device or (concrete and tuple(t.shape) != m.shape):
                    self._mismatch(
                        f"output {i} is {t.dtype} {list(t.shape)} on {t.device}, capture saw {m.describe()}"
                    )
        return tensors

    def _mismatch(self, what: str) -> None:
        raise OpaqueFunctionError(
            f"lort runs autograd.Function {self.name} opaquely and took its output metadata from a "
            f"{self.metadata_from} at capture time, but at run time it {what}. Outputs whose shape, "
            f"dtype or structure depends on data cannot be compiled; run the function outside the "
            f"compiled region (torch.compiler.disable) or make its outputs' metadata static."
        )


_ENTRIES: "weakref.WeakValueDictionary[int, _Entry]" = weakref.WeakValueDictionary()
_handles = itertools.count(1)
#: Function classes Dynamo failed to trace under lort -> the reason (they run opaquely).
_OPAQUE: "weakref.WeakKeyDictionary[type, str]" = weakref.WeakKeyDictionary()


def opaque_functions() -> dict[type, str]:
    """autograd.Function classes lort runs opaquely, with the reason Dynamo gave."""
    return dict(_OPAQUE)


def _lookup(handle: int) -> _Entry:
    entry = _ENTRIES.get(handle)
    if entry is None:
        raise OpaqueFunctionError(
            f"lort: opaque autograd.Function call {handle} is no longer registered; the compiled "
            f"graph that used it was freed (torch._dynamo.reset()?) while its code still ran"
        )
    return entry


def entries_in(gm: torch.fx.GraphModule) -> list[_Entry]:
    """The opaque-call entries a Dynamo graph uses; the compiled callable keeps them alive."""
    return [n.meta["lort_python_op"] for n in gm.graph.nodes if "lort_python_op" in n.meta]


# -- the ctx token -------------------------------------------------------------------------


class _CtxHolder(np.ndarray):
    """A one-element int64 array (the token's storage) that carries the real ctx."""

    state: Any


_LIVE: "weakref.WeakValueDictionary[int, _CtxHolder]" = weakref.WeakValueDictionary()
_keys = itertools.count(1)


def _new_token(state: Any) -> torch.Tensor:
    key = next(_keys)
    holder = np.full(1, key, dtype=np.int64).view(_CtxHolder)
    holder.state = state
    _LIVE[key] = holder
    return torch.from_numpy(holder)


# -- dispatch-key TLS: run the user's function with autograd on ---------------------------

_AUTOGRAD_KEYS = (
    torch._C.DispatchKey.AutogradFunctionality,
    torch._C.DispatchKey.AutogradOther,
    torch._C.DispatchKey.AutogradNestedTensor,
    torch._C.DispatchKey.ADInplaceOrView,
)


@contextlib.contextmanager
def _autograd_on(grad: bool) -> Iterator[None]:
    """Inside a custom op kernel the autograd keys are excluded; put them back, as
    eager PyTorch would have them around ``Function.apply``."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        with torch.set_grad_enabled(grad):
            yield


# -- the ops ------------------------------------------------------------------------------


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return -1


@torch.library.custom_op("lort::python_op", mutates_args=())
def _python_op(handle: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    entry = _lookup(handle)
    want_grad = any(entry.needs_grad)
    dirty_inputs = set(entry.dirty.values())
    leaves: list[torch.Tensor] = []
    with _autograd_on(want_grad):
        ins = []
        for i, t in enumerate(tensors):
            if want_grad and entry.needs_grad[i]:
                # A graph input that requires grad (a parameter, the caller's tensor) is
                # passed as itself: code that also reaches it another way (a checkpointed
                # module's parameters) then sees the same tensor, as in eager. Others
                # become detached leaves.
                leaf = t if (t.requires_grad and t.is_leaf) else t.detach().requires_grad_(True)
                leaves.append(leaf)
                # A function that modifies its input in place gets a non-leaf copy (the
                # graph copies the result back into the caller's tensor).
                ins.append(leaf.clone() if i in dirty_inputs else leaf)
            else:
                ins.append(t.clone() if i in dirty_inputs else t)
        result = entry.fn_cls.apply(*entry.args(ins))
    outs = entry.flatten_outputs(result, check=True)
    in_ptrs = {_storage_ptr(t) for t in tensors}
    seen: set[int] = set()
    ret = []
    for o in outs:
        d = o.detach()
        ptr = _storage_ptr(d)
        if ptr in in_ptrs or ptr in seen:  # a custom op's outputs may not alias
            d = d.clone()
        seen.add(_storage_ptr(d))
        ret.append(d)
    if want_grad and any(o.requires_grad for o in outs):
        ret.append(_new_token((entry, outs, leaves)))
    else:
        ret.append(torch.full((1,), -1, dtype=torch.int64))
    return ret


@_python_op.register_fake
def _python_op_fake(handle: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    entry = _lookup(handle)
    return [m.empty() for m in entry.out_meta] + [torch.empty(1, dtype=torch.int64, device="cpu")]


@torch.library.custom_op("lort::python_op_backward", mutates_args=())
def _python_op_backward(
    handle: int, token: torch.Tensor, grads: list[Optional[torch.Tensor]]
) -> list[torch.Tensor]:
    entry = _lookup(handle)
    holder = _LIVE.get(int(token[0]))
    if holder is None:
        raise OpaqueFunctionError(
            f"lort: the saved context of autograd.Function {entry.name} is gone; its backward "
            f"can run once per forward (use retain_graph=True to run it again)"
        )
    _, outs, leaves = holder.state
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    with _autograd_on(True):
        if pairs:
            res = torch.autograd.grad(
                [o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True
            )
        else:
            res = (None,) * len(leaves)
    taken = {_storage_ptr(t) for t in (token, *grads) if t is not None}
    out = []
    for r, leaf in zip(res, leaves):
        if r is None:
            r = torch.zeros_like(leaf, memory_format=torch.contiguous_format)
        elif _storage_ptr(r) in taken:  # a custom op's outputs may not alias
            r = r.clone()
        taken.add(_storage_ptr(r))
        out.append(r)
    return out


@_python_op_backward.register_fake
def _python_op_backward_fake(handle: int, token: torch.Tensor, grads: list[Optional[torch.Tensor]]):
    entry = _lookup(handle)
    return [
        torch.empty(m.shape, dtype=m.dtype, device=m.device)
        for m, need in zip(entry.in_meta, entry.needs_grad)
        if need
    ]


def _setup_context(ctx, inputs, output) -> None:
    # Unused outputs' gradients stay None: the user's ctx decides (set_materialize_grads).
    ctx.set_materialize_grads(False)
    ctx.handle = inputs[0]
    ctx.n_inputs = len(inputs[1])
    ctx.save_for_backward(output[-1])


def _backward(ctx, grads):
    (token,) = ctx.saved_tensors
    entry = _lookup(ctx.handle)
    got = torch.ops.lort.python_op_backward(ctx.handle, token, list(grads[:-1]))
    full: list[Optional[torch.Tensor]] = [None] * ctx.n_inputs
    it = iter(got)
    for i, need in enumerate(entry.needs_grad):
        if need:
            full[i] = next(it)
    return None, full


_python_op.register_autograd(_backward, setup_context=_setup_context)
# python_op is NOT marked side-effectful: AOTAutograd's partitioner would then copy it,
# dead, into the backward graph too and the forward would run twice. The price: a call
# whose outputs are all unused is dropped (documented in the README).


# -- output metadata at capture time --------------------------------------------------------


def _same_constant(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - objects with odd __eq__
        return a is b


def _spec_of(value: Any, tensors: list) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return ("t", len(tensors) - 1)
    if isinstance(value, (tuple, list)) and type(value) in (tuple, list):
        return ("tuple" if isinstance(value, tuple) else "list", [_spec_of(v, tensors) for v in value])
    if value is None or isinstance(value, (bool, int, float, str)):
        return ("c", value)
    raise OpaqueFunctionError(f"returns a {type(value).__name__}; lort supports tensors, scalars and tuples of them")


def _run_forward_for_metadata(entry: _Entry, inputs: list[torch.Tensor]) -> None:
    """Runs ``forward`` with a plain FunctionCtx (no autograd) and records what it returns."""
    from torch.autograd.function import FunctionCtx, _is_setup_context_defined

    ctx = FunctionCtx()
    ctx.needs_input_grad = tuple(
        entry.needs_grad[a.index] if isinstance(a, _Slot) else False for a in entry.template
    )
    args = entry.args(inputs)
    with capturing(), torch.no_grad():
        if _is_setup_context_defined(entry.fn_cls.setup_context):
            result = entry.fn_cls.forward(*args)
            entry.fn_cls.setup_context(ctx, tuple(args), result)
        else:
            result = entry.fn_cls.forward(ctx, *args)
    tensors: list[torch.Tensor] = []
    entry.out_spec = _spec_of(result, tensors)
    entry.out_meta = [_TensorMeta.of(t) for t in tensors]
    ids = {id(t): i for i, t in enumerate(tensors)}
    entry.non_differentiable = {ids[id(t)] for t in getattr(ctx, "non_differentiable", ()) if id(t) in ids}
    entry.dirty = {}
    for t in getattr(ctx, "dirty_tensors", ()):
        for j, x in enumerate(inputs):
            if t is x and id(t) in ids:
                entry.dirty[ids[id(t)]] = j


def _dummy(meta: _TensorMeta, gen: torch.Generator) -> torch.Tensor:
    shape = tuple(int(s) for s in meta.shape)
    stride = tuple(int(s) for s in meta.stride)
    t = torch.empty_strided(shape, stride, dtype=meta.dtype, device=meta.device)
    if meta.dtype.is_floating_point or meta.dtype.is_complex:
        t.copy_(torch.rand(shape, generator=gen, dtype=torch.float32).to(meta.dtype))
    elif meta.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(1)
    return t


def infer_outputs(entry: _Entry, fake_mode, fakes: list[torch.Tensor]) -> None:
    """Output metadata of ``entry``'s function: a fake-tensor run, else a dummy real run."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, is_concrete_int

    static = all(is_concrete_int(s) for f in fakes for s in (*f.shape, *f.stride()))
    try:
        # Static shapes: a fresh fake mode without a shape env, so .item() and the like
        # fail cleanly instead of adding unbacked symbols to Dynamo's shape env.
        mode = FakeTensorMode() if static else fake_mode
        shape_env = None if static else getattr(fake_mode, "shape_env", None)
        # ShapeEnv's method (torch 2.11 to 2.13; 2.13 also has a module-level context).
        ignore = contextlib.nullcontext() if shape_env is None else shape_env.ignore_fresh_unbacked_symbols()
        with mode, ignore:
            inputs = [torch.empty_strided(f.shape, f.stride(), dtype=f.dtype, device=f.device) for f in fakes]
            _run_forward_for_metadata(entry, inputs)
        if any(free_unbacked_symbols(m.shape) for m in entry.out_meta):
            raise OpaqueFunctionError("output shape depends on data")
        entry.metadata_from = "fake-tensor run"
        return
    except OpaqueFunctionError as e:
        if "output shape depends on data" not in str(e):
            raise
    except Exception as e:  # noqa: BLE001 - any failure under fake tensors: try real ones
        logger.debug("lort: %s does not run on fake tensors (%s); using a dummy run", entry.name, e)
    # Real tensors need concrete shapes: specialize symbolic sizes (a guard recompiles on change).
    from torch.fx.experimental.symbolic_shapes import guard_int

    metas = [
        _TensorMeta(
            tuple(guard_int(s) for s in f.shape), tuple(guard_int(s) for s in f.stride()), f.dtype, f.device
        )
        for f in fakes
    ]
    gen = torch.Generator().manual_seed(0)
    with unset_fake_temporarily():
        inputs = [_dummy(m, gen) for m in metas]
        try:
            _run_forward_for_metadata(entry, inputs)
        except Exception as e:  # noqa: BLE001
            raise OpaqueFunctionError(
                f"lort could not find the outputs of autograd.Function {entry.name}: its forward fails "
                f"on fake tensors and on dummy tensors at capture time ({type(e).__name__}: {e}). "
                f"Use lort.is_capturing() to skip what cannot run during capture."
            ) from e
    entry.metadata_from = "dummy run"


# -- Dynamo hook (private torch internals) ---------------------------------------------------

_installed = False
_orig_call_apply = None
#: The torch release lort's opaque autograd.Function support is tested on. On torch
#: 2.11 it gave wrong gradients (a numpy-based function's input gradient was zero) and
#: Dynamo refused its identity guard on dict arguments; below this release the feature
#: stays off and such functions graph-break, as with any other backend.
MIN_TORCH = (2, 13)
#: Marker attribute of lort backends (LortBackend, lort_backend, or anything wrapping them).
BACKEND_MARKER = "_lort_backend"


def _dynamo_internals():
    try:
        from torch._dynamo.exc import RestartAnalysis, Unsupported, unimplemented
        from torch._dynamo.guards import GuardBuilder, install_guard
        from torch._dynamo.variables import ConstantVariable, ListVariable, TupleVariable
        from torch._dynamo.variables.builder import wrap_fx_proxy
        from torch._dynamo.variables.misc import AutogradFunctionVariable
    except ImportError as e:
        raise UnsupportedVersionError(
            f"lort's autograd.Function support needs torch._dynamo internals of torch 2.13 "
            f"(torch {torch.__version__}: {e}); see lort/capture/autograd_function.py"
        ) from e
    if not hasattr(AutogradFunctionVariable, "call_apply"):
        raise UnsupportedVersionError(
            f"torch {torch.__version__}: AutogradFunctionVariable.call_apply is missing; lort's "
            f"autograd.Function support (lort/capture/autograd_function.py) needs updating"
        )
    return dict(
        RestartAnalysis=RestartAnalysis,
        Unsupported=Unsupported,
        unimplemented=unimplemented,
        GuardBuilder=GuardBuilder,
        install_guard=install_guard,
        ConstantVariable=ConstantVariable,
        ListVariable=ListVariable,
        TupleVariable=TupleVariable,
        wrap_fx_proxy=wrap_fx_proxy,
        AutogradFunctionVariable=AutogradFunctionVariable,
    )


def check_torch_internals() -> None:
    """Raises UnsupportedVersionError if the torch internals this module uses moved."""
    _dynamo_internals()
    for name in ("_ForceDispatchKeyGuard", "_dispatch_tls_local_exclude_set", "_dispatch_tls_local_include_set"):
        if not hasattr(torch._C, name):
            raise UnsupportedVersionError(f"torch {torch.__version__} lacks torch._C.{name} (lort autograd.Function support)")


def is_lort_compiler(fn: Any) -> bool:
    """Whether a Dynamo compiler_fn is (a wrapper of) a lort backend."""
    for _ in range(8):
        if fn is None:
            return False
        if getattr(fn, BACKEND_MARKER, False):
            return True
        fn = (
            getattr(fn, "_torchdynamo_orig_backend", None)
            or getattr(fn, "compiler_fn", None)
            or getattr(fn, "__wrapped__", None)
        )
    return False


#: Why opaque autograd.Function support is off on this torch (None: it is on).
unavailable_reason: str | None = None


def install() -> bool:
    """Wraps Dynamo's autograd.Function handling (idempotent). Graphs compiled by other
    backends see Dynamo's behaviour unchanged.

    On a torch whose Dynamo internals moved, the feature turns itself off with one
    warning naming it and the version; everything else in lort works, and untraceable
    autograd.Functions graph-break as with any backend. Returns whether it is on."""
    global _installed, _orig_call_apply, unavailable_reason
    if _installed:
        return True
    if unavailable_reason is not None:
        return False
    try:
        if tuple(int(p) for p in torch.__version__.split(".")[:2]) < MIN_TORCH:
            raise UnsupportedVersionError(
                f"it is tested on torch {MIN_TORCH[0]}.{MIN_TORCH[1]} and gave wrong gradients on torch 2.11"
            )
        api = _dynamo_internals()
        check_torch_internals()
    except UnsupportedVersionError as e:
        unavailable_reason = str(e)
        warnings.warn(
            f"lort: opaque autograd.Function support is off on torch {torch.__version__} ({e}); "
            f"untraceable autograd.Functions graph-break as with other backends",
            stacklevel=2,
        )
        return False
    cls = api["AutogradFunctionVariable"]
    _orig_call_apply = cls.call_apply

    def call_apply(self, tx, args, kwargs):
        if not is_lort_compiler(getattr(tx.output, "compiler_fn", None)):
            return _orig_call_apply(self, tx, args, kwargs)
        if self.fn_cls in _OPAQUE:
            return _emit_opaque(api, self, tx, args, kwargs)
        try:
            return _orig_call_apply(self, tx, args, kwargs)
        except api["Unsupported"] as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            _OPAQUE[self.fn_cls] = reason
            logger.info(
                "lort: autograd.Function %s.%s cannot be traced (%s); it runs opaquely in PyTorch",
                self.fn_cls.__module__, self.fn_cls.__qualname__, reason,
            )
            # The restarted trace takes another path at this call: the speculation log
            # of the failed attempt must go (Dynamo does the same on its own restarts).
            _clear_speculation_log(tx)
            raise api["RestartAnalysis"](
                restart_reason=f"lort: autograd.Function {self.fn_cls.__qualname__} runs opaquely"
            ) from None

    call_apply._lort_wrapped = True
    cls.call_apply = call_apply
    _installed = True
    return True


def _clear_speculation_log(tx) -> None:
    seen = set()
    while tx is not None and id(tx) not in seen:
        seen.add(id(tx))
        log = getattr(tx, "speculation_log", None)
        if log is not None:
            log.clear()
        tx = getattr(tx, "parent", None)


def _python_value(api, tx, vt) -> Any:
    """The Python value of a non-tensor argument (guarded so a new value recompiles)."""
    from torch._dynamo.variables import SymNodeVariable
    from torch._dynamo.variables.base import AsPythonConstantNotImplementedError
    from torch._dynamo.variables.lists import BaseListVariable

    vt = vt.realize() if hasattr(vt, "realize") else vt
    if isinstance(vt, SymNodeVariable):  # a scalar Dynamo made dynamic: specialize it
        return vt.evaluate_expr(tx.output)
    if type(vt).__name__ in ("TupleVariable", "ListVariable") and isinstance(vt, BaseListVariable):
        values = [_python_value(api, tx, v) for v in vt.items]
        return tuple(values) if type(vt).__name__ == "TupleVariable" else values
    try:
        return vt.as_python_constant()
    except (NotImplementedError, AsPythonConstantNotImplementedError, api["Unsupported"]):
        pass
    if vt.source is not None:
        value = getattr(vt, "value", None)
        if value is None and hasattr(vt, "module_key"):
            value = tx.output.get_submodule(vt.module_key)
        if value is not None:
            api["install_guard"](vt.source.make_guard(api["GuardBuilder"].ID_MATCH))
            return value
    api["unimplemented"](
        gb_type="lort: opaque autograd.Function argument",
        context=f"{vt}",
        explanation="lort runs this autograd.Function opaquely, but one of its non-tensor arguments "
        "was created inside the compiled region and has no Python value at capture time.",
        hints=["Create the object outside the compiled function and pass it in."],
    )


def _resolve_kwargs(fn_cls, args: list, kwargs: dict) -> list | None:
    """Keyword arguments of ``fn_cls.apply`` as positional ones, as PyTorch's C++
    ``resolve_kwargs_to_positional`` does (from forward's code object); None for
    keyword-only arguments. lort's own copy: Dynamo's moved between torch releases."""
    code = fn_cls.forward.__code__
    separate_setup = fn_cls.setup_context is not torch.autograd.Function.setup_context
    offset = 0 if separate_setup else 1
    names = list(code.co_varnames[offset : code.co_argcount])
    if any(name not in names for name in kwargs):
        return None
    for name in kwargs:
        if names.index(name) < len(args):
            raise TypeError(f"forward() got multiple values for argument '{name}'")
    last = max(names.index(name) for name in kwargs)
    result = list(args)
    for i in range(len(args), last + 1):
        if names[i] not in kwargs:
            raise TypeError(f"forward() missing required argument: '{names[i]}' (position {i})")
        result.append(kwargs[names[i]])
    return result


def _emit_opaque(api, self, tx, args, kwargs):
    if kwargs:
        resolved = _resolve_kwargs(self.fn_cls, args, kwargs)
        if resolved is None:
            api["unimplemented"](
                gb_type="lort: opaque autograd.Function keyword-only args",
                context=str(kwargs),
                explanation="keyword-only arguments of forward() are not supported",
                hints=[],
            )
        args = resolved
    template: list = []
    tensor_vts = []
    for a in args:
        if a.is_tensor():
            template.append(_Slot(len(tensor_vts)))
            tensor_vts.append(a)
        else:
            template.append(_python_value(api, tx, a))
    fakes = [vt.as_proxy().node.meta["example_value"] for vt in tensor_vts]
    grad = torch.is_grad_enabled()
    needs = tuple(bool(grad and f.requires_grad) for f in fakes)
    entry = _Entry(self.fn_cls, template, [_TensorMeta.of(f) for f in fakes], needs)
    infer_outputs(entry, tx.fake_mode, fakes)
    entry.handle = next(_handles)
    _ENTRIES[entry.handle] = entry
    logger.info(
        "lort: %s runs opaquely (outputs from a %s): %d tensor input(s), %d output(s)",
        entry.name, entry.metadata_from, len(fakes), len(entry.out_meta),
    )
    proxy = tx.output.create_proxy(
        "call_function",
        torch.ops.lort.python_op.default,
        (entry.handle, [vt.as_proxy() for vt in tensor_vts]),
        {},
    )
    proxy.node.meta["lort_python_op"] = entry  # keeps the entry alive with the graph
    result = api["wrap_fx_proxy"](tx, proxy)
    items = result.items
    outs = []
    for i in range(len(entry.out_meta)):
        vt = items[i]
        if i in entry.dirty:
            target = tensor_vts[entry.dirty[i]]
            target.call_method(tx, "copy_", [vt], {})
            vt = target
        elif i in entry.non_differentiable:
            vt = vt.call_method(tx, "detach", [], {})
        outs.append(vt)

    def build(spec):
        kind = spec[0]
        if kind == "t":
            return outs[spec[1]]
        if kind == "c":
            return api["ConstantVariable"].create(spec[1])
        parts = [build(s) for s in spec[1]]
        return api["TupleVariable"](parts) if kind == "tuple" else api["ListVariable"](parts)

    return build(entry.out_spec)
