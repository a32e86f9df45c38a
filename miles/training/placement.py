"""Where a run's roles run. Each role has one handle, used the same way whatever runs it:

- **the trainer**: the `Trainer` that `build_trainer` returns: the backend's trainer in this process, in a
  process of its own (`adapters:`, `LoraTrainerProcess`), or rank 0's `CollectiveTrainer`, which mirrors each
  collective call onto the other ranks (`run_worker`);
- **the trainer ranks**: each runs `miles.training.rank.run_rank`, in this process, as a torchrun worker
  (`miles.training.torchrun`) or as a Ray actor (`miles.training.cluster.ray_run`), started where the config
  says by `miles.training.command.run_placed`;
- **the rollout manager** of an asynchronous run: the `RolloutHandle` that `launch_rollout` returns, over a
  child process (`ChildLink`) or a Ray actor (`ActorLink`).
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

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
from miles.learner.config import MegatronTrainerConfig, TorchTrainerConfig, merge
from miles.learner.errors import ConfigError
from miles.learner.protocol import Trainer
from miles.training.config import TrainConfig
from miles.training.rollout_process import ChildLink, RolloutHandle, RolloutLink, RolloutStart
from miles.training.torchrun import in_torchrun_worker

log = logging.getLogger(__name__)


def world_size_of(cfg: TrainConfig) -> int:
    """How many ranks the config asks for: ``tp * pp * dp``."""
    p = cfg.parallel
    return p.tp * p.pp * p.dp


def torch_trainer_config(cfg: TrainConfig) -> TorchTrainerConfig:
    """``trainer:`` plus ``torch:`` as the torch backend's config."""
    return merge(TorchTrainerConfig, cfg.trainer, cfg.torch)


def megatron_trainer_config(cfg: TrainConfig) -> MegatronTrainerConfig:
    """``trainer:`` plus ``megatron:``, ``parallel.tp/pp`` and ``seed`` as the Megatron backend's config."""
    return merge(
        MegatronTrainerConfig,
        cfg.trainer,
        cfg.megatron,
        tp=cfg.parallel.tp,
        pp=cfg.parallel.pp,
        seed=cfg.seed,
    )


def check_trainer_setup(cfg: TrainConfig) -> None:
    """The trainer-side setup errors that need no model (before any rank is launched), as `ConfigError` s.

    The config itself (sizes, knobs set for the other backend) was checked when it was loaded; this checks the
    installation the backend needs and that the model's weights exist.
    """
    from miles.training.models import check_model_source

    check_model_source(cfg.model)
    if cfg.backend == "megatron":
        try:
            found = importlib.util.find_spec("megatron.core") is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise ConfigError(
                "backend",
                "the megatron backend needs megatron-core: pip install -e '.[megatron]' "
                "(or use backend: torch)",
            )
        if cfg.megatron.attention == "te":
            from miles.learner.megatron.model import te_available

            if not te_available():
                raise ConfigError(
                    "megatron.attention", "te needs Transformer Engine and a GPU; use sdpa or auto"
                )


def check_model_fits(cfg: TrainConfig, hf_config: Any) -> None:
    """The Megatron backend: the model's shape (an HF config) against ``parallel.tp/pp``, as a `ConfigError`
    naming the size to change, before megatron-core asserts on it."""
    p = cfg.parallel
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    if kv_heads % p.tp:
        raise ConfigError(
            "parallel.tp",
            f"the model's {kv_heads} key/value heads do not split over tp={p.tp}; "
            f"use a divisor of {kv_heads}",
        )
    layers = hf_config.num_hidden_layers
    if layers % p.pp:
        raise ConfigError(
            "parallel.pp",
            f"the model's {layers} layers do not split into pp={p.pp} stages; use a divisor of {layers}",
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


def cli_argv(args: Any) -> list[str]:
    """The ``miles train`` / ``miles sft`` command line that `args` (the CLI's namespace) was parsed from."""
    argv = [args.command, "--config", str(args.config)]
    for override in getattr(args, "overrides", None) or []:
        argv += ["--set", override]
    if getattr(args, "resume", False):
        argv.append("--resume")
    if getattr(args, "extend", False):
        argv.append("--extend")
    for flag in ("output_dir", "seed", "backend", "tp", "pp", "dp"):
        value = getattr(args, flag, None)
        if value is not None:
            argv += [f"--{flag.replace('_', '-')}", str(value)]
    return argv
