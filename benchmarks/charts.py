"""Charts of the benchmark results, drawn from the Markdown tables in benchmarks/results/
(nothing is measured or re-run; every figure is read as the table prints it, none is
computed here but the bars' positions). Each chart's footer names the source file, the
section the table sits in, and the date, machine and command written above that table.

    python -m benchmarks charts [--out DIR]

Writes, in benchmarks/results/charts/ (``--out``):

- ``headline.png`` (for the README): lort's speed-up over eager and over inductor for
  batch-1 and batch-8 inference (the geomean lines of results/speed.md's fullest run) and
  training steps (results/training.md's rows), and peak memory against eager's (the
  training-step memory tables of results/training.md, the geomeans of results/memory.md);
- ``speed.png``: results/speed.md per model and scenario, lort vs eager and vs inductor;
- ``training.png``: results/training.md's training steps per case;
- ``memory.png``: results/memory.md's peak growth per model and backend, and
  results/scale.md's first-call peak against eager's at real sizes.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402

EAGER, INDUCTOR, LORT, MODULE = "#8c8c8c", "#e8893b", "#2f6db5", "#5aa05a"
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


class Table:
    """One Markdown table of a results file, with what is written above it."""

    def __init__(self, path: str, lines: list[str], start: int, end: int):
        self.path, self.start, self.end = path, start, end
        cells = [split_row(line) for line in lines[start:end]]
        self.header, self.rows = cells[0], [r for r in cells[2:] if len(r) == len(cells[0])]
        # What is written above it: from its section's heading (level 1 or 2) or section
        # marker on, the later one.
        top = 0
        for i in range(start - 1, -1, -1):
            if re.match(r"#{1,2} ", lines[i]) or re.match(r"<!-- [^/]", lines[i]):
                top = i
                break
        self.heading = next((lines[i].lstrip("#").strip() for i in range(start - 1, -1, -1)
                             if lines[i].startswith("#")), "")
        self.section = next((lines[i].lstrip("#").strip() for i in range(start - 1, -1, -1)
                             if re.match(r"#{1,2} ", lines[i])), self.heading)
        self.context = "\n".join(lines[top:start])
        self.after = lines[end:]

    def col(self, name: str) -> int:
        return self.header.index(name)

    def get(self, row: list[str], name: str) -> str:
        return row[self.col(name)]

    def date(self) -> str:
        found = DATE.findall(self.context) or DATE.findall(self.heading)
        return found[-1] if found else "date not stated"

    def machine(self) -> str:
        m = (re.findall(r"Machine: (.+?)\.(?:\s|$)", self.context)
             or re.findall(r"Taken \S+ on (.+?)\.(?:\s|$)", self.context))
        if not m:
            return f"machine: as the section '{self.section}' says"
        return m[-1].split(";")[0].strip()

    def command(self) -> str:
        m = re.findall(r"`((?:python|make)[^`]*)`", self.context.replace("\n", " "))
        return m[-1].strip() if m else ""

    def source(self) -> str:
        rel = os.path.relpath(self.path, os.path.dirname(report.HERE))
        cmd = self.command()
        return (f"{rel} ('{self.section}'): {self.date()}, {self.machine()}"
                + (f"; `{cmd}`" if cmd and cmd not in self.section else ""))


def split_row(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(path: str) -> list[Table]:
    lines = open(path).read().splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-:| ]+\|$", lines[i + 1]):
            j = i + 2
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            out.append(Table(path, lines, i, j))
            i = j
        else:
            i += 1
    return out


def number(cell: str) -> float | None:
    m = re.fullmatch(r"([\d.]+)x?", cell.strip())
    return float(m.group(1)) if m else None


def result(name: str) -> str:
    return report.result_path(name)


# --- what each chart reads ---------------------------------------------------------------

def speed_tables() -> dict:
    """Per scenario of results/speed.md, the table with the most rows of it (the later on a
    tie) and the geomean line written under that table: {scenario: (table, rows, geomean)}."""
    best: dict = {}
    for t in tables(result("speed.md")):
        if t.header[:2] != ["model", "run"] or "lort vs eager" not in t.header:
            continue
        for scenario in dict.fromkeys(t.get(r, "run") for r in t.rows):
            rows = [r for r in t.rows if t.get(r, "run") == scenario]
            if scenario not in best or len(rows) >= len(best[scenario][1]):
                best[scenario] = (t, rows)
    out = {}
    for scenario, (t, rows) in best.items():
        geo = None
        for line in t.after:
            if line.startswith("|"):
                break  # the next table
            m = re.match(rf"- {scenario}: geomean lort speed-up ([\d.]+)x over eager, ([\d.]+)x over inductor", line)
            if m:
                geo = (float(m.group(1)), float(m.group(2)))
                break
        out[scenario] = (t, rows, geo)
    return out


def training_rows() -> list[tuple[Table, list[str]]]:
    """results/training.md's training steps, the latest row of each case."""
    latest: dict = {}
    for t in tables(result("training.md")):
        if t.header[:1] == ["case"] and "lort vs eager" in t.header:
            for r in t.rows:
                latest[t.get(r, "case").split(" train")[0]] = (t, r)
    return list(latest.values())


