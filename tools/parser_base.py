"""The tool-call parser contract: model text in, remaining text plus tool calls out, never an exception."""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from miles.types import Message, ToolCall

_NAME_IN_GARBAGE = re.compile(r'"name"\s*:\s*"([^"\\]{1,64})"')


@dataclass
class ParsedOutput:
    """The text outside tool calls, and the tool calls in order (ids "call_0", "call_1", ...)."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)

    def to_message(self, reasoning: str | None = None) -> Message:
        """The assistant message these parts make up."""
        return Message(role="assistant", content=self.content, tool_calls=list(self.calls), reasoning=reasoning)


def reject_constant(name: str) -> Any:
    """`parse_constant` hook refusing NaN/Infinity, which are not JSON."""
    raise ValueError(f"{name} is not valid JSON")


def loads_strict(text: str) -> Any:
    """json.loads without NaN/Infinity; raises ValueError (also for nesting too deep to decode)."""
    try:
        return json.loads(text, parse_constant=reject_constant)
    except RecursionError as exc:
        raise ValueError("JSON nested too deeply") from exc


def call_from_payload(payload: Any, index: int, raw: str, *, args_keys: tuple[str, ...]) -> ToolCall:
    """A `ToolCall` from a decoded `{"name": ..., <args key>: {...}}` payload; problems go to parse_error."""
    call_id = f"call_{index}"
    if not isinstance(payload, dict):
        return ToolCall(name="", arguments=None, id=call_id, raw_arguments=raw,
                        parse_error=f"a tool call must be a JSON object, got {type(payload).__name__}")
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(name="", arguments=None, id=call_id, raw_arguments=raw,
                        parse_error='the tool call has no "name" string')
    key = next((k for k in args_keys if k in payload), None)
    args: Any = payload[key] if key else {}
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = loads_strict(args) if args.strip() else {}
        except ValueError as exc:
            return ToolCall(name=name, arguments=None, id=call_id, raw_arguments=payload[key],
                            parse_error=f"invalid JSON in arguments: {exc}")
    if not isinstance(args, dict):
        return ToolCall(name=name, arguments=None, id=call_id, raw_arguments=json.dumps(args, ensure_ascii=False),
                        parse_error=f"arguments must be a JSON object, got {type(args).__name__}")
    return ToolCall(name=name, arguments=args, id=call_id, raw_arguments=json.dumps(args, ensure_ascii=False))


def garbage_call(body: str, index: int, error: str) -> ToolCall:
    """A call whose body is not JSON; keeps a recognisable name for the error message when there is one."""
    match = _NAME_IN_GARBAGE.search(body)
    return ToolCall(name=match.group(1) if match else "", arguments=None, id=f"call_{index}",
                    raw_arguments=body, parse_error=error)


class ToolCallParser(ABC):
    """Base of all tool-call parsers. Subclasses implement `_parse` and `render`.

    `parse` is the public entry: it accepts any input and never raises (an internal failure returns the
    whole text as content, with no calls).
    """

    name: str = ""

    def parse(self, text: str) -> ParsedOutput:
        """Split model text into content and tool calls. Never raises."""
        if not isinstance(text, str):
            text = "" if text is None else str(text)
        try:
            return self._parse(text)
        except Exception:
            return ParsedOutput(content=text.strip(), calls=[])

    @abstractmethod
    def _parse(self, text: str) -> ParsedOutput:
        """The format-specific parse; may assume `text` is a str."""

    @abstractmethod
    def render(self, content: str, calls: list[ToolCall]) -> str:
        """The text a model would emit for `content` and `calls`; `parse(render(c, k))` gives them back."""
