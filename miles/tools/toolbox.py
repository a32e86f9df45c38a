"""`ToolBox`: validate and run a turn's tool calls concurrently; every failure becomes a `ToolResult`."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import inspect
import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from miles.tools.errors import ToolDefinitionError
from miles.tools.spec import ArgumentConversionError, ToolSpec, build_spec, get_spec
from miles.tools.threads import tool_pool
from miles.types import ToolCall, ToolErrorType, ToolResult


def _json_fallback(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)


def format_output(value: Any) -> str:
    """The text a tool's return value becomes: a str as is, anything else as JSON (str() as a last resort)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=_json_fallback)
    except (TypeError, ValueError):
        return str(value)


def truncate_output(text: str, limit: int) -> tuple[str, bool]:
    """(text cut to `limit` characters plus a marker saying so, True) or (text, False) when it fits."""
    if len(text) <= limit:
        return text, False
    return f"{text[:limit]}\n[output truncated: {len(text)} characters, limit {limit}]", True


def count_errors(results: Iterable[ToolResult]) -> dict[str, int]:
    """Counts per `ToolErrorType` value (every type present, zeros included), for `info["tool_errors"]`."""
    counts = {t.value: 0 for t in ToolErrorType}
    for r in results:
        if r.error is not None:
            counts[r.error.value] += 1
    return counts


