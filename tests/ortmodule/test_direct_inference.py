"""lort.ORTModule's direct inference (Options.direct_inference, module/direct.py): no-grad
calls captured by torch.export and run without Dynamo, checked against eager PyTorch on
the same inputs after every route by which the module can change."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from test_freeze import ROUTES, Net

import lort
from lort.testing.models import CASES, output_tensor

OPTS = {"executor": "ort", "disk_cache": False, "progress": False}


@pytest.fixture
def net():
    torch.manual_seed(0)
    model = Net().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 1.5)
    return model, torch.randn(2, 3, 8, 8)


def _check(om, model, *args, tol=1e-5):
    with torch.no_grad():
        torch.testing.assert_close(om(*args), model(*args), rtol=tol, atol=tol)


def _entry(om):
    """The schema entry of the last no-grad call."""
    return [e for e in om.transition_manager.entries.values() if not e.key.grad_enabled][-1]


def _direct(om) -> bool:
    """Whether the module's no-grad calls ran through an exported graph (no Dynamo)."""
    entry = _entry(om)
    return bool(entry.runners) and entry.direct_refused is None


def test_no_grad_calls_run_an_exported_graph_without_dynamo(net):
    model, x = net
    om = lort.ORTModule(model, options=OPTS)
    torch._dynamo.reset()
    frames = dict(torch._dynamo.utils.counters["frames"])
    _check(om, model, x)
    _check(om, model, x)
    with torch.inference_mode():
        torch.testing.assert_close(om(x), model(x), rtol=1e-5, atol=1e-5)
    assert _direct(om)
    assert dict(torch._dynamo.utils.counters["frames"]) == frames  # Dynamo saw no frame
    (group,) = lort.ExplainReport(om.transition_manager.records).groups
    assert group.frozen == 8 and group.num_inputs - group.frozen == 1


@pytest.mark.parametrize("freeze", ["auto", False], ids=["frozen", "unfrozen"])
@pytest.mark.parametrize("route", ROUTES, ids=lambda f: f.__name__.strip("_"))
def test_a_weight_change_is_seen_on_the_next_call(net, route, freeze):
    model, x = net
    om = lort.ORTModule(model, options={**OPTS, "freeze": freeze})
    _check(om, model, x)
    route(model)
    _check(om, model, x)
    _check(om, model, x)
    assert _direct(om)


def test_training_steps_through_ortmodule_between_eval_calls(net):
    """Train steps through ORTModule's Dynamo path, eval calls through the direct one,
    against the same steps in eager PyTorch."""
    model, x = net
    ref = copy.deepcopy(model)
    om = lort.ORTModule(model, options=OPTS)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for _ in range(3):
        for m, o in ((om, opt), (ref, ref_opt)):
            m.train()
            o.zero_grad()
            loss = m(x).pow(2).mean()
            loss.backward()
            o.step()
            m.eval()
        _check(om, ref, x)
    assert _direct(om)


def test_a_moved_weight_with_other_strides_is_exported_again(net):
    model, x = net
    om = lort.ORTModule(model, options=OPTS)
    _check(om, model, x)
    model.fc.weight.data = torch.randn(model.fc.weight.shape[::-1]).t()  # same shape, transposed strides
    _check(om, model, x)
    reasons = [c.reason for c in om.transition_manager.captures]
    assert any("weight fc.weight changed" in r and "exported again" in r for r in reasons), reasons


def test_module_converted_to_double(net):
    model, x = net
    om = lort.ORTModule(model, options=OPTS)
    _check(om, model, x)
    om.double()
    _check(om, model, x.double(), tol=1e-9)
    assert _direct(om)


def test_input_shapes_each_get_an_exported_graph(net):
    model, x = net
    om = lort.ORTModule(model, options=OPTS)
    for batch in (2, 5, 2, 5):
        _check(om, model, torch.randn(batch, 3, 8, 8))
    _check(om, model, torch.randn(4, 3, 8, 8).transpose(2, 3))  # other strides
    entry = _entry(om)
    assert len(entry.runners) == 3
    reasons = [c.reason for c in om.transition_manager.captures]
    assert any("shape changed (2, 3, 8, 8) -> (5, 3, 8, 8)" in r for r in reasons), reasons


class Settings:
    def __init__(self):
        self.scale = 2.0
        self.shift = True


