"""`OnePolicy`: the `PolicyRun` of a run without adapters: the trainer's policy, stepped by `run_step` over one
`RolloutSource` (the scheduler or the user's agents in this process, or the rollout process), and `Publisher`,
which checks the trainer's weights and pushes them to the engines."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from miles.learner.checkpoint import Checkpoint
from miles.learner.protocol import StateDict, Trainer, Weights
from miles.observability import RunMetrics
from miles.sessions.metrics import SessionMetrics
from miles.sessions.records import SessionRecord
from miles.training.config import TrainConfig
from miles.training.evaluate import EvalResult, EvalSet
from miles.training.health import first_nonfinite
from miles.training.metrics_log import MetricsLog
from miles.training.protocol import RolloutSource, StepOutcome
from miles.training.rl_step import run_step, selection
from miles.training.sft import SftStage
from miles.trajectory import TrajectoryBatch
from miles.weight_sync import WeightPusher


class NonFiniteWeightsError(RuntimeError):
    """The trainer's weights hold a NaN or inf: the run stops before they reach an engine or a checkpoint."""


class Publisher:
    """The trainer's weights to the engines: checked for NaN and inf, pushed by weight sync, logged as a `sync`
    row of metrics.jsonl. `version` is the trainer's policy version; `sync.version` is what the engines hold
    (behind it while the asynchronous loop's rollout process has not taken the newest)."""

    def __init__(
        self, trainer: Trainer, sync: WeightPusher, metrics: MetricsLog, run_metrics: RunMetrics
    ) -> None:
        self.trainer, self.sync, self.metrics, self.run_metrics = trainer, sync, metrics, run_metrics
        self.version = sync.version
        #: False once the weights held a NaN or inf: nothing is pushed or checkpointed after that.
        self.weights_ok = True

    def weights(self) -> dict[str, torch.Tensor]:
        """The trainer's weights for the engines; `NonFiniteWeightsError` when one holds a NaN or inf."""
        state = self.trainer.hf_state_dict()
        bad = first_nonfinite(state)
        if bad is not None:
            self.weights_ok = False
            raise NonFiniteWeightsError(
                f"the weights hold NaN or inf after step {self.trainer.step} (first: {bad}); "
                "they were not synced, and no checkpoint was written after the last good one"
            )
        return state

    async def push(self, version: int | None = None, weights: Weights | None = None) -> None:
        """`weights()` (else the trainer's, checked) to the engines as `version` (else the next one)."""
        report = await self.sync.push((weights or self.weights)(), version=version)
        self.version = report.version
        self.metrics.write(
            "sync",
            self.trainer.step,
            version=report.version,
            method=report.method,
            seconds=report.seconds,
            drain_seconds=report.drain_seconds,
            mb=report.num_bytes / 1e6,
        )
        self.run_metrics.observe_sync(report)


class OnePolicy:
    """The trainer's policy over `source`: each step is `run_step` (collect, train, publish); evaluation runs
    every held-out set of `eval_sets` in every configured mode on the source's evaluation."""

    runs_ahead = False

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        publisher: Publisher,
        source: RolloutSource[StateDict],
        sft: SftStage,
        eval_sets: Sequence[EvalSet],
        session_metrics: SessionMetrics,
        echo: Callable[[str], None],
    ) -> None:
        self.cfg, self.publisher, self.source, self.sft = cfg, publisher, source, sft
        self.trainer, self.metrics = publisher.trainer, publisher.metrics
        self.eval_sets, self.session_metrics, self.echo = list(eval_sets), session_metrics, echo
        self.select = selection(
            on_timeout=cfg.rollout.on_timeout, drop_zero_std_groups=cfg.rollout.drop_zero_std_groups
        )

    @property
    def checkpoints_when_aborted(self) -> bool:
        return self.source.checkpoints_when_aborted

    @property
    def version(self) -> int:
        return self.publisher.version

    @property
    def weights_ok(self) -> bool:
        return self.publisher.weights_ok

    @property
    def record_failures(self) -> int:
        return self.source.record_failures

    async def warm_start(self, budget_s: float) -> None:
        if self.cfg.sft.enabled:
            await self.sft.run(budget_s)
        elif self.cfg.model.init_from or self.cfg.engine.kind != "embedded":
            await self.publisher.push()

    async def restore(self, checkpoint: Checkpoint | None, *, saved_at: float) -> None:
        cursor: Mapping[str, Any] = {}
        if checkpoint is not None:
            await self.publisher.push(version=checkpoint.extra.get("weight_version"))
            cursor = checkpoint.data_cursor
        self.source.restore(cursor, saved_at=saved_at)

    async def start(self, *, run_id: str, resume_time: float | None) -> None:
        await self.source.start(
            self.publisher.version, self.trainer.hf_state_dict, run_id=run_id, resume_time=resume_time
        )

    async def step(self, *, ahead: bool) -> StepOutcome:
        """`run_step` of the trainer's policy: synced now (synchronous loop), or handed to the rollout process
        while rollouts go on. A step that trained nothing still counts as a trainer step."""

        async def learn(batch: TrajectoryBatch) -> tuple[dict[str, float], Weights]:
            return self.trainer.train_step(batch), self.publisher.weights

        version = self.publisher.version
        done = await run_step(self.source, version=version, select=self.select, learn=learn, warn=self.echo)
        if done.published:
            self.publisher.version = version + 1
        elif not done.trained:
            self.trainer.step += 1
        return done

    def observe(self, records: list[SessionRecord], row: dict[str, Any]) -> None:
        routing = self.source.router_stats()
        if routing is not None:
            row.update(routing.to_metrics())
            self.session_metrics.observe_router(routing)

    async def evaluate(self, stage: str) -> dict[str, EvalResult]:
        if self.publisher.sync.version < self.publisher.version:  # async: the engines take the newest weights
            await self.publisher.push(version=self.publisher.version)
        ev = self.cfg.eval
        modes = ([True] if ev.greedy else []) + ([False] if ev.sampled else [])
        results = {}
        for part in self.eval_sets:
            for greedy in modes:
                key = part.key("greedy" if greedy else "sampled")
                run_id = f"eval-{stage}-{key.replace('/', '-')}"
                results[key] = res = await self.source.evaluate(part, greedy=greedy, run_id=run_id)
                self.metrics.write("eval", self.trainer.step, stage=stage, **res.to_dict())
                self.echo(
                    f"[eval {stage}] {key}: success {res.success_rate:.1%}  mean reward "
                    f"{res.mean_reward:.3f}  ({res.num_tasks} held-out tasks)"
                )
        return results

    def data_cursor(self) -> dict[str, Any]:
        return self.source.data_cursor()

    async def stop(self) -> None:
        await self.source.stop()

    async def aclose(self) -> None:
        await self.source.aclose()
