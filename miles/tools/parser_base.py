"""The tool-call parser contract: model text in, remaining text plus tool calls out, never an exception."""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from miles.types import STRICT_JSON, Message, ToolCall, loads_strict

__all__ = [
    "STRICT_JSON",
    "ParsedOutput",
    "ToolCallParser",
    "arguments_json",
    "call_from_payload",
    "garbage_call",
    "loads_strict",
    "member_text",
]

_NAME_IN_GARBAGE = re.compile(r'"name"\s*:\s*"([^"\\]{1,64})"')
_JSON_SPACE = " \t\n\r"


@dataclass
class ParsedOutput:
    """The text outside tool calls, the tool calls in order (ids "call_0", "call_1", ...), and the model's
    reasoning (thinking) when the parser separates it (None when there was none)."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    reasoning: str | None = None

    def to_message(self) -> Message:
        """The assistant message these parts make up."""
        return Message(
            role="assistant", content=self.content, tool_calls=list(self.calls), reasoning=self.reasoning
        )


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _JSON_SPACE:
        pos += 1
    return pos


def member_text(source: str, key: str) -> str | None:
    """The exact source text of member `key` of the JSON object `source` (the last one when repeated, as
    json.loads keeps), or None when `source` is not an object holding `key`."""
    found = None
    try:
        pos = _skip_space(source, 0)
        if source[pos] != "{":
            return None
        pos = _skip_space(source, pos + 1)
        if source[pos] == "}":
            return None
        while True:
            name, pos = STRICT_JSON.raw_decode(source, pos)
            pos = _skip_space(source, pos)
            if source[pos] != ":":
                return None
            start = _skip_space(source, pos + 1)
            _, end = STRICT_JSON.raw_decode(source, start)
            if name == key:
                found = source[start:end]
            pos = _skip_space(source, end)
            if source[pos] == "}":
                return found
            if source[pos] != ",":
                return None
            pos = _skip_space(source, pos + 1)
    except (ValueError, IndexError, RecursionError):
        return None


def call_from_payload(payload: Any, index: int, raw: str, *, args_keys: tuple[str, ...]) -> ToolCall:
    """A `ToolCall` from a decoded `{"name": ..., <args key>: {...}}` payload; problems go to parse_error.

    `raw` is the payload's JSON text; the call's `raw_arguments` is the exact text of its arguments in it.
    """
    call_id = f"call_{index}"
    if not isinstance(payload, dict):
        return ToolCall(
            name="",
            arguments=None,
            id=call_id,
            raw_arguments=raw,
            parse_error=f"a tool call must be a JSON object, got {type(payload).__name__}",
        )
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(
            name="",
            arguments=None,
            id=call_id,
            raw_arguments=raw,
            parse_error='the tool call has no "name" string',
        )
    key = next((k for k in args_keys if k in payload), None)
    args: Any = payload[key] if key else {}
    if isinstance(args, str):  # some models emit the arguments as a JSON string; that string is their text
        text = args
        try:
            args = loads_strict(args) if args.strip() else {}
        except ValueError as exc:
            return ToolCall(
                name=name,
                arguments=None,
                id=call_id,
                raw_arguments=text,
                parse_error=f"invalid JSON in arguments: {exc}",
            )
    else:
        text = (member_text(raw, key) if key else None) or json.dumps(args, ensure_ascii=False)
    if not isinstance(args, dict):
        return ToolCall(
            name=name,
            arguments=None,
            id=call_id,
            raw_arguments=text,
            parse_error=f"arguments must be a JSON object, got {type(args).__name__}",
        )
    return ToolCall(name=name, arguments=args, id=call_id, raw_arguments=text)


def arguments_json(call: ToolCall) -> str:
    """The JSON text of a call's arguments for rendering: the original text when there is one (see
    `ToolCall.arguments_text`), else the serialised arguments (`{}` when there are none)."""
    text = call.arguments_text
    if text is not None:
        return text
    return json.dumps(call.arguments if call.arguments is not None else {}, ensure_ascii=False)


def garbage_call(body: str, index: int, error: str) -> ToolCall:
    """A call whose body is not JSON; keeps a recognisable name for the error message when there is one."""
    match = _NAME_IN_GARBAGE.search(body)
    return ToolCall(
        name=match.group(1) if match else "",
        arguments=None,
        id=f"call_{index}",
        raw_arguments=body,
        parse_error=error,
    )


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
