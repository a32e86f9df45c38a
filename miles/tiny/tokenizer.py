"""The tiny byte-level BPE tokenizer: digits split one by one, ChatML specials, a Qwen2.5-style tool template.

The trained files are committed in `miles/tiny/data/`; `train_tiny_tokenizer` regenerates them bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from miles.tiny.corpus import DATA_DIR, build_corpus

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Added as whole (non-special) tokens so that tool markup costs one token each and survives skip_special_tokens.
MARKUP_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
# Qwen2-style split: letters with one leading non-letter, every digit alone, punctuation runs, whitespace runs.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


COMPACT_TEMPLATE_FILE = "chat_template_compact.jinja"


def _chat_template() -> str:
    return (DATA_DIR / TEMPLATE_FILE).read_text(encoding="utf-8")


def compact_chat_template() -> str:
    """The tiny template with each tool shown as its signature, `name(arg, ...)`, instead of a JSON schema.

    Everything after the system turn renders exactly as in the default template. A Calculator prompt is 34
    tokens instead of 279, which matters for models trained from scratch on a CPU.
    """
    return (DATA_DIR / COMPACT_TEMPLATE_FILE).read_text(encoding="utf-8")


def _tokenizer_config() -> dict:
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "chat_template": _chat_template(),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 2048,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
        "miles_tiny": True,
    }


def train_tiny_tokenizer(out_dir: str | Path) -> Path:
    """Train the tiny tokenizer from the shipped corpus and write `tokenizer.json` + `tokenizer_config.json`.

    Deterministic: the same corpus and settings give byte-identical files. Returns `out_dir`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(build_corpus().split("\n\n"), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    config = _tokenizer_config()
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8"
    )
    return out


def load_tiny_tokenizer(path: str | Path | None = None) -> PreTrainedTokenizerFast:
    """Load the committed tiny tokenizer (or one written by `train_tiny_tokenizer` at `path`).

    `eos_token` is `<|im_end|>`, `pad_token` is `<|endoftext|>`, and `chat_template` renders tools, tool calls
    and tool responses the Qwen2.5 way.
    """
    from transformers import PreTrainedTokenizerFast

    folder = Path(path) if path is not None else DATA_DIR
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"),
        eos_token=config["eos_token"],
        pad_token=config["pad_token"],
        clean_up_tokenization_spaces=False,
        model_max_length=config["model_max_length"],
    )
    tok.chat_template = config["chat_template"]
    tok.name_or_path = "miles-tiny"
    return tok
