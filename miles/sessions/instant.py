"""`InstantEngine`: an in-process `RolloutEngine` that answers from a script at once.

It is the baseline of `benchmarks/scheduler.py` (it costs nothing, so what is measured is the scheduler)
and a deterministic engine for tests of the session loop. Replies come from `replies[k % len(replies)]`
for the k-th call of a session, or from `respond(input_ids, session_id, k)`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from miles.engine import EngineError, FinishReason, GenerateResult, RolloutEngine, SamplingParams

Responder = Callable[[list[int], str | None, int], list[int]]


class InstantEngine(RolloutEngine):
    """Scripted replies with logprob `logprob` per token; `delay_s > 0` sleeps before answering (and can be
    aborted meanwhile). `calls` counts generate calls; `aborted` lists aborted rids; `adapters` the adapter of
    each call (None: the base)."""

    def __init__(
        self,
        replies: Sequence[Sequence[int]] | None = None,
        *,
        respond: Responder | None = None,
        engine_id: str = "instant-0",
        weight_version: int = 0,
        logprob: float = -0.5,
        delay_s: float = 0.0,
        context_length: int | None = None,
    ) -> None:
        if (replies is None) == (respond is None):
            raise ValueError("pass exactly one of replies= or respond=")
        if replies is not None and not replies:
            raise ValueError("replies must not be empty")
        self._replies = [list(r) for r in replies] if replies is not None else None
        self._respond = respond
        self.engine_id = engine_id
        self._version = weight_version
        self.logprob = logprob
        self.delay_s = delay_s
        self.context_length = context_length
        self.calls = 0
        self.aborted: list[str] = []
        self.adapters: list[str | None] = []
        self._per_session: dict[str | None, int] = {}
        self._waiting: dict[str, asyncio.Event] = {}
        self._closed = False

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams,
        *,
        session_id: str | None = None,
        rid: str | None = None,
        adapter: str | None = None,
    ) -> GenerateResult:
        if self._closed:
            raise EngineError(f"{self.engine_id} is closed", engine_id=self.engine_id)
        self.calls += 1
        self.adapters.append(adapter)
        k = self._per_session.get(session_id, 0)
        self._per_session[session_id] = k + 1
        if self.delay_s > 0:
            ev = asyncio.Event()
            if rid is not None:
                self._waiting[rid] = ev
            try:
                await asyncio.wait_for(ev.wait(), self.delay_s)
                return GenerateResult(
                    [], [], FinishReason.ABORT, self._version, len(input_ids), engine_id=self.engine_id
                )
            except TimeoutError:
                pass
            finally:
                if rid is not None:
                    self._waiting.pop(rid, None)
        if self._replies is not None:
            out = self._replies[k % len(self._replies)]
        else:
            assert self._respond is not None
            out = list(self._respond(input_ids, session_id, k))
        out = out[: sampling_params.max_new_tokens]
        stops = sampling_params.stop_token_ids
        finish = FinishReason.LENGTH
        for i, t in enumerate(out):
            if t in stops:
                out, finish = out[: i + 1], FinishReason.STOP
                break
        return GenerateResult(
            list(out),
            [self.logprob] * len(out),
            finish,
            self._version,
            prompt_tokens=len(input_ids),
            engine_id=self.engine_id,
        )

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)
        ev = self._waiting.get(rid)
        if ev is not None:
            ev.set()

    async def health(self) -> bool:
        return not self._closed

    async def update_weights(
        self, *, state_dict: dict[str, Any] | None = None, path: str | None = None, version: int | None = None
    ) -> int:
        self._version = self._version + 1 if version is None else int(version)
        return self._version

    @property
    def weight_version(self) -> int:
        return self._version

    async def close(self) -> None:
        self._closed = True
