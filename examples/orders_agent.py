"""Orders customer-service agent: an oracle SFT warm start on Orders-v0, then a few GRPO steps.

Orders-v0 is a multi-tool customer-service env (look up orders, check policies, refund or change them)
whose reward is reaching the customer's goal. The run prints the held-out success rate after SFT and
after RL, exactly as measured. It is fine, and expected, that the tiny models (0.1M-3M parameters)
trained for minutes on a CPU cannot really solve these multi-step conversations: this script shows the
full pipeline on a harder env, not a headline result. Read the printed numbers next to the recorded
sessions (`miles replay runs/orders_agent/eval_sessions.jsonl`) before drawing conclusions: a success
is only as meaningful as the env's goal check. Use a larger `--model-size` (or a pretrained model via a
`miles train` config) for real learning.

    python examples/orders_agent.py                        # a few minutes on 2 CPU cores
    python examples/orders_agent.py --steps 1 --sft-demos 8 --eval-tasks 4   # a quick smoke run
"""

from __future__ import annotations

from _agent import config, parser, run


def main() -> None:
    args = parser(
        __doc__, steps=6, sft_demos=64, eval_tasks=20, max_new_tokens=64, output_dir="runs/orders_agent"
    ).parse_args()
    run(config(args, "Orders-v0", num_train_tasks=2000))


if __name__ == "__main__":
    main()
