"""lort.ORTModule binds the wrapped class's own methods to itself, as
onnxruntime-training's ORTModule does: ``self(...)`` inside ``generate`` or a custom
``predict`` runs through ORT. Generation through ORTModule gives eager's tokens."""

from __future__ import annotations

import logging

import torch
from torch import nn

import lort
from lort.testing.models import make_torchvision_importable


class Scorer(nn.Module):
    scale = 2.0  # a class attribute, read through the wrapper's class too

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        return self.lin(x).tanh()

    def predict(self, x):
        return self(x).argmax(-1)

    def scaled(self, x):
        return self.forward(x) * self.scale

    @torch.no_grad()
    def decorated(self, x):
        return self(x)

    def named(self):
        return type(self).__name__


class Child(Scorer):
    def predict(self, x):  # super() needs an instance of Scorer: bound to a view of the module
        return super().predict(x) + 0


def _wrapped(cls=Scorer):
    torch.manual_seed(0)
    module = cls()
    return lort.ORTModule(module, options={"executor": "ort"}), module


def test_user_methods_are_the_modules_functions_bound_to_the_wrapper():
    om, module = _wrapped()
    for name in ("predict", "scaled", "decorated"):
        method = getattr(om, name)
        assert method.__func__ is getattr(module, name).__func__
        assert method.__self__ is om, name
    # nn.Module's own methods and attributes are the wrapper's or the module's, as before.
    assert om.parameters().__next__() is module.lin.weight
    assert om.lin is module.lin and om.scale == 2.0
    assert type(om).scale == 2.0 and type(om).predict is Scorer.predict


def test_assigning_a_method_on_the_wrapper_leaves_the_users_module_alone():
    """As onnxruntime-training's ORTModule (which copied the class's methods onto itself):
    a method assigned on the wrapper stays there; a parameter goes to the wrapped module
    (which then captures again); deleting the assignment shows the module's method."""

    class UserNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.dummy = nn.Parameter(torch.zeros(1))

        def forward(self, a):
            return a + self.dummy

        def custom_method(self, a):
            return a

    def my_new_custom_method(self, a, b, c):
        return a + b + c

    pt_model = UserNet()
    ort_model = lort.ORTModule(pt_model, options={"executor": "ort"})
    ort_model.custom_method = my_new_custom_method.__get__(ort_model)
    assert ort_model.custom_method(1, 2, 3) == 6
    assert pt_model.custom_method(5) == 5 and "custom_method" not in pt_model.__dict__
    plain = lambda a: a * 10  # noqa: E731 - a function that is not a method, stored as it is
    ort_model.custom_method = plain
    assert ort_model.custom_method is plain and pt_model.custom_method(5) == 5

    x = torch.ones(2)
    torch.testing.assert_close(ort_model(x), x)
    ort_model.dummy = nn.Parameter(torch.full((1,), 2.0))
    assert pt_model.dummy is ort_model.dummy and "dummy" not in ort_model.__dict__
    torch.testing.assert_close(ort_model(x), x + 2)  # the module's new parameter, captured again
    ort_model.new_attribute = 7  # a new attribute reaches the module, as in onnxruntime-training
    assert pt_model.new_attribute == 7

    del ort_model.custom_method
    assert ort_model.custom_method(5) == 5 and ort_model.custom_method.__self__ is ort_model


def test_self_call_inside_a_user_method_runs_through_ort():
    om, module = _wrapped()
    x = torch.randn(3, 8)
    before = lort.stats.ort_runs
    with torch.no_grad():
        torch.testing.assert_close(om.predict(x), module.predict(x))
        torch.testing.assert_close(om.scaled(x), module.scaled(x))
        torch.testing.assert_close(om.decorated(x), module.decorated(x))
    assert lort.stats.ort_runs - before >= 3
    assert len(om.transition_manager.captures) >= 1
    assert om.named().startswith("ORTModule[")


