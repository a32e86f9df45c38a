"""`Router`: the one routing layer between sessions and rollout engines.

Every generate call of a session goes through `Router.acquire`, which picks an engine and a deadline, and
comes back through exactly one of `succeeded`, `timed_out`, `failed` or `release`:

* **Affinity.** A session's turns go to the engine that served its last turn (its KV cache is there) unless
  that engine is suspect, on probation with a trial running, excluded by the caller, or *overloaded*: it
  has no room (`in flight >= max_inflight_per_engine`, waiting requests included) while another usable
  engine has room. `choose_engine` is the whole decision, as a pure function.
* **Placement.** New sessions (and moved ones) go to the usable engine with the fewest requests in flight;
  when none has room, to the one with the shortest queue.
* **Health.** An engine becomes *suspect* after a connection-level failure, a health probe that fails or
  times out, or turn timeouts (see `RetryConfig`); it then gets no new work. Suspect engines are probed
  (`health()` under `probe_timeout_s`) every `health_interval_s`, and at once when no engine is usable; a
  passing probe puts the engine on *probation* (one request at a time) until a generate call succeeds.
* **Deadlines.** Each lease carries a `TurnDeadline` that includes the queue at its engine (the formula is
  on `TimeoutConfig`) and grows while requests arrive behind it.
* **Stats.** `stats()` is a frozen per-engine snapshot (cached-token ratio, turns that stayed on their cache
  engine or switched, suspect marks with their times, retries) for the train loop, reset per step.

The real sglang-router (`miles.engines.SGLangRouter`) is one engine to this router.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Collection, Sequence
from dataclasses import dataclass, field
from enum import Enum

from asyncio_throttle import Throttler

from miles.engine import EngineError, GenerateResult, RolloutEngine
from miles.engines.load import EngineLoad, ReportsLoad
from miles.sessions.config import RetryConfig, TimeoutConfig
from miles.sessions.deadlines import ThroughputEstimate, ThroughputEstimator, TurnDeadline

log = logging.getLogger(__name__)


class EngineState(str, Enum):
    """How the router judges an engine."""

    HEALTHY = "healthy"
    PROBATION = "probation"  # a probe passed after it was suspect: one request at a time until one succeeds
    SUSPECT = "suspect"  # no new work until a probe or generate call on it succeeds


class Placement(str, Enum):
    """Where a call went relative to the engine holding its session's cache."""

    NEW = "new"  # the session has no cache engine yet (or no session id)
    STAYED = "stayed"  # on its cache engine
    SWITCHED = "switched"  # elsewhere: the cache engine was suspect, overloaded or excluded


class NoHealthyEngineError(EngineError):
    """Every engine the call may use is suspect (and failed its probe) or excluded."""

    def __init__(self, message: str) -> None:
        super().__init__(message, engine_id="", retryable=True)


@dataclass(frozen=True)
class EngineView:
    """What the routing decision sees of one engine: its state, its requests in flight (waiting ones
    included) and its concurrency limit."""

    state: EngineState
    inflight: int
    limit: int

    @property
    def accepts(self) -> bool:
        """It may take one more request now or queue it: healthy, or on probation with no trial running."""
        return self.state is EngineState.HEALTHY or (
            self.state is EngineState.PROBATION and self.inflight == 0
        )

    @property
    def has_room(self) -> bool:
        return self.accepts and self.inflight < self.limit


def choose_engine(
    views: Sequence[EngineView], *, cache: int | None = None, exclude: Collection[int] = (), start: int = 0
) -> int | None:
    """The index of the engine for the next call, or None when no engine outside `exclude` accepts work.

    `cache` is the engine holding the session's cache: it is chosen when it accepts work and is not
    overloaded (it has room, or no other usable engine has room). Otherwise the usable engine with room and
    the fewest requests in flight is chosen; when none has room, the one with the shortest queue. Ties go
    round-robin from `start`.
    """
    usable = [i for i, v in enumerate(views) if i not in exclude and v.accepts]
    if not usable:
        return None
    room = [i for i in usable if views[i].has_room]
    if cache in usable and (views[cache].has_room or not room):
        return cache
    n = len(views)
    if room:
        return min(room, key=lambda i: (views[i].inflight, (i - start) % n))
    return min(usable, key=lambda i: (views[i].inflight - views[i].limit, (i - start) % n))


