"""Session metrics: every session-level family is derived from the finished `SessionRecord`, in one call.

`SessionScheduler(observer=SessionMetrics(labels))` calls `observe(record)` once per session, right after
recording it. `observe_router(stats)` adds the router's per-engine view (placements, suspect marks, state).
"""

from __future__ import annotations

from typing import Any, Protocol

from miles.engine import BASE_POLICY, FinishReason
from miles.observability import Metrics, RunLabels, process_metrics
from miles.sessions.records import SessionRecord
from miles.sessions.router import EngineState, RouterStats
from miles.types import TerminationReason, ToolErrorType


class SessionObserver(Protocol):
    """Something told about every finished session (after it was recorded)."""

    def observe(self, record: SessionRecord) -> None: ...


UNKNOWN_TOOL = "unknown"
NO_ENGINE = "none"
TIMEOUT_ERRORS = frozenset({"TurnTimeout"})  # `ErrorInfo.type` of an attempt that missed its deadline
# Counters whose label values are known in advance, started at 0 when their env (or engine) is first seen.
_ENV_ZEROS = (
    ("miles_sessions_total", tuple(t.value for t in TerminationReason)),
    ("miles_tool_errors_total", tuple(k.value for k in ToolErrorType)),
)
_ENGINE_ZEROS = (
    ("miles_turn_retries_total", ("timeout", "error")),
    ("miles_turns_total", tuple(f.value for f in FinishReason)),
)


class SessionMetrics:
    """Feeds the `miles_session_*`, `miles_turn_*` and `miles_tool_*` families from finished records.

    `labels.env` is used when a record carries no env id. Tool-name labels are limited to the tools in the
    record's schema (anything else counts as `unknown`), so a model that invents names cannot grow the series.
    Time to first token is not here: the engines do not stream, so it is measured where an engine produces
    it (`miles_engine_time_to_first_token_seconds`).

    Counters whose label values are known in advance (terminations, tool error kinds, finish reasons and
    retry reasons of an engine) start at 0 the first time their env or engine is seen, so that `rate()`
    sees their first increase and panels show 0 rather than nothing. A session's counter increments are
    summed before they reach the client (one update per series per session).
    """

    def __init__(self, labels: RunLabels, *, metrics: Metrics | None = None) -> None:
        self.labels = labels
        self.metrics = metrics or process_metrics()
        self._seen: set[tuple[str, ...]] = set()

    def _first_sight(self, key: tuple[str, ...], zeros: tuple[tuple[str, tuple[str, ...]], ...]) -> None:
        if key in self._seen:
            return
        self._seen.add(key)
        for name, values in zeros:
            for v in values:
                self.metrics.child(name, *key, v).inc(0)

    def observe(self, record: SessionRecord) -> None:
        m = self.metrics
        adapter = self.labels.adapter if record.policy_id == BASE_POLICY else record.policy_id
        base = (self.labels.run, record.env_id or self.labels.env, self.labels.model, adapter)
        self._first_sight(base, _ENV_ZEROS)
        m.child("miles_sessions_total", *base, record.termination.value).inc()
        m.child("miles_session_duration_seconds", *base).observe(record.duration_s)
        m.child("miles_session_turns", *base).observe(len(record.turns))
        m.child("miles_session_generated_tokens", *base).observe(
            sum(t.output_end - t.output_start for t in record.turns)
        )
        m.child("miles_session_reward", *base).observe(record.reward)
        for component, value in record.reward_components.items():
            m.child("miles_session_reward_component", *base, component).observe(value)
        known_tools = {(t.get("function") or {}).get("name") for t in record.tools}
        counts: dict[tuple[str, ...], float] = {}
        for turn in record.turns:
            self._turn(base, turn, known_tools, counts)
        for (name, *values), n in counts.items():
            m.child(name, *values).inc(n)

    def _turn(
        self, base: tuple[str, ...], turn: Any, known_tools: set[Any], counts: dict[tuple[str, ...], float]
    ) -> None:
        m = self.metrics

        def count(*key: str, n: float = 1.0) -> None:
            counts[key] = counts.get(key, 0.0) + n

        for attempt in turn.attempts:
            engine_id = attempt.engine_id or NO_ENGINE
            self._first_sight((*base, engine_id), _ENGINE_ZEROS)
            reason = "timeout" if attempt.error.type in TIMEOUT_ERRORS else "error"
            count("miles_turn_retries_total", *base, engine_id, reason)
        engine_id = turn.engine_id or NO_ENGINE
        m.child("miles_turn_queue_seconds", *base, engine_id).observe(turn.queue_s)
        if turn.finish_reason:  # the generate call succeeded
            self._first_sight((*base, engine_id), _ENGINE_ZEROS)
            count("miles_turns_total", *base, engine_id, turn.finish_reason)
            m.child("miles_turn_generate_seconds", *base, engine_id).observe(turn.generate_s)
            m.child("miles_turn_output_tokens", *base, engine_id).observe(turn.output_end - turn.output_start)
            count("miles_turn_prompt_tokens_total", *base, engine_id, n=turn.prompt_tokens)
            count("miles_turn_cached_tokens_total", *base, engine_id, n=turn.cached_tokens)
        if turn.assistant:
            m.child("miles_turn_env_seconds", *base).observe(turn.env_s)
        for call in turn.tool_calls:
            name = (call.get("function") or {}).get("name")
            count("miles_tool_calls_total", *base, name if name in known_tools else UNKNOWN_TOOL)
        for kind, n in turn.tool_errors.items():
            count("miles_tool_errors_total", *base, kind, n=n)
        for result in turn.tool_results:
            duration = result.get("duration_s")
            if isinstance(duration, int | float) and not isinstance(duration, bool):
                name = result.get("name")
                m.child(
                    "miles_tool_duration_seconds", *base, name if name in known_tools else UNKNOWN_TOOL
                ).observe(duration)

    def observe_router(self, stats: RouterStats) -> None:
        """One stats window of the scheduler's router (`router.stats(reset=True)`, once per step): turns by
        placement, suspect marks, and each engine's current state."""
        m, run, model = self.metrics, self.labels.run, self.labels.model
        for e in stats.engines:
            labels = (run, model, e.engine_id)
            for placement, count in (("new", e.new_sessions), ("stayed", e.stayed), ("switched", e.switched)):
                if count:
                    m.child("miles_router_turns_total", *labels, placement).inc(count)
            m.child("miles_router_suspect_marks_total", *labels).inc(e.suspect_marks)
            for state in EngineState:
                m.child("miles_router_engine_state", *labels, state.value).set(float(e.state is state))
