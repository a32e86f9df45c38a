"""Multi-turn rollout throughput: the embedded engine vs batched `model.generate` (and per-turn batch-1 generate).

Workload: N sessions x T turns. Each turn appends the previous output plus a fresh "observation" of random
token ids to the context and generates a fixed number of tokens (sampling, temperature 1, EOS ignored so
every path generates exactly the same number of tokens per row). Three paths, same model, same process:

* **batched generate**: one `model.generate` call per turn over every session's context, left-padded
  (what TRL's GRPO rollout does);
* **generate per turn**: `model.generate` once per (session, turn), batch 1 (the historical baseline);
* **embedded engine**: all sessions concurrently (continuous batching, KV reuse across turns by session id).

The machine may be shared, so the paths alternate for `--repeats` rounds and the table shows each path's
median wall time (and its CPU time where it runs on the CPU). On CUDA it also shows the percentage of the
memory-bandwidth limit (every decode step reads all weights once: batch / (weight bytes / bandwidth)).

    python benchmarks/engine.py                                  # the 3m tiny model, CPU
    python benchmarks/engine.py --main-job --threads 2           # the calculator example's rollout shape
    python benchmarks/engine.py --device cuda --model-size 0.5b  # ~0.5B random-init Qwen2 on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from miles.engine import SamplingParams
from miles.engines.embedded import EmbeddedEngine
from miles.tiny import TINY_SIZES, make_tiny_model

SIZES = sorted(TINY_SIZES) + ["0.5b"]


@dataclass(frozen=True)
class Workload:
    """Sessions' first prompts, the observations appended after each turn, and the tokens each turn generates."""

    prompts: list[list[int]]
    observations: list[list[list[int]]]
    new_tokens: list[int]  # per turn

    @property
    def tokens(self) -> int:
        return len(self.prompts) * sum(self.new_tokens)


def make_model(size: str, device: str, seed: int = 0, vocab_size: int | None = None) -> Qwen2ForCausalLM:
    """A tiny model from `miles.tiny`, or "0.5b": Qwen2.5-0.5B's shape with random weights."""
    if size == "0.5b":
        cfg = Qwen2Config(
            vocab_size=151_936,
            hidden_size=896,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            intermediate_size=4864,
            max_position_embeddings=4096,
            eos_token_id=None,
            bos_token_id=None,
            pad_token_id=0,
            tie_word_embeddings=True,
        )
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
    else:
        model = make_tiny_model(size, seed=seed, vocab_size=vocab_size)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    return model.to(device=device, dtype=dtype).eval()


def make_workload(
    sessions: int, prompt_len: int, obs_len: int, new_tokens: list[int], vocab: int, seed: int
) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(prompt_len)] for _ in range(sessions)]
    obs = [[[rng.randrange(1, vocab) for _ in range(obs_len)] for _ in new_tokens] for _ in range(sessions)]
    return Workload(prompts, obs, new_tokens)


