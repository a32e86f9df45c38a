"""Training throughput: the Megatron backend vs the torch backend, same config, same batches, same loss.

A random-init Llama-style model (default: 16 layers, hidden 1536, 12 heads, vocab 32k, about 0.7B parameters)
trains on packed 2048-token sequences, bf16 on GPU. Both backends run the same GRPO `train_step` on the same
`TrajectoryBatch` es, one sequence per micro-batch (so both attention paths get plain causal SDPA / flash).
Prints tokens/s and MFU for each, and their ratio.

MFU = (6 * N * tokens + attention FLOPs) / step time / peak, with N the parameters that do matmuls (all but
the input embedding) and causal attention FLOPs ``6 * layers * seq_len * heads * head_dim`` per token
(forward + backward, half of the full score matrix). Peak: 989 TFLOP/s (H200 dense bf16).

    python benchmarks/megatron.py                # on the GPU machine
    python benchmarks/megatron.py --tiny         # a seconds-long CPU check
    python benchmarks/megatron.py --profile      # + where one step's GPU time goes, per backend
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import warnings

# Run as a script, this file's folder comes first on sys.path and "megatron" would resolve to this file
# instead of the megatron-core package.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [q for q in sys.path if os.path.abspath(q or os.curdir) != _HERE]

import torch  # noqa: E402

for _category in (UserWarning, FutureWarning, DeprecationWarning):  # megatron-core's import-time noise
    warnings.filterwarnings("ignore", category=_category)
PEAK_FLOPS = 989e12


def llama_config(args: argparse.Namespace):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq_len, 2048),
        tie_word_embeddings=False,
        rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
    )


def make_batches(args: argparse.Namespace, n: int):
    from miles.trajectory import Trajectory, TrajectoryBatch, TrajectoryMeta

    g = torch.Generator().manual_seed(0)
    prompt = args.seq_len // 4
    out = []
    for step in range(n):
        trajs = []
        for i in range(args.batch):
            ids = torch.randint(0, args.vocab, (args.seq_len,), generator=g).tolist()
            lps = [0.0] * prompt + (-torch.rand(args.seq_len - prompt, generator=g)).tolist()
            trajs.append(
                Trajectory(
                    token_ids=ids,
                    loss_mask=[0] * prompt + [1] * (args.seq_len - prompt),
                    rollout_logprobs=lps,
                    reward=float((i + step) % 2),
                    meta=TrajectoryMeta(group_id=str(i // 2)),
                )
            )
        out.append(TrajectoryBatch.from_trajectories(trajs))
    return out


def flops_per_token(cfg, seq_len: int) -> tuple[float, int]:
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * head_dim
    per_layer = (
        cfg.hidden_size * (cfg.hidden_size + 2 * kv)
        + cfg.hidden_size * cfg.hidden_size
        + 3 * cfg.hidden_size * cfg.intermediate_size
    )
    matmul_params = cfg.num_hidden_layers * per_layer + cfg.vocab_size * cfg.hidden_size  # + lm_head
    attention = 6 * cfg.num_hidden_layers * seq_len * cfg.num_attention_heads * head_dim
    return 6 * matmul_params + attention, matmul_params


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _sibling(name: str):
    """A helper module beside this file (not importable by name: this folder is off sys.path, see above)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(_HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_trainer(trainer, batches, warmup: int) -> float:
    for b in batches[:warmup]:
        trainer.train_step(b)
    _sync()
    t0 = time.perf_counter()
    for b in batches[warmup:]:
        trainer.train_step(b)
    _sync()
    return (time.perf_counter() - t0) / (len(batches) - warmup)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny fp32 config that runs in seconds on CPU")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4, help="sequences per train step")
    p.add_argument("--steps", type=int, default=6, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--backends", default="megatron,torch")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="default: the whole batch")
    p.add_argument("--torch-packing", default="auto", help="the torch backend's packing mode")
    p.add_argument("--profile", action="store_true", help="profile one more step per backend (GPU kernels)")
    args = p.parse_args()
    if args.tiny:
        args.layers, args.hidden, args.ffn, args.heads, args.kv_heads, args.vocab = 2, 64, 128, 4, 2, 512
        args.seq_len, args.batch, args.steps, args.warmup = 128, 2, 2, 1
    on_gpu = torch.cuda.is_available()
    precision = "bf16" if on_gpu else "fp32"
    cfg = llama_config(args)
    fpt, n_params = flops_per_token(cfg, args.seq_len)
    tokens = args.seq_len * args.batch
    mbt = args.micro_batch_tokens or tokens
    batches = make_batches(args, args.warmup + args.steps)
    print(
        f"model: {args.layers} layers, hidden {args.hidden}, heads {args.heads}/{args.kv_heads}, vocab "
        f"{args.vocab}; {n_params / 1e6:.1f}M matmul params; batch {args.batch} x {args.seq_len} tokens; "
        f"{precision} on {'cuda' if on_gpu else 'cpu'}"
    )
    results: dict[str, float] = {}
    for backend in args.backends.split(","):
        torch.manual_seed(0)
        if backend == "megatron":
            from miles.learner.megatron import MegatronTrainer, MegatronTrainerConfig

            trainer = MegatronTrainer(
                hf_config=cfg,
                config=MegatronTrainerConfig(lr=1e-5, precision=precision, micro_batch_tokens=mbt),
            )
        elif backend == "torch":
            import transformers

            from miles.learner.torch_backend import TorchTrainer, TorchTrainerConfig

            model = transformers.LlamaForCausalLM(cfg)
            trainer = TorchTrainer(
                model,
                TorchTrainerConfig(
                    lr=1e-5, precision=precision, micro_batch_tokens=mbt, packing=args.torch_packing
                ),
            )
        else:
            raise SystemExit(f"unknown backend {backend!r}; use megatron and/or torch")
        dt = time_trainer(trainer, batches, args.warmup)
        results[backend] = dt
        mfu = fpt * tokens / dt / PEAK_FLOPS
        print(
            f"{backend:>9}: {dt:.4f} s/step  {tokens / dt:,.0f} tokens/s  MFU {100 * mfu:.1f}%"
            + ("" if on_gpu else "  (MFU vs an H200 peak; meaningless on CPU)")
        )
        if args.profile:
            _sibling("gpu_profile").profile_region(
                lambda t=trainer: t.train_step(batches[-1]), label=f"one {backend} train_step"
            )
        del trainer
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
    if "megatron" in results and "torch" in results:
        print(f"megatron / torch throughput ratio: {results['torch'] / results['megatron']:.2f}x")
    if os.environ.get("RANK") is None:
        from miles.learner.megatron.parallel import destroy_parallel

        destroy_parallel()


if __name__ == "__main__":
    main()
