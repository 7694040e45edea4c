"""The benchmark suite's layout (benchmarks/__main__.py): ``python -m benchmarks --list``
names every suite, each suite's script and results files exist, and every study script
in benchmarks/studies/ has its entry in benchmarks/studies/README.md. Runs nothing heavy."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
#: The suites users run (issue 44): the entry point must keep offering each.
EXPECTED = {"speed", "training", "batched", "scale", "first-call", "generation", "quantized-decoding", "quantized-encoder", "engine-limit", "memory", "frozen-memory",
            "conformance", "cuda", "cuda-memory", "charts"}


def _entry_point():
    spec = importlib.util.spec_from_file_location("benchmarks_main", BENCH / "__main__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_list_names_every_suite():
    out = subprocess.run([sys.executable, "-m", "benchmarks", "--list"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    listed = {line.split()[0] for line in out.stdout.splitlines() if line.startswith("  ") and line.split()
              and not line.strip().startswith("script:")}
    assert EXPECTED <= listed, EXPECTED - listed
    for suite in _entry_point().SUITES:
        assert suite.name in listed
        for path in suite.results:
            assert f"benchmarks/{path}" in out.stdout


def test_unknown_suite_fails():
    out = subprocess.run([sys.executable, "-m", "benchmarks", "no-such-suite"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2
    assert "unknown suite" in out.stderr


def test_each_suite_has_its_script_and_results():
    suites = _entry_point().SUITES
    assert {s.name for s in suites} == EXPECTED
    for s in suites:
        assert (BENCH / s.script).is_file(), f"{s.name}: benchmarks/{s.script} is missing"
        assert s.results, f"{s.name} names no results file"
        for path in s.results:
            assert path.startswith("results/"), path
            assert (BENCH / path).is_file(), f"{s.name}: benchmarks/{path} is missing"


def test_results_files_say_what_produced_them():
    """Each results table's file names the command that produced it."""
    for s in _entry_point().SUITES:
        for path in s.results:
            if path.endswith(".md"):
                text = (BENCH / path).read_text()
                assert "python -m benchmarks" in text or "make " in text, path


def test_every_study_is_in_the_studies_readme():
    readme = (BENCH / "studies" / "README.md").read_text()
    scripts = sorted(p.name for p in (BENCH / "studies").glob("*.py"))
    assert scripts, "no study scripts found"
    missing = [name for name in scripts if f"benchmarks/studies/{name}" not in readme]
    assert not missing, f"studies without an entry (and command) in benchmarks/studies/README.md: {missing}"
    # Each linked .md exists beside it.
    for md in sorted(p.name for p in (BENCH / "studies").glob("*.md")):
        if md != "README.md":
            assert f"({md})" in readme, f"benchmarks/studies/{md} is not linked from its README"


def test_no_results_or_study_file_left_at_the_top():
    """Results live in benchmarks/results/, studies in benchmarks/studies/: only suites'
    scripts and shared modules stay in benchmarks/ itself."""
    assert not sorted(p.name for p in BENCH.glob("*.md"))


def _report():
    spec = importlib.util.spec_from_file_location("benchmarks_report", BENCH / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_name_the_cpus_generation_and_vector_extension(tmp_path):
    """A VM's model name ("AMD EPYC") covers generations whose GEMMs differ by 2x, so a
    results file's machine line gives the x86 family, model and widest extension."""
    report = _report()
    block = "processor\t: {i}\nvendor_id\t: AuthenticAMD\ncpu family\t: {fam}\nmodel\t\t: {model}\nmodel name\t: AMD EPYC\nflags\t\t: {flags}\n\n"
    cases = [((26, 2, "fpu avx2 avx512f avx512bw"), "AMD EPYC (family 26, model 2; AVX-512)"),
             ((25, 1, "fpu avx2"), "AMD EPYC (family 25, model 1; AVX2)"),
             ((6, 143, "avx2 avx512f amx_tile"), "AMD EPYC (family 6, model 143; AVX-512 with AMX)")]
    for (fam, model, flags), want in cases:
        info = tmp_path / f"cpuinfo-{fam}"
        # two processors: the first block is read
        info.write_text(block.format(i=0, fam=fam, model=model, flags=flags) + block.format(i=1, fam=0, model=0, flags=""))
        assert report.cpu_name(str(info)) == want
    bare = tmp_path / "bare"
    bare.write_text("model name\t: Some CPU\n")
    assert report.cpu_name(str(bare)) == "Some CPU"


def test_training_table_gives_both_front_ends_columns():
    """engines.py's table (python -m benchmarks training) from a child's result: each lort
    front end's step, ratios, settling and engines in its own columns, a graph that never
    switched (no second step) written as "-"."""
    # engines.py puts benchmarks/ on sys.path and imports its report.py as "report":
    # both are undone, so that no later test imports a benchmark module by a bare name.
    path, modules = list(sys.path), set(sys.modules)
    try:
        spec = importlib.util.spec_from_file_location("benchmarks_engines", BENCH / "engines.py")
        engines = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(engines)
    finally:
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            if getattr(sys.modules[name], "__file__", "") and str(BENCH) in sys.modules[name].__file__:
                del sys.modules[name]
    graphs = [("g1_forward", "inductor", {"ort": 20.0, "pytorch": 11.0, "inductor": 10.0})]
    result = {
        "first": {"eager": 1.0, "inductor": 40.0, "lort": 20.0, "ortmodule": 19.0},
        "final": {"lort": 60.0, "ortmodule": 45.0}, "meanwhile": {"lort": 9, "ortmodule": 0},
        "meanwhile_ms": {"lort": 4000.0, "ortmodule": 0.0}, "second_s": {"lort": 9.5, "ortmodule": None},
        "steady_ms": {"eager": 990.0, "inductor": 880.0, "lort": 890.0, "ortmodule": 900.0},
        "lort_vs_eager": 1.11, "lort_vs_inductor": 0.99, "inductor_vs_eager": 1.12,
        "ortmodule_vs_eager": 1.10, "ortmodule_vs_inductor": 0.978,
        "graphs": {"lort": graphs, "ortmodule": graphs[:0]},
        "switches": {"lort": [], "ortmodule": []},
    }
    header, rule, row = engines.table({"resnet50": result}, 8)
    cells = [c.strip() for c in row.strip("|").split("|")]
    names = [c.strip() for c in header.strip("|").split("|")]
    assert len(cells) == len(names) == rule.count("|") - 1
    got = dict(zip(names, cells))
    assert got["case"] == "resnet50 train, batch 8 at 224 px"
    assert (got["lort ms"], got["ORTModule ms"]) == ("890.0", "900.0")
    assert (got["ORTModule vs eager"], got["ORTModule vs inductor"]) == ("1.10x", "0.98x")
    assert got["first s eager / inductor / lort / ORTModule"] == "1.0 / 40.0 / 20.0 / 19.0"
    assert (got["lort 2nd step s"], got["ORTModule 2nd step s"]) == ("9.5", "-")
    assert got["lort final s (steps meanwhile, their median ms)"] == "60.0 (9, 4000)"
    assert got["engines chosen, lort"] == "g1_forward: inductor (ort 20.0 ms, pytorch 11.0 ms, inductor 10.0 ms)"
    assert got["engines chosen, ORTModule"] == ""
