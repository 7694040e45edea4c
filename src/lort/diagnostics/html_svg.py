"""SVG drawings of the graphs in the HTML report: laid out by graphviz's ``dot`` where it
is installed, else in layers by networkx (longest-path layers, barycentre ordering)."""

from __future__ import annotations

import html
import logging
import math
import re
import shutil
import subprocess

from ..reasons import Placement
from .html_graph import DrawnGraph, Unit, short_op

logger = logging.getLogger("lort")

#: (fill, stroke) per ORT group, cycling: cool colours, so that PyTorch's warm one stands out.
GROUP_COLORS = [
    ("#d6e6f7", "#2f6da3"),
    ("#d5efdc", "#2e8b57"),
    ("#e0dbf5", "#5b4ba8"),
    ("#cdeeee", "#23837f"),
    ("#e4eccb", "#5d7a1f"),
    ("#dae0ee", "#44557a"),
]
TORCH_COLOR = ("#fde0c5", "#d2691e")
EAGER_COLOR = ("#ececec", "#7a7a7a")
GROUP_PYTORCH_COLOR = ("#f3f3f3", "#8a8a8a")
_DOT_TIMEOUT_S = 60


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def colors(unit: Unit) -> tuple[str, str]:
    if unit.kind == "group":
        return GROUP_COLORS[unit.index % len(GROUP_COLORS)]
    if unit.kind == "group-pytorch":
        return GROUP_PYTORCH_COLOR
    if unit.kind == "eager":
        return EAGER_COLOR
    return TORCH_COLOR


def group_time(unit: Unit) -> float | None:
    g = unit.group
    if g is None:
        return None
    if g.executor_times.get(g.executor) is not None:
        return g.executor_times[g.executor]
    return g.thread_times.get(g.threads) if g.executor == Placement.ORT else None  # ORT's times


def reason_marks(unit: Unit, drawn: DrawnGraph) -> str:
    return ",".join(str(drawn.reasons.index(r) + 1) for r in unit.reasons if r in drawn.reasons)


def label_lines(unit: Unit, drawn: DrawnGraph) -> list[tuple[str, bool]]:
    """Lines of text in the box, with whether each is bold."""
    g = unit.group
    if g is not None:
        lines = [(unit.title, True), (f"{unit.nodes} nodes · {g.num_inputs} in · {g.num_outputs} out", False)]
        if unit.kind == "group":
            where = f"ORT · {g.threads} thread{'s' if g.threads != 1 else ''}" if g.threads else "ORT"
            t = group_time(unit)
            where += f" · {fmt_time(t)}" if t is not None else ""
            lines.append((where + (" · cached" if unit.from_cache else ""), False))
        elif g.executor_times:
            t = g.executor_times
            lines.append((f"PyTorch {fmt_time(t.get('pytorch'))} (ORT {fmt_time(t.get('ort'))})", False))
        else:
            lines.append(("runs in PyTorch", False))
        if g.fusions:
            fused = ", ".join(f"{k}×{v}" for k, v in g.fusions.items())
            lines.append((fused if len(fused) <= 44 else fused[:41] + "...", False))
        return lines
    if unit.kind == "eager":
        lines = [(unit.title, True), (f"{unit.nodes} ATen nodes", False)]
        t = drawn.record.executor_times
        if t:
            lines.append((f"eager {fmt_time(t.get('pytorch'))} vs lort {fmt_time(t.get('ort'))}", False))
        return lines
    marks = reason_marks(unit, drawn)
    lines = [(f"{unit.title} [{marks}]" if marks else unit.title, False)]
    if unit.nodes > 1:
        lines.append((f"{unit.nodes} nodes in PyTorch", False))
    return lines


def tooltip(unit: Unit) -> str:
    head = {"group": "ORT group", "group-pytorch": "group run in PyTorch"}.get(unit.kind, "PyTorch")
    lines = [f"{unit.title}: {head}, {unit.nodes} ATen node(s)"]
    if unit.why:
        lines.append(f"why: {unit.why}")
    if unit.group is not None:
        g = unit.group
        lines.append(f"inputs {g.num_inputs} ({unit.graph_inputs} from the graph's inputs), outputs {g.num_outputs}")
    for reason, count in unit.reasons.most_common(4):
        lines.append(f"left to PyTorch ({count}): {reason}")
    lines.append("ops:")
    for op, count in unit.ops.most_common(15):
        lines.append(f"  {count:>4} × {short_op(op)}")
    if len(unit.ops) > 15:
        lines.append(f"  ... and {len(unit.ops) - 15} more kinds")
    return "\n".join(lines)


def css_class(unit: Unit) -> str:
    return {"group": "lort_group", "group-pytorch": "lort_group lort_group_pytorch"}.get(unit.kind, f"lort_{unit.kind}")


def dom_id(drawn: DrawnGraph, unit: Unit) -> str:
    return f"{drawn.record.name}__{unit.id}"


def href(drawn: DrawnGraph, unit: Unit) -> str:
    if unit.group is not None:
        return f"#row-{unit.group.name}"
    return f"#reasons-{drawn.record.name}"


