"""The README's "define your own environment" snippet (docs/snippets/define_env.py) runs as written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SNIPPET = Path(__file__).resolve().parents[2] / "docs" / "snippets" / "define_env.py"


def test_snippet_runs_and_prints_the_reward():
    assert len(SNIPPET.read_text().splitlines()) <= 30
    out = subprocess.run([sys.executable, str(SNIPPET)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["get_temperature", "1.0 {'correct': 1.0}"]


def test_readme_shows_the_snippet_verbatim():
    readme = (SNIPPET.parents[2] / "README.md").read_text()
    assert "```python\n" + SNIPPET.read_text() + "```" in readme
