"""Reporting shared by the benchmarks: the machine and versions line written above every
table, the command that produced a results file, sections of a results file rewritten in
place, the geometric mean of ratios, and where results go (benchmarks/results/).

Suites import it by module name (their folder is on sys.path: ``python -m benchmarks
SUITE`` runs the suite's script in benchmarks/, ``speed`` run.py for example, as listed by
``--list``); studies insert benchmarks/ on sys.path first.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
#: Where the suites write their Markdown tables (and charts.py its PNGs, under charts/).
RESULTS = os.path.join(HERE, "results")
STUDIES = os.path.join(HERE, "studies")
MIB = 2**20


def result_path(name: str) -> str:
    """benchmarks/results/NAME: a suite's default output file."""
    return os.path.join(RESULTS, name)


def study_path(name: str) -> str:
    """benchmarks/studies/NAME: a study's output file."""
    return os.path.join(STUDIES, name)


def command(suite: str, argv: list[str] | None = None) -> str:
    """The command line that produced a results file, as written above its tables: ``python
    -m benchmarks SUITE ARGS`` for a suite, ``python benchmarks/studies/X.py ARGS`` for a
    study (``suite`` given as ``studies/X.py``). ``argv`` None: this process's arguments."""
    args = list(sys.argv[1:] if argv is None else argv)
    head = f"python benchmarks/{suite}" if suite.endswith(".py") else f"python -m benchmarks {suite}"
    return " ".join([head, *args])


def today() -> str:
    return datetime.date.today().isoformat()


def cpu_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name, x86 family and model and widest vector extension from
    ``cpuinfo``, e.g. ``AMD EPYC (family 26, model 2; AVX-512)`` (else what platform
    says). Virtual machines often give only the vendor's name ("AMD EPYC"), and the same
    name covers generations whose GEMMs differ by 2x (benchmarks/studies/gemm_libraries.md)."""
    from lort.compile.disk_cache import cpuinfo_fields

    fields = cpuinfo_fields(cpuinfo)
    name = fields.get("model name")
    if not name:
        return platform.processor() or platform.machine() or "unknown CPU"
    flags = set(fields.get("flags", "").split())
    isa = ("AVX-512 with AMX" if "amx_tile" in flags else "AVX-512" if "avx512f" in flags
           else "AVX2" if "avx2" in flags else None)
    detail = [f"family {fields['cpu family']}, model {fields['model']}"] if "cpu family" in fields and "model" in fields else []
    detail = "; ".join(detail + ([isa] if isa else []))
    return f"{name} ({detail})" if detail else name


def host() -> str:
    """``CPU, N cores``."""
    return f"{cpu_name()}, {os.cpu_count()} cores"


def version(dist: str) -> str:
    """An installed distribution's version, or "absent"."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def versions(extra: tuple[str, ...] = (), torch_detail: str = "") -> str:
    """``Python X, torch Y, onnxruntime Z, onnxscript W, [extra distributions,] lort V``
    (``torch_detail`` follows torch's version, e.g. its CUDA and cuDNN)."""
    import onnxruntime
    import onnxscript
    import torch

    import lort

    parts = [f"Python {platform.python_version()}", f"torch {torch.__version__}{torch_detail}",
             f"onnxruntime {onnxruntime.__version__}", f"onnxscript {onnxscript.__version__}",
             *(f"{d} {version(d)}" for d in extra), f"lort {lort.__version__}"]
    return ", ".join(parts)


def machine() -> str:
    """The host, torch's thread count and the versions: what a CPU results file states
    (``Machine: {machine()}.``)."""
    import torch

    return f"{host()}, torch threads {torch.get_num_threads()}; {versions()}"


def machine_line() -> str:
    """``Machine: ... .`` as one line of a results file."""
    return f"Machine: {machine()}."


def peers_line(dists: tuple[str, ...]) -> str:
    """``Peers: torchao X, ...`` (the peers' installed versions, or "absent")."""
    return "Peers: " + ", ".join(f"{d} {version(d)}" for d in dists) + "."


def geomean(xs) -> float:
    """The geometric mean of ratios (nan for none)."""
    xs = list(xs)
    return statistics.geometric_mean(xs) if xs else float("nan")


def case_tables(results: dict, heading, header: str, align: str, row) -> list[str]:
    """One Markdown table per case of ``results`` (case -> backend -> a child's result):
    ``heading(case, by_backend)`` above it, the ``header`` and ``align`` lines, and a row
    per backend, ``row(backend, result, by_backend)``, or the child's error in the first
    cell with the other cells empty."""
    blanks = " |" * (header.count("|") - 3)
    lines = []
    for case, by_backend in results.items():
        lines += [heading(case, by_backend), "", header, align]
        for b, r in by_backend.items():
            lines.append(f"| {b} | failed: {r['error']} |{blanks}" if "error" in r else row(b, r, by_backend))
        lines.append("")
    return lines


def write_section(path: str, marker: str, lines: list[str], title: str | None = None) -> None:
    """Replace the section between ``<!-- marker -->`` and ``<!-- /marker -->`` in ``path``
    (appended if missing; a new file starts with ``title``), leaving the rest of the file
    (other sections, readings by hand) as it is."""
    begin, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    text = open(path).read() if os.path.exists(path) else (f"{title}\n" if title else "")
    block = "\n".join([begin, *lines, end])
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + block + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def write_file(path: str, text: str, keep_sections: bool = False) -> None:
    """Write a whole results file (its folder made if missing). ``keep_sections``: the
    file's own "## " sections after the table a run writes (dated re-runs and readings
    written by hand) are kept after the new text, not lost to a re-run."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    kept = ""
    if keep_sections and os.path.exists(path):
        with open(path) as f:
            old = f.read()
        at = old.find("\n## ")
        kept = old[at:] if at >= 0 else ""
    with open(path, "w") as f:
        f.write(text + kept)
