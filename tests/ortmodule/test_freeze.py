"""Frozen weights (Options.freeze): an inference graph's parameters and buffers become
ORT initializers, and every route by which a weight can change after compiling is seen
on the next call, against eager PyTorch on the same inputs."""

from __future__ import annotations

import copy

import pytest
import torch

import lort
from lort.backend import LortBackend

OPTS = {"executor": "ort", "disk_cache": False, "progress": False}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8 * 6 * 6, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def _compiled(model, **options):
    backend = LortBackend({**OPTS, **options})
    return torch.compile(model, backend=backend), backend


def _groups(backend):
    return [m for r in backend.records for m in r.group_modules.values()]


def _check(cm, model, x):
    with torch.no_grad():
        torch.testing.assert_close(cm(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.fixture
def net():
    torch.manual_seed(0)
    model = Net().eval()
    with torch.no_grad():  # running stats that are not the defaults
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 1.5)
    return model, torch.randn(2, 3, 8, 8)


def test_inference_weights_become_initializers(net):
    model, x = net
    cm, backend = _compiled(model)
    _check(cm, model, x)
    report = lort.ExplainReport(backend.records)
    (group,) = report.groups
    assert group.frozen == 8  # conv (2), bn (weight, bias and the two running stats), fc (2)
    assert group.num_inputs - group.frozen == 1  # the activation alone goes to ORT
    assert "frozen" in str(report)


def test_lort_keeps_no_copy_of_the_frozen_model():
    """The model bytes lort keeps take the weights as inputs (a model with the weights
    in it goes to ORT once, to build the session, and is not kept)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 512)).eval()
    x = torch.randn(2, 512)
    cm, backend = _compiled(model)
    _check(cm, model, x)
    (mod,) = _groups(backend)
    assert mod.frozen_count == 4
    weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert len(mod.model_bytes) < weight_bytes / 100


def test_freeze_false_keeps_weights_as_inputs(net):
    model, x = net
    cm, backend = _compiled(model, freeze=False)
    _check(cm, model, x)
    (group,) = lort.ExplainReport(backend.records).groups
    assert group.frozen == 0


def _optimizer_changes(net, **options):
    model, x = net
    cm, backend = _compiled(model, record_ort_graph=True, **options)
    _check(cm, model, x)
    report = lort.ExplainReport(backend.records)
    (group,) = report.groups
    return group.ort_optimizer, str(report)


def test_explain_shows_the_fusions_ort_applied_to_frozen_weights(net):
    """ORT's NCHWc convolution (and the folding of the batch norm into it) needs the
    filter as a constant initializer: with frozen weights ORT rewrites the conv, with
    the weights as inputs it cannot, and the report says which."""
    frozen, text = _optimizer_changes(net)
    assert any(d > 0 and "Conv" in op for op, d in frozen.items()), frozen
    assert frozen.get("Conv", 0) < 0 and frozen.get("BatchNormalization", 0) <= 0, frozen
    assert "ORT's optimizer: +" in text
    as_inputs, _ = _optimizer_changes(net, freeze=False)
    assert not any(d > 0 and "Conv" in op for op, d in as_inputs.items()), as_inputs


def test_lort_explain_records_ort_fusions(net, tmp_path):
    model, x = net
    with torch.no_grad():
        report = lort.explain(model, x)
    assert any(g.ort_optimizer for g in report.groups)
    assert "ORT's optimizer:" in str(report)
    report.save_html(str(tmp_path / "report.html"))
    assert "ORT's optimizer:" in (tmp_path / "report.html").read_text()


def _in_place(model):
    with torch.no_grad():
        model.conv.weight.mul_(1.5)


def _plus_equals(model):
    with torch.no_grad():
        model.fc.bias += 0.25


def _copy(model):
    with torch.no_grad():
        model.conv.bias.copy_(torch.randn(8))


def _load_state_dict(model):
    model.load_state_dict({k: v * 1.1 if v.is_floating_point() else v for k, v in model.state_dict().items()})


def _buffer_update(model):
    model.bn.running_mean.add_(0.3)


def _new_parameter(model):
    model.fc.weight = torch.nn.Parameter(torch.randn_like(model.fc.weight))


def _set_data(model):
    model.fc.weight.data = torch.randn_like(model.fc.weight)


def _data_write(model):
    model.conv.weight.data.mul_(0.5)


def _numpy_write(model):
    model.fc.weight.detach().numpy()[:] *= 2.0


ROUTES = [_in_place, _plus_equals, _copy, _load_state_dict, _buffer_update, _new_parameter, _set_data,
          _data_write, _numpy_write]


@pytest.mark.parametrize("freeze", ["auto", False], ids=["frozen", "unfrozen"])
@pytest.mark.parametrize("route", ROUTES, ids=lambda f: f.__name__.strip("_"))
def test_a_weight_change_is_seen_on_the_next_call(net, route, freeze):
    model, x = net
    cm, backend = _compiled(model, freeze=freeze)
    _check(cm, model, x)
    route(model)
    _check(cm, model, x)
    _check(cm, model, x)  # and again, from the session frozen with the new values
    frozen = sum(m.frozen_count for m in _groups(backend))
    assert frozen > 0 if freeze else frozen == 0  # frozen with the new weights, or inputs throughout


def test_writes_behind_the_version_counter_need_freeze_auto(net):
    """freeze=True checks identity, data pointer and version only: a write through
    ``.data`` is documented as unseen there; "auto" (the default) sees it."""
    model, x = net
    cm, backend = _compiled(model, freeze=True)
    _check(cm, model, x)
    _in_place(model)  # bumps the version counter: seen by freeze=True too
    _check(cm, model, x)
    assert lort.Options().freeze == "auto"


def test_an_optimizer_step_between_eval_calls(net):
    model, x = net
    ref = copy.deepcopy(model)
    cm, backend = _compiled(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for step in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            m.train()
            o.zero_grad()
            m(x).pow(2).mean().backward()  # eager training steps
            o.step()
            m.eval()
        with torch.no_grad():
            torch.testing.assert_close(cm(x), ref(x), rtol=1e-5, atol=1e-5)


def test_a_module_moved_to_another_dtype(net):
    model, x = net
    cm, backend = _compiled(model)
    _check(cm, model, x)
    model.double()
    with torch.no_grad():
        torch.testing.assert_close(cm(x.double()), model(x.double()), rtol=1e-9, atol=1e-9)


def test_a_buffer_the_graph_updates_stays_correct_and_is_unfrozen(net):
    """Batch norm in training mode under no_grad updates its running stats on every
    call: results follow eager's, and after two quick changes the weights go to ORT as
    inputs instead of being frozen again on every call."""
    model, x = net
    model.train()
    ref = copy.deepcopy(model)
    cm, backend = _compiled(model)
    for _ in range(4):
        with torch.no_grad():
            torch.testing.assert_close(cm(x), ref(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean, rtol=1e-5, atol=1e-6)
    assert all(m.frozen_count == 0 for m in _groups(backend))


def test_frozen_weights_do_not_count_towards_max_group_args():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)]).eval()
    x = torch.randn(4, 16)
    counts = {}
    for freeze in ("auto", False):
        torch._dynamo.reset()
        cm, backend = _compiled(model, freeze=freeze, max_group_args=6)
        _check(cm, model, x)
        counts[freeze] = len(lort.ExplainReport(backend.records).groups)
    assert counts["auto"] == 1 and counts[False] > 1, counts


def test_ortmodule_in_eval_mode_freezes(net):
    model, x = net
    om = lort.ORTModule(model, options=OPTS)
    om.eval()
    with torch.no_grad():
        torch.testing.assert_close(om(x), model(x), rtol=1e-5, atol=1e-5)
        _in_place(model)
        torch.testing.assert_close(om(x), model(x), rtol=1e-5, atol=1e-5)
    groups = lort.ExplainReport(om.transition_manager.records).groups
    assert groups and all(g.frozen > 0 for g in groups)


def test_training_graphs_are_not_frozen(net):
    model, x = net
    model.train()
    cm, backend = _compiled(model)
    cm(x).sum().backward()
    assert all(g.frozen == 0 for g in lort.ExplainReport(backend.records).groups)


def test_bad_freeze_value_is_a_clear_error(monkeypatch):
    with pytest.raises(ValueError, match="freeze='yes'"):
        lort.Options(freeze="yes")
    monkeypatch.setenv("LORT_FREEZE", "0")
    assert lort.Options().freeze is False
    monkeypatch.setenv("LORT_FREEZE", "auto")
    assert lort.Options().freeze == "auto"


def test_a_warm_compile_freezes_the_current_weights(net, tmp_path):
    """The disk cache keeps a frozen group's plain model and choices, not its weights:
    a warm compile after the weights changed freezes the new ones."""
    model, x = net
    opts = {"disk_cache": True, "cache_dir": str(tmp_path)}
    cm, cold = _compiled(model, **opts)
    _check(cm, model, x)
    _in_place(model)
    torch._dynamo.reset()
    cm, warm = _compiled(model, **opts)
    _check(cm, model, x)
    mods = _groups(warm)
    assert mods and all(m.from_cache and m.frozen_count > 0 for m in mods)


def test_warm_compiles_and_refreezes_run_the_model_the_cold_compile_ran(net, tmp_path, monkeypatch):
    """The frozen session's model is the ORT-fused one (onnxscript's rewrites ran on it,
    although no named rewrite fires): a warm compile and a re-freeze after a weight
    change build that model again, not the plain translation (they did, and ran slower:
    the cnn benchmark took 0.63 ms warm against 0.27 ms cold)."""
    import lort.runtime.session as session_mod
    from lort.ort_model import model_bytes

    built = []
    create = session_mod.create_session
    monkeypatch.setattr(session_mod, "create_session", lambda b, *a, **k: built.append(b) or create(b, *a, **k))
    model, x = net
    opts = {"disk_cache": True, "cache_dir": str(tmp_path)}
    cm, cold = _compiled(model, **opts)
    _check(cm, model, x)
    (mod,) = _groups(cold)
    assert mod.compiled.fused and mod.fusions == {}
    cold_model = built[-1]
    torch._dynamo.reset()
    built.clear()
    cm, warm = _compiled(model, **opts)
    _check(cm, model, x)
    (mod,) = _groups(warm)
    assert mod.from_cache and mod.compiled.fused
    assert [model_bytes(b) for b in built] == [model_bytes(cold_model)]
    built.clear()
    _in_place(model)
    _check(cm, model, x)
    assert mod.refreezes == 1 and len(built) == 1
    # The same model, with the new weights (the small ones are in its bytes).
    assert len(model_bytes(built[0])) == len(model_bytes(cold_model))


def test_inference_mode_freezes_and_sees_changes(net):
    model, x = net
    cm, backend = _compiled(model)
    with torch.inference_mode():
        torch.testing.assert_close(cm(x), model(x), rtol=1e-5, atol=1e-5)
        _in_place(model)
        torch.testing.assert_close(cm(x), model(x), rtol=1e-5, atol=1e-5)
        _data_write(model)
        torch.testing.assert_close(cm(x), model(x), rtol=1e-5, atol=1e-5)
    assert sum(m.frozen_count for m in _groups(backend)) > 0


def test_timing_on_the_first_call_does_not_freeze_again(net):
    """executor="auto" times the whole graph on clones of its inputs (the buffers among
    them): those runs use the frozen session as it is. Only one session lives per group."""
    from lort.compile.tuner import Tuner

    class LortWins(Tuner):  # the real timing runs; lort's graph is kept whatever it measured
        def time_graph(self, candidates, example_inputs):
            assert super().time_graph(candidates, example_inputs) is not None
            return {"ort": 0.5, "pytorch": 1.0}

    model, x = net
    backend = LortBackend({**OPTS, "executor": "auto"}, tuner=LortWins(tiny_inputs_bytes=0))  # the timed path
    cm = torch.compile(model, backend=backend)
    for _ in range(3):
        _check(cm, model, x)
    assert _groups(backend)
    for mod in _groups(backend):
        assert mod.refreezes == 0
        assert mod.compiled.session is None  # the group does not keep the compile-time session
        assert len(mod._frozen_sessions) + len(mod.sessions) <= 1


def test_a_replaced_parameter_is_not_kept_alive_by_lort(net):
    import gc
    import weakref

    model, x = net
    cm, backend = _compiled(model)
    _check(cm, model, x)
    old = weakref.ref(model.fc.weight)
    _new_parameter(model)
    _check(cm, model, x)
    gc.collect()
    assert old() is None


def test_auto_freezes_only_what_it_can_sample():
    """freeze="auto" guards writes behind the version counter by sampling an element in
    CPU memory; a weight elsewhere (a meta tensor stands in for CUDA here; tests/cuda/test_cuda.py
    runs the real case) stays an input under "auto", with the reason, and is frozen with
    freeze=True."""
    from lort.compile import freezing
    from lort.runtime.compiled import Boundary

    meta = torch.device("meta")
    weights = {0: ("fc.weight", torch.empty(4, 4, device=meta))}
    boundary = Boundary(in_perms=(None, None), out_inverse=(None,), restride=(None,), outputs=(), dynamic=False)
    frozen, kept = freezing.choose(weights, boundary, meta, auto=True)
    assert frozen == () and len(kept) == 1
    (why,) = kept
    assert "freeze='auto' cannot see writes" in why and "freeze=True freezes it" in why
    frozen, kept = freezing.choose(weights, boundary, meta, auto=False)
    assert [w.name for w in frozen] == ["fc.weight"] and kept == {}


@pytest.mark.parametrize(
    "tensor",
    [
        torch.full((3, 4), float("nan")),  # no finite element: the first is sampled, by its bits
        torch.tensor([1.0, float("inf"), -5.0]),
        torch.randn(3, 4).half(),
        torch.randn(3, 4).bfloat16(),
        torch.randn(4, 3).t(),  # not contiguous: read through NumPy
        torch.arange(6) - 2,
        torch.arange(1, 7, dtype=torch.uint8),
    ],
    ids=["all-nan", "inf", "float16", "bfloat16", "transposed", "int64", "uint8"],
)
def test_the_sampled_element_sees_a_write_behind_the_version_counter(tensor):
    from lort.runtime.frozen import FrozenWeight, WeightGuard

    guard = WeightGuard((FrozenWeight(0, "w", tensor),), sample=True)
    assert guard.changed([tensor]) is None
    version = tensor._version
    tensor.data.fill_(7)  # through .data: no version bump
    assert tensor._version == version
    assert guard.changed([tensor]) == "w"
    guard.reset([tensor])
    assert guard.changed([tensor]) is None


class PoolNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x):
        return self.conv2(torch.nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)).mean((2, 3))


def test_max_pool_keeps_orts_blocked_layout_between_convolutions():
    """lort's max_pool NaN and -inf fix (capture/decompositions/__init__.py) is built of ops ORT
    keeps in its blocked (NCHWc) layout: the frozen graph leaves that layout once, at the
    end, as the whole model exported to ORT does (a select on the pooled values took it
    out and back). After a ReLU the correction is one convolution into which ORT folds
    its add to the pooled values: no Add is left."""
    torch.manual_seed(0)
    model = PoolNet().eval()
    x = torch.randn(1, 3, 16, 16)
    cm, backend = _compiled(model, record_ort_graph=True)
    _check(cm, model, x)
    (group,) = lort.ExplainReport(backend.records).groups
    assert group.ort_optimizer.get("com.microsoft.nchwc:ReorderOutput") == 1, group.ort_optimizer
    assert group.ort_optimizer.get("com.microsoft.nchwc:MaxPool") == 1, group.ort_optimizer
    assert group.ort_optimizer.get("com.microsoft.nchwc:Conv") == 3, group.ort_optimizer
    assert group.ort_optimizer.get("Add") == -1, group.ort_optimizer  # the one Add, removed


class CachedBias(torch.nn.Module):
    """Keeps tensors in plain attributes, as timm's LeViT caches its attention biases in a
    dict attribute in eval mode: module state, not parameters or buffers."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.cache = {"cpu": torch.randn(8)}
        self.scale = torch.full((8,), 0.5)

    def forward(self, x):
        return self.fc(x) * self.scale + self.cache["cpu"]


