"""A narrow CPU compatibility layer for megatron-core, so that CI trains the real backend over gloo.

megatron-core 0.16 hard-codes CUDA at a handful of call sites. This module patches exactly those, only
while it is active, and only when ``torch.cuda.is_available()`` is False (on a GPU it does nothing):

* ``torch.cuda.current_device()``, ``torch.cuda.synchronize()``, ``torch.cuda.Stream`` and
  ``device="cuda"`` / ``.cuda()`` factory arguments inside the megatron-core modules listed in
  `PATCHED_MODULES` (the RoPE table, the default causal mask, the DDP buffers, the pipeline schedules'
  token counters, the optimizer's scalars, grad clipping, the tensor-parallel layers). Each module's global
  ``torch`` name is swapped for a proxy that forwards everything to torch and maps CUDA device arguments to
  CPU; torch itself is untouched except ``torch.Tensor.cuda``, which returns the tensor unchanged (it could
  only raise on a CPU-only build). Both are restored by `disable_cpu_compat`.
* `CpuGlobalMemoryBuffer` replaces ``parallel_state``'s global memory buffer.
* `CpuRNGStatesTracker` replaces the model-parallel CUDA RNG tracker, and `cpu_model_parallel_seed`
  replaces ``model_parallel_cuda_manual_seed`` (same named states and seed offsets, on the CPU generator).
* The optimizers sort parameters by ``param.type()`` against CUDA type names
  (``'torch.cuda.FloatTensor'`` ...); `label_params_as_cuda` gives the model's own parameters (only those) an
  instance-level ``type()`` that answers with the CUDA name when called without arguments.
* ``clip_grad_by_total_norm_fp32`` asserts ``grad.type() == 'torch.cuda.FloatTensor'``; the optimizer's
  reference to it is swapped for a copy that asserts float32 instead.
* Activation recompute (``tensor_parallel.checkpoint``) saves and restores the CUDA generator through
  ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``; those two are swapped for the
  CPU generator's state.

Use it as a context manager (``with cpu_compat(): ...``) or call `enable_cpu_compat` once per process
(the Megatron backend does the latter in its worker processes).
"""

from __future__ import annotations

import contextlib
import importlib
import operator
import types
from collections.abc import Iterator
from functools import reduce
from typing import Any

import torch

PATCHED_MODULES: tuple[str, ...] = (
    "megatron.core.utils",
    "megatron.core.parallel_state",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.module",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.mlp",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
)

_CPU = torch.device("cpu")


