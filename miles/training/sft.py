"""The SFT warm start of a run (`sft.enabled`, or `miles sft`): the policy trains on the env's oracle
demonstrations until the epochs, the validation target or the budget end, and the engines then get the weights
however it ended."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from miles.engine import RolloutEngine
from miles.envs import EnvRecipe, Task
from miles.learner.protocol import Trainer
from miles.sessions.config import SchedulerConfig
from miles.training.config import TrainConfig
from miles.training.data import load_tasks
from miles.training.demos import oracle_demos
from miles.training.evaluate import evaluate
from miles.training.metrics_log import MetricsLog
from miles.trajectory import TrajectoryBatch


@dataclass(frozen=True)
class SftStage:
    """What SFT needs of the run: its trainer, tokenizer, env and tasks, engines (for validation), the
    metrics log, `sync()` (the trainer's weights to the engines) and `echo` (the console)."""

    cfg: TrainConfig
    trainer: Trainer
    tito: Any
    recipe: EnvRecipe
    train_recipe: EnvRecipe
    train_tasks: Sequence[Task]
    engines: Sequence[RolloutEngine]
    scheduler: SchedulerConfig
    metrics: MetricsLog
    sync: Callable[[], Awaitable[None]]
    echo: Callable[[str], None]

    async def run(self, budget_s: float) -> float:
        """Train on oracle demonstrations (with its own optimizer at `sft.lr`, constant after
        `sft.warmup_steps` of warmup) within `sft.max_seconds` and `budget_s`; sync the weights (and save them
        to `sft.save_to`). The first RL step then starts from fresh optimizer state at `trainer.lr`. Returns the
        seconds it took."""
        cfg, sft = self.cfg, self.cfg.sft
        t0 = time.perf_counter()
        budget = min(budget_s, math.inf if sft.max_seconds is None else sft.max_seconds)
        self.echo(f"[sft] building {sft.num_demos} oracle demonstrations ...")
        demos = await oracle_demos(self.train_recipe.make, list(self.train_tasks[: sft.num_demos]), self.tito)
        total = sft.epochs * -(-len(demos) // sft.batch_size)
        self.echo(
            f"[sft] {len(demos)} demonstrations in {time.perf_counter() - t0:.1f} s; {total} steps of "
            f"{sft.batch_size}" + (f" within {budget:.0f} s" if math.isfinite(budget) else "")
        )
        rng = random.Random(cfg.seed)
        steps, reason, t_train, last_echo = 0, "all epochs", time.perf_counter(), 0.0
        self.trainer.begin_sft(sft.lr, warmup_steps=sft.warmup_steps)
        # Validation for the early stop: distinct training prompts, never the held-out split.
        target = sft.target_success
        val_tasks = (
            load_tasks(self.recipe, cfg.env.train_split, sft.check_tasks, distinct=True) if target else []
        )
        for epoch in range(sft.epochs):
            order = list(range(len(demos)))
            rng.shuffle(order)
            for i in range(0, len(order), sft.batch_size):
                batch = TrajectoryBatch.from_trajectories([demos[j] for j in order[i : i + sft.batch_size]])
                m = self.trainer.sft_step(batch)
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
                if now - t0 > budget:
                    reason = f"its budget of {budget:.0f} s"
                    break
                if target and steps >= sft.min_steps and steps % sft.check_every == 0:
                    success = await self._validate(val_tasks, steps, m["loss"])
                    if success >= target:
                        reason = f"validation success {success:.1%} >= {target:.1%}"
                        break
            else:
                continue
            break
        self.trainer.step = 0
        await self.sync()
        if sft.save_to:
            self.trainer.save_pretrained(sft.save_to)
            self.tito.tokenizer.save_pretrained(sft.save_to)
        seconds = time.perf_counter() - t0
        self.echo(
            f"[sft] {len(demos)} oracle demos, {steps} steps in {seconds:.1f} s (ended by "
            f"{reason})" + (f"; saved to {sft.save_to}" if sft.save_to else "")
        )
        return seconds

    async def _validate(self, tasks: list[Task], steps: int, loss: float) -> float:
        """Greedy success on `tasks` under the weights after `steps` steps (synced first)."""
        await self.sync()
        val = await evaluate(
            self.engines,
            tokenizer=self.tito,
            recipe=self.train_recipe,
            run_id=f"sft-val-{steps}",
            tasks=tasks,
            scheduler=self.scheduler,
            greedy=True,
        )
        self.metrics.write("sft_val", steps, success_rate=val.success_rate)
        self.echo(f"[sft] step {steps}: loss {loss:.3f}, validation success {val.success_rate:.1%}")
        return val.success_rate
