"""lort.module.io: the one set of flatten/unflatten primitives of ORTModule."""

import collections
import dataclasses

import pytest
import torch

from lort.errors import UnsupportedInputError
from lort.module import io

Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    n: int = 2
    extra: list = dataclasses.field(default_factory=list)
    cached: object = dataclasses.field(default=None, init=False)


def _same(a, b):
    """Equal structure, types and constants; tensors identical objects."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a is b
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name))
    else:
        assert a == b


def _structures():
    t = [torch.randn(2) for _ in range(6)]
    batch = Batch(t[4], 3, [t[5], None])
    batch.cached = "set after init"
    return t, [
        t[0],
        None,
        3,
        2.5,
        True,
        "text",
        [t[0], (t[1], None, "s"), {"k": t[2], "n": 4}],
        collections.OrderedDict([("b", t[0]), ("a", 1.0)]),
        Pair(t[0], [t[1], t[2]]),
        {"batch": batch, "dtype": torch.float16, "dev": torch.device("cpu")},
        ((), [], {}),
    ]


@pytest.mark.parametrize("index", range(11))
def test_round_trip_restores_structure_types_and_constants(index):
    _, objs = _structures()
    obj = objs[index]
    tensors, spec = io.flatten(obj)
    hash(spec)  # specs are cache keys
    _same(io.unflatten(spec, tensors), obj)


def test_tensor_order_and_paths():
    t, _ = _structures()
    paths = []
    tensors, spec = io.flatten({"x": [t[0], {"y": t[1]}], "p": Pair(t[2], None)}, paths)
    assert [id(x) for x in tensors] == [id(t[0]), id(t[1]), id(t[2])]
    assert paths == ["x[0]", "x[1]['y']", "p.a"]


def test_model_output_round_trip():
    from lort.testing.models import make_torchvision_importable

    make_torchvision_importable()
    from transformers.modeling_outputs import SequenceClassifierOutput

    out = SequenceClassifierOutput(loss=torch.tensor(1.0), logits=torch.randn(2, 3))
    tensors, spec = io.flatten(out)
    assert spec[0] == "model_output" and spec[2] == ("loss", "logits")
    back = io.unflatten(spec, tensors)
    assert type(back) is SequenceClassifierOutput
    assert back.loss is out.loss and back.logits is out.logits and back.hidden_states is None
    assert back[0] is out.loss  # ModelOutput indexing still works


def test_call_spec_names_and_diff():
    x, m = torch.randn(2, 3), torch.ones(2, 3, dtype=torch.int64)
    names = ["input_ids", "attention_mask"]
    t1, s1 = io.flatten_call((x,), {"attention_mask": m, "flag": True}, names)
    t2, s2 = io.flatten_call((x,), {"attention_mask": m, "flag": False, "labels": x}, names)
    assert len(t1) == 2 and len(t2) == 3
    assert io.arg_paths(s2, names) == ["input_ids", "attention_mask", "labels"]
    assert io.diff_call(s1, s2, names) == [
        "input 'labels' passed (was omitted)",
        "input 'flag' value changed True -> False",
    ]
    _, s3 = io.flatten_call((x, m), {}, names)
    assert io.diff_call(s1, s3, names)[0] == "input 'attention_mask' passed positionally (was omitted)"
    _, s4 = io.flatten_call((x,), {"attention_mask": None, "flag": True}, names)
    assert io.diff_call(s1, s4, names) == ["input 'attention_mask' changed tensor -> None"]
    # Equal calls give equal specs; the same constant with another type does not.
    assert io.flatten_call((x,), {"attention_mask": m, "flag": True}, names)[1] == s1
    assert io.flatten_call((x,), {"attention_mask": m, "flag": 1}, names)[1] != s1


def test_unhashable_leaf_is_a_clear_error():
    class Opaque:
        __hash__ = None

    with pytest.raises(UnsupportedInputError, match="Opaque"):
        io.flatten([torch.randn(1), Opaque()])
    with pytest.raises(UnsupportedInputError, match="dict key"):
        io.flatten({object(): 1})


def test_tensor_only_calls_take_the_same_spec_without_walking():
    t = torch.zeros(2)
    for args in [(t,), (t, t, t), ()]:
        fast_tensors, fast_spec = io.flatten_call(args, {}, ["x"])
        walked_tensors, walked_spec = io.flatten_call(args, {}, ["x"], paths=[])
        assert fast_spec == walked_spec
        assert all(a is b for a, b in zip(fast_tensors, walked_tensors)) and len(fast_tensors) == len(args)
