"""Building the policy model a config names: the tiny kit, a pretrained option, or an HF folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from miles.config import ConfigError
from miles.envs import EnvRecipe, Task
from miles.envs.recipe import error_line
from miles.tito import (
    ChatTemplateError,
    TemplateDropsToolsError,
    TemplateTokenizerMismatchError,
    TITOTokenizer,
    TokenizerSpec,
    TokenizerSpecError,
)
from miles.training.config import ModelConfig, TrainConfig


class ModelSpecError(ConfigError):
    """The model, its tokenizer or its chat template cannot be found; the key names which."""


def build_tito(cfg: ModelConfig) -> TITOTokenizer:
    """The TITO tokenizer the config names, with its chat-template override if any (its `spec` is recorded
    with every session)."""
    try:
        return TITOTokenizer.from_spec(TokenizerSpec(cfg.tokenizer, cfg.chat_template))
    except (ChatTemplateError, TemplateTokenizerMismatchError) as exc:
        raise ModelSpecError("model.chat_template", str(exc)) from exc
    except TokenizerSpecError as exc:
        raise ModelSpecError("model.tokenizer", str(exc)) from exc


async def check_tools_reach_model(tito: TITOTokenizer, recipe: EnvRecipe, task: Task) -> None:
    """`ModelSpecError` on `model.chat_template` when the template would not show the env's tools to the model:
    `task`'s first prompt is rendered with and without its tool schemas, as a session renders it."""
    env = recipe.make()
    try:
        messages, _ = await env.areset(options={"task": task})
        tito.check_renders_tools(messages, list(env.tool_schemas()))
    except TemplateDropsToolsError as exc:
        raise ModelSpecError("model.chat_template", str(exc)) from None
    finally:
        await env.aclose()


def build_policy(cfg: ModelConfig, tokenizer: Any) -> torch.nn.Module:
    """The policy model; `init_from` (an HF folder, e.g. an SFT warm start) replaces the named weights."""
    from transformers import AutoModelForCausalLM

    check_model_source(cfg)
    if cfg.init_from:
        try:
            return AutoModelForCausalLM.from_pretrained(cfg.init_from, dtype=torch.float32)
        except Exception as exc:  # a truncated or garbled weights file, a missing config.json, ...
            raise ModelSpecError(
                "model.init_from", f"cannot load {cfg.init_from!r}: {error_line(exc)}"
            ) from None
    if cfg.name == "tiny":
        from miles.tiny import make_tiny_model

        return make_tiny_model(cfg.size, vocab_size=len(tokenizer), seed=cfg.seed)
    if cfg.name == "smollm2-135m":
        from miles.pretrained import load_smollm2

        return load_smollm2()[0]  # tokenizer: set model.tokenizer to "smollm2-135m" as well
    return AutoModelForCausalLM.from_pretrained(cfg.name, dtype=torch.float32)


def check_device(key: str, device: str) -> None:
    """`ConfigError` on `key` when `device` names a CUDA device this process cannot use."""
    if not device.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        why = "this torch is a CPU build" if torch.version.cuda is None else "no GPU is visible"
        raise ConfigError(
            key, f"{device!r}, but {why}: set {key}: cpu (or install a CUDA torch on a GPU machine)"
        )
    index = device.partition(":")[2]
    if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
        raise ConfigError(
            key,
            f"{device!r}: this machine has {torch.cuda.device_count()} GPU(s), cuda:0 .. "
            f"cuda:{torch.cuda.device_count() - 1}",
        )


def check_devices(cfg: TrainConfig) -> None:
    """The devices the run's embedded engines and torch trainer name exist here (checked where they will run,
    before the model loads)."""
    if cfg.engine.kind == "embedded":
        check_device("engine.device", cfg.engine.device)
    if cfg.backend == "torch":
        check_device("torch.device", cfg.torch.device)


def check_model_source(cfg: ModelConfig) -> None:
    """`ModelSpecError` unless the weights `cfg` names exist: checked before any rank or engine starts."""
    if cfg.init_from:
        if not Path(cfg.init_from).is_dir():
            raise ModelSpecError(
                "model.init_from",
                f"{cfg.init_from!r} is not a folder (relative paths start at "
                f"the working directory, {Path.cwd()}); give the warm start's folder",
            )
    elif cfg.name not in ("tiny", "smollm2-135m") and not Path(cfg.name).is_dir():
        raise ModelSpecError(
            "model.name",
            f"{cfg.name!r} is not a model: use 'tiny' (with model.size), "
            "'smollm2-135m' or an HF checkpoint folder",
        )