def _generate(model: Qwen2ForCausalLM, contexts: list[list[int]], n: int, device: str) -> list[list[int]]:
    """One `model.generate` call over `contexts`, left-padded; the `n` new tokens of each row."""
    width = max(map(len, contexts))
    ids = torch.zeros((len(contexts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, ctx in enumerate(contexts):
        ids[i, width - len(ctx) :] = torch.tensor(ctx)
        mask[i, width - len(ctx) :] = 1
    out = model.generate(
        ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        pad_token_id=0,
    )
    return out[:, width:].tolist()


def run_batched(model: Qwen2ForCausalLM, w: Workload, device: str) -> int:
    contexts = [list(p) for p in w.prompts]
    produced = 0
    with torch.inference_mode():
        for t, n in enumerate(w.new_tokens):
            outs = _generate(model, contexts, n, device)
            for s, gen in enumerate(outs):
                produced += len(gen)
                contexts[s] += gen + w.observations[s][t]
    return produced


def run_per_turn(model: Qwen2ForCausalLM, w: Workload, device: str) -> int:
    produced = 0
    with torch.inference_mode():
        for s, prompt in enumerate(w.prompts):
            ctx = list(prompt)
            for t, n in enumerate(w.new_tokens):
                gen = _generate(model, [ctx], n, device)[0]
                produced += len(gen)
                ctx += gen + w.observations[s][t]
    return produced


async def run_engine(engine: EmbeddedEngine, w: Workload, tag: str) -> int:
    """Every session of `w` at once; `tag` makes the session ids new, so no round reuses another's cache."""

    async def session(s: int) -> int:
        ctx, produced = list(w.prompts[s]), 0
        for t, n in enumerate(w.new_tokens):
            r = await engine.generate(
                ctx,
                SamplingParams(temperature=1.0, max_new_tokens=n),
                session_id=f"{tag}-s{s}",
                ignore_eos=True,
            )
            produced += len(r.output_ids)
            ctx += r.output_ids + w.observations[s][t]
        return produced

    return sum(await asyncio.gather(*(session(s) for s in range(len(w.prompts)))))


@dataclass
class Timing:
    wall: list[float]
    cpu: list[float]
    tokens: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.wall)

    @property
    def median_cpu(self) -> float:
        return statistics.median(self.cpu)


def timed(fn: Callable[[], int], sync: Callable[[], None], into: Timing) -> None:
    sync()
    c0, t0 = time.process_time(), time.perf_counter()
    into.tokens = fn()
    sync()
    into.wall.append(time.perf_counter() - t0)
    into.cpu.append(time.process_time() - c0)


def bandwidth_limit(model: torch.nn.Module, batch: int, tbs: float) -> float:
    """Tokens/s if every decode step only read the weights once at `tbs` TB/s."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return batch / (weight_bytes / (tbs * 1e12))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model-size", default="3m", choices=SIZES)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--obs-len", type=int, default=16)
    ap.add_argument(
        "--main-job",
        action="store_true",
        help="the calculator example's rollout (configs/calculator.yaml): 64 sessions, the tiny "
        "1m model with the tiny tokenizer's vocabulary, 34-token prompts, 2 turns of 22 and "
        "9 tokens, 15-token observations (the medians of its recorded sessions)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating rounds; medians are reported")
    ap.add_argument("--skip-per-turn", action="store_true", help="leave out the per-turn batch-1 baseline")
    ap.add_argument(
        "--bandwidth-tbs", type=float, default=4.3, help="memory bandwidth for the %% of limit (CUDA)"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    vocab = None
    if args.main_job:
        from miles.tiny import load_tiny_tokenizer

        args.model_size, args.sessions, args.prompt_len, args.obs_len = "1m", 64, 34, 15
        new_tokens, vocab = [22, 9], len(load_tiny_tokenizer())
    else:
        new_tokens = [args.new_tokens] * args.turns

    model = make_model(args.model_size, args.device, args.seed, vocab)
    w = make_workload(
        args.sessions, args.prompt_len, args.obs_len, new_tokens, model.config.vocab_size, args.seed
    )
    engine = EmbeddedEngine(model, device=args.device, max_batch_size=max(64, args.sessions))
    cuda = args.device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    # warm-up every path (kernel selection, allocator, CUDA graphs of the engine's batch sizes)
    warm = make_workload(args.sessions, args.prompt_len, args.obs_len, [4, 4], model.config.vocab_size, 1)
    run_batched(model, make_workload(2, 8, 4, [2], model.config.vocab_size, 1), args.device)
    asyncio.run(run_engine(engine, warm, "warm-up"))
    rounds = iter(range(1 << 30))

    paths: dict[str, Callable[[], int]] = {
        "batched generate": lambda: run_batched(model, w, args.device),
        "embedded engine": lambda: asyncio.run(run_engine(engine, w, f"round{next(rounds)}")),
    }
    if not args.skip_per_turn:
        paths["generate per turn"] = lambda: run_per_turn(model, w, args.device)
    timings = {name: Timing([], []) for name in paths}
    stats0 = dict(engine.stats)
    load0 = os.getloadavg()[0]
    for _ in range(args.repeats):
        for name, fn in paths.items():
            timed(fn, sync, timings[name])
    load1 = os.getloadavg()[0]
    reused = (engine.stats["cached_tokens"] - stats0["cached_tokens"]) // args.repeats
    prefilled = (engine.stats["prefill_tokens"] - stats0["prefill_tokens"]) // args.repeats
    asyncio.run(engine.close())

    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {args.model_size} ({params / 1e6:.2f}M params) on {args.device}; {args.sessions} sessions x "
        f"{len(new_tokens)} turns x {new_tokens} new tokens; {w.tokens} tokens per round"
    )
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average {load0:.1f} -> {load1:.1f} "
        f"on {os.cpu_count()} CPUs; {args.repeats} alternating rounds, medians"
    )
    print(f"engine: {reused} prompt tokens reused from session caches, {prefilled} prefilled per round")
    base = timings["batched generate"]
    header = f"{'path':<20} {'wall s':>8} {'tok/s':>10} {'cpu s':>8} {'vs batched':>11}"
    if cuda:
        header += f" {'% of BW limit':>14}"
        limit = bandwidth_limit(model, args.sessions, args.bandwidth_tbs)
    print(header)
    for name, t in timings.items():
        rate = t.tokens / t.median
        line = (
            f"{name:<20} {t.median:8.3f} {rate:10.1f} {t.median_cpu:8.3f} "
            f"{base.median / t.median * t.tokens / base.tokens:10.2f}x"
        )
        if cuda:
            line += f" {100 * rate / limit:13.2f}%"
        print(line)
    if cuda:
        print(f"bandwidth limit at batch {args.sessions}: {limit:,.0f} tok/s ({args.bandwidth_tbs} TB/s)")


if __name__ == "__main__":
    main()