class Configured(torch.nn.Module):
    """Reads a plain attribute of its own and the attributes of an object it holds
    (as Hugging Face models read their config)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.settings = Settings()
        self.power = 1
        self.offset = torch.ones(4)  # a tensor attribute, not a buffer

    def forward(self, x):
        y = self.fc(x) * self.settings.scale + self.offset
        if self.settings.shift:
            y = y + 1
        return y ** self.power


def test_attribute_changes_are_seen():
    torch.manual_seed(0)
    model = Configured().eval()
    x = torch.randn(3, 4)
    om = lort.ORTModule(model, options=OPTS)
    _check(om, model, x)
    model.settings.scale = 3.0
    _check(om, model, x)
    model.settings.shift = False
    _check(om, model, x)
    model.power = 2
    _check(om, model, x)
    model.settings = Settings()
    _check(om, model, x)
    model.offset.mul_(3)
    _check(om, model, x)
    model.offset = torch.full((4,), -2.0)
    _check(om, model, x)
    reasons = [c.reason for c in om.transition_manager.captures]
    assert any("an attribute of settings changed" in r for r in reasons), reasons
    assert any("module attribute 'power' changed 1 -> 2" in r for r in reasons), reasons
    assert "attribute settings replaced (exported again)" in reasons
    # The replaced tensor attribute (same dtype, shape and strides) is run on as it is.
    assert not any("offset" in r for r in reasons), reasons


def test_a_graph_that_updates_buffers_goes_through_dynamo(net):
    """Batch norm in training mode under no_grad writes its running stats: torch.export's
    graph would have to write them back, so the call takes the Dynamo path."""
    model, x = net
    model.train()
    ref = copy.deepcopy(model)
    om = lort.ORTModule(model, options=OPTS)
    for _ in range(3):
        _check(om, ref, x)
        torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean, rtol=1e-5, atol=1e-6)
    entry = _entry(om)
    assert "writes" in entry.direct_refused and "running_mean" in entry.direct_refused


class NumpyInForward(torch.nn.Module):
    """torch.export cannot trace NumPy calls on fake tensors; Dynamo can."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.from_numpy(np.tanh(self.fc(x).numpy())) + 1


def test_a_module_export_refuses_goes_through_dynamo():
    torch.manual_seed(0)
    model = NumpyInForward().eval()
    x = torch.randn(2, 4)
    om = lort.ORTModule(model, options=OPTS)
    _check(om, model, x)
    _check(om, model, x)
    assert _entry(om).direct_refused.startswith("torch.export failed")
    assert om.transition_manager.records  # compiled by the Dynamo path


def test_direct_inference_off_and_autocast_use_dynamo(net):
    model, x = net
    om = lort.ORTModule(model, options={**OPTS, "direct_inference": False})
    _check(om, model, x)
    assert not _entry(om).runners
    om = lort.ORTModule(model, options=OPTS)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        torch.testing.assert_close(om(x), model(x), rtol=2e-2, atol=2e-2)
    assert not _entry(om).runners
    with pytest.raises(ValueError, match="direct_inference='yes'"):
        lort.Options(direct_inference="yes")


class Holder:
    """An object a forward returns, holding a tensor (as transformers' DynamicCache does)."""

    def __init__(self, t):
        self.t = t


class ReturnsHolder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return y, Holder(y * 2)


def test_an_output_object_holding_tensors_goes_through_dynamo():
    """Such an object is a constant of the output's structure: made while tracing, its
    tensors would be torch.export's fake ones. Dynamo rebuilds it on every call."""
    torch.manual_seed(0)
    model = ReturnsHolder().eval()
    x = torch.randn(2, 4)
    om = lort.ORTModule(model, options=OPTS)
    with torch.no_grad():
        (y, held), (ref_y, ref_held) = om(x), model(x)
    torch.testing.assert_close(y, ref_y)
    assert type(held.t) is torch.Tensor
    torch.testing.assert_close(held.t, ref_held.t)
    assert "the output holds a Holder" in _entry(om).direct_refused


@pytest.mark.parametrize("name", ["bert", "mobilenetv3"])
def test_real_models_match_eager(name):
    model, args = CASES[name].make(2)
    model.eval()
    om = lort.ORTModule(copy.deepcopy(model), options=OPTS)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(output_tensor(om(*args)), output_tensor(model(*args)), rtol=1e-4, atol=1e-4)
    assert _direct(om)


