"""Weight sync cost: seconds per GB of the in_process, disk and broadcast methods, against a same-run memcpy
(one `copy_` per tensor into preallocated tensors on the same device).

- in_process: `WeightSync(method="in_process")` into an `EmbeddedEngine` in this process;
- disk: `WeightSync(method="disk")`: safetensors written under `--staging-dir`, then loaded by the engine;
- broadcast: `build_weight_sync(SyncConfig(method="broadcast"))` from this process (the trainer, rank 0) into an
  embedded engine server in a second process (rank 1), bucket by bucket; afterwards the engine process hashes
  every parameter and the benchmark checks they equal what was sent, bit for bit.

The broadcast backend is gloo on CPU. With `--device cuda` it is NCCL when the engine process can have its own
GPU (trainer on cuda:0, engine on cuda:1). NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so on a
single GPU the two processes broadcast over gloo (device -> host -> device); `--backend nccl` forces NCCL.

    python benchmarks/weight_sync.py --model-size 25m                   # CPU, float32, gloo
    python benchmarks/weight_sync.py --device cuda --model-size 1.5b    # GPU, bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import multiprocessing
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from miles.engines.client import SGLangClient
from miles.engines.embedded import EmbeddedEngine
from miles.ports import free_port
from miles.tiny import TINY_SIZES, make_tiny_model
from miles.weight_sync import SyncConfig, WeightSync, build_weight_sync, state_dict_bytes

# Qwen2.5 shapes (hidden, layers, heads, kv heads, intermediate, vocab), random weights.
LARGE = {"0.5b": (896, 24, 14, 2, 4864, 151_936), "1.5b": (1536, 28, 12, 2, 8960, 151_936)}
SIZES = sorted(TINY_SIZES) + sorted(LARGE)


def make_model(size: str, device: str, dtype: torch.dtype, seed: int) -> Qwen2ForCausalLM:
    if size in LARGE:
        hidden, layers, heads, kv, inter, vocab = LARGE[size]
        cfg = Qwen2Config(
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            intermediate_size=inter,
            tie_word_embeddings=True,
        )
        torch.manual_seed(seed)
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg)
    else:
        model = make_tiny_model(size, seed=seed)
    return model.to(device=device, dtype=dtype).eval()


def digest(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of every tensor's bytes."""
    return {
        n: hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for n, t in state.items()
    }


