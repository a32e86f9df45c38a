"""`Trainer`, the learner's contract: a policy trained on `TrajectoryBatch` es.

`TorchTrainer`, `MegatronTrainer`, `MultiLoraTrainer` (through `LoraTrainerProcess`) and `CollectiveTrainer`
(rank 0's handle on a multi-rank job) implement it. Every argument and result is picklable (tensors on the
CPU, paths, plain dicts), so a process boundary can sit between the caller and the trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from miles.learner.checkpoint import Checkpoint
from miles.trajectory import TrajectoryBatch

#: A model's weights under their Hugging Face names.
StateDict = dict[str, torch.Tensor]
#: The trainer's weights, made when asked (a consistent CPU snapshot).
Weights = Callable[[], StateDict]


@runtime_checkable
class Trainer(Protocol):
    """A policy being trained on `TrajectoryBatch` es.

    ``step`` counts optimizer steps; the loop may set it (to 0 after SFT, to the checkpoint's on resume).
    """

    step: int

    def train_step(self, batch: TrajectoryBatch) -> dict[str, float]:
        """One RL update on `batch` (advantages, policy loss, ``num_mini_batches * ppo_epochs`` optimizer
        steps); returns the step's metrics. The first call after `begin_sft` starts a fresh optimizer at the
        configured lr (and, with a KL penalty, takes the current policy as the reference)."""
        ...

    def sft_step(self, batch: TrajectoryBatch) -> dict[str, float]:
        """One supervised step: token-mean cross-entropy on the loss-masked tokens; returns its metrics
        (``loss``, ``lr``, ``grad_norm``, ...)."""
        ...

    def begin_sft(self, lr: float, *, warmup_steps: int = 0) -> None:
        """Give the following `sft_step` s their own fresh optimizer at a constant `lr` after `warmup_steps`
        of linear warmup. RL state is untouched: the next `train_step` starts from a fresh optimizer."""
        ...

    def compute_logprobs(self, batch: TrajectoryBatch, *, temperature: float | None = None) -> torch.Tensor:
        """Logprobs ``[T]`` (CPU, float32) of every token of `batch` under the current policy, 0 at sequence
        starts; `temperature` None takes the batch's rollout temperature."""
        ...

    def hf_state_dict(self, *, cpu: bool = False) -> dict[str, torch.Tensor]:
        """The policy's weights under their Hugging Face names: a consistent snapshot. Every tensor is a
        copy taken between optimizer steps, never a view of a live parameter, so training may go on while
        the result is sent to the engines."""
        ...

    def save_checkpoint(
        self,
        root: str | Path,
        *,
        data_cursor: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        keep_last: int | None = None,
    ) -> Path | None:
        """Save weights, optimizer, step, RNG and `data_cursor` under `root`; returns the checkpoint's path
        (None on ranks that do not write)."""
        ...

    def load_checkpoint(self, path: str | Path) -> Checkpoint:
        """Restore what `save_checkpoint` wrote (`path`: a checkpoint or its root) and return it."""
        ...

    def save_pretrained(self, directory: str | Path) -> None:
        """Write the policy as an ordinary HF checkpoint folder (``from_pretrained``-loadable)."""
        ...
