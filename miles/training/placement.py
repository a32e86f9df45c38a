"""Where a run's roles run. Each role has one handle, used the same way whatever runs it:

- **the trainer**: the `Trainer` that `build_trainer` returns: the backend's trainer in this process, in a
  process of its own (`adapters:`, `LoraTrainerProcess`), or rank 0's `CollectiveTrainer`, which mirrors each
  collective call onto the other ranks (`run_worker`);
- **the trainer ranks**: each runs `miles.training.rank.run_rank`, in this process, as a torchrun worker
  (`miles.training.torchrun`) or as a Ray actor (`miles.training.cluster.ray_run`), started where the config
  says by `miles.training.command.run_placed`;
- **the rollout manager** of an asynchronous run: the `RolloutHandle` that `launch_rollout` returns, over a
  child process (`ChildLink`) or a Ray actor (`ActorLink`).

`RunPlacement` says in one line where a config puts each role; every run prints it as it starts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from miles.learner.collective import (
    DEFAULT_COMMAND_TIMEOUT_S,
    CollectiveTrainer,
    init_distributed,
    leave_process_group,
    open_channel,
    serve_trainer_commands,
    weights_fingerprint,
)
from miles.learner.errors import ConfigError
from miles.learner.protocol import Trainer
from miles.training.config import TrainConfig
from miles.training.rollout_process import ChildLink, RolloutHandle, RolloutLink, RolloutStart
from miles.training.torchrun import in_torchrun_worker
from miles.training.trainer_setup import (
    check_model_fits,
    check_trainer_setup,
    megatron_trainer_config,
    torch_trainer_config,
)

log = logging.getLogger(__name__)


def world_size_of(cfg: TrainConfig) -> int:
    """How many ranks the config asks for: ``tp * pp * dp``."""
    p = cfg.parallel
    return p.tp * p.pp * p.dp


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


@dataclass(frozen=True)
class RunPlacement:
    """Where each role of a run runs, as its config places it: the run prints it as it starts (`line`) and
    keeps it in ``summary.json``."""

    trainer: str
    ranks: str
    rollout: str
    engines: str

    @classmethod
    def of(cls, cfg: TrainConfig) -> RunPlacement:
        """The placement `cfg` asks for."""
        on_ray, p = cfg.cluster.kind == "ray", cfg.parallel
        world = world_size_of(cfg)
        trainer = cfg.backend + (f" (tp {p.tp}, pp {p.pp}, dp {p.dp})" if world > 1 else "")
        if cfg.adapters:
            trainer += f", {_count(len(cfg.adapters), 'LoRA adapter')} in a trainer process of their own"
        if on_ray:
            ranks = f"on {_count(world, 'Ray actor')}"
        else:
            ranks = "in this process" if world == 1 else f"on {_count(world, 'torchrun rank')}"
        loop_process = "the trainer's process" if world == 1 else "rank 0's process"
        if cfg.asynchronous.enabled:
            where = "a Ray actor" if on_ray else "a child process"
            rollout = f"{where} (async, max_staleness {cfg.asynchronous.max_staleness})"
        elif cfg.rollout.agent.enabled:
            rollout = f"the user's agents (a subprocess per session), through the endpoint in {loop_process}"
        else:
            rollout = f"{loop_process} (synchronous)"
        engine = cfg.engine
        if on_ray:
            engines = _count(len(engine.urls), "Ray engine actor")
        elif engine.kind == "embedded":
            engines = f"{_count(engine.num_engines, 'embedded engine')} on {engine.device}"
        elif engine.kind == "router":
            engines = f"sglang-router over {_count(len(engine.urls), 'server')}"
        else:
            engines = _count(len(engine.urls), "SGLang server")
        return cls(trainer=trainer, ranks=ranks, rollout=rollout, engines=engines)

    def line(self) -> str:
        """One line for the run's output."""
        return (
            f"[placement] trainer: {self.trainer} {self.ranks} · rollout: {self.rollout} · "
            f"engines: {self.engines}"
        )


def _local_trainer(cfg: TrainConfig, model: torch.nn.Module) -> Trainer:
    """This rank's trainer over `model` (the initial policy, unwrapped)."""
    if cfg.backend == "megatron":
        from miles.learner.megatron.model import UnsupportedModelError
        from miles.learner.megatron.trainer import MegatronTrainer

        check_model_fits(cfg, model.config)
        try:
            return MegatronTrainer(model, megatron_trainer_config(cfg), cfg.algorithm)
        except UnsupportedModelError as e:
            raise ConfigError(
                "model", f"the Megatron backend cannot build it: {e} (backend: torch trains any HF causal LM)"
            ) from e
    if cfg.adapters:  # LoRA adapters on the frozen base (peft), one optimizer each, in a process of their own
        from miles.learner.lora.process import LoraTrainerProcess

        return LoraTrainerProcess(cfg, model)
    from miles.learner.torch_backend import TorchTrainer

    return TorchTrainer(model, torch_trainer_config(cfg), cfg.algorithm)


def build_trainer(
    cfg: TrainConfig, model: torch.nn.Module, *, timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S
) -> Trainer:
    """The `Trainer` the train loop drives: the backend's trainer over `model` in a single process; on rank 0
    of a torchrun job, a `CollectiveTrainer` around it (the other ranks run `run_worker`).

    Call it before anything wraps or converts `model`; engines must have taken their copy already (FSDP2
    shards `model` in place).
    """
    check_trainer_setup(cfg)
    world = world_size_of(cfg)
    if not in_torchrun_worker():
        if world > 1:
            raise ConfigError(
                "parallel",
                f"tp*pp*dp = {world} ranks: run it with `miles train`, which launches "
                "them under torchrun (or set parallel sizes to 1)",
            )
        return _local_trainer(cfg, model)
    init_distributed()
    if dist.get_rank() != 0:
        raise RuntimeError("build_trainer is rank 0's; the other ranks call run_worker")
    fingerprint = weights_fingerprint(model)
    trainer = _local_trainer(cfg, model)
    return CollectiveTrainer(trainer, open_channel(fingerprint, world, timeout_s=timeout_s))


def run_worker(cfg: TrainConfig, *, timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S) -> int:
    """A worker rank of ``miles train``: build the same initial policy and trainer as rank 0 (same seed, same
    ``init_from``), then serve rank 0's commands until ``stop``; returns how many it served."""
    from miles.tito import load_tokenizer
    from miles.training.models import build_policy
    from miles.training.seeding import seed_everything

    init_distributed()
    seed_everything(cfg.seed)
    model = build_policy(cfg.model, load_tokenizer(cfg.model.tokenizer))
    fingerprint = weights_fingerprint(model)
    trainer = _local_trainer(cfg, model)
    channel = open_channel(fingerprint, world_size_of(cfg), timeout_s=timeout_s)
    del model  # the trainer holds what it needs
    done = serve_trainer_commands(trainer, channel)
    log.info("rank %d: served %d trainer commands", dist.get_rank(), done)
    leave_process_group()
    return done


def launch_rollout(cfg: TrainConfig, start: RolloutStart) -> RolloutHandle:
    """Start the rollout manager of an asynchronous run where the config places it: a Ray actor on a Ray
    cluster (`cluster.kind: ray`), else a child process; its callers get the same `RolloutHandle` either way."""
    link: RolloutLink
    if cfg.cluster.kind == "ray":
        from miles.training.cluster.rollout import ActorLink

        link = ActorLink.start(cfg, start)
    else:
        link = ChildLink.start(cfg, start)
    return RolloutHandle(link, timeout_s=cfg.asynchronous.manager_timeout_s)
