"""Errors raised by miles.tools at definition time (never while executing a model's tool call)."""

from __future__ import annotations


class ToolDefinitionError(TypeError):
    """A function cannot become a tool: its schema cannot be derived, or its definition is inconsistent."""
