"""Qwen3: `<think>…</think>` reasoning, then Hermes-style `<tool_call>` blocks.

The thinking goes to `ParsedOutput.reasoning` (`Message.reasoning`, which Qwen3's chat template renders as
`reasoning_content`); the content keeps only the answer and the tool calls. The rules:

- Every `<think>…</think>` block is reasoning. Its text loses the newlines that frame it (the template
  writes `<think>\\n` + reasoning + `\\n</think>\\n\\n`); several blocks are joined by a blank line.
- A `</think>` with no `<think>` before it closes a block that the prompt opened (templates that end the
  generation prompt with `<think>\\n`): the text before it is reasoning.
- A `<think>` that is never closed (the engine stopped on max tokens mid-thought) makes the rest of the text
  reasoning. A cut thought is not an answer: the content is only what came before the block, and tool
  calls drafted inside it are not run.
- Any tag left over (a second `</think>`) is dropped, so no tag ever reaches the content.
- No tags at all: reasoning is None (e.g. `enable_thinking=False`, whose prompt already holds an empty block).

The tags are Qwen3 vocabulary tokens, so they count wherever they appear, even inside a tool call's JSON.
"""

from __future__ import annotations

from miles.tools.parser_base import ParsedOutput
from miles.tools.parser_hermes import HermesParser
from miles.types import ToolCall

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, the rest of the text) by the rules in this module's docstring."""
    thoughts: list[str] = []
    rest: list[str] = []
    pos = 0
    first_open, first_close = text.find(THINK_OPEN), text.find(THINK_CLOSE)
    if first_close != -1 and (first_open == -1 or first_close < first_open):
        thoughts.append(text[:first_close])
        pos = first_close + len(THINK_CLOSE)
    while True:
        start = text.find(THINK_OPEN, pos)
        if start == -1:
            rest.append(text[pos:])
            break
        rest.append(text[pos:start])
        end = text.find(THINK_CLOSE, start + len(THINK_OPEN))
        if end == -1:
            thoughts.append(text[start + len(THINK_OPEN) :])
            break
        thoughts.append(text[start + len(THINK_OPEN) : end])
        pos = end + len(THINK_CLOSE)
    if not thoughts:
        return None, text
    reasoning = "\n\n".join(t.strip("\n") for t in thoughts)
    return reasoning, _drop_tags("".join(rest))


def _drop_tags(text: str) -> str:
    while THINK_CLOSE in text or THINK_OPEN in text:  # dropping one tag may join the pieces of another
        text = text.replace(THINK_CLOSE, "").replace(THINK_OPEN, "")
    return text


class Qwen3Parser(HermesParser):
    """Parses Qwen3 output: reasoning from `<think>` blocks, then Hermes tool calls from the rest."""

    name = "qwen3"

    def _parse(self, text: str) -> ParsedOutput:
        reasoning, rest = split_reasoning(text)
        out = super()._parse(rest)
        out.reasoning = reasoning
        return out

    def render(self, content: str, calls: list[ToolCall], reasoning: str | None = None) -> str:
        """As Qwen3's template writes a turn: the think block (when `reasoning` is not None), then the rest."""
        body = super().render(content, calls)
        if reasoning is None:
            return body
        thought = reasoning.strip("\n")
        return f"{THINK_OPEN}\n{thought}\n{THINK_CLOSE}\n\n{body}"
