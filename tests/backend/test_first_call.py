"""What makes a first call cheaper without changing what runs: the whole-graph timing
that a graph's groups already decide, two rounds for a long call, and onnxscript's
rewrite rules that cost the square of a group's size."""

import collections
import time
from types import SimpleNamespace

import pytest
import torch

from lort.compile import graph_executor
from lort.compile.tuner import Tuner
from lort.reasons import Placement, Reason, ReasonKind
from lort.translate import _compat, onnx_export


def _record(kind="inference", times=((0.05, 0.08),), fallbacks=(), executor=Placement.ORT):
    groups = [SimpleNamespace(executor=executor, executor_times={"ort": o, "pytorch": p}) for o, p in times]
    return SimpleNamespace(kind=kind, groups=groups, fallbacks=list(fallbacks))


def test_an_inference_graph_its_groups_decide_for_ort_is_not_timed_again():
    tuner = Tuner()
    assert tuner.settled_by_groups([_record()]) == {"ort": 0.05, "pytorch": 0.08}
    size = ("add", Reason(ReasonKind.NOT_ATEN, "add is not an ATen operator"))
    assert tuner.settled_by_groups([_record(fallbacks=[size])]) is not None  # SymInt arithmetic only


@pytest.mark.parametrize("record, why", [
    (_record(kind="forward"), "a training graph: its backward is timed with it"),
    (_record(times=((0.05, 0.052),)), "a close call: eager's native kernels may beat the decomposed graph"),
    (_record(times=((0.001, 0.01),)), "a short call: the call's own cost counts"),
    (_record(fallbacks=[("aten.nonzero.default", Reason(ReasonKind.NO_TRANSLATION, "x"))]), "a tensor op in PyTorch"),
    (_record(executor=Placement.PYTORCH), "a group in PyTorch"),
    (SimpleNamespace(kind="inference", groups=[SimpleNamespace(executor=Placement.ORT, executor_times={})],
                     fallbacks=[]), "an untimed group"),
])
def test_the_whole_graph_is_timed_where_its_groups_do_not_settle_it(record, why):
    assert Tuner().settled_by_groups([record]) is None, why


def test_a_long_call_is_timed_in_two_rounds_after_one_warm_up():
    calls = collections.Counter()

    def slow(name):
        def fn(*args):
            calls[name] += 1
            time.sleep(0.03)
            return torch.zeros(1)
        return fn

    tuner = Tuner(graph_budget_s=0.01)
    times = tuner.time_graph({"ort": slow("ort"), "pytorch": slow("pytorch")}, [torch.zeros(1)])
    assert set(times) == {"ort", "pytorch"}
    assert calls == {"ort": 3, "pytorch": 3}  # one warm-up, two samples
    calls.clear()
    Tuner(graph_budget_s=1.0).time_graph({"ort": slow("ort"), "pytorch": slow("pytorch")}, [torch.zeros(1)])
    assert calls["ort"] >= 4  # a short call: at least three samples


def _timed_calls(seconds: dict[str, list[float]], tuner: Tuner) -> collections.Counter:
    """How many calls of each candidate ``tuner.time_graph`` makes, where call i of
    candidate name sleeps ``seconds[name][i]`` (the last value past the list)."""
    calls = collections.Counter()

    def sleeper(name):
        def fn(*args):
            time.sleep(seconds[name][min(calls[name], len(seconds[name]) - 1)])
            calls[name] += 1
            return torch.zeros(1)
        return fn

    times = tuner.time_graph({name: sleeper(name) for name in seconds}, [torch.zeros(1)])
    assert set(times) == set(seconds)
    return calls


