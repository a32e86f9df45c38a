"""`TrainerProcess` on a small stand-in trainer: calls, reads and writes reach the trainer in its own process,
an error comes back with its type and the child's traceback, a trainer process that dies mid-command or while
starting is a `TrainerProcessError` naming the command, and `close` stops it with the `STOP` command."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch

from miles.learner.commands import TrainerCommand
from miles.learner.trainer_process import TrainerProcess, TrainerProcessError


class StandIn:
    """Built in the trainer process by `build`."""

    def __init__(self, start: int) -> None:
        self.step = start

    def add(self, a: int, *, b: int = 0) -> int:
        self.step += a + b
        return self.step

    def getattr(self, name: str) -> str:  # no method name is special: this is a call like any other
        return f"called with {name}"

    def threads(self) -> int:
        return torch.get_num_threads()

    def fail(self) -> None:
        raise KeyError("no such thing")

    def unpicklable(self) -> Any:
        return threading.Lock()

    def crash(self) -> None:
        os._exit(3)

    @property
    def crashing(self) -> int:
        os._exit(4)


def build(start: int) -> StandIn:
    if start < 0:
        raise ValueError(f"start {start} < 0")
    return StandIn(start)


def build_and_die(start: int) -> StandIn:
    os._exit(5)


@pytest.fixture(scope="module")
def process():
    process = TrainerProcess(build, 10, threads=1, name="test-trainer")
    yield process
    process.close()


def test_calls_reads_and_writes_reach_the_trainer(process):
    process.set("step", 10)
    assert process.call("add", 1, b=2) == 13
    assert process.get("step") == 13
    process.set("step", 0)
    assert process.apply(TrainerCommand.read("step")) == 0
    assert process.apply(TrainerCommand.call("add", 5)) == 5
    assert process.call("getattr", "step") == "called with step"
    assert process.call("threads") == 1
    assert process.call("threads", threads=2) == 2 and process.call("threads") == 2
    process.call("threads", threads=1)


def test_an_error_comes_back_with_its_type_and_the_trainer_process_traceback(process):
    with pytest.raises(KeyError, match="no such thing") as info:
        process.call("fail")
    assert any("raised in the trainer process" in n and ", in fail" in n for n in info.value.__notes__)
    with pytest.raises(AttributeError, match="nope"):
        process.get("nope")
    with pytest.raises(TypeError, match="pickle"):  # a result that cannot cross the pipe
        process.call("unpicklable")
    assert process.get("step") == process.call("add", 0)  # it serves on


def test_a_trainer_process_that_dies_during_a_command_names_it():
    process = TrainerProcess(build, 0, threads=1)
    try:
        with pytest.raises(
            TrainerProcessError, match=r"^the trainer process exited \(exit code 4\) during getattr; "
        ):
            process.get("crashing")
        with pytest.raises(
            TrainerProcessError, match=r"exited \(exit code 4\); continue the run with --resume$"
        ):
            process.call("add", 1)
    finally:
        process.close()
    process = TrainerProcess(build, 0, threads=1)
    try:
        with pytest.raises(TrainerProcessError, match=r"exited \(exit code 3\) during crash; .*--resume$"):
            process.call("crash")
    finally:
        process.close()
        process.close()  # idempotent


def test_a_failed_start_raises_what_building_raised_or_names_the_main_guard():
    with pytest.raises(ValueError, match="start -1 < 0") as info:
        TrainerProcess(build, -1, threads=1)
    assert any("raised in the trainer process" in n for n in info.value.__notes__)
    with pytest.raises(TrainerProcessError, match=r"exit code 5\) while starting.*__main__") as died:
        TrainerProcess(build_and_die, 0, threads=1)
    assert "--resume" not in str(died.value)


def test_close_stops_the_trainer_process_with_the_stop_command():
    process = TrainerProcess(build, 0, threads=1)
    assert process.alive and process.pid is not None
    process.close()
    assert not process.alive and process._proc.exitcode == 0  # it returned from serving, not killed
