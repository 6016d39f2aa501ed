"""The package's shape: imports point down the declared layers (no circles), and every module reads in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "kvcli"
MAX_LINES = 400

# Top to bottom, as docs/architecture.md draws them: a module imports only from its own layer or one below.
# `kvcli` itself (its lazy Python API) sits above them all.
LAYERS = [
    ("cli", ["kvcli.cli", "kvcli.__main__"]),
    ("benchmarks", ["kvcli.bench"]),
    ("front ends", ["kvcli.serve"]),
    ("events", ["kvcli.events"]),
    ("integrations", ["kvcli.integrations"]),
    ("engine", ["kvcli.engine"]),
    ("requests", ["kvcli.requests", "kvcli.generation"]),
    ("remote", ["kvcli.remote"]),
    ("documents", ["kvcli.documents"]),
    ("format", ["kvcli.format"]),
    ("base", ["kvcli.errors", "kvcli.units", "kvcli.home"]),
]


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Modules of kvcli that this one imports (at any depth in the file: lazy imports count too)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out |= {c for c in [target, *(f"{target}.{a.name}" for a in node.names)] if c in mods}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in mods}
    out.discard(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    mods = _modules()
    graph = {name: {m for m in _imports(name, path, mods) if not name.startswith(m + ".") and m != "kvcli"}
             for name, path in mods.items()}  # a module importing its own package's __init__ is not a circle
    assert _cycles(graph) == []


def _layer(module: str) -> int:
    found = [i for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes if module == p or module.startswith(p + ".")]
    assert len(found) == 1, f"{module} belongs to {len(found)} layers of LAYERS: add it to one"
    return found[0]


def test_imports_point_down_the_layers():
    mods = _modules()
    up = sorted(f"{name} ({LAYERS[_layer(name)][0]}) imports {m} ({LAYERS[_layer(m)][0]})"
                for name, path in mods.items() if name != "kvcli"
                for m in _imports(name, path, mods) if m != "kvcli" and _layer(m) < _layer(name))
    assert up == []


def test_the_model_layer_imports_no_scheduling():
    """The runtime's bottom (models, their kernels) knows nothing of the engine loop that drives it."""
    mods = _modules()
    up = sorted(f"{name} imports {m}" for name, path in mods.items() if name.startswith("kvcli.engine.model")
                for m in _imports(name, path, mods) if m.startswith("kvcli.engine.scheduling"))
    assert up == []


RUNTIME = ("kvcli.engine.model", "kvcli.engine.cache", "kvcli.engine.decoding", "kvcli.engine.scheduling",
           "kvcli.engine.prompt")
SERVICES = ("kvcli.engine.corpus", "kvcli.engine.placement", "kvcli.engine.counting")


def test_the_runtime_imports_none_of_the_services_over_it():
    """Models, caches, decoding and scheduling know nothing of corpus runs (Slurm shares, object stores) or counting."""
    mods = _modules()
    up = sorted(f"{name} imports {m}" for name, path in mods.items() if name.startswith(RUNTIME)
                for m in _imports(name, path, mods) if m.startswith(SERVICES))
    assert up == []


def test_no_module_above_the_limit():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules above {MAX_LINES} lines: {long}"


def test_the_cli_is_a_package_of_small_command_modules():
    cli = PACKAGE / "cli"
    assert (cli / "__init__.py").is_file() and not (PACKAGE / "cli.py").exists()
    assert len(list(cli.glob("*.py"))) >= 8


SHARED = {p.stem for p in TESTS.glob("*.py") if not p.name.startswith("test_")}  # conftest, helpers, ...


def test_no_test_module_imports_another():
    """Shared fixtures live in conftest.py and shared code in helper modules, so a test module runs alone and no
    fixture reaches a module by import (ruff's F811 stays on for tests)."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.name}: {name}" for name in names if name.rsplit(".", 1)[-1].startswith("test_")]
            # shared code by its path from the root: a bare `conftest` is whichever folder's conftest imported first
            found += [f"{path.name}: {name}" for name in names if name.split(".")[0] in SHARED]
    assert not found, found


def test_tests_are_grouped_as_the_package():
    """A test module sits in the folder of the kvcli package it tests (tests/engine/ for kvcli/engine/, ...);
    only the repository-wide checks and the base modules' tests stay at the top."""
    top = {"test_docs.py", "test_install.py", "test_layout.py", "test_units.py"}
    misplaced = []
    for path in sorted(TESTS.rglob("test_*.py")):
        folder = path.parent.relative_to(TESTS)
        if folder.parts[:1] == ("bench",):
            continue
        if folder == Path(".") and path.name not in top or folder != Path(".") and not (PACKAGE / folder).is_dir():
            misplaced.append(str(path.relative_to(TESTS)))
    assert not misplaced, misplaced
