"""Attention's safe softmax in inference graphs (capture/attention.py): the row-wide
select is element by element where the probabilities only feed ``attn @ v``; results
against eager on rows of -inf only, rows with NaN or +inf beside -inf, and finite rows."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention import SDPBackend, sdpa_kernel

import lort
from lort.capture import attention, decompositions

aten = torch.ops.aten
INF, NAN = math.inf, math.nan


def _inputs(seed=0):
    """q, k, v (2, 2, 5, 4) and a float mask (5, 5): row 0 of the mask is -inf only, row 1
    -inf but for one key; q has a NaN in head 0 row 2 and a +inf in head 1 row 3, rows
    whose scores also meet the mask's -inf."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=g) for _ in range(3))
    mask = torch.zeros(5, 5)
    mask[0] = -INF
    mask[1, 1:] = -INF
    mask[2, 3:] = -INF
    mask[3, :2] = -INF
    q[0, 0, 2, 1] = NAN
    q[1, 1, 3, 0] = INF
    return q, k, v, mask


def _trace(fn, *args):
    with sdpa_kernel([SDPBackend.MATH]):
        return make_fx(fn, decomposition_table=decompositions.table())(*args)


def _count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.target is target)


def test_attention_probabilities_select_element_by_element():
    gm = _trace(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), *_inputs())
    assert _count(gm, aten.all.dim) == 1
    assert attention.elementwise_safe_softmax(gm) == 1
    assert _count(gm, aten.all.dim) == 0
    args = _inputs()
    with sdpa_kernel([SDPBackend.MATH]):
        expected = F.scaled_dot_product_attention(*args[:3], attn_mask=args[3])
    torch.testing.assert_close(gm(*args), expected, equal_nan=True)


@pytest.mark.parametrize(
    "fn",
    [
        pytest.param(lambda x: aten._safe_softmax.default(x, -1), id="probabilities-are-the-output"),
        pytest.param(lambda x: (lambda p: p @ torch.ones(5, 3) + p.sum())(aten._safe_softmax.default(x, -1)),
                     id="also-summed"),
        pytest.param(lambda x: torch.ones(3, 5) @ aten._safe_softmax.default(x, -1)[0], id="right-of-a-product"),
    ],
)
def test_other_uses_keep_the_row_select(fn):
    """Where a row's probabilities are seen otherwise than through ``attn @ v``, NaN rows
    must stay NaN everywhere (the -inf places too): no rewrite."""
    x = torch.randn(2, 5, 5)
    gm = _trace(fn, x)
    assert attention.elementwise_safe_softmax(gm) == 0


def _eager_math(q, k, v, m):
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


@pytest.mark.parametrize("route", ["torch.compile", "ORTModule"])
def test_attention_with_masked_rows_and_nan_equals_eager(route, monkeypatch):
    """Through torch.compile a CPU float32 inference graph keeps PyTorch's attention kernel
    whole, as ONNX's Attention (translate/attention.py): no math form to rewrite there;
    ORTModule's direct inference traces the math form, rewritten once."""
    rewritten = []
    rewrite = attention.elementwise_safe_softmax
    monkeypatch.setattr(attention, "elementwise_safe_softmax", lambda gm: rewritten.append(rewrite(gm)) or rewritten[-1])

    class Attend(torch.nn.Module):
        def forward(self, q, k, v, m):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m) * 2

    args = _inputs()
    model = Attend().eval()
    run = torch.compile(model, backend=lort.LortBackend(lort.Options(executor="ort"))) if route == "torch.compile" \
        else lort.ORTModule(model, options=lort.Options(executor="ort"))
    with torch.no_grad():
        got = run(*args)
        eager = model(*args)
    expected = _eager_math(*args) * 2
    assert torch.isnan(expected[0, 0, 2]).all() and torch.isnan(expected[1, 1, 3]).all()
    assert (expected[:, :, 0] == 0).all()  # the row of -inf only
    torch.testing.assert_close(eager, expected, equal_nan=True)
    torch.testing.assert_close(got, expected, equal_nan=True)
    assert sum(rewritten) == (0 if route == "torch.compile" else 1), rewritten


def test_training_graphs_keep_the_row_select():
    """In training the backward reads the probabilities: gradients against eager on the
    same rows."""
    q, k, v, mask = _inputs()
    q[0, 0, 2, 1] = 0.5  # gradients of NaN rows are NaN anyway; keep the masked rows
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                       backend=lort.LortBackend(lort.Options(executor="ort")))
    fn(*leaves).sum().backward()
    _eager_math(*ref, mask).sum().backward()
    for a, b in zip(leaves, ref):
        torch.testing.assert_close(a.grad, b.grad, equal_nan=True)
