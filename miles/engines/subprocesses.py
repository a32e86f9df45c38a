"""Child processes that never outlive their parent: the engine servers and the router that `miles rollout`
starts. Each child leads its own process group (so stopping it also stops whatever it spawned) and, on Linux,
gets SIGTERM from the kernel if its parent dies without cleaning up."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections import deque
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """A `preexec_fn`: on Linux the child gets SIGTERM when the thread that started it exits (its parent died
    or ended, whichever way); elsewhere nothing."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(
    cmd: list[str], *, log_path: str | Path | None = None, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start `cmd` in a new session with stdout and stderr appended to `log_path` (discarded when None).

    The kernel's parent-death signal fires when the *thread* that called `spawn` exits, so call it from the
    thread that outlives the child (the main thread, or the event loop's).
    """
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(log_path, "ab")) if log_path else subprocess.DEVNULL  # noqa: SIM115
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )


def stop(proc: subprocess.Popen[bytes], *, timeout_s: float = 15.0) -> None:
    """SIGTERM the child's process group, SIGKILL it after `timeout_s`, and reap the child."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):  # grandchildren left in the group
            os.killpg(proc.pid, signal.SIGKILL)
        return


def log_tail(path: str | Path | None, lines: int = 20) -> str:
    """The last `lines` lines of a log file ('' when there is none)."""
    if path is None or not Path(path).is_file():
        return ""
    with open(path, encoding="utf-8", errors="replace") as f:
        return "".join(deque(f, maxlen=lines)).rstrip()
