"""Building the policy model a config names: the tiny kit, a pretrained option, or an HF folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from miles.tito import TITOTokenizer, load_tokenizer
from miles.trainers.train_config import ModelConfig


class ModelSpecError(ValueError):
    """The model name is neither a known built-in nor an HF checkpoint folder."""


def build_tito(cfg: ModelConfig) -> TITOTokenizer:
    """The TITO tokenizer the config names, with its chat-template override if any."""
    template = None
    if cfg.chat_template == "compact":
        from miles.tiny import compact_chat_template

        template = compact_chat_template()
    elif cfg.chat_template:
        path = Path(cfg.chat_template)
        if not path.is_file():
            raise ModelSpecError(f"model.chat_template {cfg.chat_template!r}: use 'compact' or a .jinja file")
        template = path.read_text(encoding="utf-8")
    return TITOTokenizer(load_tokenizer(cfg.tokenizer), chat_template=template)


def build_policy(cfg: ModelConfig, tokenizer: Any) -> torch.nn.Module:
    """The policy model; `init_from` (an HF folder, e.g. an SFT warm start) replaces the named weights."""
    from transformers import AutoModelForCausalLM

    if cfg.init_from:
        if not Path(cfg.init_from).is_dir():
            raise ModelSpecError(f"model.init_from {cfg.init_from!r} is not a folder")
        return AutoModelForCausalLM.from_pretrained(cfg.init_from, dtype=torch.float32)
    if cfg.name == "tiny":
        from miles.tiny import make_tiny_model

        return make_tiny_model(cfg.size, vocab_size=len(tokenizer), seed=cfg.seed)
    if cfg.name == "smollm2-135m":
        from miles.pretrained import load_smollm2

        return load_smollm2()[0]  # tokenizer: set model.tokenizer to "smollm2-135m" as well
    if Path(cfg.name).is_dir():
        return AutoModelForCausalLM.from_pretrained(cfg.name, dtype=torch.float32)
    raise ModelSpecError(f"model.name {cfg.name!r}: use 'tiny', 'smollm2-135m' or an HF checkpoint folder")
