"""Sampling-mask replay on the calculator example: how far the trainer's step-0 logprobs are from the engine's
under top-p 0.8, with the replay off (before) and on (after), against top-p 1 (the reference).

Rollouts run through the whole stack of `configs/calculator.yaml` (the SFT warm start, the embedded engine, the
session scheduler, TITO trajectories; temperature 1, groups of 8) for `--tasks` tasks per setting. Each setting's
trajectories are then scored by one `TorchTrainer` holding the same weights (fp32, before any update), once with
`trainer.sampling_mask: false` (every logprob over the whole vocabulary) and once with the replay (the softmax
renormalised over each token's recorded kept set). The same tokens go through both, side by side in one process.

For every trained token the importance ratio is ``exp(logp_trainer - logp_rollout)``; the table gives the share
outside [0.9, 1.1] and [0.5, 2], the mean and largest ``|logp_trainer - logp_rollout|``, and the mean kept count
(0: unfiltered). With replay the ratio is 1 up to float noise, as under top-p 1. The warm start is sharply peaked
at the example's temperature 1; the settings at temperature 2 show a flatter distribution, where top-p cuts more.

    python benchmarks/sampling_mask.py                    # 5 settings, 16 tasks x 8 sessions each
    python benchmarks/sampling_mask.py --tasks 32 --threads 1
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "calculator.yaml"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One rollout setting: its label and the sampling filters."""

    label: str
    top_p: float = 1.0
    top_k: int = -1
    temperature: float = 1.0


@dataclasses.dataclass(frozen=True)
class Row:
    """What one setting scored one way (replay on or off) gives."""

    setting: str
    replay: str
    tokens: int
    mean_kept: float
    outside_10pct: float
    outside_2x: float
    mean_abs_diff: float
    max_abs_log_ratio: float


SETTINGS = (
    Setting("top-p 1 (reference)"),
    Setting("top-p 0.8", top_p=0.8),
    Setting("top-k 5", top_k=5),
    Setting("top-p 1, T 2 (reference)", temperature=2.0),
    Setting("top-p 0.8, T 2", top_p=0.8, temperature=2.0),
)


async def rollouts(setting: Setting, tasks: int, seed: int) -> list:
    """The trained trajectories of `tasks` GRPO groups of the calculator example at this setting."""
    from miles.engines.embedded import EmbeddedEngine
    from miles.sessions.scheduler import SessionScheduler
    from miles.training.config import load_train_config
    from miles.training.data import load_tasks
    from miles.training.models import build_policy, build_tito

    sampling = "rollout.scheduler.session.sampling"
    cfg = load_train_config(
        str(CONFIG),
        [
            f"{sampling}.top_p={setting.top_p}",
            f"{sampling}.top_k={setting.top_k}",
            f"{sampling}.temperature={setting.temperature}",
            f"seed={seed}",
        ],
    )
    tito = build_tito(cfg.model)
    engine = EmbeddedEngine(build_policy(cfg.model, tito.tokenizer), max_batch_size=64, cuda_graphs=False)
    config = dataclasses.replace(cfg.rollout.scheduler, oversample_groups=0, progress=False, seed=seed)
    recipe = cfg.env.recipe.with_kwargs(split=cfg.env.train_split)
    scheduler = SessionScheduler(engine, tokenizer=tito, config=config, recipe=recipe)
    try:
        groups = await scheduler.run([{"task": t} for t in load_tasks(recipe, cfg.env.train_split, tasks)])
    finally:
        await scheduler.aclose()
        await engine.close()
    return [r.trajectory for g in groups for r in g.records if r.trajectory.num_generated]


def score(trainer, trajectories: list, setting: Setting) -> list[Row]:
    """The step-0 mismatch of `trajectories` under `trainer`, replay off and on."""
    from miles.trajectory import TrajectoryBatch

    batch = TrajectoryBatch.from_trajectories(trajectories)
    mask = batch.loss_mask > 0
    kept = batch.kept_counts[mask].double() if batch.kept_counts is not None else torch.zeros(int(mask.sum()))
    out = []
    for replay in (False, True):
        trainer.config = dataclasses.replace(trainer.config, sampling_mask=replay)
        d = (trainer.compute_logprobs(batch) - batch.rollout_logprobs)[mask].double()
        ratio = d.exp()
        out.append(
            Row(
                setting=setting.label,
                replay="on" if replay else "off",
                tokens=int(mask.sum()),
                mean_kept=float(kept.mean()),
                outside_10pct=float(((ratio < 0.9) | (ratio > 1.1)).double().mean()),
                outside_2x=float(((ratio < 0.5) | (ratio > 2.0)).double().mean()),
                mean_abs_diff=float(d.abs().mean()),
                max_abs_log_ratio=float(d.abs().max()),
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=16, help="GRPO groups (of 8 sessions) per setting")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    from miles.learner.torch_backend import TorchTrainer, TorchTrainerConfig
    from miles.training.config import load_train_config
    from miles.training.models import build_policy, build_tito

    cfg = load_train_config(str(CONFIG))
    trainer = TorchTrainer(
        copy.deepcopy(build_policy(cfg.model, build_tito(cfg.model).tokenizer)),
        TorchTrainerConfig(
            lr=cfg.trainer.lr, micro_batch_tokens=cfg.trainer.micro_batch_tokens, device="cpu"
        ),
    )
    t0 = time.perf_counter()
    rows = []
    for setting in SETTINGS:
        trajectories = asyncio.run(rollouts(setting, args.tasks, args.seed))
        rows.extend(score(trainer, trajectories, setting))
    table = Table(title=f"step-0 trainer vs engine logprobs, calculator example, {args.tasks} tasks x 8 each")
    for name in ("setting", "replay", "tokens", "mean kept", "outside [0.9,1.1]", "outside [0.5,2]"):
        table.add_column(name, justify="left" if name in ("setting", "replay") else "right")
    table.add_column("mean |Δlogp|", justify="right")
    table.add_column("max |log ratio|", justify="right")
    for r in rows:
        table.add_row(
            r.setting,
            r.replay,
            str(r.tokens),
            f"{r.mean_kept:.2f}",
            f"{100 * r.outside_10pct:.2f}%",
            f"{100 * r.outside_2x:.2f}%",
            f"{r.mean_abs_diff:.2e}",
            f"{r.max_abs_log_ratio:.2e}",
        )
    console = Console(width=150)
    console.print(table)
    console.print(f"{time.perf_counter() - t0:.0f} s, {args.threads} torch threads")


if __name__ == "__main__":
    main()
