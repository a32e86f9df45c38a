"""`InProcessRouter`: several `RolloutEngine`s behind one, with sticky sessions, least-outstanding-requests
balancing, periodic health checks and failover.

A generate call always carries the session's full context (`input_ids` is everything so far), so failing
over to another engine only costs that engine a full prefill: the request is re-sent there as is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from miles.engine import EngineError, GenerateResult, RolloutEngine, SamplingParams

logger = logging.getLogger(__name__)


class InProcessRouter(RolloutEngine):
    """Routes each call to one of `engines`.

    * sticky: a session goes back to the engine that served its last turn (its KV cache is there);
    * new sessions and session-less calls go to the live engine with the fewest outstanding requests;
    * every `health_interval_s` each engine's `health()` is polled; dead engines leave the pool and come
      back once healthy;
    * a retryable `EngineError` marks the engine dead and re-sends the call to another live engine.
    """

    def __init__(self, engines: Sequence[RolloutEngine], *, health_interval_s: float = 2.0,
                 engine_id: str = "router", max_sticky_sessions: int = 100_000, owns_engines: bool = True) -> None:
        if not engines:
            raise ValueError("InProcessRouter needs at least one engine")
        self.engines = list(engines)
        self.engine_id = engine_id
        self.health_interval_s = health_interval_s
        self.owns_engines = owns_engines
        self._alive = [True] * len(self.engines)
        self._outstanding = [0] * len(self.engines)
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self._max_sticky = max_sticky_sessions
        self._rid_engine: dict[str, int] = {}
        self._health_task: asyncio.Task[None] | None = None
        self.failovers = 0

    # ------------------------------------------------------------------ state
    @property
    def alive(self) -> list[bool]:
        return list(self._alive)

    @property
    def outstanding(self) -> list[int]:
        return list(self._outstanding)

    @property
    def num_in_flight(self) -> int:
        return sum(self._outstanding)

    @property
    def weight_version(self) -> int:
        live = [e.weight_version for e, ok in zip(self.engines, self._alive, strict=True) if ok]
        return min(live) if live else min(e.weight_version for e in self.engines)

    def _ensure_health_task(self) -> None:
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def _health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.health_interval_s)

    async def check_health(self) -> list[bool]:
        """Poll every engine once and update the pool."""
        results = await asyncio.gather(*(self._probe(e) for e in self.engines))
        for i, ok in enumerate(results):
            if ok != self._alive[i]:
                logger.warning("engine %s is now %s", self.engines[i].engine_id, "alive" if ok else "dead")
            self._alive[i] = ok
        return list(results)

    @staticmethod
    async def _probe(engine: RolloutEngine) -> bool:
        try:
            return bool(await asyncio.wait_for(engine.health(), timeout=30.0))
        except (TimeoutError, EngineError, OSError):
            return False

    def _pick(self, session_id: str | None, exclude: set[int]) -> int:
        if session_id is not None:
            i = self._sticky.get(session_id)
            if i is not None and self._alive[i] and i not in exclude:
                self._sticky.move_to_end(session_id)
                return i
        live = [i for i, ok in enumerate(self._alive) if ok and i not in exclude]
        if not live:
            raise EngineError("no live engine left", engine_id=self.engine_id)
        return min(live, key=lambda i: (self._outstanding[i], i))

    def _stick(self, session_id: str | None, i: int) -> None:
        if session_id is None:
            return
        self._sticky[session_id] = i
        self._sticky.move_to_end(session_id)
        while len(self._sticky) > self._max_sticky:
            self._sticky.popitem(last=False)

    # ------------------------------------------------------------------ RolloutEngine
    async def generate(self, input_ids: list[int], sampling_params: SamplingParams, *,
                       session_id: str | None = None, rid: str | None = None) -> GenerateResult:
        self._ensure_health_task()
        rid = rid or uuid.uuid4().hex
        tried: set[int] = set()
        while True:
            i = self._pick(session_id, tried)
            self._stick(session_id, i)
            self._outstanding[i] += 1
            self._rid_engine[rid] = i
            try:
                result = await self.engines[i].generate(input_ids, sampling_params, session_id=session_id, rid=rid)
            except EngineError as exc:
                if not exc.retryable:
                    raise
                logger.warning("engine %s failed (%s); failing over", self.engines[i].engine_id, exc)
                self._alive[i] = False
                tried.add(i)
                self.failovers += 1
                continue
            finally:
                self._outstanding[i] -= 1
                self._rid_engine.pop(rid, None)
            result.extra.setdefault("routed_to", self.engines[i].engine_id)
            return result

    async def abort(self, rid: str) -> None:
        i = self._rid_engine.get(rid)
        targets = [self.engines[i]] if i is not None else [e for e, ok in zip(self.engines, self._alive,
                                                                               strict=True) if ok]
        for engine in targets:
            with contextlib.suppress(EngineError):
                await engine.abort(rid)

    async def health(self) -> bool:
        return any(await self.check_health())

    async def update_weights(self, *, state_dict: dict[str, Any] | None = None, path: str | None = None,
                             version: int | None = None) -> int:
        """Update every live engine (a shared broadcast group is used when all engines joined one)."""
        live = [e for e, ok in zip(self.engines, self._alive, strict=True) if ok]
        group = getattr(live[0], "_weight_group", None) if live else None
        if state_dict is not None and group is not None and group.world_size == len(live) + 1 and all(
                getattr(e, "_weight_group", None) is group for e in live):
            from miles.engines.weight_broadcast import broadcast_weights

            await broadcast_weights(group, live, state_dict,
                                    version=self.weight_version + 1 if version is None else version)
            return self.weight_version
        versions = await asyncio.gather(*(e.update_weights(state_dict=state_dict, path=path, version=version)
                                         for e in live))
        return min(versions)

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._health_task
            self._health_task = None
        if self.owns_engines:
            for engine in self.engines:
                await engine.close()
