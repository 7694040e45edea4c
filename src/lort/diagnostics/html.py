"""``ExplainReport.save_html``: one self-contained HTML page of what ran where.

Each captured graph is drawn as SVG (html_svg.py), with each ORT group collapsed into one
box and the nodes left to PyTorch drawn one by one with their reasons; tables give each
group's inputs, outputs, threads, executor, times, ORT fusions and disk-cache origin. The
page names no URL: styles and drawings are inline.
"""

from __future__ import annotations

import collections
import html
import importlib.metadata
import os
import re

from ..reasons import Placement
from . import html_graph, html_svg
from .html_graph import DrawnGraph, Unit, short_op
from .html_svg import fmt_time
from .records import GraphRecord, ort_optimizer_text

LAYOUTS = ("auto", "dot", "networkx")

_CSS = """
:root { --ink:#1f2933; --mute:#6b7280; --line:#e3e7ee; --bg:#f6f8fb; --torch:#d2691e; --ort:#2f6da3; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--ink);
  font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif; }
main { max-width:1360px; margin:0 auto; padding:22px 26px 40px; }
h1 { font-size:22px; margin:0 0 2px; } h1 span { color:var(--mute); font-weight:400; }
h2 { font-size:17px; margin:0; display:flex; gap:10px; align-items:center; }
.sub { color:var(--mute); font-size:12.5px; margin-bottom:14px; }
.cards { display:flex; gap:12px; flex-wrap:wrap; margin:10px 0 12px; }
.card { background:#fff; border:1px solid var(--line); border-radius:10px; padding:9px 14px; min-width:140px; }
.card b { display:block; font-size:20px; } .card span { color:var(--mute); font-size:12px; }
.legend { display:flex; gap:16px; flex-wrap:wrap; font-size:12.5px; color:#374151; margin:4px 0 16px; }
.sw { display:inline-block; width:14px; height:11px; border-radius:3px; border:1.4px solid; vertical-align:-1px;
  margin-right:5px; }
section { background:#fff; border:1px solid var(--line); border-radius:12px; padding:16px 18px; margin:0 0 18px;
  box-shadow:0 1px 2px rgba(16,24,40,.04); }
.badge { font-size:11.5px; font-weight:600; padding:2px 8px; border-radius:99px; background:#eef2f7; color:#374151; }
.badge.lort { background:#dbeafe; color:#1e4e8c; } .badge.pytorch { background:#fde7d3; color:#9a4a10; }
.badge.inductor { background:#e6dcf7; color:#5b2a9a; }
.meta { color:#374151; font-size:13px; margin:6px 0 8px; }
.bar { height:8px; border-radius:5px; background:#fde0c5; overflow:hidden; margin:4px 0 10px; max-width:520px; }
.bar > div { height:100%; background:#5b8fc7; }
.graph { overflow:auto; border:1px solid var(--line); border-radius:10px; background:#fcfdff; padding:8px;
  max-height:820px; text-align:center; }
svg.lort-graph { max-width:100%; height:auto; font-family:system-ui,"Helvetica Neue",Arial,sans-serif; }
svg.lort-graph g.node a:hover > :first-child, svg.lort-graph g.node a:hover path, svg.lort-graph g.node a:hover polygon
  { stroke-width:2.6; }
ol.reasons { margin:8px 0 4px; padding-left:0; list-style:none; font-size:13px; }
ol.reasons li { margin:2px 0; }
ol.reasons .n { display:inline-block; min-width:30px; color:var(--torch); font-weight:700; }
h3 { font-size:14px; margin:12px 0 0; }
ol.reasons .ops { color:var(--mute); }
table { border-collapse:collapse; width:100%; font-size:12.5px; margin-top:10px; }
th { text-align:left; font-weight:600; color:#4b5563; background:#f3f5f9; position:sticky; top:0; }
th, td { padding:5px 8px; border-bottom:1px solid var(--line); vertical-align:top; }
td.name { white-space:nowrap; }
td.num { text-align:right; font-variant-numeric:tabular-nums; }
tr:target { background:#fff7d6; }
details summary { cursor:pointer; } details ol, details ul { margin:4px 0; padding-left:18px; color:#374151; }
code { font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace; font-size:12px; }
.muted { color:var(--mute); } .chosen { font-weight:700; }
.note { color:var(--mute); font-size:12px; margin-top:6px; }
"""


