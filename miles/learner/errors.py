"""Errors raised by the trainers."""

from __future__ import annotations

from miles.config import ConfigError

__all__ = ["CheckpointError", "ConfigError"]


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, incomplete or does not match the model it is loaded into."""
