"""Change notification for module trees: ORTModule's per-call check of the module state
reads one counter instead of walking every module (module/state.py's snapshot is then
only taken after the counter moved).

The counter (``epoch()``) moves on:

- any attribute set or deleted on a module of a watched tree (``m.eps = ...``,
  ``m.train()``/``eval()``, a parameter, buffer or submodule assigned or deleted,
  ``m.forward = f``, ``m.__class__ = C``): the class's ``__setattr__`` and
  ``__delattr__`` are wrapped in place, as Dynamo's mutation_guard does, once per class
  and for the life of the process;
- a forward or backward hook registered on one through its class's ``register_*_hook``;
- ``register_parameter``, ``register_buffer`` or ``add_module`` on one (torch's global
  registration hooks);
- a submodule inserted, deleted or replaced through a container's own methods
  (Sequential, ModuleList, ModuleDict: ``insert``, ``del``, ``clear``, ...), wrapped
  like ``__setattr__``.

Nothing moves it while Dynamo traces: Dynamo replays a forward's attribute sets on the
real modules after its graph runs, through the same wrappers.

What it does not see: writes to a module's ``__dict__`` or registries
(``m._parameters[k] = p``, ``m._modules[k] = sub``, a hook removed through its handle),
``object.__setattr__``. module/state.py polls what of these matters (the hook dicts that
hold hooks, torch's global hook dicts) and module/direct.py reads each weight through
its registry on every call. Instances of a wrapped class outside any watched tree pay a
membership test per attribute set and are otherwise untouched: ``type(m)``, pickling and ``copy`` do not change. The counter is
a plain increment after each change, not atomic: modules mutated by several threads at
once while another calls them may lose a bump."""

from __future__ import annotations

import functools
import weakref

import torch

#: One global counter (a one-element list), bumped after a change; a reader compares it
#: with the value it saw (``epoch()``, or ``EPOCH[0]`` where a call costs too much).
EPOCH = [0]
#: The modules of watched trees: only their changes move the counter (a module made and
#: dropped inside a forward, as Llama's ``self.layers[:n]`` makes a ModuleList, does not).
_members: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
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
#: Modules whose own methods write their submodule registry directly (``insert``,
#: ModuleDict's ``del`` and ``clear``), and every method of theirs that changes it:
#: wrapped like ``__setattr__`` (tests/ortmodule/test_module_watch.py reads torch's source to
#: check that no other method writes the registry).
_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)
_CONTAINER_METHODS = ("insert", "append", "extend", "pop", "popitem", "clear", "update", "__setitem__",
                      "__delitem__", "__iadd__", "__imul__")


def epoch() -> int:
    return EPOCH[0]


def watch(modules: list[torch.nn.Module]) -> bool:
    """Make changes to ``modules`` move the counter; False where a module's class
    cannot be wrapped (its changes are then only seen by polling)."""
    if not _global_hooks:
        _register_global_hooks()
    _members.update(modules)
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


def _changed(module) -> None:
    # While Dynamo traces (or torch.export), nothing is bumped: the counter must not
    # become a guarded constant of the graph, and Dynamo replays a forward's attribute
    # sets on the real modules after the graph, through these same wrappers.
    if not torch.compiler.is_compiling() and module in _members:
        EPOCH[0] += 1


def _registered(module, _name, _value) -> None:
    _changed(module)


def _register_global_hooks() -> None:
    from torch.nn.modules import module as nn_module

    for register in (nn_module.register_module_parameter_registration_hook,
                     nn_module.register_module_buffer_registration_hook,
                     nn_module.register_module_module_registration_hook):
        _global_hooks.append(register(_registered))


def _wrap_setattr(original):
    @functools.wraps(original)
    def __setattr__(self, name, value):
        original(self, name, value)
        _changed(self)

    return __setattr__


def _wrap_delattr(original):
    @functools.wraps(original)
    def __delattr__(self, name):
        original(self, name)
        _changed(self)

    return __delattr__


def _wrap_method(original):
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        _changed(self)
        return out

    return method


def _patch(cls: type) -> None:
    wrapped = {
        "__setattr__": _wrap_setattr(cls.__setattr__),
        "__delattr__": _wrap_delattr(cls.__delattr__),
    }
    methods = _HOOK_METHODS + (_CONTAINER_METHODS if issubclass(cls, _CONTAINERS) else ())
    for name in methods:
        original = getattr(cls, name, None)
        if original is not None:
            wrapped[name] = _wrap_method(original)
    for name, fn in wrapped.items():
        type.__setattr__(cls, name, fn)
    _patched.add(cls)
