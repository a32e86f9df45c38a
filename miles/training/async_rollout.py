"""`ProcessSource`, the asynchronous loop's `RolloutSource`: each step takes finished groups from the rollout
process (a child process, or a Ray actor), keeps those within the staleness bound
(`miles.sessions.staleness.StalenessBound`, which the rollout process admits groups by), and afterwards hands
the new weights back while rollouts go on.

A step waits for a group still running that would be over the bound at the next version (each finished group
reports the oldest version a running group was admitted under), so no group goes over it by finishing late.
Groups over it all the same (HTTP engines whose versions lag) are dropped, or run again with
`async.stale: regenerate`.

Which tasks were trained on is kept as cursor positions: everything below `position`, plus `consumed` above
it (groups finish out of order). A checkpoint stores both, so a resumed run neither repeats nor skips a task.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from miles.learner.protocol import Weights
from miles.sessions.metrics import SessionObserver
from miles.sessions.records import SessionRecord
from miles.sessions.router import RouterStats
from miles.sessions.staleness import StalenessBound
from miles.training.config import TrainConfig
from miles.training.evaluate import EvalResult, EvalSet
from miles.training.protocol import StepRollout
from miles.training.rollout_process import Finished, RolloutHandle, RolloutStart
from miles.training.sources import Evaluation


class ProcessSource:
    """Drives the rollout manager through its `RolloutHandle`: `start`, then per step `collect` and `publish`; `aclose` at the end.

    `push(version, weights)` is the trainer's own weight sync, used for HTTP engines (the rollout process's embedded
    engines get the weights through the process queue instead). `evaluation` runs held-out sessions on the
    trainer's own engines; `observer` sees every training session taken.
    """

    #: Groups taken from the process are consumed at once: an aborted step leaves the cursor ahead of training.
    checkpoints_when_aborted = False

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        http: bool,
        push: Callable[[int, Weights], Awaitable[None]],
        evaluation: Evaluation | None = None,
        observer: SessionObserver | None = None,
    ) -> None:
        self.cfg = cfg
        self.acfg = cfg.asynchronous
        self.bound = StalenessBound(cfg.asynchronous.max_staleness, cfg.rollout.tasks_per_step)
        self.http = http
        self.push = push
        self.evaluation = evaluation
        self.observer = observer
        self.position = 0
        self.consumed: set[int] = set()
        self.process: RolloutHandle | None = None
        self._taken: list[int] = []  # positions of the groups the last `collect` kept as its share
        self._deferred: deque[Finished] = deque()  # finished groups left for the next step
        self._oldest_running: int | None = None  # as the rollout process last reported it
        self._engine_idle_s = 0.0  # the rollout process's engine idle seconds, as last reported
        self._idle_mark = 0.0  # ... at the end of the previous step
        self._clock = time.monotonic()

    def restore(self, cursor: Mapping[str, Any], *, saved_at: float) -> None:
        """Continue from a checkpoint's cursor (the rollout process moves its own later sessions aside)."""
        self.position = int(cursor.get("position", 0))
        self.consumed = {int(p) for p in cursor.get("consumed", ())}

    async def start(self, version: int, weights: Weights, *, run_id: str, resume_time: float | None) -> None:
        """Start the rollout process at the cursor and hand it weights `version` (the engines' first)."""
        start = RolloutStart(
            position=self.position,
            skip=tuple(sorted(self.consumed)),
            first_version=version,
            run_id=run_id,
            resume_time=resume_time,
        )
        from miles.training.placement import launch_rollout

        self.process = launch_rollout(self.cfg, start)
        await self.process.ready()
        self.process.publish(version, None if self.http else weights())
        await self.process.wait_acked(version)
        self._clock = time.monotonic()

    async def collect(self, trainer_version: int) -> StepRollout:
        """`tasks_per_step` groups within the staleness bound, in the order they finished (those left from the
        previous step first). Then, while a group still running was admitted `max_staleness` or more versions
        ago (it may be over the bound at the next version), the groups that finish until it has. Of the groups
        beyond the step's share, those that would be over the bound at the next version join this step as late
        groups (a long-tail group is trained late, not dropped); the others wait for the next step."""
        assert self.process is not None
        t0 = time.monotonic()
        waited, dropped, late = 0.0, 0, 0
        kept: list[SessionRecord] = []
        staleness: list[int] = []
        deferred: list[Finished] = []
        self._taken = []

        def take(group: Finished) -> None:
            self._consume(group.position)
            kept.extend(group.records)
            staleness.extend(
                trainer_version - (r.trajectory.oldest_weight_version or trainer_version)
                for r in group.records
            )

        while len(self._taken) < self.cfg.rollout.tasks_per_step or self.bound.must_wait(
            self._oldest_running, trainer_version
        ):
            if self._deferred:
                group = self._deferred.popleft()
            else:
                tw = time.monotonic()
                group = await self.process.next_group()
                waited += time.monotonic() - tw
                self._oldest_running = group.oldest_running
                self._engine_idle_s = max(self._engine_idle_s, group.engine_idle_s)
            if self.bound.too_stale(group.records, trainer_version):
                dropped += 1
                rerun = self.acfg.stale == "regenerate"
                self.process.requeue(group.position, rerun=rerun)
                if not rerun:
                    self._consume(group.position)
            elif len(self._taken) < self.cfg.rollout.tasks_per_step:
                self._taken.append(group.position)
                take(group)
            else:
                deferred.append(group)
        # the groups left for the next step that would be over the bound there join this one as late groups,
        # each freeing its place (the step takes more than its share)
        backlog, self._deferred = [*deferred, *self._deferred], deque()
        for group in backlog:
            if self.bound.due(group.records, trainer_version):
                late += 1
                self.process.requeue(group.position, rerun=False)
                take(group)
            else:
                self._deferred.append(group)
        now = time.monotonic()
        wall, self._clock = now - self._clock, now
        idle, self._idle_mark = self._engine_idle_s - self._idle_mark, self._engine_idle_s
        idle_share = min(1.0, max(0.0, idle / wall)) if wall > 0 else 0.0
        hist = Counter(staleness)
        metrics: dict[str, float] = {
            "trainer_wait_s": waited,
            "collect_s": now - t0,
            "rollout_idle_ratio": idle_share,
            "staleness_mean": float(sum(staleness) / len(staleness)) if staleness else 0.0,
            "staleness_max": float(max(staleness, default=0)),
            "stale_groups_dropped": float(dropped),
            "late_groups": float(late),
            "buffer_groups": float(self.process.buffered),
        }
        metrics.update({f"staleness_hist_{k}": float(v) for k, v in sorted(hist.items())})
        if self.observer is not None:
            for record in kept:
                self.observer.observe(record)
        return StepRollout(kept, metrics)

    def untrained(self) -> None:
        """The groups of the last `collect` trained nothing (every one without a reward spread): no new weights
        came of them, so they aged no group; free their places under the bound (else a few such steps in a
        row would leave the trainer waiting for groups the bound never admits). Late groups freed theirs when
        they were taken."""
        assert self.process is not None
        for position in self._taken:
            self.process.requeue(position, rerun=False)
        self._taken = []

    async def publish(self, version: int, weights: Weights) -> None:
        """Hand weights `version` to the engines (under `async.inflight`) while rollouts go on."""
        assert self.process is not None
        if self.http:
            if self.acfg.inflight == "continue":
                await self.process.hold(version)
            await self.push(version, weights)
            self.process.publish(version, None)
        else:
            await self.process.wait_acked(version - 1)  # the previous weights have landed: one copy in flight
            self.process.publish(version, weights())

    async def evaluate(self, part: EvalSet, *, greedy: bool, run_id: str) -> EvalResult:
        """Held-out sessions on the trainer's own engines (the loop synced the newest weights to them)."""
        assert self.evaluation is not None
        return await self.evaluation(part, greedy=greedy, run_id=run_id)

    def router_stats(self) -> RouterStats | None:
        return None  # the rollout process routes its own sessions

    @property
    def record_failures(self) -> int:
        return 0  # the rollout process records its sessions; its write failures are logged there, not counted here

    def data_cursor(self) -> dict[str, Any]:
        """The cursor for a checkpoint: every position below `position`, and those in `consumed`, are trained."""
        return {"position": self.position, "consumed": sorted(self.consumed)}

    def _consume(self, position: int) -> None:
        self.consumed.add(position)
        while self.position in self.consumed:
            self.consumed.discard(self.position)
            self.position += 1

    async def stop(self) -> None:
        """Running sessions are aborted and recorded; the process ends."""
        if self.process is not None:
            await self.process.close()

    async def aclose(self) -> None:
        await self.stop()
