"""A user-defined environment, registered and trained with SFT + GRPO on the tiny model.

The environment (the block between the two `# ---` lines, under 50 lines) is a shop with one tool,
`price(item)`. The agent must call it and answer "It costs N dollars.". Its scripted oracle gives the
demonstrations for the SFT warm start; GRPO then trains on the environment's reward.

    python examples/custom_env.py                 # a few minutes on 2 CPU cores
    python examples/custom_env.py --steps 1 --sft-demos 8 --eval-tasks 2   # a quick smoke run
"""

from __future__ import annotations

import argparse

# ---
from miles.envs import OraclePolicy, ToolEnv, register, reward
from miles.envs.tasks import Task, TaskSource, select_split
from miles.tools import tool
from miles.types import Message, ToolCall

PRICES = {"apple": 3, "bread": 5, "cheese": 12, "milk": 2, "tea": 7, "rice": 4, "soap": 6, "jam": 9}


def make_task(rng) -> Task:
    item = sorted(PRICES)[int(rng.integers(len(PRICES)))]
    return Task(id="", prompt=f"How much does the {item} cost?", answer=PRICES[item], data={"item": item})


class ShopOracle(OraclePolicy):
    def act(self, messages: list[Message]) -> Message:
        if messages[-1].role == "tool":
            return Message("assistant", f"It costs {messages[-1].content} dollars.")
        item = self.task.data["item"]
        call = ToolCall("price", {"item": item}, id="call_0", raw_arguments=f'{{"item": "{item}"}}')
        return Message("assistant", tool_calls=[call])


class ShopEnv(ToolEnv):
    max_turns = 3
    success_component = "correct"

    def __init__(self, *, split: str = "all", **kwargs) -> None:
        self._split = split
        super().__init__(**kwargs)

    def default_tasks(self) -> TaskSource:
        return select_split(TaskSource.from_generator(make_task, name="shop"), self._split, 0.2, salt="shop")

    @tool
    def price(self, item: str) -> int:
        """The price of `item` (e.g. "apple") in dollars."""
        return PRICES[item]

    @reward(weight=1.0)
    def correct(self, final: str, answer: int) -> float:
        return float(final.strip() == f"It costs {answer} dollars.")

    def oracle(self) -> ShopOracle:
        return ShopOracle().bind(self)


register("Shop-v0", ShopEnv)
# ---


def main() -> None:
    from _agent import train

    from miles.config import from_dict
    from miles.training.command import format_summary
    from miles.training.config import TrainConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="GRPO steps")
    p.add_argument("--sft-demos", type=int, default=64, help="oracle demonstrations for the SFT warm start")
    p.add_argument("--tasks-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--eval-tasks", type=int, default=32)
    p.add_argument("--model-size", default="1m", help="tiny model size: 0.1m, 1m, 3m, ...")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="runs/custom_env")
    a = p.parse_args()
    cfg = from_dict(
        TrainConfig,
        {
            "seed": a.seed,
            "output_dir": a.output_dir,
            "steps": a.steps,
            "env": {"id": "Shop-v0", "num_train_tasks": 2000},
            "model": {"name": "tiny", "size": a.model_size, "seed": a.seed},
            "rollout": {
                "tasks_per_step": a.tasks_per_step,
                "scheduler": {
                    "group_size": a.group_size,
                    "session": {"sampling": {"temperature": 1.0, "max_new_tokens": a.max_new_tokens}},
                },
            },
            "trainer": {"lr": 1e-3},
            "sft": {"enabled": a.sft_demos > 0, "num_demos": a.sft_demos, "batch_size": 8, "epochs": 2},
            "eval": {"num_tasks": a.eval_tasks, "max_new_tokens": a.max_new_tokens},
        },
    )
    print(format_summary(train(cfg), cfg))


if __name__ == "__main__":
    main()
