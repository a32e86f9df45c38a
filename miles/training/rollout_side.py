"""The rollout side of a run, built the same way wherever it runs (the loop's own process, the asynchronous
loop's rollout process): the env and its training tasks, the TITO tokenizer, the engines with a copy of the
policy, the scheduler settings bounded by the engines' context, and the training scheduler over them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.envs import EnvRecipe, Task
from miles.sessions.config import SchedulerConfig
from miles.sessions.metrics import SessionObserver
from miles.sessions.recorder import Recorder
from miles.sessions.scheduler import SessionScheduler
from miles.tito import TITOTokenizer
from miles.training.config import TrainConfig
from miles.training.data import load_tasks
from miles.training.engine_setup import EngineSet, bounded_by_context, build_engine_set
from miles.training.models import build_tito


@dataclass(frozen=True)
class RolloutData:
    """What the rollout needs before any model loads: the env recipe (and its training split's), the training
    tasks, and the TITO tokenizer."""

    recipe: EnvRecipe
    train_recipe: EnvRecipe
    train_tasks: list[Task]
    tito: TITOTokenizer

    @classmethod
    def load(cls, cfg: TrainConfig) -> RolloutData:
        recipe = cfg.env.recipe
        return cls(
            recipe=recipe,
            train_recipe=recipe.with_kwargs(split=cfg.env.train_split),
            train_tasks=load_tasks(recipe, cfg.env.train_split, cfg.env.num_train_tasks),
            tito=build_tito(cfg.model),
        )


@dataclass(frozen=True)
class RolloutSide:
    """`data`, the engines (`engine_set`) and the scheduler settings bounded by their context."""

    data: RolloutData
    engine_set: EngineSet
    scheduler_config: SchedulerConfig

    @classmethod
    async def build(cls, cfg: TrainConfig, data: RolloutData, model: torch.nn.Module) -> RolloutSide:
        """The engines `cfg.engine` names, each with a copy of `model` (taken before a trainer wraps it)."""
        engine_set = await build_engine_set(cfg.engine, model, data.tito.tokenizer, cfg.model.tokenizer)
        return cls(data, engine_set, bounded_by_context(cfg.rollout.scheduler, engine_set.context_length))

    def training_scheduler(
        self, *, recorder: Recorder, run_id: str, observer: SessionObserver | None = None
    ) -> SessionScheduler:
        """The scheduler of the training sessions, over the rollout engines."""
        return SessionScheduler(
            self.engine_set.rollout,
            tokenizer=self.data.tito,
            config=self.scheduler_config,
            recorder=recorder,
            run_id=run_id,
            recipe=self.data.train_recipe,
            observer=observer,
        )
