"""Loss options for stale samples, through `miles train`: an asynchronous run with `seq_mask_log_ratio`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from miles.training.config import ASYNC_DUAL_CLIP_C, load_train_config
from miles.training.metrics_log import read_metrics

REPO = Path(__file__).resolve().parents[2]


def test_the_sequence_mask_keeps_the_async_defaults():
    lc = load_train_config(
        None,
        ["async.enabled=true", "async.max_staleness=4", "algorithm.loss.seq_mask_log_ratio=0.693"],
    ).algorithm.loss
    assert (lc.ratio_to, lc.dual_clip_c, lc.tis_cap, lc.seq_mask_log_ratio) == (
        "rollout",
        ASYNC_DUAL_CLIP_C,
        None,
        0.693,
    )


def test_an_async_run_with_the_sequence_mask_reports_what_it_masked(tmp_path):
    sets = [
        "max_seconds=null",
        "eval.num_tasks=4",
        "steps=6",
        "rollout.tasks_per_step=4",
        "rollout.scheduler.group_size=4",
        "async.enabled=true",
        "async.max_staleness=2",
        "algorithm.loss.seq_mask_log_ratio=0.693",
    ]
    args = [sys.executable, "-m", "miles.cli", "train", "--config", str(REPO / "configs/calculator.yaml")]
    args += ["--output-dir", str(tmp_path), *(x for s in sets for x in ("--set", s))]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train" and "approx_kl" in r]
    assert rows and all(0.0 <= r["seq_masked_frac"] <= 1.0 for r in rows)
    assert all("dual_clip_frac" in r and "tis_weight_mean" not in r for r in rows)  # the async defaults stay
