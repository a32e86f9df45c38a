"""`SessionScheduler`: thousands of sessions on one event loop, grouped for GRPO, every one recorded."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from miles.engine import RolloutEngine
from miles.envs.recipe import EnvRecipe
from miles.sessions.config import SchedulerConfig
from miles.sessions.metrics import SessionObserver
from miles.sessions.progress import ProgressDisplay, RunStats
from miles.sessions.recorder import Recorder
from miles.sessions.records import ErrorInfo, SessionRecord
from miles.sessions.router import Router
from miles.sessions.session import Session, SessionEnv
from miles.sessions.spec import SessionSpec, TaskSpec
from miles.trajectory import Trajectory
from miles.types import TerminationReason

log = logging.getLogger(__name__)
_END = object()


@dataclass
class Group:
    """The `n` samples of one task (a GRPO group), in sample order, all ended."""

    group_id: str
    index: int
    task: TaskSpec
    records: list[SessionRecord] = field(default_factory=list)

    @property
    def trajectories(self) -> list[Trajectory]:
        return [r.trajectory for r in self.records]

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.records]

    @property
    def all_ok(self) -> bool:
        return all(r.ok for r in self.records)


class _Slots:
    """A FIFO counting semaphore that can take several units at once (a whole group)."""

    def __init__(self, n: int) -> None:
        self.free = n
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def acquire(self, k: int) -> None:
        if not self._waiters and self.free >= k:
            self.free -= k
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((k, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(k)
            raise

    def release(self, k: int) -> None:
        self.free += k
        while self._waiters:
            need, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if self.free < need:
                break
            self._waiters.popleft()
            self.free -= need
            fut.set_result(None)


class _GroupState:
    def __init__(self, group: Group, size: int) -> None:
        self.group = group
        self.slots: list[SessionRecord | None] = [None] * size
        self.left = size


class GroupRunner(Protocol):
    """What runs a step's sessions in groups of samples of one task: `SessionScheduler`, or `AgentRunner`
    (the user's own agent processes, through the OpenAI-compatible endpoint)."""

    #: Session ids begin with it.
    run_id: str

    @property
    def router(self) -> Router:
        """Where the sessions' requests go (its per-engine stats feed the run's metrics)."""
        ...

    async def run(self, tasks: Iterable[Any], *, num_groups: int | None = None) -> list[Group]:
        """One group per task (the first `num_groups` tasks to finish), every session recorded once."""
        ...

    async def aclose(self) -> None:
        """Abort what still runs (recorded as aborted)."""
        ...


class SessionScheduler:
    """Runs sessions of `env_factory()` envs (one fresh env per session) on `engines`: one engine, several
    (routed by a `Router` built from the config), or a `Router` shared with other schedulers.

    `recipe` (a `miles.envs.EnvRecipe`) says how those envs are built; it is recorded into every
    `SessionRecord` so that `miles replay --check` can rebuild them. Without `env_factory`, the envs are
    `recipe.make()`.

    Usage::

        async with contextlib.aclosing(scheduler.run_groups(tasks, num_groups=8)) as groups:
            async for group in groups:
                ...

    Every session that started is recorded to `recorder` (a `Recorder` or a path to a
    `sessions.jsonl`) when it ends, aborted ones included; `stats` counts them. `observer` (e.g. a
    `SessionMetrics`) is told about every session right after it is recorded.
    """

    def __init__(
        self,
        engines: RolloutEngine | Sequence[RolloutEngine] | Router,
        *,
        tokenizer: Any,
        env_factory: Callable[[], SessionEnv] | None = None,
        config: SchedulerConfig | None = None,
        recorder: Recorder | str | os.PathLike[str] | None = None,
        parser: Any = None,
        run_id: str | None = None,
        recipe: EnvRecipe | None = None,
        observer: SessionObserver | None = None,
    ) -> None:
        if env_factory is None:
            if recipe is None:
                raise ValueError("SessionScheduler needs env_factory= or recipe=")
            env_factory = recipe.make
        self.recipe = recipe
        self.observer = observer
        self.config = config or SchedulerConfig()
        self.config.validate()
        scfg = self.config.session
        self._owns_router = not isinstance(engines, Router)
        self.router = (
            engines
            if isinstance(engines, Router)
            else Router(
                engines,
                timeouts=scfg.timeouts,
                retry=scfg.retry,
                max_inflight_per_engine=self.config.max_inflight_per_engine,
                requests_per_s=self.config.requests_per_s,
            )
        )
        self.tokenizer = tokenizer
        self.env_factory = env_factory
        self._owns_recorder = recorder is not None and not isinstance(recorder, Recorder)
        self.recorder: Recorder | None = (
            recorder if recorder is None or isinstance(recorder, Recorder) else Recorder(recorder)
        )
        if parser is None and scfg.parser is not None:
            from miles.tools import get_parser

            parser = get_parser(scfg.parser)
        self.parser = parser
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.stats = RunStats()
        self._slots = _Slots(self.config.max_concurrent_sessions)
        self._running: dict[asyncio.Task[None], Session | None] = {}
        self._sample_counter = itertools.count()
        self._group_counter = itertools.count()

    # ---- public --------------------------------------------------------------------------------------
    async def run_groups(
        self,
        tasks: Iterable[Any],
        *,
        num_groups: int | None = None,
        admit: Callable[[], Awaitable[None]] | None = None,
    ) -> AsyncGenerator[Group, None]:
        """Yield groups as they complete. With `num_groups`, stop after that many, having scheduled
        `config.oversample_groups` extra ones and aborted whatever is still running; otherwise run one
        group per task until `tasks` is exhausted. `admit`, when given, is awaited before each next task is
        taken from `tasks` and its group started (admission control, e.g. a staleness bound)."""
        if num_groups is not None and num_groups < 1:
            raise ValueError("num_groups must be >= 1 or None")
        limit = None if num_groups is None else num_groups + self.config.oversample_groups
        done: asyncio.Queue[Group | None] = asyncio.Queue()
        progress = ProgressDisplay(self.stats, enabled=self.config.progress)
        progress.start()
        producer = asyncio.get_running_loop().create_task(self._produce(tasks, limit, done, admit))
        yielded = 0
        try:
            while num_groups is None or yielded < num_groups:
                group = await done.get()
                if group is None:
                    if not producer.cancelled() and producer.exception() is not None:
                        raise producer.exception()  # type: ignore[misc]
                    break
                yielded += 1
                if num_groups is not None and yielded >= num_groups:
                    self._abort_all(producer)
                yield group
        finally:
            self._abort_all(producer)
            await self._wait_all(producer)
            progress.stop()

    async def run(self, tasks: Iterable[Any], *, num_groups: int | None = None) -> list[Group]:
        """Collect `run_groups` into a list (in completion order)."""
        out = []
        gen = self.run_groups(tasks, num_groups=num_groups)
        try:
            async for g in gen:
                out.append(g)
        finally:
            await gen.aclose()
        return out

    async def aclose(self) -> None:
        """Abort what still runs, wait for every record, close an owned recorder, stop an owned router's
        background probes."""
        self._abort_all(None)
        await self._wait_all(None)
        if self._owns_router:
            await self.router.aclose()
        if self.recorder is not None and self._owns_recorder:
            await self.recorder.aclose()

    # ---- internals -----------------------------------------------------------------------------------
    async def _produce(
        self,
        tasks: Iterable[Any],
        limit: int | None,
        done: asyncio.Queue[Group | None],
        admit: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        n = self.config.group_size
        unit = self.config.group_mode == "unit"
        loop = asyncio.get_running_loop()
        items = iter(tasks)
        try:
            count = 0
            while limit is None or count < limit:
                if admit is not None:
                    await admit()
                item = next(items, _END)
                if item is _END:
                    break
                count += 1
                task = TaskSpec.of(item)
                gi = next(self._group_counter)
                state = _GroupState(Group(f"{self.run_id}-g{gi}", gi, task), n)
                if unit:
                    await self._slots.acquire(n)
                for i in range(n):
                    if not unit:
                        await self._slots.acquire(1)
                    k = next(self._sample_counter)
                    spec = SessionSpec(
                        session_id=f"{self.run_id}-s{k}",
                        task=task,
                        group_id=state.group.group_id,
                        sample_index=i,
                        seed=self.config.seed + k,
                    )
                    self.stats.scheduled += 1
                    self.stats.running += 1
                    t = loop.create_task(self._run_one(spec, state, done))
                    self._running.setdefault(t, None)
                    t.add_done_callback(self._running.pop)
            # everything is scheduled; wait for the sessions, then signal the end
            while self._running:
                await asyncio.wait(list(self._running))
        finally:
            done.put_nowait(None)

    async def _run_one(
        self, spec: SessionSpec, state: _GroupState, done: asyncio.Queue[Group | None]
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        rec: SessionRecord
        env = None
        try:
            env = self.env_factory()
            session = Session(
                spec,
                env=env,
                tokenizer=self.tokenizer,
                engines=self.router,
                config=self.config.session,
                parser=self.parser,
            )
        except Exception as exc:
            rec = _failed_record(spec, ErrorInfo.from_exception("reset", exc), env)
        else:
            self._running[task] = session
            rec = await session.run()
            self._running[task] = None  # from here on the task is never cancelled
        rec.recipe = self.recipe
        rec.policy_id = rec.trajectory.meta.policy_id = self.config.session.policy_id
        if env is not None:
            await _close_env(env)
        self.stats.add(rec)
        self._slots.release(1)
        if self.recorder is not None:
            try:
                await self.recorder.append(rec)
                self.stats.recorded += 1
            except Exception as exc:
                self.stats.record_failures += 1
                log.error("recording session %s failed: %s", spec.session_id, exc)
        if self.observer is not None:
            try:
                self.observer.observe(rec)
            except Exception as exc:  # metrics must never cost a session
                log.error("observing session %s failed: %r", spec.session_id, exc)
        state.slots[spec.sample_index] = rec
        state.left -= 1
        if state.left == 0:
            state.group.records = [r for r in state.slots if r is not None]
            self.stats.groups_done += 1
            done.put_nowait(state.group)

    def _abort_all(self, producer: asyncio.Task[None] | None) -> None:
        if producer is not None and not producer.done():
            producer.cancel()
        for task, session in list(self._running.items()):
            if session is not None and not task.done():
                session.request_abort()
                task.cancel()

    async def _wait_all(self, producer: asyncio.Task[None] | None) -> None:
        waits: list[asyncio.Future[Any]] = list(self._running)
        if producer is not None:
            waits.append(producer)
        if waits:
            await asyncio.wait(waits)


def _failed_record(spec: SessionSpec, error: ErrorInfo, env: Any) -> SessionRecord:
    rec = SessionRecord(
        session_id=spec.session_id,
        task=spec.task.to_record(),
        group_id=spec.group_id,
        sample_index=spec.sample_index,
        seed=spec.seed,
        started_at=time.time(),
        termination=TerminationReason.ENV_ERROR,
        error=error,
    )
    if env is not None:
        rec.env_id = str(getattr(env, "env_id", "") or type(env).__name__)
        rec.env_class = f"{type(env).__module__}:{type(env).__qualname__}"
    rec.trajectory.meta.session_id = spec.session_id
    rec.trajectory.meta.group_id = spec.group_id
    rec.trajectory.termination = TerminationReason.ENV_ERROR
    return rec


async def _close_env(env: Any) -> None:
    try:
        aclose = getattr(env, "aclose", None)
        if aclose is not None:
            await aclose()
        else:
            close = getattr(env, "close", None)
            if close is not None:
                close()
    except Exception as exc:  # a failing cleanup hook must not affect other sessions
        log.warning("closing env %s failed: %s", type(env).__name__, exc)
