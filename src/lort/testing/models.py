"""The models lort is tested and benchmarked on, with random weights from configs.

Nothing here downloads weights or data. ``make_torchvision_importable`` works around
PyPI's torchvision wheel, which is built against CUDA torch and fails to import beside
the CPU build of torch ("operator torchvision::nms does not exist") while registering
its C++ operators' meta kernels; timm and transformers import torchvision, and use none
of those operators in the models here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import types
from typing import Callable

import torch
from torch import nn


def make_torchvision_importable() -> None:
    """Let ``import torchvision`` succeed when its compiled ops cannot load."""
    if "torchvision" in sys.modules:
        return
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    import os

    so = [f for f in os.listdir(spec.submodule_search_locations[0]) if f.startswith("_C") and f.endswith(".so")]
    try:
        for f in so:
            torch.ops.load_library(os.path.join(spec.submodule_search_locations[0], f))
        return  # a working torchvision: nothing to do
    except OSError:
        pass
    for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
        sys.modules.setdefault(name, types.ModuleType(name))


class MLP(nn.Module):
    def __init__(self, d_in=64, hidden=256, d_out=10, layers=3):
        super().__init__()
        dims = [d_in] + [hidden] * layers
        blocks = []
        for a, b in zip(dims, dims[1:]):
            blocks += [nn.Linear(a, b), nn.GELU(), nn.LayerNorm(b)]
        self.body = nn.Sequential(*blocks)
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.head(self.body(x))


class SmallCNN(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, stride=2, padding=1, groups=4), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.fc = nn.Linear(32, classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.features(x), 1))


class TransformerBlock(nn.Module):
    def __init__(self, d=64, heads=4, ff=128, layers=2):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True, activation="gelu")
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        return self.out(self.encoder(x))


def bert(batch=1, seq=32, layers=2, hidden=64, heads=4, seed=0):
    make_torchvision_importable()
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        vocab_size=1000, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=hidden * 4, max_position_embeddings=128,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertModel(cfg, add_pooling_layer=False)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.int64)
    return model, (ids, mask)


def gpt2(batch=1, seq=32, layers=2, hidden=64, heads=4, seed=0):
    make_torchvision_importable()
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        vocab_size=1000, n_positions=128, n_embd=hidden, n_layer=layers, n_head=heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    model = transformers.GPT2Model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    return model, (ids,)


def llama(batch=1, seq=32, layers=2, hidden=64, heads=4, kv_heads=2, seed=0):
    """A Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU."""
    make_torchvision_importable()
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128,
    )
    model = transformers.LlamaModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    return model, (ids,)


def timm_model(name="resnet18", batch=1, size=64, seed=0, **kwargs):
    make_torchvision_importable()
    import timm

    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
    return model, (torch.randn(batch, 3, size, size),)


@dataclasses.dataclass
class Case:
    """A model and inputs at a batch size, and how to reduce its output to a loss."""

    name: str
    build: Callable[[int], tuple[nn.Module, tuple]]

    def make(self, batch: int = 1, seed: int = 0) -> tuple[nn.Module, tuple]:
        torch.manual_seed(seed)
        return self.build(batch)


def output_tensor(out) -> torch.Tensor:
    """The main tensor of a model's output (transformers return a ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state
    if hasattr(out, "logits"):
        return out.logits
    return out[0]


CASES = {
    "mlp": Case("mlp", lambda b: (MLP(), (torch.randn(b, 64),))),
    "cnn": Case("cnn", lambda b: (SmallCNN(), (torch.randn(b, 3, 32, 32),))),
    "transformer": Case("transformer", lambda b: (TransformerBlock(), (torch.randn(b, 32, 64),))),
    "bert": Case("bert", lambda b: bert(batch=b)),
    "resnet18": Case("resnet18", lambda b: timm_model("resnet18", batch=b)),
    "gpt2": Case("gpt2", lambda b: gpt2(batch=b)),
    "llama": Case("llama", lambda b: llama(batch=b)),
    "resnet50": Case("resnet50", lambda b: timm_model("resnet50", batch=b)),
    "mobilenetv3": Case("mobilenetv3", lambda b: timm_model("mobilenetv3_small_100", batch=b)),
    "vit": Case("vit", lambda b: timm_model("vit_tiny_patch16_224", batch=b, img_size=64)),
    # Issue 31's families: SiLU with depthwise convolutions and squeeze-excitation, a
    # GELU/LayerNorm CNN, SiLU convolutions with transformer blocks, a convolution-
    # attention vision transformer (Hardswish), grouped convolutions with squeeze-excitation.
    "efficientnet": Case("efficientnet", lambda b: timm_model("efficientnet_b0", batch=b)),
    "convnext": Case("convnext", lambda b: timm_model("convnext_atto", batch=b)),
    "mobilevit": Case("mobilevit", lambda b: timm_model("mobilevit_xxs", batch=b)),
    "levit": Case("levit", lambda b: timm_model("levit_128s", batch=b, img_size=64)),
    "regnety": Case("regnety", lambda b: timm_model("regnety_002", batch=b)),
}


