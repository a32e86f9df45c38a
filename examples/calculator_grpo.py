"""Calculator GRPO: an SFT warm start on the Calculator-v0 oracle, then GRPO, via `TrainLoop`.

The config is built in Python (the same fields as a `miles train` YAML file). The run prints the held-out
success rate after SFT and after RL, and writes sessions, metrics, checkpoints and `curves.png` into
`--output-dir`.

    python examples/calculator_grpo.py                    # a few minutes on 2 CPU cores
    python examples/calculator_grpo.py --steps 2 --eval-tasks 8   # a quick smoke run
"""

from __future__ import annotations

from _agent import config, parser, run


def main() -> None:
    args = parser(
        __doc__, steps=15, sft_demos=128, eval_tasks=50, max_new_tokens=48, output_dir="runs/calculator_grpo"
    ).parse_args()
    run(config(args, "Calculator-v0", num_train_tasks=5000))


if __name__ == "__main__":
    main()
