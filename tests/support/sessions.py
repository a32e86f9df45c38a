"""Environments, scripts and engines shared by the session, scheduler and replay tests (no tests here)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from miles.engine import EngineError, GenerateResult, RolloutEngine, SamplingParams
from miles.envs import TaskSource, ToolEnv, reward
from miles.tiny import load_tiny_tokenizer
from miles.tito import TITOTokenizer
from miles.tools import ParsedOutput, ToolCallParser, register_parser, tool
from miles.types import ToolCall

TASKS = [{"id": f"t{i}", "prompt": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1)} for i in range(8)]

_TITO: TITOTokenizer | None = None


def tito() -> TITOTokenizer:
    global _TITO
    if _TITO is None:
        _TITO = TITOTokenizer(load_tiny_tokenizer())
    return _TITO


def ids(text: str, *, stop: bool = True) -> list[int]:
    """Token ids the tiny model would emit for `text`, ending with its stop token."""
    t = tito()
    out = t.tokenizer.encode(text, add_special_tokens=False)
    return out + [t.stop_token_ids[0]] if stop else out


def call_text(name: str, **arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


class AddEnv(ToolEnv):
    """Add two numbers with a tool, then answer. `slow` tasks (data) make `add` sleep that long."""

    env_id = "Add-v0"
    max_turns = 4
    tool_timeout_s = 0.3

    def default_tasks(self) -> TaskSource:
        return TaskSource.from_iterable(TASKS)

    @tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first.
            b: the second.
        """
        return a + b

    @tool(timeout_s=0.3)
    async def hang(self) -> str:
        """Never returns."""
        await asyncio.Event().wait()
        return "unreachable"

    @tool(timeout_s=0.3)
    def hang_sync(self) -> str:
        """Blocks its thread for a while."""
        import time

        time.sleep(1.0)
        return "late"

    @tool
    async def nap(self, seconds: float) -> str:
        """Sleep.

        Args:
            seconds: how long.
        """
        await asyncio.sleep(seconds)
        return "rested"

    @reward
    def correct(self, final: str, answer: str) -> float:
        return float(final.strip() == answer)


class ResetFailsEnv(AddEnv):
    env_id = "ResetFails-v0"

    async def on_reset(self, task: Any) -> None:
        raise RuntimeError("database unavailable")


class StepFailsEnv(AddEnv):
    env_id = "StepFails-v0"

    async def react(self, action: Any) -> list:
        raise RuntimeError("the env crashed in step")


class StuckEnv(AddEnv):
    env_id = "Stuck-v0"

    async def react(self, action: Any) -> list:
        await asyncio.Event().wait()  # ignores every tool timeout: only the session's step deadline helps
        return []


class AlwaysCallParser(ToolCallParser):
    """A parser for runs against a random-weights model: every output becomes one call of `TOOL`,
    with the model's text as `raw_arguments` (so the arguments are garbage JSON unless `ARGS` is set)."""

    name = "test-always-add"
    TOOL = "add"
    ARGS: dict[str, Any] | None = {"a": 1, "b": 2}

    def render(self, content: str, calls: list[ToolCall]) -> str:
        return content

    def _parse(self, text: str) -> ParsedOutput:
        if self.ARGS is None:
            return ParsedOutput(
                content="",
                calls=[
                    ToolCall(
                        name=self.TOOL,
                        arguments=None,
                        id="call_0",
                        raw_arguments=text,
                        parse_error="not JSON",
                    )
                ],
            )
        return ParsedOutput(
            content="",
            calls=[
                ToolCall(
                    name=self.TOOL,
                    arguments=dict(self.ARGS),
                    id="call_0",
                    raw_arguments=json.dumps(self.ARGS),
                )
            ],
        )


class HangParser(AlwaysCallParser):
    TOOL = "hang"
    ARGS = {}


class GarbageArgsParser(AlwaysCallParser):
    ARGS = None


register_parser("test-always-add", AlwaysCallParser)
register_parser("test-always-hang", HangParser)
register_parser("test-garbage-args", GarbageArgsParser)


class FlakyEngine(RolloutEngine):
    """Wraps an engine; the calls numbered in `fail_calls` (0-based, over all calls) raise `error` instead."""

    def __init__(
        self, inner: RolloutEngine, fail_calls: set[int], *, retryable: bool = True, engine_id: str = "flaky"
    ) -> None:
        self.inner = inner
        self.fail_calls = fail_calls
        self.retryable = retryable
        self.engine_id = engine_id
        self.calls = 0

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams,
        *,
        session_id: str | None = None,
        rid: str | None = None,
    ) -> GenerateResult:
        n = self.calls
        self.calls += 1
        if n in self.fail_calls:
            raise EngineError(
                f"{self.engine_id}: call {n} failed", engine_id=self.engine_id, retryable=self.retryable
            )
        result = await self.inner.generate(input_ids, sampling_params, session_id=session_id, rid=rid)
        result.engine_id = self.engine_id
        return result

    async def abort(self, rid: str) -> None:
        await self.inner.abort(rid)

    async def health(self) -> bool:
        return True

    async def update_weights(
        self, *, state_dict: dict[str, Any] | None = None, path: str | None = None, version: int | None = None
    ) -> int:
        return await self.inner.update_weights(state_dict=state_dict, path=path, version=version)

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version