class ToolBox:
    """A set of tools for one environment, and their executor.

    `execute` never raises on a model's call: invalid JSON, an unknown tool, a schema violation
    (jsonschema Draft 2020-12), an exception in the tool, a timeout and oversize output each give a
    `ToolResult` with `error` set and a precise message as content. Parallel calls run concurrently:
    async tools on the event loop, sync ones on the process's daemon worker threads (`tool_pool`). A sync
    tool that overruns its timeout gets a timeout result at the deadline; its thread cannot be killed and
    finishes on its own.
    """

    def __init__(
        self,
        tools: Iterable[Callable[..., Any]],
        *,
        default_timeout_s: float = 10.0,
        max_output_chars: int = 4096,
        context: Mapping[str, Any] | None = None,
    ) -> None:
        if not default_timeout_s > 0:
            raise ValueError(f"default_timeout_s must be positive, got {default_timeout_s!r}")
        if max_output_chars < 1:
            raise ValueError(f"max_output_chars must be >= 1, got {max_output_chars!r}")
        self.default_timeout_s = default_timeout_s
        self.max_output_chars = max_output_chars
        self.context: Mapping[str, Any] = dict(context or {})
        self._tools: dict[str, tuple[ToolSpec, Callable[..., Any]]] = {}
        for fn in tools:
            spec = get_spec(fn) or build_spec(fn)
            if spec.takes_self and not inspect.ismethod(fn):
                raise ToolDefinitionError(
                    f"tool '{spec.name}' is a method; pass it bound to an instance (see collect_tools(obj))"
                )
            if spec.name in self._tools:
                raise ToolDefinitionError(f"duplicate tool name '{spec.name}'")
            self._tools[spec.name] = (spec, fn)

    @property
    def names(self) -> list[str]:
        """Tool names, in the order given."""
        return list(self._tools)

    @property
    def specs(self) -> list[ToolSpec]:
        return [spec for spec, _ in self._tools.values()]

    def spec(self, name: str) -> ToolSpec:
        """The spec of tool `name` (KeyError when unknown)."""
        return self._tools[name][0]

    def schemas(self) -> list[dict[str, Any]]:
        """OpenAI function schemas of all tools, for the chat template's `tools=`."""
        return [spec.openai_schema() for spec in self.specs]

    def __len__(self) -> int:
        return len(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    async def execute(self, calls: list[ToolCall]) -> list[ToolResult]:
        """Run `calls` concurrently and return one result per call, in call order. Never raises."""
        if not calls:
            return []
        return list(await asyncio.gather(*(self._execute_one(c) for c in calls)))

    def execute_sync(self, calls: list[ToolCall]) -> list[ToolResult]:
        """`execute` for callers without an event loop (in a running loop's thread, it uses a helper thread)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.execute(calls))
        box: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: box.setdefault("r", asyncio.run(self.execute(calls))))
        worker.start()
        worker.join()
        return box["r"]

    async def _execute_one(self, call: ToolCall) -> ToolResult:
        start = time.perf_counter()
        try:
            result = await self._run(call)
        except Exception as exc:  # a bug in the executor itself must still not end the episode
            result = ToolResult(
                call.id,
                call.name,
                f"Error: internal error running tool '{call.name}': {type(exc).__name__}: {exc}",
                ToolErrorType.TOOL_EXCEPTION,
            )
        result.duration_s = time.perf_counter() - start
        return result

    def _error(self, call: ToolCall, kind: ToolErrorType, message: str) -> ToolResult:
        return ToolResult(call_id=call.id, name=call.name, content=f"Error: {message}", error=kind)

    async def _run(self, call: ToolCall) -> ToolResult:
        if call.parse_error is not None or not isinstance(call.arguments, dict):
            reason = call.parse_error or "arguments are missing or not a JSON object"
            raw = call.raw_arguments if len(call.raw_arguments) <= 200 else call.raw_arguments[:200] + "..."
            label = f"tool call '{call.name}'" if call.name else "tool call"
            return self._error(
                call,
                ToolErrorType.INVALID_JSON,
                f"could not parse the {label}: {reason}. Raw arguments: {raw!r}. "
                'Send a JSON object such as {"name": "...", "arguments": {...}}.',
            )
        entry = self._tools.get(call.name)
        if entry is None:
            return self._error(
                call,
                ToolErrorType.UNKNOWN_TOOL,
                f"unknown tool '{call.name}'. Available tools: {', '.join(self._tools) or 'none'}.",
            )
        spec, fn = entry
        problems = spec.validation_errors(call.arguments)
        if problems:
            return self._error(
                call,
                ToolErrorType.SCHEMA_VIOLATION,
                f"invalid arguments for tool '{spec.name}': " + "; ".join(problems),
            )
        try:
            args, kwargs = spec.bind_arguments(call.arguments, self.context)
        except ArgumentConversionError as exc:
            return self._error(
                call, ToolErrorType.SCHEMA_VIOLATION, f"invalid arguments for tool '{spec.name}': {exc}"
            )
        except KeyError as exc:
            return self._error(
                call,
                ToolErrorType.TOOL_EXCEPTION,
                f"tool '{spec.name}' needs the injected value {exc.args[0]!r}, which the "
                "environment did not provide",
            )
        timeout = spec.timeout_s or self.default_timeout_s
        future: asyncio.Future[Any]
        if spec.is_async:
            future = asyncio.ensure_future(fn(*args, **kwargs))
        else:
            future = asyncio.wrap_future(tool_pool().submit(fn, *args, **kwargs))
        done, _ = await asyncio.wait({future}, timeout=timeout)
        if not done:
            future.cancel()
            future.add_done_callback(_consume)
            return self._error(
                call, ToolErrorType.TIMEOUT, f"tool '{spec.name}' timed out after {timeout:g} s"
            )
        exc = future.exception() if not future.cancelled() else asyncio.CancelledError("tool was cancelled")
        if exc is not None:
            return self._error(
                call, ToolErrorType.TOOL_EXCEPTION, f"tool '{spec.name}' raised {type(exc).__name__}: {exc}"
            )
        text, truncated = truncate_output(
            format_output(future.result()), spec.max_output_chars or self.max_output_chars
        )
        return ToolResult(
            call_id=call.id,
            name=call.name,
            content=text,
            error=ToolErrorType.OUTPUT_TRUNCATED if truncated else None,
        )


def _consume(future: asyncio.Future[Any]) -> None:
    """Retrieve a late outcome so asyncio does not log 'exception was never retrieved'."""
    if not future.cancelled():
        future.exception()
