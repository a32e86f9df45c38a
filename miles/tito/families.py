"""Family handlers: the boundary quirks of each chat-template family, and detection from tokenizer + template.

A handler says which tokens end a model turn, which token closes a turn that the engine cut short, which fixed
base conversation observation deltas are rendered against, and which canonical-render differences are a
documented property of the template rather than a TITO error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from miles.tito.errors import UnknownFamilyError

_THINK_BLOCK = re.compile(r"\s*<think>.*?</think>\s*", re.DOTALL)


@dataclass(frozen=True)
class FamilyHandler:
    """Boundary rules of one template family.

    - `stop_tokens`: tokens the engine stops on; a generation that ends in one of them is a closed turn.
    - `close_token`: appended with loss mask 0 when a generation ended without a stop token (max tokens,
      abort), so that the next observation delta is exact.
    - `delta_base`: the fixed conversation (ending in an assistant turn) that observation deltas are rendered
      against: delta = render(base + observation, generation prompt) minus render(base), cut after the base's
      last stop token. Whatever the template puts after the stop token (ChatML's `\\n`) thus lands in the
      delta, never in the model's turn.
    """

    name: str
    stop_tokens: tuple[str, ...]
    close_token: str
    delta_base: tuple[dict[str, Any], ...]
    description: str

    def explain(self, accumulated_text: str, canonical_text: str) -> str | None:
        """Why a difference is expected for this family, or None when it is not."""
        return None


@dataclass(frozen=True)
class Qwen3Handler(FamilyHandler):
    """Qwen3's template drops `<think>` blocks of earlier assistant turns; TITO keeps what the engine saw."""

    def explain(self, accumulated_text: str, canonical_text: str) -> str | None:
        if not canonical_text.strip() and _THINK_BLOCK.fullmatch(accumulated_text):
            return "qwen3_thinking_stripped"
        return None


_CHATML_BASE = ({"role": "user", "content": "base"}, {"role": "assistant", "content": "base"})
# A user turn that Qwen3's template treats as a tool response, not a query: the base assistant then renders
# without a think block whether or not more messages follow.
_QWEN3_BASE = (
    {"role": "user", "content": "<tool_response>\nbase\n</tool_response>"},
    {"role": "assistant", "content": "base"},
)

HANDLERS: dict[str, FamilyHandler] = {
    "chatml": FamilyHandler(
        name="chatml",
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        close_token="<|im_end|>",
        delta_base=_CHATML_BASE,
        description="ChatML/Qwen2.5: the `\\n` after `<|im_end|>` is never generated; it opens the next delta.",
    ),
    "tiny": FamilyHandler(
        name="tiny",
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        close_token="<|im_end|>",
        delta_base=_CHATML_BASE,
        description="miles tiny tokenizer (ChatML + Qwen2.5 tools): `\\n` after `<|im_end|>` opens the next delta.",
    ),
    "qwen3": Qwen3Handler(
        name="qwen3",
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        close_token="<|im_end|>",
        delta_base=_QWEN3_BASE,
        description=(
            "Qwen3: ChatML boundaries; the template strips <think> blocks from assistant turns before the "
            "latest user query (and empty ones from non-final turns). TITO keeps the generated thinking "
            "tokens verbatim; the check reports those differences as explained "
            "(qwen3_thinking_stripped)."
        ),
    ),
    "llama3": FamilyHandler(
        name="llama3",
        stop_tokens=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
        close_token="<|eot_id|>",
        delta_base=({"role": "user", "content": "base"}, {"role": "assistant", "content": "base"}),
        description=(
            "Llama 3.x: turns end with <|eot_id|> (nothing follows it); each delta opens with "
            "<|start_header_id|>role<|end_header_id|>\\n\\n headers."
        ),
    ),
}


def get_handler(family: str) -> FamilyHandler:
    """The handler for `family`; `UnknownFamilyError` when there is none."""
    try:
        return HANDLERS[family]
    except KeyError:
        raise UnknownFamilyError(f"unknown template family {family!r}; known: {sorted(HANDLERS)}") from None


def template_source(tokenizer: Any, chat_template: str | None = None) -> str:
    """The chat template string that rendering will use (the explicit one, else the tokenizer's default)."""
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    return template or ""


def detect_family(tokenizer: Any, chat_template: str | None = None) -> str:
    """Pick the family from the chat template's markers (and the vocabulary when the template is ambiguous)."""
    template = template_source(tokenizer, chat_template)
    if not template:
        raise UnknownFamilyError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
            "pass chat_template= or load it with miles.tito.load_tokenizer"
        )
    if "miles-tiny" in template:
        return "tiny"
    if "<|start_header_id|>" in template or "<|eot_id|>" in template:
        return "llama3"
    if "<|im_start|>" in template:
        return "qwen3" if ("<think>" in template or "reasoning_content" in template) else "chatml"
    raise UnknownFamilyError("cannot tell the template family (no ChatML or Llama 3 markers); pass family=")
