"""Custom torch.autograd.Function under lort (ORTModule's PythonOp/PythonOpGrad promise).

Every test compares outputs and gradients with eager PyTorch (fp32: rtol 1e-5, atol 1e-6
unless stated) and counts the graphs lort compiled: an untraceable function must become
one opaque node of a single graph, not a graph break.
"""

from __future__ import annotations

import gc
import textwrap
import warnings
import weakref

import numpy as np
import pytest
import torch

import lort
from lort.backend import LortBackend
from lort.capture import autograd_function as af
from lort.testing.ranks import run_ranks

# On a torch below af.MIN_TORCH the feature is off (one warning at lort's import) and
# untraceable functions graph-break as with other backends: nothing here applies.
pytestmark = pytest.mark.skipif(
    not af.install(), reason=f"opaque autograd.Function support is off on torch {torch.__version__}: {af.unavailable_reason}"
)

RTOL, ATOL = 1e-5, 1e-6


# -- helpers -------------------------------------------------------------------------------


def compile_lort(fn):
    backend = LortBackend({"executor": "ort"})
    return torch.compile(fn, backend=backend), backend


def kinds(backend):
    return [r.kind for r in backend.records]


def opaque_nodes(backend, kind="forward"):
    return [
        n
        for r in backend.records
        if r.kind == kind
        for n in r.graph_module.graph.nodes
        if n.op == "call_function" and str(n.target).startswith("lort.python_op")
    ]


def outputs_and_grads(fn, args, extra=()):
    """fn(*args), and the gradients of sum(float outputs) w.r.t. the args and extra
    tensors that require grad (None where no gradient flows)."""
    out = fn(*args)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    leaves = [a for a in (*args, *extra) if isinstance(a, torch.Tensor) and a.requires_grad]
    loss = sum((o.float() * (i + 1)).sum() for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True) if leaves and torch.is_tensor(loss) else ()
    return out, grads


def assert_same(got, want, rtol=RTOL, atol=ATOL):
    got_out, got_grads = got
    want_out, want_grads = want
    torch.testing.assert_close(got_out, want_out, rtol=rtol, atol=atol)
    assert len(got_grads) == len(want_grads)
    for g, w in zip(got_grads, want_grads):
        if w is None:
            assert g is None or torch.count_nonzero(g) == 0
        else:
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol)


def clone_args(args):
    return [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]


# -- the seed's example (traced) --------------------------------------------------------------


class ScalarAndTupleFunction(torch.autograd.Function):
    """Seed 003's example (with the save_for_backward the seed's listing forgot)."""

    @staticmethod
    def forward(ctx, input, alpha, beta, gamma):
        ctx.save_for_backward(input)
        ctx.alpha = alpha
        ctx.beta = beta
        ctx.gamma = gamma
        return alpha * beta[0] * beta[1] * gamma * input.clamp(min=0)

    @staticmethod
    def backward(ctx, grad_output):
        (input,) = ctx.saved_tensors
        alpha, beta, gamma = ctx.alpha, ctx.beta, ctx.gamma
        grad_input = grad_output.clone()
        grad_input[input < 0] = 0
        return alpha * beta[0] * beta[1] * gamma * grad_input, None, None, None


class OpaqueScalarAndTupleFunction(ScalarAndTupleFunction):
    """The same function, made untraceable: it asks lort.is_capturing()."""

    @staticmethod
    def forward(ctx, input, alpha, beta, gamma):
        ctx.captured = lort.is_capturing()
        return ScalarAndTupleFunction.forward(ctx, input, alpha, beta, gamma)


def seed_model(fn_cls):
    def model(x, w, alpha, beta):
        h = torch.tanh(x @ w)
        return fn_cls.apply(h, alpha, beta, 0.5).sin() * 2

    return model


