"""Env / ToolEnv / hooks / spaces / registry: the gymnasium contract and the error paths."""

from __future__ import annotations

import asyncio
import json
import threading

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import miles.envs as E
from miles.envs import (
    Env,
    EpisodeOverError,
    HookDefinitionError,
    HookError,
    InvalidActionError,
    NoOracleError,
    RegistryError,
    ResetNeededError,
    Task,
    ToolEnv,
    UnknownEnvError,
    cleanup,
    reward,
    stop_condition,
)
from miles.tools import Injected, tool
from miles.types import Message, ToolCall

ROWS = [{"id": f"t{i}", "prompt": f"say {i}", "answer": str(i)} for i in range(5)]


class EchoEnv(Env):
    """A plain env: one turn, reward for repeating the answer."""

    @reward(weight=2.0)
    def exact(self, final: str, answer: str) -> float:
        return float(final == answer)

    @reward(weight=0.5, name="short")
    def brevity(self, final: str) -> float:
        return float(len(final) <= 3)


class CounterEnv(ToolEnv):
    max_turns = 4

    def __init__(self, **kw):
        self.cleaned = []
        super().__init__(ROWS, **kw)

    @tool
    def add(self, x: int, counter: Injected[dict]) -> int:
        """Add x to the episode counter.

        Args:
            x: amount to add.
        """
        counter["n"] = counter.get("n", 0) + x
        return counter["n"]

    @tool
    def boom(self) -> str:
        """Always fails."""
        raise ValueError("kaput")

    @tool(timeout_s=0.2)
    async def slow(self) -> str:
        """Sleeps too long."""
        await asyncio.sleep(5)
        return "late"

    @tool(max_output_chars=10)
    def big(self) -> str:
        """Returns a long text."""
        return "x" * 100

    def tool_context(self):
        return {**super().tool_context(), "counter": self.state.setdefault("counter", {})}

    @stop_condition
    def reached_ten(self, state) -> bool:
        return state.get("counter", {}).get("n", 0) >= 10

    @reward
    def counted(self, state) -> float:
        return float(state.get("counter", {}).get("n", 0) >= 10)

    @cleanup
    def done(self, task) -> None:
        self.cleaned.append(task.id)


def call(name, args, i=0):
    return ToolCall(name=name, arguments=args, id=f"call_{i}", raw_arguments=json.dumps(args))


def test_plain_env_weighted_reward_components():
    env = EchoEnv(ROWS)
    obs, info = env.reset(options={"task_id": "t3"})
    assert obs == [Message("user", "say 3")] and info["task_id"] == "t3"
    obs, r, term, trunc, info = env.step(Message("assistant", "3"))
    assert (obs, term, trunc) == ([], True, False)
    assert info["reward_components"] == {"exact": 1.0, "short": 1.0}
    assert r == pytest.approx(2.5) and info["success"] is True
    env.reset(options={"task_id": "t3"})
    *_, r, _, _, info = env.step("something long")
    assert r == 0.0 and info["reward_components"] == {"exact": 0.0, "short": 0.0} and not info["success"]


def test_reward_weights_override_and_unknown_component():
    env = EchoEnv(ROWS, reward_weights={"short": 0.0})
    env.reset(options={"task_id": "t1"})
    assert env.step("1")[1] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="unknown reward component"):
        EchoEnv(ROWS, reward_weights={"nope": 1.0})


def test_misuse_raises_named_errors():
    env = EchoEnv(ROWS)
    with pytest.raises(ResetNeededError):
        env.step("x")
    env.reset(seed=0)
    with pytest.raises(InvalidActionError):
        env.step(Message("user", "hi"))
    with pytest.raises(InvalidActionError):
        env.step(42)
    env.step("x")
    with pytest.raises(EpisodeOverError):
        env.step("y")
    with pytest.raises(NoOracleError):
        env.oracle()
    with pytest.raises(E.UnknownTaskError):
        env.reset(options={"task_id": "missing"})


def test_sync_api_refuses_running_loop():
    env = EchoEnv(ROWS)

    async def inner():
        with pytest.raises(E.EnvError, match="running event loop"):
            env.reset()
        obs, _ = await env.areset(seed=1)
        return obs

    assert asyncio.run(inner())[0].role == "user"


def test_hook_definition_errors():
    with pytest.raises(HookDefinitionError, match="asks for 'banana'"):

        class Bad(Env):
            @reward
            def r(self, banana) -> float:
                return 0.0

    with pytest.raises(HookDefinitionError, match=r"\*args"):

        class Bad2(Env):
            @stop_condition
            def s(self, *args) -> bool:
                return False


def test_hook_errors_are_named():
    class Raises(Env):
        @reward
        def broken(self, final: str) -> float:
            raise ZeroDivisionError("oops")

    class NotANumber(Env):
        @reward
        def nan(self) -> float:
            return float("nan")

    for cls, pattern in ((Raises, "broken.*ZeroDivisionError"), (NotANumber, "finite number")):
        env = cls(ROWS)
        env.reset(seed=0)
        with pytest.raises(HookError, match=pattern):
            env.step("x")


def test_seeded_reset_is_deterministic_and_seeds_differ():
    env = EchoEnv(ROWS)
    picks = {env.reset(seed=s)[1]["task_id"] for s in range(40)}
    assert len(picks) > 1
    assert env.reset(seed=7)[1]["task_id"] == env.reset(seed=7)[1]["task_id"]


