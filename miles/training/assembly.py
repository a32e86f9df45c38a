"""`assemble`: everything one `miles train` run is made of, built once in the order the parts need each other:
the env and its tasks, the TITO tokenizer, the policy, the engines (a copy of the policy before the trainer
wraps it), the trainer, weight sync, observability, the recorders, and the `PolicyRun` that the loop steps
(`OnePolicy` over the `RolloutSource` the config names, or `AdapterRun`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from miles.learner.lora.process import LoraTrainerProcess
from miles.learner.protocol import StateDict, Trainer
from miles.observability import Observability, run_labels, start_observability
from miles.sessions.metrics import SessionMetrics
from miles.sessions.recorder import Recorder
from miles.sessions.scheduler import GroupRunner
from miles.training.async_rollout import ProcessSource
from miles.training.cluster.sync import rejoining_weight_sync
from miles.training.config import TrainConfig
from miles.training.data import TaskCursor
from miles.training.engine_setup import EngineSet
from miles.training.evaluate import eval_sets
from miles.training.health import RunHealth
from miles.training.metrics_log import MetricsLog
from miles.training.models import build_policy, check_devices, check_tools_reach_model
from miles.training.policy_run import OnePolicy, Publisher
from miles.training.protocol import PolicyRun, RolloutSource
from miles.training.rollout_side import RolloutData, RolloutSide
from miles.training.seeding import seed_everything
from miles.training.sft import SftStage
from miles.training.sources import AgentEvaluation, EngineEvaluation, Evaluation, SessionSource, close_within
from miles.weight_sync import WeightPusher, build_weight_sync

#: Seconds each part of the run gets to close.
TEARDOWN_S = 5.0


@dataclass(frozen=True)
class RunParts:
    """A run's parts, as `assemble` built them; `aclose` closes them all, each within `TEARDOWN_S`."""

    model: torch.nn.Module
    engine_set: EngineSet
    trainer: Trainer
    sync: WeightPusher
    observability: Observability
    eval_recorder: Recorder
    health: RunHealth
    policy: PolicyRun

    async def aclose(self) -> None:
        parts = [self.policy.aclose, self.eval_recorder.aclose, self.sync.close, self.engine_set.close]
        await close_within(parts, TEARDOWN_S)
        close_trainer_process(self.trainer)
        self.observability.close()


def close_trainer_process(trainer: Trainer | None) -> None:
    """End the trainer's own process, where it has one (a run with `adapters:`)."""
    if isinstance(trainer, LoraTrainerProcess):
        trainer.close()