def training_memory() -> list[tuple[str, Table]]:
    """results/training.md's tables of a training step's memory (a "peak / eager's" column)."""
    return [(t.heading, t) for t in tables(result("training.md")) if "peak / eager's" in t.header]


def memory_geomeans() -> tuple[Table, dict]:
    # The suite's full run (the table with the most models), not a later re-run of a few.
    t = max((t for t in tables(result("memory.md")) if "lort peak MiB" in t.header), key=lambda t: len(t.rows))
    geo = {}
    for line in t.after:
        if line.startswith(("#", "|")):  # the next section or table: its geomeans are not this table's
            break
        m = re.match(r"- (peak|steady): geomean lort / (eager|inductor) ([\d.]+)", line)
        if m:
            geo.setdefault((m.group(1), m.group(2)), float(m.group(3)))
    return t, geo


SCENARIO_TEXT = {"infer1": "inference, batch 1", "infer8": "inference, batch 8", "train": "training step, batch 8"}
CASE_TEXT = {"bert_base": "BERT-base", "gpt2_small": "GPT-2 small", "resnet50": "ResNet-50", "vit_small": "ViT-S/16"}


def label_bars(ax, bars, fmt="{:.2f}x", size=10):
    for b in bars:
        h = b.get_height()
        ax.annotate(fmt.format(h), (b.get_x() + b.get_width() / 2, h), ha="center", va="bottom",
                    fontsize=size, xytext=(0, 2), textcoords="offset points")


def save(fig, path: str, lines: list[str], size: float, bottom: tuple[float, float], top: float, dpi: int) -> str:
    """The footer ``lines`` (the sources), the layout above them (``bottom``: the margin's
    base and its height per source line), the PNG at ``path``; returns ``path``."""
    footer(fig, lines, size=size)
    fig.tight_layout(rect=(0, bottom[0] + bottom[1] * (len(lines) - 1), 1, top))
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def footer(fig, lines: list[str], size=8.5) -> None:
    fig.text(0.01, 0.005, "\n".join(lines), ha="left", va="bottom", fontsize=size, color="#444444", wrap=True)


def grouped(ax, labels, series, colors, fmt="{:.2f}x", size=10):
    """Bars of several series per label; None values are left out."""
    n = len(series)
    width = 0.8 / n
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (n - 1) / 2) * width for i, v in enumerate(values) if v is not None]
        vs = [v for v in values if v is not None]
        bars = ax.bar(xs, vs, width, label=name, color=colors[k])
        if fmt:
            label_bars(ax, bars, fmt, size)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels)


def ratios(ax, labels, series, colors, *, ylabel, title, legend, headroom, size=10, title_size=13,
           ylabel_size=None, legend_size=10, tick_size=None):
    """Grouped bars of ratios (``grouped``) with the 1.0 reference line, the y axis from 0
    to ``headroom`` times the largest bar, and the panel's labels and legend."""
    grouped(ax, labels, series, colors, size=size)
    ax.axhline(1.0, color="black", lw=1, ls="--")
    ax.set_ylim(0, max(v for vs in series.values() for v in vs if v) * headroom)
    ax.set_ylabel(ylabel, **({"fontsize": ylabel_size} if ylabel_size else {}))
    ax.set_title(title, fontsize=title_size)
    ax.legend(fontsize=legend_size, loc=legend)
    if tick_size:
        ax.tick_params(axis="x", labelsize=tick_size)


