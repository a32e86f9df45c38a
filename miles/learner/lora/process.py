"""`LoraTrainerProcess`: the `MultiLoraTrainer` of a run with `adapters:`, in a process of its own.

A multi-adapter step overlaps one adapter's update with the other adapters' sessions. In one process the
update, the engines' decode thread and the sessions' event loop take turns on one interpreter lock, and the
tiny ops of a small model hold it most of the time; in a trainer process of its own the update runs on its own
core. Each method is the trainer's own (`miles.learner.lora.trainer.MultiLoraTrainer`), called through
`TrainerProcess`: same arguments, same results, same errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from miles.engines.lora import AdapterWeights
from miles.learner.checkpoint import Checkpoint
from miles.learner.lora.trainer import build_lora_trainer
from miles.learner.trainer_process import TrainerProcess
from miles.trajectory import TrajectoryBatch


class LoraTrainerProcess:
    """`build_lora_trainer(cfg, model)` in a new process; implements `miles.learner.protocol.Trainer` and the
    adapter methods the multi-adapter loop uses. `close()` ends the process."""

    def __init__(self, cfg: Any, model: nn.Module, *, threads: int | None = None) -> None:
        self.process = TrainerProcess(
            build_lora_trainer, cfg, model, threads=threads, name="miles-lora-trainer"
        )
        self.names: list[str] = self.process.get("names")

    @property
    def step(self) -> int:
        return self.process.get("step")

    @step.setter
    def step(self, value: int) -> None:
        self.process.set("step", value)

    @property
    def last_trained(self) -> tuple[str, ...]:
        return self.process.get("last_trained")

    def train_adapter(
        self, name: str, batch: TrajectoryBatch, *, threads: int | None = None
    ) -> dict[str, float]:
        """One RL update of adapter `name` on `batch`, with `threads` torch threads (None: as before)."""
        return self.process.call("train_adapter", name, batch, threads=threads)

    def end_step(self, trained: tuple[str, ...]) -> dict[str, float]:
        return self.process.call("end_step", trained)

    def adapter_weights(self, name: str) -> AdapterWeights:
        return self.process.call("adapter_weights", name)

    def train_step(self, batch: TrajectoryBatch) -> dict[str, float]:
        return self.process.call("train_step", batch)

    def sft_step(self, batch: TrajectoryBatch) -> dict[str, float]:
        return self.process.call("sft_step", batch)

    def begin_sft(self, lr: float, *, warmup_steps: int = 0) -> None:
        self.process.call("begin_sft", lr, warmup_steps=warmup_steps)

    def compute_logprobs(self, batch: TrajectoryBatch, *, temperature: float | None = None) -> torch.Tensor:
        return self.process.call("compute_logprobs", batch, temperature=temperature)

    def hf_state_dict(self, *, cpu: bool = False) -> dict[str, torch.Tensor]:
        """The frozen base's weights, always as CPU copies (`cpu` is accepted for the protocol): a tensor on a
        GPU cannot outlive the trainer process's reply."""
        return self.process.call("hf_state_dict", cpu=True)

    def save_checkpoint(
        self,
        root: str | Path,
        *,
        data_cursor: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        keep_last: int | None = None,
    ) -> Path | None:
        return self.process.call(
            "save_checkpoint", root, data_cursor=data_cursor, extra=extra, keep_last=keep_last
        )

    def load_checkpoint(self, path: str | Path) -> Checkpoint:
        return self.process.call("load_checkpoint", path)

    def save_pretrained(self, directory: str | Path) -> None:
        self.process.call("save_pretrained", directory)

    def close(self) -> None:
        self.process.close()
