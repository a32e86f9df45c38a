"""The LoRA settings of one adapter (`adapters[i].lora` in a train config), and the checks that tie the
`adapters:` list to the rest of a `TrainConfig`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from miles.engines.lora import DEFAULT_TARGET_MODULES, AdapterError, check_adapter_name
from miles.learner.config import TrainerConfig
from miles.learner.errors import ConfigError

#: The `trainer:` settings an adapter may set for itself: its optimizer's learning rate and schedule.
SCHEDULE_KEYS = ("lr", "lr_schedule", "warmup_steps", "total_steps", "min_lr_ratio")


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter's shape: `rank` r and `alpha` (the update is scaled by alpha / r, as SGLang's LoRA loader
    scales it: no rsLoRA), `dropout` on the adapter's input while training, and the `target_modules` it adapts
    (leaf module names of the base model; the default is every linear layer of a Llama/Qwen2-style decoder
    layer, which SGLang's LoRA loader accepts)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ConfigError("rank", f"must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise ConfigError("alpha", f"must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError("dropout", f"must be in [0, 1), got {self.dropout}")
        if not self.target_modules or not all(isinstance(m, str) and m for m in self.target_modules):
            raise ConfigError("target_modules", "must list at least one module name, e.g. [q_proj, v_proj]")


def adapter_trainer_config(trainer: TrainerConfig, adapter: Any) -> TrainerConfig:
    """`trainer` with the adapter's own learning rate and schedule (its `SCHEDULE_KEYS` that are set); a bad
    value is a `ConfigError` naming `adapters[NAME].<key>`."""
    overrides = {k: getattr(adapter, k) for k in SCHEDULE_KEYS if getattr(adapter, k) is not None}
    try:
        return dataclasses.replace(trainer, **overrides)
    except ConfigError as exc:
        raise ConfigError(f"adapters[{adapter.name}].{exc.key}", exc.message) from None


def check_adapters(cfg: Any) -> None:
    """The `adapters:` list against the rest of a `TrainConfig`: valid, distinct names, and only settings the
    multi-adapter loop supports. Raises `ConfigError` naming the key and the fix."""
    seen: set[str] = set()
    for adapter in cfg.adapters:
        try:
            check_adapter_name(adapter.name)
        except AdapterError as exc:
            raise ConfigError(f"adapters[{adapter.name}].name", str(exc)) from None
        if adapter.name in seen:
            raise ConfigError(
                f"adapters[{adapter.name}].name", "two adapters have this name; give each its own"
            )
        seen.add(adapter.name)
        adapter_trainer_config(cfg.trainer, adapter)
    if not cfg.adapters:
        return
    unsupported = (
        (cfg.backend != "torch", "backend", "adapters train on the torch backend (peft); set backend: torch"),
        (
            cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp > 1,
            "parallel",
            "adapters train in one process; set parallel sizes to 1",
        ),
        (
            cfg.asynchronous.enabled,
            "async.enabled",
            "adapters run in the synchronous loop; set async.enabled: false",
        ),
        (
            cfg.rollout.agent.enabled,
            "rollout.agent",
            "adapters run the envs' own sessions, not an external agent",
        ),
        (
            cfg.sft.enabled,
            "sft.enabled",
            "the base is frozen under adapters: warm-start it with model.init_from "
            "(miles sft makes one) and set sft.enabled: false",
        ),
    )
    for bad, key, fix in unsupported:
        if bad:
            raise ConfigError(key, f"not with adapters: {fix}")