def headline(out: str) -> str:
    speed = speed_tables()
    train = training_rows()
    labels, vs_eager, vs_inductor, sources = [], [], [], []
    for scenario in ("infer1", "infer8"):
        t, rows, geo = speed[scenario]
        if geo is None:
            continue
        labels.append(f"inference\nbatch {scenario[-1]}\n{len(rows)} models\n(geomean)")
        vs_eager.append(geo[0])
        vs_inductor.append(geo[1])
        sources.append(f"inference: {t.source()}")
    for t, r in train:
        case, _, rest = t.get(r, "case").partition(" train, ")
        labels.append(f"training\n{CASE_TEXT.get(case, case)}\n{rest.replace(' at ', chr(10) + 'at ')}")
        vs_eager.append(number(t.get(r, "lort vs eager")))
        vs_inductor.append(number(t.get(r, "lort vs inductor")))
    for src in dict.fromkeys(t.source() for t, _ in train):
        sources.append(f"training: {src}")

    mem_tables = training_memory()
    mt, geo = memory_geomeans()
    mem_labels, mem_lort, mem_inductor = [], [], []
    for heading, t in mem_tables:
        rows = {t.get(r, "backend"): r for r in t.rows}
        name = heading.split(" (")[0].replace(" fwdbwd", "")
        mem_labels.append(f"{CASE_TEXT.get(name, name)}\nfwd + bwd\n1st-call peak")
        mem_lort.append(number(t.get(rows["lort"], "peak / eager's")) if "lort" in rows else None)
        mem_inductor.append(number(t.get(rows["inductor"], "peak / eager's")) if "inductor" in rows else None)
    if mem_tables:
        sources.append(f"memory: {mem_tables[0][1].source()}")
    for key, text in (("peak", "peak"), ("steady", "steady")):
        if (key, "eager") in geo:
            mem_labels.append(f"{len(mt.rows)} small\nmodels, 20\nsteps: {text}\n(geomean)")
            mem_lort.append(geo[(key, "eager")])
            mem_inductor.append(None)
    sources.append(f"memory: {mt.source()}")

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(15, 7.4), gridspec_kw={"width_ratios": [3, 2]})
    panel = {"headroom": 1.15, "size": 10.5, "ylabel_size": 11, "legend_size": 11, "tick_size": 9.5}
    ratios(ax, labels, {"lort vs eager": vs_eager, "lort vs inductor": vs_inductor}, [LORT, INDUCTOR],
           ylabel="speed-up (time of the other / lort's time)", title="Speed: above 1 = lort faster",
           legend="upper right", **panel)
    ratios(bx, mem_labels, {"lort": mem_lort, "inductor": mem_inductor}, [LORT, INDUCTOR],
           ylabel="peak memory / eager's peak", title="Memory: below 1 = less than eager", legend="upper left",
           **panel)
    fig.suptitle("lort on CPU against eager PyTorch and inductor (torch.compile)", fontsize=15)
    sources = list(dict.fromkeys(sources))
    sources = ["Sources (date, machine, command as written above each table):", *sources]
    return save(fig, os.path.join(out, "headline.png"), sources,
                size=8, bottom=(0.03, 0.022), top=0.96, dpi=110)