def test_a_long_call_with_a_clear_winner_in_warm_up_and_first_round_is_timed_once():
    """Both the warm-up and the first sample put one candidate 1.25x ahead: no second round."""
    tuner = Tuner(graph_budget_s=0.01)
    assert _timed_calls({"ort": [0.08], "pytorch": [0.03]}, tuner) == {"ort": 2, "pytorch": 2}
    assert _timed_calls({"ort": [0.03], "pytorch": [0.08]}, tuner) == {"ort": 2, "pytorch": 2}
    # Within the ratio: two rounds, as before.
    assert _timed_calls({"ort": [0.035], "pytorch": [0.03]}, tuner) == {"ort": 3, "pytorch": 3}
    # The warm-up and the first sample disagree (a warm-up slowed by its first run): two rounds.
    assert _timed_calls({"ort": [0.03, 0.08], "pytorch": [0.08, 0.03]}, tuner) == {"ort": 3, "pytorch": 3}
    # Short calls take their three samples whatever the ratio.
    assert _timed_calls({"ort": [0.004], "pytorch": [0.001]}, Tuner(graph_budget_s=1.0))["ort"] >= 4


def test_the_rewrites_run_without_the_quadratic_rule_and_restore_the_rules(monkeypatch):
    """SlicesSplit (two output nodes: matched by scanning the whole graph per candidate)
    is left out of the optimizer runs inside optimize_for_ort, and onnxscript's rule set
    is as it was after the call."""
    from onnxscript import optimizer, rewriter

    (rule,) = _compat._quadratic_rules()
    before = rewriter._DEFAULT_REWRITE_RULES
    assert rule in before
    seen = []
    real = optimizer.optimize_ir

    def spy(*args, **kwargs):
        seen.append(rewriter._DEFAULT_REWRITE_RULES)
        return real(*args, **kwargs)

    monkeypatch.setattr(optimizer, "optimize_ir", spy)

    class Halves(torch.nn.Module):
        def forward(self, x):
            return x[..., 0:4] * 2, x[..., 4:8] + 1

    gm = torch.fx.experimental.proxy_tensor.make_fx(Halves())(torch.randn(3, 8))
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        FakeTensorProp(gm, mode).propagate(mode.from_tensor(torch.randn(3, 8)))
    _compat.optimize_for_ort(onnx_export.group_to_onnx(gm, "halves"))
    assert seen, "optimize_for_ort ran no optimizer pass"
    assert all(rule not in rules and len(rules) == len(before) - 1 for rules in seen)
    assert rewriter._DEFAULT_REWRITE_RULES is before


def test_translation_runs_on_its_own_thread_outside_fake_mode_and_raises_as_called():
    import threading

    from torch._subclasses.fake_tensor import FakeTensorMode

    def where():
        return threading.current_thread().name, torch.utils._python_dispatch._get_current_dispatch_mode_stack()

    with FakeTensorMode():
        name, modes = onnx_export.off_compile_thread(where)
    assert name.startswith("lort-translate") and modes == []
    # Called from that thread (a nested call): it runs there, without a deadlock.
    name, _ = onnx_export.off_compile_thread(onnx_export.off_compile_thread, where)
    assert name.startswith("lort-translate")

    def fails():
        raise ValueError("from the translation thread")

    with pytest.raises(ValueError, match="from the translation thread"):
        onnx_export.off_compile_thread(fails)


def _chooser(ort_s: float, eager_s: float, tuner: Tuner, monkeypatch):
    """A ChooseOnFirstCall over two sleeping callables that say which ran; the tuner's
    timing on extra calls fails the test."""
    from lort.compile.graph_executor import ChooseOnFirstCall

    def sleeper(name, seconds):
        def fn(*args):
            time.sleep(seconds)
            return name
        return fn

    def no_extra_calls(self, candidates, example_inputs):
        raise AssertionError("a long inference call is timed on the user's own calls")

    monkeypatch.setattr(Tuner, "time_graph", no_extra_calls)
    return ChooseOnFirstCall(sleeper("pytorch", eager_s), sleeper("ort", ort_s), [], tuner, None, None, False)


