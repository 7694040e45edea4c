"""The module state a compiled ORTModule graph depends on, besides its inputs:
``training`` of every submodule, its plain attributes (bool, int, float, str, None),
which parameters, buffers and submodules are registered, and the number of hooks (the
module's and torch's global ones); with a snapshot to tell whether it changed, a cheaper
poll of what module/watch.py's notification does not see, and words that say what
changed."""

from __future__ import annotations

import operator
from itertools import chain

import torch
from torch.nn.modules import module as _nn_module

from . import watch
from .watch import EPOCH

_MISSING = object()
#: The attribute types a module state compares by value.
PLAIN = frozenset((bool, int, float, str, type(None)))


#: torch's global module hooks (run by every module's call, so traced into its graphs).
GLOBAL_HOOKS = [getattr(_nn_module, name) for name in (
    "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks")
    if isinstance(getattr(_nn_module, name, None), dict)]


def module_state(modules: list[torch.nn.Module]) -> tuple:
    """A fingerprint of what in a module tree can change its graph (besides the inputs):
    one entry per module, and the number of global hooks. Tensors enter by identity only."""
    return _per_module(modules), tuple(map(len, GLOBAL_HOOKS))


def _per_module(modules: list[torch.nn.Module]) -> tuple:
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
        [d[k] for d in dicts for k in _HOOKS if k in d] + GLOBAL_HOOKS,
    )


def polled(modules: list[torch.nn.Module]) -> list[dict]:
    """What ``poll`` reads: the hook dicts that hold hooks (a hook removed through its
    handle is no attribute set) and torch's global ones: what module/watch.py's
    notification does not see, gathered after each snapshot."""
    return [h for h in (m.__dict__.get(k) for m in modules for k in _HOOKS) if h] + GLOBAL_HOOKS


def poll(hooks: list[dict]) -> list[int]:
    """How many hooks each dict ``polled`` names holds."""
    return list(map(len, hooks))


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
    """Phrases saying how two ``module_state``s differ."""
    (old, old_global), (new, new_global) = old, new
    out = [] if old_global == new_global else ["global module hooks changed"]
    if old_names != new_names:
        added = [n for n in new_names if n not in old_names]
        removed = [n for n in old_names if n not in new_names]
        parts = []
        if added:
            parts.append(f"submodule(s) {added} added")
        if removed:
            parts.append(f"submodule(s) {removed} removed")
        return out + (parts or ["submodules replaced"])
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


class ModuleState:
    """The state of one module tree as a token (equal states share one, so switching
    train/eval back and forth reuses entries), and ``epoch``: how many times it was seen
    to change (module/direct.py re-checks what it holds on a change). ``token()`` is
    called on every call: it reads module/watch.py's counter and ``poll``, and takes the
    snapshot only after the counter moved (always, where the tree has a class watch.py
    cannot wrap)."""

    def __init__(self, root: torch.nn.Module):
        self.root = root
        self.epoch = 0
        self._token = 0
        self._tokens: dict[tuple, int] = {}
        self._info: dict[int, tuple[list[str], tuple]] = {}
        self.refresh()

    def refresh(self) -> None:
        """Walk the tree again (after a change, or when told that it changed)."""
        named = list(self.root.named_modules(remove_duplicate=False))
        self.names = [n for n, _ in named]
        self.modules = [m for _, m in named]
        self._watched = watched([m.__dict__ for m in self.modules])
        self._snap: list | None = None
        self._seen: int | None = None  # watch.epoch() when the state was last taken
        self._notified = watch.watch(self.modules)

    def named(self) -> list[tuple[str, torch.nn.Module]]:
        return list(zip(self.names, self.modules))

    def token(self) -> int:
        # The common case: nothing set on a module since the last call (module/watch.py)
        # and nothing changed of what it does not see.
        if self._seen == EPOCH[0] and list(map(len, self._polled)) == self._poll:  # poll(), inlined
            return self._token
        seen = watch.epoch() if self._notified else None
        if not same_snapshot(self._snap, snapshot(self._watched)):
            self.epoch += 1
            # Something changed (or submodules were added or replaced): walk the tree
            # again and look the state up.
            self.refresh()
            state = module_state(self.modules)
            token = self._tokens.get(state)
            if token is None:
                token = self._tokens[state] = len(self._tokens) + 1
                self._info[token] = (list(self.names), state)
            self._snap = snapshot(self._watched)
            self._token = token
        self._polled = polled(self.modules)
        self._poll = poll(self._polled)
        self._seen = seen
        return self._token

    def diff(self, old: int, new: int) -> list[str]:
        """Phrases saying how the states of two tokens differ."""
        return state_diff(*self._info[old], *self._info[new])
