"""Typed reasons: what stays in PyTorch says why with a kind, which the disk cache keeps
and explain counts, and the bisect's verdicts are warned about again from the cache."""

from __future__ import annotations

import pickle
import warnings

import torch

import lort
from lort.backend import LortBackend
from lort.reasons import Placement, Reason, ReasonKind


def _f(x):
    # dropout: random; to(bfloat16) on CPU: a dtype ORT's CPU provider lacks; add_: mutation.
    y = torch.nn.functional.dropout(x.sin(), 0.5, training=True).cos()
    return y + x.to(torch.bfloat16).float().exp()


def test_reason_is_its_text_with_a_kind():
    r = Reason(ReasonKind.DTYPE, "output 0 has dtype torch.bfloat16")
    assert r == "output 0 has dtype torch.bfloat16" and "bfloat16" in r and r.kind is ReasonKind.DTYPE
    assert Reason.from_json(r.to_json()) == r and Reason.from_json(r.to_json()).kind is ReasonKind.DTYPE
    back = pickle.loads(pickle.dumps(r))
    assert back == r and back.kind is ReasonKind.DTYPE
    assert Reason.from_json({"kind": "NO_SUCH_KIND", "detail": "x"}) is None
    assert Reason.from_json("a plain string from an older cache") is None
    assert Placement.ORT == "ort" and Placement("pytorch") is Placement.PYTORCH


def test_fallbacks_carry_kinds_and_the_disk_cache_keeps_them(tmp_path):
    x = torch.randn(4, 8)
    opts = {"executor": "ort", "disk_cache": True, "cache_dir": str(tmp_path)}
    cold = LortBackend(opts)
    torch.compile(_f, backend=cold)(x)
    report = lort.ExplainReport(cold.records)
    kinds = report.fallback_kinds
    assert kinds[ReasonKind.RANDOM] >= 1 and kinds[ReasonKind.DTYPE] >= 1, report.fallbacks
    assert all(isinstance(r, Reason) for _, r in report.fallbacks)
    assert "by kind:" in str(report) and "random" in str(report)
    torch._dynamo.reset()
    warm = LortBackend(opts)
    torch.compile(_f, backend=warm)(x)
    cold_reasons = [(op, r.kind, str(r)) for op, r in report.fallbacks]
    warm_reasons = [(op, r.kind, str(r)) for op, r in lort.ExplainReport(warm.records).fallbacks]
    assert warm_reasons == cold_reasons


def test_a_translation_failure_is_warned_again_when_read_from_the_disk_cache(tmp_path, monkeypatch):
    """The bisect's verdict (TRANSLATION_FAILED) is stored by kind; a warm compile warns
    again, as the first did, without prefix-matching any text."""
    from lort.translate import _compat

    real = _compat.translate_graph

    def broken(fx_graph, name, reg):
        if any(n.target is torch.ops.aten.cos.default for n in fx_graph.nodes):
            raise RuntimeError("simulated failure")
        return real(fx_graph, name, reg)

    monkeypatch.setattr(_compat, "translate_graph", broken)
    opts = {"executor": "ort", "disk_cache": True, "cache_dir": str(tmp_path)}

    def g(x):
        return x.sin().cos().exp()

    x = torch.randn(3, 5)
    for attempt in ("cold", "warm"):
        torch._dynamo.reset()
        backend = LortBackend(opts)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = torch.compile(g, backend=backend)(x)
        torch.testing.assert_close(out, g(x))
        msgs = [str(w.message) for w in caught if "aten.cos.default runs in PyTorch" in str(w.message)]
        assert len(msgs) == 1, (attempt, [str(w.message) for w in caught])
        (record,) = backend.records
        reasons = {op: r for op, r in record.fallbacks}
        assert reasons["aten.cos.default"].kind is ReasonKind.TRANSLATION_FAILED, attempt


def _strict_report(fn, args) -> lort.ExplainReport:
    """``fn`` compiled by lort (every group in ORT) and called once, with any warning an
    error (a failed session build warns): its result checked against eager, its report."""
    torch._dynamo.reset()
    backend = LortBackend({"executor": "ort", "disk_cache": False, "progress": False})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = torch.compile(fn, backend=backend)(*args)
    torch.testing.assert_close(out, fn(*args))
    return lort.ExplainReport(backend.records)


def test_dtypes_ort_has_no_kernel_for_stay_in_pytorch_by_kind_without_a_failed_build(tmp_path):
    """MaxPool has no int64 kernel and GridSample at the opset lort emits no float64 one:
    the support check keeps those nodes in PyTorch (NO_KERNEL), so no session build fails
    and nothing warns; float32 still runs in ORT. The constraint read is the first
    input's at the emitted opset: MaxPool's int64 indices and GridSample's opset-20
    float64 kernel do not count."""
    from lort.fusion import support

    cpu = "CPUExecutionProvider"
    assert "tensor(int64)" not in support._ort_kernel_types("MaxPool", cpu)
    assert "tensor(double)" not in support._ort_kernel_types("GridSample", cpu)
    assert "tensor(double)" in support._ort_kernel_types("GridSample", cpu, 20)

    def pool(x):
        return torch.nn.functional.max_pool2d(x * 2, 2)

    def sample(x, grid):
        return torch.nn.functional.grid_sample(x * 2, grid, align_corners=False)

    ints = torch.randint(-50, 50, (1, 2, 6, 6))
    grid = torch.rand(1, 3, 3, 2, dtype=torch.float64) * 2 - 1
    image = torch.randn(1, 2, 5, 5, dtype=torch.float64)
    for fn, args, kept in ((pool, (ints,), True), (sample, (image, grid), True),
                           (pool, (ints.float(),), False), (sample, (image.float(), grid.float()), False)):
        kinds = _strict_report(fn, args).fallback_kinds
        assert (kinds[ReasonKind.NO_KERNEL] >= 1) is kept, (fn.__name__, args[0].dtype, kinds)
        assert kinds[ReasonKind.TRANSLATION_FAILED] == 0


def test_cat_with_empty_1d_inputs_runs_where_torch_lib_is_right():
    """torch_lib's cat drops (0,)-shaped inputs: right where one input is left (a cache's
    first update, cat([tensor([]), k])), which stays in ORT; all inputs empty, or two
    left beside a (0,) of another rank, stay in PyTorch (KNOWN_WRONG) with eager's
    values and no failed session build."""

    def one_left(k):
        return torch.cat([torch.zeros(0), k * 2], dim=-2)

    def two_left(a, b):
        return torch.cat([a * 2, torch.zeros(0), b * 3])

    def all_empty(n):
        return torch.cat([torch.arange(n)[:0], torch.arange(n)[:0]]) + 1

    k, a, b = torch.randn(1, 2, 3, 4), torch.randn(2, 3), torch.randn(1, 3)
    for fn, args, kept in ((one_left, (k,), False), (two_left, (a, b), True), (all_empty, (4,), True)):
        report = _strict_report(fn, args)
        cats = [r for op, r in report.fallbacks if "cat" in op]
        assert bool(cats) is kept, (fn.__name__, report.fallbacks)
        assert all(r.kind is ReasonKind.KNOWN_WRONG for r in cats)
