"""What the agent examples share: their command-line options, the config they build, and the run."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from miles.config import ConfigError, from_dict
from miles.training.command import format_summary
from miles.training.config import TrainConfig
from miles.training.loop import RunSummary, TrainLoop


def parser(
    doc: str, *, steps: int, sft_demos: int, eval_tasks: int, max_new_tokens: int, output_dir: str
) -> argparse.ArgumentParser:
    """The options every agent example takes, with that example's defaults."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--steps", type=int, default=steps, help="GRPO steps")
    p.add_argument("--max-seconds", type=float, default=None, help="stop RL after this much wall time")
    p.add_argument(
        "--sft-demos", type=int, default=sft_demos, help="oracle demonstrations (0: no warm start)"
    )
    p.add_argument("--tasks-per-step", type=int, default=4, help="GRPO groups per step")
    p.add_argument("--group-size", type=int, default=8, help="samples per task")
    p.add_argument("--eval-tasks", type=int, default=eval_tasks, help="held-out tasks per evaluation")
    p.add_argument("--model-size", default="1m", help="tiny model size: 0.1m, 1m, 3m, ...")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default=output_dir)
    return p


def config(a: argparse.Namespace, env_id: str, *, num_train_tasks: int = 2000) -> TrainConfig:
    """SFT on `env_id`'s oracle, then GRPO, on the tiny model with the compact tool prompt."""
    return from_dict(
        TrainConfig,
        {
            "seed": a.seed,
            "output_dir": a.output_dir,
            "steps": a.steps,
            "max_seconds": a.max_seconds,
            "env": {"id": env_id, "num_train_tasks": num_train_tasks},
            "model": {"name": "tiny", "size": a.model_size, "seed": a.seed, "chat_template": "compact"},
            "rollout": {
                "tasks_per_step": a.tasks_per_step,
                "scheduler": {
                    "group_size": a.group_size,
                    "session": {"sampling": {"temperature": 1.0, "max_new_tokens": a.max_new_tokens}},
                },
            },
            "algorithm": {"advantage": {"estimator": "grpo"}},
            "trainer": {"lr": a.lr, "micro_batch_tokens": 65536},
            "sft": {"enabled": a.sft_demos > 0, "num_demos": a.sft_demos, "batch_size": 16, "epochs": 2},
            "eval": {"num_tasks": a.eval_tasks, "max_new_tokens": a.max_new_tokens},
            "checkpoint": {"every": 0, "keep": 1},
        },
    )


def train(cfg: TrainConfig) -> RunSummary:
    """Run `cfg`; a setup mistake (an `output_dir` that holds a run, say) prints its one line and exits 2, as
    `miles train` does."""
    try:
        return asyncio.run(TrainLoop(cfg).run())
    except ConfigError as exc:
        print(f"{Path(sys.argv[0]).name}: config error: {exc}", file=sys.stderr)
        sys.exit(2)


def run(cfg: TrainConfig) -> None:
    """Train, then print the held-out table."""
    print(format_summary(train(cfg), cfg))
