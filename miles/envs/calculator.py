"""`Calculator-v0`: arithmetic problems solved with a `calculate` tool, scored by a strict reward.

The expected dialogue:
    user: "What is 3 + 4 * 2?"
    assistant: calls calculate({"expression": "3 + 4 * 2"})
    tool: "11"
    assistant: "The answer is 11."

`correct` is 1 only when the final message is exactly "The answer is N." with the right N *and* an
earlier `calculate` call ran without error and returned N. Degenerate outputs (no tool use, extra text,
a bare number, repeated tags) score 0, so a policy cannot be rewarded for guessing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from miles.envs.arith import CalculatorError, evaluate, format_number
from miles.envs.base import OraclePolicy
from miles.envs.hooks import reward
from miles.envs.tasks import SPLITS, Task, TaskSource
from miles.envs.tool_env import ToolEnv
from miles.tools import tool
from miles.types import Message, ToolCall

ANSWER_RE = re.compile(r"The answer is (-?\d+)\.")
ALLOWED_OPERATORS = "+-*/"


class CalculatorConfigError(ValueError):
    """The task generator was configured with values that cannot produce tasks."""


def make_problem(
    rng: np.random.Generator,
    *,
    max_operand: int = 9,
    num_operators: tuple[int, int] = (1, 1),
    operators: str = "+-*",
    allow_negative: bool = False,
    max_tries: int = 1000,
) -> Task:
    """One arithmetic task with a whole-number answer (resampled until the answer qualifies)."""
    lo, hi = num_operators
    for _ in range(max_tries):
        k = int(rng.integers(lo, hi + 1))
        nums = [int(rng.integers(0, max_operand + 1)) for _ in range(k + 1)]
        ops = [operators[int(rng.integers(len(operators)))] for _ in range(k)]
        expr = str(nums[0]) + "".join(f" {op} {n}" for op, n in zip(ops, nums[1:], strict=True))
        try:
            value = evaluate(expr)
        except CalculatorError:
            continue  # division by zero
        if value.denominator != 1 or (value < 0 and not allow_negative):
            continue
        return Task(id="", prompt=f"What is {expr}?", answer=int(value), data={"expression": expr})
    raise CalculatorConfigError(f"no whole-number problem found in {max_tries} draws")


class CalculatorOracle(OraclePolicy):
    """Calls `calculate` with the task's expression, then answers with the tool's result."""

    def act(self, messages: list[Message]) -> Message:
        tool_msgs = [m for m in messages if m.role == "tool"]
        if not tool_msgs:
            expr = self.task.data["expression"]
            return Message(
                role="assistant",
                content="",
                tool_calls=[
                    ToolCall(
                        name="calculate",
                        arguments={"expression": expr},
                        id="call_0",
                        raw_arguments=f'{{"expression": "{expr}"}}',
                    )
                ],
            )
        return Message(role="assistant", content=f"The answer is {tool_msgs[-1].content}.")


class CalculatorEnv(ToolEnv):
    """Arithmetic with a calculator tool.

    Args:
        max_operand: operands are drawn from 0..max_operand.
        num_operators: (min, max) operators per problem.
        operators: the operator characters to use, a subset of "+-*/".
        allow_negative: keep problems whose answer is negative.
        seed: seed of the task generator.
        split: "all", "train" or "held_out" (a deterministic split by prompt hash).
        held_out_fraction: share of prompts that are held out.
    """

    max_turns = 4
    success_component = "correct"

    split_salt = "calculator"

    def __init__(
        self,
        *,
        max_operand: int = 9,
        num_operators: Sequence[int] = (1, 1),
        operators: str = "+-*",
        allow_negative: bool = False,
        seed: int = 0,
        split: str = "all",
        **kwargs: Any,
    ) -> None:
        lo, hi = (int(num_operators[0]), int(num_operators[1]))
        if max_operand < 0 or not 1 <= lo <= hi:
            raise CalculatorConfigError(
                f"need max_operand >= 0 and 1 <= min <= max operators, got {max_operand}, {num_operators}"
            )
        if not operators or any(op not in ALLOWED_OPERATORS for op in operators):
            raise CalculatorConfigError(f"operators must be a non-empty subset of {ALLOWED_OPERATORS!r}")
        if split not in SPLITS:
            raise CalculatorConfigError(f"split must be one of {SPLITS}, got {split!r}")
        self.config = {
            "max_operand": int(max_operand),
            "num_operators": (lo, hi),
            "operators": operators,
            "allow_negative": bool(allow_negative),
        }
        self._seed = seed
        super().__init__(split=split, **kwargs)

    def default_tasks(self) -> TaskSource:
        cfg = self.config
        return TaskSource.from_generator(
            lambda rng: make_problem(rng, **cfg), seed=self._seed, name="calculator"
        )

    @tool
    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly.

        Args:
            expression: arithmetic such as 3 + 4 * 2 (also / // % ** and parentheses).
        """
        return format_number(evaluate(expression))

    def oracle(self) -> CalculatorOracle:
        return CalculatorOracle().bind(self)

    def _tool_results(self, state: dict[str, Any]) -> list[str]:
        return [
            c["content"]
            for c in state.get("tool_calls", [])
            if c["name"] == "calculate" and c["error"] is None
        ]

    @reward(weight=1.0)
    def correct(self, final: str, answer: Any, state: dict[str, Any]) -> float:
        """1 iff the final message is exactly "The answer is N." and a calculate call returned N."""
        expected = f"The answer is {answer}."
        return float(final.strip() == expected and str(answer) in self._tool_results(state))

    @reward(weight=0.0)
    def used_tool(self, state: dict[str, Any]) -> float:
        """1 if at least one calculate call ran without error."""
        return float(bool(self._tool_results(state)))

    @reward(weight=0.0, name="format")
    def answer_format(self, final: str) -> float:
        """1 if the final message has the exact shape "The answer is <integer>."."""
        return float(ANSWER_RE.fullmatch(final.strip()) is not None)
