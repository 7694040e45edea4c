"""lort.ORTModule over many input sizes: a training loop never meets Dynamo's recompile
limit as an exception (module/recapture.py). Every step is checked against eager
PyTorch and a float64 reference (outputs and gradients, tests/ortmodule/test_ortmodule.py's
budgets)."""

import copy
import logging
import warnings

import torch
from torch import nn

import lort
from lort import ORTModule
from test_ortmodule import assert_close_to_reference, assert_grads_match, reasons


class SizeAsIgnoreIndex(nn.Module):
    """The issue's model: a size of the input read as a Python int (ignore_index)."""

    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(32, 128, padding_idx=1)

    def forward(self, x, p):
        o = torch.transpose(self.e(x), 0, 1)
        return nn.functional.cross_entropy(o, p, ignore_index=o.size(1))


class LoopOverRows(nn.Module):
    """Specializes on its input's first size even with every size dynamic (the loop is
    unrolled for each size)."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 16)

    def forward(self, x):
        h = self.l(x)
        acc = h[0]
        for i in range(1, x.size(0)):
            acc = acc + torch.tanh(h[i])
        return acc.sum()


class FactorialOfSize(nn.Module):
    """Captures with static sizes (one graph per size) but not with dynamic ones: Dynamo
    cannot put math.factorial of a symbolic size in a graph."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        import math

        return self.l(x).sum() * (math.factorial(x.size(0)) % 5 + 1)


def _train_over(model_cls, calls, options=None, seed=0):
    """Each call's loss and gradients through ORTModule against eager and float64; the
    ORTModule and the warnings lort gave."""
    torch.manual_seed(seed)
    model = model_cls()
    eager, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    om = ORTModule(model, options=options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for args in calls:
            args64 = [a.double() if a.is_floating_point() else a for a in args]
            losses = [m(*a) for m, a in ((om, args), (eager, args), (ref, args64))]
            assert_close_to_reference(losses[0], losses[1], losses[2], f"loss at sizes {[a.shape for a in args]}")
            for loss in losses:
                loss.backward()
            assert_grads_match(om, eager, ref)
            for m in (om, eager, ref):
                m.zero_grad()
    return om, [str(w.message) for w in caught if "lort" in str(w.message)]


def _issue_calls(sizes):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 32, (n, 4), generator=g), torch.randint(0, n, (4, 128), generator=g)) for n in sizes]


def test_twenty_sizes_of_a_model_reading_a_size_train_like_eager_auto():
    """The issue's loop: 20 sizes under the default executor='auto'. Its timing of the
    graph ran eager code on Dynamo's symbolic size, which specialized the graph on each
    size: the 9th size raised FailOnRecompileLimitHit into the loop."""
    om, said = _train_over(SizeAsIgnoreIndex, _issue_calls(range(16, 36)), {"executor": "auto"})
    assert said == []
    assert len(om.transition_manager.captures) <= 2, reasons(om)  # the first call, then dynamic sizes


def test_twenty_sizes_of_a_model_reading_a_size_train_like_eager_in_ort():
    om, said = _train_over(SizeAsIgnoreIndex, _issue_calls(range(16, 36)))
    assert said == []
    assert len(om.transition_manager.captures) == 2, reasons(om)
    assert all(g.executor.value == "ort" for r in om.transition_manager.records for g in r.group_modules.values())


def test_torch_compile_of_a_model_reading_a_size_captures_twice():
    """The same timing through torch.compile(backend='lort'): one graph per size before."""
    torch.manual_seed(0)
    model = SizeAsIgnoreIndex()
    backend = lort.LortBackend({"executor": "auto"})
    compiled = torch.compile(model, backend=backend)
    for x, p in _issue_calls(range(16, 28)):
        torch.testing.assert_close(compiled(x, p), model(x, p))
    assert len([r for r in backend.records if r.kind != "backward"]) == 2


def test_static_sizes_are_captured_again_with_every_size_dynamic():
    """With Dynamo's automatic dynamic shapes off, each size is captured again: at the
    second time a dim does so the entry is captured with every size dynamic, and later
    sizes need no capture."""
    calls = [(torch.randn(n, 16),) for n in range(3, 15)]
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        om, said = _train_over(LoopFree, calls)
    assert said == []
    got = reasons(om)
    assert len(got) == 4, got
    assert got[3].startswith("the forward specializes on input 'x' dim 0 (each new size was captured again); "
                             "captured again with every size dynamic"), got


class LoopFree(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x).square().mean()


def test_sizes_past_the_recompile_limit_run_in_pytorch_with_one_warning(caplog):
    """A forward that specializes even with dynamic sizes: once Dynamo's limit is reached
    the uncompiled sizes run in PyTorch (one warning, none of Dynamo's), the compiled
    ones in ORT, and nothing reaches the loop."""
    sizes = list(range(3, 12))
    calls = [(torch.randn(n, 16),) for n in sizes + sizes]
    with torch._dynamo.config.patch(recompile_limit=3), caplog.at_level(logging.WARNING):
        runs = lort.stats.ort_runs
        om, said = _train_over(LoopOverRows, calls)
    assert len(said) == 1, said
    assert "Dynamo's recompile limit" in said[0] and "with every size dynamic" in said[0], said[0]
    assert "run in PyTorch" in said[0] and "torch._dynamo.config.recompile_limit" in said[0]
    assert not [r for r in caplog.records if r.name.startswith("torch._dynamo")], caplog.text
    assert any("captured again with every size dynamic" in r for r in reasons(om))
    assert lort.stats.ort_runs > runs
    entry = next(iter(om.transition_manager.entries.values()))
    assert entry.size.past_limit and len(entry.size.uncompiled) >= len(sizes) - 3 - 3


def test_a_capture_failed_by_dynamic_sizes_is_made_again_with_static_sizes():
    """Dynamo's automatic dynamic shapes make the second size symbolic, which this forward
    cannot take: the entry is captured again with static sizes (a graph per size) up to
    the recompile limit, then new sizes run in PyTorch."""
    calls = [(torch.randn(n, 8),) for n in range(3, 10)]
    with torch._dynamo.config.patch(recompile_limit=4):
        om, said = _train_over(FactorialOfSize, calls)
    got = reasons(om)
    assert got[1].startswith("capture failed (Unsupported: ") and got[1].endswith(
        "captured again with static sizes (a graph per size)"), got
    assert len(said) == 1, said
    assert "recompile limit" in said[0] and "with static sizes" in said[0] and "run in PyTorch" in said[0], said[0]
    entry = next(iter(om.transition_manager.entries.values()))
    assert entry.size.mode == "static" and entry.size.past_limit and not entry.eager


def test_a_failed_capture_with_dynamic_sizes_goes_back_to_the_first_function():
    """Sizes captured one by one (automatic dynamic shapes off) make the entry try every
    size dynamic, which this forward cannot take: back on the first function, which goes
    on capturing a graph per size up to the limit."""
    calls = [(torch.randn(n, 8),) for n in range(3, 10)]
    with torch._dynamo.config.patch(recompile_limit=5, automatic_dynamic_shapes=False):
        om, said = _train_over(FactorialOfSize, calls)
    assert any(r.endswith("captured again with every size dynamic") for r in reasons(om)), reasons(om)
    assert len(said) == 1, said
    assert "the capture with every size dynamic (Unsupported: " in said[0] and "run in PyTorch" in said[0], said[0]
    entry = next(iter(om.transition_manager.entries.values()))
    assert entry.size.mode == "failed" and entry.size.past_limit and not entry.eager
