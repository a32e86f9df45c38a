"""The train loop, one straight line for every mode: assemble the run, resume or warm-start, evaluate, step the
`PolicyRun` until the steps, the budget or the run's health end it, checkpoint, evaluate again, close."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from miles.config import to_dict
from miles.envs.recipe import error_line
from miles.learner.checkpoint import elapsed_at_latest
from miles.learner.protocol import Trainer
from miles.training.assembly import RunParts, assemble
from miles.training.config import TrainConfig
from miles.training.health import Verdict, step_activity
from miles.training.metrics_log import MetricsLog
from miles.training.output_dir import OutputDirLock, check_fresh_output_dir
from miles.training.placement import RunPlacement
from miles.training.policy_run import NonFiniteWeightsError
from miles.training.resume import start_run
from miles.training.rl_step import progress_line, step_row
from miles.training.summary import RunSummary
from miles.training.wall import Budget, Ending, within_the_wall


class TrainLoop:
    """One `miles train` run. `await run()` does SFT (if enabled), evaluation, and the RL steps."""

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        resume: bool = False,
        extend: bool = False,
        echo: Callable[[str], None] = print,
    ) -> None:
        self.cfg, self.resume, self.echo = cfg, resume, echo
        self.extend = extend  # a resumed run gets a whole new max_seconds instead of what its budget has left
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
        self.summary.placement = RunPlacement.of(self.cfg)
        self.echo(self.summary.placement.line())
        self.parts = parts = await assemble(self.cfg, metrics=self.metrics, echo=self.echo)
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

    async def _train(self, parts: RunParts) -> None:
        """Resume or warm-start, evaluate, the RL steps, the last checkpoint and the final evaluation."""
        cfg, policy = self.cfg, parts.policy
        limited = cfg.max_seconds is not None and not self.extend
        start_step, saved_at, started = await start_run(
            parts,
            self.out,
            self.metrics,
            resume=self.resume,
            budget=self.budget,
            limited=limited,
            echo=self.echo,
        )
        if started:  # a resumed run measures its gain from the start
            self.summary.evals["start"] = started
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
            self._heed(parts.health.observe(activity, row, unrecorded=policy.record_failures))
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

    def _heed(self, verdict: Verdict | None) -> None:
        """The run's health after a step: a verdict that stops makes the run broken."""
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