@dataclass(frozen=True)
class EngineStats:
    """One engine's routing facts over a stats window (see `Router.stats`); times are `time.monotonic()`."""

    engine_id: str
    state: EngineState
    inflight: int
    turns: int  # generate calls that succeeded
    prompt_tokens: int
    cached_tokens: int
    new_sessions: int  # turns of sessions without a cache engine
    stayed: int  # turns served by the engine holding the session's cache
    switched: int  # turns served here although the session's cache was on another engine
    retries: int  # attempts sent here to retry a turn that failed or timed out
    timeouts: int
    failures: int
    suspect_marks: int
    suspect_marked_at: tuple[float, ...]
    first_sent_at: float | None

    @property
    def cached_token_ratio(self) -> float:
        """Cached prompt tokens / prompt tokens of the turns served here (0 when none)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class RouterStats:
    """A snapshot of every engine's `EngineStats`, with totals."""

    engines: tuple[EngineStats, ...]

    def _sum(self, name: str) -> int:
        return sum(getattr(e, name) for e in self.engines)

    @property
    def cached_token_ratio(self) -> float:
        prompt = self._sum("prompt_tokens")
        return self._sum("cached_tokens") / prompt if prompt else 0.0

    @property
    def affinity(self) -> float:
        """Of the turns whose session had a cache engine, the share served there (1.0 when none)."""
        stayed, switched = self._sum("stayed"), self._sum("switched")
        return stayed / (stayed + switched) if stayed + switched else 1.0

    def to_metrics(self, prefix: str = "router_") -> dict[str, float]:
        """Flat numbers for a metrics row: totals, and each engine's cached-token ratio by position."""
        out = {f"{prefix}cached_token_ratio": self.cached_token_ratio, f"{prefix}affinity": self.affinity}
        for name in ("turns", "stayed", "switched", "retries", "timeouts", "failures", "suspect_marks"):
            out[f"{prefix}{name}"] = float(self._sum(name))
        for i, e in enumerate(self.engines):
            out[f"{prefix}engine{i}_cached_token_ratio"] = e.cached_token_ratio
            out[f"{prefix}engine{i}_suspect"] = float(e.state is EngineState.SUSPECT)
        return out


@dataclass
class _Counters:
    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    new_sessions: int = 0
    stayed: int = 0
    switched: int = 0
    retries: int = 0
    timeouts: int = 0
    failures: int = 0
    suspect_marked_at: list[float] = field(default_factory=list)
    first_sent_at: float | None = None


class _Engine:
    """The router's mutable view of one engine."""

    def __init__(
        self,
        engine: RolloutEngine,
        engine_id: str,
        limit: int,
        throttler: Throttler | None,
        throughput: ThroughputEstimator,
    ) -> None:
        self.engine, self.engine_id, self.limit = engine, engine_id, limit
        self.throttler, self.throughput = throttler, throughput
        self.semaphore = asyncio.Semaphore(limit)
        self.state = EngineState.HEALTHY
        self.suspect_reason = ""
        self.inflight = 0  # leases handed out or being waited for
        self.sent: set[Lease] = set()  # leases whose call is in flight
        self.queue: deque[Lease] = deque()  # sent calls in send order, head first; finished ones are skipped
        self.queued_tokens = 0  # uncached tokens of the sent calls not known to be past their prefill
        self.arrived_tokens = 0  # uncached tokens of every call ever sent here (deadlines grow with them)
        self.arrivals = 0
        self.consecutive_timeouts = 0
        self.last_success_at = -math.inf
        self.reports_load = isinstance(engine, ReportsLoad)
        self.load: EngineLoad | None = None
        self.load_at = -math.inf
        self.last_probe_at = -math.inf
        self.probe: asyncio.Task[bool] | None = None
        self.counters = _Counters()

    def view(self) -> EngineView:
        return EngineView(self.state, self.inflight, self.limit)

    def prefill_wait_s(self, now: float, per_token: float) -> float:
        """The prefill still queued here, worked on since the oldest queued call was sent."""
        while self.queue and not self.queue[0].in_queue:
            self.queue.popleft()
        if not self.queue:
            return 0.0
        return max(0.0, self.queued_tokens * per_token - (now - self.queue[0].sent_at))

    def prefilled(self, lease: Lease) -> None:
        """`lease` is out of the prefill queue (it returned, or a call sent no earlier did, or it ended)."""
        if lease.in_queue:
            lease.in_queue = False
            self.queued_tokens -= lease.uncached_tokens


