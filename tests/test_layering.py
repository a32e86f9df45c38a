"""The layering rule of ARCHITECTURE.md: imports point downward only (trainers > sessions > envs > tools >
miles); the CLI (`miles/cli.py`) is the one module that wires every floor together."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"miles.tools": 1, "miles.envs": 2, "miles.sessions": 3, "miles.trainers": 4}


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


def test_no_floor_imports_a_floor_above_it():
    assert upward_imports() == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    fake = tmp_path / "miles" / "tools"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("from miles.sessions import Session\n")
    (tmp_path / "miles" / "sessions").mkdir()
    (tmp_path / "miles" / "sessions" / "fine.py").write_text("from miles.tools import Tool\n")
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    assert upward_imports() == ["miles/tools/bad.py:1 imports miles.sessions"]
