"""Translations that differed from PyTorch on extreme values (NaN, inf, signed zero,
values near the dtype's limits), found by the conformance sweep's extreme-value sample
(lort.testing.conformance_extreme): each op through lort against eager PyTorch."""

import math

import pytest
import torch

from lort.backend import LortBackend

NAN, INF = math.nan, math.inf
DTYPES = [torch.float32, torch.float64]


def _through_lort(fn, *args):
    """fn(*args) through lort (every group in ORT) and eager's result."""
    backend = LortBackend({"executor": "ort", "disk_cache": False})
    torch._dynamo.reset()
    try:
        got = torch.compile(fn, backend=backend)(*args)
    finally:
        torch._dynamo.reset()
    return got, fn(*args)


def _same(got, expected):
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fn", [
    lambda x: x + 1e-8, lambda x: x - 1e-9, lambda x: 1e-8 + x, lambda x: x * 1.000001, lambda x: x / 1.000001,
])
def test_constants_near_zero_or_one_are_not_no_ops(fn):
    # onnxscript's optimizer took c within 1e-8 of 0 (1e-5 relative of 1) for a no-op.
    _same(*_through_lort(fn, torch.tensor([0.0, 1.0, 3.0])))


def test_isclose_of_tiny_differences():
    got, expected = _through_lort(torch.isclose, torch.tensor([-0.0, 1e-30, INF, NAN]),
                                  torch.tensor([1e-30, 0.0, INF, NAN]))
    assert got.tolist() == expected.tolist() == [True, True, True, False]