"""`run_rank`: what one trainer rank of a run does, wherever it was placed (this process, a torchrun worker,
or a Ray actor). Rank 0 runs the `TrainLoop`; the other ranks serve its trainer's collective calls."""

from __future__ import annotations

import asyncio
import os

from miles.learner.collective import leave_process_group, stop_workers
from miles.training.config import TrainConfig
from miles.training.loop import TrainLoop
from miles.training.placement import run_worker
from miles.training.summary import RunSummary


class TrainerRankError(RuntimeError):
    """A trainer rank died (its process or actor is gone); the run stops with its checkpoints intact and can
    continue with ``--resume``."""


def run_rank(cfg: TrainConfig, *, resume: bool, extend: bool = False) -> RunSummary | None:
    """This process's rank (torchrun's ``RANK``, 0 when unset) of `cfg`'s run: rank 0 trains and returns the
    `RunSummary`, releasing the other ranks at the end (also after an error); another rank serves rank 0's
    trainer commands until then and returns None."""
    if int(os.environ.get("RANK", "0")):
        run_worker(cfg)
        return None
    loop = TrainLoop(cfg, resume=resume, extend=extend)
    try:
        summary = asyncio.run(loop.run())
    finally:
        stop_workers(loop.trainer)
    leave_process_group()
    return summary
