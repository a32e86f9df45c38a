"""`AdapterRun`, the `PolicyRun` of a run with `adapters:`: per adapter its env, tasks and data cursor, its
scheduler, evaluation, sync and metrics.

Every adapter's scheduler shares one router, so the sessions of all adapters run at once and the engines
decode their rows together, each row under its own adapter. Within a step each adapter runs its own copy of the
one step body (`miles.training.rl_step.run_step`) on its own `SessionSource`: its sessions, its update (one
adapter at a time, in the trainer's own process, `LoraTrainerProcess`, so the other adapters' sessions go on
beside it), and the push of its new weights (only adapters that trained, each under its own version counter:
`WeightSync.push_adapter`).

When the loop commits the next step during this one, an adapter's pipeline of the next step starts as soon as
its own push is done: its sessions, and its update as soon as they are in, while other adapters still roll
out or train this step (an adapter with long sessions does not hold back the others' updates). So an adapter
runs at most one step ahead of the run, and each adapter still trains on exactly its own on-policy groups.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from miles.engine import RolloutEngine
from miles.engines.lora import AdapterWeights
from miles.envs import EnvRecipe, Task
from miles.learner.checkpoint import Checkpoint
from miles.learner.errors import ConfigError
from miles.learner.lora.process import LoraTrainerProcess
from miles.learner.trainer_process import TrainerProcessError
from miles.observability import RunLabels, RunMetrics
from miles.sessions.config import SchedulerConfig
from miles.sessions.metrics import SessionMetrics
from miles.sessions.recorder import Recorder
from miles.sessions.records import SessionRecord
from miles.sessions.router import Router
from miles.sessions.scheduler import SessionScheduler
from miles.training.config import AdapterConfig, TrainConfig
from miles.training.data import TaskCursor, load_tasks
from miles.training.evaluate import EvalResult, EvalSet
from miles.training.metrics_log import MetricsLog
from miles.training.policy_run import Publisher
from miles.training.protocol import StepOutcome
from miles.training.rl_step import run_step, selection
from miles.training.sources import EngineEvaluation, SessionSource
from miles.trajectory import Trajectory, TrajectoryBatch

ALL_ADAPTERS = "all"  # the `adapter` label of a multi-adapter run's step-level (all adapters) metrics


def adapter_recipe(cfg: TrainConfig, adapter: AdapterConfig) -> EnvRecipe:
    """The adapter's env (its own, or the run's) with its reward weights in the constructor kwargs."""
    recipe = (adapter.env or cfg.env).recipe
    if adapter.reward_weights:
        recipe = recipe.with_kwargs(
            reward_weights={**recipe.kwargs.get("reward_weights", {}), **adapter.reward_weights}
        )
    return recipe


def adapter_scheduler_config(base: SchedulerConfig, adapter: AdapterConfig) -> SchedulerConfig:
    """The run's scheduler settings with the adapter's policy id, sampling overrides and group size."""
    session = dataclasses.replace(
        base.session, policy_id=adapter.name, sampling=base.session.sampling.updated(adapter.sampling)
    )
    return dataclasses.replace(base, session=session, group_size=adapter.group_size or base.group_size)


@dataclass
class AdapterPart:
    """One adapter of the run: where its sessions come from and how they run."""

    config: AdapterConfig
    train_recipe: EnvRecipe
    eval_recipe: EnvRecipe
    train_tasks: list[Task]
    eval_tasks: list[Task]
    cursor: TaskCursor
    scheduler_config: SchedulerConfig
    tasks_per_step: int
    scheduler: SessionScheduler
    metrics: RunMetrics
    #: Its sessions, pushes and evaluations, set by `AdapterRun` (over `scheduler`, `train_tasks`, `cursor`).
    source: SessionSource[AdapterWeights] | None = None
    #: The step number of the sync rows that the adapter's next push writes.
    step_index: int = 0

    @property
    def name(self) -> str:
        return self.config.name


@dataclass(frozen=True)
class AdapterStep:
    """A step of one adapter, or of all of them: the sessions, the trajectories trained, the updates' metrics
    (`NAME/<metric>`; for all, also `step` and `adapters_trained`), the seconds its sessions took (for all: the
    longest adapter's), and the seconds spent in updates and in pushes."""

    records: list[SessionRecord]
    trained: list[Trajectory]
    metrics: dict[str, float]
    rollout_s: float
    train_s: float
    sync_s: float


@dataclass(frozen=True)
class _Pipeline:
    """An adapter's step in progress (sessions, update, push), and its cursor position before its sessions."""

    position: int
    task: asyncio.Task[AdapterStep]


class AdapterRun:
    """Rollouts, evaluation, sync, metrics and data cursors of every adapter of a run (see the module doc).
    The first adapter's scheduler owns the router that the others share."""

    runs_ahead = True
    checkpoints_when_aborted = True
    weights_ok = True  # the base is frozen; an adapter's update is checked in the trainer's process

    def __init__(
        self,
        parts: Sequence[AdapterPart],
        *,
        cfg: TrainConfig,
        trainer: LoraTrainerProcess,
        publisher: Publisher,
        engines: Sequence[RolloutEngine],
        tokenizer: Any,
        recorder: Recorder,
        eval_recorder: Recorder,
        metrics_log: MetricsLog,
        session_metrics: SessionMetrics,
        echo: Callable[[str], None] = print,
    ) -> None:
        self.parts = list(parts)
        self.recorder, self.session_metrics = recorder, session_metrics
        self.select = selection(
            on_timeout=cfg.rollout.on_timeout, drop_zero_std_groups=cfg.rollout.drop_zero_std_groups
        )
        self.cfg, self.trainer, self.engines = cfg, trainer, list(engines)
        self.publisher, self.weight_sync = publisher, publisher.sync
        self.tokenizer, self.eval_recorder, self.metrics_log, self.echo = (
            tokenizer,
            eval_recorder,
            metrics_log,
            echo,
        )
        self._ahead: dict[str, _Pipeline] = {}
        self._updating = asyncio.Lock()  # one adapter's update at a time: they share the peft model
        self._update: asyncio.Future[tuple[dict[str, float], AdapterWeights]] | None = (
            None  # the one in flight
        )
        for part in self.parts:
            part.source = self._source(part)

    def _source(self, part: AdapterPart) -> SessionSource[AdapterWeights]:
        """`part`'s sessions from its own tasks and cursor, its pushes under its own version, and its held-out
        sessions under its own policy."""
        name = part.name

        async def push(version: int, weights: Callable[[], AdapterWeights]) -> None:
            await self._push(name, version, part.step_index, weights())

        assert isinstance(part.scheduler.recorder, Recorder)
        return SessionSource(
            part.scheduler,
            tasks=part.train_tasks,
            cursor=part.cursor,
            tasks_per_step=part.tasks_per_step,
            oversample=0,
            push=push,
            evaluation=EngineEvaluation(
                self.engines,
                self.tokenizer,
                part.scheduler_config,
                self.eval_recorder,
                self.cfg.eval.max_new_tokens,
            ),
            recorder=part.scheduler.recorder,
        )

    @classmethod
    def build(
        cls,
        cfg: TrainConfig,
        *,
        trainer: LoraTrainerProcess,
        publisher: Publisher,
        engines: Sequence[RolloutEngine],
        tokenizer: Any,
        scheduler_config: SchedulerConfig,
        recorder: Recorder,
        eval_recorder: Recorder,
        observer: SessionMetrics,
        labels: RunLabels,
        run_metrics: RunMetrics,
        metrics_log: MetricsLog,
        echo: Callable[[str], None] = print,
    ) -> AdapterRun:
        """One part per configured adapter; every env is built once here, so a bad env or reward weight is a
        `ConfigError` naming the adapter before the first step."""
        parts: list[AdapterPart] = []
        for a in cfg.adapters:
            recipe = adapter_recipe(cfg, a)
            env_cfg = a.env or cfg.env
            try:
                recipe.make(split=env_cfg.train_split).close()
            except (ConfigError, ValueError, TypeError) as exc:
                key = "reward_weights" if a.reward_weights and "reward" in str(exc) else "env"
                raise ConfigError(f"adapters[{a.name}].{key}", str(exc)) from exc
            train_tasks = load_tasks(recipe, env_cfg.train_split, env_cfg.num_train_tasks)
            sched_cfg = adapter_scheduler_config(scheduler_config, a)
            train_recipe = recipe.with_kwargs(split=env_cfg.train_split)
            parts.append(
                AdapterPart(
                    config=a,
                    train_recipe=train_recipe,
                    eval_recipe=recipe.with_kwargs(split=env_cfg.eval_split),
                    train_tasks=train_tasks,
                    eval_tasks=load_tasks(recipe, env_cfg.eval_split, cfg.eval.num_tasks, distinct=True),
                    cursor=TaskCursor(len(train_tasks), cfg.seed),
                    scheduler_config=sched_cfg,
                    tasks_per_step=a.tasks_per_step or cfg.rollout.tasks_per_step,
                    scheduler=SessionScheduler(
                        parts[0].scheduler.router if parts else list(engines),
                        tokenizer=tokenizer,
                        config=sched_cfg,
                        recorder=recorder,
                        run_id=f"train-{a.name}",
                        recipe=train_recipe,
                        observer=observer,
                    ),
                    metrics=RunMetrics(
                        dataclasses.replace(labels, env=recipe.id, adapter=a.name),
                        metrics=run_metrics.metrics,
                        flops_per_token=run_metrics.flops_per_token,
                        peak_flops=run_metrics.peak_flops,
                    ),
                )
            )
        return cls(
            parts,
            cfg=cfg,
            trainer=trainer,
            publisher=publisher,
            engines=engines,
            tokenizer=tokenizer,
            recorder=recorder,
            eval_recorder=eval_recorder,
            metrics_log=metrics_log,
            session_metrics=observer,
            echo=echo,
        )

    @property
    def router(self) -> Router:
        return self.parts[0].scheduler.router

    @property
    def version(self) -> int:
        return self.publisher.version

    @property
    def record_failures(self) -> int:
        return sum(p.scheduler.stats.record_failures for p in self.parts)

    async def warm_start(self, budget_s: float) -> None:
        """The base to engines that do not hold it already (`model.init_from`, HTTP servers), then every adapter
        at version 0 (a fresh adapter is the base)."""
        if self.cfg.model.init_from or self.cfg.engine.kind != "embedded":
            await self.publisher.push()
        await self._load_adapters()

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.parts]

    # ---- engines ---------------------------------------------------------------------------------------
    async def start(self, *, run_id: str, resume_time: float | None) -> None:
        """Each adapter's session ids begin with `run_id` and its name."""
        for part in self.parts:
            part.scheduler.run_id = f"{run_id}-{part.name}"

    async def _load_adapters(self, versions: dict[str, int] | None = None) -> None:
        """Load every adapter into the engines: at version 0 (a fresh adapter is the base), or at the versions a
        checkpoint was synced as."""
        for name in self.names:
            await self._push(name, None if versions is None else versions.get(name))

    async def _push(
        self, name: str, version: int | None, step: int | None = None, weights: AdapterWeights | None = None
    ) -> float:
        t0 = time.perf_counter()
        weights = self.trainer.adapter_weights(name) if weights is None else weights
        report = await self.weight_sync.push_adapter(name, weights, version=version)
        self.metrics_log.write(
            "sync",
            self.trainer.step if step is None else step,
            adapter=name,
            version=report.version,
            method=report.method,
            seconds=report.seconds,
            drain_seconds=report.drain_seconds,
            mb=report.num_bytes / 1e6,
        )
        self._part(name).metrics.observe_sync(report)
        return time.perf_counter() - t0

    def _part(self, name: str) -> AdapterPart:
        return next(p for p in self.parts if p.name == name)

    # ---- a step ----------------------------------------------------------------------------------------
    async def step(self, *, ahead: bool) -> StepOutcome:
        """One step of every adapter (`step_all`), as one outcome: the longest adapter's `rollout_s`, and when
        any trained, the updates' metrics (`NAME/<metric>`), `train_s` and `sync_s` summed over adapters."""
        done = await self.step_all(self.select, ahead=ahead)
        row: dict[str, float] = {"rollout_s": done.rollout_s}
        if done.trained:
            row.update(
                {k: v for k, v in done.metrics.items() if k != "step"},
                train_s=done.train_s,
                sync_s=done.sync_s,
                num_tokens=float(sum(len(t) for t in done.trained)),
                num_sequences=float(len(done.trained)),
            )
        return StepOutcome(done.records, done.trained, row, published=bool(done.trained))

    async def step_all(
        self, select: Callable[[list[SessionRecord]], list[Trajectory]], *, ahead: bool
    ) -> AdapterStep:
        """One step of every adapter, each on its own pipeline (see the module doc): its sessions, `select(records)`
        (the trajectories to train on), its update and the push of its new weights; an adapter's pipeline may
        have started, or even finished, during the previous step. With `ahead` the loop commits the next step:
        each adapter's pipeline of it starts right after this step's push (`settle()` takes back what a run
        stopped by an error leaves). An update runs in the trainer process with this process's torch threads,
        or one fewer (at least one) while sessions are in flight: in-process engines then decode beside it."""
        index = self.trainer.step + 1

        async def one(part: AdapterPart) -> AdapterStep:
            pending = self._ahead.pop(part.name, None) or self._start(part, select, index)
            done = await pending.task
            if ahead:
                self._ahead[part.name] = self._start(part, select, index + 1)
            return done

        try:
            async with asyncio.TaskGroup() as tg:
                runs = [tg.create_task(one(p)) for p in self.parts]
        except* (
            TrainerProcessError
        ) as failed:  # the run stops with this one line, as for a dead rollout process
            raise failed.exceptions[0] from None
        done = [r.result() for r in runs]
        metrics: dict[str, float] = {}
        for d in done:
            metrics.update(d.metrics)
        metrics.update(
            self.trainer.end_step(tuple(p.name for p, d in zip(self.parts, done, strict=True) if d.trained))
        )
        return AdapterStep(
            records=[r for d in done for r in d.records],
            trained=[t for d in done for t in d.trained],
            metrics=metrics,
            rollout_s=max(d.rollout_s for d in done),
            train_s=sum(d.train_s for d in done),
            sync_s=sum(d.sync_s for d in done),
        )

    def _start(
        self, part: AdapterPart, select: Callable[[list[SessionRecord]], list[Trajectory]], index: int
    ) -> _Pipeline:
        """Start `part`'s pipeline of step `index` (the step number of its sync rows)."""
        return _Pipeline(
            part.cursor.position, asyncio.get_running_loop().create_task(self._pipeline(part, select, index))
        )

    async def _pipeline(
        self, part: AdapterPart, select: Callable[[list[SessionRecord]], list[Trajectory]], index: int
    ) -> AdapterStep:
        """`part`'s copy of the one step body, with its update in the trainer process."""
        assert part.source is not None

        async def learn(batch: TrajectoryBatch) -> tuple[dict[str, float], Callable[[], AdapterWeights]]:
            async with self._updating:
                threads_all = torch.get_num_threads()
                threads = threads_all if part.scheduler.router.inflight == 0 else max(1, threads_all - 1)
                # shielded: a cancelled step waits for the update it started (`settle`), as the trainer's pipe
                # must not carry another call meanwhile
                self._update = asyncio.ensure_future(
                    asyncio.to_thread(self._train, part.name, batch, threads)
                )
                metrics, weights = await asyncio.shield(self._update)
                self._update = None
            return metrics, lambda: weights

        part.step_index = index
        last = self.weight_sync.adapter_version(part.name)
        version = -1 if last is None else last  # a first push is version 0, as `push_adapter` numbers it
        done = await run_step(part.source, version=version, select=select, learn=learn, warn=self.echo)
        metrics = dict(done.metrics)
        rollout_s, train_s, sync_s = (metrics.pop(k, 0.0) for k in ("rollout_s", "train_s", "sync_s"))
        return AdapterStep(done.records, done.trained, metrics, rollout_s, train_s, sync_s)

    def _train(
        self, name: str, batch: TrajectoryBatch, threads: int
    ) -> tuple[dict[str, float], AdapterWeights]:
        """Adapter `name`'s update on `batch` with `threads` torch threads, and its new weights."""
        return self.trainer.train_adapter(name, batch, threads=threads), self.trainer.adapter_weights(name)

    async def settle(self) -> None:
        """Take back the pipelines of a step that will not run (a run stopped by an error or an interrupt): their
        sessions still running are aborted and every one is recorded once; an update already running is waited
        for, and no other starts; each adapter's cursor returns to where they began, so a run resumed from the
        last checkpoint counts those tasks as not done."""
        ahead, self._ahead = self._ahead, {}
        for pending in ahead.values():
            pending.task.cancel()
        for name, pending in ahead.items():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pending.task
            self._part(name).cursor.position = pending.position
        if self._update is not None:
            with contextlib.suppress(Exception):
                await self._update
            self._update = None

    def observe(self, records: list[SessionRecord], row: dict[str, Any]) -> None:
        """Add each adapter's rollout reward, success and session count to the step's `row` (as `NAME/...`,
        beside the trainer's `NAME/...` metrics), and export each adapter's step under its own label; then the
        shared router's counts."""
        for part in self.parts:
            mine = [r for r in records if r.policy_id == part.name]
            prefix = f"{part.name}/"
            own = {k[len(prefix) :]: v for k, v in row.items() if k.startswith(prefix)}
            own.update(
                {
                    "rollout_reward_mean": float(np.mean([r.reward for r in mine])) if mine else 0.0,
                    "rollout_success_rate": float(np.mean([bool(r.final_info.get("success")) for r in mine]))
                    if mine
                    else 0.0,
                    "sessions": len(mine),
                }
            )
            for key in ("rollout_reward_mean", "rollout_success_rate", "sessions"):
                row[prefix + key] = own[key]
            part.metrics.observe_step({**{k: row[k] for k in ("rollout_s", "step_s") if k in row}, **own})
        routing = self.router.stats(reset=True)
        row.update(routing.to_metrics())
        self.session_metrics.observe_router(routing)

    # ---- evaluation ------------------------------------------------------------------------------------
    async def evaluate(self, stage: str) -> dict[str, EvalResult]:
        """Every adapter on its own held-out tasks under its own policy, all at once; results keyed
        `NAME/<mode>`, each written to metrics.jsonl and echoed."""
        ev = self.cfg.eval
        modes = ([True] if ev.greedy else []) + ([False] if ev.sampled else [])

        async def one(part: AdapterPart, greedy: bool) -> EvalResult:
            assert part.source is not None
            return await part.source.evaluate(
                EvalSet("", part.eval_recipe, part.eval_tasks),
                greedy=greedy,
                run_id=f"eval-{stage}-{part.name}-{'greedy' if greedy else 'sampled'}",
            )

        jobs = [(part, greedy) for greedy in modes for part in self.parts]
        async with asyncio.TaskGroup() as tg:
            runs = [tg.create_task(one(part, greedy)) for part, greedy in jobs]
        results = {}
        for (part, _), run in zip(jobs, runs, strict=True):
            res = run.result()
            results[f"{part.name}/{res.mode}"] = res
            self.metrics_log.write("eval", self.trainer.step, stage=stage, adapter=part.name, **res.to_dict())
            self.echo(
                f"[eval {stage}] {part.name} {res.mode}: success {res.success_rate:.1%}  "
                f"mean reward {res.mean_reward:.3f}  ({res.num_tasks} held-out tasks)"
            )
        return results

    # ---- checkpoints -----------------------------------------------------------------------------------
    def data_cursor(self) -> dict[str, Any]:
        """Each adapter's task position and synced version, for a checkpoint's data cursor."""
        return {
            "adapters": {
                p.name: {"position": p.cursor.position, "version": self.weight_sync.adapter_version(p.name)}
                for p in self.parts
            }
        }

    async def restore(self, checkpoint: Checkpoint | None, *, saved_at: float) -> None:
        """Resume from `checkpoint`: each adapter's task position, and its weights (already in the trainer)
        pushed at the version they were synced as; the sessions recorded after `saved_at` are moved aside."""
        self.recorder.drop_after(saved_at)
        if checkpoint is None:
            return
        await self.publisher.push(version=checkpoint.extra.get("weight_version"))
        saved = checkpoint.data_cursor.get("adapters", {})
        for part in self.parts:
            part.cursor.position = int(saved.get(part.name, {}).get("position", 0))
        await self._load_adapters(
            {n: int(s["version"]) for n, s in saved.items() if s.get("version") is not None}
        )

    async def stop(self) -> None:
        await self.settle()

    async def aclose(self) -> None:
        await self.settle()
        for part in reversed(self.parts):  # the first owns the router the others use
            await part.scheduler.aclose()
        await self.recorder.aclose()
