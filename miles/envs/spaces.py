"""gymnasium spaces for text agents: an action is one assistant `Message`, an observation a list of them."""

from __future__ import annotations

import string
from typing import Any

import numpy as np
from gymnasium import spaces

from miles.types import Message, ToolCall

_ROLES = ("system", "user", "assistant", "tool")
_CHARSET = string.ascii_letters + string.digits + " .,:;+-*/()?!'\n"


def _valid_message(m: Any, roles: tuple[str, ...], max_length: int) -> bool:
    return (
        isinstance(m, Message)
        and m.role in roles
        and isinstance(m.content, str)
        and len(m.content) <= max_length
        and isinstance(m.tool_calls, list)
        and all(isinstance(c, ToolCall) for c in m.tool_calls)
    )


class MessageSpace(spaces.Space[Message]):
    """One chat message of the given roles (default: assistant) with content up to `max_length` chars.

    `sample()` draws random text (no tool calls), which every env must handle without crashing.
    """

    def __init__(
        self,
        roles: tuple[str, ...] = ("assistant",),
        max_length: int = 1 << 20,
        seed: int | np.random.Generator | None = None,
    ) -> None:
        self.roles = tuple(roles)
        self.max_length = max_length
        self._text = spaces.Text(min_length=0, max_length=min(max_length, 64), charset=_CHARSET)
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def seed(self, seed: int | None = None) -> int | list[int]:  # type: ignore[override]
        out = super().seed(seed)
        self._text.seed(int(self.np_random.integers(2**31)))
        return out

    def sample(self, mask: Any = None, probability: Any = None) -> Message:
        return Message(role=self.roles[0], content=self._text.sample())

    def contains(self, x: Any) -> bool:
        return _valid_message(x, self.roles, self.max_length)

    def __repr__(self) -> str:
        return f"MessageSpace(roles={self.roles})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MessageSpace) and (other.roles, other.max_length) == (
            self.roles,
            self.max_length,
        )


class MessagesSpace(spaces.Space[list]):
    """A list of chat messages (any role): what an env adds to the conversation in one step."""

    def __init__(
        self,
        max_messages: int = 1024,
        max_length: int = 1 << 20,
        seed: int | np.random.Generator | None = None,
    ) -> None:
        self.max_messages = max_messages
        self.max_length = max_length
        self._message = MessageSpace(roles=("user", "tool"), max_length=max_length)
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def sample(self, mask: Any = None, probability: Any = None) -> list:
        n = int(self.np_random.integers(0, 3))
        return [self._message.sample() for _ in range(n)]

    def contains(self, x: Any) -> bool:
        return (
            isinstance(x, list)
            and len(x) <= self.max_messages
            and all(_valid_message(m, _ROLES, self.max_length) for m in x)
        )

    def __repr__(self) -> str:
        return "MessagesSpace()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MessagesSpace) and (other.max_messages, other.max_length) == (
            self.max_messages,
            self.max_length,
        )