def _to_cpu_device(device: Any) -> Any:
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _redirect(fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    wrapper.__name__ = getattr(fn, "__name__", "factory")
    wrapper.__doc__ = getattr(fn, "__doc__", None)
    return wrapper


class _CpuStream:
    """Stands in for ``torch.cuda.Stream``: a no-op context on CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> _CpuStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _CpuCuda:
    """``torch.cuda`` as seen by a patched module: device queries answer CPU, syncs are no-ops."""

    def __init__(self) -> None:
        self._real = torch.cuda

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    @staticmethod
    def current_device() -> torch.device:
        return _CPU

    @staticmethod
    def synchronize(*args: Any, **kwargs: Any) -> None:
        return None

    @staticmethod
    def current_stream(*args: Any, **kwargs: Any) -> _CpuStream:
        return _CpuStream()

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    Stream = _CpuStream


_FACTORIES = (
    "tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "rand",
    "randn",
    "as_tensor",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
)


class _CpuTorch(types.ModuleType):
    """A proxy for the ``torch`` module whose factories map CUDA devices to CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _redirect(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class CpuGlobalMemoryBuffer:
    """CPU twin of ``megatron.core.utils.GlobalMemoryBuffer``: reusable named scratch tensors."""

    def __init__(self) -> None:
        self.buffer: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(
        self, tensor_shape: Any, dtype: torch.dtype, name: str, mem_alloc_context: Any = None
    ) -> torch.Tensor:
        """A view of shape `tensor_shape` into the buffer `name`, growing it when too small."""
        required = reduce(operator.mul, tensor_shape, 1)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < required:
            buf = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype, device=_CPU)
        return buf[:required].view(*tensor_shape)


class CpuRNGStatesTracker:
    """CPU twin of megatron's ``CudaRNGStatesTracker``: named generator states that `fork` switches to.

    Forking sets the CPU default generator to the named state and restores the previous state afterwards,
    as the CUDA tracker does with the CUDA generator.
    """

    def __init__(self) -> None:
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        """Track a new named state seeded with `seed`."""
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"rng seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name!r} already exists")
        self.seeds_.add(seed)
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed)
        self.states_[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        """Run the block under the named state, then restore the caller's state."""
        if name not in self.states_:
            raise ValueError(f"rng state {name!r} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def cpu_model_parallel_seed(seed: int) -> None:
    """CPU version of ``model_parallel_cuda_manual_seed``: the same named states and seed offsets."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    tracker = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    torch.manual_seed(seed)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def label_params_as_cuda(module: torch.nn.Module) -> None:
    """Make ``p.type()`` of `module`'s CPU parameters report the CUDA type name megatron's optimizers expect.

    Only while the layer is active (a no-op otherwise); ``p.type(dtype)`` with arguments behaves as usual.
    """
    if not _State.active:
        return
    for p in module.parameters():
        name = _CUDA_TYPE_NAMES.get(p.dtype)
        if name is None or p.device.type != "cpu":
            continue
        real = p.type

        def typed(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            return _name if not args and not kwargs else _real(*args, **kwargs)

        p.type = typed  # type: ignore[method-assign]


def _clip_grad_by_total_norm_fp32(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """``clip_grad_by_total_norm_fp32`` without the CUDA tensor-type assertion."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    for g in grads:
        if g.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"gradient clipping expects fp32/bf16 main grads, got {g.dtype}")
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for g in grads:
            g.detach().mul_(clip_coeff)


def _cpu_get_rng_state(device: Any = None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


_RNG_FUNCTIONS = {"_get_cuda_rng_state": _cpu_get_rng_state, "_set_cuda_rng_state": _cpu_set_rng_state}


class _State:
    active = False
    saved_torch: dict[str, Any] = {}
    saved_rng: dict[str, Any] = {}
    saved_tensor_cuda: Any = None
    saved_clip: Any = None
    saved_buffer: Any = None


def cpu_compat_needed() -> bool:
    """True when there is no usable GPU, i.e. when the layer would do anything."""
    return not torch.cuda.is_available()


def enable_cpu_compat() -> bool:
    """Activate the layer (idempotent). Returns False, doing nothing, when a GPU is available."""
    if not cpu_compat_needed() or _State.active:
        return _State.active
    proxy = _CpuTorch()
    for name in PATCHED_MODULES:
        mod = importlib.import_module(name)
        if getattr(mod, "torch", None) is torch:
            _State.saved_torch[name] = mod.torch
            mod.torch = proxy
    _State.saved_tensor_cuda = torch.Tensor.cuda
    torch.Tensor.cuda = _tensor_cuda_noop  # type: ignore[method-assign]
    from megatron.core.optimizer import optimizer as mopt

    _State.saved_clip = mopt.clip_grad_by_total_norm_fp32
    mopt.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    from megatron.core.tensor_parallel import random as mrandom

    for name, cpu_fn in _RNG_FUNCTIONS.items():
        _State.saved_rng[name] = getattr(mrandom, name)
        setattr(mrandom, name, cpu_fn)
    install_cpu_memory_buffer()
    _State.active = True
    return True


def install_cpu_memory_buffer() -> None:
    """Swap parallel_state's global memory buffer for a `CpuGlobalMemoryBuffer` (after model-parallel init)."""
    from megatron.core import parallel_state

    current = parallel_state._GLOBAL_MEMORY_BUFFER
    if current is not None and not isinstance(current, CpuGlobalMemoryBuffer):
        _State.saved_buffer = current
        parallel_state._GLOBAL_MEMORY_BUFFER = CpuGlobalMemoryBuffer()


def disable_cpu_compat() -> None:
    """Undo every patch made by `enable_cpu_compat`."""
    if not _State.active:
        return
    for name, real in _State.saved_torch.items():
        importlib.import_module(name).torch = real
    _State.saved_torch = {}
    torch.Tensor.cuda = _State.saved_tensor_cuda  # type: ignore[method-assign]
    from megatron.core import parallel_state
    from megatron.core.optimizer import optimizer as mopt

    mopt.clip_grad_by_total_norm_fp32 = _State.saved_clip
    from megatron.core.tensor_parallel import random as mrandom

    for name, real in _State.saved_rng.items():
        setattr(mrandom, name, real)
    _State.saved_rng = {}
    if isinstance(parallel_state._GLOBAL_MEMORY_BUFFER, CpuGlobalMemoryBuffer):
        parallel_state._GLOBAL_MEMORY_BUFFER = _State.saved_buffer
    _State.saved_buffer = None
    _State.active = False


def cpu_compat_active() -> bool:
    return _State.active


@contextlib.contextmanager
def cpu_compat() -> Iterator[bool]:
    """Context manager form: active inside the block (when no GPU is present), restored afterwards."""
    was_active = _State.active
    enabled = enable_cpu_compat()
    try:
        yield enabled
    finally:
        if enabled and not was_active:
            disable_cpu_compat()


def _tensor_cuda_noop(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self
