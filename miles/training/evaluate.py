"""Held-out evaluation: success rate and mean reward under greedy or sampled decoding."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.engine import RolloutEngine
from miles.envs import EnvRecipe, Task
from miles.sessions.config import SchedulerConfig
from miles.sessions.recorder import Recorder
from miles.sessions.records import SessionRecord
from miles.sessions.scheduler import SessionScheduler
from miles.training.data import load_tasks
from miles.training.metrics_log import read_metrics

#: Terminations that say nothing about the policy: an evaluation made mostly of them measured no policy.
_INFRASTRUCTURE = ("engine_error", "aborted")


@dataclass
class EvalResult:
    """One evaluation pass over held-out tasks."""

    mode: str
    num_tasks: int
    success_rate: float
    mean_reward: float
    terminations: dict[str, int]
    first_error: str = ""  # the first infrastructure failure's type and message, one line

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def invalid(self) -> str:
        """Why this result is no score (most sessions failed in the infrastructure), or ""."""
        failed = sum(self.terminations.get(t, 0) for t in _INFRASTRUCTURE)
        if self.num_tasks and failed * 2 > self.num_tasks:
            kinds = ", ".join(
                f"{self.terminations[t]} {t}" for t in _INFRASTRUCTURE if self.terminations.get(t)
            )
            first = f"; the first: {self.first_error}" if self.first_error else ""
            return f"{failed} of {self.num_tasks} sessions failed in the engines ({kinds}){first}"
        return ""


@dataclass(frozen=True)
class EvalSet:
    """The held-out tasks of one env: `label` names its results ("" for the run's own env, else the env id)."""

    label: str
    recipe: EnvRecipe
    tasks: list[Task]

    def key(self, mode: str) -> str:
        """The name of this set's result in `mode`: the mode alone, or `label/mode`."""
        return f"{self.label}/{mode}" if self.label else mode


def eval_sets(recipe: EnvRecipe, split: str, num_tasks: int, extra_envs: Sequence[str] = ()) -> list[EvalSet]:
    """The run's env and each of `extra_envs` (registered ids, built with the run's user modules), each with
    `num_tasks` distinct tasks of `split`."""
    out = [EvalSet("", recipe.with_kwargs(split=split), load_tasks(recipe, split, num_tasks, distinct=True))]
    for env_id in extra_envs:
        other = EnvRecipe(id=env_id, imports=recipe.imports)
        out.append(
            EvalSet(
                env_id, other.with_kwargs(split=split), load_tasks(other, split, num_tasks, distinct=True)
            )
        )
    return out


def summarize(mode: str, records: Sequence[SessionRecord]) -> EvalResult:
    """Success rate (the env's `info["success"]`) and mean reward over `records`."""
    n = len(records)
    terms: dict[str, int] = {}
    for r in records:
        terms[r.termination.value] = terms.get(r.termination.value, 0) + 1
    success = sum(bool(r.final_info.get("success", False)) for r in records)
    failed = next((r.error for r in records if r.termination.value in _INFRASTRUCTURE and r.error), None)
    return EvalResult(
        mode=mode,
        num_tasks=n,
        success_rate=success / n if n else 0.0,
        mean_reward=sum(r.reward for r in records) / n if n else 0.0,
        terminations=terms,
        first_error="" if failed is None else f"{failed.type}: {failed.message.splitlines()[0][:300]}",
    )


async def evaluate(
    engine: RolloutEngine | Sequence[RolloutEngine],
    *,
    tokenizer: Any,
    recipe: EnvRecipe,
    tasks: Sequence[Task],
    scheduler: SchedulerConfig,
    greedy: bool = True,
    recorder: Recorder | None = None,
    max_new_tokens: int | None = None,
    run_id: str = "eval",
) -> EvalResult:
    """Run one session per task (group size 1) and summarize. Greedy sets temperature 0. The envs are built
    from `recipe`, which is recorded with every session (`miles replay --check` rebuilds them from it);
    `run_id` prefixes the session ids, so give each evaluation of a run its own."""
    session = scheduler.session
    sampling = session.sampling
    if greedy:
        sampling = dataclasses.replace(sampling, temperature=0.0, seed=None)
    if max_new_tokens is not None:
        sampling = dataclasses.replace(sampling, max_new_tokens=max_new_tokens)
    config = dataclasses.replace(
        scheduler,
        group_size=1,
        oversample_groups=0,
        group_mode="backfill",
        progress=False,
        session=dataclasses.replace(session, sampling=sampling),
    )
    sched = SessionScheduler(
        engine, tokenizer=tokenizer, config=config, recorder=recorder, run_id=run_id, recipe=recipe
    )
    try:
        groups = await sched.run([{"task": t} for t in tasks])
    finally:
        await sched.aclose()
    return summarize("greedy" if greedy else "sampled", [r for g in groups for r in g.records])


def recorded_evals(metrics_path: str | Path, stage: str) -> dict[str, EvalResult]:
    """The evaluations of `stage` that a metrics log holds (a resumed run's start), by mode."""
    fields = {f.name for f in dataclasses.fields(EvalResult)}
    rows = [r for r in read_metrics(metrics_path) if r.get("kind") == "eval" and r.get("stage") == stage]
    return {r["mode"]: EvalResult(**{k: v for k, v in r.items() if k in fields}) for r in rows}
