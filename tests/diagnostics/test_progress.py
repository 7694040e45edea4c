"""Progress of compiles: INFO lines per graph (capture, translation, sessions, timing)
and a bar over the groups of big graphs, both turned off by Options.progress."""

import io
import logging

import pytest
import torch

import lort
from lort.backend import LortBackend
from lort.compile.tuner import Tuner
from lort.diagnostics import progress

STEPS = ("captured", "translated", "built", "timed", "whole graph timed", "read from the disk cache")


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def lort_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "lort" and r.levelno == logging.INFO]


def progress_lines(caplog):
    return [m for m in lort_lines(caplog) if any(step in m for step in STEPS)]


def one(lines, start, middle=""):
    found = [m for m in lines if m.startswith(start) and middle in m]
    assert len(found) == 1, (start, middle, lines)
    return found[0]


def test_training_step_logs_each_step_once_per_graph(caplog):
    m, x = model(), torch.randn(4, 8)
    # tiny_inputs_bytes=0: the timed path, not the small-graph shortcut (test_call_floor.py)
    backend = LortBackend({"executor": "auto", "disk_cache": False}, tuner=Tuner(tiny_inputs_bytes=0))
    compiled = torch.compile(m, backend=backend)
    with caplog.at_level(logging.INFO, logger="lort"):
        compiled(x).sum().backward()  # first call: eager PyTorch's step, untimed
        compiled(x).sum().backward()  # second: whole graph timed (forward and backward)
        compiled(x).sum().backward()
    lines = progress_lines(caplog)
    fw, bw = backend.records
    assert (fw.kind, bw.kind) == ("forward", "backward")
    for rec, how in ((fw, " in "), (bw, " (traced with its forward)")):
        total = rec.ort_nodes + rec.torch_nodes
        one(lines, f"lort: {rec.name}: captured {total} ATen nodes{how}")
        grouped = sum(g.num_nodes for g in rec.groups)
        one(lines, f"lort: {rec.name}: translated {len(rec.groups)} group(s) ({grouped} ATen nodes) to ONNX in ")
        one(lines, f"lort: {rec.name}: built {len(rec.groups)} ORT session(s) in ")
        # executor="auto" times every group in ORT against PyTorch.
        one(lines, f"lort: {rec.name}: timed {len(rec.groups)} group(s) (", "ORT against PyTorch")
    one(lines, f"lort: {fw.name}: its first training call runs in eager PyTorch; lort's graph is timed")
    one(lines, f"lort: {fw.name}+{bw.name}: whole graph timed in ")
    # Nothing else: capture, translation, sessions and timing of 2 graphs, the first
    # call's placement, and the whole graph's timing.
    assert len(lines) == 10, lines
    # The existing summary line stays, once per graph.
    one(lort_lines(caplog), f"lort: {fw.name}: {len(fw.groups)} ORT group(s)")


def test_option_turns_the_lines_off(caplog, monkeypatch):
    with caplog.at_level(logging.INFO, logger="lort"), torch.no_grad():
        backend = LortBackend({"progress": False})
        x = torch.randn(4, 8)
        torch.testing.assert_close(torch.compile(model(), backend=backend)(x), model()(x), rtol=1e-5, atol=1e-6)
    assert backend.records and progress_lines(caplog) == []
    assert any("ORT group(s)" in m for m in lort_lines(caplog))  # the summary is not progress
    monkeypatch.setenv("LORT_PROGRESS", "0")
    assert lort.Options().progress is False
    monkeypatch.setenv("LORT_PROGRESS", "1")
    assert lort.Options().progress is True
    monkeypatch.setenv("LORT_PROGRESS", "maybe")
    with pytest.raises(ValueError, match="LORT_PROGRESS='maybe' is not a boolean"):
        lort.Options()
    with pytest.raises(ValueError, match="progress='yes' must be True or False"):
        lort.Options(progress="yes")


def test_warm_compile_says_groups_came_from_the_disk_cache(caplog, tmp_path):
    options = {"disk_cache": True, "cache_dir": str(tmp_path)}
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.compile(model(), backend=LortBackend(options))(x)
        torch._dynamo.reset()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lort"):
            backend = LortBackend(options)
            torch.compile(model(), backend=backend)(x)
    (rec,) = backend.records
    lines = progress_lines(caplog)
    one(lines, f"lort: {rec.name}: {len(rec.groups)} group(s) ", "read from the disk cache, none translated")
    one(lines, f"lort: {rec.name}: built {len(rec.groups)} ORT session(s) in ")
    assert not any("translated" in m and "none translated" not in m or "timed" in m for m in lines), lines


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _compile_inference(monkeypatch, stream, **options):
    monkeypatch.setattr("sys.stderr", stream)
    monkeypatch.setattr(progress, "BAR_MIN_GROUPS", 1)  # the tiny graph has one group
    x = torch.randn(4, 8)
    with torch.no_grad():
        out = torch.compile(model(), backend=LortBackend({"disk_cache": False, **options}))(x)
    torch._dynamo.reset()
    torch.testing.assert_close(out, model()(x), rtol=1e-5, atol=1e-6)
    return stream.getvalue()


def test_bar_only_on_a_terminal_and_with_the_option_on(monkeypatch):
    pytest.importorskip("tqdm")
    shown = _compile_inference(monkeypatch, _Terminal())
    # tqdm draws the bar with its total when it starts (later redraws depend on timing).
    assert "lort g1_inference" in shown and "0/1 [" in shown and "group" in shown, shown
    assert "lort g1_inference" not in _compile_inference(monkeypatch, io.StringIO())  # not a terminal
    assert "lort g1_inference" not in _compile_inference(monkeypatch, _Terminal(), progress=False)


def test_bar_needs_many_groups(monkeypatch):
    pytest.importorskip("tqdm")
    monkeypatch.setattr("sys.stderr", _Terminal())
    options = lort.Options()
    assert progress.group_bar(options, "g1_forward", progress.BAR_MIN_GROUPS - 1) is None
    bar = progress.group_bar(options, "g1_forward", progress.BAR_MIN_GROUPS)
    assert bar is not None
    bar.close()
