"""The Megatron backend: megatron-core ``GPTModel`` policies with TP / PP / DP, HF weight conversion, CPU support.

Public entry points: `MegatronTrainer` / `MegatronTrainerConfig` (same interface as the torch backend),
`build_gpt_model` / `layout_from_hf` / `transformer_config` (the model), `hf_to_megatron` / `megatron_to_hf`
(weights), `cpu_compat` / `enable_cpu_compat` (megatron-core on CPU), `launch_torchrun` (spawning ranks),
`build_megatron_trainer` / `CollectiveTrainer` / `serve_trainer_commands` / `run_worker` (driving a multi-rank job
from the train loop on rank 0).
"""

from miles.trainers.megatron.compat import cpu_compat, disable_cpu_compat, enable_cpu_compat
from miles.trainers.megatron.convert import ConversionError, hf_to_megatron, megatron_to_hf
from miles.trainers.megatron.driver import (
    CollectiveTrainer,
    build_megatron_trainer,
    megatron_trainer_config,
    run_worker,
    serve_trainer_commands,
)
from miles.trainers.megatron.launch import in_torchrun_worker, launch_torchrun, torchrun_command
from miles.trainers.megatron.model import (
    ModelLayout,
    UnsupportedModelError,
    build_gpt_model,
    layer_spec,
    layout_from_hf,
    pad_vocab_size,
    transformer_config,
)
from miles.trainers.megatron.trainer import MegatronTrainer, MegatronTrainerConfig

__all__ = [
    "CollectiveTrainer", "ConversionError", "MegatronTrainer", "MegatronTrainerConfig", "ModelLayout",
    "UnsupportedModelError", "build_gpt_model", "build_megatron_trainer", "cpu_compat",
    "disable_cpu_compat", "enable_cpu_compat", "hf_to_megatron", "in_torchrun_worker", "launch_torchrun",
    "layer_spec", "layout_from_hf", "megatron_to_hf", "megatron_trainer_config", "pad_vocab_size",
    "run_worker", "serve_trainer_commands", "torchrun_command", "transformer_config",
]