def draw(drawn: DrawnGraph, layout: str) -> tuple[str, str]:
    """The SVG for ``drawn`` and the name of the layout that made it. ``layout`` is
    "auto" (dot where installed), "dot" or "networkx"."""
    if layout in ("auto", "dot"):
        dot = shutil.which("dot")
        if dot:
            try:
                return _draw_dot(drawn, dot), "graphviz dot"
            except (OSError, subprocess.SubprocessError, ValueError) as e:
                if layout == "dot":
                    raise RuntimeError(f"lort: graphviz's dot failed to lay out {drawn.record.name}: {e}") from e
                logger.info("lort: graphviz's dot failed (%s); laying %s out with networkx", e, drawn.record.name)
        elif layout == "dot":
            raise RuntimeError(
                "lort: save_html(layout='dot') needs graphviz's `dot` on PATH (Debian: apt-get install "
                "graphviz); layout='auto' or 'networkx' draws without it"
            )
    return _draw_networkx(drawn), "networkx layers"


# -- graphviz ----------------------------------------------------------------------
def _dot_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _dot_label(lines: list[tuple[str, bool]]) -> str:
    rows = []
    for i, (text, bold) in enumerate(lines):
        t = html.escape(text)
        t = f"<B>{t}</B>" if bold else (f'<FONT POINT-SIZE="9" COLOR="#333333">{t}</FONT>' if i else t)
        rows.append(f"<TR><TD>{t}</TD></TR>")
    return '<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="1">' + "".join(rows) + "</TABLE>>"


def _draw_dot(drawn: DrawnGraph, dot: str) -> str:
    names = {u.id: f"u{i}" for i, u in enumerate(drawn.units)}
    tips = {}
    out = [
        "digraph lort {",
        '  graph [rankdir=TB, nodesep=0.25, ranksep=0.32, pad=0.15, bgcolor="transparent", fontname="Helvetica"];',
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10, margin="0.14,0.05", '
        "height=0.3, penwidth=1.4];",
        '  edge [color="#8b95a7", arrowsize=0.6, fontname="Helvetica", fontsize=8, fontcolor="#6b7280"];',
    ]
    for u in drawn.units:
        fill, stroke = colors(u)
        style = "rounded,filled,dashed" if u.kind == "group-pytorch" else "rounded,filled"
        tips[names[u.id]] = tooltip(u)
        out.append(
            f"  {names[u.id]} [id={_dot_str(dom_id(drawn, u))}, class={_dot_str(css_class(u))}, "
            f"label={_dot_label(label_lines(u, drawn))}, fillcolor={_dot_str(fill)}, color={_dot_str(stroke)}, "
            f"style={_dot_str(style)}, URL={_dot_str(href(drawn, u))}];"
        )
    for (a, b), count in drawn.edges.items():
        attrs = f"penwidth={1 + 0.5 * min(4.0, math.log2(count)):.2f}"
        if count > 1:
            attrs += f", label={_dot_str(str(count))}"
        out.append(f"  {names[a]} -> {names[b]} [{attrs}];")
    out.append("}")
    res = subprocess.run([dot, "-Tsvg"], input="\n".join(out).encode(), capture_output=True, timeout=_DOT_TIMEOUT_S)
    if res.returncode != 0:
        raise ValueError(res.stderr.decode(errors="replace").strip() or f"exit status {res.returncode}")
    svg = res.stdout.decode()
    start = svg.find("<svg")
    if start < 0:
        raise ValueError("no <svg> in dot's output")
    svg = svg[start:]
    # Inline in HTML: no namespace declarations (the page names no URL), the size set by CSS.
    end = svg.index(">")
    root = re.sub(r'\s(?:xmlns(?::xlink)?|width|height)="[^"]*"', "", svg[:end])
    vb = re.search(r'viewBox="[-\d.]+ [-\d.]+ ([\d.]+) [\d.]+"', root)
    style = f' style="width:{float(vb.group(1)) * 4 / 3:.0f}px"' if vb else ""  # dot's units are pt
    svg = root.replace("<svg", f'<svg class="lort-graph"{style}', 1) + svg[end:]

    def retitle(m: re.Match) -> str:
        key = html.unescape(m.group(1))
        if key in tips:
            return f"<title>{html.escape(tips[key])}</title>"
        if "->" in key:
            a, b = key.split("->")
            return f"<title>{html.escape(_edge_tip(drawn, names, a, b))}</title>"
        return ""

    svg = re.sub(r"<title>([^<]*)</title>", retitle, svg)
    svg = re.sub(r"<!--.*?-->\n?", "", svg, flags=re.S)
    # dot numbers its own ids (graph0, edge1, a_node1) per drawing: unique in the page.
    own = drawn.record.name + "__"
    svg = re.sub(r'\bid="(?!' + re.escape(own) + r')([^"]*)"', lambda m: f'id="{own}{m.group(1)}"', svg)
    return svg


def _edge_tip(drawn: DrawnGraph, names: dict, a: str, b: str) -> str:
    back = {v: k for k, v in names.items()}
    ua, ub = back.get(a), back.get(b)
    count = drawn.edges.get((ua, ub), 0)
    return f"{count} value(s) from {ua} to {ub}"


