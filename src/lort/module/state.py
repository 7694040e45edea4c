"""The module state a compiled ORTModule graph depends on, besides its inputs:
``training`` of every submodule, its plain attributes (bool, int, float, str, None),
which parameters, buffers and submodules are registered, and the number of hooks; with
a cheap snapshot to tell whether it changed and words that say what changed."""

from __future__ import annotations

import torch

_MISSING = object()
_PLAIN = frozenset((bool, int, float, str, type(None)))


def module_state(modules: list[torch.nn.Module]) -> tuple:
    """A cheap fingerprint of what in a module tree can change its graph (besides the
    inputs). Compared with ``==`` on every call; tensors enter by identity only."""
    plain = _PLAIN
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


def snapshot(dicts: list[dict]) -> list:
    """What ``_module_state`` depends on, by identity: cheaper to build and compare (a
    third of the cost), used to skip ``_module_state`` while nothing changed."""
    return [
        (
            tuple(d.values()),
            tuple(d["_parameters"].values()),
            tuple(d["_buffers"].values()),
            tuple(d["_modules"].values()),
            len(d["_forward_hooks"]) + len(d["_forward_pre_hooks"]) + len(d["_backward_hooks"])
            + len(d.get("_backward_pre_hooks", ())),
        )
        for d in dicts
    ]


def same_snapshot(a: list | None, b: list) -> bool:
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
