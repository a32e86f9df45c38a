"""The layering rule of ARCHITECTURE.md: imports point downward only (trainers > sessions > envs > tools >
miles); the CLI (`miles/cli.py`) is the one module that wires every floor together."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLOORS = {"miles": 0, "tools": 1, "envs": 2, "sessions": 3, "trainers": 4}
PACKAGES = {"miles.tools": 1, "miles.envs": 2, "miles.sessions": 3, "miles.trainers": 4}


def floor_of(module: str) -> int | None:
    for package, floor in PACKAGES.items():
        if module == package or module.startswith(package + "."):
            return floor
    return 0 if module == "miles" or module.startswith("miles.") else None


def upward_imports() -> list[str]:
    found = []
    for folder, floor in FLOORS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            if path == REPO / "miles" / "cli.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                found += [f"{path.relative_to(REPO)}:{node.lineno} imports {n}" for n in names
                          if (floor_of(n) or 0) > floor]
    return found


def test_no_floor_imports_a_floor_above_it():
    assert upward_imports() == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    fake = tmp_path / "tools"
    fake.mkdir()
    (fake / "bad.py").write_text("from miles.sessions import Session\n")
    for folder in FLOORS:
        (tmp_path / folder).mkdir(exist_ok=True)
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    assert upward_imports() == ["tools/bad.py:1 imports miles.sessions"]
