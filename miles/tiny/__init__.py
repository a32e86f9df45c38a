"""The tiny model kit: a deterministic byte-level BPE tokenizer shipped in the package and tiny Qwen2 models."""

from miles.tiny.model import (
    TINY_SIZES,
    TinySize,
    UnknownTinySizeError,
    count_parameters,
    make_tiny_model,
    tiny_config,
)
from miles.tiny.tokenizer import compact_chat_template, load_tiny_tokenizer, train_tiny_tokenizer

__all__ = [
    "TINY_SIZES",
    "TinySize",
    "UnknownTinySizeError",
    "compact_chat_template",
    "count_parameters",
    "load_tiny_tokenizer",
    "make_tiny_model",
    "tiny_config",
    "train_tiny_tokenizer",
]
