"""Driving a multi-rank Megatron job from one process: rank 0 runs the train loop, the other ranks follow.

Under torchrun, rank 0 runs the whole `TrainLoop` (rollout, engines, scheduler, weight sync) as in a
single-process run; its trainer is a `CollectiveTrainer`, which broadcasts every collective call
(method name and arguments) to the worker ranks over a gloo group before running it locally. The workers
run `serve_trainer_commands`: they receive the same calls and execute them on their own `MegatronTrainer`
until rank 0 sends ``stop``. With world size 1 there are no workers and no wrapper.

Commands travel through ``broadcast_object_list``, so a `TrajectoryBatch` argument is pickled on rank 0
and unpickled on every worker (CPU tensors; a few MB per RL step at most, small next to the step itself).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from miles.trainers.errors import ConfigError
from miles.trainers.megatron.trainer import MegatronTrainer, MegatronTrainerConfig
from miles.trainers.train_config import TrainConfig

log = logging.getLogger(__name__)

STOP = "stop"
SET_STEP = "set_step"
# The collective methods of `MegatronTrainer` that rank 0 mirrors onto the workers.
COLLECTIVE_METHODS = ("train_step", "sft_step", "compute_logprobs", "hf_state_dict", "save_checkpoint",
                      "load_checkpoint", "save_pretrained")
# Workers wait this long for the next command (rollout and evaluation on rank 0 happen in between).
DEFAULT_COMMAND_TIMEOUT_S = 4 * 3600.0


class CommandProtocolError(RuntimeError):
    """A worker received a command that is not one of `COLLECTIVE_METHODS`, ``set_step`` or ``stop``."""


@dataclass(frozen=True)
class TrainerCommand:
    """One call that rank 0 broadcasts: a method name with its arguments."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


