"""Errors raised by the trainers."""

from __future__ import annotations


class ConfigError(ValueError):
    """A trainer or algorithm setting is invalid; `key` names the offending dotted key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, incomplete or does not match the model it is loaded into."""