def speed_chart(out: str) -> str:
    speed = speed_tables()
    scenarios = [s for s in ("infer1", "infer8", "train") if s in speed]
    fig, axes = plt.subplots(len(scenarios), 1, figsize=(14, 4.6 * len(scenarios)))
    sources = []
    for ax, scenario in zip(axes, scenarios):
        t, rows, _ = speed[scenario]
        models = [t.get(r, "model") for r in rows]
        ratios(ax, models, {"lort vs eager": [number(t.get(r, "lort vs eager")) for r in rows],
                            "lort vs inductor": [number(t.get(r, "lort vs inductor")) for r in rows]},
               [LORT, INDUCTOR], ylabel="speed-up", legend="upper right", headroom=1.18, size=9, title_size=12,
               tick_size=10.5,
               title=f"{SCENARIO_TEXT[scenario]} ({t.date()}): torch.compile(backend=\"lort\"), above 1 = lort faster")
        sources.append(f"{scenario}: {t.source()}")
    return save(fig, os.path.join(out, "speed.png"), ["Sources:", *sources],
                size=8.5, bottom=(0.02, 0.012), top=1, dpi=100)


def training_chart(out: str) -> str:
    rows = training_rows()
    labels = []
    for t, r in rows:
        case, _, rest = t.get(r, "case").partition(" train, ")
        labels.append(f"{CASE_TEXT.get(case, case)}\n{rest}\n({t.date()})")
    series = {"lort vs eager": [number(t.get(r, "lort vs eager")) for t, r in rows],
              "lort vs inductor": [number(t.get(r, "lort vs inductor")) for t, r in rows],
              "inductor vs eager": [number(t.get(r, "inductor vs eager")) for t, r in rows]}
    fig, ax = plt.subplots(figsize=(12, 6.2))
    ratios(ax, labels, series, [LORT, INDUCTOR, EAGER], ylabel="speed-up of a training step (median of rounds)",
           title="Training steps, lort with executor=\"auto\" (engines ort, pytorch, inductor)",
           legend="upper right", headroom=1.2)
    sources = list(dict.fromkeys(t.source() for t, _ in rows))
    return save(fig, os.path.join(out, "training.png"), ["Sources:", *sources],
                size=8.5, bottom=(0.03, 0.03), top=1, dpi=100)


def memory_chart(out: str) -> str:
    mt, _ = memory_geomeans()
    models = [mt.get(r, "model") for r in mt.rows]
    series = {b: [number(mt.get(r, f"{b} peak MiB")) for r in mt.rows] for b in ("eager", "inductor", "lort")}
    scale = [t for t in tables(result("scale.md"))
             if "peak / eager's" in t.header and "<!-- scale:memory -->" in t.context]
    if not scale:  # a table under its own heading: its section marker is further up
        text = open(result("scale.md")).read()
        block = text[text.index("<!-- scale:memory -->"):text.index("<!-- /scale:memory -->")] \
            if "<!-- scale:memory -->" in text else ""
        scale = [t for t in tables(result("scale.md")) if "peak / eager's" in t.header and t.heading in block]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(13, 10.5))
    grouped(ax, models, series, [EAGER, INDUCTOR, LORT], fmt="{:.0f}", size=8)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_ylabel("peak RSS growth over 20 steps, MiB (log scale)")
    ax.set_title(f"Training at batch 8, 20 steps, peak growth over the baseline ({mt.date()})", fontsize=12)
    ax.legend(fontsize=10, loc="upper left")
    cases, per = [], {"inductor": [], "lort": [], "ortmodule": []}
    for t in scale:
        rows = {t.get(r, "backend"): r for r in t.rows}
        cases.append(t.heading.replace(" (weights", "\n(weights"))
        for b in per:
            per[b].append(number(t.get(rows[b], "peak / eager's")) if b in rows else None)
    if cases:
        ratios(bx, cases, {"inductor": per["inductor"], "lort (torch.compile)": per["lort"],
                           "lort.ORTModule": per["ortmodule"]}, [INDUCTOR, LORT, MODULE],
               ylabel="first call's peak RSS / eager's", legend="upper right", headroom=1.2, size=9.5,
               title_size=12,
               title=f"Real sizes: the first call's peak against eager's ({scale[0].date()}; below 1 = less)")
    sources = [mt.source()] + ([scale[0].source()] if scale else [])
    return save(fig, os.path.join(out, "memory.png"), ["Sources:", *sources],
                size=8.5, bottom=(0.02, 0.018), top=1, dpi=100)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=report.result_path("charts"), help="default: benchmarks/results/charts")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    for draw in (headline, speed_chart, training_chart, memory_chart):
        print("wrote", draw(a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
