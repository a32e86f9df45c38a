"""The layering rule of ARCHITECTURE.md: imports point downward only (training > learner > sessions > envs >
tools > miles); the CLI (`miles/cli.py`) is the one module that wires every floor together; and no modules import each
other in a circle, counting the imports inside functions and under `TYPE_CHECKING`."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"miles.tools": 1, "miles.envs": 2, "miles.sessions": 3, "miles.learner": 4, "miles.training": 5}


def floor_of(module: str) -> int | None:
    for package, floor in PACKAGES.items():
        if module == package or module.startswith(package + "."):
            return floor
    return 0 if module == "miles" or module.startswith("miles.") else None


def upward_imports() -> list[str]:
    """Every import in the package tree (`miles/`, where the folder path is the import path) of a floor above
    its own module's."""
    found = []
    for path in sorted((REPO / "miles").rglob("*.py")):
        relative = path.relative_to(REPO)
        if relative == Path("miles", "cli.py"):
            continue
        floor = floor_of(".".join(relative.with_suffix("").parts)) or 0
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            found += [f"{relative}:{node.lineno} imports {n}" for n in names if (floor_of(n) or 0) > floor]
    return found


def module_graph(root: Path) -> dict[str, set[str]]:
    """Which modules of the package tree under `root` each module imports, wherever the import stands (top
    level, inside a function, under `TYPE_CHECKING`); `from package import name` counts as importing the
    module `package.name` when there is one."""
    modules = {}
    for path in sorted((root / "miles").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [resolve(f"{node.module}.{a.name}") for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [resolve(a.name) for a in node.names]
            else:
                continue
            graph[module] |= {t for t in targets if t is not None and t != module}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of `graph` with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
    return circles


def test_no_modules_import_each_other_in_a_circle():
    assert import_circles(module_graph(REPO)) == []


def test_the_check_sees_a_circle_through_a_lazy_import(tmp_path):
    pkg = tmp_path / "miles"
    pkg.mkdir()
    (pkg / "engine.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from miles.lora import W\n"
    )
    (pkg / "lora.py").write_text("def f():\n    from miles.errors import E\n")
    (pkg / "errors.py").write_text("from miles.engine import EngineError\n")
    (pkg / "leaf.py").write_text("import miles.engine\n")
    assert import_circles(module_graph(tmp_path)) == [["miles.engine", "miles.errors", "miles.lora"]]


def test_no_floor_imports_a_floor_above_it():
    assert upward_imports() == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    fake = tmp_path / "miles" / "tools"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("from miles.sessions import Session\n")
    (tmp_path / "miles" / "sessions").mkdir()
    (tmp_path / "miles" / "sessions" / "fine.py").write_text("from miles.tools import Tool\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert upward_imports() == ["miles/tools/bad.py:1 imports miles.sessions"]
