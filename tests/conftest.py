import os
import sys

import pytest
import torch

from lort.testing.models import make_torchvision_importable

make_torchvision_importable()
# The tests are in one folder per part of lort (ops, decompositions, fusion, backend,
# ortmodule, models, diagnostics, cuda); some import another's helpers by module name
# (test_models.assert_close_to_reference, test_run_fallback's broken fusion, ...): every
# folder is importable from every test.
_HERE = os.path.dirname(os.path.abspath(__file__))
for _name in sorted(os.listdir(_HERE)):
    _folder = os.path.join(_HERE, _name)
    if os.path.isdir(_folder) and not _name.startswith((".", "_")) and _folder not in sys.path:
        sys.path.append(_folder)
torch.set_num_threads(min(2, os.cpu_count() or 1))
# Tests check what ORT computes: every group runs in ORT unless a test asks for
# executor="auto" (lort's default, which may time a group faster in PyTorch and run it
# there: correct either way, but then the test would compare PyTorch with itself).
os.environ["LORT_EXECUTOR"] = "ort"
# executor="auto" may also choose inductor, compiled in a subprocess after a graph's
# first call (compile/engines.py): tests of auto that do not test that leave it out, so
# that no compile runs on behind them; tests/backend/test_engines.py turns it on.
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