@pytest.mark.parametrize("fn_cls, opaque", [(ScalarAndTupleFunction, False), (OpaqueScalarAndTupleFunction, True)])
def test_seed_scalar_and_tuple_function(fn_cls, opaque):
    torch.manual_seed(0)
    x, w = torch.randn(6, 5), torch.randn(5, 7, requires_grad=True)
    model = seed_model(fn_cls)
    compiled, backend = compile_lort(model)
    for alpha, beta in [(2.0, (1.5, 3)), (2.0, (1.5, 3)), (-1.0, (2.0, 0.25))]:
        got = outputs_and_grads(compiled, [x, w, alpha, beta])
        want = outputs_and_grads(model, [x, w, alpha, beta])
        assert_same(got, want)
    # One graph per (alpha, beta) value: the scalars are guarded, never split the graph.
    assert kinds(backend) == ["forward", "backward"] * 2
    assert len(opaque_nodes(backend)) == (2 if opaque else 0)
    assert len(opaque_nodes(backend, "backward")) == (2 if opaque else 0)
    # The tensor math around the function (and the traced function's own ops) runs in ORT.
    fw = backend.records[0]
    assert fw.ort_nodes >= (3 if opaque else 6)
    if not opaque:
        ops = {op for g in fw.groups for op in g.ops}
        assert "aten.clamp.default" in ops


# -- a traced function whose custom backward differs from autograd of its forward -----------


class StraightThroughRound(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return torch.round(x * scale) / scale

    @staticmethod
    def backward(ctx, g):
        return g * 3.0, None  # autograd of round would give 0


def test_traced_function_runs_its_custom_backward_in_ort():
    torch.manual_seed(0)
    x = torch.randn(8, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)

    def model(x, w):
        return StraightThroughRound.apply(x @ w, 4.0).relu()

    compiled, backend = compile_lort(model)
    got = outputs_and_grads(compiled, [x, w])
    want = outputs_and_grads(model, [x, w])
    assert_same(got, want)
    assert torch.count_nonzero(got[1][0]) > 0  # round's own gradient would be all zeros
    assert kinds(backend) == ["forward", "backward"]
    assert not opaque_nodes(backend) and not opaque_nodes(backend, "backward")
    bw = backend.records[1]
    assert bw.ort_nodes > 0 and "aten.round.default" in {op for g in backend.records[0].groups for op in g.ops}


# -- several outputs, a non-differentiable output and a None gradient (opaque) --------------


class MultiOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, note):
        ctx.note = note  # an arbitrary object
        ctx.save_for_backward(x, y)
        k = int(np.argmax(x.detach().numpy().ravel()))  # numpy: untraceable
        idx = torch.tensor([k])
        ctx.mark_non_differentiable(idx)
        ctx.needs = ctx.needs_input_grad
        return x * y, x + y, idx

    @staticmethod
    def backward(ctx, g_prod, g_sum, g_idx):
        x, y = ctx.saved_tensors
        assert ctx.note["tag"] == "kept"
        gx = g_prod * y + g_sum if ctx.needs_input_grad[0] else None
        return gx, None, None  # y gets no gradient even though it requires grad


class Note(dict):
    pass


def test_several_outputs_non_differentiable_and_none_gradient():
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    y = torch.randn(3, 4, requires_grad=True)

    def model(x, y, note):
        p, s, idx = MultiOutput.apply(x.exp(), y * 2, note)
        return p.sum(-1), s.relu(), idx

    note = Note(tag="kept")
    compiled, backend = compile_lort(model)
    got = outputs_and_grads(compiled, [x, y, note])
    want = outputs_and_grads(model, [x, y, note])
    assert_same(got, want)
    assert got[0][2].dtype == torch.int64 and not got[0][2].requires_grad
    assert kinds(backend) == ["forward", "backward"]
    assert len(opaque_nodes(backend)) == 1 and len(opaque_nodes(backend, "backward")) == 1
    assert MultiOutput in af.opaque_functions()


# -- .item() in forward -----------------------------------------------------------------------


