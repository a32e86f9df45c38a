"""`run_step`: the one body of an RL step, for every mode: a `RolloutSource`'s groups, the update on those that
train, and the new weights to the engines. The train loop runs it once per step; a run with LoRA adapters runs
one copy per adapter, concurrently, over the shared engines and the LoRA learner (`miles.training.adapters`)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np

from miles.engine import EngineError
from miles.envs.recipe import error_line
from miles.sessions.records import SessionRecord
from miles.training.health import UNTRAINABLE, StepActivity
from miles.training.protocol import RolloutSource, StepOutcome
from miles.trajectory import Trajectory, TrajectoryBatch
from miles.types import TerminationReason

P = TypeVar("P")


async def run_step(
    source: RolloutSource[P],
    *,
    version: int,
    select: Callable[[list[SessionRecord]], list[Trajectory]],
    learn: Callable[[TrajectoryBatch], Awaitable[tuple[dict[str, float], Callable[[], P]]]],
    warn: Callable[[str], None],
) -> StepOutcome:
    """One step of a policy at weight `version`: collect, `select` what trains, `learn` on it (its metrics, and
    the new weights as the source's payload, made when the engines take them), publish them as `version + 1`. A step with nothing to train tells the source (`untrained`). A weight update that
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


def trainable(records: list[SessionRecord], *, on_timeout: str = "drop") -> list[Trajectory]:
    """The trajectories to train on: sessions that ended for infrastructure reasons are left out, and so are
    timed-out ones unless `on_timeout` is "zero" (then they count with reward 0)."""
    skip = UNTRAINABLE + ((TerminationReason.TIMEOUT,) if on_timeout == "drop" else ())
    out = []
    for r in records:
        if r.termination in skip or r.trajectory.num_generated == 0:
            continue
        traj = r.trajectory
        traj.reward = 0.0 if r.termination == TerminationReason.TIMEOUT else r.reward
        out.append(traj)
    return out


def split_by_reward_spread(trajs: list[Trajectory]) -> tuple[list[Trajectory], int, int]:
    """Keep the groups whose rewards differ (DAPO-style dynamic sampling); also count groups and dropped ones.

    A group whose samples all got the same reward has zero GRPO advantage everywhere: it adds no policy
    gradient, only compute.
    """
    groups: dict[str, list[Trajectory]] = {}
    for t in trajs:
        groups.setdefault(t.meta.group_id, []).append(t)
    kept = [g for g in groups.values() if max(t.reward for t in g) != min(t.reward for t in g)]
    return [t for g in kept for t in g], len(groups), len(groups) - len(kept)


def selection(
    *, on_timeout: str, drop_zero_std_groups: bool
) -> Callable[[list[SessionRecord]], list[Trajectory]]:
    """What of a step's records trains: finished (or timed-out, per `rollout.on_timeout`) sessions, and with
    `rollout.drop_zero_std_groups` only groups whose rewards differ."""

    def select(records: list[SessionRecord]) -> list[Trajectory]:
        trajs = trainable(records, on_timeout=on_timeout)
        return split_by_reward_spread(trajs)[0] if drop_zero_std_groups else trajs

    return select


def step_row(done: StepOutcome, activity: StepActivity, *, on_timeout: str, seconds: float) -> dict[str, Any]:
    """A step's row for metrics.jsonl: what its sessions did (`activity` summarises them), then the step's own
    metrics, then throughput over its `seconds`."""
    records, trajs = done.records, done.trained
    finished = trainable(records, on_timeout=on_timeout)
    num_groups, flat = split_by_reward_spread(finished)[1:]
    row: dict[str, Any] = {
        "rollout_reward_mean": float(np.mean([r.reward for r in records])) if records else 0.0,
        "rollout_success_rate": (
            float(np.mean([bool(r.final_info.get("success")) for r in records])) if records else 0.0
        ),
        "sessions": len(records),
        "trained_sessions": len(trajs),
        **activity.metrics(),
        "rollout_zero_std_group_frac": flat / num_groups if num_groups else 0.0,
        "generated_tokens": sum(r.trajectory.num_generated for r in records),
        **done.metrics,
    }
    row["step_s"] = seconds
    row["samples_per_s"] = len(trajs) / seconds
    row["trained_tokens_per_s"] = float(sum(len(t) for t in trajs)) / seconds
    if "trainer_wait_s" in row:
        row["trainer_idle_ratio"] = row["trainer_wait_s"] / seconds
    return row


def progress_line(step: int, steps: int, row: dict[str, Any]) -> str:
    """The console line of one RL step: reward and success, then whether the step could teach anything."""
    return (
        f"[step {step}/{steps}] reward {row['rollout_reward_mean']:.3f}  "
        f"success {row['rollout_success_rate']:.1%}  trained {row['trained_sessions']}/{row['sessions']}  "
        f"zero-spread {row['rollout_zero_std_group_frac']:.0%}  "
        f"tool calls/session {row['tool_calls_per_session']:.1f}  "
        f"parse errors {row['tool_parse_failures']:.0f}  env errors {row['env_error_sessions']:.0f}  "
        f"{row['step_s']:.1f} s"
    )