class Lease:
    """One generate call's engine and deadline. Hand it back to the router exactly once."""

    def __init__(
        self,
        index: int,
        engine: _Engine,
        *,
        session_id: str | None,
        prompt_tokens: int,
        uncached_tokens: int,
        max_new_tokens: int,
        placement: Placement,
        retry: bool,
        deadline: TurnDeadline,
    ) -> None:
        self.index = index
        self._at = engine
        self.engine: RolloutEngine = engine.engine
        self.engine_id = engine.engine_id
        self.session_id = session_id
        self.prompt_tokens = prompt_tokens
        self.uncached_tokens = uncached_tokens
        self.max_new_tokens = max_new_tokens
        self.placement = placement
        self.retry = retry
        self.sent_at = time.monotonic()
        self.in_queue = True  # not known to be past its prefill yet
        self._deadline = deadline
        self._seen = (engine.arrived_tokens, engine.arrivals)
        self._timeout: asyncio.Timeout | None = None
        self._check: asyncio.TimerHandle | None = None
        self._started = 0.0
        self._cap = math.inf
        self.done = False

    def _sync(self) -> None:
        """Grow the deadline by the calls sent to the engine behind this one (while it is in flight)."""
        if self.done:
            return
        tokens, count = self._at.arrived_tokens, self._at.arrivals
        if count != self._seen[1]:
            self._deadline.add_arrivals(tokens - self._seen[0], count - self._seen[1])
            self._seen = (tokens, count)

    @property
    def deadline_s(self) -> float:
        """The call's current deadline in seconds from its start (capped by `timeout`'s `cap_s`)."""
        self._sync()
        return min(self._deadline.seconds, self._cap)

    def overdue(self, now: float) -> bool:
        """Past its expected completion time (the deadline without slack)."""
        self._sync()
        return now - self.sent_at > self._deadline.expected_s

    @contextlib.asynccontextmanager
    async def timeout(self, cap_s: float = math.inf) -> AsyncIterator[asyncio.Timeout]:
        """An `asyncio.timeout` for the call that expires at its deadline, which grows while calls arrive
        behind it and never exceeds `cap_s` from now. Check `.expired()` on it after a `TimeoutError`."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(None) as cm:
            self._timeout, self._cap, self._started = cm, cap_s, loop.time()
            self._arm()
            try:
                yield cm
            finally:
                if self._check is not None:
                    self._check.cancel()
                self._timeout = None

    def _arm(self) -> None:
        # one timer per call: when it fires, the deadline may have grown meanwhile; then wait on
        if self._timeout is None:
            return
        loop = asyncio.get_running_loop()
        when = self._started + self.deadline_s
        if loop.time() >= when:
            self._timeout.reschedule(loop.time())
        else:
            self._check = loop.call_at(when, self._arm)


class Router:
    """Routes the generate calls of many sessions over `engines` (see the module docstring).

    `max_inflight_per_engine` bounds concurrent calls per engine (more wait for a slot);
    `requests_per_s` rate-limits each engine (asyncio-throttle), None for no limit.
    """

    def __init__(
        self,
        engines: RolloutEngine | Sequence[RolloutEngine],
        *,
        timeouts: TimeoutConfig | None = None,
        retry: RetryConfig | None = None,
        max_inflight_per_engine: int = 64,
        requests_per_s: float | None = None,
        max_sessions: int = 100_000,
    ) -> None:
        engines = [engines] if isinstance(engines, RolloutEngine) else list(engines)
        if not engines:
            raise ValueError("a Router needs at least one engine")
        if max_inflight_per_engine < 1:
            raise ValueError("max_inflight_per_engine must be >= 1")
        self.timeouts = timeouts or TimeoutConfig()
        self.retry = retry or RetryConfig()
        self._engines: list[_Engine] = []
        for i, e in enumerate(engines):
            throttler = None
            if requests_per_s is not None:
                # asyncio-throttle counts whole requests per period; a 1 s window keeps rates >= 1/s exact.
                period = 1.0 if requests_per_s >= 1 else 1.0 / requests_per_s
                throttler = Throttler(rate_limit=max(1, int(requests_per_s)), period=period)
            self._engines.append(
                _Engine(
                    e,
                    getattr(e, "engine_id", "") or f"engine-{i}",
                    max_inflight_per_engine,
                    throttler,
                    ThroughputEstimator(self.timeouts),
                )
            )
        self._affinity: OrderedDict[str, tuple[int, int]] = (
            OrderedDict()
        )  # session -> (engine, cached tokens)
        self._max_sessions = max_sessions
        self._rr = 0
        self._changed = asyncio.Event()
        self._monitor: asyncio.Task[None] | None = None
        self._open = asyncio.Event()  # cleared while `held()` keeps new calls waiting
        self._open.set()

    # ---- what callers read ---------------------------------------------------------------------------
    @property
    def engines(self) -> list[RolloutEngine]:
        return [e.engine for e in self._engines]

    @property
    def engine_ids(self) -> list[str]:
        return [e.engine_id for e in self._engines]

    def states(self) -> list[EngineState]:
        return [e.state for e in self._engines]

    def estimate(self, index: int) -> ThroughputEstimate:
        """Engine `index`'s current throughput fit."""
        return self._engines[index].throughput.estimate()

    def stats(self, *, reset: bool = False) -> RouterStats:
        """Every engine's stats since the last reset; `reset=True` starts a new window (once per step)."""
        out = []
        for e in self._engines:
            c = e.counters
            out.append(
                EngineStats(
                    engine_id=e.engine_id,
                    state=e.state,
                    inflight=e.inflight,
                    turns=c.turns,
                    prompt_tokens=c.prompt_tokens,
                    cached_tokens=c.cached_tokens,
                    new_sessions=c.new_sessions,
                    stayed=c.stayed,
                    switched=c.switched,
                    retries=c.retries,
                    timeouts=c.timeouts,
                    failures=c.failures,
                    suspect_marks=len(c.suspect_marked_at),
                    suspect_marked_at=tuple(c.suspect_marked_at),
                    first_sent_at=c.first_sent_at,
                )
            )
            if reset:
                e.counters = _Counters()
        return RouterStats(tuple(out))

    @property
    def inflight(self) -> int:
        """Calls that hold or wait for a slot on some engine."""
        return sum(e.inflight for e in self._engines)

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """Keep new calls waiting, let every call in flight return, then run the block; new calls go on after
        it. Under it a weight update lands between turns: the turns that were running finished on the old
        weights, and no turn starts until the new ones are in."""
        self._open.clear()
        try:
            while self.inflight:
                await self._wait_change(0.1)
            yield
        finally:
            self._open.set()

    # ---- leases --------------------------------------------------------------------------------------
    async def acquire(
        self,
        session_id: str | None,
        *,
        prompt_tokens: int,
        max_new_tokens: int,
        exclude: Collection[int] = (),
        avoid: Collection[int] = (),
        retry: bool = False,
    ) -> Lease:
        """A lease on the engine for the next call of `session_id`, once that engine has a free slot.

        `exclude`d engines are never used; `avoid`ed ones only when nothing else is usable. `retry` marks
        the call as a retry of a failed or timed-out attempt. Raises `NoHealthyEngineError` when no engine
        outside `exclude` can take the call, even after probing the suspect ones.
        """
        self._ensure_monitor()
        await self._open.wait()
        exclude = frozenset(exclude)
        shunned = exclude | frozenset(avoid)
        probed = False
        while True:
            views = [e.view() for e in self._engines]
            cache, cached = self._affinity.get(session_id, (None, 0)) if session_id is not None else (None, 0)
            i = choose_engine(views, cache=cache, exclude=shunned, start=self._rr)
            if i is None and shunned != exclude:
                i = choose_engine(views, cache=cache, exclude=exclude, start=self._rr)
            if i is None:
                suspects = [
                    e
                    for k, e in enumerate(self._engines)
                    if k not in exclude and e.state is EngineState.SUSPECT
                ]
                trials = [
                    e
                    for k, e in enumerate(self._engines)
                    if k not in exclude and e.state is EngineState.PROBATION
                ]
                if suspects and not probed:
                    probed = True
                    await asyncio.gather(*(self._probe(e) for e in suspects))
                    continue
                if trials:  # a probation trial is running: wait for it to settle the engine's state
                    await self._wait_change(self.retry.probe_timeout_s)
                    continue
                raise NoHealthyEngineError(self._no_engine_message(exclude))
            e = self._engines[i]
            e.inflight += 1
            try:
                await e.semaphore.acquire()
                try:
                    if e.throttler is not None:
                        await e.throttler.acquire()
                except BaseException:
                    e.semaphore.release()
                    raise
            except BaseException:
                e.inflight -= 1
                self._notify()
                raise
            if e.state is EngineState.SUSPECT:  # it turned suspect while this call waited for its slot
                e.inflight -= 1
                e.semaphore.release()
                continue
            self._rr += 1
            placement = (
                Placement.NEW if cache is None else Placement.STAYED if cache == i else Placement.SWITCHED
            )
            return self._send(
                i,
                e,
                session_id,
                prompt_tokens,
                max_new_tokens,
                cached if placement is Placement.STAYED else 0,
                placement,
                retry,
            )

    def _send(
        self,
        i: int,
        e: _Engine,
        session_id: str | None,
        prompt_tokens: int,
        max_new_tokens: int,
        cached: int,
        placement: Placement,
        retry: bool,
    ) -> Lease:
        now = time.monotonic()
        uncached = max(0, prompt_tokens - cached)
        per_token = e.throughput.estimate().prefill_s_per_token
        wait = e.prefill_wait_s(now, per_token)  # engines prefill in arrival order
        ahead = len(e.sent)
        if e.load is not None and now - e.load_at <= 2 * self.retry.health_interval_s:
            tokens = e.load.waiting_tokens if e.load.waiting_tokens is not None else e.load.waiting * uncached
            wait = max(wait, tokens * per_token)
            ahead = max(ahead, e.load.requests)
        deadline = e.throughput.deadline(uncached, max_new_tokens, prefill_wait_s=wait, requests_ahead=ahead)
        e.arrived_tokens += uncached
        e.arrivals += 1
        lease = Lease(
            i,
            e,
            session_id=session_id,
            prompt_tokens=prompt_tokens,
            uncached_tokens=uncached,
            max_new_tokens=max_new_tokens,
            placement=placement,
            retry=retry,
            deadline=deadline,
        )
        e.sent.add(lease)
        e.queue.append(lease)
        e.queued_tokens += uncached
        if e.counters.first_sent_at is None:
            e.counters.first_sent_at = lease.sent_at
        if retry:
            e.counters.retries += 1
        return lease

    def succeeded(self, lease: Lease, result: GenerateResult, latency_s: float) -> None:
        """The call returned `result` after `latency_s`: the engine is healthy and holds the session's cache."""
        e = self._finish(lease)
        if e is None:
            return
        c = e.counters
        prompt = result.prompt_tokens or lease.prompt_tokens
        cached = result.cached_tokens if result.prompt_tokens else lease.prompt_tokens - lease.uncached_tokens
        e.throughput.observe(max(0, prompt - cached), len(result.output_ids), result.latency_s or latency_s)
        c.turns += 1
        c.prompt_tokens += prompt
        c.cached_tokens += result.cached_tokens
        if lease.placement is Placement.NEW:
            c.new_sessions += 1
        elif lease.placement is Placement.STAYED:
            c.stayed += 1
        else:
            c.switched += 1
        e.consecutive_timeouts = 0
        e.last_success_at = time.monotonic()
        while e.queue and e.queue[0].sent_at <= lease.sent_at:  # what was sent before it has been prefilled
            e.prefilled(e.queue.popleft())
        if e.state is not EngineState.HEALTHY:
            log.warning("engine %s is healthy again (a generate call succeeded)", e.engine_id)
            e.state = EngineState.HEALTHY
            self._notify()
        if lease.session_id is not None:
            self._affinity[lease.session_id] = (lease.index, lease.prompt_tokens + len(result.output_ids))
            self._affinity.move_to_end(lease.session_id)
            while len(self._affinity) > self._max_sessions:
                self._affinity.popitem(last=False)

    async def timed_out(self, lease: Lease) -> bool:
        """The call missed its deadline (and was aborted). Returns whether its engine is now suspect.

        The engine becomes suspect when it was on probation, when it finished nothing since this call was
        sent while another call there is also overdue (past its expected time), after
        `suspect_after_timeouts` consecutive timeouts, or when a fast health probe fails.
        """
        e = self._finish(lease)
        if e is None:
            return False
        now = time.monotonic()
        e.counters.timeouts += 1
        e.consecutive_timeouts += 1
        if e.state is EngineState.SUSPECT:
            return True
        reason = ""
        if e.state is EngineState.PROBATION:
            reason = "a call timed out on probation"
        elif e.last_success_at < lease.sent_at and any(o.overdue(now) for o in e.sent):
            reason = f"it finished nothing in {now - lease.sent_at:.3g}s while other calls there were overdue"
        elif e.consecutive_timeouts >= self.retry.suspect_after_timeouts:
            reason = f"{e.consecutive_timeouts} consecutive timeouts"
        if reason:
            self._mark_suspect(e, reason)
        else:
            await self._probe(e)  # a failing probe marks it suspect
        return e.state is EngineState.SUSPECT

    def failed(self, lease: Lease, error: BaseException, *, suspect: bool) -> None:
        """The call failed with `error`; `suspect` when that says the engine is unusable (connection lost,
        5xx), not when the request alone was at fault or was aborted."""
        e = self._finish(lease)
        if e is None:
            return
        e.counters.failures += 1
        if suspect:
            self._mark_suspect(e, f"{type(error).__name__}: {str(error)[:200]}")

    def release(self, lease: Lease) -> None:
        """Hand the lease back without a verdict (the caller was cancelled or ran out of budget)."""
        self._finish(lease)

    def _finish(self, lease: Lease) -> _Engine | None:
        if lease.done:
            return None
        lease._sync()
        lease.done = True
        e = self._engines[lease.index]
        e.sent.discard(lease)
        e.prefilled(lease)
        e.inflight -= 1
        e.semaphore.release()
        self._notify()
        return e

    # ---- health --------------------------------------------------------------------------------------
    def _mark_suspect(self, e: _Engine, reason: str) -> None:
        if e.state is EngineState.SUSPECT:
            return
        now = time.monotonic()
        e.state, e.suspect_reason, e.last_probe_at = EngineState.SUSPECT, reason, now
        e.counters.suspect_marked_at.append(now)
        log.warning("engine %s is suspect: %s", e.engine_id, reason)
        self._notify()

    async def _probe(self, e: _Engine) -> bool:
        """Probe `e` once (concurrent callers share one probe) and apply the verdict."""
        if e.probe is None or e.probe.done():
            e.probe = asyncio.get_running_loop().create_task(self._run_probe(e))
        return await asyncio.shield(e.probe)

    async def _run_probe(self, e: _Engine) -> bool:
        try:
            async with asyncio.timeout(self.retry.probe_timeout_s):
                ok = bool(await e.engine.health())
        except Exception as exc:  # a probe that raises or times out is a failed probe
            log.debug("health probe of %s failed: %r", e.engine_id, exc)
            ok = False
        e.last_probe_at = time.monotonic()
        if ok and e.state is EngineState.SUSPECT:
            log.warning("engine %s passed its health probe: on probation", e.engine_id)
            e.state = EngineState.PROBATION
            self._notify()
        elif not ok:
            self._mark_suspect(e, f"health probe failed (limit {self.retry.probe_timeout_s:g}s)")
        return ok

    async def _refresh_load(self, e: _Engine) -> None:
        try:
            async with asyncio.timeout(self.retry.probe_timeout_s):
                e.load = await e.engine.load()  # type: ignore[attr-defined]
            e.load_at = time.monotonic()
        except Exception as exc:  # an engine without load reports (an older server): stop asking
            log.debug("load report of %s failed: %r", e.engine_id, exc)
            e.reports_load = False

    def _ensure_monitor(self) -> None:
        if self._monitor is None or self._monitor.done():
            self._monitor = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        """While calls are in flight: probe suspect and idle engines and refresh load reports every
        `health_interval_s`. Busy healthy engines are not probed: a probe queued behind their work would
        fail for the wrong reason. Ends after two idle rounds (the next `acquire` restarts it)."""
        interval = self.retry.health_interval_s
        idle = 0
        while idle < 2:
            now = time.monotonic()
            jobs: list[Awaitable[object]] = []
            for e in self._engines:
                stale = now - e.last_probe_at >= interval
                if stale and (
                    e.state is EngineState.SUSPECT or (e.state is EngineState.HEALTHY and e.inflight == 0)
                ):
                    jobs.append(self._probe(e))
                if e.reports_load and e.inflight > 0:
                    jobs.append(self._refresh_load(e))
            await asyncio.gather(*jobs)
            idle = 0 if any(e.inflight for e in self._engines) else idle + 1
            await asyncio.sleep(interval)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._changed.wait()

    def _no_engine_message(self, exclude: frozenset[int]) -> str:
        parts = []
        for k, e in enumerate(self._engines):
            why = "excluded by the caller" if k in exclude else f"{e.state.value}: {e.suspect_reason}"
            parts.append(f"{e.engine_id} ({why})")
        return "no healthy engine left: " + "; ".join(parts)

    async def aclose(self) -> None:
        """Stop background probes (the engines themselves stay open)."""
        tasks = [
            t for t in [self._monitor, *(e.probe for e in self._engines)] if t is not None and not t.done()
        ]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._monitor = None