def test_a_llama_without_cache_matches_eager():
    """LlamaModel without a KV cache exports (with one, its DynamicCache output sends the
    call to Dynamo) and passes SDPA a boolean causal mask: its math form took the mask as
    0 and 1 to add, and the direct path's hidden states were off by up to 3.2."""
    from lort.testing.models import llama

    model, args = llama(batch=2, seq=16)
    model.config.use_cache = False
    model.eval()
    om = lort.ORTModule(copy.deepcopy(model), options=OPTS)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(output_tensor(om(*args)), output_tensor(model(*args)), rtol=1e-4, atol=1e-4)
    assert _direct(om)


@pytest.mark.parametrize("mask, causal", [("bool", False), ("float", False), (None, False), (None, True)])
@pytest.mark.parametrize("gqa", [False, True])
def test_sdpa_math_form_matches_sdpa(mask, gqa, causal):
    from lort.capture import export

    torch.manual_seed(0)
    q = torch.randn(2, 8, 6, 16)
    k, v = torch.randn(2, 2 if gqa else 8, 6, 16), torch.randn(2, 2 if gqa else 8, 6, 16)
    m = None
    if mask == "bool":
        m = torch.rand(2, 1, 6, 6) > 0.3
        m[..., 0] = True  # no row without a key
    elif mask == "float":
        m = torch.randn(2, 1, 6, 6)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, m, is_causal=causal, scale=0.3, enable_gqa=gqa)
    got = export._sdpa_math(q, k, v, m, is_causal=causal, scale=0.3, enable_gqa=gqa)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_gpt2_exports_with_attention_in_its_math_form():
    """SDPA is decomposed to its math form, as in the Dynamo path: decomposing the
    flash-attention kernel torch.export picks gave other strides, and GPT-2's export then
    failed in a view."""
    from lort.capture import export
    from lort.fusion import support
    from lort.module import direct, io

    model, args = CASES["gpt2"].make(2)
    flat, spec = io.flatten_call(args, {}, [])
    table = export.decomposition_table(False, support.implemented_overload_names())
    graph = export.export_inference(direct._Flat(model.eval(), spec), flat, table, prefix="m.")
    targets = {str(n.target) for n in graph.gm.graph.nodes if n.op == "call_function"}
    assert not any("scaled_dot_product" in t for t in targets), targets


def test_a_graph_timed_slower_than_eager_runs_the_module_itself(net, monkeypatch):
    """executor="auto" chose eager PyTorch for the whole graph: later calls run the
    module directly (no weight checks to pay), and still see every change."""
    from lort.compile.tuner import Tuner
    from lort.reasons import Placement

    monkeypatch.setattr(Tuner, "choose_graph_executor", lambda self, times: Placement.PYTORCH)
    # The timed path, not the small-graph shortcut (test_call_floor.py).
    monkeypatch.setattr(Tuner, "time_tiny_eager", lambda self, eager, example_inputs: None)
    model, x = net
    om = lort.ORTModule(model, options={**OPTS, "executor": "auto"})
    _check(om, model, x)
    runner = _entry(om).runner
    assert runner.runs_eager
    calls = []
    monkeypatch.setattr(runner, "_call", lambda *a: calls.append(1))  # the graph path is not taken
    _check(om, model, x)
    with torch.no_grad():
        model.fc.weight.mul_(-1)
    _check(om, model, x)
    assert calls == [] and _direct(om)


class HoldsTensor(torch.nn.Module):
    """Reads a tensor held by a plain object it holds (not a buffer, not its own)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.settings = Settings()
        self.settings.bias = torch.ones(4)

    def forward(self, x):
        return self.fc(x) + self.settings.bias


def test_a_tensor_an_object_holds_is_seen():
    torch.manual_seed(0)
    model = HoldsTensor().eval()
    x = torch.randn(3, 4)
    om = lort.ORTModule(model, options=OPTS)
    _check(om, model, x)
    model.settings.bias = torch.full((4,), -3.0)  # replaced: no module attribute set
    _check(om, model, x)
    model.settings.bias.mul_(2)
    _check(om, model, x)
    model.settings.bias = torch.zeros(1, 4)  # another shape (broadcast): exported again
    _check(om, model, x)
    assert _direct(om)
