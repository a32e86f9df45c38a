"""`EngineLoad`: what an engine reports about its queue, and SGLang's `GET /v1/loads` wire format.

SGLang 0.5.23 publishes one load snapshot per data-parallel rank (`LoadSnapshot` in
`sglang/srt/managers/load_snapshot.py`); `/v1/loads` answers `{"loads": [{"dp_rank", "num_running_reqs",
"num_waiting_reqs", "num_waiting_uncached_tokens", ...}, ...]}`. The embedded engine knows the same numbers
directly. Routers use them for load-aware deadlines (see `miles.sessions.TimeoutConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from miles.engine import EngineError

LOADS_PATH = "/v1/loads"


@dataclass(frozen=True)
class EngineLoad:
    """Requests decoding (`running`) and queued for prefill (`waiting`) at an engine, over all its ranks;
    `waiting_tokens` is the uncached prompt tokens of the waiting ones, None when the engine doesn't say."""

    running: int
    waiting: int
    waiting_tokens: int | None = None

    @property
    def requests(self) -> int:
        return self.running + self.waiting


@runtime_checkable
class ReportsLoad(Protocol):
    """An engine that can say how loaded it is (`SGLangClient`, `EmbeddedEngine`)."""

    async def load(self) -> EngineLoad: ...


def _count(snapshot: dict[str, Any], key: str) -> int:
    value = snapshot.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise EngineError(f"/v1/loads: {key} is {value!r}, not a count", retryable=False)
    return int(value)


def parse_loads(body: Any) -> EngineLoad:
    """An `EngineLoad` from a `/v1/loads` answer (summed over data-parallel ranks)."""
    loads = body.get("loads") if isinstance(body, dict) else None
    if not isinstance(loads, list) or not all(isinstance(x, dict) for x in loads):
        raise EngineError(f"/v1/loads: expected {{'loads': [...]}}, got {str(body)[:200]}", retryable=False)
    tokens = [x for x in loads if "num_waiting_uncached_tokens" in x]
    return EngineLoad(
        running=sum(_count(x, "num_running_reqs") for x in loads),
        waiting=sum(_count(x, "num_waiting_reqs") for x in loads),
        waiting_tokens=sum(_count(x, "num_waiting_uncached_tokens") for x in tokens) if tokens else None,
    )


def loads_body(load: EngineLoad) -> dict[str, Any]:
    """The `/v1/loads` answer of a one-rank engine with `load` (what the embedded server serves)."""
    snapshot: dict[str, Any] = {
        "dp_rank": 0,
        "num_running_reqs": load.running,
        "num_waiting_reqs": load.waiting,
    }
    if load.waiting_tokens is not None:
        snapshot["num_waiting_uncached_tokens"] = load.waiting_tokens
    return {"loads": [snapshot]}
