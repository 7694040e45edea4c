"""A model that repeats one layer is translated, rewritten and timed once per distinct
layer (translate/repeated.py; GroupCompiler.alike), and computes what eager computes.

Transformers' BERT from a config with random weights; the counts come from spies on
torch_lib's translation and on lort's thread timing, the values from a float64 eager
reference with the budget of tests/models/test_models.py.
"""

import collections
import copy

import pytest
import torch
import transformers

import lort
from lort.compile import group_compiler
from lort.translate import _compat, repeated
from test_models import assert_close_to_reference

LAYERS = 8


def _bert(layers=LAYERS, dropout=0.0, seed=0):
    cfg = transformers.BertConfig(
        vocab_size=100, num_hidden_layers=layers, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )
    torch.manual_seed(seed)
    return transformers.BertModel(cfg), torch.randint(0, 100, (2, 16))


@pytest.fixture
def translated(monkeypatch):
    """Counts of the graphs torch_lib translates and of their nodes."""
    count = collections.Counter()
    translate = _compat.translate_graph

    def counting(graph, name, reg):
        count["graphs"] += 1
        count["nodes"] += sum(1 for n in graph.nodes if n.op == "call_function")
        return translate(graph, name, reg)

    monkeypatch.setattr(_compat, "translate_graph", counting)
    return count


@pytest.fixture
def splits(monkeypatch):
    """The runs ``repeated.split`` cut each group into (None: translated whole)."""
    out = []
    split = repeated.split

    def spy(gm):
        runs = split(gm)
        out.append(runs)
        return runs

    monkeypatch.setattr(repeated, "split", spy)
    return out


def _infer(model, x):
    with torch.no_grad():
        return torch.compile(model, backend="lort")(x).last_hidden_state


def test_inference_translates_each_distinct_layer_once(translated, monkeypatch):
    model, x = _bert()
    monkeypatch.setattr(repeated, "MIN_NODES", 10**9)  # every group translated whole
    _infer(copy.deepcopy(model), x)
    whole = dict(translated)
    torch._dynamo.reset()
    translated.clear()
    monkeypatch.setattr(repeated, "MIN_NODES", 150)
    out = _infer(model, x)
    # 8 layers: the runs before and after the layers, the first and the last layer
    # (they read and feed the glue) and one for the six alike in between.
    assert translated["graphs"] <= 5, translated
    assert translated["nodes"] < 0.6 * whole["nodes"], (translated, whole)
    with torch.no_grad():
        eager = model(x).last_hidden_state
        ref = model.double()(x).last_hidden_state
    assert_close_to_reference(out, eager, ref, "8-layer BERT inference, translated by layer")


def test_training_by_layer_matches_eager(splits):
    model, x = _bert(layers=4)
    ref_model = copy.deepcopy(model).double()
    eager_model = copy.deepcopy(model)
    out = torch.compile(model, backend="lort")(x).last_hidden_state
    out_e = eager_model(x).last_hidden_state
    out_r = ref_model(x).last_hidden_state
    assert_close_to_reference(out, out_e, out_r, "4-layer BERT forward")
    for o in (out, out_e, out_r):
        o.pow(2).mean().backward()
    checked = 0
    for (name, p), p_e, p_r in zip(model.named_parameters(), eager_model.parameters(), ref_model.parameters()):
        if p_r.grad is None or not p_r.grad.abs().sum():
            continue
        assert_close_to_reference(p.grad, p_e.grad, p_r.grad, f"grad of {name}")
        checked += 1
    assert checked > 30
    assert sum(1 for r in splits if r) >= 2, "no group of the forward and backward graphs was cut by layer"


def test_alike_groups_are_timed_once(monkeypatch):
    """Dropout kept whole (random: it stays in PyTorch, as where its mask cannot be drawn
    apart, capture/decompositions/dropout.py) cuts each layer into groups; the same group
    of every layer shares the first one's translation and timing."""
    from lort.capture.decompositions import dropout

    monkeypatch.setattr(dropout, "_SAFE", False)
    timed, compiled = [], []
    choose, compile_group = group_compiler.GroupCompiler._choose_threads, group_compiler.GroupCompiler.compile

    def spy_choose(self, *a, **k):
        timed.append(1)
        return choose(self, *a, **k)

    def spy_compile(self, name, *a, **k):
        compiled.append(name)
        return compile_group(self, name, *a, **k)

    monkeypatch.setattr(group_compiler.GroupCompiler, "_choose_threads", spy_choose)
    monkeypatch.setattr(group_compiler.GroupCompiler, "compile", spy_compile)
    model, x = _bert(layers=6, dropout=0.1)
    torch.compile(model, backend="lort")(x).last_hidden_state.sum().backward()
    assert len(compiled) >= 3 * 6, compiled  # groups per layer, forward and backward
    assert len(timed) < 0.4 * len(compiled), (len(timed), len(compiled), compiled)
    assert all(p.grad is not None for p in model.encoder.parameters())


class _Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 2 * d)
        self.down = torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x)))).softmax(-1)


class _Stack(torch.nn.Module):
    def __init__(self, d=16, n=10):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(d) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.sum(-1)


