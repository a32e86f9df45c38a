"""Contracts shared by every floor: chat messages, tool calls, tool results, termination reasons."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

#: The largest reward magnitude miles accepts at any entry (env reward hooks, the agent endpoint's `/reward`,
#: `miles replay --rescore`): beyond it a float32 reward batch overflows to inf and every weight becomes NaN.
MAX_ABS_REWARD = 1e6


def reward_problem(value: Any, *, bound: float = MAX_ABS_REWARD) -> str | None:
    """Why `value` cannot be a reward (not a finite number within ±`bound`), or None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{value!r} is not a number"
    if not math.isfinite(value):
        return f"{value!r} is not a finite number"
    if abs(value) > bound:
        return f"{value!r} is outside [-{bound:g}, {bound:g}]"
    return None


class TerminationReason(str, Enum):
    """Why a session ended. Every recorded session carries exactly one."""

    DONE = "done"
    MAX_TURNS = "max_turns"
    CONTEXT_FULL = "context_full"
    TIMEOUT = "timeout"
    ENV_ERROR = "env_error"
    ENGINE_ERROR = "engine_error"
    ABORTED = "aborted"


class ToolErrorType(str, Enum):
    """The ways a tool call can go wrong. The model sees a precise error; the env counts these in `info`."""

    INVALID_JSON = "invalid_json"
    UNKNOWN_TOOL = "unknown_tool"
    SCHEMA_VIOLATION = "schema_violation"
    TOOL_EXCEPTION = "tool_exception"
    TIMEOUT = "timeout"
    OUTPUT_TRUNCATED = "output_truncated"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (only finite numbers are)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} is out of range (it is not a finite double)")
    return value


#: A JSON decoder that accepts only finite numbers; `raw_decode` on it decodes one value from a position.
STRICT_JSON = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


def loads_strict(text: str) -> Any:
    """`json.loads` that accepts only standard, finite JSON.

    Raises ValueError for invalid JSON, for the NaN / Infinity / -Infinity literals, for number literals that
    overflow a double (`1e400`) anywhere in the structure, and for nesting too deep to decode.
    """
    try:
        return STRICT_JSON.decode(text)
    except RecursionError as exc:
        raise ValueError("JSON nested too deeply") from exc


def _same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values (unlike `==`, `true` differs from `1` and `1.0` from `1`); key order is ignored."""
    try:
        return json.dumps(a, sort_keys=True, allow_nan=False) == json.dumps(
            b, sort_keys=True, allow_nan=False
        )
    except (TypeError, ValueError):
        return False


@dataclass
class ToolCall:
    """One tool call parsed from model text.

    `arguments` is None when `raw_arguments` is not a JSON object; `parse_error` then says why.
    `raw_arguments` is the arguments' JSON text exactly as it arrived (the model's bytes, or an OpenAI-style
    string); rendering uses it, so a chat template reproduces those bytes instead of a re-serialisation.
    """

    name: str
    arguments: dict[str, Any] | None
    id: str = ""
    raw_arguments: str = ""
    parse_error: str | None = None

    @property
    def arguments_text(self) -> str | None:
        """`raw_arguments` when it is the JSON text of `arguments` (still in sync with it), else None."""
        if self.arguments is None or self.parse_error is not None or not self.raw_arguments.strip():
            return None
        try:
            decoded = loads_strict(self.raw_arguments)
        except ValueError:
            return None
        return self.raw_arguments if _same_json(decoded, self.arguments) else None

    def to_dict(self, *, verbatim: bool = False) -> dict[str, Any]:
        """OpenAI-style `tool_calls` entry, as chat templates expect it.

        Arguments are a dict, or the raw text when they did not parse. With `verbatim=True` they are the
        original JSON text whenever there is one (`arguments_text`): chat templates render string arguments
        as they are, so the render reproduces the original bytes (what TITO rendering needs).
        """
        args: Any = self.arguments if self.arguments is not None else self.raw_arguments
        if verbatim:
            text = self.arguments_text
            if text is not None:
                args = text
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": args}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ToolCall:
        """Inverse of `to_dict`; accepts arguments as a dict or as a JSON string (kept as `raw_arguments`)."""
        fn = data.get("function", data)
        args = fn.get("arguments")
        raw = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        parsed: dict[str, Any] | None = args if isinstance(args, dict) else None
        error = None
        if isinstance(args, str):
            try:
                value = loads_strict(args)
                parsed = value if isinstance(value, dict) else None
                if parsed is None:
                    error = "arguments are not a JSON object"
            except ValueError as exc:
                error = f"invalid JSON: {exc}"
        return cls(
            name=fn.get("name", ""),
            arguments=parsed,
            id=data.get("id", ""),
            raw_arguments=raw,
            parse_error=error,
        )


@dataclass
class Message:
    """One chat message. `reasoning` holds thinking content (Qwen3 `<think>`), kept apart from `content`."""

    role: str
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None

    def to_dict(self, *, verbatim: bool = False) -> dict[str, Any]:
        """The dict form that HF chat templates and JSONL recordings use (`verbatim`: see `ToolCall.to_dict`)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.to_dict(verbatim=verbatim) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Message:
        """Inverse of `to_dict`."""
        return cls(
            role=data["role"],
            content=data.get("content") or "",
            tool_calls=[ToolCall.from_dict(c) for c in data.get("tool_calls") or []],
            tool_call_id=data.get("tool_call_id"),
            name=data.get("name"),
            reasoning=data.get("reasoning_content"),
        )


@dataclass
class ToolResult:
    """The outcome of one tool call. `error` is None on success."""

    call_id: str
    name: str
    content: str
    error: ToolErrorType | None = None
    duration_s: float = 0.0

    def to_message(self) -> Message:
        """The tool message that goes back to the model."""
        return Message(role="tool", content=self.content, tool_call_id=self.call_id or None, name=self.name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "call_id": self.call_id,
            "name": self.name,
            "content": self.content,
            "error": self.error.value if self.error else None,
            "duration_s": self.duration_s,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ToolResult:
        err = data.get("error")
        return cls(
            call_id=data.get("call_id", ""),
            name=data.get("name", ""),
            content=data.get("content", ""),
            error=ToolErrorType(err) if err else None,
            duration_s=data.get("duration_s", 0.0),
        )