async def assemble(cfg: TrainConfig, *, metrics: MetricsLog, echo: Callable[[str], None]) -> RunParts:
    """Build the run of `cfg` (see the module doc); a setup mistake fails here, in one line, before the first
    step. What was built is closed again when a later part fails."""
    out = Path(cfg.output_dir)
    check_devices(cfg)
    seed_everything(cfg.seed)
    cfg.env.recipe.make(
        split=cfg.env.train_split
    ).close()  # imports the user's modules; fails early, in one line
    data = RolloutData.load(cfg)
    recipe, train_recipe, train_tasks, tito = data.recipe, data.train_recipe, data.train_tasks, data.tito
    held_out = eval_sets(recipe, cfg.env.eval_split, cfg.eval.num_tasks, cfg.eval.envs)
    await check_tools_reach_model(tito, train_recipe, train_tasks[0])  # before the model loads
    model = build_policy(cfg.model, tito.tokenizer)
    # Engines copy the policy before the trainer wraps it (FSDP, Megatron conversion).
    side = await RolloutSide.build(cfg, data, model)
    engine_set, engines, scheduler_cfg = side.engine_set, side.engine_set.rollout, side.scheduler_config
    trainer: Trainer | None = None
    try:
        from miles.training.placement import build_trainer

        trainer = build_trainer(cfg, model)
        make_sync = (
            build_weight_sync
            if cfg.cluster.kind == "local"  # on Ray, restarted engines rejoin
            else functools.partial(rejoining_weight_sync, wait_s=cfg.cluster.timeout_s)
        )
        pause = cfg.asynchronous.enabled and cfg.asynchronous.inflight == "pause"  # turns in flight go on
        sync = await make_sync(
            dataclasses.replace(cfg.sync, policy="pause") if pause else cfg.sync,
            engine_set.workers,
            staging_dir=out / "weights",
            drain_engines=engines,
        )
        labels = run_labels(
            cfg.observability, out, cfg.env.id, cfg.model.name, adapter="all" if cfg.adapters else "base"
        )  # adapters: step metrics span them all
        observability = start_observability(
            cfg.observability,
            labels,
            engines=engines,
            num_params=sum(p.numel() for p in model.parameters()),
            echo=echo,
        )
        eval_recorder = Recorder(out / "eval_sessions.jsonl")
        session_metrics = SessionMetrics(observability.labels)
        publisher = Publisher(trainer, sync, metrics, observability.run)
        policy: PolicyRun
        if cfg.adapters:  # LoRA adapters on one base: each its own env and scheduler, all on one router
            from miles.training.adapters import AdapterRun

            assert isinstance(trainer, LoraTrainerProcess)
            policy = AdapterRun.build(
                cfg,
                trainer=trainer,
                publisher=publisher,
                engines=engines,
                tokenizer=tito,
                scheduler_config=scheduler_cfg,
                recorder=Recorder(out / "sessions.jsonl"),
                eval_recorder=eval_recorder,
                observer=session_metrics,
                labels=observability.labels,
                run_metrics=observability.run,
                metrics_log=metrics,
                echo=echo,
            )
        else:
            engine_evaluation = EngineEvaluation(
                engines, tito, scheduler_cfg, eval_recorder, cfg.eval.max_new_tokens
            )
            source: RolloutSource[StateDict]
            if cfg.asynchronous.enabled:  # the rollout process runs (and records) the training sessions
                source = ProcessSource(
                    cfg,
                    http=engine_set.is_http,
                    push=publisher.push,
                    evaluation=engine_evaluation,
                    observer=session_metrics,
                )
            else:
                recorder = Recorder(out / "sessions.jsonl")
                runner: GroupRunner
                evaluation: Evaluation = engine_evaluation
                closing = []
                if cfg.rollout.agent.enabled:  # the user's own agent runs the sessions, through the endpoint
                    from miles.sessions.openai.agent import AgentRollout

                    agents = await AgentRollout.start(
                        engines,
                        tokenizer=tito,
                        config=cfg.rollout.agent,
                        context_length=scheduler_cfg.session.context_length,
                        log_dir=cfg.rollout.agent.log_dir or out / "agent_logs",
                    )
                    runner = agents.runner(
                        recipe=train_recipe,
                        group_size=scheduler_cfg.group_size,
                        seed=scheduler_cfg.seed,
                        recorder=recorder,
                        run_id="train",
                        observer=session_metrics,
                    )
                    evaluation = AgentEvaluation(agents, eval_recorder, cfg.eval.max_new_tokens)
                    closing.append(agents.aclose)
                else:
                    runner = side.training_scheduler(
                        recorder=recorder, run_id="train", observer=session_metrics
                    )
                source = SessionSource(
                    runner,
                    tasks=train_tasks,
                    cursor=TaskCursor(len(train_tasks), cfg.seed),
                    tasks_per_step=cfg.rollout.tasks_per_step,
                    oversample=scheduler_cfg.oversample_groups,
                    push=publisher.push,
                    evaluation=evaluation,
                    recorder=recorder,
                    closing=closing,
                    close_timeout=TEARDOWN_S,
                )
            sft = SftStage(
                cfg,
                trainer,
                tito,
                recipe,
                train_recipe,
                train_tasks,
                engines,
                scheduler_cfg,
                metrics,
                publisher.push,
                echo,
            )
            policy = OnePolicy(
                cfg,
                publisher=publisher,
                source=source,
                sft=sft,
                eval_sets=held_out,
                session_metrics=session_metrics,
                echo=echo,
            )
        return RunParts(
            model=model,
            engine_set=engine_set,
            trainer=trainer,
            sync=sync,
            observability=observability,
            eval_recorder=eval_recorder,
            health=RunHealth(cfg.health, warn=echo, sessions=out / "sessions.jsonl"),
            policy=policy,
        )
    except BaseException:
        await engine_set.close()
        close_trainer_process(trainer)
        raise