def test_a_long_inference_call_is_timed_on_the_next_calls_not_on_extra_ones(monkeypatch):
    """The first call returns lort's run, the second eager's (their warm-ups); the next
    ones alternate eager PyTorch and lort's graph, two samples each, then the faster runs
    every call."""
    chooser = _chooser(0.03, 0.012, Tuner(graph_budget_s=0.01), monkeypatch)
    x = torch.zeros(2)
    ran = [chooser(x) for _ in range(8)]
    assert ran == ["ort", "pytorch", "pytorch", "ort", "pytorch", "ort", "pytorch", "pytorch"], ran
    assert chooser.chosen is not None and chooser.chosen(x) == "pytorch"


def test_a_close_call_over_calls_takes_twice_the_samples(monkeypatch):
    chooser = _chooser(0.02, 0.02, Tuner(graph_budget_s=0.01), monkeypatch)
    x = torch.zeros(2)
    ran = [chooser(x) for _ in range(10)]
    assert ran == ["ort", "pytorch"] + ["pytorch", "ort"] * 4, ran
    assert chooser.chosen is not None


def test_a_short_call_is_timed_on_the_first_call_a_cpu_training_call_on_the_second(monkeypatch):
    from lort.compile.graph_executor import ChooseOnFirstCall

    timed = []

    def fixed(self, candidates, example_inputs):
        timed.append(sorted(candidates))
        return {"ort": 1e-3, "pytorch": 2e-3}

    monkeypatch.setattr(Tuner, "time_graph", fixed)
    runs = []
    chooser = ChooseOnFirstCall(lambda *a: runs.append("pytorch"), lambda *a: runs.append("ort"), [],
                                Tuner(graph_budget_s=1.0), None, None, False)
    chooser(torch.zeros(2))
    assert timed == [["ort", "pytorch"]] and runs == ["ort"]  # the call's own run is lort's
    weight = torch.zeros(2, requires_grad=True)
    timed.clear()
    runs.clear()
    trains = ChooseOnFirstCall(lambda *a: runs.append("pytorch"), lambda *a: runs.append("ort"), [],
                               Tuner(graph_budget_s=0.0), None, None, False)
    trains(weight)  # a training call (its backward follows): eager PyTorch's run, untimed
    assert timed == [] and runs == ["pytorch"] and trains.chosen is None
    trains(weight)  # the second: timed, then the faster runs
    assert timed == [["ort", "pytorch"]] and runs == ["pytorch", "ort"] and trains.chosen is not None
    trains(weight)
    assert timed == [["ort", "pytorch"]] and runs == ["pytorch", "ort", "ort"]


def test_a_long_inference_graph_through_torch_compile_matches_eager_on_every_call(monkeypatch):
    """A real graph, every call long (graph_budget_s=0): each call's output is eager's,
    whichever engine ran it, and the choice lands in the graph's record."""
    import lort

    def no_extra_calls(self, candidates, example_inputs):
        raise AssertionError("a long inference call is timed on the user's own calls")

    monkeypatch.setattr(Tuner, "time_graph", no_extra_calls)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 8)).eval()
    x = torch.randn(16, 32)
    backend = lort.LortBackend({"executor": "auto", "engines": ("ort", "pytorch"), "disk_cache": False},
                               tuner=Tuner(graph_budget_s=0.0, tiny_graph_s=0.0))
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for _ in range(10):
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    record, = backend.records
    assert set(record.executor_times) >= {"ort", "pytorch"}, record.executor_times


def test_a_long_call_of_another_size_ends_the_sampling_with_a_timing_on_it(monkeypatch):
    """A graph with symbolic sizes: a call of another size than the sampled ones is timed
    on its own inputs (the old way), so that no choice compares two sizes."""
    from lort.compile.graph_executor import ChooseOnFirstCall

    timed = []

    def fixed(self, candidates, example_inputs):
        timed.append(tuple(example_inputs[0].shape))
        return {"ort": 1e-3, "pytorch": 2e-3}

    monkeypatch.setattr(Tuner, "time_graph", fixed)

    def slow(name):
        def fn(*args):
            time.sleep(0.02)
            return name
        return fn

    chooser = ChooseOnFirstCall(slow("pytorch"), slow("ort"), [], Tuner(graph_budget_s=0.01), None, None, False)
    assert [chooser(torch.zeros(4)), chooser(torch.zeros(4)), chooser(torch.zeros(4))] == ["ort", "pytorch", "pytorch"]
    assert chooser(torch.zeros(6)) == "ort" and timed == [(6,)] and chooser.chosen is not None


