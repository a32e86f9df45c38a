"""`miles train` runs that tests drive through the CLI, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from miles.training.metrics_log import read_metrics

REPO = Path(__file__).resolve().parents[2]

#: A short asynchronous calculator run: 6 steps of 4 groups of 4 at `max_staleness` 2, so that batches are stale.
SHORT_ASYNC = (
    "max_seconds=null",
    "eval.num_tasks=4",
    "steps=6",
    "rollout.tasks_per_step=4",
    "rollout.scheduler.group_size=4",
    "async.enabled=true",
    "async.max_staleness=2",
)


def trained_rows(out: Path, *sets: str) -> list[dict[str, Any]]:
    """Run `miles train` on the calculator example into `out` with `--set` overrides `sets` (one torch thread);
    it must exit 0. The metric rows of its steps that trained."""
    args = [sys.executable, "-m", "miles.cli", "train", "--config", str(REPO / "configs/calculator.yaml")]
    args += ["--output-dir", str(out), *(x for s in sets for x in ("--set", s))]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train" and "approx_kl" in r]
