"""The Megatron backend: megatron-core ``GPTModel`` policies with TP / PP / DP, HF weight conversion, CPU support.

Public entry points: `MegatronTrainer` / `MegatronTrainerConfig` (the `Trainer` protocol), `build_gpt_model` /
`layout_from_hf` / `transformer_config` (the model), `hf_to_megatron` / `megatron_to_hf` (weights),
`cpu_compat` / `enable_cpu_compat` (megatron-core on CPU). Launching ranks and driving them from the train
loop is backend-neutral: `miles.training.torchrun`, `miles.learner.collective`, `miles.training.placement`.
"""

from miles.learner.config import MegatronOptions, MegatronTrainerConfig
from miles.learner.megatron.compat import cpu_compat, disable_cpu_compat, enable_cpu_compat
from miles.learner.megatron.convert import ConversionError, hf_to_megatron, megatron_to_hf
from miles.learner.megatron.model import (
    ModelLayout,
    UnsupportedModelError,
    build_gpt_model,
    layer_spec,
    layout_from_hf,
    pad_vocab_size,
    transformer_config,
)
from miles.learner.megatron.trainer import MegatronTrainer

__all__ = [
    "ConversionError",
    "MegatronOptions",
    "MegatronTrainer",
    "MegatronTrainerConfig",
    "ModelLayout",
    "UnsupportedModelError",
    "build_gpt_model",
    "cpu_compat",
    "disable_cpu_compat",
    "enable_cpu_compat",
    "hf_to_megatron",
    "layer_spec",
    "layout_from_hf",
    "megatron_to_hf",
    "pad_vocab_size",
    "transformer_config",
]
