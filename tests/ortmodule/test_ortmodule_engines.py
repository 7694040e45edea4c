"""lort.ORTModule with inductor among executor="auto"'s engines (compile/engines.py), as the
torch.compile front end has it: a graph starts on lort's graph or eager PyTorch, inductor
compiles it in its subprocess after the first call, and the faster is kept. Direct
inference (module/direct.py, exported no-grad graphs) and training (Dynamo's graphs):
every call is checked against eager PyTorch on the same inputs, a weight change after the
swap included; training's losses and weights against eager and a float64 reference."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from test_ortmodule import assert_close_to_reference

import lort
from lort.compile import engines
from lort.compile.tuner import Tuner
from lort.reasons import Placement

AUTO = {"executor": "auto", "engines": ("ort", "pytorch", "inductor"), "disk_cache": False, "progress": False}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                       torch.nn.Linear(64, 8))

    def forward(self, x):
        return self.net(x)


def _timings(monkeypatch, fixed: dict, calls: list | None = None):
    """Whole-graph timings fixed by candidate name (after the real timing runs, so every
    candidate is called on the timing's inputs); the timed path, not the small-graph
    shortcut (compile/call_floor.py)."""
    real = Tuner.time_graph

    def time_graph(self, candidates, example_inputs):
        assert real(self, candidates, example_inputs)
        if calls is not None:
            calls.append(sorted(candidates))
        return {name: fixed[name] for name in candidates}

    monkeypatch.setattr(Tuner, "time_graph", time_graph)
    monkeypatch.setattr(Tuner, "time_tiny_eager", lambda self, eager, example_inputs: None)


@pytest.fixture
def net():
    torch.manual_seed(0)
    return Net().eval(), torch.randn(16, 32)


def _check(om, model, x):
    with torch.no_grad():
        torch.testing.assert_close(om(x), model(x), rtol=1e-4, atol=1e-5)


def _switch(om) -> engines.EngineSwitch:
    entry = [e for e in om.transition_manager.entries.values() if not e.key.grad_enabled][-1]
    switch = entry.runner._fn
    assert isinstance(switch, engines.EngineSwitch), switch
    return switch


def _until_settled(om, model, x, timeout=600.0) -> engines.EngineSwitch:
    _check(om, model, x)  # the first call exports and compiles
    switch = _switch(om)
    start = time.perf_counter()
    while switch.engine is None:
        assert time.perf_counter() - start < timeout, "inductor's compile did not finish"
        _check(om, model, x)
        time.sleep(0.05)
    return switch


def test_direct_inference_swaps_to_inductor_and_sees_weight_changes(net, monkeypatch):
    model, x = net
    _timings(monkeypatch, {"ort": 1e-3, "pytorch": 2e-3, "inductor": 0.5e-3})
    om = lort.ORTModule(model, options=AUTO)
    frames = dict(torch._dynamo.utils.counters["frames"])
    switch = _until_settled(om, model, x)
    assert switch.engine == "inductor"
    _check(om, model, x)
    with torch.no_grad():  # inductor's code reads the weights per call, as they are now
        model.net[0].weight.mul_(-1)
    _check(om, model, x)
    model.net[3].bias.data = torch.full((8,), 2.0)  # moved: same dtype, shape and strides
    _check(om, model, x)
    assert dict(torch._dynamo.utils.counters["frames"]) == frames  # direct: Dynamo saw no frame
    record, = om.transition_manager.records  # the same schema and graph throughout
    assert record.executor == Placement.INDUCTOR
    text = str(lort.ExplainReport(om.transition_manager.records))
    assert "graphs run whole in inductor:" in text and "0.500 ms inductor" in text, text


def test_inductor_timed_slower_keeps_the_ort_group_and_its_short_route(net, monkeypatch):
    model, x = net
    _timings(monkeypatch, {"ort": 1e-3, "pytorch": 2e-3, "inductor": 3e-3})
    om = lort.ORTModule(model, options=AUTO)
    assert _until_settled(om, model, x).engine == "ort"
    _check(om, model, x)
    entry = [e for e in om.transition_manager.entries.values() if not e.key.grad_enabled][-1]
    assert entry.runner.settled and entry.runner._steady is not None  # one ORT group, called directly
    record, = om.transition_manager.records
    assert record.executor == Placement.ORT and record.executor_times["inductor"] == 3e-3


def test_eager_chosen_first_then_inductor_timed_against_it(net, monkeypatch):
    model, x = net
    calls = []
    _timings(monkeypatch, {"ort": 2e-3, "pytorch": 1e-3, "inductor": 0.5e-3}, calls)
    om = lort.ORTModule(model, options=AUTO)
    assert _until_settled(om, model, x).engine == "inductor"
    assert calls == [["ort", "pytorch"], ["inductor", "pytorch"]], calls
    _check(om, model, x)


def test_a_cached_inductor_choice_starts_on_eager_and_swaps_without_timing(net, monkeypatch, tmp_path):
    model, x = net
    opts = {**AUTO, "disk_cache": True, "cache_dir": str(tmp_path)}
    _timings(monkeypatch, {"ort": 1e-3, "pytorch": 2e-3, "inductor": 0.5e-3})
    _until_settled(lort.ORTModule(model, options=opts), model, x)

    def no_timing(self, candidates, example_inputs):
        raise AssertionError("the choice is read from the disk cache")

    monkeypatch.setattr(Tuner, "time_graph", no_timing)
    warm = lort.ORTModule(model, options=opts)
    assert _until_settled(warm, model, x).engine == "inductor"
    _check(warm, model, x)
    record, = warm.transition_manager.records
    assert record.executor == Placement.INDUCTOR and "read from the disk cache" in record.fallbacks[0][1]
    assert not record.group_modules  # nothing compiled for ORT


def test_inductor_left_out_keeps_the_direct_choice_as_it_was(net, monkeypatch):
    model, x = net
    _timings(monkeypatch, {"ort": 1e-3, "pytorch": 2e-3, "inductor": 0.5e-3})
    om = lort.ORTModule(model, options={**AUTO, "engines": ("ort", "pytorch")})
    _check(om, model, x)
    _check(om, model, x)
    entry = [e for e in om.transition_manager.entries.values() if not e.key.grad_enabled][-1]
    assert not isinstance(entry.runner._fn, engines.EngineSwitch) and entry.runner.settled


def test_training_through_ortmodule_swaps_to_inductor_and_matches_eager(net, monkeypatch):
    """Eight AdamW steps through ORTModule (its Dynamo path): lort's graph first, then
    inductor once ready and timed faster; each loss and the final weights against eager
    and float64."""
    model, x = net
    model.train()
    y = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    _timings(monkeypatch, {"ort": 1e-3, "pytorch": 2e-3, "inductor": 0.5e-3})
    eager, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    om = lort.ORTModule(model, options=AUTO)

    def train(m, xs, ys, wait=None):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses = []
        for i in range(8):
            if wait is not None and i == 3:
                wait()
            loss = torch.nn.functional.mse_loss(m(xs), ys)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    def switch():
        found = [s for e in om.transition_manager.entries.values() if e.backend is not None
                 for s in (r() for r in e.backend.switches) if s is not None]
        assert len(found) == 1, found
        return found[0]

    def wait():  # the first steps ran on lort's graph; inductor's compile started at the second
        assert switch().engine is None
        start = time.perf_counter()
        while not switch()._job.ready():
            assert time.perf_counter() - start < 600, "inductor's compile did not finish"
            time.sleep(0.05)

    ours = train(om, x, y, wait)
    theirs = train(eager, x, y)
    exact = train(ref, x.double(), y.double())
    assert switch().engine == "inductor"
    for i, (a, b, r) in enumerate(zip(ours, theirs, exact)):
        assert_close_to_reference(a, b, r, f"loss at step {i}")
    for (name, p), pe, pr in zip(model.named_parameters(), eager.parameters(), ref.parameters()):
        assert_close_to_reference(p.detach(), pe.detach(), pr.detach(), f"weight {name} after 8 steps")
    kinds = {r.kind: r.executor for r in om.transition_manager.records}
    assert kinds == {"forward": Placement.INDUCTOR, "backward": Placement.INDUCTOR}, kinds
