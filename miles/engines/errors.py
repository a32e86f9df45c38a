"""Errors raised by the engines beyond the ground-floor `EngineError`."""

from __future__ import annotations

from miles.config import ConfigError
from miles.engine import EngineError


class InvalidRequestError(EngineError):
    """The request itself is wrong (empty prompt, token id outside the vocabulary, bad field).

    Never retryable: sending the same request again fails the same way.
    """

    def __init__(self, message: str, *, engine_id: str = "") -> None:
        super().__init__(message, engine_id=engine_id, retryable=False)


class EngineAuthError(ConfigError):
    """A server refused the admin token (or its absence) on a control route: a setup mistake, one line."""

    def __init__(self, message: str) -> None:
        super().__init__("", message)
