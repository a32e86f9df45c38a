"""Two LoRA adapters trained at once on one frozen base model, each with its own env, reward, sampling and
optimizer (configs/multi_lora.yaml): `mul` learns multiplication, `addsub` addition and subtraction, both from
the shipped Calculator warm start. Their sessions decode together in the embedded engine, each row under its
own adapter; after each step only the adapters that trained are synced. Prints each adapter's held-out success
before and after.

    python examples/multi_lora.py                            # about 6 minutes on 2 CPU cores
    python examples/multi_lora.py --steps 2 --eval-tasks 8   # a quick smoke run
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _agent import train

from miles.training.config import load_train_config

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: the config's)")
    p.add_argument("--max-seconds", type=float, default=None, help="RL time budget (default: the config's)")
    p.add_argument("--eval-tasks", type=int, default=None, help="held-out tasks per adapter and evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="runs/multi_lora")
    args = p.parse_args()
    overrides = [
        f"seed={args.seed}",
        f"output_dir={args.output_dir}",
        f"model.init_from={ROOT / 'checkpoints' / 'calculator-sft-1m'}",
    ]
    for key, value in (
        ("steps", args.steps),
        ("max_seconds", args.max_seconds),
        ("eval.num_tasks", args.eval_tasks),
    ):
        if value is not None:
            overrides.append(f"{key}={value}")
    cfg = load_train_config(str(ROOT / "configs" / "multi_lora.yaml"), overrides)
    summary = train(cfg)
    print(f"\n{'adapter':<10}{'held-out success before':>26}{'after':>10}{'gain':>10}")
    for adapter in cfg.adapters:
        before = summary.evals["start"][f"{adapter.name}/greedy"].success_rate
        after = summary.evals["final"][f"{adapter.name}/greedy"].success_rate
        print(f"{adapter.name:<10}{before:>26.1%}{after:>10.1%}{100 * (after - before):>+9.1f}p")
    print(
        f"{summary.steps_done} steps, RL {summary.seconds.get('rl', 0.0):.0f} s; run dir: {summary.output_dir}"
    )


if __name__ == "__main__":
    main()
