"""Typed configuration for sessions and the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from miles.config import ConfigError
from miles.engine import BASE_POLICY, SamplingParams
from miles.tools import UnknownParserError, get_parser


class SessionConfigError(ConfigError):
    """A scheduler or session setting is out of range; the message names it."""

    def __init__(self, message: str) -> None:
        super().__init__("", message)
        self.args = (message,)


@dataclass(frozen=True)
class TimeoutConfig:
    """Context- and load-aware deadlines.

    A turn sent to engine E gets the deadline `clamp(slack * expected_s, turn_floor_s, turn_cap_s)` with

        expected_s = overhead + prefill_wait + uncached * prefill_s_per_token
                     + max_new_tokens * decode_s_per_token * (1 + batch_slowdown * requests_ahead)

    and, while it runs, every request sent to E behind it adds
    `uncached_behind * prefill_s_per_token + batch_slowdown * max_new_tokens * decode_s_per_token`
    to `expected_s` (engines prefill new arrivals before the next decode step, and the batch grows).

    - `overhead`, `prefill_s_per_token`, `decode_s_per_token`: E's measured (EMA least-squares) costs, the
      priors until `min_observations` calls were measured on E.
    - `uncached`: the prompt tokens E does not hold in its cache for this session.
    - `prefill_wait`: the prefill still queued at E when the turn is sent (engines prefill in arrival
      order): `prefill_s_per_token` times the uncached tokens of the calls this router sent to E that are not
      known to be past their prefill (no call sent at or after them has returned), less the time since the
      oldest of them was sent; or, when larger, what E reports waiting (`EngineLoad.waiting_tokens`, else its
      waiting requests times this turn's `uncached`) times `prefill_s_per_token`.
    - `requests_ahead`: the requests in flight at E, from this router or, when larger, as E reports them
      (`running + waiting`).
    - `batch_slowdown`: how much each other request in the batch slows one decode step: 0 for ideal
      continuous batching, 1 for an engine that serves one request at a time (measured ~0.05 for the
      embedded engine on CPU with the 3M tiny model).

    With an idle engine this is `slack * (overhead + uncached * prefill + max_new_tokens * decode)`.
    `env_step_s`/`env_reset_s` bound env calls, `session_budget_s` a whole session, `abort_s` an abort.
    """

    turn_floor_s: float = 5.0
    turn_cap_s: float = 600.0
    slack: float = 3.0
    prior_prefill_tokens_per_s: float = 2000.0
    prior_decode_tokens_per_s: float = 50.0
    prior_overhead_s: float = 0.05
    batch_slowdown: float = 0.05
    ema_decay: float = 0.9
    min_observations: int = 4
    env_step_s: float = 120.0
    env_reset_s: float = 60.0
    session_budget_s: float | None = 3600.0
    abort_s: float = 5.0

    def validate(self) -> None:
        if not 0 < self.turn_floor_s <= self.turn_cap_s:
            raise SessionConfigError(
                f"need 0 < turn_floor_s ({self.turn_floor_s}) <= turn_cap_s ({self.turn_cap_s})"
            )
        if self.slack <= 0 or not 0 <= self.ema_decay < 1:
            raise SessionConfigError("slack must be > 0 and ema_decay in [0, 1)")
        if self.prior_prefill_tokens_per_s <= 0 or self.prior_decode_tokens_per_s <= 0:
            raise SessionConfigError("prior throughputs must be > 0")
        if not 0 <= self.batch_slowdown <= 1:
            raise SessionConfigError(f"batch_slowdown must be in [0, 1], got {self.batch_slowdown}")
        if self.env_step_s <= 0 or self.env_reset_s <= 0 or self.abort_s <= 0:
            raise SessionConfigError("env_step_s, env_reset_s and abort_s must be > 0")
        if self.session_budget_s is not None and self.session_budget_s <= 0:
            raise SessionConfigError("session_budget_s must be > 0 or None")


@dataclass(frozen=True)
class RetryConfig:
    """Retries of infrastructure failures, and how the router judges an engine.

    A failed attempt is retried after `min(max_delay_s, base_delay_s * 2**attempt)` seconds, times a random
    factor in `[1 - jitter, 1 + jitter]`, at most `max_retries` times per turn.

    An engine becomes *suspect* (no new work) after a connection-level failure; after a turn timeout when it
    finished nothing since that turn was sent while another call there is also past its expected time;
    after `suspect_after_timeouts` consecutive turn timeouts; or when a health probe (its `health()`, bounded
    by `probe_timeout_s`) fails after a timeout or while it is idle. A turn that timed out on a suspect engine
    is retried at once on another engine (within `max_retries`).
    A suspect engine is probed every `health_interval_s` (or at once when no engine is left) and comes back
    on probation (one request at a time) until a generate call on it succeeds.
    """

    max_retries: int = 4
    base_delay_s: float = 0.2
    max_delay_s: float = 10.0
    jitter: float = 0.5
    suspect_after_timeouts: int = 2
    probe_timeout_s: float = 3.0
    health_interval_s: float = 2.0

    def validate(self) -> None:
        if self.max_retries < 0 or self.base_delay_s < 0 or self.max_delay_s < 0:
            raise SessionConfigError("max_retries, base_delay_s and max_delay_s must be >= 0")
        if not 0 <= self.jitter <= 1:
            raise SessionConfigError(f"jitter must be in [0, 1], got {self.jitter}")
        if self.suspect_after_timeouts < 1:
            raise SessionConfigError("suspect_after_timeouts must be >= 1")
        if self.probe_timeout_s <= 0 or self.health_interval_s <= 0:
            raise SessionConfigError("probe_timeout_s and health_interval_s must be > 0")


@dataclass(frozen=True)
class SessionConfig:
    """How one session runs.

    `context_length` is the model's context; when None, the engine's `context_length` (or `max_context`) is used
    when it has one, and the context is otherwise unbounded. `max_turns` overrides the env's when set.
    `parser` names a `miles.tools` tool-call parser. A task whose `data` holds `sampling` (a mapping of
    `SamplingParams` fields, e.g. `{"max_new_tokens": 512}` for a long task) overrides `sampling` for its
    sessions; an unknown field ends them `env_error`, named. `policy_id` is the policy that generates: "base",
    or the name of a LoRA adapter the engines serve (sent with every generate call, recorded with the session).
    """

    sampling: SamplingParams = field(default_factory=SamplingParams)
    context_length: int | None = None
    max_turns: int | None = None
    parser: str = "hermes"
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    policy_id: str = BASE_POLICY

    def validate(self) -> None:
        if not self.policy_id:
            raise SessionConfigError(f"policy_id must name an adapter or be {BASE_POLICY!r}")
        if self.context_length is not None and self.context_length <= 0:
            raise SessionConfigError("context_length must be > 0")
        if self.max_turns is not None and self.max_turns <= 0:
            raise SessionConfigError("max_turns must be > 0")
        if self.sampling.max_new_tokens <= 0:
            raise SessionConfigError("sampling.max_new_tokens must be > 0")
        try:
            get_parser(self.parser)
        except UnknownParserError as exc:
            raise SessionConfigError(f"session.parser: {exc}") from None
        self.timeouts.validate()
        self.retry.validate()


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler runs many sessions.

    - `group_size`: samples per task (a GRPO group).
    - `group_mode`: "unit" starts a group only when all its samples fit under `max_concurrent_sessions`;
      "backfill" starts samples one by one as slots free up.
    - `oversample_groups`: extra groups scheduled beyond the number asked for; the first groups to finish
      are kept and the rest are aborted (and still recorded).
    - `max_inflight_per_engine`: concurrent generate calls per engine; `requests_per_s`: a rate limit per
      engine (asyncio-throttle), None for none.
    - `progress`: True/False forces the rich display on/off; None shows it only on a terminal.
    - `seed`: sample `i` of the run gets seed `seed + i` for sampling and env reset (unless its task has one).
    """

    session: SessionConfig = field(default_factory=SessionConfig)
    group_size: int = 1
    group_mode: str = "unit"
    oversample_groups: int = 0
    max_concurrent_sessions: int = 256
    max_inflight_per_engine: int = 64
    requests_per_s: float | None = None
    progress: bool | None = None
    seed: int = 0

    def validate(self) -> None:
        if self.group_size < 1:
            raise SessionConfigError("group_size must be >= 1")
        if self.group_mode not in ("unit", "backfill"):
            raise SessionConfigError(f"group_mode must be 'unit' or 'backfill', got {self.group_mode!r}")
        if self.oversample_groups < 0:
            raise SessionConfigError("oversample_groups must be >= 0")
        if self.max_concurrent_sessions < 1 or self.max_inflight_per_engine < 1:
            raise SessionConfigError("max_concurrent_sessions and max_inflight_per_engine must be >= 1")
        if self.group_mode == "unit" and self.group_size > self.max_concurrent_sessions:
            raise SessionConfigError(
                f"group_size {self.group_size} exceeds max_concurrent_sessions "
                f"{self.max_concurrent_sessions} in 'unit' mode"
            )
        if self.requests_per_s is not None and self.requests_per_s <= 0:
            raise SessionConfigError("requests_per_s must be > 0 or None")
        self.session.validate()
