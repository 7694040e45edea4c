"""The shape of the code (ARCHITECTURE.md): which layer may import which, file sizes,
and no repeated blocks. Read from the source with ``ast``, imports inside functions
included, so a lazy import cannot hide a dependency that runs back up a layer."""

from __future__ import annotations

import ast
import collections
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "lort"

#: Dependency order: a module may import lort modules of its own layer or a lower one.
#: The pipeline's stages run capture -> fusion -> translate -> compile -> runtime; the
#: import order differs where a stage uses a lower service: fusion asks the runtime's
#: provider and dtype tables, the compiler builds runtime sessions to time them, and the
#: compiler fills the diagnostics records.
LAYERS = [
    ("lort._version", "lort.offload_dir", "lort.options", "lort.errors", "lort.reasons", "lort.ort_model", "lort.numpy_views"),
    ("lort.translate",),
    ("lort.runtime",),
    ("lort.fusion",),
    ("lort.capture",),
    ("lort.diagnostics",),
    ("lort.compile",),
    ("lort.backend",),
    ("lort.module",),
    # The public entry points: explain() compiles with a backend of its own.
    ("lort.registration", "lort.diagnostics.explain", "lort.testing", "lort"),
]
MAX_LINES = 450
#: A block of this many consecutive code lines may not appear twice in src/lort.
DUPLICATE_LINES = 6


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> int:
    best, rank = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    assert rank is not None, f"{module} is in no layer of tests/test_architecture.py"
    return rank


def _lort_imports(path: pathlib.Path) -> set[str]:
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "lort")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "lort":
                continue
            # "from . import x" names submodules: check each.
            for a in node.names:
                sub = f"{target}.{a.name}"
                found.add(sub if (SRC.parent / sub.replace(".", "/")).exists()
                          or (SRC.parent / (sub.replace(".", "/") + ".py")).exists() else target)
    return found


SOURCES = sorted(SRC.rglob("*.py"))


def test_no_import_runs_back_up_a_layer():
    wrong = []
    for path in SOURCES:
        me = _module_name(path)
        for target in _lort_imports(path):
            if _layer(target) > _layer(me):
                wrong.append(f"{me} imports {target}")
    assert not wrong, "imports that run back up a layer (see ARCHITECTURE.md):\n" + "\n".join(sorted(wrong))


def test_runtime_imports_no_compile_time_stage():
    """The runtime binds and runs what the compile stage built: it imports nothing from
    capture, fusion, translate, compile or the backend."""
    forbidden = ("lort.capture", "lort.fusion", "lort.translate", "lort.compile", "lort.backend")
    wrong = [
        f"{_module_name(p)} imports {t}"
        for p in SOURCES if _module_name(p).startswith("lort.runtime")
        for t in _lort_imports(p) if t.startswith(forbidden)
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(SRC)))
def test_file_is_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(SRC)} has {lines} lines (limit {MAX_LINES}): split it by job"


def _code_lines(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, stripped text) of lines that carry code: not blank, not comments,
    not lone brackets."""
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#") or text in (")", "]", "}", "),", "],", "},", '"""'):
            continue
        out.append((i, text))
    return out


def test_no_block_is_repeated():
    seen: dict[tuple, tuple[str, int]] = {}
    repeats = collections.defaultdict(list)
    for path in SOURCES:
        lines = _code_lines(path)
        for k in range(len(lines) - DUPLICATE_LINES + 1):
            window = tuple(t for _, t in lines[k : k + DUPLICATE_LINES])
            where = (str(path.relative_to(SRC)), lines[k][0])
            first = seen.setdefault(window, where)
            if first != where and (first[0] != where[0] or abs(first[1] - where[1]) >= DUPLICATE_LINES):
                repeats[first].append(where)
    assert not repeats, "blocks of %d code lines repeated:\n%s" % (
        DUPLICATE_LINES,
        "\n".join(f"{a}:{b} also at {', '.join(f'{f}:{n}' for f, n in v)}" for (a, b), v in repeats.items()),
    )


def _import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in SOURCES}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for t in _lort_imports(path):
            while t not in modules and "." in t:  # "from .x import name": the module x
                t = t.rpartition(".")[0]
            if t in modules and t != name:
                targets.add(t)
        graph[name] = targets
    return graph


def test_no_import_circle():
    """No module imports, through any chain of lort imports (lazy ones included), a
    module that imports it back: each folder reads top-down."""
    graph = _import_graph()
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_no_module_imports_the_package_root():
    """``lort`` (the package root) is what users import; modules inside it import the
    module that holds what they need."""
    wrong = [_module_name(p) for p in SOURCES if _module_name(p) != "lort" and "lort" in _lort_imports(p)]
    assert not wrong, wrong
