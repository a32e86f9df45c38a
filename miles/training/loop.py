"""The train loop, one straight line for every mode: assemble the run, resume or warm-start, evaluate, step the
`PolicyRun` until the steps, the budget or the run's health end it, checkpoint, evaluate again, close."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from miles.config import to_dict
from miles.envs.recipe import error_line
from miles.learner.checkpoint import elapsed_at_latest
from miles.learner.protocol import Trainer
from miles.training.assembly import RunParts, SpawnRollout, assemble
from miles.training.config import TrainConfig
from miles.training.evaluate import EvalResult, recorded_evals
from miles.training.health import StepActivity, step_activity
from miles.training.metrics_log import MetricsLog
from miles.training.output_dir import OutputDirLock, check_fresh_output_dir
from miles.training.policy_run import NonFiniteWeightsError
from miles.training.rl_step import progress_line, step_row
from miles.training.rollout_process import RolloutProcess
from miles.training.wall import Budget, Ending, within_the_wall


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


class TrainLoop:
    """One `miles train` run. `await run()` does SFT (if enabled), evaluation, and the RL steps."""

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        resume: bool = False,
        extend: bool = False,
        echo: Callable[[str], None] = print,
        rollout_process: SpawnRollout = RolloutProcess.spawn,
    ) -> None:
        self.cfg, self.resume, self.echo = cfg, resume, echo
        self.extend = extend  # a resumed run gets a whole new max_seconds instead of what its budget has left
        self.spawn_rollout = rollout_process
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
        self.budget = Budget(cfg.max_seconds, time.perf_counter())
        self.parts: RunParts | None = None  # set by `run`

    @property
    def trainer(self) -> Trainer | None:
        return self.parts.trainer if self.parts else None

    async def run(self) -> RunSummary:
        """Train (resuming if asked), evaluate, write the summary and curves; the output folder is released."""
        try:
            return await self._run()
        finally:
            self.lock.release()

    async def _run(self) -> RunSummary:
        t_start, lingered = time.perf_counter(), 0.0
        self.parts = parts = await assemble(
            self.cfg, metrics=self.metrics, echo=self.echo, spawn_rollout=self.spawn_rollout
        )
        spent = elapsed_at_latest(self.out / "checkpoints") if self.resume and not self.extend else 0.0
        self.budget = Budget(self.cfg.max_seconds, t_start - spent)
        try:
            outcome = await within_the_wall(self._train(parts), self.budget.left() + self.cfg.health.grace_s)
            if outcome.ending is Ending.FINISHED:
                lingered = await parts.observability.linger(self.echo)
            else:
                self._aborted(parts, outcome.ending, outcome.signal, outcome.error)
        finally:
            await parts.aclose()
            self.metrics.close()
        self.summary.seconds["total"] = time.perf_counter() - t_start - lingered
        (self.out / "summary.json").write_text(json.dumps(self.summary.to_dict(), indent=1))
        from miles.training.plot import plot_run

        plot_run(self.out / "metrics.jsonl", self.out / "curves.png")
        return self.summary

    def _aborted(self, parts: RunParts, ending: Ending, signal: str, error: BaseException | None) -> None:
        """A signal stopped the work (checkpoint, no score), or it ran past its wall (the run is broken)."""
        if error:
            self.echo(f"[health] aborting raised {error_line(error)}")
        if parts.policy.checkpoints_when_aborted:
            self._checkpoint(parts)
        if ending is Ending.STOPPED:
            self.summary.stopped = signal
            self.echo(f"[train] stopped by {signal} after step {self.summary.steps_done}")
            return
        self.summary.broken = (
            f"the run was still working {self.cfg.health.grace_s:.0f} s after its max_seconds "
            f"({self.cfg.max_seconds:.0f} s), so its work in flight was aborted after step "
            f"{self.summary.steps_done} (a stalled engine or env?); continue with --resume"
        )
        self.echo(f"[health] {self.summary.broken}.")

    async def _start(self, parts: RunParts) -> tuple[int, float | None]:
        """Resume from the newest checkpoint, or warm-start a fresh run; the step to start at, and for a resumed
        run the time after which recorded work is redone."""
        root = self.out / "checkpoints"
        if not self.resume:
            await parts.policy.warm_start(self.budget.left())
            return 0, None
        if not any(root.glob("step_*")):  # killed before its first checkpoint: every step is redone
            self._set_aside_after(parts, 0.0)
            await parts.policy.restore(None, saved_at=0.0)
            self.echo(
                f"[resume] no checkpoint in {root}: starting at step 0 (the earlier sessions are moved to "
                "sessions.jsonl.dropped)"
            )
            await parts.policy.warm_start(self.budget.left())
            return 0, 0.0
        ckpt = parts.trainer.load_checkpoint(root)
        for reason in ckpt.passed_over:
            self.echo(f"[resume] passed over a damaged checkpoint: {reason}")
        saved_at = float(ckpt.extra.get("time", float("inf")))
        self._set_aside_after(parts, saved_at)
        await parts.policy.restore(ckpt, saved_at=saved_at)
        started = recorded_evals(self.out / "metrics.jsonl", "start")
        self.summary.evals.update(
            {"start": started} if started else {}
        )  # the gain is measured from the start
        limited = self.cfg.max_seconds is not None and not self.extend
        self.echo(
            f"[resume] from {ckpt.path.name}: step {ckpt.step}"
            + (
                f"; {self.budget.spent():.0f} s of max_seconds ({self.budget.limit:.0f} s) spent"
                if limited
                else ""
            )
        )
        return ckpt.step, saved_at

    def _set_aside_after(self, parts: RunParts, saved_at: float) -> None:
        """Forget the metric rows and held-out sessions written after `saved_at`: a resumed run redoes them."""
        self.metrics.drop_after(saved_at)
        parts.eval_recorder.drop_after(saved_at)

    async def _train(self, parts: RunParts) -> None:
        """Resume or warm-start, evaluate, the RL steps, the last checkpoint and the final evaluation."""
        cfg, policy = self.cfg, parts.policy
        start_step, saved_at = await self._start(parts)
        if start_step == 0:
            await self._evaluate(parts, "start")
        await policy.start(  # session ids stay unique across resumes
            run_id=f"train-r{start_step}" if start_step else "train",
            resume_time=saved_at,
        )
        t_rl = time.perf_counter()
        step, committed = start_step, False
        self.summary.steps_done = step
        while step < cfg.steps and not self.summary.broken:
            if not committed and self.budget.over():
                self.echo(f"[train] time budget of {self.budget.limit:.0f} s reached after {step} steps")
                break
            committed = policy.runs_ahead and self._runs_ahead(step)
            t0 = time.perf_counter()
            try:
                done = await policy.step(ahead=committed)
            except NonFiniteWeightsError as exc:
                self.summary.broken = str(exc)
                self.echo(f"[health] {exc}. Stopping.")
                break
            activity = step_activity(done.records)
            row = step_row(
                done, activity, on_timeout=cfg.rollout.on_timeout, seconds=time.perf_counter() - t0
            )
            policy.observe(done.records, row)
            self.metrics.write("train", step, **row)
            parts.observability.run.observe_step(row)
            step += 1
            self.summary.steps_done = step
            self.summary.seconds["rl"] = time.perf_counter() - t_rl
            self.echo(progress_line(step, cfg.steps, row))
            self._check_health(parts, activity, row)
            if self.summary.broken:
                break
            if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.steps:
                await self._evaluate(parts, f"step{step}")
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                self._checkpoint(parts)
        self.summary.seconds["rl"] = time.perf_counter() - t_rl
        await policy.stop()  # running sessions are aborted and recorded; then the checkpoint
        self._checkpoint(parts)
        if not self.summary.broken and (step > start_step or "start" not in self.summary.evals):
            await self._evaluate(parts, "final")

    def _runs_ahead(self, step: int) -> bool:
        """Whether step `step + 1` may be committed during step `step`: it is a step of this run, no evaluation
        or checkpoint comes before it, and the time budget is not spent. A committed step runs even if the
        budget runs out meanwhile."""
        cfg, nxt = self.cfg, step + 1
        return (
            nxt < cfg.steps
            and not (cfg.eval.every and nxt % cfg.eval.every == 0)
            and not (cfg.checkpoint.every and nxt % cfg.checkpoint.every == 0)
            and not self.budget.over()
        )

    def _check_health(self, parts: RunParts, activity: StepActivity, row: dict[str, Any]) -> None:
        """Mark the run broken when a session record went unwritten or the health rules say stop."""
        unrecorded = parts.policy.record_failures
        if unrecorded:
            self.summary.broken = (
                f"{unrecorded} session record(s) could not be written to {self.out / 'sessions.jsonl'} (the log "
                "says why); the run stops so that no session it trains on goes unrecorded"
            )
            self.echo(f"[health] {self.summary.broken}.")
            return
        verdict = parts.health.observe(activity, row)
        if verdict is None:
            return
        if verdict.stop:
            self.summary.broken = verdict.reason
            self.echo(f"[health] {verdict.reason}. Stopping.")
        else:
            self.echo(f"[health] {verdict.reason}. Going on (health.on_no_signal: continue).")

    async def _evaluate(self, parts: RunParts, stage: str) -> None:
        """Every held-out set under the newest weights; an invalid result makes the run broken."""
        self.summary.evals[stage] = results = await parts.policy.evaluate(stage)
        for key, res in results.items():
            if res.invalid and not self.summary.broken:
                self.summary.broken = f"the {stage} evaluation ({key}) is no score: {res.invalid}"

    def _checkpoint(self, parts: RunParts) -> None:
        if not parts.policy.weights_ok:
            return
        parts.trainer.save_checkpoint(
            self.out / "checkpoints",
            data_cursor=parts.policy.data_cursor(),
            extra={
                "weight_version": parts.policy.version,
                "time": time.time(),
                "elapsed_s": self.budget.spent(),
            },
            keep_last=self.cfg.checkpoint.keep,
        )
