"""Brings the benchmark result tables and studies into the site.

The files stay where the benchmark suites write them (``benchmarks/results/*.md``,
``benchmarks/studies/*.md``, charts in ``benchmarks/results/charts/``). When the build
starts, each is copied into ``docs/_generated/`` as a page of its own, unchanged but for
its heading levels (made consecutive, ``_headings``) and its links: a link to another copied page stays a link, a link to a chart is pointed
at the copied chart, and a link to any other repository file (a script, a file not in
the site) becomes that file's repository path as literal text. ``_generated/charts.md``
shows the charts that exist (copied to ``_generated/charts/``), or says they are absent.
Nothing in a table or in the text's words is changed.
"""

from __future__ import annotations

import os
import re
import shutil

KINDS = ("results", "studies")
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
CHARTS = ("headline", "speed", "training", "memory")


def _rewrite(text: str, src_dir: str, root: str, out_dir: str, pages: dict) -> str:
    def repl(m: re.Match) -> str:
        bang, label, target = m.groups()
        if re.match(r"[a-z]+://", target) or target.startswith(("#", "mailto:")):
            return m.group(0)
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(src_dir, path))
        if full in pages:
            rel = os.path.relpath(pages[full], out_dir).replace(os.sep, "/")
            return f"{bang}[{label}]({rel}{'#' + anchor if anchor else ''})"
        repo_path = os.path.relpath(full, root).replace(os.sep, "/")
        if bang and os.path.exists(full):
            return f"{bang}[{label}]({os.path.relpath(full, out_dir).replace(os.sep, '/')})"
        shown = label.strip("`")
        return f"`{repo_path}`" if shown in (repo_path, path, os.path.basename(path)) else f"{label} (`{repo_path}`)"

    return LINK.sub(repl, text)


def _headings(text: str, title: str) -> str:
    """Heading levels made consecutive (a file's H1 then H3 becomes H1 then H2), with
    ``title`` as the H1 of a file that has none: Sphinx needs a page title and MyST
    warns on skipped levels. The headings' words are kept."""
    out, fence, stack = [], False, []
    if not any(line.startswith("# ") for line in text.splitlines()):
        out += [f"# {title}", ""]
        stack = [1]
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
        m = None if fence else re.match(r"(#{1,6}) ", line)
        if m:
            level = len(m.group(1))
            while stack and stack[-1] >= level:
                stack.pop()
            new = min(level, len(stack) + 1)
            stack.append(level)
            line = "#" * new + line[len(m.group(1)):]
        out.append(line)
    return "\n".join(out) + "\n"


def generate(app, config) -> None:
    """Write docs/_generated/{results,studies}/*.md and docs/_generated/charts.md."""
    docs = app.srcdir
    root = os.path.dirname(docs)
    out = os.path.join(docs, "_generated")
    shutil.rmtree(out, ignore_errors=True)
    pages: dict[str, str] = {}
    for kind in KINDS:
        src = os.path.join(root, "benchmarks", kind)
        if not os.path.isdir(src):
            continue
        os.makedirs(os.path.join(out, kind), exist_ok=True)
        for name in sorted(os.listdir(src)):
            if name.endswith(".md"):
                page = "index.md" if name == "README.md" else name
                pages[os.path.join(src, name)] = os.path.join(out, kind, page)
    for src, dst in pages.items():
        with open(src, encoding="utf-8") as f:
            text = f.read()
        text = _rewrite(text, os.path.dirname(src), root, os.path.dirname(dst), pages)
        text = _headings(text, f"`{os.path.relpath(src, root)}`")
        note = (f"% Generated from {os.path.relpath(src, root)} by docs/_ext/benchpages.py: "
                "edit that file, not this one.\n\n")
        with open(dst, "w", encoding="utf-8") as f:
            f.write(note + text)
    charts = os.path.join(root, "benchmarks", "results", "charts")
    lines = []
    for name in CHARTS:
        png = os.path.join(charts, name + ".png")
        if os.path.exists(png):
            # Copied beside the pages; charts.md is included by docs/benchmarks.md, so its
            # image paths are relative to docs/.
            os.makedirs(os.path.join(out, "charts"), exist_ok=True)
            shutil.copyfile(png, os.path.join(out, "charts", name + ".png"))
            lines.append(f"![{name} chart: benchmarks/results/charts/{name}.png](_generated/charts/{name}.png)\n")
    if not lines:
        lines.append("The charts (`python -m benchmarks charts`, written to `benchmarks/results/charts/`) "
                     "were not present when this site was built.\n")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "charts.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def setup(app):
    app.connect("config-inited", generate)
    return {"parallel_read_safe": True}
