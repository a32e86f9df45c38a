"""Calculator-v0: the safe evaluator, configurable task generation, the strict reward, the oracle."""

from __future__ import annotations

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import given, settings
from hypothesis import strategies as st

import miles.envs as E
from miles.envs.arith import CalculatorError, evaluate, format_number
from miles.envs.calculator import CalculatorConfigError, CalculatorEnv
from miles.types import Message, ToolCall

TASK = E.Task("fixed", "What is 3 + 4 * 2?", 11, {"expression": "3 + 4 * 2"})


def calc(expr: str, i: int = 0) -> Message:
    return Message("assistant", tool_calls=[ToolCall("calculate", {"expression": expr}, f"call_{i}")])


def play(env, actions, task=TASK):
    env.reset(options={"task": task})
    for a in actions:
        obs, r, term, trunc, info = env.step(a)
        if term or trunc:
            return obs, r, info
    raise AssertionError("episode did not end")


def test_the_exact_expected_dialogue():
    env = E.make("Calculator-v0")
    obs, _ = env.reset(options={"task": TASK})
    assert obs == [Message("user", "What is 3 + 4 * 2?")]
    oracle = env.oracle()
    first = oracle.act(obs)
    assert first.tool_calls[0].name == "calculate" and first.tool_calls[0].arguments == {
        "expression": "3 + 4 * 2"
    }
    tool_obs, r, term, *_ = env.step(first)
    assert [m.content for m in tool_obs] == ["11"] and tool_obs[0].role == "tool" and not term
    final = oracle.act([*obs, first, *tool_obs])
    assert final.content == "The answer is 11."
    _, r, term, trunc, info = env.step(final)
    assert (r, term, trunc, info["success"]) == (1.0, True, False, True)
    assert info["reward_components"] == {"correct": 1.0, "used_tool": 1.0, "format": 1.0}


def test_oracle_succeeds_on_every_task_of_several_configs():
    for cfg in (
        {},
        {"max_operand": 99, "num_operators": (1, 2)},
        {"operators": "+-*/", "num_operators": (2, 3)},
    ):
        env = E.make("Calculator-v0", **cfg)
        results = [E.run_episode(env, seed=s) for s in range(30)]
        assert all(r.success and r.reward == 1.0 for r in results), cfg


@pytest.mark.parametrize(
    "actions",
    [
        ["11"],  # a bare number, no tool
        ["The answer is 11."],  # right text but no tool use
        [calc("3 + 4 * 2"), "The answer is 11. Hope that helps!"],  # extra text
        [calc("3 + 4 * 2"), "the answer is 11."],  # wrong case
        [calc("3 + 4 * 2"), "The answer is 12."],  # wrong number
        [calc("3 + 4 * 2"), "0"],
        [calc("3 + 4 * 2"), '"0' + "</tool_call>" * 30],  # the reward hack seen in LEARNING.md
        ["</tool_call></tool_call></tool_call>"],
        [calc("2 + 2"), "The answer is 11."],  # tool never returned 11
        [
            Message("assistant", tool_calls=[ToolCall("calculate", None, "call_0", "{oops", "invalid JSON")]),
            "The answer is 11.",
        ],
        [calc("3 +"), "The answer is 11."],  # tool error
        [""],
    ],
)
def test_degenerate_outputs_score_zero_on_correct(actions):
    env = E.make("Calculator-v0")
    _, r, info = play(env, actions)
    assert info["reward_components"]["correct"] == 0.0 and r == 0.0 and info["success"] is False


def test_truncation_scores_zero_and_small_component_weights_are_configurable():
    env = E.make("Calculator-v0", max_turns=2, reward_weights={"format": 0.1, "used_tool": 0.05})
    _, r, info = play(env, [calc("3 + 4 * 2"), calc("1 + 1", 1)])
    assert info["termination"] == "max_turns" and info["reward_components"]["correct"] == 0.0
    assert r == pytest.approx(0.05)
    _, r, info = play(env, [calc("3 + 4 * 2"), "The answer is 11."])
    assert r == pytest.approx(1.15) and info["success"]


def test_tool_errors_are_counted_and_the_episode_goes_on():
    env = E.make("Calculator-v0")
    env.reset(options={"task": TASK})
    obs, _, term, _, info = env.step(
        Message(
            "assistant",
            tool_calls=[
                ToolCall("calculate", {"expression": "1/0"}, "call_0"),
                ToolCall("calc", {}, "call_1"),
                ToolCall("calculate", {"expr": "1"}, "call_2"),
                ToolCall("calculate", {"expression": "__import__('os')"}, "call_3"),
            ],
        )
    )
    assert not term and "division by zero" in obs[0].content and "unknown tool" in obs[1].content
    assert info["tool_errors"]["tool_exception"] == 2 and info["tool_errors"]["unknown_tool"] == 1
    assert info["tool_errors"]["schema_violation"] == 1
    obs, *_ = env.step(calc("3 + 4 * 2", 4))
    _, r, *_ = env.step("The answer is 11.")
    assert r == 1.0


def test_generator_config_is_respected():
    env = E.make("Calculator-v0", max_operand=5, num_operators=(2, 3), operators="+*")
    for task in env.tasks.take(200):
        expr = task.data["expression"]
        nums = [int(x) for x in expr.split() if x.isdigit()]
        ops = [x for x in expr.split() if not x.isdigit()]
        assert all(0 <= n <= 5 for n in nums) and 2 <= len(ops) <= 3 and set(ops) <= {"+", "*"}
        assert task.prompt == f"What is {expr}?" and task.answer == evaluate(expr) and task.answer >= 0
    div = E.make("Calculator-v0", operators="/", max_operand=20)
    assert all(isinstance(t.answer, int) for t in div.tasks.take(100))
    for bad in ({"operators": "^"}, {"num_operators": (2, 1)}, {"max_operand": -1}, {"split": "test"}):
        with pytest.raises(CalculatorConfigError):
            CalculatorEnv(**bad)


def test_train_and_held_out_prompts_are_disjoint():
    train = E.make("Calculator-v0", split="train", max_operand=20).tasks.take(300)
    held = E.make("Calculator-v0", split="held_out", max_operand=20).tasks.take(60)
    assert not {t.prompt for t in train} & {t.prompt for t in held}


def test_check_env_and_gymnasium_make():
    check_env(gymnasium.make("miles/Calculator-v0").unwrapped)
    env = gymnasium.make("miles/Calculator-v0", max_operand=3)
    obs, info = env.reset(seed=5)
    assert obs[0].content.startswith("What is ")


def test_evaluator_rejects_non_arithmetic():
    assert format_number(evaluate("3 + 4 * 2")) == "11" and format_number(evaluate("7 / 2")) == "3.5"
    assert format_number(evaluate("-(2 ** 10) // 3")) == "-342"
    for bad in (
        "__import__('os').system('x')",
        "a + 1",
        "[1, 2]",
        "1 if 1 else 2",
        "9 ** 9 ** 9",
        "",
        "1/0",
        "(" * 300 + "1" + ")" * 300,
        "2 ** 0.5",
        "'a' * 3",
    ):
        with pytest.raises(CalculatorError):
            evaluate(bad)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_evaluator_never_raises_anything_but_calculator_error(text):
    try:
        evaluate(text)
    except CalculatorError:
        pass


@settings(max_examples=100, deadline=None)
@given(st.integers(-1000, 1000), st.integers(-1000, 1000), st.sampled_from("+-*"))
def test_evaluator_agrees_with_python_on_integers(a, b, op):
    assert evaluate(f"{a} {op} ({b})") == {"+": a + b, "-": a - b, "*": a * b}[op]
