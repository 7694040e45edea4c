import os

import pytest
import torch

from lort.testing.models import make_torchvision_importable

make_torchvision_importable()
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch (Dynamo caches per code object)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
