"""A run's output folder: one writer at a time, and a new run only where no run is recorded yet.

Two runs writing one folder would mix their records (session ids repeat, metric steps interleave), so a
`miles train` holds an exclusive lock on `<output_dir>/.miles.lock` while it runs (released by the OS when the
process ends, however it ends) and a new run refuses a folder that already holds one. On Ray the loop runs in
an actor, which takes that lock; the driver, which places the roles and writes `cluster.json` first, holds
`.miles-driver.lock` for the whole run, so a second Ray run into the folder stops before it starts anything.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from miles.config import ConfigError

RUN_RECORDS = ("metrics.jsonl", "sessions.jsonl", "eval_sessions.jsonl", "summary.json")
LOCK_NAME = ".miles.lock"
DRIVER_LOCK_NAME = ".miles-driver.lock"
logger = logging.getLogger(__name__)


def check_fresh_output_dir(out: Path) -> None:
    """`ConfigError` on `output_dir` if `out` already holds a run."""
    held = [name for name in RUN_RECORDS if (out / name).is_file() and (out / name).stat().st_size]
    held += ["checkpoints/"] if any((out / "checkpoints").glob("step_*")) else []
    if held:
        raise ConfigError(
            "output_dir",
            f"{str(out)!r} already holds a run ({', '.join(held)}); continue it with "
            "--resume, or give another --output-dir (or remove the folder)",
        )


def leftovers(out: Path) -> list[str]:
    """What a folder that holds no run still holds (say, the config.yaml and empty metrics.jsonl of a run that
    stopped at setup): the names a new run replaces, lock files aside."""
    if not out.is_dir():
        return []
    return sorted(
        p.name + ("/" if p.is_dir() else "")
        for p in out.iterdir()
        if p.name not in (LOCK_NAME, DRIVER_LOCK_NAME)
    )


class OutputDirLock:
    """The exclusive right to write `out` (created if missing); `ConfigError` on `output_dir` while another
    process holds it. `name` is the lock file (the Ray driver holds its own). `release()` gives it up."""

    def __init__(self, out: Path, name: str = LOCK_NAME) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / name
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "?"
            self.release()
            raise ConfigError(
                "output_dir",
                f"{str(out)!r} is being written by another run (pid {holder}); wait "
                "for it to end, or give another --output-dir",
            ) from None
        except OSError as exc:  # a file system without flock (some NFS or Lustre mounts): run unguarded
            logger.warning(
                "cannot lock %s (%s): a second run into this folder would not be detected", self.path, exc
            )
            return
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
