"""Calculator GRPO: an SFT warm start on the Calculator-v0 oracle, then GRPO, via `TrainLoop`.

The config is built in Python (the same fields as a `miles train` YAML file). The run prints the held-out
success rate after SFT and after RL, and writes sessions, metrics, checkpoints and `curves.png` into
`--output-dir`.

    python examples/calculator_grpo.py                    # a few minutes on 2 CPU cores
    python examples/calculator_grpo.py --steps 2 --eval-tasks 8   # a quick smoke run
"""

from __future__ import annotations

import argparse
import asyncio

from miles.config import from_dict
from miles.trainers.loop import TrainLoop
from miles.trainers.run import format_summary
from miles.trainers.train_config import TrainConfig


def build_config(a: argparse.Namespace) -> TrainConfig:
    return from_dict(TrainConfig, {
        "seed": a.seed, "output_dir": a.output_dir, "steps": a.steps, "max_seconds": a.max_seconds,
        "env": {"id": "Calculator-v0", "num_train_tasks": 5000},
        "model": {"name": "tiny", "size": a.model_size, "seed": a.seed},
        "rollout": {"tasks_per_step": a.tasks_per_step, "scheduler": {
            "group_size": a.group_size, "session": {"sampling": {"temperature": 1.0,
                                                                  "max_new_tokens": a.max_new_tokens}}}},
        "algorithm": {"advantage": {"estimator": "grpo"}},
        "trainer": {"lr": a.lr},
        "sft": {"enabled": a.sft_demos > 0, "num_demos": a.sft_demos, "batch_size": 16, "epochs": 2},
        "eval": {"num_tasks": a.eval_tasks, "max_new_tokens": a.max_new_tokens},
        "checkpoint": {"every": 0, "keep": 1},
    })


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=15, help="GRPO steps")
    p.add_argument("--max-seconds", type=float, default=None, help="stop RL after this much wall time")
    p.add_argument("--sft-demos", type=int, default=128, help="oracle demonstrations (0: no warm start)")
    p.add_argument("--tasks-per-step", type=int, default=4, help="GRPO groups per step")
    p.add_argument("--group-size", type=int, default=8, help="samples per task")
    p.add_argument("--eval-tasks", type=int, default=50, help="held-out tasks per evaluation")
    p.add_argument("--model-size", default="1m", help="tiny model size: 0.1m, 1m, 3m, ...")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="runs/calculator_grpo")
    cfg = build_config(p.parse_args())
    summary = asyncio.run(TrainLoop(cfg).run())
    print(format_summary(summary, cfg))


if __name__ == "__main__":
    main()
