"""Hugging Face Trainer and accelerate with lort: the name ``onnxrt`` and ORTModule.

A 2-layer BERT (random weights from a config) trains 12 Trainer steps on a small
synthetic dataset, through ``torch_compile_backend="onnxrt"`` and as ``lort.ORTModule``,
against an eager Trainer run with the same seed, and against a float64 eager run.

Tolerances as in tests/ortmodule/test_ortmodule.py's BERT fine-tuning: AdamW turns float32
summation-order noise into full-size steps, so each step's loss (and gradient norm) must
match eager's within LOSS_RTOL, and lort's drift from the float64 run must stay within
ERR_FACTOR of eager float32's own drift.
"""

import copy
import inspect
import logging

import pytest
import torch

import lort
from lort.testing.models import make_torchvision_importable

make_torchvision_importable()
transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

STEPS = 12
BATCH = 4
SEQ = 16
LOSS_RTOL = 1e-3
ERR_FACTOR = 8.0


def _bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
        # Set, so the first loss computation does not set it (a change Dynamo's guards see:
        # the graph would be captured and compiled twice).
        problem_type="single_label_classification",
    )
    return transformers.BertForSequenceClassification(cfg)


def _dataset():
    """A list of dicts, as a tokenized dataset gives them (padding in some examples);
    4 batches, so 12 steps are 3 epochs and the loss falls."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(4 * BATCH):
        mask = torch.ones(SEQ, dtype=torch.int64)
        mask[SEQ - 1 - i % 7:] = 0
        rows.append({
            "input_ids": torch.randint(0, 1000, (SEQ,), generator=g),
            "attention_mask": mask,
            "labels": int(torch.randint(0, 3, (), generator=g)),
        })
    return rows


def _train(tmp_path, model, **args):
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=1e-3,
        logging_steps=1, report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True,
        **{"save_strategy": "no", **args},
    )
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=_dataset())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == STEPS
    return trainer, [h["loss"] for h in logs], [h["grad_norm"] for h in logs]


@pytest.fixture(scope="module")
def eager_runs(tmp_path_factory):
    """(losses, grad norms) of the eager float32 and float64 Trainer runs."""
    _, losses, norms = _train(tmp_path_factory.mktemp("eager"), _bert())
    _, losses64, _ = _train(tmp_path_factory.mktemp("eager64"), _bert().double())
    assert losses[-1] < losses[0]  # it trains
    return losses, norms, losses64


def assert_matches_eager(losses, norms, eager_runs):
    eager, eager_norms, f64 = eager_runs
    ours, eag, ref = (torch.tensor(x, dtype=torch.float64) for x in (losses, eager, f64))
    torch.testing.assert_close(ours, eag, rtol=LOSS_RTOL, atol=1e-6)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(eager_norms), rtol=LOSS_RTOL, atol=1e-6)
    drift_eager = ((eag - ref).abs() / ref.abs()).max().item()
    drift_ours = ((ours - ref).abs() / ref.abs()).max().item()
    assert drift_ours <= ERR_FACTOR * drift_eager + 1e-6, (drift_ours, drift_eager)


# -- the name onnxrt ------------------------------------------------------------------
def test_onnxrt_is_listed_and_served_by_lort():
    from torch._dynamo.backends.registry import lookup_backend

    from lort.registration import onnxrt_backend

    assert {"lort", "onnxrt"} <= set(torch._dynamo.list_backends())
    assert lookup_backend("onnxrt") is onnxrt_backend


def test_a_torch_with_its_own_onnxrt_keeps_it(monkeypatch):
    """Dynamo registers its own backends, then reads entry points; a name registered by
    torch resolves to torch's function, so lort's entry point does not shadow it."""
    from torch._dynamo.backends import registry

    def torch_own_onnxrt(gm, example_inputs):
        return gm.forward

    registry._lazy_import()
    monkeypatch.setitem(registry._COMPILER_FNS, "onnxrt", torch_own_onnxrt)
    monkeypatch.setitem(registry._BACKENDS, "onnxrt", None)
    registry._discover_entrypoint_backends.__wrapped__()  # the entry points, read again after it
    assert registry._BACKENDS["onnxrt"] is not None  # lort's entry point is seen...
    assert registry.lookup_backend("onnxrt") is torch_own_onnxrt  # ...and torch's own wins


def test_trainer_refuses_the_name_lort_so_onnxrt_is_the_one_to_use(tmp_path):
    # accelerate checks torch_compile_backend against its fixed DynamoBackend list
    # (README: "Hugging Face Trainer and accelerate").
    args = transformers.TrainingArguments(output_dir=str(tmp_path), torch_compile_backend="lort", use_cpu=True,
                                          report_to=[])
    with pytest.raises(ValueError, match="'LORT' is not a valid DynamoBackend"):
        transformers.Trainer(model=torch.nn.Linear(2, 2), args=args)
    with pytest.raises(ValueError, match="'LORT' is not a valid DynamoBackend"):
        accelerate.Accelerator(dynamo_backend="lort", cpu=True)
    assert accelerate.utils.DynamoBackend("ONNXRT").value.lower() == "onnxrt"


def test_onnxrt_takes_modes_as_lort_does():
    model = torch.nn.Linear(3, 2)
    x = torch.randn(2, 3)
    runs = lort.stats.ort_runs
    torch.testing.assert_close(torch.compile(model, backend="onnxrt", mode="max-autotune")(x), model(x))
    assert lort.stats.ort_runs > runs
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"backend='onnxrt', mode='turbo'\): not a mode lort knows"):
        torch.compile(model, backend="onnxrt", mode="turbo")(x)


def test_trainer_torch_compile_onnxrt_12_steps_matches_eager(tmp_path, monkeypatch, caplog, eager_runs):
    import lort.registration

    monkeypatch.setenv("LORT_EXECUTOR", "ort")  # options reach lort through the environment
    monkeypatch.setattr(lort.registration, "_announced", False)
    runs = lort.stats.ort_runs
    with caplog.at_level(logging.INFO, logger="lort"):
        trainer, losses, norms = _train(tmp_path, _bert(), torch_compile=True, torch_compile_backend="onnxrt")
    assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    assert lort.stats.ort_runs - runs >= 2 * STEPS  # each step's forward and backward ran in ORT
    served = [r for r in caplog.records if "'onnxrt' is served by lort" in r.getMessage()]
    assert len(served) == 1 and served[0].levelno == logging.INFO
    assert_matches_eager(losses, norms, eager_runs)


@pytest.mark.parametrize("how", ["dynamo_backend", "plugin_options"])
def test_accelerator_dynamo_backend_onnxrt_runs_lort(monkeypatch, how, fresh_accelerate_state):
    # A fresh accelerate state: an Accelerator's dynamo plugin is process state, and the
    # second case's plugin (its options) would otherwise be the first case's.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    eager = copy.deepcopy(model)
    if how == "dynamo_backend":
        monkeypatch.setenv("LORT_EXECUTOR", "ort")  # options through the environment
        acc = accelerate.Accelerator(dynamo_backend="onnxrt", cpu=True)
    else:
        monkeypatch.setenv("LORT_EXECUTOR", "auto")  # the plugin's options win over it
        plugin = accelerate.utils.TorchDynamoPlugin(backend="onnxrt", options={"executor": "ort"})
        acc = accelerate.Accelerator(dynamo_plugin=plugin, cpu=True)
    prepared = acc.prepare(model)
    x = torch.randn(5, 8)
    runs = lort.stats.ort_runs
    out = prepared(x)
    out.square().sum().backward()
    eager(x).square().sum().backward()
    assert lort.stats.ort_runs - runs >= 2  # forward and backward
    torch.testing.assert_close(out, eager(x), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


# -- ORTModule under Trainer and accelerate ---------------------------------------------
def test_trainer_with_ortmodule_12_steps_matches_eager_and_saves(tmp_path, monkeypatch, eager_runs):
    from safetensors.torch import load_file

    monkeypatch.setenv("LORT_EXECUTOR", "ort")
    model = _bert()
    om = lort.ORTModule(model)
    runs = lort.stats.ort_runs
    trainer, losses, norms = _train(tmp_path, om, save_strategy="steps", save_steps=STEPS)
    assert trainer.model is om
    assert lort.stats.ort_runs - runs >= 2 * STEPS  # each step's forward and backward ran in ORT
    # Trainer read the wrapped model's labels off type(model).forward, as for the model itself.
    assert trainer.label_names == ["labels"] and trainer.can_return_loss is False
    assert_matches_eager(losses, norms, eager_runs)
    # The checkpoint holds the wrapped model's weights under its own names (Trainer saves a
    # model that accelerate does not unwrap to a PreTrainedModel as its state dict alone).
    checkpoint = tmp_path / f"checkpoint-{STEPS}"
    assert not (checkpoint / "config.json").exists()
    saved = load_file(str(checkpoint / "model.safetensors"))
    state = model.state_dict()
    assert sorted(saved) == sorted(state)
    for name, value in state.items():
        assert torch.equal(saved[name], value), name
    fresh = _bert()
    fresh.load_state_dict(saved)
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), model.parameters()))


def test_ortmodule_forward_signature_is_the_wrapped_models():
    model = _bert()
    om = lort.ORTModule(model)
    assert inspect.signature(om.forward) == inspect.signature(model.forward)
    assert "labels" in inspect.signature(om.forward).parameters
    # Trainer's find_labels and can_return_loss read the class's forward.
    from transformers.utils.generic import can_return_loss, find_labels

    assert find_labels(type(om)) == find_labels(type(model)) == ["labels"]
    assert can_return_loss(type(om)) == can_return_loss(type(model))
    qa = lort.ORTModule(transformers.BertForQuestionAnswering(model.config))
    assert find_labels(type(qa)) == ["start_positions", "end_positions"]
    # Still an ORTModule; one class per wrapped class; plain modules keep their signature too.
    assert isinstance(om, lort.ORTModule) and type(lort.ORTModule(_bert())) is type(om)
    lin = torch.nn.Linear(2, 2)
    assert inspect.signature(lort.ORTModule(lin).forward) == inspect.signature(lin.forward)


def test_ortmodule_attributes_trainer_and_accelerate_read(tmp_path):
    model = _bert()
    om = lort.ORTModule(model)
    assert om.main_input_name == model.main_input_name == "input_ids"
    assert om.config is model.config
    assert om.can_generate() == model.can_generate()
    assert om._keys_to_ignore_on_save == model._keys_to_ignore_on_save
    assert hasattr(om, "accepts_loss_kwargs") == hasattr(model, "accepts_loss_kwargs")
    # Trainer's gradient_checkpointing=True calls one of these (the first is deprecated in 5.x):
    # the model's functions bound to the wrapper (as onnxruntime-training binds them), which
    # act on the wrapped model's submodules.
    for name in ("gradient_checkpointing_enable", "activation_checkpointing_enable"):
        method = getattr(om, name)
        assert method.__func__ is getattr(model, name).__func__ and method.__self__ is om
    om.activation_checkpointing_enable()
    assert model.is_activation_checkpointing and om.is_activation_checkpointing
    # save_pretrained / from_pretrained of the wrapped model: config and weights, its names.
    om.save_pretrained(str(tmp_path))
    loaded = om.from_pretrained(str(tmp_path))
    assert type(loaded) is type(model) and loaded.config.num_labels == 3
    assert [n for n, _ in loaded.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(torch.equal(p, q) for p, q in zip(loaded.parameters(), model.parameters()))


def test_accelerate_unwrap_keeps_ortmodule():
    """ORTModule is the model that runs (not a parallel container): accelerate's unwrap
    returns it, as it returns a plain model; recursive unwrapping (``.module``) reaches the
    wrapped model."""
    from accelerate.utils import extract_model_from_parallel

    model = _bert()
    om = lort.ORTModule(model)
    assert extract_model_from_parallel(om) is om
    assert extract_model_from_parallel(om, keep_torch_compile=False) is om
    assert accelerate.Accelerator(cpu=True).unwrap_model(om) is om
    assert extract_model_from_parallel(om, recursive=True) is model


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps its state (mixed precision included) per process: start anew."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_accelerate_autocast_wraps_the_wrapper_and_unwraps(fresh_accelerate_state):
    """accelerate's mixed precision replaces ``model.forward`` (keeping ``_original_forward``):
    on an ORTModule that wraps the wrapper's forward, not the wrapped model's (which would
    call the wrapper back), and unwrapping with keep_fp32_wrapper=False restores it."""
    from accelerate.utils import extract_model_from_parallel

    model = _bert()
    om = lort.ORTModule(model)
    prepared = accelerate.Accelerator(cpu=True, mixed_precision="bf16").prepare(om)
    assert prepared is om
    assert "forward" in om.__dict__ and "_original_forward" in om.__dict__
    assert "forward" not in model.__dict__ and "_original_forward" not in model.__dict__
    assert inspect.signature(om.forward) == inspect.signature(model.forward)
    assert extract_model_from_parallel(om, keep_fp32_wrapper=False) is om
    assert "_original_forward" not in om.__dict__