def test_dynamic_shapes_by_layer(splits, monkeypatch):
    """Runs cut from a graph with symbolic sizes: one translation serves every length."""
    monkeypatch.setattr(repeated, "MIN_NODES", 20)
    torch.manual_seed(0)
    model = _Stack()
    compiled = torch.compile(model, backend="lort", dynamic=True)
    with torch.no_grad():
        for n in (5, 9):
            x = torch.randn(3, n, 16)
            torch.testing.assert_close(compiled(x), model(x))
    runs = [r for r in splits if r]
    assert runs and len({r.key for r in runs[0]}) < len(runs[0]) - 5


def test_small_or_unlayered_groups_are_not_split():
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    assert repeated.split(gm) is None


def _fusions(model, x):
    backend = lort.LortBackend({"disk_cache": False})
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(x).logits
    fired = collections.Counter()
    for r in backend.records:
        for g in r.groups:
            fired.update(g.fusions)
    return out, fired


def test_fusions_across_layer_cuts_fire_as_in_the_whole_group(monkeypatch):
    """GPT-2 is pre-norm: a layer's last residual Add and the next layer's first norm
    fall on either side of a cut, and ORT's own optimizer does not fuse them: the
    stitched model gets onnxscript's skip-norm fusions (as many as the whole group's).
    Skip-norm fusions are made for groups off the CPU (CUDA) only: the test asks for
    them here."""
    from lort.translate import onnx_export

    real = onnx_export.translate_group
    monkeypatch.setattr(onnx_export, "translate_group",
                        lambda gm, name, structure=None, skip_norms=True: real(gm, name, structure, skip_norms=True))
    cfg = transformers.GPT2Config(n_layer=6, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    x = torch.randint(0, 100, (1, 12))
    monkeypatch.setattr(repeated, "MIN_NODES", 10**9)
    whole_out, whole = _fusions(model, x)
    torch._dynamo.reset()
    monkeypatch.setattr(repeated, "MIN_NODES", 50)
    split_out, split = _fusions(model, x)
    assert whole["skip_layer_normalization"] >= 6 and split == whole, (split, whole)
    with torch.no_grad():
        eager = model(x).logits
        ref = copy.deepcopy(model).double()(x).logits
    assert_close_to_reference(split_out, eager, ref, "6-layer GPT-2, stitched")


def test_cpu_groups_get_no_skip_norm_fusions():
    """ORT's CPU SkipLayerNormalization and SkipSimplifiedLayerNormalization kernels run
    slower than the Add and norm they fuse (benchmarks/studies/skip_norm.md): CPU groups keep
    Add + LayerNormalization (GPT-2) and Add + SimplifiedLayerNormalization (Llama's RMS
    norm), within and across layer cuts, and match eager."""
    models = []
    for make in (
        lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=4, n_embd=32, n_head=2, vocab_size=100, n_positions=32)),
        lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=2,
            num_key_value_heads=2, vocab_size=100, max_position_embeddings=32)),
    ):
        torch.manual_seed(0)
        models.append(make().eval())
    x = torch.randint(0, 100, (1, 12))
    for model in models:
        torch._dynamo.reset()
        out, fired = _fusions(model, x)
        assert not fired["skip_layer_normalization"] and not fired["skip_rms_normalization"], fired
        with torch.no_grad():
            torch.testing.assert_close(out, model(x).logits, rtol=1e-4, atol=1e-5)
    # The norms themselves are fused (the skip-norm fusions being the only ones left out).
    assert fired["rms_normalization"] > 0, fired


@pytest.mark.parametrize("fails", ["stitching the rewritten layers", "the fusions across cuts"])
def test_a_failing_layer_wise_rewrite_leaves_the_plain_model(monkeypatch, fails):
    """The rewrites are an optimization: where stitching the rewritten runs, or the
    fusions across their cuts, raise, the group runs its plain (or un-crossed) model."""
    from lort.translate import onnx_export

    if fails == "stitching the rewritten layers":
        stitched, calls = onnx_export._stitched, []

        def second_fails(*args):
            calls.append(1)
            if len(calls) == 2:  # the first stitches the plain translations
                raise RuntimeError("simulated stitching failure")
            return stitched(*args)

        monkeypatch.setattr(onnx_export, "_stitched", second_fails)
    else:
        def cross_fails(model):
            raise RuntimeError("simulated fusion failure")

        monkeypatch.setattr(_compat, "fuse_across_cuts", cross_fails)
    monkeypatch.setattr(repeated, "MIN_NODES", 50)
    model, x = _bert(layers=4)
    backend = lort.LortBackend({"disk_cache": False})
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(x).last_hidden_state
        eager = model(x).last_hidden_state
        ref = copy.deepcopy(model).double()(x).last_hidden_state
    assert_close_to_reference(out, eager, ref, f"4-layer BERT, {fails} failing")
    groups = [g for r in backend.records for g in r.groups]
    assert groups and backend.records[0].torch_nodes == 0
    if fails == "stitching the rewritten layers":
        assert all(g.fusions == {} for g in groups)
