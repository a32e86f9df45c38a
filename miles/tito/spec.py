"""`TokenizerSpec`: the names that rebuild a TITO tokenizer (tokenizer, chat-template override, template
kwargs). Sessions record it, so a replay renders with exactly the template the run used."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.tito.errors import TokenizerSpecError
from miles.tito.loading import TEMPLATES_DIR


class ChatTemplateError(TokenizerSpecError):
    """A chat-template override is neither a known name (see `CHAT_TEMPLATES`) nor a template file."""


def _compact() -> str:
    from miles.tiny import compact_chat_template

    return compact_chat_template()


def _shipped(file_name: str) -> Callable[[], str]:
    return lambda: (TEMPLATES_DIR / file_name).read_text(encoding="utf-8")


#: Named chat-template overrides: "compact" (the tiny kit's short tool prompt: signatures instead of JSON
#: schemas), "chatml-tools" (ChatML with Hermes / Qwen2.5-style tool calls, for ChatML models whose own template
#: drops `tools`, such as SmolLM2) and "llama3-tools" (Llama 3.x JSON tool calls with `ipython` tool turns).
CHAT_TEMPLATES: dict[str, Callable[[], str]] = {
    "compact": _compact,
    "chatml-tools": _shipped("chatml_tools.jinja"),
    "llama3-tools": _shipped("llama3_tools.jinja"),
}


def resolve_chat_template(name: str | None) -> str | None:
    """The template text of an override: None for none (the tokenizer's own), a name in `CHAT_TEMPLATES`,
    or the path of a Jinja file."""
    if not name:
        return None
    if name in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[name]()
    path = Path(name)
    if not path.is_file():
        raise ChatTemplateError(
            f"{name!r} is neither a template name ({', '.join(CHAT_TEMPLATES)}) nor a .jinja file"
        )
    return path.read_text(encoding="utf-8")


def template_sha256(template: str) -> str:
    """The fingerprint recorded for a chat template."""
    return hashlib.sha256(template.encode()).hexdigest()


@dataclass(frozen=True)
class TokenizerSpec:
    """`tokenizer` (a `load_tokenizer` name or folder), `chat_template` (an override for
    `resolve_chat_template`, or None), `chat_template_kwargs` (e.g. `enable_thinking`), and, once built,
    `template_sha256` of the template actually used."""

    tokenizer: str
    chat_template: str | None = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    template_sha256: str = ""

    def to_record(self) -> dict[str, Any]:
        """The JSON form."""
        return {
            "tokenizer": self.tokenizer,
            "chat_template": self.chat_template,
            "chat_template_kwargs": dict(self.chat_template_kwargs),
            "template_sha256": self.template_sha256,
        }

    @classmethod
    def from_record(cls, data: Mapping[str, Any]) -> TokenizerSpec:
        """Inverse of `to_record`."""
        return cls(
            tokenizer=str(data["tokenizer"]),
            chat_template=data.get("chat_template"),
            chat_template_kwargs=dict(data.get("chat_template_kwargs") or {}),
            template_sha256=str(data.get("template_sha256") or ""),
        )
