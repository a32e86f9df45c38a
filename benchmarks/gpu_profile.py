"""Where a region's GPU time goes: the torch profiler's kernels grouped by kind, the top kernels, and the ops that
launched the most GPU time (with the project's own frames that called them).

Used by `benchmarks/megatron.py --profile` and `benchmarks/gpu_engine.py --profile`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import torch

KERNEL_KINDS = (  # first match wins; kernel names of cuBLAS/cuDNN/flash/PyTorch on Hopper
    ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|wgmma|matmul|splitk", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("softmax/logprob", re.compile(r"softmax|logsumexp|cross_entropy|nll|log_prob", re.I)),
    ("sampling", re.compile(r"sort|topk|radix|scan|multinomial|philox|random|exponential", re.I)),
    ("norm", re.compile(r"norm", re.I)),
    ("copy/cast", re.compile(r"memcpy|memset|copy|cast|convert|cat|fill", re.I)),
    ("reduce", re.compile(r"reduce|sum|mean|max|min", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise|silu|mul|add|exp|neg", re.I)),
)
OWN_FRAMES = re.compile(r"(^|/)(miles|learner|training|sessions|benchmarks)/[^/]*\.py")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_region(fn: Callable[[], object], *, label: str, top: int = 8) -> None:
    """Run `fn` once under the profiler and print its wall time, GPU-busy share by kernel kind, the `top` kernels
    and the `top` ops by the GPU time they launched (each with its innermost project frames)."""
    from torch.profiler import ProfilerActivity, profile

    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        t0 = time.perf_counter()
        fn()
        _sync()
        wall_us = (time.perf_counter() - t0) * 1e6
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_kind: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for e in kernels:
        us = e.time_range.elapsed_us()
        kind = next((k for k, rx in KERNEL_KINDS if rx.search(e.name)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + us
        by_name[e.name] = by_name.get(e.name, 0.0) + us
    busy = sum(by_kind.values())
    print(
        f"  profile of {label}: {wall_us / 1e3:.1f} ms wall, GPU kernels {busy / 1e3:.1f} ms "
        f"({100 * busy / max(wall_us, 1e-9):.0f}% busy, {len(kernels)} kernels)"
    )
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"    {kind:>16}: {us / 1e3:8.1f} ms  {100 * us / wall_us:5.1f}% of the wall time")
    print("    top kernels:")
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {us / 1e3:8.1f} ms  {name[:110]}")
    print("    top ops by the GPU time they launched (innermost project frames):")
    ops = [a for a in prof.key_averages(group_by_stack_n=12) if a.self_device_time_total > 0]
    for a in sorted(ops, key=lambda a: -a.self_device_time_total)[:top]:
        frames = [f for f in a.stack if OWN_FRAMES.search(f)][:3]
        print(
            f"    {a.self_device_time_total / 1e3:8.1f} ms  {a.key} x{a.count}  <- {' <- '.join(frames) or '?'}"
        )
