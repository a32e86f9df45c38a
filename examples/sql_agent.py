"""SQL agent: an oracle SFT warm start on SQL-v0 with the tiny model, then a few GRPO steps.

SQL-v0 asks questions about a real sqlite database; the agent inspects the schema and runs queries through
tools, then answers. The run prints the held-out success rate before RL (after SFT) and after RL, as
measured, with nothing tuned to flatter it. Be warned: a model of one to a few million parameters
trained for minutes on a CPU usually cannot write correct SQL for unseen questions, so held-out success
near 0% before *and* after RL is the expected, honest outcome here. The script shows the full pipeline
(oracle demos through TITO, multi-turn tool sessions against sqlite, GRPO, weight sync) on a hard env;
use a larger `--model-size` (or a pretrained model via a `miles train` config) for real learning.

    python examples/sql_agent.py                           # a few minutes on 2 CPU cores
    python examples/sql_agent.py --steps 1 --sft-demos 8 --eval-tasks 4   # a quick smoke run
"""

from __future__ import annotations

from _agent import config, parser, run


def main() -> None:
    args = parser(
        __doc__, steps=6, sft_demos=64, eval_tasks=20, max_new_tokens=96, output_dir="runs/sql_agent"
    ).parse_args()
    run(config(args, "SQL-v0", num_train_tasks=2000))


if __name__ == "__main__":
    main()
