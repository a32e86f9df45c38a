"""The trainers' settings: the algorithm, the settings both backends share, and each backend's own knobs.

In a `miles train` YAML the shared settings are the ``trainer:`` section (`TrainerConfig`), the backend knobs
the ``torch:`` (`TorchOptions`) and ``megatron:`` (`MegatronOptions`) sections. Each backend's constructor takes
the union of the shared settings and its own knobs: `TorchTrainerConfig` / `MegatronTrainerConfig`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from miles.learner.advantages import AdvantageConfig
from miles.learner.errors import ConfigError
from miles.learner.losses import LossConfig

Schedule = Literal["constant", "cosine", "linear"]
Precision = Literal["auto", "bf16", "fp32"]
Packing = Literal["auto", "varlen", "packed", "padded"]
AttentionBackend = Literal["auto", "sdpa", "local", "te"]
Recompute = Literal["none", "selective", "full"]


@dataclass(frozen=True)
class AlgorithmConfig:
    """Advantage estimator plus policy loss, and how many optimizer steps one batch gives.

    With ``loss.kl_coef > 0`` the trainer keeps a frozen reference policy: the initial weights it was built
    from, or the policy as SFT left it when supervised steps ran first (see `Trainer.begin_sft`).
    """

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    num_mini_batches: int = 1
    ppo_epochs: int = 1

    def __post_init__(self) -> None:
        if self.num_mini_batches < 1:
            raise ConfigError("num_mini_batches", f"must be >= 1, got {self.num_mini_batches}")
        if self.ppo_epochs < 1:
            raise ConfigError("ppo_epochs", f"must be >= 1, got {self.ppo_epochs}")

    @property
    def needs_reference(self) -> bool:
        return self.loss.kl_coef > 0


@dataclass(frozen=True)
class TrainerConfig:
    """Optimizer, LR schedule, batching and precision: the settings both backends share (YAML ``trainer:``).

    AdamW with decoupled weight decay on every parameter and global-norm clipping. ``total_steps`` is needed by
    the ``cosine`` and ``linear`` schedules (decay to ``min_lr_ratio * lr`` after ``warmup_steps``).
    ``micro_batch_tokens`` caps the tokens of one forward pass. ``temperature=None`` takes the rollout
    temperature from the batch's ``meta[i]["sampling_params"]`` (1.0 when absent); logprobs are always
    recomputed as ``log_softmax(logits / T)``. ``precision`` ``auto`` is bf16 on a GPU, fp32 on a CPU.
    ``sampling_mask`` (sampling-mask replay): for tokens sampled under top-k/top-p whose engine recorded the
    kept set (`miles.trajectory.Trajectory.kept_counts`), the softmax is renormalised over that set, the
    distribution actually sampled from; ``false`` takes every logprob over the whole vocabulary.
    """

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    lr_schedule: Schedule = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.0
    micro_batch_tokens: int = 4096
    temperature: float | None = None
    precision: Precision = "auto"
    compute_entropy: bool = True
    sampling_mask: bool = True

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ConfigError("lr", f"must be > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError("betas", f"must be two numbers in [0, 1), got {self.betas}")
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        if self.lr_schedule not in ("constant", "cosine", "linear"):
            raise ConfigError("lr_schedule", f"must be constant|cosine|linear, got {self.lr_schedule!r}")
        if self.lr_schedule != "constant" and not (self.total_steps and self.total_steps > 0):
            raise ConfigError("total_steps", f"the {self.lr_schedule} schedule needs total_steps > 0")
        if self.warmup_steps < 0:
            raise ConfigError("warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        if self.micro_batch_tokens < 1:
            raise ConfigError("micro_batch_tokens", f"must be >= 1, got {self.micro_batch_tokens}")
        if self.temperature is not None and not self.temperature > 0:
            raise ConfigError("temperature", f"must be > 0, got {self.temperature}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ConfigError("precision", f"must be auto|bf16|fp32, got {self.precision!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError("max_grad_norm", f"must be > 0 or null, got {self.max_grad_norm}")

    def for_sft(self, lr: float, *, warmup_steps: int = 0) -> TrainerConfig:
        """The same settings with a constant schedule at `lr` after `warmup_steps` (SFT's own optimizer)."""
        return dataclasses.replace(
            self, lr=lr, lr_schedule="constant", total_steps=None, warmup_steps=warmup_steps
        )


@dataclass(frozen=True)
class TorchOptions:
    """The torch backend's own knobs (YAML ``torch:``).

    ``packing``: ``auto`` (padded), ``padded`` (right-padded micro-batches), ``packed`` (one row, position ids
    restart per sequence) or ``varlen`` (one row, per-sequence causal SDPA). ``gradient_checkpointing`` turns
    on the HF model's activation checkpointing. ``device``: ``auto`` (the rank's GPU, else CPU) or a torch
    device name.
    """

    packing: Packing = "auto"
    gradient_checkpointing: bool = False
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.packing not in ("auto", "varlen", "packed", "padded"):
            raise ConfigError("packing", f"must be auto|varlen|packed|padded, got {self.packing!r}")


@dataclass(frozen=True)
class MegatronOptions:
    """The Megatron backend's own knobs (YAML ``megatron:``); tensor/pipeline sizes are ``parallel.tp/pp``.

    - ``attention``: ``auto`` (Transformer Engine when present, else SDPA), ``sdpa``, ``te``, or ``local``
      (megatron's own unfused attention; no packing: one sequence per micro-batch).
    - ``distributed_optimizer``: shard the optimizer state over data-parallel ranks.
    - ``grad_reduce_in_fp32``: reduce gradients in fp32 even when the model is bf16.
    - ``recompute``: activation recomputation, ``none``, ``selective`` (core attention) or ``full`` (every layer).
    - ``vocab_divisible_by``: the embedding is padded to a multiple of this times ``tp``.
    """

    attention: AttentionBackend = "auto"
    distributed_optimizer: bool = True
    grad_reduce_in_fp32: bool = True
    recompute: Recompute = "none"
    vocab_divisible_by: int = 128

    def __post_init__(self) -> None:
        if self.attention not in ("auto", "sdpa", "local", "te"):
            raise ConfigError("attention", f"must be auto|sdpa|local|te, got {self.attention!r}")
        if self.recompute not in ("none", "selective", "full"):
            raise ConfigError("recompute", f"must be none|selective|full, got {self.recompute!r}")
        if self.vocab_divisible_by < 1:
            raise ConfigError("vocab_divisible_by", f"must be >= 1, got {self.vocab_divisible_by}")


@dataclass(frozen=True)
class TorchTrainerConfig(TrainerConfig, TorchOptions):
    """Everything `TorchTrainer` reads: the shared `TrainerConfig` settings plus `TorchOptions`."""

    def __post_init__(self) -> None:
        TrainerConfig.__post_init__(self)
        TorchOptions.__post_init__(self)


@dataclass(frozen=True)
class MegatronTrainerConfig(TrainerConfig, MegatronOptions):
    """Everything `MegatronTrainer` reads: `TrainerConfig`, `MegatronOptions`, the model-parallel sizes ``tp`` x
    ``pp`` (they must divide the world size; the rest is data parallelism) and the model-parallel RNG seed."""

    tp: int = 1
    pp: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        TrainerConfig.__post_init__(self)
        MegatronOptions.__post_init__(self)
        for key in ("tp", "pp"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be >= 1, got {getattr(self, key)}")


def merge(cls: type, *parts: Any, **extra: Any) -> Any:
    """Build the backend config `cls` from its parts (a `TrainerConfig`, the backend's options) and `extra`."""
    values: dict[str, Any] = {}
    for part in parts:
        values.update({f.name: getattr(part, f.name) for f in dataclasses.fields(part)})
    return cls(**values, **extra)


def lr_lambda(step: int, config: TrainerConfig) -> float:
    """LR multiplier after ``step`` optimizer steps: linear warmup, then constant / cosine / linear decay."""
    if config.warmup_steps and step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return 1.0
    total = max(config.total_steps - config.warmup_steps, 1)  # type: ignore[operator]
    progress = min(max(step - config.warmup_steps, 0) / total, 1.0)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if config.lr_schedule == "cosine" else 1 - progress
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * shape


def changed_knobs(options: TorchOptions | MegatronOptions) -> list[str]:
    """The fields of a backend's options that differ from their defaults (knobs the user set)."""
    default = type(options)()
    return [
        f.name for f in dataclasses.fields(options) if getattr(options, f.name) != getattr(default, f.name)
    ]
