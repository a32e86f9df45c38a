"""Process-group setup for the Megatron backend: torch.distributed, then ``megatron.core.parallel_state``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from miles.learner.collective import init_distributed
from miles.learner.errors import ConfigError
from miles.learner.megatron.compat import (
    cpu_model_parallel_seed,
    enable_cpu_compat,
    install_cpu_memory_buffer,
)


@dataclass(frozen=True)
class ParallelInfo:
    """Where this process sits: world, tensor-, pipeline- and data-parallel ranks and sizes."""

    world_size: int
    rank: int
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    dp_size: int
    dp_rank: int
    device: torch.device

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def initialize_parallel(tp_size: int = 1, pp_size: int = 1, *, seed: int = 0) -> ParallelInfo:
    """Initialize (or reuse) megatron's model-parallel groups; enables the CPU layer when no GPU is present."""
    from megatron.core import parallel_state as ps

    init_distributed()
    world = dist.get_world_size()
    if tp_size < 1 or pp_size < 1 or world % (tp_size * pp_size):
        raise ConfigError("parallel", f"world size {world} is not divisible by tp={tp_size} x pp={pp_size}")
    cpu = enable_cpu_compat()
    if ps.model_parallel_is_initialized():
        if (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) != (
            tp_size,
            pp_size,
        ):
            raise ConfigError("parallel", "model parallelism is already initialized with other sizes")
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size)
    if cpu:
        install_cpu_memory_buffer()
        cpu_model_parallel_seed(seed)
    else:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    return parallel_info()


def parallel_info() -> ParallelInfo:
    from megatron.core import parallel_state as ps

    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    return ParallelInfo(
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        device=device,
    )


def destroy_parallel() -> None:
    """Tear down megatron's groups and the default process group (for tests and clean exits)."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
