"""ExplainReport.save_html: one self-contained page drawing what ran where, checked for its
structure against the report, and rendered by headless Chromium where it is installed."""

from __future__ import annotations

import collections
import dataclasses
import html
import os
import re
import shutil
import subprocess

import pytest
import torch

import lort
from lort.diagnostics import html as lort_html
from lort.diagnostics import html_svg
from lort.testing.models import SmallCNN

NO_DOT = pytest.mark.skipif(not shutil.which("dot"), reason="graphviz's dot is not installed")
LAYOUTS = ["networkx", pytest.param("dot", marks=NO_DOT)]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _train_report():
    torch.manual_seed(0)
    model, x = SmallCNN(), torch.randn(2, 3, 16, 16)
    return lort.explain(model, x)


def _inference_report():
    torch.manual_seed(0)
    model, x = SmallCNN().eval(), torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        return lort.explain(model, x)


@pytest.fixture(scope="module")
def reports():
    torch._dynamo.reset()
    train = _train_report()
    torch._dynamo.reset()
    return {"train": train, "inference": _inference_report()}


def _nodes(svg: str, cls: str) -> list[tuple[str, int]]:
    """(tooltip, ATen node count) of each box of class ``cls`` in a drawing."""
    svg = html.unescape(svg)
    found = []
    for m in re.finditer(r'<g id="[^"]*" class="node ' + cls + r'[" ].*?<title>(.*?)</title>', svg, re.S):
        count = re.search(r"(\d+) ATen node\(s\)", m.group(1))
        found.append((m.group(1), int(count.group(1))))
    return found


def _check_page(page: str, report) -> None:
    # Self-contained: nothing fetched, no URL at all.
    assert not re.search(r"https?:|<link|<script|<img|<iframe|@import", page, re.I)
    assert all(u.startswith("#") for u in re.findall(r'url\(([^)]*)\)', page))
    assert all(h.startswith("#") for h in re.findall(r'href="([^"]*)"', page))
    drawings = lort_html.svg_sections(page)
    assert list(drawings) == [r.name for r in report.records]
    for r in report.records:
        svg = drawings[r.name]
        assert svg.startswith("<svg") and "viewBox" in svg
        groups = _nodes(svg, "lort_group")
        torch_boxes = _nodes(svg, "lort_torch")
        eager = _nodes(svg, "lort_eager")
        if r.executor == "pytorch":
            assert not groups and not torch_boxes and [n for _, n in eager] == [r.torch_nodes]
            continue
        assert not eager
        # One box per group, holding the group's nodes; PyTorch boxes hold the rest.
        assert sorted(n for _, n in groups) == sorted(g.num_nodes for g in r.groups)
        in_pytorch_groups = sum(g.num_nodes for g in r.groups if g.executor == "pytorch")
        assert sum(n for _, n in torch_boxes) + in_pytorch_groups == r.torch_nodes
        assert sum(n for _, n in groups) - in_pytorch_groups == r.ort_nodes
        for g in r.groups:
            row = re.search(rf'<tr id="row-{g.name}" class="group-row" data-executor="(\w+)">(.*?)</tr>', page, re.S)
            assert row and row.group(1) == g.executor
            assert f"<td class='num'>{g.num_nodes}</td>" in row.group(2)
        # Every reason a node was left to PyTorch is on the page, and on that node's box.
        for op, reason in r.fallbacks:
            assert html.escape(reason) in page
        on_boxes = collections.Counter()
        for tip, n in torch_boxes:
            for count, reason in re.findall(r"left to PyTorch \((\d+)\): (.*)", tip):
                on_boxes[reason] += int(count)
        if not in_pytorch_groups:
            assert on_boxes == collections.Counter(reason for _, reason in r.fallbacks)
        else:
            group_reasons = collections.Counter(reason for _, reason in r.fallbacks) - on_boxes
            assert sum(group_reasons.values()) == in_pytorch_groups


@pytest.mark.parametrize("layout", LAYOUTS)
def test_page_structure_train_and_inference(reports, layout, tmp_path):
    train, infer = reports["train"], reports["inference"]
    assert [r.kind for r in train.records] == ["forward", "backward"]
    assert [r.kind for r in infer.records] == ["inference"]
    # SmallCNN's convolution backward is left to PyTorch: the drawing must show those nodes.
    assert train.torch_nodes > 0 and train.groups
    for report, name in ((train, "train"), (infer, "inference")):
        path = report.save_html(tmp_path / f"{name}.html", layout=layout)
        page = open(path, encoding="utf-8").read()
        _check_page(page, report)
        assert ("Drawn by graphviz dot" if layout == "dot" else "Drawn by networkx layers") in page
    # Shapes of a group's inputs are listed.
    page = open(tmp_path / "inference.html", encoding="utf-8").read()
    assert "<code>float32[2, 3, 16, 16]</code>" in page


