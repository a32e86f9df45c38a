"""Errors raised by the engines beyond the ground-floor `EngineError`."""

from __future__ import annotations

from miles.engine import EngineError


class InvalidRequestError(EngineError):
    """The request itself is wrong (empty prompt, token id outside the vocabulary, bad field).

    Never retryable: sending the same request again fails the same way.
    """

    def __init__(self, message: str, *, engine_id: str = "") -> None:
        super().__init__(message, engine_id=engine_id, retryable=False)