def _gelu_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def test_a_long_inference_group_is_left_to_its_graphs_timing_over_calls(monkeypatch):
    """A CPU inference group whose ORT run is past graph_budget_s is not timed in
    PyTorch at compile time: its graph is timed against eager over its calls, and
    explain says so. Results are eager's on every call."""
    import lort

    def no_group_timing(*args, **kwargs):
        raise AssertionError("a long inference group is timed in PyTorch at compile time")

    monkeypatch.setattr(Tuner, "time_pytorch", no_group_timing)
    model, x = _gelu_mlp().eval(), torch.randn(16, 32)
    tuner = Tuner(graph_budget_s=0.0, tiny_graph_s=0.0, peak_flops_per_thread=float("inf"))  # long by its run
    backend = lort.LortBackend({"executor": "auto", "engines": ("ort", "pytorch"), "disk_cache": False}, tuner=tuner)
    compiled = torch.compile(model, backend=backend)
    # the calls a choice over calls may take at most: the first, eager's warm-up, then
    # LONG_SAMPLES of each engine, doubled where the two time within 5% (a close call:
    # under a loaded full suite 8 calls were not enough)
    calls = 2 + 2 * 2 * graph_executor.LONG_SAMPLES
    with torch.no_grad():
        for _ in range(calls):
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    record, = backend.records
    assert record.groups and all(set(g.executor_times) == {"ort"} for g in record.groups)
    assert set(record.executor_times) >= {"ort", "pytorch"}, "the graph was not timed over its calls"
    assert "timed against eager PyTorch as part of its graph, not alone" in str(lort.ExplainReport(backend.records))


@pytest.mark.parametrize("budget_s, train", [(1e3, False), (0.0, True)])
def test_short_and_training_groups_are_still_timed_in_pytorch(budget_s, train):
    """A short inference group, and any training group (no sampling over calls: its
    backward follows), keep their compile-time timing against PyTorch."""
    import lort

    model, x = _gelu_mlp(), torch.randn(16, 32)
    backend = lort.LortBackend({"executor": "auto", "engines": ("ort", "pytorch"), "disk_cache": False},
                               tuner=Tuner(graph_budget_s=budget_s, tiny_graph_s=0.0))
    compiled = torch.compile(model, backend=backend)
    with torch.set_grad_enabled(train):
        compiled(x)
    groups = [g for r in backend.records for g in r.groups]
    assert groups and all(set(g.executor_times) == {"ort", "pytorch"} for g in groups), \
        [g.executor_times for g in groups]


def test_product_flops_are_those_of_torchs_flop_counter():
    from torch.fx.experimental.proxy_tensor import make_fx

    from lort.compile.flops import product_flops

    def mlp(x, w1, b1, w2):
        return torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, w1, b1)), w2)

    gm = make_fx(mlp, tracing_mode="fake")(torch.randn(16, 32), torch.randn(64, 32), torch.randn(64), torch.randn(8, 64))
    assert product_flops(gm) == 2 * 16 * 32 * 64 + 2 * 16 * 64 * 8
    conv = make_fx(torch.nn.functional.conv2d, tracing_mode="fake")(torch.randn(2, 3, 10, 10), torch.randn(8, 3, 3, 3))
    assert product_flops(conv) == 2 * (2 * 8 * 8 * 8) * (3 * 3 * 3)
    relu = make_fx(torch.relu, tracing_mode="fake")(torch.randn(4))
    assert product_flops(relu) == 0
    half = make_fx(mlp, tracing_mode="fake")(*(torch.randn(s, dtype=torch.bfloat16) for s in ((16, 32), (64, 32), (64,), (8, 64))))
    assert product_flops(half) == 0  # matrix units (AMX) run it past any float32 peak: no bound


