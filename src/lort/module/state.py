"""The module state a compiled ORTModule graph depends on, besides its inputs:
``training`` of every submodule, its plain attributes (bool, int, float, str, None),
which parameters, buffers and submodules are registered, and the number of hooks; with
a cheap snapshot to tell whether it changed and words that say what changed."""

from __future__ import annotations

import operator
from itertools import chain

import torch

_MISSING = object()
#: The attribute types a module state compares by value.
PLAIN = frozenset((bool, int, float, str, type(None)))


def module_state(modules: list[torch.nn.Module]) -> tuple:
    """A cheap fingerprint of what in a module tree can change its graph (besides the
    inputs). Compared with ``==`` on every call; tensors enter by identity only."""
    plain = PLAIN
    return tuple([
        (
            tuple([(k, v) for k, v in d.items() if type(v) in plain]),
            tuple(map(id, d["_parameters"].values())),
            tuple(map(id, d["_buffers"].values())),
            tuple(map(id, d["_modules"].values())),
            len(d["_forward_hooks"]) + len(d["_forward_pre_hooks"]) + len(d["_backward_hooks"])
            + len(d.get("_backward_pre_hooks", ())),
        )
        for d in [m.__dict__ for m in modules]
    ])


_REGISTRIES = ("_parameters", "_buffers", "_modules")
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
#: The attributes every module gets from ``nn.Module.__init__`` (hook and registry
#: containers; their contents are watched apart, not their identity), except ``training``.
_INFRASTRUCTURE = frozenset(torch.nn.Module().__dict__) - {"training"}


def watched(dicts: list[dict]) -> tuple:
    """What ``snapshot`` reads, gathered once per module tree: the modules'
    ``__dict__``s with a getter of their own attributes (``training`` and whatever the
    module set: not the containers ``nn.Module.__init__`` made), their parameter, buffer
    and submodule dicts, and their hook dicts."""
    getters = [operator.itemgetter(*[k for k in d if k not in _INFRASTRUCTURE]) for d in dicts]
    return (
        list(dicts),
        getters,
        [d[k] for d in dicts for k in _REGISTRIES],
        [d[k] for d in dicts for k in _HOOKS if k in d],
    )


def snapshot(watch: tuple) -> list | None:
    """What ``module_state`` depends on, by identity, read by C-level maps: the number of
    each module's attributes and the values of its own ones, the parameters, buffers
    and submodules, and the number of hooks; None where an attribute was deleted. Used
    to skip ``module_state`` while nothing changed."""
    modules, getters, registries, hooks = watch
    try:
        return list(chain(
            map(len, modules),
            map(operator.call, getters, modules),
            chain.from_iterable(map(dict.values, registries)),
            map(len, registries),
            map(len, hooks),
        ))
    except KeyError:
        return None


def same_snapshot(a, b) -> bool:
    # Unchanged entries compare by identity; a replaced tensor attribute makes == compare
    # tensors, which may raise (ambiguous truth value): then it changed.
    try:
        return a is not None and bool(a == b)
    except Exception:  # noqa: BLE001 - any failing __eq__ means "changed"
        return False


def state_diff(old_names: list[str], old: tuple, new_names: list[str], new: tuple) -> list[str]:
    """Phrases saying how two module states differ."""
    if old_names != new_names:
        added = [n for n in new_names if n not in old_names]
        removed = [n for n in old_names if n not in new_names]
        parts = []
        if added:
            parts.append(f"submodule(s) {added} added")
        if removed:
            parts.append(f"submodule(s) {removed} removed")
        return parts or ["submodules replaced"]
    out = []
    root_switched = old[0][0] and dict(old[0][0]).get("training") != dict(new[0][0]).get("training")
    if root_switched:
        out.append(f"module switched to {'train' if dict(new[0][0]).get('training') else 'eval'} mode")
    for name, a, b in zip(new_names, old, new):
        if a == b:
            continue
        label = f"'{name}'" if name else "the module"
        attrs_a, attrs_b = dict(a[0]), dict(b[0])
        for k in sorted(attrs_a.keys() | attrs_b.keys()):
            va, vb = attrs_a.get(k, _MISSING), attrs_b.get(k, _MISSING)
            if va is vb or va == vb:
                continue
            if k == "training":
                if not root_switched:
                    out.append(f"submodule {label} switched to {'train' if vb else 'eval'} mode")
                continue
            attr = f"{name}.{k}" if name else k
            if va is _MISSING:
                out.append(f"module attribute '{attr}' set to {vb!r}")
            elif vb is _MISSING:
                out.append(f"module attribute '{attr}' removed (or no longer a constant)")
            else:
                out.append(f"module attribute '{attr}' changed {va!r} -> {vb!r}")
        if a[1] != b[1]:
            out.append(f"parameters of {label} replaced")
        if a[2] != b[2]:
            out.append(f"buffers of {label} replaced")
        if a[3] != b[3]:
            out.append(f"submodules of {label} replaced")
        if a[4] != b[4]:
            out.append(f"hooks of {label} changed")
    return out or ["module state changed"]