def test_a_method_calling_super_runs_through_ort_on_a_view_of_the_module():
    """super() needs an instance of the defining class: the method is bound to the
    wrapper's view of the module (a subclass instance sharing the module's __dict__,
    called through the wrapper), so super() resolves and self(...) still runs in ORT."""
    om, module = _wrapped(Child)
    view = om.predict.__self__
    assert isinstance(view, Child) and view is not module
    assert view.__dict__ is module.__dict__  # its parameters, submodules and attributes
    assert om.predict.__func__ is Child.predict
    x = torch.randn(3, 8)
    before = lort.stats.ort_runs
    with torch.no_grad():
        torch.testing.assert_close(om.predict(x), module.predict(x))
    assert lort.stats.ort_runs - before >= 1
    view.note = 3  # an attribute written through the view is the module's
    assert module.note == 3


def _gpt2():
    make_torchvision_importable()
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=128,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def test_generate_through_ortmodule_gives_eagers_tokens_in_ort():
    """generate passes a DynamicCache that the forward updates: export would have written
    its fake tensors into the caller's cache (the logits came back fake); Dynamo's capture
    replays the update on the real one."""
    model = _gpt2()
    ids = torch.randint(1, 500, (1, 8), generator=torch.Generator().manual_seed(1))
    want = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
    om = lort.ORTModule(model, options={"executor": "ort"})
    before = lort.stats.ort_runs
    got = om.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    assert lort.stats.ort_runs - before >= 16  # prefill and every decode step in ORT
    # The prefill, then the decode step: captured again once with dynamic lengths.
    assert len(om.transition_manager.captures) <= 3, om.transition_manager.captures
    # A second generate (a new DynamicCache, another prompt) reuses the captures: the
    # cache is passed to the graph by reference, the schema depends on its class only.
    ids2 = torch.randint(1, 500, (1, 8), generator=torch.Generator().manual_seed(2))
    before = lort.stats.ort_runs
    got2 = om.generate(ids2, max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert torch.equal(got2, model.generate(ids2, max_new_tokens=16, do_sample=False, pad_token_id=0))
    assert lort.stats.ort_runs - before >= 16
    assert len(om.transition_manager.captures) <= 3, om.transition_manager.captures


def test_an_object_holding_state_is_passed_by_reference():
    """A stateful object (compared by identity, holding lists or tensors) is a leaf of its
    class in the schema and reaches the forward as itself, so a new one each call does
    not capture again, and what the forward writes into it lands in the caller's object."""

    class Memory:
        def __init__(self):
            self.items = []

    class Appends(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, memory):
            y = self.lin(x)
            memory.items.append(y)
            return y * 2

    model = Appends()
    om = lort.ORTModule(model, options={"executor": "ort"})
    before = lort.stats.ort_runs
    for seed in range(3):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(seed))
        mine, theirs = Memory(), Memory()
        with torch.no_grad():
            got = om(x, mine)
            want = model(x, theirs)
        torch.testing.assert_close(got, want)
        assert len(mine.items) == 1
        torch.testing.assert_close(mine.items[0], theirs.items[0])
    assert len(om.transition_manager.captures) == 1, om.transition_manager.captures
    assert lort.stats.ort_runs - before >= 3


def _t5():
    make_torchvision_importable()
    import transformers

    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=200, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return transformers.T5ForConditionalGeneration(cfg).eval()