def test_tensors_a_module_keeps_in_attributes_are_frozen_and_their_changes_seen():
    torch.manual_seed(0)
    model, x = CachedBias().eval(), torch.randn(4, 8)
    cm, backend = _compiled(model)
    _check(cm, model, x)
    (group,) = _groups(backend)
    assert group.frozen_count == 4  # fc's weight and bias, the dict's tensor and the plain attribute
    assert len(group._live) == 1  # the activation alone goes to ORT
    # Each change is seen on the next call (two calls each: a change on every call
    # leaves the weights as inputs, test_a_buffer_the_graph_updates...).
    for change in (lambda: model.cache["cpu"].mul_(2), lambda: model.cache.update(cpu=torch.randn(8)),
                   lambda: model.scale.fill_(3.0)):
        change()
        _check(cm, model, x)
        _check(cm, model, x)
    assert group.refreezes == 3 and group.frozen_count == 4


def test_two_instances_of_a_model_keep_their_own_frozen_weights():
    """One backend (as backend="lort" is) for two instances of a class: Dynamo would reuse
    the first instance's graph for the second, whose weights then differed from the
    frozen ones on every call (frozen again, then left as inputs). Each gets its graph."""
    torch.manual_seed(0)
    models = [Net().eval(), Net().eval()]
    x = torch.randn(2, 3, 8, 8)
    backend = LortBackend(OPTS)
    compiled = [torch.compile(m, backend=backend) for m in models]
    for _ in range(3):
        for cm, model in zip(compiled, models):
            _check(cm, model, x)
    groups = _groups(backend)
    assert len(backend.records) == 2 and len(groups) == 2
    assert all(g.frozen_count == 8 and g.refreezes == 0 for g in groups)


class ScaledNorm(torch.nn.Module):
    """Python float attributes, as a norm's epsilon and an attention's scaling: under
    ``dynamic=True`` Dynamo passes each as a 0-d float64 tensor made anew on every call."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.eps = 1e-6
        self.scaling = 0.125

    def forward(self, x):
        y = self.fc(x) * self.scaling
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)


def test_python_numbers_dynamo_passes_as_tensors_are_not_frozen():
    """Were they frozen, every call would find them changed (a new tensor each time),
    freeze the model again and at last leave all its weights as inputs."""
    torch.manual_seed(0)
    model = ScaledNorm().eval()
    backend = LortBackend(OPTS)
    cm = torch.compile(model, backend=backend, dynamic=True)
    for rows in (3, 5, 7, 9):
        _check(cm, model, torch.randn(rows, 8))
    groups = _groups(backend)
    assert groups and all(g.frozen_count == 2 and g.refreezes == 0 for g in groups)  # fc's weight and bias
