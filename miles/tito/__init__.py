"""TITO (token-in, token-out): multi-turn trajectories that hold exactly the ids the engine consumed and produced."""

from miles.tito.conversation import Conversation
from miles.tito.errors import (
    ConversationStateError,
    DeltaPrefixError,
    InvalidTokenError,
    TemplateDropsToolsError,
    TemplateTokenizerMismatchError,
    TITOError,
    TITOMismatchError,
    TokenizerSpecError,
    UnknownFamilyError,
)
from miles.tito.families import HANDLERS, FamilyHandler, detect_family, get_handler
from miles.tito.loading import llama3_chat_template, load_tokenizer
from miles.tito.report import Mismatch, MismatchKind, TITOReport
from miles.tito.spec import CHAT_TEMPLATES, ChatTemplateError, TokenizerSpec, resolve_chat_template
from miles.tito.tokenizer import TITOTokenizer

__all__ = [
    "CHAT_TEMPLATES",
    "HANDLERS",
    "ChatTemplateError",
    "Conversation",
    "ConversationStateError",
    "DeltaPrefixError",
    "FamilyHandler",
    "InvalidTokenError",
    "Mismatch",
    "MismatchKind",
    "TITOError",
    "TITOMismatchError",
    "TemplateDropsToolsError",
    "TemplateTokenizerMismatchError",
    "TITOReport",
    "TITOTokenizer",
    "TokenizerSpec",
    "TokenizerSpecError",
    "UnknownFamilyError",
    "detect_family",
    "get_handler",
    "llama3_chat_template",
    "load_tokenizer",
    "resolve_chat_template",
]
