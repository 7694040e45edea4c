"""The wrapped class's own methods, bound so that ``self(...)`` inside them runs through
the ORTModule (as onnxruntime-training's ORTModule binds them).

A plain method is bound to the wrapper itself. A method whose code calls ``super()``
(transformers' Whisper ``generate`` calls ``super().generate``) needs ``self`` to be an
instance of its defining class, which the wrapper is not: it is bound to a **view** of the
module instead, an instance of a subclass of the module's class made for this wrapper,
that shares the module's ``__dict__`` (its parameters, submodules, buffers, config and
every attribute, read and written alike) and whose ``__call__`` is the wrapper's. So
``super()`` resolves, ``type(self)`` reads the module's class attributes, and
``self(...)`` goes through ORT.
"""

from __future__ import annotations

import types
import weakref
from typing import Any

import torch


def bound(value: Any, module: torch.nn.Module, name: str, wrapper: torch.nn.Module) -> Any:
    """``module.<name>`` (``value``) as the wrapper returns it: the wrapped class's own
    method bound to the wrapper (or to its view of the module, for a method that calls
    ``super()``); anything else as it is."""
    if type(value) is not types.MethodType or value.__self__ is not module or name.startswith("__"):
        return value
    func = value.__func__
    if getattr(torch.nn.Module, name, None) is func or not isinstance(func, types.FunctionType):
        return value
    if _calls_super(func):
        return types.MethodType(func, _view(wrapper, module))
    return types.MethodType(func, wrapper)


def is_user_method(module: torch.nn.Module, name: str, wrapper_cls: type) -> bool:
    """``name`` is a method the wrapped class defines (not ``forward``, not a dunder, not
    torch.nn.Module's own function, not a name of the wrapper class): one that
    onnxruntime-training's ORTModule copied onto itself, so that assigning it on the
    wrapper replaces the wrapper's copy and leaves the user's module alone."""
    if name.startswith("__") or name == "forward" or hasattr(wrapper_cls, name):
        return False
    func = getattr(type(module), name, None)
    return isinstance(func, types.FunctionType) and getattr(torch.nn.Module, name, None) is not func


def _calls_super(func) -> bool:
    while func is not None:  # a decorated method: each function of its __wrapped__ chain
        code = getattr(func, "__code__", None)
        if code is not None and ("__class__" in code.co_freevars or "super" in code.co_names):
            return True
        func = getattr(func, "__wrapped__", None)
    return False


def _view(wrapper: torch.nn.Module, module: torch.nn.Module) -> torch.nn.Module:
    """The wrapper's view of ``module`` (module docstring), made once per wrapper."""
    view = wrapper.__dict__.get("_lort_view")
    if view is None or type(view).__mro__[1] is not type(module):
        ref = weakref.ref(wrapper)  # the view lives on the wrapper: no cycle through it

        def __call__(self, *args, **kwargs):
            owner = ref()
            if owner is None:
                raise RuntimeError("lort.ORTModule: the ORTModule of this method was deleted")
            return owner(*args, **kwargs)

        cls = type(module)
        view_cls = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                               "__qualname__": cls.__qualname__})
        view = object.__new__(view_cls)
        object.__setattr__(view, "__dict__", module.__dict__)
        object.__setattr__(wrapper, "_lort_view", view)
    return view
