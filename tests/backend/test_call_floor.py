"""executor="auto" leaves a graph uncompiled where eager PyTorch runs it faster than lort's
cheapest call (compile/call_floor.py): onnxruntime-training's einsum tests build hundreds
of such modules, and each cost lort a full compile."""

import time

import pytest
import torch

import lort
from lort import LortBackend
from lort.compile import call_floor
from lort.compile.tuner import Tuner


class _Bias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(8))

    def forward(self, left, right):
        return torch.einsum("ab,bc->ac", left + self.bias, right)


class _EagerTakes(Tuner):
    """Eager's timing of a small graph fixed to ``eager_s`` (the real one runs first)."""

    eager_s = 0.0

    def time_tiny_eager(self, eager, example_inputs):
        measured = super().time_tiny_eager(eager, example_inputs)
        assert measured is not None and 0 < measured < self.tiny_graph_s
        return self.eager_s


def _steps(model, compiled, steps=3):
    torch.manual_seed(1)
    for _ in range(steps):
        left, right = torch.rand(4, 8), torch.rand(8, 6)
        got, want = compiled(left, right), model(left, right)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        got.sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("eager_faster", [True, False])
def test_a_graph_eager_runs_under_lorts_cheapest_call_is_not_compiled(monkeypatch, eager_faster):
    monkeypatch.setattr(call_floor, "floor_s", lambda options, train: 1e-3)
    tuner = _EagerTakes()
    tuner.eager_s = 0.5e-3 if eager_faster else 2e-3
    torch.manual_seed(0)
    model, twin = _Bias(), _Bias()
    twin.load_state_dict(model.state_dict())
    backend = LortBackend({"executor": "auto", "disk_cache": False}, tuner=tuner)
    sessions, runs = lort.stats.sessions_created, lort.stats.ort_runs
    grads = _steps(model, torch.compile(model, backend=backend))
    for got, want in zip(grads, _steps(twin, twin)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if eager_faster:
        # Nothing traced by AOTAutograd, translated or built.
        assert [(r.kind, r.executor) for r in backend.records] == [("graph", "pytorch")]
        assert (lort.stats.sessions_created, lort.stats.ort_runs) == (sessions, runs)
        why = backend.records[0].fallbacks[0][1]
        assert "less than lort's cheapest call (1.000 ms" in why and "nothing compiled" in why
        assert "1.000 ms lort's cheapest call, 0.500 ms eager" in str(lort.ExplainReport(backend.records))
    else:
        assert [r.kind for r in backend.records] == ["forward", "backward"]


def test_large_inputs_are_never_timed_against_the_floor():
    class NoTinyTiming(Tuner):
        def time_tiny_eager(self, eager, example_inputs):
            raise AssertionError("inputs past tiny_inputs_bytes are not timed here")

        def time_graph(self, candidates, example_inputs):
            return None

    x, w = torch.randn(64, 64), torch.randn(64, 64, requires_grad=True)
    backend = LortBackend({"executor": "auto", "disk_cache": False}, tuner=NoTinyTiming(tiny_inputs_bytes=1024))
    compiled = torch.compile(lambda x, w: (x @ w).relu(), backend=backend)
    for _ in range(2):  # a training graph's first call runs eager PyTorch; its second is timed (None: lort's graph)
        compiled(x, w).sum().backward()
    assert [r.kind for r in backend.records] == ["forward", "backward"]


def test_a_slow_graph_ends_its_eager_timing_at_once():
    calls = []

    def slow(x):
        calls.append(1)
        time.sleep(0.03)
        return x + 1

    tuner = Tuner()
    assert tuner.time_tiny_eager(slow, [torch.ones(2)]) is None
    assert len(calls) == 1  # its warm-up call took 30x tiny_graph_s
    calls.clear()
    tuner.tiny_graph_s = 0.01  # now within 20x, but each sample past it: the minimum samples
    assert tuner.time_tiny_eager(slow, [torch.ones(2)]) is None
    assert len(calls) == 1 + tuner.graph_min_samples


def test_the_choice_is_read_back_from_the_disk_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(call_floor, "floor_s", lambda options, train: 1e-3)
    opts = {"executor": "auto", "disk_cache": True, "cache_dir": str(tmp_path)}
    model = _Bias()
    cold = LortBackend(opts, tuner=_EagerTakes())
    _steps(model, torch.compile(model, backend=cold), steps=1)
    torch._dynamo.reset()

    class NoTiming(Tuner):
        def time_tiny_eager(self, eager, example_inputs):
            raise AssertionError("a warm compile times nothing")

    warm = LortBackend(opts, tuner=NoTiming())
    _steps(model, torch.compile(model, backend=warm), steps=1)
    assert [(r.kind, r.executor) for r in warm.records] == [("graph", "pytorch")]
    assert "read from the disk cache" in warm.records[0].fallbacks[0][1]


def test_ortmodule_direct_inference_of_a_tiny_module_runs_it_eager(monkeypatch):
    monkeypatch.setattr(call_floor, "floor_s", lambda options, train: 1e-3)
    monkeypatch.setattr(Tuner, "time_tiny_eager", lambda self, eager, example_inputs: 0.5e-3)
    model = _Bias().eval()
    ort_model = lort.ORTModule(model, options=lort.Options(executor="auto", disk_cache=False))
    left, right = torch.rand(4, 8), torch.rand(8, 6)
    sessions = lort.stats.sessions_created
    with torch.no_grad():
        torch.testing.assert_close(ort_model(left, right), model(left, right), rtol=0, atol=0)
    records = ort_model.transition_manager.records
    assert [(r.kind, r.executor) for r in records] == [("graph", "pytorch")]
    assert "nothing compiled" in records[0].fallbacks[0][1]
    assert lort.stats.sessions_created == sessions


@pytest.mark.parametrize("train", [False, True])
def test_lorts_cheapest_call_is_measured_once_and_not_counted(monkeypatch, train):
    call_floor._floors.clear()
    measured = []
    real = call_floor._measure
    monkeypatch.setattr(call_floor, "_measure", lambda o, t: measured.append(t) or real(o, t))
    sessions, runs = lort.stats.sessions_created, lort.stats.ort_runs
    options = lort.Options.resolve({"executor": "auto"})
    first = call_floor.floor_s(options, train)
    assert first is not None and 0 < first < 0.05
    assert call_floor.floor_s(options, train) == first and measured == [train]
    # The user's counters count the user's sessions and runs only.
    assert (lort.stats.sessions_created, lort.stats.ort_runs) == (sessions, runs)


@pytest.mark.parametrize("train", [True, False])
def test_save_onnx_writes_the_files_of_a_graph_run_in_eager_pytorch(monkeypatch, tmp_path, train):
    """Options.save_onnx asks for every graph's models: a graph run in eager PyTorch by
    lort's choice is translated for the files alone, and still runs in PyTorch."""
    import onnx

    monkeypatch.setattr(call_floor, "floor_s", lambda options, train: 1e-3)
    monkeypatch.setattr(Tuner, "time_tiny_eager", lambda self, eager, example_inputs: 0.5e-3)
    model = _Bias()
    backend = LortBackend({"executor": "auto", "disk_cache": False, "save_onnx": str(tmp_path)})
    left, right = torch.rand(4, 8), torch.rand(8, 6)
    with torch.set_grad_enabled(train):
        out = torch.compile(model, backend=backend)(left, right)
    torch.testing.assert_close(out, model(left, right), rtol=0, atol=0)  # PyTorch ran it
    assert [(r.kind, r.executor) for r in backend.records] == [("graph", "pytorch")]
    files = sorted(p.name for p in tmp_path.iterdir())
    kinds = ("forward", "backward") if train else ("inference",)
    for kind in kinds:
        assert any(f"_{kind}_" in f and f.endswith(".onnx") for f in files), files
    for f in files:
        onnx.checker.check_model(onnx.load(str(tmp_path / f)))
