"""Tiny Qwen2-architecture causal LMs, from about 0.1M to about 25M parameters, built from a config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from miles.tiny.tokenizer import load_tiny_tokenizer

if TYPE_CHECKING:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM


class UnknownTinySizeError(ValueError):
    """`make_tiny_model` was asked for a size that is not in `TINY_SIZES`."""


@dataclass(frozen=True)
class TinySize:
    """The shape of one tiny model size."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int


TINY_SIZES: dict[str, TinySize] = {
    "0.1m": TinySize(48, 2, 4, 2, 128),
    "1m": TinySize(128, 4, 4, 2, 320),
    "3m": TinySize(192, 6, 6, 2, 512),
    "10m": TinySize(320, 8, 8, 4, 960),
    "25m": TinySize(512, 8, 8, 4, 1408),
}


def tiny_config(
    size: str = "3m", *, vocab_size: int | None = None, max_position_embeddings: int = 2048
) -> Qwen2Config:
    """The `Qwen2Config` of a tiny size; `vocab_size` defaults to the tiny tokenizer's full length."""
    from transformers import Qwen2Config

    if size not in TINY_SIZES:
        raise UnknownTinySizeError(f"unknown tiny model size {size!r}; choose one of {sorted(TINY_SIZES)}")
    shape = TINY_SIZES[size]
    tok = load_tiny_tokenizer()
    return Qwen2Config(
        vocab_size=vocab_size if vocab_size is not None else len(tok),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        use_cache=True,
    )


def make_tiny_model(
    size: str = "3m", *, vocab_size: int | None = None, seed: int = 0, max_position_embeddings: int = 2048
) -> Qwen2ForCausalLM:
    """A randomly initialised tiny `Qwen2ForCausalLM` (fp32, eval mode off), the same weights for the same seed.

    The global torch RNG state is left untouched. Save and load it with `save_pretrained` / `from_pretrained`.
    """
    import torch
    from transformers import Qwen2ForCausalLM

    config = tiny_config(size, vocab_size=vocab_size, max_position_embeddings=max_position_embeddings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())