class NormalizeByMax(torch.autograd.Function):
    calls = 0

    @staticmethod
    def forward(ctx, x):
        NormalizeByMax.calls += 1
        m = x.abs().max().item()  # data-dependent Python scalar
        ctx.m = m
        return x / m

    @staticmethod
    def backward(ctx, g):
        return g / ctx.m


def test_item_in_forward_is_one_opaque_node_in_one_graph():
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 6)
    x = torch.randn(4, 6, requires_grad=True)

    def model(x):
        return torch.nn.functional.gelu(NormalizeByMax.apply(lin(x)) @ lin.weight)

    compiled, backend = compile_lort(model)
    want = outputs_and_grads(model, [x], lin.parameters())
    got = outputs_and_grads(compiled, [x], lin.parameters())  # compiles
    NormalizeByMax.calls = 0
    got = outputs_and_grads(compiled, [x], lin.parameters())
    assert NormalizeByMax.calls == 1  # the real forward runs once per call, not again in backward
    assert_same(got, want)
    assert kinds(backend) == ["forward", "backward"]  # no graph break
    assert len(opaque_nodes(backend)) == 1
    fw, bw = backend.records
    # ORT groups before and after the opaque node, forward and backward.
    assert len(fw.groups) >= 2 and fw.ort_nodes >= 3 and bw.ort_nodes >= 3
    assert ("lort.python_op.default" in {op for op, _ in fw.fallbacks})


# -- numpy ------------------------------------------------------------------------------------


class NumpyTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.from_numpy(np.tanh(x.detach().cpu().numpy()))
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return torch.from_numpy(g.numpy() * (1.0 - y.numpy() ** 2))


def test_numpy_function():
    torch.manual_seed(0)
    x = torch.randn(5, 3, requires_grad=True)
    w = torch.randn(3, 3, requires_grad=True)

    def model(x, w):
        return NumpyTanh.apply(x @ w) * w.sum()

    compiled, backend = compile_lort(model)
    assert_same(outputs_and_grads(compiled, [x, w]), outputs_and_grads(model, [x, w]))
    assert kinds(backend) == ["forward", "backward"]


# -- checkpoint-style recompute in backward -----------------------------------------------------


class Checkpoint(torch.autograd.Function):
    """Recomputes ``run_fn`` in backward (torch.utils.checkpoint's classic form)."""

    @staticmethod
    def forward(ctx, run_fn, x, *params):
        ctx.run_fn = run_fn
        ctx.save_for_backward(x, *params)
        with torch.no_grad():
            return run_fn(x)

    @staticmethod
    def backward(ctx, g):
        x, *params = ctx.saved_tensors
        with torch.enable_grad():
            xd = x.detach().requires_grad_(x.requires_grad)
            out = ctx.run_fn(xd)
            inputs = [xd, *params] if xd.requires_grad else list(params)
            grads = torch.autograd.grad(out, inputs, g, allow_unused=True)
        if not xd.requires_grad:
            grads = (None, *grads)
        return (None, *grads)


def test_checkpoint_style_function_recomputes_in_backward():
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    head = torch.nn.Linear(8, 2)
    x = torch.randn(4, 8, requires_grad=True)
    params = list(block.parameters())

    def model(x):
        h = Checkpoint.apply(block, x * 2, *params)
        return head(h + x).tanh()

    all_params = [*params, *head.parameters()]
    compiled, backend = compile_lort(model)
    got = outputs_and_grads(compiled, [x], all_params)
    assert_same(got, outputs_and_grads(model, [x], all_params))
    # The checkpointed block's parameters get their gradients from the recompute.
    assert all(torch.count_nonzero(g) > 0 for g in got[1][1 : 1 + len(params)])
    assert kinds(backend) == ["forward", "backward"]
    assert len(opaque_nodes(backend)) == 1


# -- ctx features: mark_dirty, set_materialize_grads, needs_input_grad, no-grad inputs ---------


class InplaceScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, s):
        ctx.s = float(s.sum().item())
        x.mul_(ctx.s)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * ctx.s, None


def test_mark_dirty_modifies_the_input_in_place():
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    s = torch.tensor([0.5, 1.0])

    def model(w, s):
        h = w * 1.0
        out = InplaceScale.apply(h, s)
        return out is h, h.cos(), out.sin()

    compiled, backend = compile_lort(model)
    got = outputs_and_grads(compiled, [w, s])
    want = outputs_and_grads(model, [w, s])
    assert want[0][0] is True and got[0][0] is True  # the output is the input, as in eager
    assert_same((got[0][1:], got[1]), (want[0][1:], want[1]))
    assert kinds(backend) == ["forward", "backward"]


class NoMaterialize(torch.autograd.Function):
    seen = []

    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        ctx.flag = x.sum().item() > -1e9
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, ga, gb):
        NoMaterialize.seen.append((ga is None, gb is None))
        grad = torch.zeros_like(ga if ga is not None else gb)
        if ga is not None:
            grad = grad + ga * 2
        if gb is not None:
            grad = grad + gb * 3
        return grad


def test_set_materialize_grads_false_passes_none_for_unused_outputs():
    torch.manual_seed(0)
    x = torch.randn(3, requires_grad=True)

    def model(x):
        a, b = NoMaterialize.apply(x + 1)
        return a.exp()  # b unused: its gradient is None

    compiled, backend = compile_lort(model)
    NoMaterialize.seen.clear()
    want = outputs_and_grads(model, [x])
    got = outputs_and_grads(compiled, [x])
    assert_same(got, want)
    assert NoMaterialize.seen == [(False, True), (False, True)]
    assert kinds(backend) == ["forward", "backward"]


class NeedsGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.needs = tuple(ctx.needs_input_grad)
        ctx.save_for_backward(a, b)
        return a * b + float(a.mean().item())

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        assert ctx.needs_input_grad == ctx.needs
        return (g * b if ctx.needs_input_grad[0] else None, g * a if ctx.needs_input_grad[1] else None)


def test_inputs_that_do_not_require_grad_and_needs_input_grad():
    torch.manual_seed(0)
    a = torch.randn(4, requires_grad=True)
    b = torch.randn(4)  # no grad

    def model(a, b):
        return NeedsGrad.apply(a.sin(), b).sum()

    compiled, backend = compile_lort(model)
    assert_same(outputs_and_grads(compiled, [a, b]), outputs_and_grads(model, [a, b]))
    with torch.no_grad():  # inference: no ctx kept
        torch.testing.assert_close(compiled(a, b), model(a, b), rtol=RTOL, atol=ATOL)
    assert "inference" in kinds(backend)


# -- arbitrary objects are kept alive with the graph --------------------------------------------


class Scaler:
    def __init__(self, k):
        self.k = k


class UseObject(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, obj, nothing):
        assert nothing is None
        ctx.obj = obj
        if lort.is_capturing():
            pass
        return x * obj.k

    @staticmethod
    def backward(ctx, g):
        return g * ctx.obj.k, None, None


def test_arbitrary_object_argument_lives_as_long_as_the_graph():
    x = torch.randn(3, requires_grad=True)
    holder = {"obj": Scaler(5.0)}

    def model(x):
        return UseObject.apply(x, holder["obj"], None).tanh()

    compiled, backend = compile_lort(model)
    ref = weakref.ref(holder["obj"])
    want = outputs_and_grads(model, [x])
    got = outputs_and_grads(compiled, [x])
    assert_same(got, want)
    entry_ref = weakref.ref(af._ENTRIES[opaque_nodes(backend)[0].args[0]])
    assert entry_ref() is not None and entry_ref().template[1] is ref()
    torch._dynamo.reset()
    del compiled, backend, got, want
    gc.collect()
    holder.clear()
    gc.collect()
    assert entry_ref() is None and ref() is None  # released with the graph


