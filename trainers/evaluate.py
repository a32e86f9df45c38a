"""Held-out evaluation: success rate and mean reward under greedy or sampled decoding."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from miles.engine import RolloutEngine
from miles.envs import EnvRecipe, Task
from miles.sessions.config import SchedulerConfig
from miles.sessions.recorder import Recorder
from miles.sessions.records import SessionRecord
from miles.sessions.scheduler import SessionScheduler


@dataclass
class EvalResult:
    """One evaluation pass over held-out tasks."""

    mode: str
    num_tasks: int
    success_rate: float
    mean_reward: float
    terminations: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def summarize(mode: str, records: Sequence[SessionRecord]) -> EvalResult:
    """Success rate (the env's `info["success"]`) and mean reward over `records`."""
    n = len(records)
    terms: dict[str, int] = {}
    for r in records:
        terms[r.termination.value] = terms.get(r.termination.value, 0) + 1
    success = sum(bool(r.final_info.get("success", False)) for r in records)
    return EvalResult(mode=mode, num_tasks=n, success_rate=success / n if n else 0.0,
                      mean_reward=sum(r.reward for r in records) / n if n else 0.0, terminations=terms)


async def evaluate(engine: RolloutEngine | Sequence[RolloutEngine], *, tokenizer: Any,
                   recipe: EnvRecipe, tasks: Sequence[Task], scheduler: SchedulerConfig,
                   greedy: bool = True, recorder: Recorder | None = None,
                   max_new_tokens: int | None = None, run_id: str = "eval") -> EvalResult:
    """Run one session per task (group size 1) and summarize. Greedy sets temperature 0. The envs are built
    from `recipe`, which is recorded with every session (`miles replay --check` rebuilds them from it);
    `run_id` prefixes the session ids, so give each evaluation of a run its own."""
    session = scheduler.session
    sampling = session.sampling
    if greedy:
        sampling = dataclasses.replace(sampling, temperature=0.0, seed=None)
    if max_new_tokens is not None:
        sampling = dataclasses.replace(sampling, max_new_tokens=max_new_tokens)
    config = dataclasses.replace(scheduler, group_size=1, oversample_groups=0, group_mode="backfill",
                                 progress=False, session=dataclasses.replace(session, sampling=sampling))
    sched = SessionScheduler(engine, tokenizer=tokenizer, config=config, recorder=recorder, run_id=run_id,
                             recipe=recipe)
    try:
        groups = await sched.run([{"task": t} for t in tasks])
    finally:
        await sched.aclose()
    return summarize("greedy" if greedy else "sampled", [r for g in groups for r in g.records])