def render(report, layout: str = "auto") -> str:
    """The page for ``report`` as a string (see ``ExplainReport.save_html``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"lort: save_html(layout={layout!r}): layout must be one of {', '.join(LAYOUTS)}")
    sections = [_section(r, layout) for r in report.records]
    total = report.ort_nodes + report.torch_nodes
    cards = [
        (len(report.records), "graphs captured"),
        (len(report.groups), "ORT groups"),
        (f"{report.ort_nodes}/{total}", f"ATen nodes in ORT ({100 * report.ort_fraction:.1f}%)"),
        (report.torch_nodes, "ATen nodes in PyTorch"),
    ]
    legend = [
        (html_svg.GROUP_COLORS[0], "ORT group (one box per group; colours cycle)"),
        (html_svg.TORCH_COLOR, "node left to PyTorch, [n] = its reason"),
        (html_svg.GROUP_PYTORCH_COLOR, "group run in PyTorch (timed faster there, or ORT failed)"),
        (html_svg.EAGER_COLOR, "graph run whole in eager PyTorch"),
    ]
    head = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<title>lort explain: what ran where</title>",
        f"<style>{_CSS}</style></head><body><main>",
        "<h1>lort explain <span>· what ran where</span></h1>",
        f'<div class="sub">{html.escape(_versions())} · hover a box for its ops, click a group for its row</div>',
        '<div class="cards">'
        + "".join(f'<div class="card"><b>{v}</b><span>{html.escape(t)}</span></div>' for v, t in cards)
        + "</div>",
        '<div class="legend">'
        + "".join(
            f'<span><i class="sw" style="background:{f};border-color:{s}"></i>{html.escape(t)}</span>'
            for (f, s), t in legend
        )
        + "</div>",
    ]
    return "\n".join(head + sections + ["</main></body></html>", ""])


def write(report, path: str | os.PathLike, layout: str = "auto") -> str:
    page = render(report, layout)
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return os.fspath(path)


def _versions() -> str:
    parts = []
    for dist in ("lort", "torch", "onnxruntime", "onnxruntime-gpu", "onnxscript"):
        try:
            parts.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join(parts)


def _whole_graph_line(r: GraphRecord) -> str:
    t = r.executor_times
    if r.executor == Placement.PYTORCH:
        text = "Runs whole in <b>eager PyTorch</b>"
        if t:
            lort_time = "for lort's cheapest call, nothing compiled" if t.get("floor") else "through lort"
            text += (
                f": timed {fmt_time(t.get('pytorch'))} eager vs {fmt_time(t.get('ort'))} {lort_time} "
                "(executor='auto')"
            )
        reason = r.fallbacks[0][1] if r.fallbacks else ""
        if "disk cache" in reason:
            text += "; choice read from the disk cache"
        return text + "."
    if r.executor == Placement.INDUCTOR:
        timed = ", ".join(f"{fmt_time(t.get(k))} {name}" for k, name in
                          (("inductor", "with inductor"), ("ort", "through lort"), ("pytorch", "eager")) if t.get(k))
        reason = r.fallbacks[0][1] if r.fallbacks else ""
        return ("Runs whole compiled by <b>inductor</b>" + (f": timed {timed} (executor='auto')" if timed else "")
                + ("; choice read from the disk cache" if "disk cache" in reason else "") + ".")
    if t:
        return (
            f"Runs through <b>lort</b>: timed {fmt_time(t.get('ort'))} through lort vs "
            f"{fmt_time(t.get('pytorch'))} eager (executor='auto', forward and backward together)."
        )
    return "Runs through <b>lort</b> (the whole graph was not timed against eager: executor='ort', or not on CPU)."


def _section(r: GraphRecord, layout: str) -> str:
    drawn = html_graph.build(r)
    svg, how = html_svg.draw(drawn, layout)
    total = r.ort_nodes + r.torch_nodes
    frac = r.ort_nodes / total if total else 0.0
    where = {Placement.PYTORCH: "pytorch", Placement.INDUCTOR: "inductor"}.get(r.executor, "lort")
    badge = {"pytorch": "eager PyTorch", "inductor": "inductor"}.get(where, "lort")
    out = [
        f'<section id="graph-{html.escape(r.name)}" data-graph="{html.escape(r.name)}">',
        f'<h2>{html.escape(r.name)} <span class="badge">{html.escape(r.kind)}</span>'
        f'<span class="badge {where}">{badge}</span></h2>',
        f'<div class="meta">{_whole_graph_line(r)} {len(r.groups)} ORT group(s); '
        f"{r.ort_nodes}/{total} ATen nodes in ORT ({100 * frac:.1f}%), {r.torch_nodes} in PyTorch."
        + "".join(f" {html.escape(note[:1].upper() + note[1:])}." for note in r.engine_notes) + "</div>",
        f'<div class="bar" title="{100 * frac:.1f}% of ATen nodes in ORT">'
        f'<div style="width:{100 * frac:.2f}%"></div></div>',
        f'<div class="graph">{svg}</div>',
        f'<div class="note">Drawn by {html.escape(how)}: one box per ORT group'
        + (", connected PyTorch nodes merged (a large graph)" if _merged(drawn) else "")
        + "; edge labels count the values passed.</div>",
    ]
    out.append(_reasons(drawn))
    if r.executor == Placement.ORT and r.groups:
        out.append(_group_table(drawn))
    out.append("</section>")
    return "\n".join(out)


def _merged(drawn: DrawnGraph) -> bool:
    return any(u.kind == "torch" and u.nodes > 1 for u in drawn.units)


def _reasons(drawn: DrawnGraph) -> str:
    if not drawn.reasons:
        return '<div class="note" id="reasons-{}">Nothing left to PyTorch.</div>'.format(html.escape(drawn.record.name))
    ops_by_reason: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for op, reason in drawn.record.fallbacks:
        ops_by_reason[reason][short_op(op)] += 1
    items = []
    for i, reason in enumerate(drawn.reasons, 1):
        ops = ops_by_reason.get(reason, collections.Counter())
        n = sum(ops.values())
        listed = ", ".join(f"{op} ×{c}" for op, c in ops.most_common(6)) + (" ..." if len(ops) > 6 else "")
        items.append(
            f'<li><span class="n">[{i}]</span>{html.escape(reason)} '
            f'<span class="ops">— {n} node(s): {html.escape(listed)}</span></li>'
        )
    note = (
        ""
        if drawn.reasons_exact
        else '<div class="note">Reasons were matched to the drawn nodes by op name.</div>'
    )
    return (
        f'<h3 id="reasons-{html.escape(drawn.record.name)}">Left to PyTorch, and why</h3>'
        f'<ol class="reasons">{"".join(items)}</ol>{note}'
    )


def _shapes(summary: str, values: list[str]) -> str:
    if not values:
        return summary
    items = "".join(f"<li><code>{html.escape(v)}</code></li>" for v in values)
    return f"<details><summary>{summary}</summary><ol>{items}</ol></details>"


def _group_row(unit: Unit) -> str:
    g = unit.group
    fill, stroke = html_svg.colors(unit)
    runs = "ORT"
    if g.executor != Placement.ORT:
        why = unit.why or ""
        short = why if len(why) <= 60 else why[:57] + "..."
        runs = f'PyTorch <span class="muted" title="{html.escape(why)}">({html.escape(short)})</span>'

    threads = "-" if g.threads is None else str(g.threads)
    if g.thread_times:
        tt = " · ".join(f"{k}: {fmt_time(v)}" for k, v in g.thread_times.items() if v is not None)
        threads += f' <span class="muted">({html.escape(tt)})</span>'
    if g.executor_times:
        names = {"ort": "ORT", "pytorch": "PyTorch", "ort_lower_bound": "ORT at least"}
        times = " · ".join(
            f'<span class="{"chosen" if k == g.executor else "muted"}">{names.get(k, k)} {fmt_time(v)}</span>'
            for k, v in g.executor_times.items()
        )
    else:
        t = html_svg.group_time(unit)
        times = fmt_time(t) if t is not None else '<span class="muted">not timed</span>'
    fusions = ", ".join(f"{html.escape(k)} ×{v}" for k, v in g.fusions.items()) or '<span class="muted">-</span>'
    if g.ort_optimizer:
        fusions += f'<br><span class="muted">ORT\'s optimizer:</span> {html.escape(ort_optimizer_text(g.ort_optimizer))}'
    cache = {True: "yes", False: "no", None: '<span class="muted">-</span>'}[unit.from_cache]
    top = ", ".join(f"{short_op(op)} ×{c}" for op, c in unit.ops.most_common(3))
    hist = "".join(f"<li>{c} × <code>{html.escape(short_op(op))}</code></li>" for op, c in unit.ops.most_common())
    ins = _shapes(f"{g.num_inputs} <span class='muted'>({unit.graph_inputs} from graph)</span>", unit.inputs)
    outs = _shapes(f"{g.num_outputs} <span class='muted'>({unit.graph_outputs} to graph)</span>", unit.outputs)
    return (
        f'<tr id="row-{html.escape(g.name)}" class="group-row" data-executor="{g.executor}">'
        f'<td class="name"><i class="sw" style="background:{fill};border-color:{stroke}"></i>'
        f"<code>{html.escape(g.name)}</code></td>"
        f"<td>{runs}</td><td class='num'>{g.num_nodes}</td><td>{ins}</td><td>{outs}</td>"
        f"<td>{threads}</td><td>{times}</td><td>{fusions}</td><td>{cache}</td>"
        f"<td><details><summary>{html.escape(top)}</summary><ul>{hist}</ul></details></td></tr>"
    )


def _group_table(drawn: DrawnGraph) -> str:
    rows = [_group_row(u) for u in drawn.units if u.group is not None]
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "group", "runs in", "ATen nodes", "inputs", "outputs", "ORT threads (timed)",
            "time per call", "ORT fusions fired", "from disk cache", "ops",
        )
    )
    return f'<table class="groups"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def svg_sections(page: str) -> dict[str, str]:
    """Each graph's SVG in a page this module wrote, by graph name (for tests and tools)."""
    found = {}
    for m in re.finditer(r'<section id="graph-[^"]*" data-graph="([^"]*)">(.*?)</section>', page, re.S):
        svg = re.search(r"<svg.*?</svg>", m.group(2), re.S)
        found[html.unescape(m.group(1))] = svg.group(0) if svg else ""
    return found
