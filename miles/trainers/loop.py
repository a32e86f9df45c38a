"""The train loop: rollout via the scheduler, TITO trajectories, train steps, weight sync, repeat."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from miles.config import to_dict
from miles.envs.recipe import error_line
from miles.observability import run_labels, start_observability
from miles.sessions.metrics import SessionMetrics
from miles.sessions.recorder import Recorder
from miles.sessions.records import SessionRecord
from miles.sessions.scheduler import GroupRunner, SessionScheduler
from miles.trainers.async_rollout import ProcessSource
from miles.trainers.cluster.sync import rejoining_weight_sync
from miles.trainers.data import TaskCursor, load_tasks
from miles.trainers.demos import oracle_demos
from miles.trainers.engine_setup import bounded_by_context, build_engine_set
from miles.trainers.evaluate import EvalResult, eval_sets, evaluate
from miles.trainers.health import UNTRAINABLE, RunHealth, StepActivity, first_nonfinite, step_activity
from miles.trainers.lora.process import LoraTrainerProcess
from miles.trainers.metrics_log import MetricsLog, read_metrics
from miles.trainers.models import build_policy, build_tito, check_devices, check_tools_reach_model
from miles.trainers.output_dir import OutputDirLock, check_fresh_output_dir
from miles.trainers.protocol import RolloutSource, Trainer, Weights
from miles.trainers.rl_step import run_step
from miles.trainers.rollout_process import RolloutProcess, RolloutStart
from miles.trainers.seeding import seed_everything
from miles.trainers.sources import (
    AgentEvaluation,
    EngineEvaluation,
    Evaluation,
    SessionSource,
    close_within,
)
from miles.trainers.train_config import TrainConfig
from miles.trajectory import Trajectory, TrajectoryBatch
from miles.types import TerminationReason
from miles.weight_sync import build_weight_sync

if TYPE_CHECKING:
    from miles.trainers.lora.run import AdapterRun

log = logging.getLogger(__name__)


@dataclass
class RunSummary:
    """The outcome of one run: held-out results at each stage, and where the time went."""

    output_dir: str
    steps_done: int
    evals: dict[str, dict[str, EvalResult]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    #: Why the run stopped before its budget because it was broken (empty when it was not): the run then
    #: reports this line and exit status 3, never a score.
    broken: str = ""
    #: The signal that stopped the run ("SIGINT", "SIGTERM"), or "": it checkpointed and reports no score.
    stopped: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "output_dir": self.output_dir,
            "steps_done": self.steps_done,
            "seconds": self.seconds,
            "broken": self.broken,
            "stopped": self.stopped,
            "evals": {stage: {m: r.to_dict() for m, r in res.items()} for stage, res in self.evals.items()},
        }


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


#: Cancellations sent to a run's work past its wall (each unwinds one cleanup that waits on a stuck peer).
ABORT_ROUNDS = 5
#: Seconds each part of the run gets to close.
TEARDOWN_S = 5.0


class _StopSignals:
    """SIGINT and SIGTERM handlers on the running loop (main thread only) that set `stop`; `restore()` puts
    the previous handling back."""

    def __init__(self, stop: asyncio.Event, summary: Any) -> None:
        self.loop = asyncio.get_running_loop()
        self.installed: list[int] = []
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):

            def handler(sig: int = sig) -> None:
                summary.stopped = summary.stopped or signal.Signals(sig).name
                stop.set()

            self.loop.add_signal_handler(sig, handler)
            self.installed.append(sig)

    def restore(self) -> None:
        for sig in self.installed:
            self.loop.remove_signal_handler(sig)


class NonFiniteWeightsError(RuntimeError):
    """The trainer's weights hold a NaN or inf: the run stops before they reach an engine or a checkpoint."""


