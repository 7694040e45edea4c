"""Complex tensors in ORT groups: FFTs and the complex ops torch_lib translates run in ORT
as float pairs (fusion/fuser.py's group boundary, fusion/support.py's complex rules),
against eager PyTorch on the same inputs: outputs, and the gradients of the real inputs."""

from __future__ import annotations

import pytest
import torch

import lort
from lort.backend import LortBackend

OPTS = {"executor": "ort", "mode": "ort", "disk_cache": False, "progress": False}


def _loss(out: torch.Tensor) -> torch.Tensor:
    w = torch.linspace(-1.0, 1.0, out.numel()).reshape(out.shape)
    real = torch.view_as_real(out.resolve_conj()).sum(-1) if out.is_complex() else out
    return (real * w).sum()


CASES = {
    "rfft": lambda x: torch.fft.rfft(x, dim=-1).abs(),
    "rfft_ortho_n": lambda x: torch.view_as_real(torch.fft.rfft(x, n=12, dim=1, norm="ortho")),
    "fft_of_real": lambda x: torch.fft.fft(x, dim=-1) * torch.fft.fft(x, dim=-1),
    "ifft": lambda x: torch.fft.ifft(torch.fft.rfft(x), n=9, norm="forward"),
    "irfft_roundtrip": lambda x: torch.fft.irfft(torch.fft.rfft(x) * torch.fft.rfft(x).conj(), n=x.shape[-1]),
    "rfft2": lambda x: torch.fft.rfft2(x).abs() + 1,
    "fftn": lambda x: torch.fft.fftn(x, s=(3, 10), dim=(1, 2)),
    "hfft": lambda x: torch.fft.hfft(torch.fft.rfft(x), n=8),
    "ihfft": lambda x: torch.fft.ihfft(x, dim=1),
    "scaled_and_padded": lambda x: torch.nn.functional.pad(torch.fft.rfft(x) * 0.5 + 2.0 - 1.5j * torch.fft.rfft(x),
                                                           (1, 2)) / 3.0,
    "stft": lambda x: torch.stft(x.flatten(1), n_fft=8, hop_length=4, return_complex=True, window=torch.hann_window(8)).abs(),
}


def _results(fn, x):
    xe, xl = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = fn(xe)
    _loss(expected).backward()
    backend = LortBackend(OPTS)
    got = torch.compile(fn, backend=backend)(xl)
    _loss(got).backward()
    return got, expected, xl.grad, xe.grad, backend


@pytest.mark.parametrize("name", list(CASES))
def test_fft_against_eager(name):
    torch.manual_seed(0)
    x = torch.randn(3, 6, 8)
    got, expected, got_grad, exp_grad, backend = _results(CASES[name], x)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5 * scale)
    gscale = exp_grad.abs().max().item()
    torch.testing.assert_close(got_grad, exp_grad, rtol=1e-4, atol=1e-5 * gscale)
    fft_nodes_in_torch = [op for r in backend.records for op, _ in r.fallbacks if "_fft_" in op]
    assert not fft_nodes_in_torch, fft_nodes_in_torch
    assert sum(r.ort_nodes for r in backend.records if r.kind == "forward") > 0


def test_complex_inputs_and_outputs_cross_as_float_pairs():
    """A complex input (with its conjugate bit set, which view_as_real refuses) enters as
    float pairs and a complex output leaves as a complex tensor."""
    torch.manual_seed(0)
    z = torch.randn(4, 8, dtype=torch.complex64)
    w = torch.randn(4, 8, dtype=torch.complex64)

    def fn(a, b):
        return torch.fft.fft(a * b, dim=-1)

    backend = LortBackend(OPTS)
    compiled = torch.compile(fn, backend=backend)
    for a in (z, z.conj(), z.conj().t().contiguous().t()):
        got = compiled(a, w)
        torch.testing.assert_close(got, fn(a, w), rtol=1e-5, atol=1e-5)
    (record,) = backend.records[:1]
    assert record.torch_nodes == 0, record.fallbacks


def test_complex128():
    torch.manual_seed(0)
    x = torch.randn(2, 16, dtype=torch.float64)
    fn = CASES["irfft_roundtrip"]
    got, expected, got_grad, exp_grad, _ = _results(fn, x)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_grad, exp_grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "fn, op, why",
    [
        (lambda x: torch.nn.functional.pad(torch.fft.rfft(x), (1, 2), value=2.0), "aten.constant_pad_nd.default",
         "other than 0"),
        (lambda x: torch.fft.rfft(x) * x[..., :5], "aten.mul.Tensor", "mixes complex and real"),
        (lambda x: torch.complex(x, x) + 1j, "aten.complex.default", "makes a complex tensor from real ones"),
    ],
)
def test_what_torch_lib_cannot_take_as_float_pairs_stays_in_pytorch(fn, op, why):
    """A real tensor beside a complex one (torch_lib's complex translations take float
    pairs for every tensor), padding by a value other than 0 (lort's complex pad pads both
    parts alike), and a complex tensor made from real ones by an op whose real translation
    would build an ONNX complex type, stay in PyTorch, with the reason; the result is
    eager's."""
    torch.manual_seed(0)
    x = torch.randn(3, 8)
    backend = LortBackend(OPTS)
    torch.testing.assert_close(torch.compile(fn, backend=backend)(x), fn(x))
    reasons = [str(reason) for r in backend.records for o, reason in r.fallbacks if o == op]
    assert reasons and all(why in r for r in reasons), [r.fallbacks for r in backend.records]


class Spectrum(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(9, 4)

    def forward(self, x):
        return self.proj(torch.fft.rfft(x, dim=-1).abs())


def test_ortmodule_inference_over_an_fft():
    torch.manual_seed(0)
    model = Spectrum().eval()
    x = torch.randn(5, 16)
    om = lort.ORTModule(model)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(om(x), model(x), rtol=1e-5, atol=1e-5)
