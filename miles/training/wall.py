"""A run's time: its `max_seconds` budget, and the wall past which its work is aborted (a stalled engine or env,
an endless step) or at which SIGINT / SIGTERM stop it."""

from __future__ import annotations

import asyncio
import enum
import math
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

#: Cancellations sent to a run's work past its wall (each unwinds one cleanup that waits on a stuck peer).
ABORT_ROUNDS = 5


@dataclass(frozen=True)
class Budget:
    """`max_seconds` (None: no limit) counted from `origin`, a `time.perf_counter()` (earlier than the process's
    start for a resumed run that had spent part of it)."""

    max_seconds: float | None
    origin: float

    @property
    def limit(self) -> float:
        return math.inf if self.max_seconds is None else self.max_seconds

    def spent(self) -> float:
        return time.perf_counter() - self.origin

    def left(self) -> float:
        """Seconds left (inf without a limit; negative once overspent)."""
        return self.limit - self.spent()

    def over(self) -> bool:
        return self.left() < 0


class Ending(enum.Enum):
    """How a run's work ended: it finished, a signal stopped it, or it overran its wall and was aborted."""

    FINISHED = "finished"
    STOPPED = "stopped"
    OVERRAN = "overran"


@dataclass(frozen=True)
class WallOutcome:
    """`ending`, the signal's name when `STOPPED`, and the error the aborted work raised while unwinding (or
    None)."""

    ending: Ending
    signal: str = ""
    error: BaseException | None = None


class _StopSignals:
    """SIGINT and SIGTERM handlers on the running loop (main thread only) that call `on_signal(name)`;
    `restore()` puts the previous handling back."""

    def __init__(self, on_signal: Callable[[str], None]) -> None:
        self.loop = asyncio.get_running_loop()
        self.installed: list[int] = []
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.loop.add_signal_handler(sig, on_signal, signal.Signals(sig).name)
            self.installed.append(sig)

    def restore(self) -> None:
        for sig in self.installed:
            self.loop.remove_signal_handler(sig)


async def within_the_wall(work: Awaitable[None], seconds: float) -> WallOutcome:
    """Run `work` until it ends (its error propagates), until SIGINT or SIGTERM, or for at most `seconds` (inf:
    no wall). Work that did not end is cancelled, up to `ABORT_ROUNDS` times, each cancel unwinding one
    `finally: await ...` that waits on a stuck peer."""
    task = asyncio.ensure_future(work)
    stop = asyncio.Event()
    caught: list[str] = []

    def on_signal(name: str) -> None:
        caught.append(name)
        stop.set()

    signals = _StopSignals(on_signal)
    try:
        waiter = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait(
            {task, waiter},
            return_when=asyncio.FIRST_COMPLETED,
            timeout=None if math.isinf(seconds) else max(seconds, 0.0),
        )
        waiter.cancel()
        if task in done:
            task.result()
            return WallOutcome(Ending.FINISHED)
        for _ in range(ABORT_ROUNDS):
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=1.0)
            if done:
                break
    finally:
        signals.restore()
    error = task.exception() if task.done() and not task.cancelled() else None
    if caught:
        return WallOutcome(Ending.STOPPED, signal=caught[0], error=error)
    return WallOutcome(Ending.OVERRAN, error=error)
