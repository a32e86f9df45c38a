"""Hermes / Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, several per message."""

from __future__ import annotations

import json
import re

from miles.tools.parser_base import (
    ParsedOutput,
    ToolCallParser,
    arguments_json,
    call_from_payload,
    garbage_call,
    loads_strict,
)
from miles.types import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# A block is closed by </tool_call>, or runs to the end of the text when the model stopped before closing.
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


class HermesParser(ToolCallParser):
    """Parses the Hermes/Qwen2.5/Qwen3 format. Text outside the blocks is the content (stripped).

    A block whose body is not a JSON object becomes a call with `parse_error` set, so the executor answers
    with an INVALID_JSON error instead of dropping it. An unclosed last block is parsed up to the end.
    """

    name = "hermes"

    def _parse(self, text: str) -> ParsedOutput:
        calls: list[ToolCall] = []
        pieces: list[str] = []
        pos = 0
        for match in _BLOCK.finditer(text):
            pieces.append(text[pos : match.start()])
            pos = match.end()
            body = match.group(1).strip()
            closed = match.group(0).endswith(CLOSE)
            try:
                payload = loads_strict(body)
            except ValueError as exc:
                note = "" if closed else " (the <tool_call> tag was not closed)"
                calls.append(garbage_call(body, len(calls), f"invalid JSON: {exc}{note}"))
                continue
            calls.append(call_from_payload(payload, len(calls), body, args_keys=("arguments", "parameters")))
        pieces.append(text[pos:])
        content = "".join(pieces).replace(CLOSE, "")
        return ParsedOutput(content=content.strip(), calls=calls)

    def render(self, content: str, calls: list[ToolCall]) -> str:
        blocks = []
        for call in calls:
            payload = f'{{"name": {json.dumps(call.name, ensure_ascii=False)}, "arguments": {arguments_json(call)}}}'
            blocks.append(f"{OPEN}\n{payload}\n{CLOSE}")
        return "\n".join(p for p in [content, *blocks] if p)