# -- is_capturing ------------------------------------------------------------------------------


class RecordCapture(torch.autograd.Function):
    seen = []

    @staticmethod
    def forward(ctx, x):
        RecordCapture.seen.append(lort.is_capturing())
        return x + 1

    @staticmethod
    def backward(ctx, g):
        return g


def test_is_capturing_true_during_capture_false_when_running():
    assert lort.is_capturing() is False
    x = torch.randn(3, requires_grad=True)
    compiled, backend = compile_lort(lambda x: RecordCapture.apply(x * 2).cos())
    RecordCapture.seen.clear()
    compiled(x).sum().backward()
    assert RecordCapture.seen == [True, False]  # a fake-tensor run at capture, then the real one
    RecordCapture.seen.clear()
    compiled(x)
    assert RecordCapture.seen == [False]
    assert kinds(backend) == ["forward", "backward"]


def test_other_backends_keep_dynamo_behaviour():
    """The hook only acts for lort: aot_eager still graph-breaks on .item()."""
    counts = []

    def counting(gm, inputs):
        counts.append(gm)
        return gm.forward

    x = torch.randn(3, requires_grad=True)
    out = torch.compile(lambda x: NormalizeByMax.apply(x.sin()).cos(), backend=counting)(x)
    torch.testing.assert_close(out, NormalizeByMax.apply(x.sin()).cos())
    assert len(counts) == 2
    assert not any("lort" in str(n.target) for g in counts for n in g.graph.nodes)


class ShapeFromData(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        n = int(x.sum().item() > 0) + 1
        return x.repeat(n)

    @staticmethod
    def backward(ctx, g):
        raise NotImplementedError


def test_data_dependent_output_shape_is_a_clear_error():
    compiled, _ = compile_lort(lambda x: ShapeFromData.apply(x) * 2)
    # Capture sees dummy inputs in [0, 1): sum > 0, two copies.
    torch.testing.assert_close(compiled(torch.ones(3)), torch.ones(6) * 2)
    with pytest.raises(af.OpaqueFunctionError, match=r"ShapeFromData.*dummy run.*output 0 is torch.float32 \[3\]"):
        compiled(-torch.ones(3))


# -- a transformer block with two custom functions, trained 20 steps ---------------------------


class CustomGelu(torch.autograd.Function):
    """Traceable, with a hand-written backward (tanh approximation)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.nn.functional.gelu(x, approximate="tanh")

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        c = 0.7978845608028654
        inner = c * (x + 0.044715 * x**3)
        t = torch.tanh(inner)
        dinner = c * (1 + 3 * 0.044715 * x**2)
        return g * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * dinner)


class ClipByRms(torch.autograd.Function):
    """Untraceable: scales by a Python float from .item(); straight-through backward."""

    @staticmethod
    def forward(ctx, x, limit):
        rms = x.pow(2).mean().sqrt().item()
        ctx.scale = min(1.0, limit / max(rms, 1e-12))
        return x * ctx.scale

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


class Block(torch.nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        x = x + ClipByRms.apply(a, 0.5)
        return x + self.fc2(CustomGelu.apply(self.fc1(self.ln2(x))))


def test_transformer_block_with_two_custom_functions_trains_like_eager():
    torch.manual_seed(0)
    eager = Block()
    model = Block()
    model.load_state_dict(eager.state_dict())
    compiled, backend = compile_lort(model)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
    opt_c = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    losses_e, losses_c = [], []
    for _ in range(20):
        x = torch.randn(2, 6, 32, generator=gen)
        target = torch.randn(2, 6, 32, generator=gen)
        for m, opt, losses in ((eager, opt_e, losses_e), (compiled, opt_c, losses_c)):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses_c), torch.tensor(losses_e), rtol=1e-3, atol=1e-5)
    assert losses_e[-1] < losses_e[0]
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)
    assert kinds(backend) == ["forward", "backward"]  # one graph for all 20 steps
    assert len(opaque_nodes(backend)) == 1  # ClipByRms; CustomGelu is traced into ORT groups
    fw, bw = backend.records
    assert fw.ort_nodes > 20 and bw.ort_nodes > 20 and len(fw.groups) >= 2


# -- collectives: all_reduce on 2 gloo ranks --------------------------------------------------

_DIST_WORKER = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    import lort
    from lort.backend import LortBackend

    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)

    class AllReduceSum(torch.autograd.Function):
        captures = 0

        @staticmethod
        def forward(ctx, x):
            y = x.clone()
            if lort.is_capturing():
                AllReduceSum.captures += 1  # no collective while lort captures
            else:
                dist.all_reduce(y)
            return y

        @staticmethod
        def backward(ctx, g):
            g = g.clone()
            dist.all_reduce(g)
            return g

    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    def model(x):
        return (AllReduceSum.apply(lin(x)) * (rank + 1)).tanh()

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank + 10), requires_grad=True)
    def run(fn):
        out = fn(x)
        grads = torch.autograd.grad(out.sum(), [x, *lin.parameters()])
        return out, grads

    backend = LortBackend({"executor": "ort"})
    compiled = torch.compile(model, backend=backend)
    want = run(model)
    got = run(compiled)
    got2 = run(compiled)
    for g in (got, got2):
        torch.testing.assert_close(g[0], want[0], rtol=1e-5, atol=1e-6)
        for a, b in zip(g[1], want[1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert [r.kind for r in backend.records] == ["forward", "backward"], backend.records
    assert AllReduceSum.captures >= 1
    dist.destroy_process_group()
    print(f"rank {rank} ok")
    """
)


