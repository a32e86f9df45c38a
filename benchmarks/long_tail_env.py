"""LongTail-v0: a benchmark env with the heavy-tailed shape of tool-using agents, whatever the model says.

Most tasks end after one turn; about one in five needs 6-8 (the env answers every turn with a tool-style
message until then). Each task sets its own generation budget (`data["sampling"]["max_new_tokens"]`),
log-uniform over 8-80 tokens, so turn lengths vary 10x; with a model that emits no stop token every turn
uses its whole budget. The reward is a stable hash of the generated text, so GRPO groups have spread.

    miles train --config C --import benchmarks/long_tail_env.py --set env.id=LongTail-v0
"""

from __future__ import annotations

import hashlib
import math

from miles.envs import Env, register, reward
from miles.envs.tasks import Task, TaskSource
from miles.types import Message


def make_task(rng) -> Task:
    turns = int(rng.integers(6, 9)) if rng.random() < 0.2 else 1
    budget = int(round(math.exp(rng.uniform(math.log(8), math.log(80)))))
    return Task(
        id="",
        prompt=f"Work for {turns} turns, about {budget} tokens each: {int(rng.integers(10**6))}.",
        data={"turns": turns, "sampling": {"max_new_tokens": budget}},
    )


class LongTailEnv(Env):
    """Ends after the task's number of turns; each turn's observation is a short tool-style result."""

    max_turns = 8
    held_out_fraction = 0.2

    def default_tasks(self) -> TaskSource:
        return TaskSource.from_generator(make_task, name="long-tail")

    def is_final(self, action: Message) -> bool:
        return self.turn >= int(self.task.data["turns"])

    async def react(self, action: Message) -> list[Message]:
        return [Message("user", f"result {self.turn}: ok")]

    @reward
    def text_hash(self, messages: list[Message]) -> float:
        text = "".join(m.content for m in messages if m.role == "assistant")
        return hashlib.sha256(text.encode()).digest()[0] / 255.0


register("LongTail-v0", LongTailEnv)
