"""The model lock of an engine whose decode loop takes it once per step: anyone else waiting goes first.

A plain `threading.Lock` released and re-taken in a tight loop is not fair: on a busy machine a weight load
waiting for it can miss hundreds of decode steps. Here the loop gives way to every waiting holder, so a load
lands within one step.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class StepLock:
    """`step()` for the decode loop (one step per hold), `exclusive()` for everything else (which goes first)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(threading.Lock())
        self._waiting = 0

    @property
    def waiting(self) -> int:
        """How many `exclusive` holders are waiting now."""
        return self._waiting

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the model for a load or a flush: taken at the end of the decode step in progress, if any."""
        registered = False
        try:
            with self._cond:
                self._waiting += 1
                registered = True
            self._lock.acquire()
        finally:
            if registered:
                with self._cond:
                    self._waiting -= 1
                    self._cond.notify_all()
        try:
            yield
        finally:
            self._lock.release()

    @contextmanager
    def step(self) -> Iterator[None]:
        """Hold the model for one decode step, once no `exclusive` holder is waiting."""
        with self._cond:
            self._cond.wait_for(lambda: self._waiting == 0)
        with self._lock:
            yield