def test_a_group_its_products_make_long_is_not_run_at_compile_time(monkeypatch):
    """Where the products' flops at the core's peak speed already pass graph_budget_s,
    the group runs on every thread and in ORT with no compile-time run; its graph is
    timed against eager (this call is short: on its first call), every call eager's result."""
    import lort

    def no_run(*args, **kwargs):
        raise AssertionError("a group surely long was run at compile time")

    for timer in ("time_sessions", "time_session", "time_pytorch", "time_group_session"):
        monkeypatch.setattr(Tuner, timer, no_run)
    model, x = _gelu_mlp().eval(), torch.randn(16, 32)
    flops = 2 * 16 * 32 * 64 + 2 * 16 * 64 * 8
    tuner = Tuner(graph_budget_s=0.5, peak_flops_per_thread=flops / torch.get_num_threads(), tiny_graph_s=0.0)
    backend = lort.LortBackend({"executor": "auto", "engines": ("ort", "pytorch"), "disk_cache": False},
                               tuner=tuner)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for _ in range(8):
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    record, = backend.records
    group, = record.groups
    assert group.threads == torch.get_num_threads() and group.thread_times == {}
    assert group.executor_times == {"ort_lower_bound": pytest.approx(1.0)}
    assert "products alone take at least 1.00 s a run" in str(lort.ExplainReport(backend.records))


def test_a_cpu_training_graphs_first_step_is_eagers_and_the_choice_is_timed_on_the_second(monkeypatch):
    """executor="auto" on a training graph (batch norm's running statistics and dropout
    included): the first step runs in eager PyTorch with no timing run (its outputs,
    gradients and buffers are eager's, bit for bit); the second is timed, lort's graph
    and eager each on copies of its inputs, then runs the faster; over five AdamW steps the
    losses, weights and buffers match eager's, and the records hold the choice's times."""
    import copy

    import lort

    timings = []
    real_time_graph = Tuner.time_graph

    def counted(self, candidates, example_inputs):
        timings.append(sorted(candidates))
        return real_time_graph(self, candidates, example_inputs)

    monkeypatch.setattr(Tuner, "time_graph", counted)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.GELU(),
                                torch.nn.Dropout(0.1), torch.nn.Linear(32, 4)).train()
    reference = copy.deepcopy(model)
    backend = lort.LortBackend({"executor": "auto", "engines": ("ort", "pytorch"), "disk_cache": False},
                               tuner=Tuner(tiny_graph_s=0.0, tiny_inputs_bytes=0))
    compiled = torch.compile(model, backend=backend)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference))
    x = torch.randn(8, 16)
    for step in range(5):
        torch.manual_seed(100 + step)
        loss = compiled(x).pow(2).mean()
        loss.backward()
        torch.manual_seed(100 + step)
        ref_loss = reference(x).pow(2).mean()
        ref_loss.backward()
        if step == 0:
            assert timings == [], "the first training step ran a timing"
            assert "not chosen yet: its first training call ran in eager PyTorch" in str(
                lort.ExplainReport(backend.records))
            assert torch.equal(loss, ref_loss)
            for p, q in zip(model.parameters(), reference.parameters()):
                assert torch.equal(p.grad, q.grad)
        if step == 1:
            assert timings == [["ort", "pytorch"]], timings
        torch.testing.assert_close(loss, ref_loss)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    for a, b in zip(model.state_dict().values(), reference.state_dict().values()):
        torch.testing.assert_close(a, b)
    assert timings == [["ort", "pytorch"]]
    assert "not chosen yet" not in str(lort.ExplainReport(backend.records))
    assert any(set(r.executor_times) >= {"ort", "pytorch"} for r in backend.records), \
        [r.executor_times for r in backend.records]
