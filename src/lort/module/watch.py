"""Change notification for module trees: ORTModule's per-call check of the module state
reads one counter instead of walking every module (module/state.py's snapshot is then
only taken after the counter moved).

The counter (``epoch()``) moves on:

- any attribute set or deleted on an instance of a watched class (``m.eps = ...``,
  ``m.train()``/``eval()``, a parameter, buffer or submodule assigned or deleted,
  ``m.forward = f``, ``m.__class__ = C``): the class's ``__setattr__`` and
  ``__delattr__`` are wrapped in place, as Dynamo's mutation_guard does, once per class
  and for the life of the process;
- a forward or backward hook registered through a watched class's ``register_*_hook``;
- any ``register_parameter``, ``register_buffer`` or ``add_module`` in the process
  (torch's global registration hooks).

What it does not see: writes to a module's ``__dict__`` or registries
(``m._parameters[k] = p``, ``ModuleList.insert``, a hook removed through its handle),
``object.__setattr__``. module/state.py polls what of these matters (containers'
submodules, hook dicts that hold hooks) and module/direct.py reads each weight through
its registry on every call. A wrapped instance of an unwatched class costs one counter
bump per set attribute (about 0.1 us) and is otherwise untouched: ``type(m)`` and
pickling do not change."""

from __future__ import annotations

import functools
import weakref

import torch

# One global counter, bumped after a change; a reader compares it with the value it saw.
_EPOCH = [0]
_patched: "weakref.WeakSet[type]" = weakref.WeakSet()
_unpatchable: "weakref.WeakSet[type]" = weakref.WeakSet()
_global_hooks: list = []
_HOOK_METHODS = (
    "register_forward_hook",
    "register_forward_pre_hook",
    "register_full_backward_hook",
    "register_full_backward_pre_hook",
    "register_backward_hook",
)


def epoch() -> int:
    return _EPOCH[0]


def watch(modules: list[torch.nn.Module]) -> bool:
    """Make changes to ``modules`` move the counter; False where a module's class
    cannot be wrapped (its changes are then only seen by polling)."""
    if not _global_hooks:
        _register_global_hooks()
    ok = True
    for cls in {type(m) for m in modules}:
        if cls in _patched:
            continue
        if cls in _unpatchable:
            ok = False
            continue
        try:
            _patch(cls)
        except (TypeError, AttributeError):  # a class that refuses new attributes
            _unpatchable.add(cls)
            ok = False
    return ok


def _bump(*_args) -> None:
    _EPOCH[0] += 1


def _register_global_hooks() -> None:
    from torch.nn.modules import module as nn_module

    for register in (nn_module.register_module_parameter_registration_hook,
                     nn_module.register_module_buffer_registration_hook,
                     nn_module.register_module_module_registration_hook):
        _global_hooks.append(register(_bump))


def _wrap_setattr(original):
    @functools.wraps(original)
    def __setattr__(self, name, value):
        original(self, name, value)
        _EPOCH[0] += 1

    return __setattr__


def _wrap_delattr(original):
    @functools.wraps(original)
    def __delattr__(self, name):
        original(self, name)
        _EPOCH[0] += 1

    return __delattr__


def _wrap_method(original):
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        _EPOCH[0] += 1
        return out

    return method


def _patch(cls: type) -> None:
    wrapped = {
        "__setattr__": _wrap_setattr(cls.__setattr__),
        "__delattr__": _wrap_delattr(cls.__delattr__),
    }
    for name in _HOOK_METHODS:
        original = getattr(cls, name, None)
        if original is not None:
            wrapped[name] = _wrap_method(original)
    for name, fn in wrapped.items():
        type.__setattr__(cls, name, fn)
    _patched.add(cls)
