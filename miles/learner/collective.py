"""Driving a multi-rank trainer (torch FSDP2 or Megatron) from one process: rank 0 runs the train loop, the
other ranks follow.

Under torchrun, rank 0 runs the whole `TrainLoop` (rollout, engines, scheduler, weight sync) as in a
single-process run; its trainer is a `CollectiveTrainer`, which broadcasts every collective call (a
`miles.learner.commands.TrainerCommand`) to the worker ranks over a gloo group before running it locally. The
workers run `serve_trainer_commands`: they receive the same commands and apply them to their own trainer until
rank 0 sends `STOP`, refusing any command outside `WORKER_COMMANDS`. With world size 1 there are no workers and
no wrapper.

Commands travel through ``broadcast_object_list``, so a `TrajectoryBatch` argument is pickled on rank 0 and
unpickled on every worker, whole: each trainer computes advantages over the full batch (a GRPO group may span
ranks) and then takes its own token-balanced share of the sequences. That is a few MB per RL step at most
(CPU tensors), small next to the step itself.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from miles.learner.checkpoint import Checkpoint
from miles.learner.commands import STOP, Allowed, CommandKind, CommandProtocolError, TrainerCommand, apply
from miles.learner.errors import ConfigError
from miles.learner.protocol import Trainer
from miles.ports import free_port
from miles.trajectory import TrajectoryBatch

# The `Trainer` methods that rank 0 mirrors onto the workers (every one is a collective on the trainer side).
COLLECTIVE_METHODS = (
    "train_step",
    "sft_step",
    "begin_sft",
    "compute_logprobs",
    "hf_state_dict",
    "save_checkpoint",
    "load_checkpoint",
    "save_pretrained",
)
# What a worker rank applies: those calls, and rank 0's writes of the step counter.
WORKER_COMMANDS: Allowed = {CommandKind.CALL: COLLECTIVE_METHODS, CommandKind.WRITE: ("step",)}
# Workers wait this long for the next command (rollout and evaluation on rank 0 happen in between).
DEFAULT_COMMAND_TIMEOUT_S = 4 * 3600.0


def init_distributed() -> None:
    """Join the process group torchrun set up (env://), or start a single-process one when there is none.

    NCCL with one GPU per local rank when CUDA is present, gloo otherwise.
    """
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


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


def weights_fingerprint(model: torch.nn.Module) -> tuple[int, float]:
    """A cheap summary of `model` 's weights (tensor count, summed magnitude) to compare across ranks."""
    with torch.no_grad():
        sd = model.state_dict()
        return len(sd), float(sum(v.double().abs().sum() for v in sd.values()))


def open_channel(
    fingerprint: tuple[int, float], expected_world: int, *, timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S
) -> CommandChannel:
    """Open the command channel (a collective) and check that the job has `expected_world` ranks, all of which
    started from the same initial weights (`fingerprint`, taken before any wrapping or conversion)."""
    world = dist.get_world_size()
    if world != expected_world:
        raise ConfigError("parallel", f"tp*pp*dp = {expected_world} but the job has {world} ranks")
    channel = CommandChannel(timeout_s=timeout_s)
    prints = channel.all_gather(fingerprint)
    if len(set(prints)) != 1:
        raise ConfigError(
            "model",
            f"the ranks built different initial weights {prints}; the model must be "
            "deterministic (model.seed) or loaded from a folder (model.init_from)",
        )
    return channel


class CollectiveTrainer:
    """Rank 0's `Trainer` for a multi-rank job: each call is first sent to the workers, then run locally.

    Other attributes are read from the wrapped trainer. Call `stop` once at the end (also after an error) to
    release the workers.
    """

    def __init__(self, trainer: Trainer, channel: CommandChannel) -> None:
        self.__dict__["trainer"] = trainer
        self.__dict__["channel"] = channel
        self.__dict__["stopped"] = False

    def _run(self, command: TrainerCommand) -> Any:
        """`command` sent to the workers, then applied here."""
        if self.stopped:
            raise RuntimeError(f"CollectiveTrainer.{command.name} after stop(): the workers are gone")
        self.channel.send(command)
        return apply(self.trainer, command)

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._run(TrainerCommand.call(name, *args, **kwargs))

    def train_step(self, batch: TrajectoryBatch) -> dict[str, float]:
        """`Trainer.train_step` on every rank."""
        return self._call("train_step", batch)

    def sft_step(self, batch: TrajectoryBatch) -> dict[str, float]:
        """`Trainer.sft_step` on every rank."""
        return self._call("sft_step", batch)

    def begin_sft(self, lr: float, *, warmup_steps: int = 0) -> None:
        """`Trainer.begin_sft` on every rank."""
        self._call("begin_sft", lr, warmup_steps=warmup_steps)

    def compute_logprobs(self, batch: TrajectoryBatch, *, temperature: float | None = None) -> torch.Tensor:
        """`Trainer.compute_logprobs` on every rank; rank 0 keeps the result."""
        return self._call("compute_logprobs", batch, temperature=temperature)

    def hf_state_dict(self, *, cpu: bool = False) -> dict[str, torch.Tensor]:
        """`Trainer.hf_state_dict` on every rank; rank 0 keeps the result."""
        return self._call("hf_state_dict", cpu=cpu)

    def save_checkpoint(
        self,
        root: str | Path,
        *,
        data_cursor: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        keep_last: int | None = None,
    ) -> Path | None:
        """`Trainer.save_checkpoint` on every rank (rank 0 writes)."""
        return self._call("save_checkpoint", root, data_cursor=data_cursor, extra=extra, keep_last=keep_last)

    def load_checkpoint(self, path: str | Path) -> Checkpoint:
        """`Trainer.load_checkpoint` on every rank (each reads the same files)."""
        return self._call("load_checkpoint", path)

    def save_pretrained(self, directory: str | Path) -> None:
        """`Trainer.save_pretrained` on every rank (rank 0 writes)."""
        self._call("save_pretrained", directory)

    @property
    def step(self) -> int:
        return self.trainer.step

    @step.setter
    def step(self, value: int) -> None:
        self._run(TrainerCommand.write("step", int(value)))

    def stop(self) -> None:
        """Tell the workers to return from `serve_trainer_commands` (idempotent)."""
        if not self.stopped:
            self.channel.send(STOP)
            self.__dict__["stopped"] = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["trainer"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "step":
            object.__setattr__(self, name, value)
            return
        raise AttributeError(f"CollectiveTrainer does not forward setting {name!r} to the workers")


def serve_trainer_commands(trainer: Trainer, channel: CommandChannel) -> int:
    """A worker rank: apply rank 0's commands to `trainer` until `STOP`; returns how many were applied.

    A command outside `WORKER_COMMANDS` raises `CommandProtocolError`.

    An exception in a command propagates (the process exits and torchrun ends the job) rather than leaving
    rank 0 waiting in a collective that this rank never joins.
    """
    done = 0
    while True:
        command = channel.receive()
        if command.kind is CommandKind.STOP:
            return done
        apply(trainer, command, WORKER_COMMANDS)
        done += 1


def leave_process_group() -> None:
    """Destroy this rank's process group at the end of a multi-rank run (no-op otherwise): a gloo group with
    peers left to the interpreter's exit can abort the process ("terminate called without an active
    exception"). A world of one stays: in-process callers may still use it."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.destroy_process_group()


def end_rank(status: int) -> NoReturn:
    """End a torchrun rank whose work is done and whose process group is gone, with `status`, skipping the
    interpreter's teardown: there, C++ destructors of c10d/gloo threads now and then abort a finished rank
    ("terminate called without an active exception", SIGABRT) after it printed its results."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def stop_workers(trainer: Any) -> None:
    """Release the workers if `trainer` is a `CollectiveTrainer` (no-op otherwise)."""
    if isinstance(trainer, CollectiveTrainer):
        trainer.stop()
