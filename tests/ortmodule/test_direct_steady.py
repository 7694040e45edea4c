"""ORTModule's steady state of direct inference: the transition manager's lane
(module/direct.py, ``lane``), the group's shortest route (runtime/group.py,
``steady_run``, whose weight guard reads the weights from their modules) and the
wrapper's own ``__call__``. Each call that is not the steady one must leave them for the
full path, and every result must match eager PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
from test_direct_inference import OPTS, _check, _entry, net  # noqa: F401 - net is a fixture

import lort
from lort.module import direct, io
from lort.module.direct import _single_group
from lort.runtime import native
from lort.runtime.group import OrtGroup


def _group(om) -> OrtGroup:
    fn = _entry(om).runner._fn
    (group, *_), = [_single_group(getattr(fn, "chosen", None) or fn)]
    return group


@pytest.fixture
def counts(monkeypatch):
    """How often the manager's full path (flatten_call) and the group's forward past its
    route (_run_ort_or_fall_back) ran."""
    seen = {"flatten": 0, "forward": 0}
    flatten, run = io.flatten_call, OrtGroup._run_ort_or_fall_back

    def counted_flatten(*a, **k):
        seen["flatten"] += 1
        return flatten(*a, **k)

    def counted_run(self, args):
        seen["forward"] += 1
        return run(self, args)

    monkeypatch.setattr(io, "flatten_call", counted_flatten)
    monkeypatch.setattr(OrtGroup, "_run_ort_or_fall_back", counted_run)

    def reset():
        seen.update(flatten=0, forward=0)
        return seen

    return reset


def test_steady_calls_take_the_lane_and_the_groups_route(net, counts):  # noqa: F811
    model, x = net
    om = lort.ORTModule(model, options=OPTS)
    _check(om, model, x)
    runner = _entry(om).runner
    assert runner._steady is not None  # BatchNorm's num_batches_tracked, unread, does not block it
    seen = counts()
    for _ in range(3):
        _check(om, model, x)
    assert seen == {"flatten": 0, "forward": 0}
    _check(om, model, x.clone())  # other tensors of the same shape: the same lane
    assert seen == {"flatten": 0, "forward": 0}


def test_a_weight_changed_in_place_is_frozen_again_then_the_route_serves(net, counts):  # noqa: F811
    model, x = net
    om = lort.ORTModule(model, options=OPTS)
    _check(om, model, x)
    group = _group(om)
    seen = counts()
    with torch.no_grad():
        model.fc.weight.mul_(-2)
    _check(om, model, x)
    assert seen["forward"] == 1  # the route declined: the group's forward froze the weights again
    assert group.refreezes == 1
    seen = counts()
    _check(om, model, x)
    _check(om, model, x)
    assert seen == {"flatten": 0, "forward": 0}


@pytest.mark.parametrize("cpp", [True, False], ids=["cpp-check", "python-check"])
def test_the_route_reads_each_weight_from_its_module(net, counts, monkeypatch, cpp):  # noqa: F811
    """The route's weight guard reads the weights from their modules' registries (in C++
    where runtime/native.py built it): a registry written directly (as
    torch.func.functional_call does) and a write behind the version counter are seen on
    the next call, then the route serves again."""
    if cpp and native.load() is None:
        pytest.skip("the C++ check is not built here (python -m lort.runtime.build_native)")
    if not cpp:
        monkeypatch.setattr(native, "load", lambda: None)
    model, x = net
    om = lort.ORTModule(model, options=OPTS)
    _check(om, model, x)
    assert (_group(om)._guard.registered_check is not None) == cpp
    model.fc._parameters["weight"] = torch.nn.Parameter(torch.randn_like(model.fc.weight))
    _check(om, model, x)
    model.conv.weight.data.mul_(0.5)  # no version bump: the sampled element sees it
    _check(om, model, x)
    seen = counts()
    _check(om, model, x)
    _check(om, model, x)
    assert seen == {"flatten": 0, "forward": 0}
    assert _group(om).refreezes == 2


def test_calls_that_differ_leave_the_lane(net):  # noqa: F811
    model, x = net
    om = lort.ORTModule(model, options=OPTS)
    _check(om, model, x)
    _check(om, model, x)
    with torch.no_grad():
        torch.testing.assert_close(om(x=x), model(x=x), rtol=1e-5, atol=1e-5)  # keyword
    _check(om, model, torch.randn(5, 3, 8, 8))  # another batch size
    _check(om, model, x.transpose(2, 3).contiguous().transpose(2, 3))  # the same shape, other strides
    _check(om, model, x.double().float())
    model.bn.train()  # a training flag (module state): eval calls in train mode update BatchNorm
    ref = copy.deepcopy(model)
    with torch.no_grad():
        torch.testing.assert_close(om(x), ref(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean, rtol=1e-5, atol=1e-5)
    model.bn.eval()
    _check(om, model, x)
    # grad enabled: the Dynamo path, with gradients
    xr = x.clone().requires_grad_(True)
    out = om(xr)
    out.sum().backward()
    xe = x.clone().requires_grad_(True)
    model(xe).sum().backward()
    torch.testing.assert_close(xr.grad, xe.grad, rtol=1e-4, atol=1e-5)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(om(x), model(x), rtol=0.05, atol=0.05)
    _check(om, model, x)


@pytest.mark.parametrize("cpp", [True, False], ids=["TensorGuards", "python"])
def test_the_lane_checks_each_argument_and_the_inference_mode(net, counts, monkeypatch, cpp):  # noqa: F811
    """The lane's tensor check (Dynamo's C++ TENSOR_MATCH where torch has it, else the
    Python comparison) leaves it for another tensor type, requires_grad, count or a
    non-tensor; under torch.inference_mode a lane serves too (its own where the C++ check
    sees other dispatch keys), and switching back and forth stays right."""
    if cpp:
        assert direct._TensorGuards is not None, "torch 2.13 has Dynamo's TensorGuards"
    else:
        monkeypatch.setattr(direct, "_TensorGuards", None)
    model, x = net
    om = lort.ORTModule(model, options=OPTS)
    _check(om, model, x)
    seen = counts()
    with torch.no_grad():
        for arg in (torch.nn.Parameter(x.clone()), x.clone().requires_grad_(True)):
            torch.testing.assert_close(om(arg), model(arg), rtol=1e-5, atol=1e-5)
            assert seen["flatten"] == 1
            seen = counts()
        for bad in ((x, x), (3,)):  # PyTorch's own error, after lort's warning that it runs the module
            with pytest.raises(TypeError), pytest.warns(UserWarning, match="capture or compile failed"):
                om(*bad)
    for _ in range(2):
        with torch.inference_mode():
            torch.testing.assert_close(om(x), model(x), rtol=1e-5, atol=1e-5)
            y = torch.randn_like(x)  # an inference tensor
            torch.testing.assert_close(om(y), model(y), rtol=1e-5, atol=1e-5)
        _check(om, model, x)
    seen = counts()
    with torch.inference_mode():
        torch.testing.assert_close(om(y), model(y), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(om(y), model(y), rtol=1e-5, atol=1e-5)
    # C++: the first call under inference_mode built its lane, the second took it;
    # Python: the no-grad lane served both
    assert seen["flatten"] == (1 if cpp else 0)


def test_hooks_and_a_replaced_forward_on_the_wrapper_are_honoured(net):  # noqa: F811
    model, x = net
    om = lort.ORTModule(model, options=OPTS)
    _check(om, model, x)
    _check(om, model, x)
    calls = []
    handle = om.register_forward_hook(lambda mod, args, out: calls.append("wrapper hook") or out * 2)
    with torch.no_grad():
        torch.testing.assert_close(om(x), model(x) * 2, rtol=1e-5, atol=1e-5)
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda mod, args: calls.append("global"))
    try:
        _check(om, model, x)
    finally:
        handle.remove()
    assert calls[0] == "wrapper hook" and "global" in calls
    original = om.forward
    om.forward = lambda *a, **k: original(*a, **k) + 1  # as accelerate wraps it
    with torch.no_grad():
        torch.testing.assert_close(om(x), model(x) + 1, rtol=1e-5, atol=1e-5)
    del om.forward
    _check(om, model, x)
