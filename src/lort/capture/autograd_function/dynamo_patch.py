"""The Dynamo patch: opaque autograd.Function calls under lort (the compatibility module).

:func:`install` wraps Dynamo's ``AutogradFunctionVariable.call_apply``. For graphs
compiled by another backend it calls the original unchanged. Under a lort backend, when
the original raises ``Unsupported`` (a graph break), the Function class is remembered as
opaque (``registry._OPAQUE``) and Dynamo restarts the frame (``RestartAnalysis``, as
Dynamo does itself); the restarted trace emits ``lort::python_op`` (``ops.py``) with the
call's entry (``registry.py``) and output metadata (``meta.py``).

This module is the ONLY place lort touches Dynamo's variable trackers, guards and
exceptions; :func:`check_torch_internals` fails with :class:`UnsupportedVersionError` if a
torch release moved them (or the dispatch-key TLS that ``ops.py`` uses), and
:func:`install` then turns the feature off with one warning.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch

from ...errors import UnsupportedVersionError
from . import ops
from .meta import infer_outputs
from .registry import _OPAQUE, _Entry, _Slot, _TensorMeta, register

logger = logging.getLogger("lort")


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
            f"(torch {torch.__version__}: {e}); see lort/capture/autograd_function/dynamo_patch.py"
        ) from e
    if not hasattr(AutogradFunctionVariable, "call_apply"):
        raise UnsupportedVersionError(
            f"torch {torch.__version__}: AutogradFunctionVariable.call_apply is missing; lort's "
            f"autograd.Function support (lort/capture/autograd_function/dynamo_patch.py) needs updating"
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
    for name in ops.REQUIRED_C_NAMES:
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
    register(entry)
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
