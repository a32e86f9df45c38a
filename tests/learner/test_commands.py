"""`miles.learner.commands`: `apply` runs a call, a read or a write on a trainer, refuses what the allow-list
leaves out and never applies `STOP`; a command pickled (as both carriers send it) applies as the original."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from miles.learner.collective import WORKER_COMMANDS
from miles.learner.commands import STOP, CommandKind, CommandProtocolError, TrainerCommand, apply


class FakeTrainer:
    def __init__(self) -> None:
        self.step = 0
        self.lr = 1e-3
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def train_step(self, *args: Any, **kwargs: Any) -> tuple[int, tuple[Any, ...], dict[str, Any]]:
        self.calls.append((args, kwargs))
        self.step += 1
        return self.step, args, kwargs

    def stop(self) -> str:  # a method named like the stop command is still a method
        return "stopped"


def test_a_call_passes_its_arguments_and_returns_the_result():
    trainer = FakeTrainer()
    command = TrainerCommand.call("train_step", 1, "two", name="n", method="m")
    assert command.kind is CommandKind.CALL and command.label == "train_step"
    assert apply(trainer, command) == (1, (1, "two"), {"name": "n", "method": "m"})
    assert trainer.calls == [((1, "two"), {"name": "n", "method": "m"})]
    assert apply(trainer, TrainerCommand.call("stop")) == "stopped"


def test_a_read_returns_the_attribute_and_a_write_sets_it():
    trainer = FakeTrainer()
    trainer.step = 7
    read = TrainerCommand.read("step")
    assert read.label == "getattr" and apply(trainer, read) == 7
    write = TrainerCommand.write("step", 11)
    assert write.label == "setattr" and apply(trainer, write) is None
    assert trainer.step == 11 and apply(trainer, read) == 11
    with pytest.raises(AttributeError, match="nope"):
        apply(trainer, TrainerCommand.read("nope"))


def test_the_allow_list_refuses_every_other_command():
    trainer = FakeTrainer()
    assert apply(trainer, TrainerCommand.call("train_step", 3), WORKER_COMMANDS)[0] == 1
    apply(trainer, TrainerCommand.write("step", 5), WORKER_COMMANDS)
    assert trainer.step == 5
    refused = [
        (TrainerCommand.call("stop"), "unknown trainer command 'stop'"),
        (
            TrainerCommand.call("step"),
            "unknown trainer command 'step'",
        ),  # a write of step is not a call of it
        (TrainerCommand.write("lr", 1.0), "unknown trainer command setattr 'lr'"),
        (TrainerCommand.read("step"), "unknown trainer command getattr 'step'"),
    ]
    for command, message in refused:
        with pytest.raises(CommandProtocolError, match=f"^{message}$"):
            apply(trainer, command, WORKER_COMMANDS)
    assert trainer.step == 5 and trainer.lr == 1e-3 and len(trainer.calls) == 1  # nothing refused ran


def test_stop_is_never_applied():
    trainer = FakeTrainer()
    assert pickle.loads(pickle.dumps(STOP)).kind is CommandKind.STOP
    for allowed in (None, WORKER_COMMANDS, {CommandKind.STOP: ("stop",)}):
        with pytest.raises(CommandProtocolError, match="stop command"):
            apply(trainer, STOP, allowed)
    assert trainer.calls == []


values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
commands = st.one_of(
    st.builds(
        lambda args, kwargs: TrainerCommand.call("train_step", *args, **kwargs),
        st.lists(values, max_size=3),
        st.dictionaries(st.text(min_size=1, max_size=6), values, max_size=3),
    ),
    st.sampled_from(["step", "lr", "calls"]).map(TrainerCommand.read),
    st.builds(TrainerCommand.write, st.sampled_from(["step", "lr"]), values),
)


def by_hand(trainer: FakeTrainer, command: TrainerCommand) -> Any:
    """What `command` means, written out."""
    if command.kind is CommandKind.READ:
        return getattr(trainer, command.name)
    if command.kind is CommandKind.WRITE:
        return setattr(trainer, command.name, command.args[0])
    return trainer.train_step(*command.args, **command.kwargs)


@given(commands)
def test_a_pickled_command_applies_as_the_original(command):
    copy = pickle.loads(pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL))
    assert copy == command and copy.kind is command.kind
    here, there, reference = FakeTrainer(), FakeTrainer(), FakeTrainer()
    assert apply(there, copy) == apply(here, command) == by_hand(reference, command)
    assert vars(there) == vars(here) == vars(reference)
