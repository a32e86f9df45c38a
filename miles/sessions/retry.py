"""Which failures are retried, and how long to wait before the next attempt."""

from __future__ import annotations

import random

import httpx

from miles.engine import EngineError
from miles.sessions.config import RetryConfig


def is_retryable(exc: BaseException) -> bool:
    """True for infrastructure failures: a retryable `EngineError`, a connection or transport error.

    Model errors (a non-retryable `EngineError`, e.g. a rejected prompt) and everything else are not.
    """
    if isinstance(exc, EngineError):
        return exc.retryable
    return isinstance(exc, httpx.TransportError | ConnectionError | BrokenPipeError)


def backoff_delay_s(attempt: int, cfg: RetryConfig, rng: random.Random | None = None) -> float:
    """Exponential backoff with jitter for retry number `attempt` (0 for the first retry)."""
    base = min(cfg.max_delay_s, cfg.base_delay_s * (2.0 ** max(0, attempt)))
    r = (rng or random).uniform(1.0 - cfg.jitter, 1.0 + cfg.jitter)
    return min(cfg.max_delay_s, base * r)
