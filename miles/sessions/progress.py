"""Live counters of a scheduler run, and their rich display (silent when stdout is not a terminal)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.live import Live
from rich.table import Table

from miles.sessions.records import SessionRecord
from miles.types import TerminationReason


@dataclass
class RunStats:
    """Counters of one scheduler run. `failed` counts sessions that ended in an error (env_error,
    engine_error, timeout); `aborted` those aborted by over-sampling or shutdown."""

    scheduled: int = 0
    running: int = 0
    finished: int = 0
    failed: int = 0
    aborted: int = 0
    recorded: int = 0
    record_failures: int = 0
    groups_done: int = 0
    generated_tokens: int = 0
    reward_sum: float = 0.0
    started: float = field(default_factory=time.monotonic)
    terminations: dict[str, int] = field(default_factory=dict)

    def add(self, rec: SessionRecord) -> None:
        """Count one ended session."""
        self.running -= 1
        t = rec.termination
        self.terminations[t.value] = self.terminations.get(t.value, 0) + 1
        if t == TerminationReason.ABORTED:
            self.aborted += 1
        elif t in (TerminationReason.ENV_ERROR, TerminationReason.ENGINE_ERROR, TerminationReason.TIMEOUT):
            self.failed += 1
        else:
            self.finished += 1
            self.reward_sum += rec.reward
        self.generated_tokens += rec.trajectory.num_generated

    @property
    def ended(self) -> int:
        return self.finished + self.failed + self.aborted

    @property
    def mean_reward(self) -> float:
        return self.reward_sum / self.finished if self.finished else 0.0

    @property
    def tokens_per_s(self) -> float:
        dt = time.monotonic() - self.started
        return self.generated_tokens / dt if dt > 0 else 0.0

    def table(self) -> Table:
        t = Table(title="sessions", show_header=True, header_style="bold")
        for col in ("running", "finished", "failed", "aborted", "groups", "tokens/s", "mean reward"):
            t.add_column(col, justify="right")
        t.add_row(
            str(self.running),
            str(self.finished),
            str(self.failed),
            str(self.aborted),
            str(self.groups_done),
            f"{self.tokens_per_s:,.0f}",
            f"{self.mean_reward:.3f}",
        )
        return t

    def __rich__(self) -> Table:
        return self.table()


class ProgressDisplay:
    """A rich `Live` view of `RunStats`. `enabled=None` shows it only when stdout is a terminal."""

    def __init__(
        self, stats: RunStats, *, enabled: bool | None = None, console: Console | None = None
    ) -> None:
        self.stats = stats
        self.enabled = sys.stdout.isatty() if enabled is None else enabled
        self._console = console
        self._live: Live | None = None

    def start(self) -> None:
        if self.enabled and self._live is None:
            self._live = Live(
                self.stats, console=self._console or Console(), refresh_per_second=4, transient=False
            )
            self._live.start()

    def stop(self) -> None:
        if self._live is not None:
            self._live.refresh()
            self._live.stop()
            self._live = None