def test_all_reduce_in_function_on_two_gloo_ranks(tmp_path):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    script = tmp_path / "worker.py"
    script.write_text(_DIST_WORKER)
    run_ranks(str(script), 2, env={"OMP_NUM_THREADS": "1"}, timeout=120)


# -- the same functions under lort.ORTModule --------------------------------------------------


class MixedModel(torch.nn.Module):
    """The seed's function (opaque variant), .item(), numpy, a traced custom backward and a
    checkpointed block in one module."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.block = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = OpaqueScalarAndTupleFunction.apply(self.fc1(x), 2.0, (1.5, 0.5), 0.5)
        h = NormalizeByMax.apply(CustomGelu.apply(h))
        h = Checkpoint.apply(self.block, h, *self.block.parameters())
        return self.fc2(NumpyTanh.apply(h) + ScalarAndTupleFunction.apply(h, 0.5, (2.0, 1.0), 1.5))


@pytest.mark.skipif(not hasattr(lort, "ORTModule"), reason="lort.ORTModule is not built yet")
def test_functions_under_ortmodule_train_like_eager():
    import copy

    torch.manual_seed(0)
    eager = MixedModel()
    ortm = lort.ORTModule(copy.deepcopy(eager), options={"executor": "ort", "fallback": "raise"})
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_o = torch.optim.SGD(ortm.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        x = torch.randn(6, 8, generator=gen)
        y = torch.randn(6, 4, generator=gen)
        losses = []
        for m, opt in ((eager, opt_e), (ortm, opt_o)):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for p, q in zip(ortm.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    records = ortm.transition_manager.records
    assert [r.kind for r in records] == ["forward", "backward"]
    fw_opaque = [n for n in records[0].graph_module.graph.nodes if str(n.target) == "lort.python_op.default"]
    # Opaque: the seed's variant, .item() and the checkpoint. CustomGelu and
    # ScalarAndTupleFunction are traced into ORT groups, and so is NumpyTanh: Dynamo
    # traces numpy calls on tensors (torch._numpy).
    assert len(fw_opaque) == 3
    assert records[0].ort_nodes > 0 and records[1].ort_nodes > 0


@pytest.mark.skipif(not hasattr(lort, "ORTModule"), reason="lort.ORTModule is not built yet")
def test_ortmodule_inference_with_opaque_function():
    torch.manual_seed(0)
    lin = torch.nn.Linear(5, 5)
    ortm = lort.ORTModule(torch.nn.Sequential(lin, torch.nn.ReLU()), options={"executor": "ort", "fallback": "raise"})
    ortm.eval()
    x = torch.randn(2, 5)
    with torch.no_grad():
        got = NormalizeByMax.apply(ortm(x))
        want = NormalizeByMax.apply(torch.relu(lin(x)))
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_missing_dynamo_internals_fail_with_a_clear_version_error(monkeypatch):
    from torch._dynamo.variables.misc import AutogradFunctionVariable

    af.check_torch_internals()  # the installed torch has what lort needs
    monkeypatch.delattr(AutogradFunctionVariable, "call_apply")
    with pytest.raises(lort.UnsupportedVersionError, match="call_apply is missing"):
        af.check_torch_internals()


def test_missing_dynamo_internals_turn_the_feature_off_not_lort(monkeypatch):
    """torch 2.11 lacks internals of 2.13 (Dynamo's _resolve_kwargs): lort must still
    import and run; only opaque autograd.Function support turns itself off, with one
    warning naming the feature and the version."""
    from torch._dynamo.variables.misc import AutogradFunctionVariable

    monkeypatch.setattr(af.dynamo_patch, "_installed", False)
    monkeypatch.setattr(af.dynamo_patch, "unavailable_reason", None)
    monkeypatch.delattr(AutogradFunctionVariable, "call_apply")
    with pytest.warns(UserWarning, match=r"opaque autograd.Function support is off on torch"):
        assert af.install() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert af.install() is False  # warned once
    monkeypatch.undo()
    assert AutogradFunctionVariable.call_apply._lort_wrapped  # the real install is untouched
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    before = lort.stats.ort_runs
    got = torch.compile(lin, backend=lort.LortBackend({"executor": "ort"}))(x)
    torch.testing.assert_close(got, lin(x), rtol=RTOL, atol=ATOL)
    assert lort.stats.ort_runs > before


def test_keyword_arguments_resolve_without_dynamo_internals():
    """Opaque functions take keyword arguments through lort's own resolution (Dynamo's
    _resolve_kwargs is not on every supported torch)."""

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, factor, shift=0.0):
            return x * factor + shift

    assert af._resolve_kwargs(Scale, ["x"], {"factor": "f"}) == ["x", "f"]
    assert af._resolve_kwargs(Scale, ["x"], {"shift": "s", "factor": "f"}) == ["x", "f", "s"]
    assert af._resolve_kwargs(Scale, ["x"], {"other": 1}) is None
    with pytest.raises(TypeError, match="missing required argument: 'factor'"):
        af._resolve_kwargs(Scale, ["x"], {"shift": "s"})
    with pytest.raises(TypeError, match="multiple values for argument 'x'"):
        af._resolve_kwargs(Scale, ["x"], {"x": "again"})

    class ItemScale(torch.autograd.Function):  # .item(): untraceable, runs opaquely
        @staticmethod
        def forward(ctx, x, factor, shift=0.0):
            ctx.factor = factor.item()
            return x * ctx.factor + shift

        @staticmethod
        def backward(ctx, g):
            return g * ctx.factor, None, None

    def fn(x, f):
        return ItemScale.apply(torch.sin(x), factor=f, shift=0.5).sum()

    x = torch.randn(6, requires_grad=True)
    f = torch.tensor(3.0)
    got = torch.compile(fn, backend=LortBackend({"executor": "ort"}))(x, f)
    (gx,) = torch.autograd.grad(got, [x])
    want = fn(x, f)
    (wx,) = torch.autograd.grad(want, [x])
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(gx, wx, rtol=RTOL, atol=ATOL)
    assert ItemScale in af.opaque_functions()
