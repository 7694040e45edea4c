"""Views of a graph's inputs leave ORT's groups as PyTorch views, not copies
(fusion/input_views.py), and an embedding's backward stays whole in PyTorch."""

import torch
import torch.fx

import lort
from lort.fusion import input_views
from lort.reasons import ReasonKind

aten = torch.ops.aten


def _input(g, name, *shape):
    node = g.placeholder(name)
    node.meta["val"] = torch.empty(*shape)
    return node


def _op(g, target, args, *shape):
    node = g.call_function(target, args)
    node.meta["val"] = torch.empty(*shape)
    return node


def _graph():
    """x, w -> (mm(x, t(w)), t(w), view(t(w))): t(w) feeds ORT's mm and the output."""
    g = torch.fx.Graph()
    x, w = _input(g, "x", 2, 3), _input(g, "w", 4, 3)
    t = _op(g, aten.t.default, (w,), 3, 4)
    mm = _op(g, aten.mm.default, (x, t), 2, 4)
    v = _op(g, aten.view.default, (t, [12]), 12)
    g.output((mm, t, v))
    return g, t, mm, v


def test_a_view_of_an_input_feeding_the_output_is_copied_for_pytorch():
    g, t, mm, v = _graph()
    unsupported = {}
    made = input_views.split_input_views(g, unsupported)
    out = next(n for n in g.nodes if n.op == "output")
    returned = out.args[0]
    assert returned[0] is mm and mm.args[1] is t  # ORT's consumer keeps the original
    t_copy, v_copy = returned[1], returned[2]
    assert t_copy is not t and t_copy.target is aten.t.default and t_copy in made
    # view(t(w)) had no other consumer: the copy replaces it, and it chains on t's copy
    assert v not in g.nodes and v_copy.args[0] is t_copy
    assert set(unsupported) == made and all(r.kind is ReasonKind.VIEW_OF_INPUT for r in unsupported.values())
    # reports count the duplicated t once; the view, whose original left, counts as itself
    assert t_copy.meta.get(input_views.DUPLICATE) and not v_copy.meta.get(input_views.DUPLICATE)
    g.lint()


def test_views_of_computed_values_and_views_only_ort_consumes_are_left_alone():
    g = torch.fx.Graph()
    x = _input(g, "x", 2, 3)
    e = _op(g, aten.exp.default, (x,), 2, 3)
    t = _op(g, aten.t.default, (e,), 3, 2)  # a view of a computed value: ORT's output anyway
    tx = _op(g, aten.t.default, (x,), 3, 2)  # a view of an input only ORT consumes
    s = _op(g, aten.add.Tensor, (tx, t), 3, 2)
    g.output((t, s))
    before = [n.name for n in g.nodes]
    assert input_views.split_input_views(g, {}) == set()
    assert [n.name for n in g.nodes] == before


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 8)

    def forward(self, ids):
        return self.fc2(torch.relu(self.fc1(self.emb(ids))))


def test_training_saves_weights_as_views_and_matches_eager():
    """The forward graph gives the backward each transposed weight as a view of the
    parameter (no copy), and outputs, gradients and the embedding's gradient (PyTorch's
    own kernel) match eager's."""
    torch.manual_seed(0)
    model = Net()
    ref = Net()
    ref.load_state_dict(model.state_dict())
    ids = torch.randint(0, 50, (4, 6))
    backend = lort.LortBackend({"executor": "ort"})
    compiled = torch.compile(model, backend=backend)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = compiled(ids)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters() if p.dim() == 2}
    transposed = [t for t in saved if t.dim() == 2 and t.shape in ((16, 32), (32, 8))]
    assert transposed, [tuple(t.shape) for t in saved]
    assert all(t.untyped_storage().data_ptr() in weights for t in transposed)
    expected = ref(ids)
    torch.testing.assert_close(out, expected)
    out.square().mean().backward()
    expected.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    fallbacks = [(op, r.kind) for rec in backend.records for op, r in rec.fallbacks]
    assert ("aten.embedding_dense_backward.default", ReasonKind.NO_TRANSLATION) in fallbacks, fallbacks
    forward = backend.records[0].graph_module.graph
    copies = [n for n in forward.nodes if n.meta.get(input_views.DUPLICATE)]
    assert {n.target for n in copies} == {aten.t.default}, copies  # t(fc1.weight), t(fc2.weight)
    assert not any(kind is ReasonKind.VIEW_OF_INPUT for _, kind in fallbacks)  # duplicates count once, in ORT


def test_views_of_an_input_the_graph_writes_are_left_alone():
    """A view of an input that a later op writes would show the written values; ORT's
    copy (and the functional graph) hold the values before the write."""
    g = torch.fx.Graph()
    x, y = _input(g, "x", 2, 3), _input(g, "y", 2, 3)
    t = _op(g, aten.t.default, (x,), 3, 2)
    _op(g, aten.copy_.default, (x, y), 2, 3)
    g.output((t,))
    assert input_views.split_input_views(g, {}) == set()
