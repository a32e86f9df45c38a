"""`SessionSource`: the synchronous loop's `RolloutSource`, whose sessions run in the loop's own process (by the
scheduler, or by the user's agents through the OpenAI-compatible endpoint); and the held-out evaluations that
every source runs (`EngineEvaluation`, `AgentEvaluation`)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from miles.engine import RolloutEngine
from miles.envs import Task
from miles.envs.recipe import error_line
from miles.sessions.config import SchedulerConfig
from miles.sessions.recorder import Recorder
from miles.sessions.router import RouterStats
from miles.sessions.scheduler import GroupRunner
from miles.tito import TITOTokenizer
from miles.training.data import TaskCursor
from miles.training.evaluate import EvalResult, EvalSet, evaluate, summarize
from miles.training.protocol import StepRollout

if TYPE_CHECKING:
    from miles.sessions.openai.agent import AgentRollout

log = logging.getLogger(__name__)

#: An evaluation of one held-out set: `(part, greedy=, run_id=)` to its result, keyed by `part`'s mode name.
Evaluation = Callable[..., Awaitable[EvalResult]]


async def close_within(parts: Sequence[Callable[[], Awaitable[Any]]], timeout: float) -> None:
    """Close each of `parts` in turn, each within `timeout` seconds; a part that fails or hangs is logged and
    passed over (the run's own outcome matters more than a close)."""
    for close in parts:
        try:
            await asyncio.wait_for(close(), timeout=timeout)
        except Exception as exc:  # noqa: BLE001
            log.warning("closing %s failed: %s", getattr(close, "__qualname__", close), error_line(exc))


@dataclasses.dataclass(frozen=True)
class EngineEvaluation:
    """Held-out sessions on the trainer's own engines, run by a scheduler in this process."""

    engines: Sequence[RolloutEngine]
    tokenizer: TITOTokenizer
    scheduler: SchedulerConfig
    recorder: Recorder | None
    max_new_tokens: int | None

    async def __call__(self, part: EvalSet, *, greedy: bool, run_id: str) -> EvalResult:
        result = await evaluate(
            self.engines,
            tokenizer=self.tokenizer,
            recipe=part.recipe,
            run_id=run_id,
            tasks=part.tasks,
            scheduler=self.scheduler,
            greedy=greedy,
            recorder=self.recorder,
            max_new_tokens=self.max_new_tokens,
        )
        return dataclasses.replace(result, mode=part.key("greedy" if greedy else "sampled"))


@dataclasses.dataclass(frozen=True)
class AgentEvaluation:
    """Held-out success of the user's own agent, through the endpoint."""

    agents: AgentRollout
    recorder: Recorder | None
    max_new_tokens: int | None

    async def __call__(self, part: EvalSet, *, greedy: bool, run_id: str) -> EvalResult:
        records = await self.agents.evaluate(
            part.tasks,
            recipe=part.recipe,
            recorder=self.recorder,
            greedy=greedy,
            max_tokens=self.max_new_tokens,
            run_id=run_id,
        )
        return summarize(part.key("greedy" if greedy else "sampled"), records)


P = TypeVar("P")


class SessionSource(Generic[P]):
    """The synchronous loop's sessions: each step runs `tasks_per_step` groups (plus `oversample` extra ones
    whose slowest are dropped) from the data cursor on `runner`, in this process; `publish` syncs the new
    weights (a thunk of `P`: a state dict, or an adapter's weights) to the engines at once
    (`push(version, weights)`), before the next step's sessions start."""

    checkpoints_when_aborted = True

    def __init__(
        self,
        runner: GroupRunner,
        *,
        tasks: Sequence[Task],
        cursor: TaskCursor,
        tasks_per_step: int,
        oversample: int,
        push: Callable[[int, Callable[[], P]], Awaitable[None]],
        evaluation: Evaluation,
        recorder: Recorder,
        closing: Sequence[Callable[[], Awaitable[Any]]] = (),
        close_timeout: float = 5.0,
    ) -> None:
        self.runner, self.tasks, self.cursor = runner, tasks, cursor
        self.tasks_per_step, self.oversample = tasks_per_step, oversample
        self.push, self.evaluation, self.recorder = push, evaluation, recorder
        self.closing, self.close_timeout = list(closing), close_timeout

    def restore(self, cursor: Mapping[str, Any], *, saved_at: float) -> None:
        self.cursor.position = int(cursor.get("position", 0))
        self.recorder.drop_after(saved_at)

    async def start(
        self, version: int, weights: Callable[[], P], *, run_id: str, resume_time: float | None
    ) -> None:
        self.runner.run_id = run_id  # the engines already hold `version`: the loop synced them

    async def collect(self, version: int) -> StepRollout:
        tasks = [{"task": self.tasks[i]} for i in self.cursor.next(self.tasks_per_step + self.oversample)]
        groups = await self.runner.run(tasks, num_groups=self.tasks_per_step)
        return StepRollout([r for g in groups for r in g.records])

    def untrained(self) -> None:
        return None  # nothing runs between steps: the next step starts from the same weights

    async def publish(self, version: int, weights: Callable[[], P]) -> None:
        await self.push(version, weights)

    async def evaluate(self, part: EvalSet, *, greedy: bool, run_id: str) -> EvalResult:
        return await self.evaluation(part, greedy=greedy, run_id=run_id)

    def data_cursor(self) -> dict[str, Any]:
        return dict(self.cursor.to_dict())

    def router_stats(self) -> RouterStats | None:
        return self.runner.router.stats(reset=True)

    @property
    def record_failures(self) -> int:
        return int(getattr(getattr(self.runner, "stats", None), "record_failures", 0))

    async def stop(self) -> None:
        return None  # nothing runs between steps

    async def aclose(self) -> None:
        await close_within([self.runner.aclose, *self.closing, self.recorder.aclose], self.close_timeout)