def _no_cache(made):
    """A decoder (model, args) whose forward returns no key/value cache (``config.use_cache``
    off): a forward pass over the whole sequence, as benchmarked. With the cache on, the
    whole-model export failed on the GPU image (torch 2.11, transformers 5.17: no pytree for
    DynamicCache)."""
    made[0].config.use_cache = False
    return made


#: The models at the sizes issue 10 benchmarks on CUDA (python -m benchmarks cuda,
#: python -m benchmarks cuda-memory): BERT and GPT-2 with 6 layers of 768, a Llama-style decoder
#: with 4 layers of 1024 and grouped-query attention (16 heads, 4 key/value heads), all
#: on 128 tokens, the decoders without a key/value cache; ResNet-50 and ViT-S/16 at 224 px.
CUDA_CASES = {
    "bert": Case("bert", lambda b: bert(batch=b, seq=128, layers=6, hidden=768, heads=12)),
    "gpt2": Case("gpt2", lambda b: _no_cache(gpt2(batch=b, seq=128, layers=6, hidden=768, heads=12))),
    "llama": Case("llama", lambda b: _no_cache(llama(batch=b, seq=128, layers=4, hidden=1024, heads=16,
                                                     kv_heads=4))),
    "resnet50": Case("resnet50", lambda b: timm_model("resnet50", batch=b, size=224)),
    "vit_s16": Case("vit_s16", lambda b: timm_model("vit_small_patch16_224", batch=b, size=224)),
}


def bert_base(batch=1, seq=128, seed=0):
    """transformers' BERT-base (BertConfig()'s defaults: 12 layers of 768, 110M parameters)."""
    make_torchvision_importable()
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.BertConfig()
    model = transformers.BertModel(cfg)
    return model, (torch.randint(0, cfg.vocab_size, (batch, seq)),)


def gpt2_small(batch=1, seq=128, seed=0):
    """transformers' GPT-2 small with its LM head (GPT2Config()'s defaults, 124M
    parameters); called with ``labels``, it returns its language-model loss."""
    make_torchvision_importable()
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config()
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    return model, (ids,), {"labels": ids}


def _llama_causal_lm(batch, seq, seed, **shape):
    """A LlamaForCausalLM of ``shape`` (hidden_size, intermediate_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads) with random weights, a 32000-token
    vocabulary and an untied head, and ``batch`` x ``seq`` random token ids."""
    make_torchvision_importable()
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False, **shape)
    model = transformers.LlamaForCausalLM(cfg)
    return model, torch.randint(0, cfg.vocab_size, (batch, seq))


def llama_2gb(batch=1, seq=128, layers=18, seed=0):
    """A Llama-style causal LM past 2 GB of float32 weights: hidden 2048, SwiGLU 5632,
    32 heads with 4 key/value heads, a 32000-token vocabulary, untied head (18 layers:
    0.92B parameters, 3.7 GB). Called with ``use_cache=False`` (one forward over the
    prompt, as in scoring or a prefill)."""
    model, ids = _llama_causal_lm(batch, seq, seed, hidden_size=2048, intermediate_size=5632,
                                  num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4)
    return model, (ids,), {"use_cache": False}


def llama_small(batch=1, seq=128, seed=0):
    """A Llama-style causal LM of 0.2B parameters, trained as one: hidden 1024, SwiGLU
    2816, 12 layers, 16 heads with 4 key/value heads, a 32000-token vocabulary, untied
    head (201M parameters, 0.80 GB). Called with ``labels`` (its language-model loss) and
    ``use_cache=False``."""
    model, ids = _llama_causal_lm(batch, seq, seed, hidden_size=1024, intermediate_size=2816,
                                  num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4)
    return model, (ids,), {"labels": ids, "use_cache": False}


#: The models at the sizes users run (python -m benchmarks scale): each builder returns
#: (model, args, kwargs).
SCALE_CASES = {
    "bert_base": lambda b=1: (*bert_base(batch=b), {}),
    "gpt2_small": lambda b=1: gpt2_small(batch=b),
    "llama_2gb": lambda b=1: llama_2gb(batch=b),
}

#: The cases of the engine benchmarks at real sizes (python -m benchmarks training and
#: batched): each builder takes the batch and returns (model, args, kwargs); ``ENGINE_SAMPLE``
#: says what one sample of each is.
ENGINE_CASES = {
    "bert_base": lambda b: (*bert_base(batch=b), {}),
    "gpt2_small": lambda b: gpt2_small(batch=b),
    "resnet50": lambda b: (*timm_model("resnet50", batch=b, size=224), {}),
    "vit_small": lambda b: (*timm_model("vit_small_patch16_224", batch=b, size=224), {}),
    "llama_small": lambda b: llama_small(batch=b),
}
ENGINE_SAMPLE = {"bert_base": "x 128", "gpt2_small": "x 128", "resnet50": "at 224 px", "vit_small": "at 224 px",
                 "llama_small": "x 128"}