def test_tool_env_errors_are_counted_and_episode_goes_on():
    env = CounterEnv()
    env.reset(seed=0)
    assert [s["function"]["name"] for s in env.tool_schemas()] == ["add", "boom", "slow", "big"]
    params = env.tool_schemas()[0]["function"]["parameters"]
    assert list(params["properties"]) == ["x"]  # `counter` is injected: hidden from the schema
    bad = Message(
        "assistant",
        tool_calls=[
            ToolCall(
                name="add", arguments=None, id="call_0", raw_arguments="{x:", parse_error="invalid JSON"
            ),
            call("nope", {}, 1),
            call("add", {"x": "three"}, 2),
            call("boom", {}, 3),
            call("slow", {}, 4),
            call("big", {}, 5),
            call("add", {"x": 4}, 6),
        ],
    )
    obs, r, term, trunc, info = env.step(bad)
    assert not term and not trunc and r == 0.0
    assert [m.tool_call_id for m in obs] == [f"call_{i}" for i in range(7)]
    assert all(m.role == "tool" for m in obs) and obs[-1].content == "4"
    assert info["tool_errors"] == {
        "invalid_json": 1,
        "unknown_tool": 1,
        "schema_violation": 1,
        "tool_exception": 1,
        "timeout": 1,
        "output_truncated": 1,
    }
    assert "kaput" in obs[3].content and "nope" in obs[1].content
    # The episode goes on and state persists; reaching 10 fires the stop condition.
    obs, r, term, trunc, info = env.step(Message("assistant", tool_calls=[call("add", {"x": 6})]))
    assert obs[0].content == "10" and term and not trunc
    assert info["stop_reason"] == "reached_ten" and r == 1.0 and info["success"]
    assert env.cleaned == [env.task.id]


def test_max_turns_truncates_and_cleanup_runs_once():
    env = CounterEnv(max_turns=2)
    env.reset(seed=1)
    assert env.step(Message("assistant", tool_calls=[call("add", {"x": 1})]))[3] is False
    obs, r, term, trunc, info = env.step(Message("assistant", tool_calls=[call("add", {"x": 1})]))
    assert trunc and not term and info["termination"] == "max_turns" and r == 0.0
    env.reset(seed=2)
    env.close()
    assert len(env.cleaned) == 2  # the abandoned second episode is cleaned up by close()
    env.close()  # twice is fine


def test_parallel_tool_calls_run_concurrently():
    barrier = threading.Barrier(4, timeout=5)

    class Meet(ToolEnv):
        @tool
        def meet(self, i: int) -> int:
            """Wait until all four parallel calls have arrived.

            Args:
                i: call index.
            """
            barrier.wait()  # breaks (tool error) unless the four calls run at the same time
            return i

    env = Meet(ROWS)
    env.reset(seed=0)
    obs, *_, info = env.step(Message("assistant", tool_calls=[call("meet", {"i": i}, i) for i in range(4)]))
    assert [m.content for m in obs] == ["0", "1", "2", "3"]
    assert info["tool_errors"]["tool_exception"] == 0


def test_string_actions_are_parsed_with_the_hermes_parser():
    env = CounterEnv()
    env.reset(seed=0)
    obs = env.step('<tool_call>{"name": "add", "arguments": {"x": 2}}</tool_call>')[0]
    assert obs[0].content == "2"


def test_check_env_passes_for_plain_and_tool_envs():
    check_env(EchoEnv(ROWS), skip_render_check=True)
    check_env(CounterEnv(), skip_render_check=True)
    env = EchoEnv(ROWS, render_mode="ansi")
    env.reset(options={"task_id": "t0"})
    env.step("0")
    assert env.render() == "[user] say 0\n[assistant] 0\n"


def test_registry_and_gymnasium_make():
    E.register("Echo-test-v0", EchoEnv, tasks=ROWS)
    E.register("Echo-test-v0", EchoEnv, tasks=ROWS)  # identical re-registration is a no-op
    with pytest.raises(RegistryError, match="already registered"):
        E.register("Echo-test-v0", CounterEnv)
    env = E.make("Echo-test-v0", max_turns=3)
    assert env.env_id == "Echo-test-v0" and env.max_turns == 3
    genv = gymnasium.make("miles/Echo-test-v0")
    obs, info = genv.reset(seed=0)
    assert info["env_id"] == "Echo-test-v0" and isinstance(obs[0], Message)
    assert {"Calculator-v0", "SQL-v0", "Orders-v0", "PythonSandbox-v0"} <= set(E.registry())
    with pytest.raises(UnknownEnvError, match="did you mean Calculator-v0"):
        E.make("Calculater-v0")
    with pytest.raises(RegistryError, match="module:Name"):
        E.register("Broken-v0", "no_colon_here")
        E.make("Broken-v0")
    with pytest.raises(RegistryError, match="cannot load"):
        E.register("Broken-v1", "miles.envs:NoSuchEnv")
        E.make("Broken-v1")


def test_task_option_and_bad_task_option():
    env = EchoEnv(ROWS)
    obs, info = env.reset(options={"task": Task("custom", "say hi", "hi")})
    assert obs[-1].content == "say hi" and info["task_id"] == "custom"
    with pytest.raises(E.EnvError, match="must be a Task"):
        env.reset(options={"task": {"prompt": "x"}})


async def test_many_episodes_share_one_event_loop():
    envs = [E.make("Calculator-v0") for _ in range(16)]
    results = await asyncio.gather(*(E.arun_episode(env, seed=i) for i, env in enumerate(envs)))
    assert all(r.success for r in results)
    assert len({r.info["task_id"] for r in results}) > 1
    for env in envs:
        await env.aclose()
