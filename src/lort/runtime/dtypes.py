"""The one dtype table: every torch dtype lort sends to ORT, with its ONNX element type
(what IOBinding binds), ORT's type name (what its kernel registry lists) and the NumPy
dtype of synthetic timing inputs (None: that dtype is not timed)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx
import torch


class DType(NamedTuple):
    element_type: int
    ort_name: str
    numpy: type | None
    #: Sent to ORT on CUDA only (ORT's CPU provider lacks most of its kernels).
    cuda_only: bool = False


TABLE: dict[torch.dtype, DType] = {
    torch.float32: DType(onnx.TensorProto.FLOAT, "tensor(float)", np.float32),
    torch.float16: DType(onnx.TensorProto.FLOAT16, "tensor(float16)", np.float16),
    torch.bfloat16: DType(onnx.TensorProto.BFLOAT16, "tensor(bfloat16)", None, cuda_only=True),
    torch.float64: DType(onnx.TensorProto.DOUBLE, "tensor(double)", np.float64),
    torch.int64: DType(onnx.TensorProto.INT64, "tensor(int64)", np.int64),
    torch.int32: DType(onnx.TensorProto.INT32, "tensor(int32)", np.int32),
    torch.int16: DType(onnx.TensorProto.INT16, "tensor(int16)", np.int16),
    torch.int8: DType(onnx.TensorProto.INT8, "tensor(int8)", np.int8),
    torch.uint8: DType(onnx.TensorProto.UINT8, "tensor(uint8)", np.uint8),
    torch.bool: DType(onnx.TensorProto.BOOL, "tensor(bool)", np.bool_),
}

#: ONNX element types by torch dtype (IOBinding takes the ONNX enum, which covers
#: bfloat16, unlike NumPy dtypes, and binds faster).
ELEMENT_TYPES = {t: d.element_type for t, d in TABLE.items()}
#: dtypes lort sends to ORT on every device.
SUPPORTED_DTYPES = frozenset(t for t, d in TABLE.items() if not d.cuda_only)
#: dtypes lort sends to ORT's CUDA provider only (autocast's bfloat16).
CUDA_ONLY_DTYPES = frozenset(t for t, d in TABLE.items() if d.cuda_only)