class TrainLoop:
    """One `miles train` run. `await run()` does SFT (if enabled), evaluation, and the RL steps."""

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        resume: bool = False,
        extend: bool = False,
        echo: Callable[[str], None] = print,
        rollout_process: Callable[[TrainConfig, RolloutStart], RolloutProcess] = RolloutProcess.spawn,
    ) -> None:
        self.cfg = cfg
        self.rollout_process = rollout_process  # how an asynchronous run starts its rollout process
        self.resume = resume
        self.extend = extend  # a resumed run gets a whole new max_seconds instead of what its budget has left
        self.echo = echo
        self.t_origin = time.perf_counter()  # when the run's budget started (earlier, for a resumed run)
        self.out = Path(cfg.output_dir)
        self.lock = OutputDirLock(self.out)  # released at the end of `run`
        try:
            if not resume:
                check_fresh_output_dir(self.out)
            (self.out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
            self.metrics = MetricsLog(self.out / "metrics.jsonl")
        except BaseException:
            self.lock.release()
            raise
        self.summary = RunSummary(output_dir=str(self.out), steps_done=0)
        self.weights_ok = (
            True  # False once the weights held a NaN or inf: nothing is synced or saved after that
        )

    def _set_aside_after(self, saved_at: float, cursor: dict[str, Any]) -> None:
        """Continue from data `cursor`; forget the metric rows and move aside the sessions of the work after
        `saved_at`, which a resumed run redoes: every session stays in its file once."""
        self.metrics.drop_after(saved_at)
        self.eval_recorder.drop_after(saved_at)
        self.source.restore(cursor, saved_at=saved_at)

    # ---- setup ---------------------------------------------------------------------------------------
    async def _setup(self) -> None:
        cfg = self.cfg
        check_devices(cfg)
        seed_everything(cfg.seed)
        self.recipe = cfg.env.recipe
        self.recipe.make(
            split=cfg.env.train_split
        ).close()  # imports the user's modules; fails early, in one line
        self.tito = build_tito(cfg.model)
        self.train_recipe = self.recipe.with_kwargs(split=cfg.env.train_split)
        self.train_tasks = load_tasks(self.recipe, cfg.env.train_split, cfg.env.num_train_tasks)
        self.eval_sets = eval_sets(self.recipe, cfg.env.eval_split, cfg.eval.num_tasks, cfg.eval.envs)
        await check_tools_reach_model(
            self.tito, self.train_recipe, self.train_tasks[0]
        )  # before the model loads
        self.model = build_policy(cfg.model, self.tito.tokenizer)
        self.cursor = TaskCursor(len(self.train_tasks), cfg.seed)
        # Engines copy the policy before the trainer wraps it (FSDP, Megatron conversion).
        self.engine_set = await build_engine_set(
            cfg.engine, self.model, self.tito.tokenizer, cfg.model.tokenizer
        )
        self.engines = self.engine_set.rollout
        self.scheduler_cfg = bounded_by_context(cfg.rollout.scheduler, self.engine_set.context_length)
        try:
            from miles.trainers.factory import build_trainer

            self.trainer: Trainer = build_trainer(cfg, self.model)
            make_sync = (
                build_weight_sync
                if cfg.cluster.kind == "local"  # on Ray, restarted engines rejoin
                else functools.partial(rejoining_weight_sync, wait_s=cfg.cluster.timeout_s)
            )
            pause = cfg.asynchronous.enabled and cfg.asynchronous.inflight == "pause"  # turns in flight go on
            self.sync = await make_sync(
                dataclasses.replace(cfg.sync, policy="pause") if pause else cfg.sync,
                self.engine_set.workers,
                staging_dir=self.out / "weights",
                drain_engines=self.engine_set.rollout,
            )
            labels = run_labels(
                cfg.observability,
                self.out,
                cfg.env.id,
                cfg.model.name,
                adapter="all" if cfg.adapters else "base",
            )  # adapters: step metrics span them all
            self.observability = start_observability(
                cfg.observability,
                labels,
                engines=self.engines,
                num_params=sum(p.numel() for p in self.model.parameters()),
                echo=self.echo,
            )
            self.eval_recorder = Recorder(self.out / "eval_sessions.jsonl")
            self.health = RunHealth(cfg.health, warn=self.echo)
            self.session_metrics = SessionMetrics(self.observability.labels)
            self.version = self.sync.version  # the weights the trainer's policy was last synced as
            self.adapters: AdapterRun | None = None
            self.source: RolloutSource = await self._rollout_source()
        except BaseException:
            await self.engine_set.close()
            self._close_trainer()
            raise

    async def _rollout_source(self) -> RolloutSource:
        """Where the training sessions come from: the rollout process (`async.enabled`), the user's agents
        (`rollout.agent`), or the scheduler in this process; with `adapters:`, each adapter's scheduler shares
        the source's router."""
        cfg = self.cfg
        engine_evaluation = EngineEvaluation(
            self.engines, self.tito, self.scheduler_cfg, self.eval_recorder, cfg.eval.max_new_tokens
        )
        if cfg.asynchronous.enabled:  # the rollout process runs (and records) the training sessions
            return ProcessSource(
                cfg,
                http=self.engine_set.is_http,
                push=self._sync,
                evaluation=engine_evaluation,
                observer=self.session_metrics,
                spawn=self.rollout_process,
            )
        recorder = Recorder(self.out / "sessions.jsonl")
        runner: GroupRunner
        evaluation: Evaluation = engine_evaluation
        closing = []
        if cfg.rollout.agent.enabled:  # the user's own agent runs the sessions, against the OpenAI endpoint
            from miles.sessions.openai.agent import AgentRollout

            agents = await AgentRollout.start(
                self.engines,
                tokenizer=self.tito,
                config=cfg.rollout.agent,
                context_length=self.scheduler_cfg.session.context_length,
                log_dir=cfg.rollout.agent.log_dir or self.out / "agent_logs",
            )
            runner = agents.runner(
                recipe=self.train_recipe,
                group_size=self.scheduler_cfg.group_size,
                seed=self.scheduler_cfg.seed,
                recorder=recorder,
                run_id="train",
                observer=self.session_metrics,
            )
            evaluation = AgentEvaluation(agents, self.eval_recorder, cfg.eval.max_new_tokens)
            closing.append(agents.aclose)
        else:
            runner = SessionScheduler(
                self.engines,
                tokenizer=self.tito,
                config=self.scheduler_cfg,
                recorder=recorder,
                run_id="train",
                recipe=self.train_recipe,
                observer=self.session_metrics,
            )
        source = SessionSource(
            runner,
            tasks=self.train_tasks,
            cursor=self.cursor,
            tasks_per_step=cfg.rollout.tasks_per_step,
            oversample=self.scheduler_cfg.oversample_groups,
            push=self._sync,
            evaluation=evaluation,
            recorder=recorder,
            closing=closing,
            close_timeout=TEARDOWN_S,
        )
        if cfg.adapters:  # LoRA adapters on one base: each its own env and scheduler, all on this router
            from miles.trainers.lora.run import AdapterRun

            self.adapters = AdapterRun.build(
                cfg,
                trainer=self.trainer,
                sync=self.sync,
                engines=self.engines,
                router=runner.router,
                tokenizer=self.tito,
                scheduler_config=self.scheduler_cfg,
                recorder=recorder,
                eval_recorder=self.eval_recorder,
                observer=self.session_metrics,
                labels=self.observability.labels,
                run_metrics=self.observability.run,
                metrics_log=self.metrics,
                echo=self.echo,
            )
        return source

    def _close_trainer(self) -> None:
        """End the trainer's own process, where it has one (a run with `adapters:`)."""
        if isinstance(getattr(self, "trainer", None), LoraTrainerProcess):
            self.trainer.close()

    # ---- stages --------------------------------------------------------------------------------------
    def _finite_weights(self) -> dict[str, Any]:
        """The trainer's weights for the engines; `NonFiniteWeightsError` when one holds a NaN or inf (then
        nothing is synced or checkpointed again)."""
        state = self.trainer.hf_state_dict()
        bad = first_nonfinite(state)
        if bad is not None:
            self.weights_ok = False
            raise NonFiniteWeightsError(
                f"the weights hold NaN or inf after step {self.trainer.step} (first: {bad}); "
                "they were not synced, and no checkpoint was written after the last good one"
            )
        return state

    async def _sync(self, version: int | None = None, weights: Weights | None = None) -> None:
        """The trainer's weights (`weights()`, else checked `_finite_weights`) to the engines as `version`."""
        report = await self.sync.push((weights or self._finite_weights)(), version=version)
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
        self.observability.run.observe_sync(report)

    async def _evaluate(self, stage: str) -> dict[str, EvalResult]:
        """Every held-out set in every configured mode, under the trainer's newest weights."""
        cfg = self.cfg
        if self.adapters is not None:  # every adapter on its own held-out tasks
            self.summary.evals[stage] = results = await self.adapters.evaluate(stage)
            return results
        if self.sync.version < self.version:  # async: the trainer's own engines evaluate the newest weights
            await self._sync(version=self.version)
        modes = ([True] if cfg.eval.greedy else []) + ([False] if cfg.eval.sampled else [])
        results = {}
        for part in self.eval_sets:
            for greedy in modes:
                key = part.key("greedy" if greedy else "sampled")
                run_id = f"eval-{stage}-{key.replace('/', '-')}"
                results[key] = res = await self.source.evaluate(part, greedy=greedy, run_id=run_id)
                if res.invalid and not self.summary.broken:
                    self.summary.broken = f"the {stage} evaluation ({key}) is no score: {res.invalid}"
                self.metrics.write("eval", self.trainer.step, stage=stage, **res.to_dict())
                self.echo(
                    f"[eval {stage}] {key}: success {res.success_rate:.1%}  mean reward "
                    f"{res.mean_reward:.3f}  ({res.num_tasks} held-out tasks)"
                )
        self.summary.evals[stage] = results
        return results

    def _sft_trainer(self) -> Any:
        """SFT runs with its own optimizer at `sft.lr` (constant after `sft.warmup_steps` of warmup), on either
        backend; the first RL step then starts from fresh optimizer state at `trainer.lr`."""
        self.trainer.begin_sft(self.cfg.sft.lr, warmup_steps=self.cfg.sft.warmup_steps)
        return self.trainer

    def _sft_budget(self, t_run: float) -> float | None:
        """Seconds SFT may take: `sft.max_seconds`, and within the run's own `max_seconds` (counted from
        `t_run`, the run's start), whichever ends first; None for no limit."""
        limits = [self.cfg.sft.max_seconds]
        if self.cfg.max_seconds is not None:
            limits.append(self.cfg.max_seconds - (time.perf_counter() - t_run))
        limits = [x for x in limits if x is not None]
        return min(limits) if limits else None

    async def _sft(self, t_run: float) -> None:
        """Train on oracle demonstrations until the epochs, the validation target or the budget end; the
        weights are then synced (and saved to `sft.save_to`) however it ended."""
        cfg, sft = self.cfg, self.cfg.sft
        t0 = time.perf_counter()
        budget = self._sft_budget(t_run)
        self.echo(f"[sft] building {sft.num_demos} oracle demonstrations ...")
        demos = await oracle_demos(self.train_recipe.make, self.train_tasks[: sft.num_demos], self.tito)
        total = sft.epochs * -(-len(demos) // sft.batch_size)
        self.echo(
            f"[sft] {len(demos)} demonstrations in {time.perf_counter() - t0:.1f} s; {total} steps of "
            f"{sft.batch_size}" + (f" within {budget:.0f} s" if budget is not None else "")
        )
        rng = random.Random(cfg.seed)
        steps, reason, t_train, last_echo = 0, "all epochs", time.perf_counter(), 0.0
        sft_trainer = self._sft_trainer()
        # Validation for the early stop: distinct training prompts, never the held-out split.
        val_tasks = (
            load_tasks(self.recipe, cfg.env.train_split, sft.check_tasks, distinct=True)
            if sft.target_success
            else []
        )
        for epoch in range(sft.epochs):
            order = list(range(len(demos)))
            rng.shuffle(order)
            for i in range(0, len(order), sft.batch_size):
                batch = TrajectoryBatch.from_trajectories([demos[j] for j in order[i : i + sft.batch_size]])
                m = sft_trainer.sft_step(batch)
                steps += 1
                now = time.perf_counter()
                if steps % 10 == 0:
                    self.metrics.write("sft", steps, epoch=epoch, loss=m["loss"], lr=m["lr"])
                if now - last_echo >= 10 or steps == total:
                    last_echo = now
                    eta = (now - t_train) / steps * (total - steps)
                    self.echo(
                        f"[sft] step {steps}/{total}  epoch {epoch + 1}/{sft.epochs}  loss {m['loss']:.3f}  "
                        f"{now - t0:.0f} s  ETA {eta:.0f} s"
                    )
                if budget is not None and now - t0 > budget:
                    reason = f"its budget of {budget:.0f} s"
                    break
                if val_tasks and steps >= sft.min_steps and steps % sft.check_every == 0:
                    await self._sync()
                    val = await evaluate(
                        self.engines,
                        tokenizer=self.tito,
                        recipe=self.train_recipe,
                        run_id=f"sft-val-{steps}",
                        tasks=val_tasks,
                        scheduler=self.scheduler_cfg,
                        greedy=True,
                    )
                    self.metrics.write("sft_val", steps, success_rate=val.success_rate)
                    self.echo(
                        f"[sft] step {steps}: loss {m['loss']:.3f}, validation success {val.success_rate:.1%}"
                    )
                    if val.success_rate >= sft.target_success:
                        reason = f"validation success {val.success_rate:.1%} >= {sft.target_success:.1%}"
                        break
            else:
                continue
            break
        self.trainer.step = 0
        await self._sync()
        if sft.save_to:
            self.trainer.save_pretrained(sft.save_to)
            self.tito.tokenizer.save_pretrained(sft.save_to)
        self.summary.seconds["sft"] = time.perf_counter() - t0
        self.echo(
            f"[sft] {len(demos)} oracle demos, {steps} steps in {self.summary.seconds['sft']:.1f} s (ended by "
            f"{reason})" + (f"; saved to {sft.save_to}" if sft.save_to else "")
        )

    def _to_train(self, records: list[SessionRecord]) -> list[Trajectory]:
        """The trajectories of `records` that train: finished (or timed-out, per `rollout.on_timeout`), and
        with `rollout.drop_zero_std_groups` only groups whose rewards differ."""
        trajs = trainable(records, on_timeout=self.cfg.rollout.on_timeout)
        return split_by_reward_spread(trajs)[0] if self.cfg.rollout.drop_zero_std_groups else trajs

    def _runs_ahead(self, step: int, t_start: float) -> bool:
        """Whether step `step + 1` is committed during step `step` (a run with adapters), so that each adapter's
        part of it starts as soon as the adapter is done with this step: it is a step of this run, no evaluation
        or checkpoint comes before it, and the time budget is not spent. A committed step runs even if the
        budget runs out meanwhile."""
        cfg, nxt = self.cfg, step + 1
        return (
            nxt < cfg.steps
            and not (cfg.eval.every and nxt % cfg.eval.every == 0)
            and not (cfg.checkpoint.every and nxt % cfg.checkpoint.every == 0)
            and (cfg.max_seconds is None or time.perf_counter() - t_start < cfg.max_seconds)
        )

    async def _rl_step(self, step: int, *, ahead: bool = False) -> tuple[dict[str, Any], StepActivity]:
        """One RL step (the source's groups, the update, the new weights to the engines) and its metrics row."""
        t0 = time.perf_counter()
        if self.adapters is not None:  # every adapter on its own pipeline; updates and pushes happen inside
            records, trajs, row = await self._adapter_step(ahead)
        else:
            records, trajs, row = await self._one_step()
        activity = step_activity(records)
        finished = trainable(records, on_timeout=self.cfg.rollout.on_timeout)
        num_groups, flat = split_by_reward_spread(finished)[1:]
        row = {
            "rollout_reward_mean": float(np.mean([r.reward for r in records])) if records else 0.0,
            "rollout_success_rate": (
                float(np.mean([bool(r.final_info.get("success")) for r in records])) if records else 0.0
            ),
            "sessions": len(records),
            "trained_sessions": len(trajs),
            **activity.metrics(),
            "rollout_zero_std_group_frac": flat / num_groups if num_groups else 0.0,
            "generated_tokens": sum(r.trajectory.num_generated for r in records),
            **row,
        }
        row["step_s"] = time.perf_counter() - t0
        row["samples_per_s"] = len(trajs) / row["step_s"]
        row["trained_tokens_per_s"] = float(sum(len(t) for t in trajs)) / row["step_s"]
        if "trainer_wait_s" in row:
            row["trainer_idle_ratio"] = row["trainer_wait_s"] / row["step_s"]
        if self.adapters is not None:
            self.adapters.observe(records, row)
        routing = self.source.router_stats()
        if routing is not None:
            row.update(routing.to_metrics())
            self.session_metrics.observe_router(routing)
        self.metrics.write("train", step, **row)
        self.observability.run.observe_step(row)
        return row, activity

    async def _one_step(self) -> tuple[list[SessionRecord], list[Trajectory], dict[str, Any]]:
        """The step (`run_step`) of the trainer's policy: synced now (synchronous loop), or handed to the
        rollout process while rollouts go on."""

        async def learn(batch: TrajectoryBatch) -> tuple[dict[str, float], Weights]:
            return self.trainer.train_step(batch), self._finite_weights

        version = self.version
        done = await run_step(
            self.source, version=version, select=self._to_train, learn=learn, warn=self.echo
        )
        if done.published:
            self.version = version + 1
        elif not done.trained:
            self.trainer.step += 1
        return done.records, done.trained, dict(done.metrics)

    async def _adapter_step(
        self, ahead: bool
    ) -> tuple[list[SessionRecord], list[Trajectory], dict[str, Any]]:
        """The step of every adapter, each on its own pipeline (sessions, update, push)."""
        assert self.adapters is not None
        done = await self.adapters.step(self._to_train, ahead=ahead)
        row: dict[str, Any] = {"rollout_s": done.rollout_s}  # the longest adapter's sessions
        if done.trained:
            row.update(
                {k: v for k, v in done.metrics.items() if k != "step"},
                train_s=done.train_s,
                sync_s=done.sync_s,
                num_tokens=float(sum(len(t) for t in done.trained)),
                num_sequences=float(len(done.trained)),
            )
        return done.records, done.trained, row

    def _checkpoint(self) -> None:
        if not self.weights_ok:
            return
        cursor = self.source.data_cursor()
        if self.adapters is not None:
            cursor.update(self.adapters.data_cursor())
        self.trainer.save_checkpoint(
            self.out / "checkpoints",
            data_cursor=cursor,
            extra={
                "weight_version": self.version,
                "time": time.time(),
                "elapsed_s": time.perf_counter() - self.t_origin,
            },
            keep_last=self.cfg.checkpoint.keep,
        )

    # ---- the run -------------------------------------------------------------------------------------
    async def run(self) -> RunSummary:
        """Train (resuming if asked), evaluate, write the summary and curves; the output folder is released."""
        try:
            return await self._run()
        finally:
            self.lock.release()

    async def _run(self) -> RunSummary:
        t_start, lingered = time.perf_counter(), 0.0
        await self._setup()
        self.t_origin = t_start - self._spent_before()
        try:
            if await self._within_the_wall(self._train(self.t_origin), self.t_origin):
                lingered = await self.observability.linger(self.echo)
        finally:
            await self._teardown()
        self.summary.seconds["total"] = time.perf_counter() - t_start - lingered
        (self.out / "summary.json").write_text(json.dumps(self.summary.to_dict(), indent=1))
        from miles.trainers.plot import plot_run

        plot_run(self.out / "metrics.jsonl", self.out / "curves.png")
        return self.summary

    def _recorded_evals(self, stage: str) -> dict[str, dict[str, EvalResult]]:
        """The evaluations of `stage` that `metrics.jsonl` holds (a resumed run's start), by stage and mode."""
        fields = {f.name for f in dataclasses.fields(EvalResult)}
        rows = [
            r
            for r in read_metrics(self.out / "metrics.jsonl")
            if r.get("kind") == "eval" and r.get("stage") == stage
        ]
        results = {r["mode"]: EvalResult(**{k: v for k, v in r.items() if k in fields}) for r in rows}
        return {stage: results} if results else {}

    def _spent_before(self) -> float:
        """Seconds of `max_seconds` the run had spent when its newest checkpoint was written (0 for a fresh
        run, or with `--extend`)."""
        if not self.resume or self.extend:
            return 0.0
        from miles.trainers.checkpoint import latest_checkpoint

        latest = latest_checkpoint(self.out / "checkpoints")
        if latest is None:
            return 0.0
        try:
            return float(json.loads((latest / "meta.json").read_text())["extra"].get("elapsed_s", 0.0))
        except (OSError, ValueError, KeyError, TypeError):
            return 0.0

    async def _within_the_wall(self, work: Any, t_start: float) -> bool:
        """Run `work` until it ends, until SIGINT or SIGTERM (a checkpoint, then the run reports it was
        stopped), or until `max_seconds` plus `health.grace_s` have passed since `t_start` (a stalled engine or
        env, an endless step: the run ends broken). Whether `work` finished."""
        cfg = self.cfg
        task = asyncio.ensure_future(work)
        stop = asyncio.Event()
        signals = _StopSignals(stop, self.summary)
        try:
            waiter = asyncio.ensure_future(stop.wait())
            wall = None if cfg.max_seconds is None else cfg.max_seconds + cfg.health.grace_s
            done, _ = await asyncio.wait(
                {task, waiter},
                return_when=asyncio.FIRST_COMPLETED,
                timeout=None if wall is None else max(wall - (time.perf_counter() - t_start), 0.0),
            )
            waiter.cancel()
            if task in done:
                task.result()
                return True
            for _ in range(
                ABORT_ROUNDS
            ):  # each cancel unwinds one `finally: await ...` that waits on a stuck peer
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=1.0)
                if done:
                    break
        finally:
            signals.restore()
        if task.done() and not task.cancelled() and task.exception() is not None:
            self.echo(f"[health] aborting raised {error_line(task.exception())}")
        if self.source.checkpoints_when_aborted:
            self._checkpoint()
        if self.summary.stopped:
            self.echo(f"[train] stopped by {self.summary.stopped} after step {self.summary.steps_done}")
            return False
        self.summary.broken = (
            f"the run was still working {cfg.health.grace_s:.0f} s after its max_seconds "
            f"({cfg.max_seconds:.0f} s), so its work in flight was aborted after step "
            f"{self.summary.steps_done} (a stalled engine or env?); continue with --resume"
        )
        self.echo(f"[health] {self.summary.broken}.")
        return False

    async def _teardown(self) -> None:
        """Close every part of the run, each within `TEARDOWN_S` (a wedged engine must not hold the exit)."""
        parts = [self.adapters.aclose] if self.adapters is not None else []
        parts += [self.source.aclose, self.eval_recorder.aclose, self.sync.close, self.engine_set.close]
        await close_within(parts, TEARDOWN_S)
        self._close_trainer()
        self.metrics.close()
        self.observability.close()

    async def _train(self, t_start: float) -> None:
        """Resume or warm-start, evaluate, the RL steps, the last checkpoint and the final evaluation."""
        cfg = self.cfg
        start_step = 0
        saved_at: float | None = None
        ckpt_root = self.out / "checkpoints"
        resumed = self.resume and any(ckpt_root.glob("step_*"))
        if self.resume and not resumed:  # killed before its first checkpoint: every step is redone
            saved_at = 0.0
            self._set_aside_after(saved_at, {})
            self.echo(
                f"[resume] no checkpoint in {ckpt_root}: starting at step 0 (the earlier sessions are "
                "moved to sessions.jsonl.dropped)"
            )
        if resumed:
            ckpt = self.trainer.load_checkpoint(ckpt_root)
            for reason in getattr(ckpt, "passed_over", []):
                self.echo(f"[resume] passed over a damaged checkpoint: {reason}")
            start_step = ckpt.step
            await self._sync(version=ckpt.extra.get("weight_version"))
            saved_at = float(ckpt.extra.get("time", float("inf")))
            self._set_aside_after(saved_at, ckpt.data_cursor)
            if self.adapters is not None:
                await self.adapters.restore(ckpt, start_step)
            self.summary.evals.update(self._recorded_evals("start"))  # the gain is measured from the start
            spent = time.perf_counter() - t_start
            self.echo(
                f"[resume] from {ckpt.path.name}: step {start_step}"
                + (
                    f"; {spent:.0f} s of max_seconds ({cfg.max_seconds:.0f} s) spent"
                    if cfg.max_seconds is not None and not self.extend
                    else ""
                )
            )
        elif cfg.sft.enabled:
            await self._sft(t_start)
        elif cfg.model.init_from or cfg.engine.kind != "embedded":
            await self._sync()
        if self.adapters is not None and start_step == 0:
            await self.adapters.start()
        if start_step == 0:
            await self._evaluate("start")
        await self.source.start(  # session ids stay unique across resumes
            self.version,
            self.trainer.hf_state_dict,
            run_id=f"train-r{start_step}" if start_step else "train",
            resume_time=saved_at,
        )
        t_rl = time.perf_counter()
        step, committed = start_step, False
        self.summary.steps_done = step
        while step < cfg.steps and not self.summary.broken:
            if (
                not committed
                and cfg.max_seconds is not None
                and time.perf_counter() - t_start > cfg.max_seconds
            ):
                self.echo(f"[train] time budget of {cfg.max_seconds:.0f} s reached after {step} steps")
                break
            committed = self.adapters is not None and self._runs_ahead(step, t_start)
            try:
                row, activity = await self._rl_step(step, ahead=committed)
            except NonFiniteWeightsError as exc:
                self.summary.broken = str(exc)
                self.echo(f"[health] {exc}. Stopping.")
                break
            step += 1
            self.summary.steps_done = step
            self.summary.seconds["rl"] = time.perf_counter() - t_rl
            self.echo(progress_line(step, cfg.steps, row))
            unrecorded = self.source.record_failures
            if unrecorded:
                self.summary.broken = (
                    f"{unrecorded} session record(s) could not be written to "
                    f"{self.out / 'sessions.jsonl'} (the log says why); the run stops so that "
                    "no session it trains on goes unrecorded"
                )
                self.echo(f"[health] {self.summary.broken}.")
                break
            verdict = self.health.observe(activity, row)
            if verdict is not None and verdict.stop:
                self.summary.broken = verdict.reason
                self.echo(f"[health] {verdict.reason}. Stopping.")
                break
            if verdict is not None:
                self.echo(f"[health] {verdict.reason}. Going on (health.on_no_signal: continue).")
            if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.steps:
                await self._evaluate(f"step{step}")
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                self._checkpoint()
        self.summary.seconds["rl"] = time.perf_counter() - t_rl
        await self.source.stop()  # running sessions are aborted and recorded; then the checkpoint
        self._checkpoint()
        if not self.summary.broken and (step > start_step or "start" not in self.summary.evals):
            await self._evaluate("final")
