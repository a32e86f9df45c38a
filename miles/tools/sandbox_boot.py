"""Bootstrap that runs inside the sandbox subprocess (`python -I sandbox_boot.py CONFIG`); code comes on stdin.

It sets the rlimits, switches to the configured unprivileged uid (privileged bwrap runs), installs an audit
hook (PEP 578) and runs the code as `__main__`.

Under bwrap (config `isolated`) the OS isolates files, network and processes, and the hook only refuses
starting processes unless allowed. Under the audit backend the hook is the whole policy; it refuses, with
PermissionError:
- opening a file for writing, creating, removing, renaming, linking, chmod/chown/utime/truncate
  outside the working directory (symlinks are resolved first; /dev/null stays writable);
- reading /proc/<pid>/... of other processes (their environment holds the secrets withheld here);
- starting processes (subprocess, os.system, os.exec*, os.spawn*, posix_spawn, fork) unless allowed;
- sockets connect/bind/send unless allowed; signalling other processes;
- ctypes symbol lookups other than the Python C API.

Alone, this guards against accidents and naive code, not against an adversary: C extensions, `dir_fd`
arguments, memory tricks through ctypes or already-open descriptors bypass audit hooks, and reads are not
refused. That is why the bwrap backend exists (see `miles.tools.sandbox`).
"""

from __future__ import annotations

import json
import linecache
import os
import re
import resource
import sys
import traceback
import types

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_PROC_PID = re.compile(r"^/proc/(\d+)(/|$)")
_PATH_EVENTS = {  # event -> indices of the path arguments that must stay inside the working directory
    "os.remove": (0,),
    "os.rmdir": (0,),
    "os.mkdir": (0,),
    "os.rename": (0, 1),
    "os.symlink": (1,),
    "os.link": (1,),
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.truncate": (0,),
    "os.utime": (0,),
    "os.chflags": (0,),
    "os.lchflags": (0,),
    "os.setxattr": (0,),
    "os.removexattr": (0,),
    "shutil.rmtree": (0,),
    "os.mkfifo": (0,),
    "os.mknod": (0,),
}
_PROCESS_EVENTS = {
    "subprocess.Popen",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.forkpty",
    "pty.spawn",
}
_NETWORK_EVENTS = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"}


def _set_limits(cfg: dict) -> None:
    cpu = cfg.get("cpu_s")
    limits = [
        (resource.RLIMIT_CPU, None if cpu is None else max(1, -(-cpu // 1))),
        (resource.RLIMIT_AS, cfg.get("memory_bytes")),
        (resource.RLIMIT_FSIZE, cfg.get("fsize_bytes")),
        (resource.RLIMIT_NPROC, cfg.get("nproc")),
    ]
    for which, value in limits:
        if value is not None:
            # CPU: SIGXCPU at the soft limit, SIGKILL one second later should it be caught.
            hard = int(value) + 1 if which == resource.RLIMIT_CPU else int(value)
            resource.setrlimit(which, (int(value), hard))


def _drop_privileges(uid: int) -> None:
    """Become `uid` (and gid `uid`, no supplementary groups) for good; capabilities go with uid 0."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _make_hook(root: str, allow_subprocess: bool, allow_network: bool, isolated: bool):
    me = os.getpid()
    realpath = os.path.realpath
    fsdecode = os.fsdecode

    def inside(path) -> bool:
        if isinstance(path, int):  # an already-open descriptor
            return True
        p = realpath(fsdecode(path))
        return p == root or p.startswith(root + os.sep) or p == os.devnull

    def deny(what: str) -> None:
        raise PermissionError(f"sandbox: {what} is not allowed")

    def hook(event: str, args: tuple) -> None:
        if event in _PROCESS_EVENTS:
            if not allow_subprocess:
                deny(f"starting processes ({event})")
        elif isolated:
            return
        elif event == "open":
            path, mode, flags = args
            if isinstance(path, int) or path is None:
                return
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & _WRITE_FLAGS
            )
            if writing and not inside(path):
                deny(f"writing {fsdecode(path)!r} outside the working directory")
            m = _PROC_PID.match(realpath(fsdecode(path)))
            if m and int(m.group(1)) != me:
                deny(f"reading {fsdecode(path)!r} of another process")
        elif event in _PATH_EVENTS:
            for i in _PATH_EVENTS[event]:
                if i < len(args) and args[i] is not None and not inside(args[i]):
                    deny(f"{event} on {fsdecode(args[i])!r} outside the working directory")
        elif event in _NETWORK_EVENTS:
            if not allow_network:
                deny(f"network access ({event})")
        elif event in ("os.kill", "os.killpg", "signal.pthread_kill"):
            if args and args[0] not in (me, 0):
                deny(f"signalling other processes ({event})")
        elif event in ("ctypes.dlsym", "ctypes.dlsym/handle"):
            name = args[1] if len(args) > 1 else ""
            if not (isinstance(name, str) and name.lstrip("_").startswith("Py")):
                deny(f"ctypes symbol lookup of {name!r}")

    return hook


def _print_user_traceback(exc: BaseException) -> None:
    """The traceback without this bootstrap's frames (its own and the audit hook's)."""
    report = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    pending = [report]
    while pending:
        te = pending.pop()
        te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename != __file__])
        pending.extend(x for x in (te.__cause__, te.__context__) if x is not None)
    sys.stderr.write("".join(report.format()))


def main() -> int:
    cfg = json.loads(sys.argv[1])
    code = sys.stdin.read()
    sys.stdin = open(os.devnull)  # noqa: SIM115 - lives as long as the process
    for stream in (sys.stdout, sys.stderr):  # line-buffered, so a killed run still shows what it printed
        stream.reconfigure(encoding="utf-8", errors="backslashreplace", line_buffering=True)
    root = os.path.realpath(cfg["workdir"])
    sys.path.insert(0, root)
    sys.dont_write_bytecode = True
    _set_limits(cfg)
    if cfg.get("uid") is not None:
        _drop_privileges(int(cfg["uid"]))
    filename = "<sandbox>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    try:
        compiled = compile(code, filename, "exec")
    except SyntaxError:
        traceback.print_exc(limit=0)
        return 1
    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = module
    sys.addaudithook(
        _make_hook(
            root, bool(cfg.get("allow_subprocess")), bool(cfg.get("allow_network")), bool(cfg.get("isolated"))
        )
    )
    try:
        exec(compiled, module.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        _print_user_traceback(exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
