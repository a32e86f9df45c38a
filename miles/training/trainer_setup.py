"""The trainer's side of a `TrainConfig`: each backend's config merged from its sections, and the setup checks
that need no rank (the installation the backend needs, the model's weights, the model's shape against
``parallel.tp/pp``), each a `ConfigError` naming what to change."""

from __future__ import annotations

import importlib.util
from typing import Any

from miles.learner.config import MegatronTrainerConfig, TorchTrainerConfig, merge
from miles.learner.errors import ConfigError
from miles.training.config import TrainConfig


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
