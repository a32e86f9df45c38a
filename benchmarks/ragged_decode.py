"""Decode steps over rows of very different context lengths: grouped by length vs one padded call.

A multi-turn rollout mixes rows of long sessions (many turns in) with rows of fresh ones, and the asynchronous
loop does so all the time (a long session spans weight versions while new groups keep joining). One padded
attention call reads every row's cache up to the longest context; `attention_groups` lets each group of rows
read only up to its own (`Decoder.forward(groups=...)`), as a ragged attention kernel does. Both paths run
the same decode step, alternately, in one process; the table gives each one's median step time.

    python benchmarks/ragged_decode.py                       # the calculator example's 1m model, 1 thread
    python benchmarks/ragged_decode.py --model-size 3m
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from miles.engines.decoder import AttentionGroups, Decoder, attention_groups
from miles.tiny import TINY_SIZES, make_tiny_model


def mixes(seed: int) -> dict[str, list[int]]:
    """Context lengths per row: long-tail mixes, and spreads the grouping should leave alone."""
    rng = random.Random(seed)
    return {
        "16 rows: 3 at 700, 13 at 100": [700] * 3 + [100] * 13,
        "32 rows: 4 at 900, 28 at 60": [900] * 4 + [60] * 28,
        "64 rows: 8 at 700, 56 at 110": [700] * 8 + [110] * 56,
        "8 rows: 1 at 600, 7 at 120": [600] + [120] * 7,
        "4 rows: 1 at 600, 3 at 50": [600] + [50] * 3,
        "16 rows: uniform 30-700": [rng.randint(30, 700) for _ in range(16)],
        "32 rows: uniform 30-300": [rng.randint(30, 300) for _ in range(32)],
    }


def step_ms(
    decoder: Decoder, cache, lengths: list[int], plan: AttentionGroups | None, min_s: float = 0.2
) -> float:
    """Mean milliseconds of one decode step over rows of `lengths` (one padded call when `plan` is None)."""
    ids = torch.randint(0, 100, (len(lengths), 1))
    pos = torch.tensor(lengths)[:, None] - 1
    start, n = time.perf_counter(), 0
    with torch.inference_mode():
        while time.perf_counter() - start < min_s:
            decoder.forward(cache, ids, pos, 0, max(lengths), groups=plan)
            n += 1
    return 1e3 * (time.perf_counter() - start) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-size", default="1m", choices=sorted(TINY_SIZES))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per path; medians are reported")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    decoder = Decoder(make_tiny_model(args.model_size).eval())
    cache = decoder.new_cache(256, 2048, initial_len=1024)
    cache.data.normal_(generator=torch.Generator().manual_seed(args.seed))
    print(
        f"{'rows and context lengths':<32}{'padded ms':>11}{'grouped ms':>12}{'speed-up':>10}  groups (base; rows x length)"
    )
    ratios = []
    for name, lengths in mixes(args.seed).items():
        plan = attention_groups(lengths)
        step_ms(decoder, cache, lengths, None, min_s=0.02)
        step_ms(decoder, cache, lengths, plan, min_s=0.02)
        padded, grouped = [], []
        for _ in range(args.rounds):
            padded.append(step_ms(decoder, cache, lengths, None))
            grouped.append(step_ms(decoder, cache, lengths, plan))
        p, g = statistics.median(padded), statistics.median(grouped)
        ratios.append(p / g)
        shape = (
            f"{plan.base}; " + ", ".join(f"{len(r)} x {n}" for r, n in plan.gathered) if plan else "one call"
        )
        print(f"{name:<32}{p:>11.3f}{g:>12.3f}{p / g:>9.2f}x  {shape}")
    print(
        f"grouped/padded decode step, geometric mean over the mixes: {statistics.geometric_mean(ratios):.2f}x"
    )


if __name__ == "__main__":
    main()
