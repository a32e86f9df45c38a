"""A thread pool of daemon threads for sync tools, and the one pool of the process (`tool_pool`).

`concurrent.futures.ThreadPoolExecutor` joins its workers at interpreter exit, so one tool that hangs
for ever would hang the whole process on exit. Here the workers are daemon threads, the pool grows when
every worker is busy (a hung tool never starves the others) up to `max_workers`, and idle workers exit.
Every `ToolBox` of a process shares `tool_pool()`: a pool per env (one per session) would start a thread
for each session's first tool call and keep it idle for `idle_timeout_s`, thousands at a time.
"""

from __future__ import annotations

import contextvars
import functools
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class DaemonThreadPool:
    """Runs callables on daemon threads; `submit` returns a `concurrent.futures.Future`."""

    def __init__(self, max_workers: int = 64, idle_timeout_s: float = 30.0, name: str = "miles-tool") -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self.idle_timeout_s = idle_timeout_s
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers = 0
        self._idle = 0  # workers waiting for a job minus jobs waiting for a worker

    @property
    def workers(self) -> int:
        """Number of live worker threads (busy, hung or idle)."""
        return self._workers

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        """Schedule `fn(*args, **kwargs)` with the caller's contextvars; never blocks."""
        future: Future[Any] = Future()
        ctx = contextvars.copy_context()
        with self._lock:
            self._queue.put((lambda: ctx.run(fn, *args, **kwargs), future))
            self._idle -= 1
            if self._idle < 0 and self._workers < self.max_workers:
                self._workers += 1
                self._idle += 1
                threading.Thread(target=self._work, name=f"{self._name}-{self._workers}", daemon=True).start()
        return future

    def _work(self) -> None:
        while True:
            try:
                job, future = self._queue.get(timeout=self.idle_timeout_s)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._idle -= 1
                        self._workers -= 1
                        return
                continue
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(job())
                except BaseException as exc:  # delivered to the awaiting caller
                    future.set_exception(exc)
            del job, future
            with self._lock:
                self._idle += 1


TOOL_POOL_MAX_WORKERS = 256


@functools.cache
def tool_pool() -> DaemonThreadPool:
    """The process's pool for sync tools (made on first use; a forked child makes its own)."""
    return DaemonThreadPool(max_workers=TOOL_POOL_MAX_WORKERS, name="miles-tool")


os.register_at_fork(after_in_child=tool_pool.cache_clear)  # the parent's workers do not exist in a child