def _copy(report) -> lort.ExplainReport:
    """A report whose records can be changed without touching ``report``'s."""
    return lort.ExplainReport(
        [
            dataclasses.replace(r, groups=[dataclasses.replace(g) for g in r.groups], fallbacks=list(r.fallbacks))
            for r in report.records
        ]
    )


def test_graph_run_whole_in_eager_is_one_box(reports):
    """A graph executor='auto' ran whole in eager PyTorch is one box with all its nodes
    (the record changed the way lort's backend changes it)."""
    report = _copy(reports["train"])
    for record in report.records:
        record.ran_whole_in_pytorch({"ort": 2e-3, "pytorch": 1e-3})
    page = lort_html.render(report, "networkx")
    _check_page(page, report)
    assert page.count("eager PyTorch</b>: timed 1.00 ms eager vs 2.00 ms through lort") == 2


def test_group_run_in_pytorch_is_marked(reports):
    """A group ORT failed to run (the record changed the way the backend changes it) is
    drawn as a group in PyTorch, and the other nodes keep their own reasons."""
    report = _copy(reports["train"])
    backward = report.records[1]
    failed = backward.groups[1]
    backward.group_failed_at_run(failed.name, "ORT failed to run its group: test")
    page = lort_html.render(report, "networkx")
    _check_page(page, report)
    svg = lort_html.svg_sections(page)[backward.name]
    boxes = _nodes(svg, "lort_group lort_group_pytorch")
    assert [n for _, n in boxes] == [failed.num_nodes]
    assert f'<tr id="row-{failed.name}" class="group-row" data-executor="pytorch">' in page


def test_bad_layout_is_a_clear_error(reports, tmp_path):
    with pytest.raises(ValueError, match="layout must be one of auto, dot, networkx"):
        reports["inference"].save_html(tmp_path / "x.html", layout="neato")


def test_without_dot_auto_uses_networkx_and_dot_is_a_clear_error(reports, monkeypatch):
    monkeypatch.setattr(html_svg.shutil, "which", lambda name: None)
    page = lort_html.render(reports["train"], "auto")
    _check_page(page, reports["train"])
    assert "Drawn by networkx layers" in page and "Drawn by graphviz dot" not in page
    with pytest.raises(RuntimeError, match="needs graphviz's `dot` on PATH"):
        lort_html.render(reports["train"], "dot")


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (Debian: apt-get install chromium)")
def test_chromium_renders_the_page(reports, tmp_path):
    path = reports["train"].save_html(tmp_path / "train.html")
    png = tmp_path / "shot.png"
    cmd = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png}", "--window-size=1400,1800",
        f"file://{os.path.abspath(path)}",
    ]
    res = subprocess.run(cmd, capture_output=True, timeout=120)
    assert res.returncode == 0 and png.exists(), res.stderr.decode(errors="replace")[-2000:]
    assert png.stat().st_size > 20_000
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - Pillow comes with torchvision and timm
        return
    img = Image.open(png).convert("RGB")
    assert img.size == (1400, 1800)
    colours = img.getcolors(maxcolors=1 << 20)
    assert len(colours) > 100  # text, boxes and tables, not a blank page
    # The drawing was painted: the first ORT group's fill and the PyTorch nodes' fill.
    present = {c for _, c in colours}
    for hex_fill in (html_svg.GROUP_COLORS[0][0], html_svg.TORCH_COLOR[0]):
        rgb = tuple(int(hex_fill[i : i + 2], 16) for i in (1, 3, 5))
        assert rgb in present, hex_fill


def _random_ops(x):  # rand_like -> bernoulli: two connected random ops, left to PyTorch
    return torch.bernoulli(torch.rand_like(x)) * x + torch.rand_like(x)


def test_many_pytorch_nodes_are_merged_when_connected(monkeypatch):
    """Past MAX_TORCH_UNITS, connected PyTorch nodes share a box: counts and reasons stay whole."""
    from lort.diagnostics import html_graph

    report = lort.explain(_random_ops, torch.randn(4, 8))
    monkeypatch.setattr(html_graph, "MAX_TORCH_UNITS", 0)
    page = lort_html.render(report, "networkx")
    _check_page(page, report)
    boxes = _nodes(lort_html.svg_sections(page)[report.records[0].name], "lort_torch")
    assert sorted(n for _, n in boxes) == [1, 2]


def test_groups_read_from_the_disk_cache_say_so(monkeypatch, tmp_path):
    monkeypatch.setenv("LORT_DISK_CACHE", "1")
    monkeypatch.setenv("LORT_CACHE_DIR", str(tmp_path))
    pages = []
    for _ in range(2):
        torch._dynamo.reset()
        report = lort.explain(_random_ops, torch.randn(4, 8))
        pages.append(lort_html.render(report, "networkx"))
        _check_page(pages[-1], report)
    name = report.groups[0].name
    cells = [re.search(rf'<tr id="row-{name}".*?</tr>', p, re.S).group(0) for p in pages]
    assert "<td>no</td>" in cells[0] and "<td>yes</td>" in cells[1]
    assert "· cached</text>" not in pages[0] and "· cached</text>" in pages[1]
