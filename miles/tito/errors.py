"""Named errors of the TITO tokenizer."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles.tito.report import TITOReport


class TITOError(ValueError):
    """Base class of TITO errors."""


class UnknownFamilyError(TITOError):
    """The template family cannot be detected, or an unknown family was named."""


class TokenizerSpecError(TITOError):
    """`load_tokenizer` got a spec that is neither a known name nor a tokenizer folder."""


class TemplateTokenizerMismatchError(TITOError):
    """The chat template belongs to a family whose turn-closing token the tokenizer does not have (say, a
    Llama 3 template over a ChatML tokenizer)."""


class TemplateDropsToolsError(TITOError):
    """The chat template does not show the tool schemas to the model: a prompt renders the same with and
    without them (or leaves a tool's name out)."""


class DeltaPrefixError(TITOError):
    """The shorter render is not a token prefix of the longer one: the template is not append-only there."""


class ConversationStateError(TITOError):
    """A Conversation method was called out of order (e.g. an observation before any generation)."""


class InvalidTokenError(TITOError):
    """Engine output holds ids outside the vocabulary, or logprobs that do not match the ids."""


class TITOMismatchError(TITOError):
    """Strict check: the accumulated ids differ from the canonical render in a way no handler explains."""

    def __init__(self, report: TITOReport) -> None:
        self.report = report
        super().__init__(report.summary())
