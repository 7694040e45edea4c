"""executor="auto" with inductor among the engines (compile/engines.py): the graph starts
on lort's graph or eager PyTorch, inductor compiles in its subprocess after the first
call, and the faster is kept. Each run is checked against eager PyTorch and a float64
reference (tests/ortmodule/test_ortmodule.py's budgets), over several optimizer steps."""

import copy
import time
import warnings

import pytest
import torch
from torch import nn

import lort
from lort import LortBackend
from lort.compile import engines, inductor_compat
from lort.compile.tuner import Tuner
from lort.reasons import Placement
from test_ortmodule import assert_close_to_reference

AUTO = {"executor": "auto", "engines": ("ort", "pytorch", "inductor"), "disk_cache": False}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8))

    def forward(self, x):
        return self.net(x)


class Timed(Tuner):
    """Whole-graph timings fixed by candidate name (lort's graph vs eager on the first
    call, then the running placement vs inductor); the real timing runs first."""

    fixed = {"ort": 1e-3, "pytorch": 2e-3, "inductor": 0.5e-3}

    def time_graph(self, candidates, example_inputs):
        assert super().time_graph(candidates, example_inputs)
        return {name: self.fixed[name] for name in candidates}


def _switch(backend):
    switches = [ref() for ref in backend.switches if ref() is not None]
    assert len(switches) == 1, switches
    return switches[0]


