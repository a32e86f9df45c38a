"""The tool-call parser registry, with the built-in "hermes" (alias "qwen", for Qwen2.5), "qwen3" (Hermes
calls plus `<think>` reasoning) and "llama3_json" parsers."""

from __future__ import annotations

from miles.tools.parser_base import ToolCallParser
from miles.tools.parser_hermes import HermesParser
from miles.tools.parser_llama3 import Llama3JsonParser
from miles.tools.parser_qwen3 import Qwen3Parser


class UnknownParserError(KeyError):
    """No parser is registered under the requested name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown parser"


_REGISTRY: dict[str, type[ToolCallParser]] = {}


def register_parser(name: str, cls: type[ToolCallParser]) -> None:
    """Register a parser class under `name` (replacing any earlier one)."""
    if not (isinstance(cls, type) and issubclass(cls, ToolCallParser)):
        raise TypeError(f"register_parser needs a ToolCallParser subclass, got {cls!r}")
    _REGISTRY[name] = cls


def get_parser(name: str) -> ToolCallParser:
    """A new instance of the parser registered under `name`; `UnknownParserError` when there is none."""
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise UnknownParserError(
            f"unknown tool-call parser {name!r}; registered: {sorted(_REGISTRY)}"
        ) from None


def available_parsers() -> list[str]:
    """Registered parser names, sorted."""
    return sorted(_REGISTRY)


register_parser("hermes", HermesParser)
register_parser("qwen", HermesParser)
register_parser("qwen3", Qwen3Parser)
register_parser("llama3_json", Llama3JsonParser)
