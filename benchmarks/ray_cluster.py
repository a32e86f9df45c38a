"""The Ray path's per-step overhead on the calculator example, side by side in one run.

The same `miles train --config configs/calculator.yaml` run (same seed, same steps) three ways:

- `local`: `cluster.kind: local`, the embedded engine in the trainer's process, in-process weight sync;
- `http`: `cluster.kind: local` against a `miles rollout` server of the same weights (`engine.kind: sglang`),
  broadcast weight sync: what HTTP engines cost without Ray;
- `ray`: `cluster.kind: ray` on a private local Ray instance: the engine and the trainer are actors, HTTP
  and broadcast as in `http`.

Each variant runs `--repeats` times, interleaved, so that a change in the machine's load hits all of them.
Reported: the mean seconds per RL step (the first `--warmup` steps left out) with its rollout, train and sync
parts, and the ratios `ray/local` and `ray/http` last. The load average before and after is printed too.

    python benchmarks/ray_cluster.py                   # CPU, the calculator example, 15 steps
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
PARTS = ("step_s", "rollout_s", "train_s", "sync_s")


def run(name: str, out: Path, args: argparse.Namespace, sets: list[str]) -> dict[str, float]:
    cmd = [
        sys.executable,
        "-m",
        "miles.cli",
        "train",
        "--config",
        "configs/calculator.yaml",
        "--output-dir",
        str(out),
        "--set",
        "max_seconds=null",
        "--set",
        f"steps={args.steps}",
        "--set",
        "eval.num_tasks=8",
        *(x for s in sets for x in ("--set", s)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"][args.warmup :]
    return {k: float(np.mean([r.get(k, 0.0) for r in train])) for k in PARTS}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from miles.engines.testing import RolloutProcess
    from miles.ports import free_port

    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    results: dict[str, list[dict[str, float]]] = {"local": [], "http": [], "ray": []}
    with tempfile.TemporaryDirectory() as tmp:
        server = RolloutProcess(
            "--engine",
            "embedded",
            "--model",
            "checkpoints/calculator-sft-1m",
            "--port",
            str(free_port()),
            "--no-router",
            "--log-dir",
            str(Path(tmp) / "logs"),
            cwd=REPO,
        )
        try:
            url = server.ready()["urls"][0]
            variants = {
                "local": [],
                "http": ["engine.kind=sglang", f"engine.urls=[{url}]"],
                "ray": ["cluster.kind=ray"],
            }
            for i in range(args.repeats):
                for name, sets in variants.items():
                    results[name].append(run(name, Path(tmp) / f"{name}-{i}", args, sets))
                    print(f"  {name} #{i}: {results[name][-1]['step_s']:.3f} s/step", flush=True)
        finally:
            server.finish(signal.SIGTERM)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print(f"\n{'variant':<8}" + "".join(f"{k:>12}" for k in PARTS))
    mean = {name: {k: float(np.mean([r[k] for r in rs])) for k in PARTS} for name, rs in results.items()}
    for name, m in mean.items():
        print(f"{name:<8}" + "".join(f"{m[k]:>12.3f}" for k in PARTS))
    print(f"\nray/http step time: {mean['ray']['step_s'] / mean['http']['step_s']:.2f}x")
    print(f"ray/local step time: {mean['ray']['step_s'] / mean['local']['step_s']:.2f}x")


if __name__ == "__main__":
    main()
