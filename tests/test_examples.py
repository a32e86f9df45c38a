"""The user-defined-environment example runs end to end (SFT + GRPO on the tiny model) as a subprocess; a run
again into its folder is one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_custom_env_example_trains_a_registered_user_env(tmp_path):
    script = EXAMPLES / "custom_env.py"
    lines = script.read_text().splitlines()
    env_block = lines[lines.index("# ---") + 1 : len(lines) - lines[::-1].index("# ---") - 1]
    assert 0 < len(env_block) < 50
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            "--steps",
            "1",
            "--sft-demos",
            "8",
            "--eval-tasks",
            "2",
            "--tasks-per-step",
            "2",
            "--group-size",
            "2",
            "--model-size",
            "0.1m",
            "--output-dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[sft] 8 oracle demos" in proc.stdout and "held-out success" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps_done"] == 1 and set(summary["evals"]) == {"start", "final"}
    rows = [json.loads(line) for line in (out / "sessions.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 and {r["env_id"] for r in rows} == {"Shop-v0"}
    assert all(r["tools"][0]["function"]["name"] == "price" for r in rows)

    # the same folder again: refused in one line, and the first run's records are untouched
    sessions = (out / "sessions.jsonl").read_bytes()
    again = subprocess.run(
        [sys.executable, str(script), "--steps", "1", "--output-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr[-3000:]
    assert again.stderr.strip().splitlines() == [
        f"custom_env.py: config error: output_dir: {str(out)!r} already holds a run (metrics.jsonl, sessions.jsonl, "
        "eval_sessions.jsonl, summary.json, checkpoints/); continue it with --resume, or give another --output-dir "
        "(or remove the folder)"
    ]
    assert (out / "sessions.jsonl").read_bytes() == sessions
