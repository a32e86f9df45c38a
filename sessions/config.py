"""Typed configuration for sessions and the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from miles.config import ConfigError
from miles.engine import SamplingParams


class SessionConfigError(ConfigError):
    """A scheduler or session setting is out of range; the message names it."""

    def __init__(self, message: str) -> None:
        super().__init__("", message)
        self.args = (message,)


@dataclass(frozen=True)
class TimeoutConfig:
    """Context-aware deadlines.

    A turn's deadline is `slack * (overhead + uncached_prompt_tokens * prefill_s_per_token
    + max_new_tokens * decode_s_per_token)`, clamped to `[turn_floor_s, turn_cap_s]`, where the per-token
    costs are the engine's measured (EMA) prefill and decode costs. Until `min_observations` turns were
    measured on an engine, the prior throughputs are used.
    """

    turn_floor_s: float = 5.0
    turn_cap_s: float = 600.0
    slack: float = 3.0
    prior_prefill_tokens_per_s: float = 2000.0
    prior_decode_tokens_per_s: float = 50.0
    prior_overhead_s: float = 0.05
    ema_decay: float = 0.9
    min_observations: int = 4
    env_step_s: float = 120.0
    env_reset_s: float = 60.0
    session_budget_s: float | None = 3600.0
    abort_s: float = 5.0

    def validate(self) -> None:
        if not 0 < self.turn_floor_s <= self.turn_cap_s:
            raise SessionConfigError(f"need 0 < turn_floor_s ({self.turn_floor_s}) <= turn_cap_s ({self.turn_cap_s})")
        if self.slack <= 0 or not 0 <= self.ema_decay < 1:
            raise SessionConfigError("slack must be > 0 and ema_decay in [0, 1)")
        if self.prior_prefill_tokens_per_s <= 0 or self.prior_decode_tokens_per_s <= 0:
            raise SessionConfigError("prior throughputs must be > 0")
        if self.env_step_s <= 0 or self.env_reset_s <= 0 or self.abort_s <= 0:
            raise SessionConfigError("env_step_s, env_reset_s and abort_s must be > 0")
        if self.session_budget_s is not None and self.session_budget_s <= 0:
            raise SessionConfigError("session_budget_s must be > 0 or None")


@dataclass(frozen=True)
class RetryConfig:
    """Retries of infrastructure failures: delay `min(max_delay_s, base_delay_s * 2**attempt)`, times a
    random factor in `[1 - jitter, 1 + jitter]`."""

    max_retries: int = 4
    base_delay_s: float = 0.2
    max_delay_s: float = 10.0
    jitter: float = 0.5
    engine_cooldown_s: float = 5.0

    def validate(self) -> None:
        if self.max_retries < 0 or self.base_delay_s < 0 or self.max_delay_s < 0:
            raise SessionConfigError("max_retries, base_delay_s and max_delay_s must be >= 0")
        if not 0 <= self.jitter <= 1:
            raise SessionConfigError(f"jitter must be in [0, 1], got {self.jitter}")


@dataclass(frozen=True)
class SessionConfig:
    """How one session runs.

    `context_length` is the model's context; when None, the engine's `context_length` (or `max_context`) is used
    when it has one, and the context is otherwise unbounded. `max_turns` overrides the env's when set.
    `parser` names a `miles.tools` tool-call parser.
    """

    sampling: SamplingParams = field(default_factory=SamplingParams)
    context_length: int | None = None
    max_turns: int | None = None
    parser: str = "hermes"
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)

    def validate(self) -> None:
        if self.context_length is not None and self.context_length <= 0:
            raise SessionConfigError("context_length must be > 0")
        if self.max_turns is not None and self.max_turns <= 0:
            raise SessionConfigError("max_turns must be > 0")
        if self.sampling.max_new_tokens <= 0:
            raise SessionConfigError("sampling.max_new_tokens must be > 0")
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
            raise SessionConfigError(f"group_size {self.group_size} exceeds max_concurrent_sessions "
                              f"{self.max_concurrent_sessions} in 'unit' mode")
        if self.requests_per_s is not None and self.requests_per_s <= 0:
            raise SessionConfigError("requests_per_s must be > 0 or None")
        self.session.validate()
