"""Synchronous vs asynchronous RL on a long-tail agentic workload, side by side in one run.

Every variant is the same `miles train` run (the `LongTail-v0` env of `benchmarks/long_tail_env.py`: most
sessions take one turn, a fifth take 6-8, turn budgets vary 10x; a tiny random model that uses its whole
budget) for the same number of steps; only `async.*` differs. Each variant gets the whole machine: the
synchronous loop runs with `--threads` torch threads and with half as many (the faster is the baseline: a
tiny model can run faster on fewer threads), the asynchronous one gives the rollout process and the trainer
half each.

Reported per variant: trained samples/s and trained tokens/s over the RL phase (tokens/s as well, since a loop
that left the long sessions out would gain samples/s), the trainer's idle ratio (time waiting for groups over
step time), the rollout engines' idle ratio, the staleness of the trained samples, the groups dropped as stale
and the late groups (taken beyond a step's share so as not to go over the bound), and the CPU cores the run's
processes kept busy over the measured steps (from /proc: what bounds an overlap gain on a small box).

The first `--warmup-steps` steps are left out: they hold one-time costs (the first long batch the trainer
sees, the engines' first long contexts) that land in a different step for each variant. Every variant sizes
its KV cache once at start (`engine.kv_cache_fraction`) so no cache grows mid-run.

    python benchmarks/async_rl.py                       # CPU, tiny 1m model (about 4 minutes)
    python benchmarks/async_rl.py --device cuda --model-size 25m --steps 30 --tasks-per-step 32 --threads 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def config(args: argparse.Namespace, out: Path) -> dict:
    return {
        "seed": 0, "output_dir": str(out), "steps": args.steps,
        "env": {"id": "LongTail-v0", "import": [str(REPO / "benchmarks" / "long_tail_env.py")],
                "num_train_tasks": 4096},
        "model": {"name": "tiny", "size": args.model_size},
        "engine": {"device": args.device, "max_batch_size": 256, "kv_cache_fraction": 0.03},
        "rollout": {"tasks_per_step": args.tasks_per_step,
                    "scheduler": {"group_size": args.group_size, "progress": False,
                                  "session": {"sampling": {"temperature": 1.0, "max_new_tokens": 80},
                                              "timeouts": {"turn_floor_s": 120.0}}}},
        "trainer": {"lr": 1e-4, "micro_batch_tokens": 16384},
        "torch": {"device": args.device},
        "eval": {"num_tasks": 1, "max_new_tokens": 8},
        "checkpoint": {"every": 0, "keep": 1},
    }


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of process `root` and every live descendant, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    tree, grew = {root}, True
    while grew:
        kids = {pid for pid, (ppid, _) in stats.items() if ppid in tree} - tree
        tree |= kids
        grew = bool(kids)
    return sum(stats[pid][1] for pid in tree if pid in stats)


class CpuSampler:
    """Samples the CPU seconds of a process tree every `period_s` (wall time, cumulative CPU seconds)."""

    def __init__(self, pid: int, period_s: float = 0.5) -> None:
        self.pid, self.period_s = pid, period_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append((time.time(), tree_cpu_seconds(self.pid)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def cores_between(self, start: float, end: float) -> float:
        """Average cores busy between wall times `start` and `end` (the nearest samples inside them)."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return float("nan")
        (t0, c0), (t1, c1) = inside[0], inside[-1]
        return (c1 - c0) / (t1 - t0)


def run_variant(args: argparse.Namespace, name: str, sets: list[str], threads: int, work: Path) -> dict:
    out = work / name
    cfg = work / f"{name}.json"
    cfg.write_text(json.dumps(config(args, out)))
    cmd = [sys.executable, "-m", "miles.cli", "train", "--config", str(cfg)]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True) as proc:
        sampler = CpuSampler(proc.pid)
        _, stderr = proc.communicate()
        sampler.stop()
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"][args.warmup_steps:]
    summary = json.loads((out / "summary.json").read_text())
    wall = sum(r["step_s"] for r in train)
    samples = sum(r["trained_sessions"] for r in train)
    tokens = sum(r["trained_tokens_per_s"] * r["step_s"] for r in train)
    stale = [r.get("staleness_mean", 0.0) for r in train]
    return {
        "variant": name, "samples_per_s": samples / wall, "tokens_per_s": tokens / wall, "step_s": wall / len(train),
        "trainer_idle": float(np.mean([r.get("trainer_idle_ratio", r["rollout_s"] / r["step_s"]) for r in train])),
        "rollout_idle": float(np.mean([r.get("rollout_idle_ratio", 1 - r["rollout_s"] / r["step_s"])
                                       for r in train])),
        "staleness_mean": float(np.mean(stale)), "staleness_max": max(r.get("staleness_max", 0.0) for r in train),
        "stale_dropped": sum(r.get("stale_groups_dropped", 0) for r in train),
        "late": sum(r.get("late_groups", 0) for r in train), "rl_s": summary["seconds"]["rl"],
        "cores": sampler.cores_between(train[0]["time"] - train[0]["step_s"], train[-1]["time"]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model-size", default="1m", help="a tiny model size (the largest: 25m)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup-steps", type=int, default=6,
                   help="steps left out of the figures (one-time costs: cache growth, first long batches)")
    p.add_argument("--tasks-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the whole machine")
    p.add_argument("--staleness", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--inflight", default=None, choices=["continue", "pause"],
                   help="async.inflight of the asynchronous variants (default: the config's default)")
    args = p.parse_args()
    half = max(1, args.threads // 2)
    print(f"{'variant':<10}{'samples/s':>11}{'tokens/s':>10}{'s/step':>8}{'trainer idle':>14}{'rollout idle':>14}"
          f"{'staleness mean/max':>20}{'stale dropped':>15}{'late groups':>13}{'CPU cores':>11}", flush=True)
    variants = [(f"sync-t{t}", ["async.enabled=false"], t) for t in sorted({args.threads, half}, reverse=True)]
    for s in args.staleness:
        sets = ["async.enabled=true", f"async.max_staleness={s}", f"async.rollout_threads={half}"]
        if args.inflight:
            sets.append(f"async.inflight={args.inflight}")
        variants.append((f"async-s{s}", sets, half))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, sets, threads in variants:
            r = run_variant(args, name, sets, threads, Path(tmp))
            results.append(r)
            print(f"{r['variant']:<10}{r['samples_per_s']:>11.2f}{r['tokens_per_s']:>10.0f}{r['step_s']:>8.2f}"
                  f"{r['trainer_idle']:>14.1%}{r['rollout_idle']:>14.1%}{r['staleness_mean']:>11.2f} / "
                  f"{r['staleness_max']:<6.0f}{r['stale_dropped']:>15.0f}{r['late']:>13.0f}{r['cores']:>11.2f}",
                  flush=True)
    syncs = [r for r in results if r["variant"].startswith("sync")]
    base = max(syncs, key=lambda r: r["samples_per_s"])
    best = max(results[len(syncs):], key=lambda r: r["samples_per_s"])
    print(f"best sync: {base['variant']}; best async: {best['variant']}")
    print(f"async/sync trained tokens/s: {best['tokens_per_s'] / base['tokens_per_s']:.2f}x (same variants)")
    print(f"async/sync throughput: {best['samples_per_s'] / base['samples_per_s']:.2f}x")


if __name__ == "__main__":
    main()
