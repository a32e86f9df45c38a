"""Run untrusted Python in a subprocess: wall-clock timeout, rlimits, a private working dir, minimal env.

Two backends. `backend=` picks one per call; otherwise the MILES_SANDBOX environment variable does
(`auto`, the default, `bwrap` or `audit`). `auto` uses bwrap when bubblewrap is installed and starts a
sandbox here (probed once per process) and otherwise falls back to audit, logging a warning once per process.
`bwrap` makes an unusable bubblewrap an error. `sandbox_backend()` says which backend a run gets, and every
`SandboxResult` records the backend it ran under.

Threat model
------------
Both backends run the code with `python -I` in a fresh per-call directory (deleted afterwards) as its cwd,
HOME and TMPDIR. The environment is minimal, so the caller's API keys and tokens are not inherited. They
enforce RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE and RLIMIT_NPROC, and a wall-clock timeout that kills the whole
process group. Output is capped.

bwrap (OS-level isolation, meant for hostile code; mounts and privileges are in `miles.tools.sandbox_bwrap`).
The code runs in new mount, pid, network, IPC, UTS and cgroup namespaces, plus a user namespace unless the
host is root.
- Files: it sees only the read-only Python runtime and system libraries/executables, a minimal /dev and its
  working directory; no /proc. Reads of /etc/passwd, $HOME, the repository or /proc/<pid>/environ fail
  because those paths do not exist there. Writes outside the working directory fail (read-only file system).
  What it writes inside is deleted when the run ends.
- Network: its network namespace holds only its own loopback. Nothing on the host is reachable, not even
  127.0.0.1 (unless `allow_network`).
- Processes: it sees only its own. When the run ends or times out, every process in its pid namespace is
  killed, including those that left the process group. Its uid is unprivileged and has no capabilities.
  RLIMIT_NPROC (default 64) counts this run's processes only, so a fork bomb stops there. The exception is
  a root host that only allows bwrap in a user namespace: there the kernel exempts the code from it.
Not covered: kernel exploits (the host kernel is shared and no seccomp filter narrows the system calls).
Also not covered: CPU, cache and timing side channels; reading the runtime and /usr (public files on a
normal system); disk use in the working directory beyond RLIMIT_FSIZE per file until the timeout; memory
beyond RLIMIT_AS per process. On root hosts the code may create user namespaces of its own. bwrap reports
death by signal N as exit status 128 + N, so `returncode` reads exit statuses 129-192 as signals.

audit (the fallback, for accidents and naive code): a PEP 578 audit hook refuses writes outside the working
directory, /proc/<pid> of other processes, process creation, sockets, signals and ctypes lookups (see
`miles.tools.sandbox_boot`). It does not stop reads (`open('/etc/passwd').read()` works), nor C extensions
or descriptor tricks that bypass audit hooks. As root, RLIMIT_NPROC is not enforced (the kernel exempts
root).
"""

from __future__ import annotations

import asyncio
import json
import logging
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
from typing import Literal

from miles.tools.sandbox_bwrap import (
    BOOTSTRAP_MOUNT,
    Bwrap,
    bwrap_argv,
    bwrap_candidates,
    decode_returncode,
    private_uid,
)

log = logging.getLogger(__name__)

BOOTSTRAP = str(Path(__file__).with_name("sandbox_boot.py"))
_CHUNK = 65536
SANDBOX_ENV_VAR = "MILES_SANDBOX"
BACKENDS = ("auto", "bwrap", "audit")
BWRAP_DEFAULT_MAX_PROCESSES = 64
_INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install -y bubblewrap)"

Backend = Literal["bwrap", "audit"]


