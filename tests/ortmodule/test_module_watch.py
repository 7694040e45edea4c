"""ORTModule's per-call module-state check (module/watch.py's change counter, with
module/state.py's poll of what the counter does not see): every route by which a module
tree can change between two no-grad calls, each checked against eager PyTorch on the
same inputs after the change."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lort
from lort.module import watch

OPTS = {"executor": "ort", "disk_cache": False, "progress": False}


def _check(om, model, *args):
    with torch.no_grad():
        torch.testing.assert_close(om(*args), model(*args), rtol=1e-5, atol=1e-5)


def _direct(om) -> bool:
    entries = [e for e in om.transition_manager.entries.values() if not e.key.grad_enabled]
    return bool(entries) and bool(entries[-1].runners) and entries[-1].direct_refused is None


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6))
        self.heads = nn.ModuleDict({"a": nn.Linear(6, 2), "b": nn.Linear(6, 3)})
        self.scale = 1.0

    def forward(self, x):
        y = self.layers(x) * self.scale
        if hasattr(self, "extra"):
            y = y + self.extra
        return torch.cat([h(y) for h in self.heads.values()], dim=-1)


@pytest.fixture
def stack():
    torch.manual_seed(0)
    return Stack().eval(), torch.randn(4, 6)


def _routes():
    def sequential_insert(m):
        m.layers.insert(1, nn.Tanh())  # writes the registry directly

    def sequential_append(m):
        m.layers.append(nn.Sigmoid())

    def sequential_pop_and_del(m):
        m.layers.pop(1)
        del m.layers[0]

    def module_dict_del(m):
        del m.heads["a"]

    def module_dict_pop(m):
        m.heads.pop("b")  # `del self._modules[key]`

    def module_dict_clear_and_update(m):
        heads = dict(m.heads)
        m.heads.clear()
        m.heads.update({"b": heads["b"]})

    def registry_write(m):
        m.layers[0]._parameters["weight"] = nn.Parameter(torch.randn(6, 6))

    def registry_write_buffer(m):
        m.register_buffer("extra", torch.full((6,), 0.5))

    def plain_attribute(m):
        m.scale = 3.0

    def submodule_attribute(m):
        m.layers[1].inplace = True

    def deleted_then_set(m):
        del m.scale
        m.scale = -1.0

    def submodule_replaced(m):
        m.layers[2] = nn.Linear(6, 6)

    def train_flag(m):
        m.layers[1].train()

    return [sequential_insert, sequential_append, sequential_pop_and_del, module_dict_del, module_dict_pop, module_dict_clear_and_update, registry_write,
            registry_write_buffer, plain_attribute, submodule_attribute, deleted_then_set, submodule_replaced,
            train_flag]


@pytest.mark.parametrize("route", _routes(), ids=lambda f: f.__name__)
def test_a_module_change_is_seen_on_the_next_call(stack, route):
    model, x = stack
    om = lort.ORTModule(model, options=OPTS)
    _check(om, model, x)
    _check(om, model, x)
    route(model)
    _check(om, model, x)
    _check(om, model, x)
    assert _direct(om)


def test_module_list_insert_is_seen():
    torch.manual_seed(0)
    model = nn.ModuleList([nn.Linear(5, 5), nn.ReLU()])
    run = lambda m, x: torch.stack([layer(x) for layer in m]).sum(0)  # noqa: E731

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = model

        def forward(self, x):
            return run(self.blocks, x)

    holder, x = Holder().eval(), torch.randn(3, 5)
    om = lort.ORTModule(holder, options=OPTS)
    _check(om, holder, x)
    model.insert(0, nn.Tanh())  # writes the registry directly
    _check(om, holder, x)
    assert len(om.transition_manager.captures) == 2


def _writes_registry(fn) -> bool:
    import inspect
    import re

    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    return re.search(r"self\._modules\[[^\]]*\]\s*=(?!=)|del self\._modules|self\._modules\.(clear|pop|popitem|update|"
                     r"setdefault)\(", source) is not None


def test_every_container_method_that_writes_the_registry_is_wrapped():
    """module/watch.py wraps the containers' methods that write their submodule registry
    directly (it polls none of them): read torch's own source, so that a torch version
    adding such a method fails here, not silently."""
    for cls in watch._CONTAINERS:
        writers = {name for name, fn in vars(cls).items() if callable(fn) and _writes_registry(fn)}
        assert writers, cls  # the scan finds insert (and ModuleDict's del and clear)
        wrapped = set(watch._CONTAINER_METHODS) | {"__setattr__", "__delattr__"}  # the latter for every class
        assert writers <= wrapped, (cls.__name__, writers - wrapped)


def test_hooks_added_and_removed_are_seen(stack):
    model, x = stack
    before = model.layers[0].register_forward_hook(lambda mod, inp, out: out * 2)  # made before wrapping
    om = lort.ORTModule(model, options=OPTS)
    _check(om, model, x)
    before.remove()  # no attribute set: seen by the poll of hook dicts that held hooks
    _check(om, model, x)
    after = model.heads["a"].register_forward_pre_hook(lambda mod, inp: (inp[0] + 1,))
    _check(om, model, x)
    after.remove()
    _check(om, model, x)
    glob = nn.modules.module.register_module_forward_hook(lambda mod, inp, out: out + 1 if isinstance(mod, nn.ReLU) else out)
    try:
        _check(om, model, x)
    finally:
        glob.remove()
    _check(om, model, x)
    reasons = [c.reason for c in om.transition_manager.captures]
    assert "global module hooks changed" in reasons, reasons
    assert _direct(om)


def test_functional_call_swaps_the_weights_of_the_call(stack):
    """torch.func.functional_call writes the registries directly (no attribute set):
    the direct path reads every weight through its registry."""
    model, x = stack
    om = lort.ORTModule(model, options=OPTS)
    _check(om, model, x)
    params = {k: torch.randn_like(v) for k, v in model.named_parameters()}
    with torch.no_grad():
        got = torch.func.functional_call(om.module, params, (x,))
        want = torch.func.functional_call(model, params, (x,))
    torch.testing.assert_close(got, want)
    _check(om, model, x)


def test_no_snapshot_while_nothing_changed(stack, monkeypatch):
    """The common call reads the counter and the poll, not every module."""
    model, x = stack
    om = lort.ORTModule(model, options=OPTS)
    _check(om, model, x)
    _check(om, model, x)
    from lort.module import state

    calls = []
    monkeypatch.setattr(state, "snapshot", lambda w: calls.append(1) or [])
    with torch.no_grad():
        om(x)
        om(x)
    assert calls == []
    model.scale = 2.0
    with torch.no_grad():
        om(x)
    assert calls  # the counter moved: the snapshot is taken


def test_a_class_watch_cannot_wrap_is_snapshot_on_every_call(stack, monkeypatch):
    model, x = stack

    class Plain(nn.Module):
        def forward(self, x):
            return x * self.k

    def refuse(cls):
        if cls is Plain:
            raise TypeError("no")
        return original(cls)

    original = watch._patch
    monkeypatch.setattr(watch, "_patch", refuse)
    plain = Plain()
    plain.k = 2.0
    om = lort.ORTModule(plain, options=OPTS)
    _check(om, plain, x)
    object.__setattr__(plain, "k", 3.0)  # no notification at all
    _check(om, plain, x)
    assert not om.transition_manager._tree._notified


class Recorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.last = torch.zeros(4)

    def forward(self, x):
        y = self.fc(x)
        self.last = y.detach().sum(0)  # sets an attribute in forward
        return y


def test_wrapped_classes_still_trace_whole_under_dynamo():
    """watch.py wraps __setattr__ of the classes it watches: a forward that sets an
    attribute must still compile as one graph (fullgraph) with any backend."""
    torch.manual_seed(0)
    watched = Recorder()
    lort.ORTModule(watched, options=OPTS)(torch.randn(2, 4))  # wraps Recorder and Linear
    other = Recorder()
    x = torch.randn(3, 4)
    for backend in ("eager", lort.LortBackend(OPTS)):
        torch._dynamo.reset()
        out = torch.compile(other, backend=backend, fullgraph=True)(x)
        torch.testing.assert_close(out, other.fc(x))
        torch.testing.assert_close(other.last, other.fc(x).detach().sum(0))


class Sliced(nn.Module):
    """Slices its ModuleList in forward (as Llama does with ``self.layers[:n]``): a new
    ModuleList, filled by add_module, on every call; and sets an attribute."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.n = 2
        self.calls = torch.zeros(())

    def forward(self, x):
        for layer in self.layers[: self.n]:
            x = torch.relu(layer(x))
        self.calls = self.calls + 1
        return x


def test_modules_made_in_forward_and_dynamo_replays_do_not_recompile():
    """The counter is no guarded constant of a Dynamo graph (one graph for many calls)
    and modules made inside forward do not move it."""
    torch.manual_seed(0)
    watched = Sliced()
    with torch.no_grad():
        lort.ORTModule(watched, options=OPTS)(torch.randn(2, 4))  # watches Sliced, ModuleList, Linear
    other = Sliced()
    x = torch.randn(3, 4)
    torch._dynamo.reset()
    compiled = torch.compile(other, backend="eager", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            torch.testing.assert_close(compiled(x), Sliced.forward(other, x))
    before = watch.epoch()
    with torch.no_grad():
        watched(x)
    # One bump, for the attribute its forward sets; none for the two add_module calls of
    # the sliced ModuleList, which is no member of the watched tree.
    assert watch.epoch() == before + 1
    watched.n = 3
    assert watch.epoch() == before + 2
