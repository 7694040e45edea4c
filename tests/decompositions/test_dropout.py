"""Dropout on CPU as ``lort::dropout_mask`` (PyTorch) and its products (ORT):
capture/decompositions/dropout.py, and the order of random draws (fusion/dependencies.py)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import lort
from lort import LortBackend
from lort.capture.decompositions import dropout
from lort.fusion.dependencies import DepGraph
from test_models import assert_close_to_reference

aten = torch.ops.aten


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape, p", [((4, 128, 64), 0.1), ((3, 7, 5), 0.5), ((1000,), 0.3), ((2, 3, 16, 16), 0.9)])
def test_decomposition_is_eagers_dropout_bit_for_bit(shape, p, dtype):
    x = torch.randn(shape, dtype=dtype)
    x.view(-1)[0] = float("nan")
    x.view(-1)[1] = -0.0
    torch.manual_seed(7)
    out, mask = aten.native_dropout(x, p, True)
    after = torch.rand(3)  # the generator's state after the draw
    torch.manual_seed(7)
    out2, mask2 = dropout.native_dropout(x, p, True)
    assert mask2.dtype == torch.bool and torch.equal(mask2, mask)
    torch.testing.assert_close(out2, out, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(out2.signbit(), out.signbit())
    assert torch.equal(torch.rand(3), after)


def test_kept_whole_where_the_draw_cannot_be_written_apart():
    x = torch.randn(4, 5)
    assert dropout.native_dropout(x, 0.5, False) is NotImplemented
    assert dropout.native_dropout(x, 0.0, True) is NotImplemented
    assert dropout.native_dropout(x, 1.0, True) is NotImplemented
    assert dropout.native_dropout(x.to("meta"), 0.5, True) is NotImplemented
    assert dropout._SAFE, "the mask op is not in AOTAutograd's list of random ops: two masks could become one"


class _TwoDropouts(torch.nn.Module):
    """Two dropouts of the same shape and p (AOTAutograd's CSE would make them one mask if
    it did not know the mask op is random), and a data-dependent draw between them."""

    def __init__(self, d=16):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(d, d) for _ in range(3))

    def forward(self, x):
        h = F.dropout(torch.tanh(self.a(x)), 0.3, training=True)
        h = h + torch.bernoulli(torch.sigmoid(h))  # draws after the first mask, before the second
        h = F.dropout(torch.tanh(self.b(h)), 0.3, training=True)
        return self.c(h).sum(-1)


def _ort_backend():
    return LortBackend(lort.Options(executor="ort"))


def test_training_steps_with_dropout_match_eager_and_dropout_cuts_no_group():
    torch.manual_seed(0)
    model = _TwoDropouts()
    eager, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    backend = _ort_backend()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(8, 16)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager, ref)]
    for step in range(4):
        outs = []
        for m, inp, opt in zip((compiled, eager, ref), (x, x, x.double()), opts):
            torch.manual_seed(100 + step)
            loss = m(inp).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            outs.append(loss.detach())
        # eager draws the same masks in float32 and float64 (bernoulli_ on a float64
        # tensor too), so the reference is eager's step in float64
        assert_close_to_reference(outs[0], outs[1], outs[2], f"loss at step {step}")
    for (name, p), pe, pr in zip(model.named_parameters(), eager.parameters(), ref.parameters()):
        assert_close_to_reference(p.detach(), pe.detach(), pr.detach(), f"{name} after 4 steps")
    forward = next(r for r in backend.records if r.kind == "forward")
    fallbacks = sorted({str(op) for op, _ in forward.fallbacks})
    assert fallbacks == ["aten.bernoulli.default", "lort.dropout_mask.default"], fallbacks


def test_masks_are_drawn_in_eagers_order_around_a_data_dependent_draw():
    """The bernoulli between the dropouts depends on the first's output: the second mask,
    which depends on nothing, must still be drawn after it, as eager draws it (drawn
    first, the masks and the bernoulli would differ from eager's). The schedule's own
    order kept it here without fusion/dependencies.py's ordering edges too; those are
    checked on their own below."""
    torch.manual_seed(0)
    model = _TwoDropouts()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=_ort_backend())
    x = torch.randn(8, 16)
    torch.manual_seed(5)
    got = compiled(x)
    torch.manual_seed(5)
    expected = eager(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_dynamic_shapes_keep_dropout_whole_and_match_eager():
    torch.manual_seed(0)
    model = _TwoDropouts()
    eager = copy.deepcopy(model)
    backend = _ort_backend()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for n in (6, 9):
        x = torch.randn(n, 16)
        torch.manual_seed(n)
        got = compiled(x)
        torch.manual_seed(n)
        torch.testing.assert_close(got, eager(x), rtol=1e-5, atol=1e-5)
    ops = {str(op) for r in backend.records for op, _ in r.fallbacks}
    assert "aten.native_dropout.default" in ops and "lort.dropout_mask.default" not in ops, ops


def test_random_ops_are_ordered_in_the_dependency_graph():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    m1 = g.call_function(dropout.dropout_mask, ([4], 0.5, torch.float32, torch.device("cpu")))
    y = g.call_function(aten.sin.default, (x,))
    b = g.call_function(aten.bernoulli.default, (y,))
    m2 = g.call_function(dropout.dropout_mask, ([4], 0.5, torch.float32, torch.device("cpu")))
    g.output((m1, b, m2))
    deps = DepGraph(list(g.nodes))
    assert b in deps.succ[m1] and m2 in deps.succ[b]
    assert m2 not in deps.succ[m1]  # a chain, not every pair
