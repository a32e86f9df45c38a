"""Tool-call contracts at the env level: a bank-like ToolEnv with `transfer(amount: int)` driven by model text,
and Qwen3 thinking output through Calculator's exact-answer check."""

from __future__ import annotations

import json

import pytest

from miles.envs import ToolEnv, reward
from miles.envs.calculator import CalculatorEnv
from miles.tools import tool
from miles.types import Message


class BankEnv(ToolEnv):
    """Two accounts; the task is to move 30 from alice to bob."""

    max_turns = 6

    async def on_reset(self, task):
        self.state["balances"] = {"alice": 100, "bob": 0}

    @tool
    def transfer(self, source: str, target: str, amount: int) -> str:
        """Move whole units between accounts.

        Args:
            source: The account to take from.
            target: The account to pay into.
            amount: How many whole units.
        """
        balances = self.state["balances"]
        balances[source] -= amount
        balances[target] += amount
        return f"moved {amount}"

    @tool
    def balance(self, account: str) -> int:
        """The balance of an account.

        Args:
            account: The account name.
        """
        return self.state["balances"][account]

    @reward(weight=1.0)
    def final_state(self, state, answer) -> float:
        return float(json.dumps(state["balances"]) == json.dumps(answer))  # 70.0 would not match 70


TASKS = [{"prompt": "Move 30 from alice to bob.", "answer": {"alice": 70, "bob": 30}}]


def transfer_text(amount: str) -> str:
    return (
        '<tool_call>\n{"name": "transfer", "arguments": {"source": "alice", "target": "bob", "amount": '
        f"{amount}}}}}\n</tool_call>"
    )


def test_integral_float_amount_leaves_integer_balances():
    env = BankEnv(TASKS)
    env.reset(seed=0)
    obs, _, terminated, _, info = env.step(transfer_text("30.0"))
    assert [m.content for m in obs] == ["moved 30"] and not terminated
    assert info["tool_errors"]["schema_violation"] == 0
    assert env.state["balances"] == {"alice": 70, "bob": 30}
    assert all(type(v) is int for v in env.state["balances"].values())
    obs, _, _, _, _ = env.step(
        '<tool_call>{"name": "balance", "arguments": {"account": "alice"}}</tool_call>'
    )
    assert obs[0].content == "70"
    _, reward_value, terminated, _, info = env.step("Done.")
    assert terminated and reward_value == 1.0 and info["success"]


@pytest.mark.parametrize(
    ("amount", "kind", "needle"),
    [
        ("30.5", "schema_violation", "at 'amount': 30.5 is not of type 'integer'"),
        ("true", "schema_violation", "at 'amount': True is not of type 'integer'"),
        ("1e400", "invalid_json", "the number 1e400 is out of range"),
        ("NaN", "invalid_json", "NaN is not valid JSON"),
    ],
)
def test_bad_amount_is_an_error_message_and_the_episode_goes_on(amount, kind, needle):
    env = BankEnv(TASKS)
    env.reset(seed=0)
    obs, _, terminated, truncated, info = env.step(transfer_text(amount))
    [message] = obs
    assert message.role == "tool" and message.content.startswith("Error: ") and needle in message.content
    assert not terminated and not truncated and info["tool_errors"][kind] == 1
    assert env.state["balances"] == {"alice": 100, "bob": 0}  # nothing moved
    obs, _, _, _, _ = env.step(transfer_text("30"))
    assert obs[0].content == "moved 30"
    _, reward_value, terminated, _, _ = env.step("Done.")
    assert terminated and reward_value == 1.0


class Qwen3Calculator(CalculatorEnv):
    parser = "qwen3"


def qwen3_episode(env: CalculatorEnv) -> tuple[float, list[Message]]:
    """A Qwen3 model that follows its template: it thinks, calls the tool, thinks, answers."""
    env.reset(seed=3)
    expression, answer = env.task.data["expression"], env.task.answer
    call = json.dumps({"name": "calculate", "arguments": {"expression": expression}})
    obs, _, _, _, _ = env.step(
        f"<think>\nI should not do {expression} in my head.\n</think>\n\n<tool_call>\n{call}\n</tool_call>"
    )
    assert obs[0].content == str(answer)
    _, reward_value, terminated, _, _ = env.step(
        f"<think>\nThe tool says {answer}.\n</think>\n\nThe answer is {answer}."
    )
    assert terminated
    return reward_value, [m for m in env.messages if m.role == "assistant"]


def test_qwen3_thinking_passes_the_exact_answer_check():
    reward_value, (first, last) = qwen3_episode(Qwen3Calculator())
    assert reward_value == 1.0
    assert first.reasoning.startswith("I should not do") and first.content == "" and first.tool_calls
    assert last.reasoning.startswith("The tool says") and last.content.startswith("The answer is")
    # the hermes parser leaves the think block in the content, and the same episode scores 0
    reward_value, (_, last) = qwen3_episode(CalculatorEnv())
    assert reward_value == 0.0 and last.content.startswith("<think>") and last.reasoning is None
