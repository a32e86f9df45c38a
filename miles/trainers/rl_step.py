"""`run_step`: the one body of an RL step, for every mode: a `RolloutSource`'s groups, the update on those that
train, and the new weights to the engines. The train loop runs it once per step; a run with LoRA adapters runs
one copy per adapter, concurrently, over the shared engines and the LoRA learner (`miles.trainers.lora.run`)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from miles.engine import EngineError
from miles.envs.recipe import error_line
from miles.sessions.records import SessionRecord
from miles.trainers.protocol import RolloutSource, Weights
from miles.trajectory import Trajectory, TrajectoryBatch

#: An update on a batch: its metrics, and the new weights (made when the engines take them).
Learn = Callable[[TrajectoryBatch], Awaitable[tuple[dict[str, float], Weights]]]


@dataclass(frozen=True)
class StepOutcome:
    """What one step did: its sessions, the trajectories it trained on, its metrics (`rollout_s`, the source's
    collection metrics, then, when it trained, the update's metrics, `train_s`, `sync_s` and `sync_failed`),
    and whether new weights reached the engines."""

    records: list[SessionRecord]
    trained: list[Trajectory]
    metrics: dict[str, float]
    published: bool


async def run_step(
    source: RolloutSource,
    *,
    version: int,
    select: Callable[[list[SessionRecord]], list[Trajectory]],
    learn: Learn,
    warn: Callable[[str], None],
) -> StepOutcome:
    """One step of a policy at weight `version`: collect, `select` what trains, `learn` on it, publish the new
    weights as `version + 1`. A step with nothing to train tells the source (`untrained`). A weight update that
    does not reach the engines is a warning and `sync_failed` in the metrics (the run's health counts it); the
    engines keep `version`."""
    t0 = time.perf_counter()
    taken = await source.collect(version)
    metrics = {"rollout_s": time.perf_counter() - t0, **taken.metrics}
    trajs = select(taken.records)
    if not trajs:
        source.untrained()
        return StepOutcome(taken.records, trajs, metrics, published=False)
    t1 = time.perf_counter()
    update, weights = await learn(TrajectoryBatch.from_trajectories(trajs))
    metrics["train_s"] = time.perf_counter() - t1
    metrics.update({k: v for k, v in update.items() if k != "step"})
    t2 = time.perf_counter()
    published = True
    try:
        await source.publish(version + 1, weights)
    except EngineError as exc:
        published = False
        metrics["sync_failed"] = 1.0
        warn(
            f"[warn] the weight update did not reach the engines ({error_line(exc)}); they keep version {version}"
        )
    metrics["sync_s"] = time.perf_counter() - t2
    return StepOutcome(taken.records, trajs, metrics, published)
