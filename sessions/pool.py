"""A set of rollout engines with per-engine concurrency limits, rate limits, throughput fits and failover."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from asyncio_throttle import Throttler

from miles.engine import RolloutEngine
from miles.sessions.config import TimeoutConfig
from miles.sessions.deadlines import ThroughputEstimator


@dataclass
class EngineSlot:
    """One engine of a pool and what the pool knows about it."""

    engine: RolloutEngine
    engine_id: str
    semaphore: asyncio.Semaphore
    throttler: Throttler | None
    throughput: ThroughputEstimator
    inflight: int = 0
    failures: int = 0
    cooldown_until: float = 0.0


class EnginePool:
    """Chooses an engine for each generate call: the least loaded one that is not cooling down after a
    failure and not excluded by the caller (a retry excludes the engine that just failed)."""

    def __init__(self, engines: Sequence[RolloutEngine] | RolloutEngine, *, timeouts: TimeoutConfig,
                 max_inflight_per_engine: int = 64, requests_per_s: float | None = None,
                 cooldown_s: float = 5.0) -> None:
        engines = [engines] if isinstance(engines, RolloutEngine) else list(engines)
        if not engines:
            raise ValueError("an EnginePool needs at least one engine")
        self.cooldown_s = cooldown_s
        self.slots: list[EngineSlot] = []
        for i, e in enumerate(engines):
            eid = getattr(e, "engine_id", "") or f"engine-{i}"
            throttler = None
            if requests_per_s is not None:
                # asyncio-throttle counts whole requests per period; a 1 s window keeps rates >= 1/s exact.
                period = 1.0 if requests_per_s >= 1 else 1.0 / requests_per_s
                throttler = Throttler(rate_limit=max(1, int(requests_per_s)), period=period)
            self.slots.append(EngineSlot(e, eid, asyncio.Semaphore(max_inflight_per_engine), throttler,
                                         ThroughputEstimator(timeouts)))
        self._rr = 0

    @property
    def engines(self) -> list[RolloutEngine]:
        return [s.engine for s in self.slots]

    def choose(self, exclude: frozenset[str] = frozenset()) -> EngineSlot:
        """The slot to use next. Falls back to excluded or cooling engines when nothing else is left."""
        now = time.monotonic()
        n = len(self.slots)
        if n == 1:
            return self.slots[0]
        best: EngineSlot | None = None
        best_key: tuple[int, float, int, int] | None = None
        self._rr = (self._rr + 1) % n
        for k in range(n):
            s = self.slots[(self._rr + k) % n]
            key = (1 if s.engine_id in exclude else 0, max(0.0, s.cooldown_until - now), s.inflight, k)
            if best_key is None or key < best_key:
                best, best_key = s, key
        assert best is not None
        return best

    async def acquire(self, exclude: frozenset[str] = frozenset()) -> EngineSlot:
        """Choose a slot and wait for its concurrency and rate limits. Pair with `release`."""
        slot = self.choose(exclude)
        slot.inflight += 1
        try:
            await slot.semaphore.acquire()
        except BaseException:
            slot.inflight -= 1
            raise
        if slot.throttler is not None:
            try:
                await slot.throttler.acquire()
            except BaseException:
                self.release(slot)
                raise
        return slot

    def release(self, slot: EngineSlot) -> None:
        slot.inflight -= 1
        slot.semaphore.release()

    def mark_failed(self, slot: EngineSlot) -> None:
        """An infrastructure failure: keep the engine out of rotation for `cooldown_s` while others exist."""
        slot.failures += 1
        slot.cooldown_until = time.monotonic() + self.cooldown_s

    def mark_ok(self, slot: EngineSlot) -> None:
        if slot.cooldown_until:
            slot.cooldown_until = 0.0
