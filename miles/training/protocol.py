"""The run's contracts beside the learner's `Trainer` (`miles.learner.protocol`): `RolloutSource`, where a
step's sessions come from and where new weights go, and `PolicyRun`, what the train loop steps.

`SessionSource` (sessions run in the loop's own process, by the scheduler or by the user's agents) and
`ProcessSource` (the asynchronous loop's rollout process, local or a Ray actor) implement `RolloutSource`.

`PolicyRun` is what the train loop steps: `OnePolicy` (the trainer's policy over one `RolloutSource`) or
`AdapterRun` (LoRA adapters on one frozen base, each its own copy of the step over its own source).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from miles.learner.checkpoint import Checkpoint
from miles.sessions.records import SessionRecord
from miles.sessions.router import RouterStats
from miles.trajectory import Trajectory

if TYPE_CHECKING:
    from miles.training.evaluate import EvalResult, EvalSet


@dataclass(frozen=True)
class StepRollout:
    """One step's sessions (its groups, flattened to records) and what collecting them measured."""

    records: list[SessionRecord]
    metrics: dict[str, float] = field(default_factory=dict)


#: What a source's engines load from the trainer: a full state dict (`miles.learner.protocol.Weights` makes
#: one), or one LoRA adapter's weights (`miles.engines.lora.AdapterWeights`).
Payload = TypeVar("Payload", contravariant=True)


@runtime_checkable
class RolloutSource(Protocol[Payload]):
    """The rollout side of a run, as the train loop drives it: `restore` (a resumed run), `start`, then per
    step `collect` and `publish` (or `untrained`), `evaluate` whenever asked, `stop` after the last step and
    `aclose` at the end. Weights reach it as a thunk of its `Payload`, made only when the engines take them."""

    #: Whether the data cursor is consistent when the loop's work is aborted between awaits (a checkpoint may
    #: then be written): true where sessions run in the loop's own process.
    checkpoints_when_aborted: bool

    def restore(self, cursor: Mapping[str, Any], *, saved_at: float) -> None:
        """Before `start`: continue from a checkpoint's data `cursor`; the sessions recorded after `saved_at`
        (a time.time()) are moved aside, since the resumed run redoes them."""
        ...

    async def start(
        self, version: int, weights: Callable[[], Payload], *, run_id: str, resume_time: float | None
    ) -> None:
        """Begin serving sessions under weights `version` (`weights()` gives them to engines that need them);
        session ids begin with `run_id`."""
        ...

    async def collect(self, version: int) -> StepRollout:
        """This step's groups, for a trainer at weight `version`."""
        ...

    def untrained(self) -> None:
        """The last `collect` trained nothing (no group had a reward spread): no new weights come of it."""
        ...

    async def publish(self, version: int, weights: Callable[[], Payload]) -> None:
        """Hand weights `version` (the trainer's, after this step) to the engines."""
        ...

    async def evaluate(self, part: EvalSet, *, greedy: bool, run_id: str) -> EvalResult:
        """Held-out sessions of `part` under the newest synced weights; the result's mode is `part`'s key."""
        ...

    def data_cursor(self) -> dict[str, Any]:
        """Which training tasks are done, for a checkpoint (`restore` takes it back)."""
        ...

    def router_stats(self) -> RouterStats | None:
        """Per-engine routing counts since the last call (None where routing happens in another process)."""
        ...

    @property
    def record_failures(self) -> int:
        """Session records that could not be written so far."""
        ...

    async def stop(self) -> None:
        """No more training sessions: those still running are aborted and recorded; `evaluate` still works."""
        ...

    async def aclose(self) -> None:
        """Release everything `start` (or the constructor) took."""
        ...


@dataclass(frozen=True)
class StepOutcome:
    """What one step did: its sessions, the trajectories it trained on, its metrics (`rollout_s`, the source's
    collection metrics, then, when it trained, the update's metrics, `train_s`, `sync_s` and `sync_failed`),
    and whether new weights reached the engines."""

    records: list[SessionRecord]
    trained: list[Trajectory]
    metrics: dict[str, float]
    published: bool


@runtime_checkable
class PolicyRun(Protocol):
    """What the train loop trains, step by step, and where its sessions come from. The loop calls
    `warm_start` (a fresh run) or `restore` (a resumed one), then `start`, then `step` until the run ends,
    `evaluate` between steps, `stop` after the last one and `aclose` at the end."""

    #: Whether `step(ahead=True)` may start the next step's work before this step returns (the loop then
    #: commits that next step: it runs even if the budget runs out meanwhile).
    runs_ahead: bool

    @property
    def checkpoints_when_aborted(self) -> bool:
        """Whether the data cursor is consistent when the loop's work is aborted between awaits."""
        ...

    @property
    def version(self) -> int:
        """The weight version of the trainer's (base) policy, as a checkpoint records it."""
        ...

    @property
    def weights_ok(self) -> bool:
        """False once the trainer's weights held a NaN or inf: no checkpoint is written after that."""
        ...

    @property
    def record_failures(self) -> int:
        """Session records that could not be written so far."""
        ...

    async def warm_start(self, budget_s: float) -> None:
        """Before the first step of a fresh run: bring the engines to the trainer's starting weights (SFT on
        oracle demonstrations first when configured, within `budget_s` seconds)."""
        ...

    async def restore(self, checkpoint: Checkpoint | None, *, saved_at: float) -> None:
        """A resumed run: continue from `checkpoint` (None: killed before its first, so every step is redone);
        the sessions recorded after `saved_at` are moved aside."""
        ...

    async def start(self, *, run_id: str, resume_time: float | None) -> None:
        """Begin serving training sessions, whose ids begin with `run_id`."""
        ...

    async def step(self, *, ahead: bool) -> StepOutcome:
        """One step: sessions, the update on those that train, the new weights to the engines."""
        ...

    def observe(self, records: list[SessionRecord], row: dict[str, Any]) -> None:
        """Add what the run knows beyond the step's own metrics (routing, per-adapter figures) to `row`."""
        ...

    async def evaluate(self, stage: str) -> dict[str, EvalResult]:
        """Every held-out set under the newest weights, each result written to metrics.jsonl and echoed."""
        ...

    def data_cursor(self) -> dict[str, Any]:
        """Which training tasks are done, for a checkpoint."""
        ...

    async def stop(self) -> None:
        """No more training sessions: those still running are aborted and recorded; `evaluate` still works."""
        ...

    async def aclose(self) -> None:
        """Release everything the run took (sessions, recorders, the trainer's own process)."""
        ...
