"""The bubblewrap (`bwrap`) command line that isolates one sandbox run.

Every mount but the bootstrap's sits at its host path, so tracebacks and `sys.path` read the same inside and
out. The new root is an empty tmpfs, read-only once set up, holding only:
- the Python runtime, read-only: the interpreter's prefixes (binary, stdlib, lib-dynload and this environment's
  site-packages), so a package that imports on the host imports in the sandbox, unless its code lives outside
  the prefix (an editable install such as miles itself);
- the system's executables and shared libraries, read-only: /usr/bin and /usr/lib* (/bin and /lib* as on the host);
- a minimal read-only /dev (null, zero, full, random, urandom, tty; device nodes stay usable, /dev/shm does not);
- the bootstrap script, read-only, at `BOOTSTRAP_MOUNT`;
- the run's working directory, read-write.
No /etc, /home, /root, /proc, /sys, /tmp, /var or repository (/proc would show the environment of the
namespace's init process and the host's kernel details).

On a non-root host bwrap runs unprivileged in a new user namespace (uid 65534, no capabilities, no nested user
namespaces where bwrap has `--disable-userns`). As root it runs privileged without one, keeping only
CAP_SETUID/CAP_SETGID, which the bootstrap spends at once to switch to a fresh unprivileged uid: the kernel
exempts root from RLIMIT_NPROC, and a uid of its own makes that limit count this run's processes only.
Where root may not mount (a container without CAP_SYS_ADMIN) but may create user namespaces, the second
choice is a user namespace; there the code's kernel uid stays 0, so RLIMIT_NPROC is not enforced.
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import signal
import site
import subprocess
import sys
from dataclasses import dataclass

BOOTSTRAP_MOUNT = "/run/miles/sandbox_boot.py"
"""Where the bootstrap script is mounted (read-only) inside the sandbox."""

USERNS_UID = 65534
"""The uid and gid sandboxed code has inside the user namespace (non-root hosts)."""

_FIRST_PRIVATE_UID = 1 << 30
_SYSTEM_PATHS = ("/bin", "/lib", "/lib32", "/lib64", "/usr/bin", "/usr/lib", "/usr/lib32", "/usr/lib64")
_NETWORK_FILES = ("/etc/resolv.conf", "/etc/hosts")


@dataclass(frozen=True)
class Bwrap:
    """A bwrap executable and how this process runs it."""

    path: str
    privileged: bool  # running as root: no user namespace, the bootstrap switches uid
    disable_userns: bool  # bwrap >= 0.8 can forbid nested user namespaces


@dataclass(frozen=True)
class Mount:
    """A read-only bind (`source` at `dest`) or, when `symlink`, a symlink `dest` -> `source`."""

    source: str
    dest: str
    symlink: bool = False


def bwrap_candidates() -> list[Bwrap]:
    """The ways to run the `bwrap` on PATH here, best first (none when it is missing). As root: privileged,
    then in a user namespace (for containers that deny root the mounts but allow user namespaces; there
    the code keeps kernel uid 0, which RLIMIT_NPROC exempts)."""
    path = shutil.which("bwrap")
    if path is None:
        return []
    try:
        usage = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        usage = ""
    disable_userns = "--disable-userns" in usage
    modes = [True, False] if os.geteuid() == 0 else [False]
    return [Bwrap(path=path, privileged=mode, disable_userns=disable_userns) for mode in modes]


@functools.cache
def runtime_mounts() -> tuple[Mount, ...]:
    """The read-only part of the sandbox: system executables and libraries, and the Python runtime."""
    candidates: list[Mount] = []
    for path in _SYSTEM_PATHS:
        if os.path.islink(path):
            candidates.append(Mount(os.readlink(path), path, symlink=True))
        elif os.path.isdir(path):
            candidates.append(Mount(path, path))
    runtime = {
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        os.path.dirname(sys.executable),
        *site.getsitepackages(),
    }
    for path in runtime:
        if os.path.isdir(path):
            real = os.path.realpath(path)
            candidates += [Mount(real, real), Mount(real, os.path.abspath(path))]
    mounts: list[Mount] = []
    for mount in sorted(set(candidates), key=lambda m: (m.dest, m.symlink)):
        if not any(_inside(mount.dest, m.dest) for m in mounts):
            mounts.append(mount)
    return tuple(mounts)


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _parents(paths: list[str]) -> list[str]:
    """Every ancestor directory of `paths` (not / and not the paths themselves), parents first."""
    found = {os.path.dirname(p.rstrip("/")) for p in paths}
    out: set[str] = set()
    for p in found:
        while p not in ("/", ""):
            out.add(p)
            p = os.path.dirname(p)
    return sorted(out - set(paths))


def private_uid(bwrap: Bwrap) -> int | None:
    """The uid a privileged run's code switches to (fresh per run), or None when a user namespace is used."""
    return _FIRST_PRIVATE_UID + random.randrange(1 << 24) if bwrap.privileged else None


def bwrap_argv(bwrap: Bwrap, workdir: str, bootstrap: str, *, allow_network: bool) -> list[str]:
    """The bwrap options (the command to run follows them) for a run in the existing directory `workdir`,
    with the file `bootstrap` at `BOOTSTRAP_MOUNT`."""
    argv = [
        bwrap.path,
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--hostname",
        "sandbox",
        "--die-with-parent",
        "--new-session",
    ]
    if bwrap.privileged:
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user", "--uid", str(USERNS_UID), "--gid", str(USERNS_UID)]
        if bwrap.disable_userns:
            argv.append("--disable-userns")
    mounts = list(runtime_mounts())
    if allow_network:
        mounts += [Mount(os.path.realpath(f), f) for f in _NETWORK_FILES if os.path.exists(f)]
    else:
        argv.append("--unshare-net")
    mounts.append(Mount(bootstrap, BOOTSTRAP_MOUNT))
    for parent in _parents([m.dest for m in mounts] + [workdir, "/dev"]):
        argv += ["--perms", "0755", "--dir", parent]
    for m in mounts:
        argv += ["--symlink", m.source, m.dest] if m.symlink else ["--ro-bind", m.source, m.dest]
    argv += [
        "--dev",
        "/dev",
        "--remount-ro",
        "/dev",
        "--bind",
        workdir,
        workdir,
        "--chdir",
        workdir,
        "--remount-ro",
        "/",
    ]
    return argv


def decode_returncode(returncode: int) -> int:
    """bwrap's exit status as `subprocess` would give it for the sandboxed process: bwrap reports death by
    signal N as 128 + N, which becomes -N (so `sys.exit(137)` inside reads as -9, as it would in a shell)."""
    if 128 < returncode < 128 + signal.NSIG:
        return 128 - returncode
    return returncode