def sync_cuda(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


async def timed(fn: Callable[[], Awaitable[object]], device: str, repeats: int) -> float:
    """Median seconds of `repeats` runs after one warm-up."""
    await fn()
    times = []
    for _ in range(repeats):
        sync_cuda(device)
        t0 = time.perf_counter()
        await fn()
        sync_cuda(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------------------- the engine process (rank 1)
def engine_main(size: str, device: str, dtype: str, port: int, threads: int, conn) -> None:
    torch.set_num_threads(threads)
    from miles.engines.server import serve_in_thread

    engine = EmbeddedEngine(make_model(size, device, getattr(torch, dtype), seed=1), device=device)
    handle = serve_in_thread(engine, port=port)
    conn.send("ready")
    while (cmd := conn.recv()) != "stop":
        assert cmd == "digest"
        conn.send(digest(engine.model.state_dict()))
    handle.stop()


async def bench_broadcast(
    args: argparse.Namespace,
    state: dict[str, torch.Tensor],
    backend: str,
    engine_device: str,
    dtype: torch.dtype,
) -> tuple[float, int, bool]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    port = free_port()
    proc = ctx.Process(
        target=engine_main,
        args=(args.model_size, engine_device, str(dtype).removeprefix("torch."), port, args.threads, child),
        daemon=True,
    )
    proc.start()
    client = SGLangClient(f"http://127.0.0.1:{port}")
    try:
        if not await asyncio.to_thread(parent.poll, 600) or parent.recv() != "ready":
            raise RuntimeError("the engine process did not start")
        sync = await build_weight_sync(
            SyncConfig(method="broadcast", backend=backend, bucket_mb=args.bucket_mb, timeout_s=600),
            [client],
            staging_dir=args.staging_dir,
        )
        seconds = await timed(lambda: sync.push(state), args.device, args.repeats)
        buckets = sync.history[-1].num_buckets
        parent.send("digest")
        equal = await asyncio.to_thread(parent.recv) == digest(state)
        await sync.close()
        parent.send("stop")
        return seconds, buckets, equal
    finally:
        await client.close()
        proc.join(30)
        if proc.is_alive():
            proc.terminate()


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    device = args.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    trainer = make_model(args.model_size, device, dtype, seed=0)
    state = {n: t.detach() for n, t in trainer.state_dict().items()}
    gb = state_dict_bytes(state) / 1e9
    print(
        f"model {args.model_size}: {sum(p.numel() for p in trainer.parameters()) / 1e6:.1f}M parameters, "
        f"{len(state)} tensors, {gb:.3f} GB ({dtype}), device {device}, {args.threads} CPU thread(s) per "
        f"process, {args.repeats} repeats (median)"
    )

    rows: list[tuple[str, float, str]] = []
    dst = {n: torch.empty_like(t) for n, t in state.items()}

    async def memcpy() -> None:
        for n, t in state.items():
            dst[n].copy_(t)

    rows.append(("memcpy (tensor copy_)", await timed(memcpy, device, args.repeats), "baseline"))
    dst.clear()

    engine = EmbeddedEngine(make_model(args.model_size, device, dtype, seed=1), device=device)
    try:
        in_process = WeightSync([engine], method="in_process")
        rows.append(
            (
                "in_process",
                await timed(lambda: in_process.push(state), device, args.repeats),
                "into an EmbeddedEngine, same process",
            )
        )
        staging = Path(tempfile.mkdtemp(prefix="miles-sync-", dir=args.staging_dir))
        disk = WeightSync([engine], method="disk", staging_dir=staging, keep_versions=1)
        rows.append(
            (
                "disk",
                await timed(lambda: disk.push(state), device, args.repeats),
                f"safetensors under {staging.parent}, then loaded",
            )
        )
        shutil.rmtree(staging)
    finally:
        await engine.close()

    if device.startswith("cuda"):
        two_gpus = torch.cuda.device_count() >= 2
        backend = args.backend or ("nccl" if two_gpus else "gloo")
        engine_device = "cuda:1" if two_gpus else "cuda:0"
    else:
        backend, engine_device = "gloo", "cpu"
    seconds, buckets, equal = await bench_broadcast(args, state, backend, engine_device, dtype)
    where = f"trainer {device} -> engine process {engine_device}"
    rows.append(
        (
            f"broadcast ({backend})",
            seconds,
            f"{where}, {buckets} buckets of <= {args.bucket_mb:g} MB, received == sent: {equal}",
        )
    )

    base = rows[0][1] / gb
    print("\n| method | s per sync | s per GB | GB/s | vs memcpy | notes |\n|---|---|---|---|---|---|")
    for name, s, note in rows:
        print(f"| {name} | {s:.4f} | {s / gb:.4f} | {gb / s:.2f} | {s / gb / base:.1f}x | {note} |")
    print("\nratios (s per GB / memcpy's):")
    for name, s, _ in rows[1:]:
        print(f"  {name}: {s / gb / base:.1f}x")
    if not equal:
        raise SystemExit("broadcast: the engine's weights differ from the trainer's")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-size", default="25m", choices=SIZES)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=512.0)
    ap.add_argument(
        "--backend",
        choices=["nccl", "gloo"],
        default=None,
        help="broadcast backend (default: gloo on CPU; on CUDA nccl with two GPUs, else gloo)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads per process (1: stable on a shared machine; every method gets the same)",
    )
    ap.add_argument(
        "--staging-dir", default=None, help="where the disk method writes (default: the temp dir)"
    )
    asyncio.run(main(ap.parse_args()))
