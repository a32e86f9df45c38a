"""Llama-3.x JSON tool calls: `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`.

Several calls may follow one another, separated by `;` or whitespace. Calls are recognised only at the
start of the message (as Llama's template emits them); any text after the last call is the content.
"""

from __future__ import annotations

import json

from miles.tools.parser_base import (
    STRICT_JSON,
    ParsedOutput,
    ToolCallParser,
    arguments_json,
    call_from_payload,
    garbage_call,
)
from miles.types import ToolCall

PYTHON_TAG = "<|python_tag|>"
_END_TOKENS = ("<|eom_id|>", "<|eot_id|>")


def _strip_end(text: str) -> str:
    text = text.strip()
    changed = True
    while changed:
        changed = False
        for tok in _END_TOKENS:
            if text.endswith(tok):
                text = text[: -len(tok)].rstrip()
                changed = True
    return text


class Llama3JsonParser(ToolCallParser):
    """Parses Llama 3.1/3.2/3.3 JSON-based tool calls.

    Without `<|python_tag|>`, text that is not a JSON object with a "name" is plain content (a JSON
    final answer stays content). After `<|python_tag|>`, malformed JSON becomes a call with parse_error.
    """

    name = "llama3_json"

    def _parse(self, text: str) -> ParsedOutput:
        stripped = _strip_end(text)
        tagged = stripped.startswith(PYTHON_TAG)
        body = stripped[len(PYTHON_TAG) :].lstrip() if tagged else stripped
        if not body.startswith("{"):
            if tagged and body:
                return ParsedOutput(
                    content="", calls=[garbage_call(body, 0, "expected a JSON object after <|python_tag|>")]
                )
            return ParsedOutput(content=stripped if not tagged else "", calls=[])
        calls: list[ToolCall] = []
        pos = 0
        while pos < len(body) and body[pos] == "{":
            try:
                payload, end = STRICT_JSON.raw_decode(body, pos)
            except (ValueError, RecursionError) as exc:
                if not calls and not tagged:
                    return ParsedOutput(content=stripped, calls=[])
                calls.append(garbage_call(body[pos:], len(calls), f"invalid JSON: {exc}"))
                return ParsedOutput(content="", calls=calls)
            is_call = isinstance(payload, dict) and isinstance(payload.get("name"), str)
            if not is_call and not calls and not tagged:
                return ParsedOutput(content=stripped, calls=[])
            raw = body[pos:end]
            calls.append(call_from_payload(payload, len(calls), raw, args_keys=("parameters", "arguments")))
            pos = end
            while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
                pos += 1
        return ParsedOutput(content=body[pos:].strip(), calls=calls)

    def render(self, content: str, calls: list[ToolCall]) -> str:
        parts = [
            f'{{"name": {json.dumps(c.name, ensure_ascii=False)}, "parameters": {arguments_json(c)}}}'
            for c in calls
        ]
        text = "; ".join(parts)
        if content:
            text = f"{text}\n{content}" if text else content
        return text
