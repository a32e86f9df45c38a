"""The commands that drive a trainer from elsewhere, and the one way of running them on a trainer.

A `TrainerCommand` is a method call, an attribute read or an attribute write on a trainer, or `STOP`, which ends
the loop of whatever carries the commands. Two carriers exist: the pipe of a trainer in a process of its own
(`miles.learner.trainer_process.TrainerProcess`) and the gloo broadcast from rank 0 to the worker ranks of a
multi-rank job (`miles.learner.collective`). Both send `TrainerCommand` s by value (pickled) and run them with
`apply`; a carrier that trusts less than all of the trainer passes `apply` the commands it allows.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class CommandProtocolError(RuntimeError):
    """A command that the receiving side does not allow (or that is not a `TrainerCommand` at all)."""


class CommandKind(Enum):
    """What a `TrainerCommand` does; the value names the command in messages."""

    CALL = "call"  # trainer.<name>(*args, **kwargs)
    READ = "getattr"  # trainer.<name>
    WRITE = "setattr"  # trainer.<name> = args[0]
    STOP = "stop"  # the carrier stops serving; never applied to a trainer


@dataclass(frozen=True)
class TrainerCommand:
    """One command for a trainer: `kind` on the trainer's member `name`, with `args` and `kwargs` (a call's
    arguments; a write's value is ``args[0]``). Build one with `call`, `read` or `write`; `STOP` is the stop."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    kind: CommandKind = CommandKind.CALL

    @classmethod
    def call(cls, method: str, /, *args: Any, **kwargs: Any) -> TrainerCommand:
        """``trainer.method(*args, **kwargs)``."""
        return cls(method, args, kwargs)

    @classmethod
    def read(cls, attribute: str) -> TrainerCommand:
        """``trainer.attribute``."""
        return cls(attribute, kind=CommandKind.READ)

    @classmethod
    def write(cls, attribute: str, value: Any) -> TrainerCommand:
        """``trainer.attribute = value``."""
        return cls(attribute, (value,), kind=CommandKind.WRITE)

    @property
    def label(self) -> str:
        """How messages name this command: the method's name for a call, else the kind (``getattr``, ...)."""
        return self.name if self.kind is CommandKind.CALL else self.kind.value


STOP = TrainerCommand("stop", kind=CommandKind.STOP)

# Which member names each kind of command may touch; `apply` refuses every other command.
Allowed = Mapping[CommandKind, Collection[str]]


def apply(trainer: Any, command: TrainerCommand, allowed: Allowed | None = None) -> Any:
    """Run `command` on `trainer` and return its result (None for a write).

    With `allowed`, a command whose name is not listed under its kind raises `CommandProtocolError`, as does
    `STOP` (the carrier's to act on) always.
    """
    if command.kind is CommandKind.STOP:
        raise CommandProtocolError("the stop command ends a carrier's loop; it is not applied to a trainer")
    if allowed is not None and command.name not in allowed.get(command.kind, ()):
        what = "" if command.kind is CommandKind.CALL else f"{command.kind.value} "
        raise CommandProtocolError(f"unknown trainer command {what}{command.name!r}")
    if command.kind is CommandKind.READ:
        return getattr(trainer, command.name)
    if command.kind is CommandKind.WRITE:
        (value,) = command.args
        setattr(trainer, command.name, value)
        return None
    return getattr(trainer, command.name)(*command.args, **command.kwargs)
