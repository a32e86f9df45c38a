"""`RolloutHandle` over any `RolloutLink`: what the trainer sees of the rollout manager depends on the messages
and the link's exit status only, never on where the manager runs."""

from __future__ import annotations

import asyncio
import queue
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.training.rollout_process import (
    Ack,
    Failed,
    Finished,
    Ready,
    RolloutHandle,
    RolloutManagerError,
    Stop,
)


class ScriptedLink:
    """A manager that sends `script` (then nothing), and exits with `code` once it got `Stop` (or at once when
    `exits_at_once`)."""

    def __init__(self, script: list[Any], *, code: int = 0, exits_at_once: bool = False) -> None:
        self.outbox: queue.Queue[Any] = queue.Queue()
        for message in script:
            self.outbox.put(message)
        self.sent: list[Any] = []
        self.code = code
        self.exited = exits_at_once
        self.killed = self.released = False

    def send(self, message: Any) -> None:
        self.sent.append(message)
        if isinstance(message, Stop):
            self.exited = True

    def receive(self, timeout_s: float) -> Any | None:
        try:
            return self.outbox.get(True, min(timeout_s, 0.01))
        except queue.Empty:
            return None

    def waiting(self) -> int:
        return self.outbox.qsize()

    def exit_code(self) -> int | None:
        return self.code if self.exited else None

    def wait_exit(self, timeout_s: float) -> None:
        pass

    def kill(self) -> None:
        self.killed = self.exited = True

    def release(self) -> None:
        self.released = True


def _group(position: int) -> Finished:
    return Finished(records=[], position=position, engine_idle_s=0.0)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=8, unique=True), st.integers(1, 5))
def test_groups_come_out_in_the_order_the_manager_finished_them(positions, version):
    # groups that finish before the weights are acknowledged wait in the handle, in order
    link = ScriptedLink([Ready(), *(_group(p) for p in positions), Ack(version)])
    handle = RolloutHandle(link, timeout_s=5.0)

    async def go() -> list[int]:
        await handle.ready()
        handle.publish(version, None)
        await handle.wait_acked(version)
        taken = [(await handle.next_group()).position for _ in positions]
        await handle.close()
        return taken

    assert asyncio.run(go()) == positions
    assert [type(m).__name__ for m in link.sent] == ["Weights", "Stop"]
    assert link.released and not link.killed  # it left on Stop


def test_a_manager_that_exits_without_a_word_is_named_with_its_exit_status():
    handle = RolloutHandle(ScriptedLink([], code=-9, exits_at_once=True), timeout_s=5.0)
    with pytest.raises(RolloutManagerError, match="exited with code -9; continue the run with --resume"):
        asyncio.run(handle.next_group())


def test_a_silent_manager_is_named_after_its_timeout():
    handle = RolloutHandle(ScriptedLink([]), timeout_s=0.2)
    with pytest.raises(RolloutManagerError, match=r"sent nothing for 0 s \(async.manager_timeout_s\)"):
        asyncio.run(handle.next_group())


def test_a_manager_that_failed_says_why_in_one_line():
    handle = RolloutHandle(ScriptedLink([Failed("ValueError: no tasks")]), timeout_s=5.0)
    with pytest.raises(RolloutManagerError, match="the rollout process failed: ValueError: no tasks"):
        asyncio.run(handle.ready())


def test_a_manager_that_ignores_stop_is_killed_and_its_link_released():
    class Deaf(ScriptedLink):
        def send(self, message: Any) -> None:
            self.sent.append(message)

    link = Deaf([])
    asyncio.run(RolloutHandle(link, timeout_s=5.0).close(timeout_s=0.05))
    assert link.killed and link.released