def _train(model, step_fn, steps, x, y):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for i in range(steps):
        loss = nn.functional.mse_loss(step_fn(i)(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _until_settled(compiled, backend, x, timeout=600.0):
    """Calls (no grad) until the switch has chosen its engine."""
    with torch.no_grad():
        compiled(x)  # the first call compiles
    switch = _switch(backend)
    start = time.perf_counter()
    while switch.engine is None:
        assert time.perf_counter() - start < timeout, "inductor's compile did not finish"
        with torch.no_grad():
            compiled(x)
        time.sleep(0.05)
    return switch


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def test_training_swaps_to_inductor_mid_run_and_matches_eager(data):
    """Ten AdamW steps: the first ones through lort (timed faster than eager), then,
    once inductor is ready and timed faster, through inductor; each step's loss and the
    final weights against eager and float64."""
    x, y = data
    torch.manual_seed(0)
    model = Net()
    eager, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    backend = LortBackend(AUTO, tuner=Timed())
    compiled = torch.compile(model, backend=backend)
    engines_seen = []

    def step(i):
        if i == 3:  # the first steps ran on lort's graph; wait for inductor here
            switch = _switch(backend)
            assert switch.engine is None
            assert switch.waiting.startswith("inductor's compile running for "), switch.waiting
            while not switch._job.ready():
                time.sleep(0.05)

        def call(inp):
            out = compiled(inp)
            engines_seen.append(_switch(backend).engine)  # the engine after this step's forward
            return out
        return call

    ours = _train(model, step, 10, x, y)
    theirs = _train(eager, lambda i: eager, 10, x, y)
    exact = _train(ref, lambda i: ref, 10, x.double(), y.double())
    for i, (a, b, r) in enumerate(zip(ours, theirs, exact)):
        assert_close_to_reference(a, b, r, f"loss at step {i}")
    for (name, p), pe, pr in zip(model.named_parameters(), eager.parameters(), ref.parameters()):
        assert_close_to_reference(p.detach(), pe.detach(), pr.detach(), f"weight {name} after 10 steps")
    assert engines_seen == [None] * 3 + ["inductor"] * 7, engines_seen
    assert _switch(backend).waiting is None
    assert {r.kind: r.executor for r in backend.records} == {"forward": Placement.INDUCTOR,
                                                             "backward": Placement.INDUCTOR}
    text = str(lort.ExplainReport(backend.records))
    assert "graphs run whole in inductor:" in text and "0.500 ms inductor" in text, text


def test_inductor_timed_slower_keeps_lorts_graph_and_is_remembered(data, tmp_path):
    x, _ = data
    opts = {**AUTO, "disk_cache": True, "cache_dir": str(tmp_path)}

    class Slower(Timed):
        fixed = {"ort": 1e-3, "pytorch": 2e-3, "inductor": 3e-3}

    model = Net()
    backend = LortBackend(opts, tuner=Slower())
    compiled = torch.compile(model, backend=backend)
    switch = _until_settled(compiled, backend, x)
    assert switch.engine == "ort"
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    assert all(r.executor == Placement.ORT and r.executor_times.get("inductor") == 3e-3 for r in backend.records)
    torch._dynamo.reset()

    class NoTiming(Tuner):
        def time_graph(self, candidates, example_inputs):
            raise AssertionError("a warm compile times nothing")

    warm = LortBackend(opts, tuner=NoTiming())
    with torch.no_grad():
        torch.compile(model, backend=warm)(x)
    assert warm.switches == []  # inductor was timed slower: not compiled again


def test_a_cached_inductor_choice_starts_on_eager_and_swaps_without_timing(data, tmp_path):
    x, _ = data
    opts = {**AUTO, "disk_cache": True, "cache_dir": str(tmp_path)}
    model = Net().eval()
    cold = LortBackend(opts, tuner=Timed())
    _until_settled(torch.compile(model, backend=cold), cold, x)
    torch._dynamo.reset()

    class NoTiming(Tuner):
        def time_graph(self, candidates, example_inputs):
            raise AssertionError("the choice is read from the disk cache")

    warm = LortBackend(opts, tuner=NoTiming())
    compiled = torch.compile(model, backend=warm)
    assert _until_settled(compiled, warm, x).engine == "inductor"
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    record, = warm.records
    assert record.executor == Placement.INDUCTOR and "read from the disk cache" in record.fallbacks[0][1]


def test_where_inductor_cannot_compile_one_warning_and_the_others_choose(data, monkeypatch):
    x, _ = data
    monkeypatch.setattr(engines, "_state", {"broken": None})

    def unavailable(gm, example_inputs):
        raise inductor_compat.InductorUnavailable("no C++ compiler (test)")

    monkeypatch.setattr(inductor_compat, "start", unavailable)
    model = Net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            backend = LortBackend(AUTO, tuner=Timed())
            compiled = torch.compile(model, backend=backend)
            for _ in range(3):
                compiled(x).sum().backward()
            torch._dynamo.reset()
    said = [str(w.message) for w in caught if "inductor" in str(w.message)]
    assert len(said) == 1 and "no C++ compiler (test)" in said[0] and "engines=('ort', 'pytorch')" in said[0], said
    assert all(r.executor == Placement.ORT for r in backend.records)
    assert backend.switches == []  # the second backend did not try


def test_inductor_code_that_fails_its_timing_is_dropped_and_explain_says_why(data, monkeypatch, tmp_path, caplog):
    """Inductor compiled, but its code raises on the timing's inputs: the graph goes on in
    the placement that ran, results stay eager's, one WARNING on the lort logger, and
    explain and the HTML report say why inductor was not chosen (it was an INFO line only)."""
    x, y = data

    class Broken:
        def ready(self):
            return True

        def result(self):
            def run(*args):
                raise RuntimeError("a kernel of inductor's code failed (test)")
            return run

    monkeypatch.setattr(inductor_compat, "start", lambda gm, example_inputs: Broken())
    model = Net()
    reference = copy.deepcopy(model)
    backend = LortBackend(AUTO)
    compiled = torch.compile(model, backend=backend)
    losses = _train(model, lambda i: compiled, 4, x, y)
    expected = _train(reference, lambda i: reference, 4, x, y)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-4, atol=1e-5)
    switch = _switch(backend)
    assert switch.engine in ("ort", "pytorch")
    notes = [n for r in backend.records for n in r.engine_notes]
    assert notes and all("inductor compiled it but its timing failed" in n and "(test)" in n for n in notes), notes
    report = lort.ExplainReport(backend.records)
    text = str(report)
    assert "engines not timed:" in text and "a kernel of inductor's code failed (test)" in text, text
    page = report.save_html(str(tmp_path / "lort.html"), layout="networkx")
    assert "Inductor compiled it but its timing failed" in open(page).read()
    warned = [r for r in caplog.records if r.name == "lort" and r.levelname == "WARNING" and "timing failed" in r.message]
    assert len(warned) == 1, warned


def test_a_graph_with_symbolic_sizes_gets_no_inductor_candidate_and_explain_says_why(data):
    """Inductor's engine takes static shapes for now: a dynamic graph is chosen between
    lort's graph and eager PyTorch, and explain names the reason."""
    x, _ = data
    model = Net().eval()
    backend = LortBackend(AUTO)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for rows in (16, 9):
            torch.testing.assert_close(compiled(x[:rows]), model(x[:rows]), rtol=1e-4, atol=1e-5)
    assert backend.switches == []
    notes = [n for r in backend.records for n in r.engine_notes]
    assert notes and all(n == "no inductor candidate: the graph has symbolic sizes (inductor's engine takes "
                         "static shapes for now)" for n in notes), notes
    assert "no inductor candidate: the graph has symbolic sizes" in str(lort.ExplainReport(backend.records))


def test_engines_option_errors_and_leaving_inductor_out(data, monkeypatch):
    for bad in ("inductor", ("ort",), ("ort", "pytorch", "tvm"), ("ort", "ort", "pytorch")):
        with pytest.raises(ValueError, match="engines=.* must be a list of engines from"):
            lort.Options(engines=bad)
    monkeypatch.setenv("LORT_ENGINES", "ort, pytorch ,inductor")
    assert lort.Options().engines == ("ort", "pytorch", "inductor")
    monkeypatch.setenv("LORT_ENGINES", "ort,xla")
    with pytest.raises(ValueError, match="engines=\\('ort', 'xla'\\)"):
        lort.Options()
    x, _ = data
    backend = LortBackend({**AUTO, "engines": ("ort", "pytorch")}, tuner=Timed())
    model = Net()  # alive until its backward has run (lort releases a dropped model's sessions)
    torch.compile(model, backend=backend)(x).sum().backward()
    assert backend.switches == []


def _compiled_in_subprocess(gm, example_inputs):
    """inductor_compat.start on a Dynamo graph, waited for; and fresh copies of its inputs."""
    return _waited(inductor_compat.start(gm, example_inputs), example_inputs)


def _waited(job, example_inputs):
    """A started compile, waited for: its callable, and fresh copies of its inputs."""
    start = time.perf_counter()
    while not job.ready():
        assert time.perf_counter() - start < 600, "inductor's subprocess did not finish"
        time.sleep(0.05)
    inputs = [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
              for a in example_inputs]
    return job.result(), inputs


def test_inductor_compiles_a_transformers_model_in_its_subprocess():
    """compile/inductor_compat.py on a real model: BERT's graph holds prims ops (the
    attention mask's dtype cast) that inductor's pickler refused, and module stacks that
    named transformers' classes (the subprocess imported transformers, and torchvision,
    which fails beside this CPU torch). Its forward and backward against eager."""
    from lort.testing.models import bert, output_tensor

    model, (ids, mask) = bert(batch=2, seq=16, layers=1, hidden=32, heads=2)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    output_tensor(torch.compile(model, backend=capture)(ids, mask)).sum().backward()
    (gm, example_inputs), = graphs
    fn, inputs = _compiled_in_subprocess(gm, example_inputs)
    want = gm(*inputs)
    got = fn(*inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    leaves = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
    grads_got = torch.autograd.grad(got[0].sum(), leaves, allow_unused=True)
    grads_want = torch.autograd.grad(want[0].sum(), leaves, allow_unused=True)
    for g, w in zip(grads_got, grads_want):
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_inductor_compiles_a_convolutional_model_in_its_subprocess():
    """Inductor's layout optimization made the forward save channels-last tensors, while
    its backward, sent to the subprocess before the forward's code existed, expected
    dense ones: every call of a model with convolutions failed inductor's stride check,
    so executor="auto" never timed inductor on ResNet-50 or ViT (benchmarks/results/training.md).
    A ViT-style patch embedding and a convolution stack: forward and backward against
    eager."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 64, 4, stride=4), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(64, 64, 3, padding=1), nn.Flatten(), nn.Linear(64 * 8 * 8, 10))
    x = torch.randn(2, 3, 32, 32)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch.compile(model, backend=capture)(x).sum().backward()
    (gm, example_inputs), = graphs
    fn, inputs = _compiled_in_subprocess(gm, example_inputs)
    got, want = fn(*inputs), gm(*inputs)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    leaves = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
    assert leaves
    grads_got = torch.autograd.grad(got[0].square().sum(), leaves)
    grads_want = torch.autograd.grad(want[0].square().sum(), leaves)
    for g, w in zip(grads_got, grads_want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_inductors_layout_optimization_stays_on_and_the_backward_reads_the_forwards_strides(monkeypatch):
    """Inductor's layout optimization is on for graphs with and without a backward, as
    torch.compile's inductor has it (ResNet-50 inference on 2 cores: 387 against 454 ms
    without it; training, batch 8, AMD family 26: torch.compile's 716 against lort's 809 ms
    with it off). The setting is read as each graph is sent to the subprocess. A training
    graph's backward is sent once the forward's code is back, compiled for the strides that
    code gives the tensors it saves: channels-last around the convolutions. Outputs (values
    and strides) and gradients against eager."""
    from torch._inductor.compile_fx_subproc import _SubprocessFxCompile

    sent = []
    real = _SubprocessFxCompile.serialize_compile

    def spy(self, *args, **kwargs):
        sent.append(torch._inductor.config.layout_optimization)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(_SubprocessFxCompile, "serialize_compile", spy)
    torch.manual_seed(0)
    # A max pool: its backward under layout optimization holds a prims op
    # (_low_memory_max_pool_offsets_to_indices), which the held backward's pickler must take.
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 1)).eval()
    x = torch.randn(2, 3, 16, 16)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    with torch.no_grad():
        want = model(x)
        torch.compile(model, backend=capture)(x)
        (gm, example_inputs), = graphs
        fn, inputs = _compiled_in_subprocess(gm, example_inputs)
        got = fn(*inputs)
    assert sent == [True]
    torch.testing.assert_close(got[0], want, rtol=1e-4, atol=1e-5)
    assert got[0].stride() == want.stride()

    sent.clear()
    torch._dynamo.reset()
    graphs.clear()
    model.train()
    torch.compile(model, backend=capture)(x)
    (gm, example_inputs), = graphs
    job = inductor_compat.start(gm, example_inputs)
    forward, backward = job._pending
    assert backward._future is None  # held until the forward's code is back
    fn, inputs = _waited(job, example_inputs)
    assert sent == [True, True]
    strides = [t.stride() for t in backward._post[0] if isinstance(t, torch.Tensor) and t.dim() == 4]
    assert any(s[1] == 1 for s in strides), strides  # saved channels-last, as the forward made them
    got, want = fn(*inputs), gm(*inputs)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    assert got[0].stride() == want[0].stride()
    leaves = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
    grads_got = torch.autograd.grad(got[0].square().sum(), leaves)
    grads_want = torch.autograd.grad(want[0].square().sum(), leaves)
    for g, w in zip(grads_got, grads_want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_a_long_inference_call_starts_inductor_after_its_choice_over_calls(data, monkeypatch):
    """Where lort's graph and eager PyTorch are timed over the user's calls (a long
    inference call: compile/graph_executor.py), inductor's compile starts only once they
    are chosen between: its subprocess would load the cores they are timed on. Every
    call against eager."""
    from lort.compile.graph_executor import ChooseOnFirstCall

    x, _ = data
    started = []
    real = inductor_compat.start

    def start(gm, example_inputs):
        switch = _switch(backend)
        assert isinstance(switch._current, ChooseOnFirstCall) and switch._current.chosen is not None
        started.append(switch._calls)
        return real(gm, example_inputs)

    monkeypatch.setattr(inductor_compat, "start", start)
    model = Net().eval()
    backend = LortBackend(AUTO, tuner=Timed(graph_budget_s=0.0, tiny_graph_s=0.0))
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    assert started == [] and _switch(backend)._current.chosen is None  # still timing over calls
    switch = _until_settled(compiled, backend, x)
    assert switch.engine == "inductor" and started and started[0] >= 6, started
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