class SandboxError(ValueError):
    """Invalid sandbox arguments (e.g. a file name that escapes the working directory), or a backend that
    was asked for and cannot run here."""


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run produced. `returncode` is negative when a signal killed it (-9 on timeout,
    -24 for SIGXCPU when the CPU limit was hit). `backend` is the one it ran under ("bwrap" or "audit")."""

    stdout: str
    stderr: str
    returncode: int
    timed_out: bool
    duration_s: float
    backend: Backend
    output_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


class _BwrapProbe:
    """Whether bwrap works here, found out on first use (one short sandboxed run) and then remembered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False
        self.bwrap: Bwrap | None = None
        self.problem: str | None = None
        self._warned = False

    def get(self) -> tuple[Bwrap | None, str | None]:
        with self._lock:
            if not self._done:
                self.bwrap, self.problem = _probe_bwrap()
                self._done = True
            return self.bwrap, self.problem

    def warn_once(self) -> None:
        """Log, the first time only, that runs fall back to the audit backend."""
        with self._lock:
            if self._warned:
                return
            self._warned = True
        log.warning(
            "sandbox: %s, so run_python code runs under the audit-hook sandbox, which does not stop "
            "reads, network or processes at the OS level; %s, or set %s=audit to accept this",
            self.problem,
            _INSTALL_HINT,
            SANDBOX_ENV_VAR,
        )


def _probe_bwrap() -> tuple[Bwrap | None, str | None]:
    candidates = bwrap_candidates()
    if not candidates:
        return None, "bubblewrap (bwrap) is not on PATH"
    failures = []
    for bwrap in candidates:
        failure = _try_bwrap(bwrap)
        if failure is None:
            return bwrap, None
        failures.append(failure)
    return None, f"{candidates[0].path} cannot create a sandbox here ({'; '.join(failures)})"


def _try_bwrap(bwrap: Bwrap) -> str | None:
    """None when a short run under `bwrap` works, else what went wrong."""
    mode = "privileged" if bwrap.privileged else "in a user namespace"
    try:
        res = _run(
            "print('ok')",
            bwrap=bwrap,
            timeout_s=30.0,
            memory_mb=512,
            cpu_s=None,
            files={},
            max_output_bytes=4096,
            max_file_mb=1,
            allow_subprocess=False,
            allow_network=False,
            max_processes=None,
        )
    except OSError as exc:
        return f"{mode}: {exc}"
    if res.ok and res.stdout == "ok\n":
        return None
    return f"{mode}: " + (res.stderr.strip().splitlines() or [f"exit status {res.returncode}"])[-1]


_PROBE = _BwrapProbe()


def bwrap_problem() -> str | None:
    """None when bubblewrap works on this machine, else one line saying why not (probed once per process)."""
    return _PROBE.get()[1]


def sandbox_backend(requested: str | None = None) -> Backend:
    """The backend a run gets: `requested`, else $MILES_SANDBOX, else "auto" (bwrap when it works here,
    otherwise audit with a warning logged once per process). Raises SandboxError for an unknown name, or for
    "bwrap" when bubblewrap cannot run here."""
    choice = requested if requested is not None else os.environ.get(SANDBOX_ENV_VAR, "auto").strip() or "auto"
    if choice not in BACKENDS:
        where = "backend" if requested is not None else SANDBOX_ENV_VAR
        raise SandboxError(f"{where}={choice!r} is not a sandbox backend; use one of {', '.join(BACKENDS)}")
    if choice == "audit":
        return "audit"
    problem = bwrap_problem()
    if problem is None:
        return "bwrap"
    if choice == "bwrap":
        raise SandboxError(
            f"the bwrap sandbox was asked for but {problem}; {_INSTALL_HINT}, "
            f"or set {SANDBOX_ENV_VAR}=auto to fall back to the audit-hook sandbox"
        )
    _PROBE.warn_once()
    return "audit"


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
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _write_files(workdir: str, files: dict[str, str]) -> None:
    for name, content in files.items():
        rel = PurePosixPath(name)
        if not name or rel.is_absolute() or ".." in rel.parts:
            raise SandboxError(
                f"sandbox file name {name!r} must be a relative path inside the working directory"
            )
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


def _hand_over(workdir: str, uid: int) -> None:
    """Give the working directory to `uid`; group 0 keeps bwrap (root without capabilities) able to enter it."""
    for path in Path(workdir).rglob("*"):
        os.lchown(path, uid, uid)
    os.chown(workdir, uid, 0)
    os.chmod(workdir, 0o770)