def test_encoder_decoder_generate_through_both_front_ends_gives_eagers_tokens_in_ort():
    """T5: generate runs the encoder once (its own submodule) and each decoder step through
    the model's forward, with an EncoderDecoderCache of two DynamicCaches."""
    model = _t5()
    ids = torch.randint(2, 200, (1, 10), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    want = model.generate(ids, **kw)
    om = lort.ORTModule(model, options={"executor": "ort"})
    for _ in range(2):
        before = lort.stats.ort_runs
        assert torch.equal(om.generate(ids, **kw), want)
        assert lort.stats.ort_runs - before >= 12  # every decoder step in ORT
    assert len(om.transition_manager.captures) <= 3, om.transition_manager.captures
    forward = model.forward
    try:
        model.forward = torch.compile(forward, backend=lort.LortBackend({"executor": "ort"}))
        before = lort.stats.ort_runs
        assert torch.equal(model.generate(ids, **kw), want)
        assert lort.stats.ort_runs - before >= 12
    finally:
        model.forward = forward


def test_whisper_generate_which_calls_super_runs_through_ortmodule():
    """Whisper's generate calls super().generate: bound to the wrapper's view of the
    module, each decoder step still runs through ORT, with eager's tokens."""
    make_torchvision_importable()
    import transformers

    torch.manual_seed(0)
    cfg = transformers.WhisperConfig(
        vocab_size=200, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=50,
        max_target_positions=64, decoder_start_token_id=1, pad_token_id=0, eos_token_id=2, bos_token_id=1)
    model = transformers.WhisperForConditionalGeneration(cfg).eval()
    features = torch.randn(1, 16, 100, generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    want = model.generate(input_features=features, **kw)
    om = lort.ORTModule(model, options={"executor": "ort"})
    before = lort.stats.ort_runs
    assert torch.equal(om.generate(input_features=features, **kw), want)
    assert lort.stats.ort_runs - before >= 12
    assert len(om.transition_manager.captures) <= 3, om.transition_manager.captures


_log = logging.getLogger("lort.tests.logs")  # at module level, as libraries keep theirs


class Logs(nn.Module):
    """Logs in its forward, as transformers' models do (their causal LMs call
    ``logger.warning_once`` in every forward with labels)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        _log.warning("forward of %s", type(self).__name__)
        _log.info("input shape %s", tuple(x.shape))
        return self.lin(x).tanh()


def _assert_trains_in_ort_as_eager(model, call, loss_of):
    """ORTModule(model) makes ORT runs and no capture failure, and its loss and gradients
    match eager's (float32, against a float64 copy within eager's own error budget)."""
    import copy
    import warnings

    from test_models import assert_close_to_reference

    ref = copy.deepcopy(model).double()
    om = lort.ORTModule(copy.deepcopy(model))
    runs = lort.stats.ort_runs
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*capture or compile failed.*")
        loss_l = loss_of(call(om, torch.float32))
    loss_e, loss_r = loss_of(call(model, torch.float32)), loss_of(call(ref, torch.float64))
    assert lort.stats.ort_runs > runs, "nothing ran in ORT"
    assert_close_to_reference(loss_l, loss_e, loss_r, "loss")
    for loss in (loss_l, loss_e, loss_r):
        loss.backward()
    checked = 0
    for (name, p_e), p_l, p_r in zip(model.named_parameters(), om.parameters(), ref.parameters()):
        if p_e.grad is not None:
            assert_close_to_reference(p_l.grad, p_e.grad, p_r.grad, f"grad {name}")
            checked += 1
    assert checked


def test_logging_calls_in_forward_do_not_keep_a_module_out_of_ort():
    """A ``logging.Logger`` call in forward is a no-op in ORTModule's graph (as in
    torch.export; module/logging_calls.py), not a failed capture that runs the module in
    PyTorch. Dynamo's setting is the user's again after the call."""
    torch.manual_seed(0)
    x = torch.randn(3, 8)
    before = set(torch._dynamo.config.ignore_logging_functions)
    _assert_trains_in_ort_as_eager(Logs(), lambda m, dtype: m(x.to(dtype)), lambda out: out.pow(2).mean())
    assert set(torch._dynamo.config.ignore_logging_functions) == before


def test_a_causal_lm_with_labels_trains_through_ortmodule_in_ort():
    """transformers' GPT-2 LM head with labels (its forward calls ``logger.warning_once``
    about ``loss_type``): trained in PyTorch with no ORT run before."""
    make_torchvision_importable()
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 1000, (2, 16))
    _assert_trains_in_ort_as_eager(model, lambda m, dtype: m(input_ids=ids, labels=ids), lambda out: out.loss)