class CommandChannel:
    """Broadcasts `TrainerCommand` s from rank 0 to every other rank over a dedicated gloo group.

    Creating one is a collective: every rank must construct it at the same point of the program.
    """

    def __init__(self, *, timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S) -> None:
        if not dist.is_initialized():
            raise RuntimeError("CommandChannel needs an initialized torch.distributed process group")
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def send(self, command: TrainerCommand) -> None:
        """Rank 0: hand `command` to every worker."""
        dist.broadcast_object_list([command], src=0, group=self.group)

    def receive(self) -> TrainerCommand:
        """A worker: wait for rank 0's next command."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        command = box[0]
        if not isinstance(command, TrainerCommand):
            raise CommandProtocolError(f"expected a TrainerCommand, got {type(command).__name__}")
        return command

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (picklable), on every rank."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out


class CollectiveTrainer:
    """Rank 0's view of a multi-rank `MegatronTrainer`: each collective call is first sent to the workers.

    It has the trainer's interface (`train_step`, `sft_step`, `compute_logprobs`, `hf_state_dict`,
    `save_checkpoint`, `load_checkpoint`, `save_pretrained`, a settable `step`); other attributes are read
    from the wrapped trainer. Call `stop` once at the end (also after an error) to release the workers.
    """

    def __init__(self, trainer: MegatronTrainer, channel: CommandChannel) -> None:
        self.__dict__["trainer"] = trainer
        self.__dict__["channel"] = channel
        self.__dict__["stopped"] = False

    def _send(self, name: str, *args: Any, **kwargs: Any) -> None:
        if self.stopped:
            raise RuntimeError(f"CollectiveTrainer.{name} after stop(): the workers are gone")
        self.channel.send(TrainerCommand(name, args, kwargs))

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self._send(name, *args, **kwargs)
        return getattr(self.trainer, name)(*args, **kwargs)

    def train_step(self, batch: Any) -> dict[str, float]:
        """`MegatronTrainer.train_step` on every rank."""
        return self._call("train_step", batch)

    def sft_step(self, batch: Any) -> dict[str, float]:
        """`MegatronTrainer.sft_step` on every rank."""
        return self._call("sft_step", batch)

    def compute_logprobs(self, batch: Any, **kwargs: Any) -> torch.Tensor:
        """`MegatronTrainer.compute_logprobs` on every rank."""
        return self._call("compute_logprobs", batch, **kwargs)

    def hf_state_dict(self, **kwargs: Any) -> dict[str, torch.Tensor]:
        """`MegatronTrainer.hf_state_dict` on every rank; rank 0 keeps the result."""
        return self._call("hf_state_dict", **kwargs)

    def save_checkpoint(self, root: Any, **kwargs: Any) -> Any:
        """`MegatronTrainer.save_checkpoint` on every rank (rank 0 writes)."""
        return self._call("save_checkpoint", root, **kwargs)

    def load_checkpoint(self, path: Any) -> Any:
        """`MegatronTrainer.load_checkpoint` on every rank (each reads the same files)."""
        return self._call("load_checkpoint", path)

    def save_pretrained(self, directory: Any) -> None:
        """`MegatronTrainer.save_pretrained` on every rank (rank 0 writes)."""
        self._call("save_pretrained", directory)

    @property
    def step(self) -> int:
        return self.trainer.step

    @step.setter
    def step(self, value: int) -> None:
        self._send(SET_STEP, int(value))
        self.trainer.step = int(value)

    def stop(self) -> None:
        """Tell the workers to return from `serve_trainer_commands` (idempotent)."""
        if not self.stopped:
            self.channel.send(TrainerCommand(STOP))
            self.__dict__["stopped"] = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["trainer"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "step":
            object.__setattr__(self, name, value)
            return
        raise AttributeError(f"CollectiveTrainer does not forward setting {name!r} to the workers")


def _set_step(trainer: MegatronTrainer, value: int) -> None:
    trainer.step = value


def serve_trainer_commands(trainer: MegatronTrainer, channel: CommandChannel) -> int:
    """A worker rank: execute rank 0's calls on `trainer` until ``stop``; returns how many were executed.

    An exception in a command propagates (the process exits and torchrun ends the job) rather than leaving
    rank 0 waiting in a collective that this rank never joins.
    """
    done = 0
    while True:
        command = channel.receive()
        if command.name == STOP:
            return done
        if command.name == SET_STEP:
            _set_step(trainer, *command.args)
        elif command.name in COLLECTIVE_METHODS:
            getattr(trainer, command.name)(*command.args, **command.kwargs)
        else:
            raise CommandProtocolError(f"unknown trainer command {command.name!r}")
        done += 1


# ------------------------------------------------------------------------------------------ construction


def megatron_trainer_config(cfg: TrainConfig) -> MegatronTrainerConfig:
    """`TrainConfig` (``trainer.*`` optimizer and batching settings, ``parallel.tp/pp``, ``seed``) as a
    `MegatronTrainerConfig`. ``trainer.packing`` and ``trainer.device`` are torch-backend settings (Megatron
    always packs, and runs on the rank's GPU when there is one)."""
    t = cfg.trainer
    if t.gradient_checkpointing:
        raise ConfigError("trainer.gradient_checkpointing", "not supported by the Megatron backend")
    return MegatronTrainerConfig(
        tp=cfg.parallel.tp, pp=cfg.parallel.pp, lr=t.lr, weight_decay=t.weight_decay, betas=tuple(t.betas),
        adam_eps=t.adam_eps, max_grad_norm=t.max_grad_norm, lr_schedule=t.lr_schedule,
        warmup_steps=t.warmup_steps, total_steps=t.total_steps, min_lr_ratio=t.min_lr_ratio,
        micro_batch_tokens=t.micro_batch_tokens, temperature=t.temperature, precision=t.precision,
        compute_entropy=t.compute_entropy, seed=cfg.seed)


def world_size_of(cfg: TrainConfig) -> int:
    """How many ranks the config asks for: ``tp * pp * dp``."""
    p = cfg.parallel
    for key in ("tp", "pp", "dp"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallel.{key}", f"must be >= 1, got {getattr(p, key)}")
    return p.tp * p.pp * p.dp


def _weights_fingerprint(model: torch.nn.Module) -> tuple[int, float]:
    with torch.no_grad():
        sd = model.state_dict()
        return len(sd), float(sum(v.double().abs().sum() for v in sd.values()))


def _connect(trainer: MegatronTrainer, model: torch.nn.Module, cfg: TrainConfig,
             timeout_s: float) -> CommandChannel:
    """Open the command channel and check that every rank started from the same weights (collective)."""
    world = dist.get_world_size()
    if world != world_size_of(cfg):
        raise ConfigError("parallel", f"tp*pp*dp = {world_size_of(cfg)} but the job has {world} ranks")
    channel = CommandChannel(timeout_s=timeout_s)
    prints = channel.all_gather(_weights_fingerprint(model))
    if len(set(prints)) != 1:
        raise ConfigError("model", f"the ranks built different initial weights {prints}; the model must be "
                                   "deterministic (model.seed) or loaded from a folder (model.init_from)")
    return channel


def build_megatron_trainer(model: torch.nn.Module, cfg: TrainConfig, *,
                           timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S) -> MegatronTrainer | CollectiveTrainer:
    """The trainer the train loop drives for ``backend: megatron``.

    World size 1: a `MegatronTrainer`. Rank 0 of a torchrun job: a `CollectiveTrainer` around it (the workers
    run `run_worker`, which builds the same trainer and serves its commands).
    """
    trainer = MegatronTrainer(model, megatron_trainer_config(cfg), cfg.algorithm)
    if trainer.info.world_size == 1:
        return trainer
    if trainer.info.rank != 0:
        raise RuntimeError("build_megatron_trainer is rank 0's; the other ranks call run_worker")
    return CollectiveTrainer(trainer, _connect(trainer, model, cfg, timeout_s))


def run_worker(cfg: TrainConfig, *, timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S) -> int:
    """A worker rank of ``miles train --backend megatron``: build the same initial policy and trainer as
    rank 0 (same seed, same ``init_from``), then serve rank 0's commands until ``stop``."""
    from miles.tito import load_tokenizer
    from miles.trainers.loop import seed_everything
    from miles.trainers.models import build_policy

    seed_everything(cfg.seed)
    model = build_policy(cfg.model, load_tokenizer(cfg.model.tokenizer))
    trainer = MegatronTrainer(model, megatron_trainer_config(cfg), cfg.algorithm)
    channel = _connect(trainer, model, cfg, timeout_s)
    del model  # the trainer holds its own (converted) copy
    done = serve_trainer_commands(trainer, channel)
    log.info("rank %d: served %d trainer commands", trainer.info.rank, done)
    return done


def stop_workers(trainer: Any) -> None:
    """Release the workers if `trainer` is a `CollectiveTrainer` (no-op otherwise)."""
    if isinstance(trainer, CollectiveTrainer):
        trainer.stop()


def cli_argv(args: Any) -> list[str]:
    """The ``miles train`` / ``miles sft`` command line that `args` (the CLI's namespace) was parsed from."""
    argv = [args.command, "--config", str(args.config)]
    for override in getattr(args, "overrides", None) or []:
        argv += ["--set", override]
    if getattr(args, "resume", False):
        argv.append("--resume")
    for flag in ("output_dir", "seed", "backend", "tp", "pp", "dp"):
        value = getattr(args, flag, None)
        if value is not None:
            argv += [f"--{flag.replace('_', '-')}", str(value)]
    return argv


def dispatch_ranks(cfg: TrainConfig, argv: list[str]) -> int | None:
    """Where a ``backend: megatron`` command runs. Returns None when this process should run the train loop
    (a single process, or rank 0 under torchrun), else its exit status: the launcher re-runs ``argv`` under
    torchrun with ``tp * pp * dp`` ranks and returns torchrun's status; a worker rank serves rank 0's
    trainer commands and returns 0."""
    from miles.trainers.megatron.launch import in_torchrun_worker, relaunch_under_torchrun

    world = world_size_of(cfg)
    if world == 1 and not in_torchrun_worker():
        return None
    status = relaunch_under_torchrun(world, argv)
    if status is not None:
        return status
    if int(os.environ.get("RANK", "0")) == 0:
        return None
    run_worker(cfg)
    return 0