def run_python_sandboxed(
    code: str,
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    cpu_s: float | None = None,
    files: dict[str, str] | None = None,
    max_output_bytes: int = 65536,
    max_file_mb: int = 64,
    allow_subprocess: bool = False,
    allow_network: bool = False,
    max_processes: int | None = None,
    backend: str | None = None,
) -> SandboxResult:
    """Run `code` with `python -I` in a fresh temporary working directory and return its output.

    Limits: wall clock `timeout_s` (the whole process group is killed; under bwrap, the whole pid
    namespace), RLIMIT_CPU `cpu_s` (default ceil(timeout_s) + 1), RLIMIT_AS `memory_mb`, RLIMIT_FSIZE
    `max_file_mb`, RLIMIT_NPROC `max_processes`. Under bwrap that counts this run's processes and threads
    only and defaults to 64. Under audit it counts every process of the user, root is exempt, and the
    default is no limit. `files` are written into the working directory first (relative names); it is
    deleted afterwards. The environment is minimal. stdout and stderr keep their first `max_output_bytes`
    bytes each. `backend` is "auto", "bwrap" or "audit"; None defers to `sandbox_backend()`.
    """
    if not isinstance(code, str):
        raise SandboxError(f"code must be str, got {type(code).__name__}")
    if not timeout_s > 0:
        raise SandboxError(f"timeout_s must be positive, got {timeout_s!r}")
    if memory_mb < 32:
        raise SandboxError(f"memory_mb must be at least 32, got {memory_mb!r}")
    bwrap = _PROBE.get()[0] if sandbox_backend(backend) == "bwrap" else None
    return _run(
        code,
        bwrap=bwrap,
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        cpu_s=cpu_s,
        files=files or {},
        max_output_bytes=max_output_bytes,
        max_file_mb=max_file_mb,
        allow_subprocess=allow_subprocess,
        allow_network=allow_network,
        max_processes=max_processes,
    )


def _run(
    code: str,
    *,
    bwrap: Bwrap | None,
    timeout_s: float,
    memory_mb: int,
    cpu_s: float | None,
    files: dict[str, str],
    max_output_bytes: int,
    max_file_mb: int,
    allow_subprocess: bool,
    allow_network: bool,
    max_processes: int | None,
) -> SandboxResult:
    with tempfile.TemporaryDirectory(prefix="miles-sandbox-", ignore_cleanup_errors=True) as tmp:
        workdir = os.path.realpath(tmp)
        _write_files(workdir, files)
        command = [sys.executable, "-I", BOOTSTRAP]
        uid = None
        if bwrap is not None:
            uid = private_uid(bwrap)
            if uid is not None:
                _hand_over(workdir, uid)
            if max_processes is None:
                max_processes = BWRAP_DEFAULT_MAX_PROCESSES
            command = bwrap_argv(bwrap, workdir, BOOTSTRAP, allow_network=allow_network) + [
                sys.executable,
                "-I",
                BOOTSTRAP_MOUNT,
            ]
        config = {
            "workdir": workdir,
            "cpu_s": cpu_s if cpu_s is not None else math.ceil(timeout_s) + 1,
            "memory_bytes": memory_mb * 1024 * 1024,
            "fsize_bytes": max_file_mb * 1024 * 1024,
            "nproc": max_processes,
            "allow_subprocess": allow_subprocess,
            "allow_network": allow_network,
            "isolated": bwrap is not None,
            "uid": uid,
        }
        start = time.perf_counter()
        proc = subprocess.Popen(
            [*command, json.dumps(config)],
            cwd=workdir,
            env=_minimal_env(workdir),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
        )
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
        returncode = proc.returncode if bwrap is None or timed_out else decode_returncode(proc.returncode)
        return SandboxResult(
            stdout=stdout,
            stderr=stderr,
            returncode=returncode,
            timed_out=timed_out,
            duration_s=duration,
            backend="audit" if bwrap is None else "bwrap",
            output_truncated=cut_out or cut_err,
        )


def _feed(stdin, code: str) -> None:
    try:
        stdin.write(code.encode("utf-8"))
        stdin.close()
    except OSError:  # the process died before reading its program
        pass


async def arun_python_sandboxed(code: str, **kwargs) -> SandboxResult:
    """`run_python_sandboxed` on a worker thread, for async callers."""
    return await asyncio.to_thread(run_python_sandboxed, code, **kwargs)