# -- networkx ----------------------------------------------------------------------
_CHAR_W, _BOLD_W, _LINE_H, _PAD_X, _PAD_Y, _GAP_X, _GAP_Y = 6.0, 6.9, 13.5, 12, 8, 18, 34


def _size(lines: list[tuple[str, bool]]) -> tuple[float, float]:
    w = max(len(t) * (_BOLD_W if b else _CHAR_W) for t, b in lines)
    return w + 2 * _PAD_X, len(lines) * _LINE_H + 2 * _PAD_Y


def _draw_networkx(drawn: DrawnGraph) -> str:
    import networkx as nx

    g = nx.DiGraph()
    g.add_nodes_from(u.id for u in drawn.units)
    g.add_edges_from(drawn.edges)
    layers = [list(layer) for layer in nx.topological_generations(g)]
    lines = {u.id: label_lines(u, drawn) for u in drawn.units}
    size = {k: _size(v) for k, v in lines.items()}
    order = {u.id: i for i, u in enumerate(drawn.units)}
    for layer in layers:
        layer.sort(key=order.get)
    x: dict[str, float] = {}

    def place(layer: list[str]) -> None:
        total = sum(size[n][0] for n in layer) + _GAP_X * (len(layer) - 1)
        pos = -total / 2
        for n in layer:
            x[n] = pos + size[n][0] / 2
            pos += size[n][0] + _GAP_X

    for layer in layers:
        place(layer)
    for sweep in range(6):  # barycentre ordering, down then up
        seq = layers[1:] if sweep % 2 == 0 else layers[-2::-1]
        for layer in seq:
            near = g.predecessors if sweep % 2 == 0 else g.successors
            key = {}
            for n in layer:
                xs = [x[m] for m in near(n)]
                key[n] = sum(xs) / len(xs) if xs else x[n]
            layer.sort(key=key.get)
            place(layer)
    y: dict[str, float] = {}
    top = _GAP_Y / 2
    for layer in layers:
        h = max(size[n][1] for n in layer)
        for n in layer:
            y[n] = top + (h - size[n][1]) / 2
        top += h + _GAP_Y
    top -= _GAP_Y / 2
    left = min(x[n] - size[n][0] / 2 for n in x) - 10
    width = max(x[n] + size[n][0] / 2 for n in x) - left + 10
    out = [f'<svg class="lort-graph" viewBox="0 0 {width:.0f} {top:.0f}" style="width:{width * 1.2:.0f}px">']
    marker = html.escape(f"{drawn.record.name}__arrow")
    out.append(
        f'<defs><marker id="{marker}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#8b95a7"/></marker></defs>'
    )
    for (a, b), count in drawn.edges.items():
        x1, y1 = x[a] - left, y[a] + size[a][1]
        x2, y2 = x[b] - left, y[b]
        dy = max(20.0, (y2 - y1) / 2)
        w = 1 + 0.5 * min(4.0, math.log2(count))
        out.append(
            f'<g class="edge"><title>{count} value(s) from {html.escape(a)} to {html.escape(b)}</title>'
            f'<path d="M{x1:.1f},{y1:.1f} C{x1:.1f},{y1 + dy:.1f} {x2:.1f},{y2 - dy:.1f} {x2:.1f},{y2 - 1:.1f}" '
            f'fill="none" stroke="#8b95a7" stroke-width="{w:.2f}" marker-end="url(#{marker})"/>'
            + (
                f'<text x="{(x1 + x2) / 2 + 5:.1f}" y="{(y1 + y2) / 2 + 3:.1f}" font-size="9" '
                f'fill="#6b7280">{count}</text>'
                if count > 1
                else ""
            )
            + "</g>"
        )
    for u in drawn.units:
        fill, stroke = colors(u)
        w, h = size[u.id]
        x0, y0 = x[u.id] - left - w / 2, y[u.id]
        dash = ' stroke-dasharray="5,3"' if u.kind == "group-pytorch" else ""
        out.append(
            f'<g id="{html.escape(dom_id(drawn, u))}" class="node {css_class(u)}">'
            f"<title>{html.escape(tooltip(u))}</title>"
            f'<a href="{html.escape(href(drawn, u))}"><rect x="{x0:.1f}" y="{y0:.1f}" width="{w:.1f}" height="{h:.1f}" '
            f'rx="6" fill="{fill}" stroke="{stroke}" stroke-width="1.4"{dash}/>'
        )
        for i, (text, bold) in enumerate(lines[u.id]):
            ty = y0 + _PAD_Y + (i + 0.8) * _LINE_H
            style = ' font-size="9.5" fill="#333"' if i else ' font-size="10.5"'
            style = ' font-weight="bold" font-size="11"' if bold else style
            out.append(
                f'<text x="{x0 + w / 2:.1f}" y="{ty:.1f}" text-anchor="middle"{style}>{html.escape(text)}</text>'
            )
        out.append("</a></g>")
    out.append("</svg>")
    return "\n".join(out)
