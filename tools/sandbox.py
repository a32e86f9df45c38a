"""Run untrusted Python in a subprocess: wall-clock timeout, rlimits, temp working dir, minimal env.

See `miles.tools.sandbox_boot` for what the in-process audit hook does and does not protect against.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

BOOTSTRAP = str(Path(__file__).with_name("sandbox_boot.py"))
_CHUNK = 65536


class SandboxError(ValueError):
    """Invalid sandbox arguments (e.g. a file name that escapes the working directory)."""


@dataclass
class SandboxResult:
    """What a sandboxed run produced. `returncode` is negative when a signal killed it (-9 on timeout,
    -24 for SIGXCPU when the CPU limit was hit)."""

    stdout: str
    stderr: str
    returncode: int
    timed_out: bool
    duration_s: float
    output_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


class _Capture(threading.Thread):
    """Drains one pipe, keeping the first `limit` bytes and counting the rest."""

    def __init__(self, stream, limit: int) -> None:
        super().__init__(daemon=True)
        self.stream, self.limit = stream, limit
        self.data = bytearray()
        self.total = 0

    def run(self) -> None:
        fd = self.stream.fileno()
        try:
            while chunk := os.read(fd, _CHUNK):
                self.total += len(chunk)
                room = self.limit - len(self.data)
                if room > 0:
                    self.data += chunk[:room]
        except OSError:
            pass

    def text(self) -> tuple[str, bool]:
        out = self.data.decode("utf-8", errors="replace")
        if self.total > self.limit:
            return f"{out}\n[output truncated: {self.total} bytes, limit {self.limit}]", True
        return out, False


def _minimal_env(workdir: str) -> dict[str, str]:
    # Nothing is inherited: API keys, tokens and proxies in the parent's environment stay there.
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _write_files(workdir: str, files: dict[str, str]) -> None:
    for name, content in files.items():
        rel = PurePosixPath(name)
        if not name or rel.is_absolute() or ".." in rel.parts:
            raise SandboxError(f"sandbox file name {name!r} must be a relative path inside the working directory")
        if not isinstance(content, str):
            raise SandboxError(f"sandbox file {name!r} content must be str, got {type(content).__name__}")
        target = Path(workdir, *rel.parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_python_sandboxed(code: str, *, timeout_s: float = 10.0, memory_mb: int = 512, cpu_s: float | None = None,
                         files: dict[str, str] | None = None, max_output_bytes: int = 65536,
                         max_file_mb: int = 64, allow_subprocess: bool = False, allow_network: bool = False,
                         max_processes: int | None = None) -> SandboxResult:
    """Run `code` with `python -I` in a fresh temporary working directory and return its output.

    Limits: wall clock `timeout_s` (the whole process group is killed), RLIMIT_CPU `cpu_s` (default
    ceil(timeout_s) + 1), RLIMIT_AS `memory_mb`, RLIMIT_FSIZE `max_file_mb`, RLIMIT_NPROC `max_processes`
    when given (it counts all processes of the user, and root ignores it). `files` are written into the
    working directory first (relative names); it is deleted afterwards. The environment is minimal.
    stdout and stderr keep their first `max_output_bytes` bytes each.
    """
    if not isinstance(code, str):
        raise SandboxError(f"code must be str, got {type(code).__name__}")
    if not timeout_s > 0:
        raise SandboxError(f"timeout_s must be positive, got {timeout_s!r}")
    if memory_mb < 32:
        raise SandboxError(f"memory_mb must be at least 32, got {memory_mb!r}")
    with tempfile.TemporaryDirectory(prefix="miles-sandbox-", ignore_cleanup_errors=True) as workdir:
        _write_files(workdir, files or {})
        config = {"workdir": workdir, "cpu_s": cpu_s if cpu_s is not None else math.ceil(timeout_s) + 1,
                  "memory_bytes": memory_mb * 1024 * 1024, "fsize_bytes": max_file_mb * 1024 * 1024,
                  "nproc": max_processes, "allow_subprocess": allow_subprocess, "allow_network": allow_network}
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-I", BOOTSTRAP, json.dumps(config)], cwd=workdir,
                                env=_minimal_env(workdir), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
        out, err = _Capture(proc.stdout, max_output_bytes), _Capture(proc.stderr, max_output_bytes)
        out.start()
        err.start()
        writer = threading.Thread(target=_feed, args=(proc.stdin, code), daemon=True)
        writer.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid)
            proc.wait()
        duration = time.perf_counter() - start
        _kill_group(proc.pid)  # leftovers in the group (only possible with allow_subprocess)
        for t in (out, err, writer):
            t.join(timeout=2.0)
        for stream in (proc.stdout, proc.stderr):
            stream.close()
        stdout, cut_out = out.text()
        stderr, cut_err = err.text()
        return SandboxResult(stdout=stdout, stderr=stderr, returncode=proc.returncode, timed_out=timed_out,
                             duration_s=duration, output_truncated=cut_out or cut_err)


def _feed(stdin, code: str) -> None:
    try:
        stdin.write(code.encode("utf-8"))
        stdin.close()
    except OSError:  # the process died before reading its program
        pass


async def arun_python_sandboxed(code: str, **kwargs) -> SandboxResult:
    """`run_python_sandboxed` on a worker thread, for async callers."""
    return await asyncio.to_thread(run_python_sandboxed, code, **kwargs)
