"""Per-engine throughput measurement and context- and load-aware turn deadlines (see `TimeoutConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from miles.sessions.config import TimeoutConfig

_SCALE = (1.0, 1e-3, 1e-2)  # features: [1, prompt tokens / 1000, output tokens / 100]
_RIDGE = 1e-4


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting for the tiny (<= 3x3) systems of the fit."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        piv = m[c][c]
        for r in range(c + 1, n):
            f = m[r][c] / piv
            for k in range(c, n + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x


@dataclass(frozen=True)
class ThroughputEstimate:
    """Fitted costs of one engine: fixed seconds per call, seconds per uncached prompt token and per output
    token, and how many calls they rest on."""

    overhead_s: float
    prefill_s_per_token: float
    decode_s_per_token: float
    observations: int

    @property
    def prefill_tokens_per_s(self) -> float:
        return 1.0 / self.prefill_s_per_token if self.prefill_s_per_token > 0 else float("inf")

    @property
    def decode_tokens_per_s(self) -> float:
        return 1.0 / self.decode_s_per_token if self.decode_s_per_token > 0 else float("inf")


class ThroughputEstimator:
    """Exponentially weighted least squares of call latency on (1, uncached prompt tokens, output tokens).

    Each generate call contributes one observation; older ones decay by `ema_decay` per call. The prior
    throughputs act as a ridge penalty, so the fit is defined from the first call on, and coefficients are
    kept non-negative. The fit is recomputed lazily, when a deadline is asked for.
    """

    def __init__(self, timeouts: TimeoutConfig) -> None:
        self._cfg = timeouts
        prior = (
            timeouts.prior_overhead_s,
            1.0 / timeouts.prior_prefill_tokens_per_s,
            1.0 / timeouts.prior_decode_tokens_per_s,
        )
        self._prior = [v / s for v, s in zip(prior, _SCALE, strict=True)]
        self._xtx = [[0.0] * 3 for _ in range(3)]
        self._xty = [0.0] * 3
        self._theta = list(self._prior)
        self._stale = False
        self.observations = 0

    def observe(self, uncached_prompt_tokens: int, output_tokens: int, latency_s: float) -> None:
        """Add one measured call. Calls with a non-positive latency are ignored."""
        if latency_s <= 0:
            return
        x = (1.0, uncached_prompt_tokens * _SCALE[1], output_tokens * _SCALE[2])
        d = self._cfg.ema_decay
        for i in range(3):
            row = self._xtx[i]
            for j in range(3):
                row[j] = d * row[j] + x[i] * x[j]
            self._xty[i] = d * self._xty[i] + x[i] * latency_s
        self.observations += 1
        self._stale = True

    def _fit(self) -> list[float]:
        # Ridge towards the prior, with non-negativity by a small active set: a coefficient that comes out
        # negative is fixed at 0 and the others are refitted, so the fit still matches the data.
        free = [0, 1, 2]
        theta = [0.0, 0.0, 0.0]
        while free:
            a = [[self._xtx[i][j] + (_RIDGE if i == j else 0.0) for j in free] for i in free]
            b = [self._xty[i] + _RIDGE * self._prior[i] for i in free]
            sub = _solve(a, b)
            if min(sub) >= 0:
                for i, v in zip(free, sub, strict=True):
                    theta[i] = v
                break
            free.pop(sub.index(min(sub)))
        return theta

    def estimate(self) -> ThroughputEstimate:
        """The current fit, or the prior until `min_observations` calls were seen."""
        if self.observations < self._cfg.min_observations:
            theta = self._prior
        else:
            if self._stale:
                self._theta, self._stale = self._fit(), False
            theta = self._theta
        t = [v * s for v, s in zip(theta, _SCALE, strict=True)]
        return ThroughputEstimate(t[0], t[1], t[2], self.observations)

    def expected_s(self, uncached_prompt_tokens: int, max_new_tokens: int) -> float:
        """Expected latency of a call that decodes all `max_new_tokens` on an idle engine."""
        return self.deadline(uncached_prompt_tokens, max_new_tokens).expected_s

    def turn_deadline_s(self, uncached_prompt_tokens: int, max_new_tokens: int) -> float:
        """`slack * expected_s(...)`, clamped to the configured floor and cap (an idle engine)."""
        return self.deadline(uncached_prompt_tokens, max_new_tokens).seconds

    def deadline(
        self,
        uncached_prompt_tokens: int,
        max_new_tokens: int,
        *,
        prefill_wait_s: float = 0.0,
        requests_ahead: int = 0,
    ) -> TurnDeadline:
        """The deadline of a call sent now, behind `prefill_wait_s` of queued prefill and `requests_ahead`
        requests in flight at the engine."""
        return TurnDeadline(
            self._cfg,
            self.estimate(),
            uncached_prompt_tokens,
            max_new_tokens,
            prefill_wait_s=prefill_wait_s,
            requests_ahead=requests_ahead,
        )


class TurnDeadline:
    """The deadline of one call on one engine; it grows as requests arrive behind it (`add_arrivals`).

    The formula is documented on `TimeoutConfig`.
    """

    def __init__(
        self,
        cfg: TimeoutConfig,
        estimate: ThroughputEstimate,
        uncached_prompt_tokens: int,
        max_new_tokens: int,
        *,
        prefill_wait_s: float = 0.0,
        requests_ahead: int = 0,
    ) -> None:
        self._cfg = cfg
        self._estimate = estimate
        self._decode_s = max_new_tokens * estimate.decode_s_per_token
        self.expected_s = (
            estimate.overhead_s
            + max(0.0, prefill_wait_s)
            + max(0, uncached_prompt_tokens) * estimate.prefill_s_per_token
            + self._decode_s * (1.0 + cfg.batch_slowdown * max(0, requests_ahead))
        )

    def add_arrivals(self, uncached_prompt_tokens: int, count: int = 1) -> None:
        """`count` requests with `uncached_prompt_tokens` to prefill in all were sent to the engine behind
        this one."""
        self.expected_s += (
            max(0, uncached_prompt_tokens) * self._estimate.prefill_s_per_token
            + count * self._cfg.batch_slowdown * self._decode_s
        )

    @property
    def seconds(self) -> float:
        """`slack * expected_s`, clamped to `[turn_floor_s, turn_cap_s]`."""
        cfg = self._cfg
        return min(cfg.turn_cap_s, max(cfg.turn_floor_s, cfg.slack * self.expected_s))
