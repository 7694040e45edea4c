"""Serializing an ONNX model with its large initializers outside its bytes (an
``OnnxModel``, lort/ort_model.py), and saving one as ONNX external data.

Protobuf messages stop at 2 GB, and serializing a model that holds a model's weights
copies every one of them. A model with frozen weights (compile/freezing.py) is
serialized with each large initializer declared as external data instead
(``EXTERNAL_LOCATION``, no file behind it), and the tensors that hold the data travel
beside the bytes. The runtime hands them to ORT from their own memory
(runtime/session.py): ORT reads them there, and copies only what its optimizer folds
or its kernels pre-pack.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnx_ir as ir
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..numpy_views import numpy_view
from ..ort_model import OnnxModel, model_bytes

#: The location every externalized initializer names. No file has it: ORT gets the data
#: from memory (SessionOptions.add_external_initializers), never from a path.
EXTERNAL_LOCATION = "lort-initializers-in-memory"
#: Initializers of at least this many bytes leave the model's bytes.
EXTERNAL_MIN_BYTES = 1024


def serialize(model: ir.Model, min_bytes: int = EXTERNAL_MIN_BYTES) -> OnnxModel:
    """``model`` serialized with every initializer of ``min_bytes`` or more declared as
    external data, held by the returned value's tensors (the initializers' own memory:
    a NumPy array over a weight's memory stays that weight's memory). ``model`` is left
    as it was."""
    swapped: list[tuple[ir.Value, object]] = []
    external = []
    try:
        for value in model.graph.initializers.values():
            data = value.const_value
            if data is None or data.nbytes < min_bytes:
                continue
            tensor = _torch_view(data)
            if tensor is None:  # no memory to point ORT at (a lazily loaded tensor): embedded
                continue
            swapped.append((value, data))
            value.const_value = ir.ExternalTensor(
                EXTERNAL_LOCATION, None, data.nbytes, data.dtype, shape=data.shape, name=value.name,
            )
            external.append((value.name, tensor, int(data.dtype)))
        proto = ir.serde.serialize_model(model).SerializeToString()
    finally:
        for value, data in swapped:
            value.const_value = data
    return OnnxModel(proto, tuple(external))


def _torch_view(data) -> torch.Tensor | None:
    """A contiguous tensor over ``data``'s memory (a copy where it is not contiguous); a
    real one, also while compiling under FakeTensorMode."""
    with unset_fake_temporarily():
        return _real_view(getattr(data, "raw", None))


def _real_view(raw) -> torch.Tensor | None:
    if isinstance(raw, torch.Tensor):
        return raw.detach().contiguous()
    if isinstance(raw, np.ndarray):
        array = raw if raw.flags.c_contiguous else np.ascontiguousarray(raw)
        try:
            return torch.from_numpy(array)
        except TypeError:  # a dtype torch has no type for (ml_dtypes' bfloat16, say)
            return torch.from_numpy(array.view(np.dtype(f"u{array.itemsize}"))) if array.itemsize in (1, 2, 4, 8) else None
    return None


def save(model: OnnxModel | bytes, path: str) -> None:
    """Write ``model`` to ``path``, its external initializers into ``path + ".data"``
    (ONNX external data, loadable with onnx.load or by ORT from the path)."""
    if not isinstance(model, OnnxModel) or not model.external:
        with open(path, "wb") as f:
            f.write(model_bytes(model))
        return
    proto = onnx.ModelProto.FromString(model.proto)
    data_name = os.path.basename(path) + ".data"
    offsets = {}
    with open(path + ".data", "wb") as f, unset_fake_temporarily():
        for name, t, _ in model.external:
            offset = f.tell()
            f.write(memoryview(numpy_view(t.detach().cpu().contiguous().view(torch.uint8).reshape(-1))))
            offsets[name] = (offset, f.tell() - offset)
            pad = (-f.tell()) % 64  # ORT maps aligned data without a copy
            f.write(b"\0" * pad)
    for init in proto.graph.initializer:
        if init.name in offsets:
            offset, length = offsets[init.name]
            del init.external_data[:]
            for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(length))):
                entry = init.external_data.add()
                entry.key, entry.value = key, value
    with open(path, "wb") as f:
        f.write(proto.SerializeToString())


def initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """A new initializer of ``graph`` holding ``array`` (by reference), named ``name``
    or, where that is taken, ``name`` with underscores added."""
    while name in graph.initializers:
        name += "_"
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                     const_value=ir.Tensor(array, name=name))
    graph.register_initializer(value)
    return value
