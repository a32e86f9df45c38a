"""`RolloutManager`: the scheduler as a stream of finished groups under a staleness bound.

The asynchronous loop runs it in its own process (see `miles.training.async_rollout`): sessions keep running
while the trainer trains, and weight updates land while they do. Three pieces:

- **Admission.** Under the `miles.sessions.staleness.StalenessBound`: with `groups_per_version` groups trained
  per weight version, group number `g` may start only once the engines hold version
  `first_version + g // groups_per_version - max_staleness` or newer. With `max_staleness: 0` the next
  version's groups start only after it landed: the synchronous loop. A group the trainer turned away as too stale, or took in a step that
  trained nothing (no new weights came of it), frees its place (`replace`): one more group is admitted on top
  of the bound, its task run again or the next one. (Without that, such groups would shrink the window for
  good, and the trainer would end up waiting for a group the bound never admits.)
- **Tasks.** `TaskFeed` hands out the training tasks in cursor order, each with its cursor position, skipping
  the positions an earlier run already trained on; requeued positions come first.
- **Weight updates.** `update_weights(apply, inflight)`: with `continue`, new turns wait while the turns in
  flight finish on the old weights, then `apply` runs (`Router.held`); with `pause`, `apply` runs at once and
  the engines swap between decode steps.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any, Literal

from miles.sessions.scheduler import Group, SessionScheduler
from miles.sessions.staleness import StalenessBound


class TaskFeed:
    """Training tasks in cursor order as `{"task": task}` items, remembering each one's cursor position.

    `next_position()` yields positions `start, start + 1, ...` (skipping `skip`); `task_at(position)` maps a
    position to its task. `positions[i]` is the position of the i-th item handed out (its group's index
    within the feed), so a finished group can be traced back to its task's position.
    """

    def __init__(self, task_at: Callable[[int], Any], *, start: int = 0, skip: Iterable[int] = ()) -> None:
        self._task_at = task_at
        self._next = start
        self._skip = set(skip)
        self._again: deque[int] = deque()
        self.positions: list[int] = []

    def requeue(self, position: int) -> None:
        """Hand out `position` again, before any new one."""
        self._again.append(position)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._again:
            position = self._again.popleft()
        else:
            while self._next in self._skip:
                self._next += 1
            position = self._next
            self._next += 1
        self.positions.append(position)
        return {"task": self._task_at(position)}


class RolloutManager:
    """Runs `scheduler`'s groups from `feed` for ever (until `stop`), admitting them under the staleness bound,
    and yields each group as it finishes with its task's cursor position."""

    def __init__(
        self,
        scheduler: SessionScheduler,
        feed: TaskFeed,
        *,
        groups_per_version: int,
        max_staleness: int,
        first_version: int,
    ) -> None:
        self.bound = StalenessBound(max_staleness, groups_per_version)
        self.scheduler = scheduler
        self.feed = feed
        self.first_version = first_version
        self.version = first_version
        self.admitted = 0  # groups started (requeued ones count again)
        self._running: dict[int, int] = {}  # group index -> the engines' version when it was admitted
        self._credit = 0  # groups turned away as too stale: admitted on top of the bound
        self._changed = asyncio.Event()

    @property
    def allowed(self) -> int:
        """How many groups may have started by now."""
        return self.bound.admitted(self.version, self.first_version, self._credit)

    def set_version(self, version: int) -> None:
        """The engines now hold weights `version`: admit the groups that this allows."""
        self.version = max(self.version, int(version))
        self._wake()

    def replace(self, position: int, *, rerun: bool) -> None:
        """The group of the task at `position` takes no place under the bound any more (too stale to train,
        or it trained nothing): admit one more group on top of the bound, running that task again when
        `rerun`, else the next task."""
        if rerun:
            self.feed.requeue(position)
        self._credit += 1
        self._wake()

    @property
    def oldest_running(self) -> int | None:
        """The engines' version when the oldest group still running was admitted (None when none runs): no
        token of it is older, so a trainer at version `v` must take it before `v` passes it by more than
        `max_staleness`."""
        return min(self._running.values(), default=None)

    async def admit(self) -> None:
        """Wait until one more group may start, then count it."""
        while self.admitted >= self.allowed:
            await self._changed.wait()
        self._running[self.admitted] = self.version
        self.admitted += 1

    async def stream(self) -> AsyncIterator[tuple[Group, int]]:
        """Finished groups with their tasks' cursor positions, in the order they finish. The scheduler must be
        fresh: its groups are numbered from 0 in the order the feed hands out their tasks."""
        gen = self.scheduler.run_groups(self.feed, admit=self.admit)
        try:
            async for group in gen:
                self._running.pop(group.index, None)
                yield group, self.feed.positions[group.index]
        finally:
            await gen.aclose()

    async def update_weights(
        self, apply: Callable[[], Awaitable[Any]], inflight: Literal["continue", "pause"]
    ) -> Any:
        """Run `apply` (which loads new weights into the engines) under the in-flight policy."""
        if inflight == "pause":
            return await apply()
        async with self.scheduler.router.held():
            return await apply()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
