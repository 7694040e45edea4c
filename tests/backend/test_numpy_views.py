"""lort reads users' tensors through lort.numpy_views.numpy_view, never Tensor.numpy(),
which marks a storage as not resizable for good (FSDP2 frees unsharded parameters with
``untyped_storage().resize_(0)``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lort
from lort.numpy_views import numpy_view
from lort.runtime import native


def test_numpy_view_is_the_tensors_memory_and_leaves_it_resizable():
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = numpy_view(t[:, ::2])
    assert view.strides == (24, 8) and view.ctypes.data == t.data_ptr()
    np.testing.assert_array_equal(view, t[:, ::2].clone().numpy())
    view[0, 1] = -1.0
    assert t[0, 2].item() == -1.0
    assert t.untyped_storage().resizable()
    assert numpy_view(torch.zeros(0, 3)).shape == (0, 3)
    assert numpy_view(torch.tensor(2.5, dtype=torch.float16)).item() == 2.5


def test_numpy_view_keeps_its_tensor_alive():
    view = numpy_view(torch.full((1000,), 3.0))
    import gc

    gc.collect()
    assert float(view.sum()) == 3000.0


def test_numpy_view_refuses_other_devices():
    with pytest.raises(ValueError, match="CPU tensor"):
        numpy_view(torch.zeros(2, device="meta"))


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _storages_resizable(*tensors):
    return [t.untyped_storage().resizable() for t in tensors]


@pytest.mark.parametrize("python_check", [False, True], ids=["cpp-or-python-check", "python-check"])
def test_frozen_weights_and_timing_feeds_leave_user_tensors_resizable(python_check, monkeypatch, tmp_path):
    if python_check:
        monkeypatch.setattr(native, "load", lambda: None)
    x = torch.randn(8, 16)
    net = _net()
    compiled = torch.compile(net, backend="lort", options={"freeze": True, "save_onnx": str(tmp_path)})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), net(x))
    assert list((tmp_path).glob("*.onnx")), "save_onnx wrote nothing"
    assert all(_storages_resizable(x, *net.parameters()))
    torch._dynamo.reset()


def test_training_and_ortmodule_leave_user_tensors_resizable():
    x = torch.randn(8, 16)
    net = _net()
    compiled = torch.compile(net, backend="lort")  # executor 'auto' times groups on the real weights
    compiled(x).sum().backward()
    ort_net = _net()
    module = lort.ORTModule(ort_net)
    module(x).sum().backward()
    with torch.no_grad():
        module.eval()
        module(x)
    assert all(_storages_resizable(x, *net.parameters(), *ort_net.parameters()))
    torch._dynamo.reset()
