"""The metric-history gate: a fixed-seed short run of the calculator example must learn the way trusted runs did.

A single end threshold misses a slow drift (a reward curve that rises later, an entropy that falls faster, updates
that clip more). Here each gated metric of a 60-step run, smoothed over a trailing window of steps, must stay
inside a per-step corridor built from several trusted runs of the same command; a non-finite value anywhere fails.

Regenerate the corridors (after a change that is meant to move them), on a quiet machine:

    python tests/support/history_gate.py --runs 5        # writes tests/data/history_corridors.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CORRIDORS = REPO / "tests" / "data" / "history_corridors.json"
STEPS = 60
WINDOW = 10
#: Gated metrics of metrics.jsonl's train rows, with the least half-width of a corridor (the run-to-run spread of
#: a few trusted runs can be narrower than a healthy run's).
METRICS = {"rollout_reward_mean": 0.06, "entropy": 0.03, "approx_kl": 0.002, "clip_frac": 0.01}
#: A corridor is the trusted runs' [min, max] per step, widened by this fraction of its width on each side.
WIDEN = 0.5
RUN_ARGS = (
    "--set",
    f"steps={STEPS}",
    "--set",
    "max_seconds=null",
    "--set",
    "eval.num_tasks=8",
    "--set",
    "checkpoint.every=0",
)


def gate_run(out: Path, *sets: str) -> list[dict]:
    """Run the calculator example for `STEPS` steps with seed 0 into `out` (plus `--set` overrides); its train
    rows."""
    args = [
        sys.executable,
        "-m",
        "miles.cli",
        "train",
        "--config",
        str(REPO / "configs" / "calculator.yaml"),
        "--output-dir",
        str(out),
        "--seed",
        "0",
        *RUN_ARGS,
        *(x for s in sets for x in ("--set", s)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"the gate's run failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == "train"]


def smoothed(rows: Sequence[dict], metric: str) -> dict[int, float]:
    """Step -> the mean of `metric` over the trailing `WINDOW` steps that report it (steps that trained nothing
    report no update metrics), from the first full window on."""
    values = {int(r["step"]): float(r[metric]) for r in rows if metric in r}
    out = {}
    for step in range(WINDOW, STEPS + 1):
        window = [values[s] for s in range(step - WINDOW + 1, step + 1) if s in values]
        if window:
            out[step] = sum(window) / len(window)
    return out


def corridors_from(runs: Sequence[Sequence[dict]]) -> dict[str, dict[str, list[float]]]:
    """Per metric and step (as a string key, for JSON), `[low, high]` around the trusted runs' smoothed values."""
    result: dict[str, dict[str, list[float]]] = {}
    for metric, least in METRICS.items():
        per_run = [smoothed(rows, metric) for rows in runs]
        steps = sorted(set.intersection(*(set(p) for p in per_run)))
        result[metric] = {}
        for step in steps:
            values = [p[step] for p in per_run]
            low, high = min(values), max(values)
            pad = max(WIDEN * (high - low), least)
            result[metric][str(step)] = [low - pad, high + pad]
    return result


def violations(rows: Sequence[dict], corridors: dict[str, dict[str, list[float]]]) -> list[str]:
    """What a run did outside its corridors: non-finite values of any gated metric, and smoothed values out of
    bounds (one line per metric: the first step out and how many steps were)."""
    found = []
    for row in rows:
        for metric in METRICS:
            if metric in row and not math.isfinite(float(row[metric])):
                found.append(f"step {row['step']}: {metric} is {row[metric]}")
    for metric, bounds in corridors.items():
        values = smoothed(rows, metric)
        missing = [step for step in bounds if int(step) not in values]
        outside = [
            (int(step), values[int(step)], low, high)
            for step, (low, high) in bounds.items()
            if int(step) in values and not low <= values[int(step)] <= high
        ]
        if missing:
            found.append(f"{metric}: no value at steps {missing[:5]}")
        if outside:
            step, value, low, high = min(outside)
            found.append(
                f"{metric}: outside its corridor at {len(outside)} steps, first at step {step} "
                f"({value:.4g} not in [{low:.4g}, {high:.4g}])"
            )
    return found


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Regenerate the metric-history corridors from trusted runs.")
    ap.add_argument("--runs", type=int, default=5, help="trusted runs of the gate's command (default 5)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [gate_run(Path(tmp) / f"run{i}") for i in range(args.runs)]
    for i, rows in enumerate(runs):
        print(f"run {i}: final smoothed reward {smoothed(rows, 'rollout_reward_mean')[STEPS]:.3f}")
    data = {
        "command": "python tests/support/history_gate.py --runs " + str(args.runs),
        "steps": STEPS,
        "window": WINDOW,
        "runs": args.runs,
        "corridors": corridors_from(runs),
    }
    CORRIDORS.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {CORRIDORS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
