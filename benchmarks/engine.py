"""Multi-turn rollout throughput: the embedded engine vs plain `model.generate` per turn.

Workload: N sessions x T turns. Each turn appends the previous output plus a fresh "observation" of random
token ids to the context and generates `--new-tokens` tokens (sampling, temperature 1, EOS ignored so both
sides generate the same number of tokens). The embedded engine runs all sessions concurrently (continuous
batching, KV reuse across turns by session id); the baseline runs `model.generate` once per (session, turn),
one after another, on the same model in the same process.

    python benchmarks/engine.py                                  # the 3m tiny model, CPU
    python benchmarks/engine.py --model-size 0.1m
    python benchmarks/engine.py --device cuda --model-size 0.5b  # ~0.5B random-init Qwen2 on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from miles.engine import SamplingParams
from miles.engines.embedded import EmbeddedEngine
from miles.tiny import TINY_SIZES, make_tiny_model

SIZES = sorted(TINY_SIZES) + ["0.5b"]


def make_model(size: str, device: str, seed: int = 0) -> Qwen2ForCausalLM:
    """A tiny model from `miles.tiny`, or "0.5b": Qwen2.5-0.5B's shape with random weights."""
    if size == "0.5b":
        cfg = Qwen2Config(vocab_size=151_936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                          num_key_value_heads=2, intermediate_size=4864, max_position_embeddings=4096,
                          eos_token_id=None, bos_token_id=None, pad_token_id=0, tie_word_embeddings=True)
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
    else:
        model = make_tiny_model(size, seed=seed)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    return model.to(device=device, dtype=dtype).eval()


def workload(sessions: int, prompt_len: int, obs_len: int, vocab: int, seed: int) -> tuple[list[list[int]],
                                                                                            list[list[list[int]]]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(prompt_len)] for _ in range(sessions)]
    obs = [[[rng.randrange(1, vocab) for _ in range(obs_len)] for _ in range(16)] for _ in range(sessions)]
    return prompts, obs


def run_baseline(model: Qwen2ForCausalLM, prompts, obs, turns: int, new_tokens: int, device: str) -> int:
    produced = 0
    with torch.inference_mode():
        for s, prompt in enumerate(prompts):
            ctx = list(prompt)
            for t in range(turns):
                x = torch.tensor([ctx], device=device)
                out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0,
                                     top_p=1.0, pad_token_id=0)
                gen = out[0, len(ctx):].tolist()
                produced += len(gen)
                ctx += gen + obs[s][t]
    return produced


async def run_engine(engine: EmbeddedEngine, prompts, obs, turns: int, new_tokens: int) -> int:
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)

    async def session(s: int) -> int:
        ctx, produced = list(prompts[s]), 0
        for t in range(turns):
            r = await engine.generate(ctx, params, session_id=f"s{s}", ignore_eos=True)
            produced += len(r.output_ids)
            ctx += r.output_ids + obs[s][t]
        return produced

    return sum(await asyncio.gather(*(session(s) for s in range(len(prompts)))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model-size", default="3m", choices=SIZES)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--obs-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    model = make_model(args.model_size, args.device, args.seed)
    prompts, obs = workload(args.sessions, args.prompt_len, args.obs_len, model.config.vocab_size, args.seed)
    engine = EmbeddedEngine(model, device=args.device, max_batch_size=max(64, args.sessions))

    # warm-up both paths (kernel selection, allocator)
    run_baseline(model, prompts[:1], obs[:1], 1, 4, args.device)
    asyncio.run(run_engine(engine, prompts[:2], obs[:2], 1, 4))

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    sync()
    t0 = time.perf_counter()
    base_tokens = run_baseline(model, prompts, obs, args.turns, args.new_tokens, args.device)
    sync()
    base_s = time.perf_counter() - t0

    stats0 = dict(engine.stats)
    t0 = time.perf_counter()
    eng_tokens = asyncio.run(run_engine(engine, prompts, obs, args.turns, args.new_tokens))
    sync()
    eng_s = time.perf_counter() - t0
    cached = engine.stats["cached_tokens"] - stats0["cached_tokens"]
    prefilled = engine.stats["prefill_tokens"] - stats0["prefill_tokens"]
    asyncio.run(engine.close())

    params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.model_size} ({params / 1e6:.2f}M params) on {args.device}; "
          f"{args.sessions} sessions x {args.turns} turns x {args.new_tokens} new tokens")
    print(f"model.generate per turn : {base_tokens:6d} tokens in {base_s:7.2f} s = {base_tokens / base_s:9.1f} tok/s")
    print(f"embedded engine         : {eng_tokens:6d} tokens in {eng_s:7.2f} s = {eng_tokens / eng_s:9.1f} tok/s"
          f"  (prompt tokens reused from cache: {cached}, prefilled: {prefilled})")
    print(f"ratio (engine / generate): {(eng_tokens / eng_s) / (base_tokens / base_s):.2f}x")


if __name__ == "__main__":
    main()
