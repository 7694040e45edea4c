import os

import pytest
import torch

from lort.testing.models import make_torchvision_importable

make_torchvision_importable()
torch.set_num_threads(min(2, os.cpu_count() or 1))
# Tests check what ORT computes: every group runs in ORT unless a test asks for
# executor="auto" (lort's default, which may time a group faster in PyTorch and run it
# there: correct either way, but then the test would compare PyTorch with itself).
os.environ["LORT_EXECUTOR"] = "ort"
# executor="auto" may also choose inductor, compiled in a subprocess after a graph's
# first call (compile/engines.py): tests of auto that do not test that leave it out, so
# that no compile runs on behind them; tests/test_engines.py turns it on.
os.environ["LORT_ENGINES"] = "ort,pytorch"
# No disk cache between tests (tests that monkeypatch translation or timing would read
# each other's entries); tests of the cache turn it on with a directory of their own.
os.environ["LORT_DISK_CACHE"] = "0"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch (Dynamo caches per code object)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
