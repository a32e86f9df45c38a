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

With `--servers 0 N`, both loops also run with the rollout on N `miles rollout` servers (embedded engines in
processes of their own, on the same device, `engine.kind: sglang`, weights by broadcast over gloo) instead
of engines inside the run: `sync-xN` and `async-sS-xN`; with `--engines 1 E`, also with E engines inside the
run (`engine.num_engines`, each its own decode thread; `-eE`). The ratio printed last is the best asynchronous
variant over the best synchronous one, whichever layout each used.

The first `--warmup-steps` steps are left out: they hold one-time costs (the first long batch the trainer
sees, the engines' first long contexts) that land in a different step for each variant. Every variant with
engines inside the run sizes their KV cache once at start (`engine.kv_cache_fraction`) so no cache grows
mid-run; a server's cache grows on demand, in the first steps.

    python benchmarks/async_rl.py                       # CPU, tiny 1m model (about 4 minutes)
    python benchmarks/async_rl.py --device cuda --model-size 25m --steps 24 --warmup-steps 4 \
        --tasks-per-step 32 --threads 8 --staleness 2 --servers 0 2 4      # one H200
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from miles.engines.testing import RolloutProcess
from miles.ports import free_ports

REPO = Path(__file__).resolve().parents[1]


def config(args: argparse.Namespace, out: Path) -> dict:
    return {
        "seed": 0,
        "output_dir": str(out),
        "steps": args.steps,
        "env": {
            "id": "LongTail-v0",
            "import": [str(REPO / "benchmarks" / "long_tail_env.py")],
            "num_train_tasks": 4096,
        },
        "model": {"name": "tiny", "size": args.model_size},
        "engine": {"device": args.device, "max_batch_size": 256, "kv_cache_fraction": 0.03},
        "rollout": {
            "tasks_per_step": args.tasks_per_step,
            "scheduler": {
                "group_size": args.group_size,
                "progress": False,
                "session": {
                    "sampling": {"temperature": 1.0, "max_new_tokens": 80},
                    "timeouts": {"turn_floor_s": 120.0},
                },
            },
        },
        "trainer": {"lr": 1e-4, "micro_batch_tokens": 16384},
        "torch": {"device": args.device},
        "eval": {"num_tasks": 1, "max_new_tokens": 8},
        "checkpoint": {"every": 0, "keep": 1},
    }


def tree_cpu_seconds(*roots: int) -> float:
    """User + system CPU seconds of the processes `roots` and every live descendant, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    tree, grew = set(roots), True
    while grew:
        kids = {pid for pid, (ppid, _) in stats.items() if ppid in tree} - tree
        tree |= kids
        grew = bool(kids)
    return sum(stats[pid][1] for pid in tree if pid in stats)


class CpuSampler:
    """Samples the CPU seconds of process trees every `period_s` (wall time, cumulative CPU seconds)."""

    def __init__(self, *pids: int, period_s: float = 0.5) -> None:
        self.pids, self.period_s = pids, period_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append((time.time(), tree_cpu_seconds(*self.pids)))

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


def start_servers(args: argparse.Namespace, count: int, logs: Path) -> tuple[RolloutProcess, dict]:
    """`miles rollout --dp count` on this run's device, with miles' own router in the run (no sglang-router)."""
    device = "cuda:0" if args.device == "cuda" else args.device
    servers = RolloutProcess(
        "--dp",
        str(count),
        "--no-router",
        "--model",
        f"tiny-{args.model_size}",
        "--device",
        device,
        "--max-running-requests",
        "256",
        "--port",
        str(free_ports(count)),
        "--log-dir",
        str(logs),
    )
    try:
        return servers, servers.ready()
    except BaseException:
        servers.kill()
        raise


def run_variant(
    args: argparse.Namespace, name: str, sets: list[str], threads: int, servers: int, work: Path
) -> dict:
    out = work / name
    cfg = work / f"{name}.json"
    launcher, engine = start_servers(args, servers, work / f"{name}-logs") if servers else (None, None)
    spec = config(args, out)
    if engine is not None:
        spec["engine"] = engine
        spec["sync"] = {"method": "broadcast", "backend": "gloo"}
    cfg.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "miles.cli", "train", "--config", str(cfg)]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    try:
        with subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        ) as proc:
            sampler = CpuSampler(proc.pid, *([launcher.proc.pid] if launcher else []))
            _, stderr = proc.communicate()
            sampler.stop()
    finally:
        if launcher is not None:
            launcher.finish(signal.SIGTERM)
            launcher.kill()
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"][args.warmup_steps :]
    summary = json.loads((out / "summary.json").read_text())
    wall = sum(r["step_s"] for r in train)
    samples = sum(r["trained_sessions"] for r in train)
    tokens = sum(r["trained_tokens_per_s"] * r["step_s"] for r in train)
    stale = [r.get("staleness_mean", 0.0) for r in train]
    return {
        "variant": name,
        "samples_per_s": samples / wall,
        "tokens_per_s": tokens / wall,
        "step_s": wall / len(train),
        "trainer_idle": float(
            np.mean([r.get("trainer_idle_ratio", r["rollout_s"] / r["step_s"]) for r in train])
        ),
        "rollout_idle": float(
            np.mean([r.get("rollout_idle_ratio", 1 - r["rollout_s"] / r["step_s"]) for r in train])
        ),
        "staleness_mean": float(np.mean(stale)),
        "staleness_max": max(r.get("staleness_max", 0.0) for r in train),
        "stale_dropped": sum(r.get("stale_groups_dropped", 0) for r in train),
        "late": sum(r.get("late_groups", 0) for r in train),
        "rl_s": summary["seconds"]["rl"],
        "cores": sampler.cores_between(train[0]["time"] - train[0]["step_s"], train[-1]["time"]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model-size", default="1m", help="a tiny model size (the largest: 25m)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=6,
        help="steps left out of the figures (one-time costs: cache growth, first long batches)",
    )
    p.add_argument("--tasks-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the whole machine")
    p.add_argument("--staleness", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument(
        "--servers",
        type=int,
        nargs="+",
        default=[0],
        help="rollout layouts: 0 is engines inside the run, N > 0 is N `miles rollout` servers",
    )
    p.add_argument(
        "--engines",
        type=int,
        nargs="+",
        default=[1],
        help="engines inside the run (`engine.num_engines`) of the layout without servers",
    )
    p.add_argument(
        "--inflight",
        default=None,
        choices=["continue", "pause"],
        help="async.inflight of the asynchronous variants (default: the config's default)",
    )
    args = p.parse_args()
    half = max(1, args.threads // 2)
    print(
        f"{'variant':<14}{'samples/s':>11}{'tokens/s':>10}{'s/step':>8}{'trainer idle':>14}{'rollout idle':>14}"
        f"{'staleness mean/max':>20}{'stale dropped':>15}{'late groups':>13}{'CPU cores':>11}",
        flush=True,
    )
    variants = []
    layouts = [(0, e) for e in args.engines if 0 in args.servers] + [(n, 1) for n in args.servers if n]
    for n, e in layouts:  # per layout: its synchronous variants, then its asynchronous ones
        suffix = f"-x{n}" if n else (f"-e{e}" if e > 1 else "")
        common = [f"engine.num_engines={e}"] if n == 0 else []
        if n == 0:
            variants += [
                (f"sync-t{t}{suffix}", ["async.enabled=false", *common], t, 0)
                for t in sorted({args.threads, half}, reverse=True)
            ]
        else:
            variants.append((f"sync{suffix}", ["async.enabled=false", *common], args.threads, n))
        for s in args.staleness:
            sets = ["async.enabled=true", f"async.max_staleness={s}", *common]
            if args.inflight:
                sets.append(f"async.inflight={args.inflight}")
            threads = half if n == 0 else args.threads
            sets.append(f"async.rollout_threads={half if n == 0 else 1}")
            variants.append((f"async-s{s}{suffix}", sets, threads, n))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, sets, threads, servers in variants:
            r = run_variant(args, name, sets, threads, servers, Path(tmp))
            results.append(r)
            print(
                f"{r['variant']:<14}{r['samples_per_s']:>11.2f}{r['tokens_per_s']:>10.0f}{r['step_s']:>8.2f}"
                f"{r['trainer_idle']:>14.1%}{r['rollout_idle']:>14.1%}{r['staleness_mean']:>11.2f} / "
                f"{r['staleness_max']:<6.0f}{r['stale_dropped']:>15.0f}{r['late']:>13.0f}{r['cores']:>11.2f}",
                flush=True,
            )
    base = max((r for r in results if r["variant"].startswith("sync")), key=lambda r: r["samples_per_s"])
    best = max((r for r in results if r["variant"].startswith("async")), key=lambda r: r["samples_per_s"])
    print(f"best sync: {base['variant']}; best async: {best['variant']}")
    print(f"async/sync trained tokens/s: {best['tokens_per_s'] / base['tokens_per_s']:.2f}x (same variants)")
    print(f"async/sync throughput: {best['samples_per_s'] / base['samples_per_s']:.2f}x")


if __name__ == "__main__":
    main()
