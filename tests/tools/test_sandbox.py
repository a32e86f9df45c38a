"""The sandboxed run_python: real subprocesses (and real bubblewrap) with timeouts, rlimits, a private dir.

Tests of the bwrap backend fail when bubblewrap does not work here and $CI is set, and skip otherwise.
"""

import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

import miles.tools.sandbox as sandbox_module
from miles.tools import (
    SandboxError,
    ToolBox,
    arun_python_sandboxed,
    bwrap_problem,
    get_spec,
    make_run_python_tool,
    run_python,
    run_python_sandboxed,
    sandbox_backend,
)
from miles.tools.sandbox_bwrap import runtime_mounts
from miles.types import ToolCall

REPO = Path(__file__).resolve().parents[2]


def require_bwrap() -> None:
    problem = bwrap_problem()
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the bwrap sandbox tests: {problem}")
        pytest.skip(problem)


@pytest.fixture(params=["bwrap", "audit"])
def backend(request) -> str:
    if request.param == "bwrap":
        require_bwrap()
    return request.param


@pytest.fixture
def bwrap() -> str:
    require_bwrap()
    return "bwrap"


def _survivors(marker: str, wait_s: float = 5.0) -> list[int]:
    """Live (not zombie) host processes whose command line holds `marker`, after waiting up to `wait_s`
    for them to go. The sandbox's command line holds its working directory, so that is the marker."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if marker.encode() in cmdline and state not in ("Z", "X"):
                alive.append(int(entry.name))
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


# ---- both backends ---------------------------------------------------------------------------------------


def test_runs_code_with_files_and_captures_output(backend):
    res = run_python_sandboxed(
        "import sys, helper\nprint(helper.double(21))\nprint('oops', file=sys.stderr)\n"
        "open('out.txt', 'w').write('inside is fine')\nprint(open('out.txt').read())\nprint('é')\n"
        "open('helper.py', 'a').write('# mine')",
        files={"helper.py": "def double(x):\n    return 2 * x\n", "data/in.txt": "x"},
        backend=backend,
    )
    assert res.ok and res.returncode == 0 and not res.timed_out and res.backend == backend, res.stderr
    assert res.stdout == "42\ninside is fine\né\n" and res.stderr == "oops\n"


def test_error_exit_code_and_clean_traceback(backend):
    res = run_python_sandboxed("def f():\n    raise ValueError('bad input')\nf()", backend=backend)
    assert res.returncode == 1 and not res.ok
    assert 'File "<sandbox>", line 2, in f' in res.stderr and "ValueError: bad input" in res.stderr
    assert "sandbox_boot" not in res.stderr
    assert run_python_sandboxed("import sys; sys.exit(3)", backend=backend).returncode == 3
    syntax = run_python_sandboxed("def (:", backend=backend)
    assert syntax.returncode == 1 and "SyntaxError" in syntax.stderr


def test_secrets_in_the_environment_are_not_visible(backend, monkeypatch):
    monkeypatch.setenv("MILES_TEST_API_KEY", "sk-very-secret")
    res = run_python_sandboxed(
        "import os\nprint(sorted(os.environ))\nprint(os.environ['HOME'] == os.getcwd())", backend=backend
    )
    assert res.returncode == 0, res.stderr
    assert "MILES_TEST_API_KEY" not in res.stdout and res.stdout.endswith("True\n")


def test_infinite_loop_is_killed_at_the_timeout_with_its_children(backend):
    code = (
        "import os, time\nprint(os.getcwd(), flush=True)\n"
        "if os.fork() == 0:\n    time.sleep(60)\n    os._exit(0)\nwhile True:\n    pass"
    )
    res = run_python_sandboxed(code, timeout_s=4.0, cpu_s=60, allow_subprocess=True, backend=backend)
    assert res.timed_out and res.returncode == -signal.SIGKILL and not res.ok
    workdir = res.stdout.split()[0]  # output printed before the kill is kept
    assert _survivors(workdir) == []  # the sleeping child died with the run


def test_memory_limit(backend):
    res = run_python_sandboxed(
        "x = bytearray(1024 * 1024 * 1024)\nprint('allocated')", memory_mb=256, backend=backend
    )
    assert res.returncode == 1 and "MemoryError" in res.stderr and "allocated" not in res.stdout


def test_cpu_limit(backend):
    res = run_python_sandboxed("while True:\n    pass", timeout_s=30, cpu_s=1, backend=backend)
    assert not res.timed_out and res.returncode == -signal.SIGXCPU


def test_file_size_limit(backend):
    res = run_python_sandboxed(
        "open('big.bin', 'wb').write(b'x' * (3 * 1024 * 1024))", max_file_mb=1, backend=backend
    )
    assert res.returncode == 1 and not res.timed_out and "File too large" in res.stderr


def test_huge_output_is_capped(backend):
    res = run_python_sandboxed("print('y' * 100000)", max_output_bytes=1000, backend=backend)
    assert res.output_truncated and res.stdout.startswith("y" * 1000)
    assert res.stdout.endswith("[output truncated: 100001 bytes, limit 1000]")
    endless = run_python_sandboxed(
        "import sys\nwhile True:\n    sys.stdout.write('z' * 65536)",
        timeout_s=4.0,
        max_output_bytes=5000,
        backend=backend,
    )
    assert endless.timed_out and endless.output_truncated
    assert endless.stdout.startswith("z" * 5000) and "z" * 5001 not in endless.stdout


def test_working_directory_is_removed(backend):
    res = run_python_sandboxed("import os; print(os.getcwd())", backend=backend)
    workdir = Path(res.stdout.strip())
    assert workdir.name.startswith("miles-sandbox-") and not workdir.exists()


def test_subprocesses_are_refused_unless_allowed(backend):
    code = (
        "import subprocess\ntry:\n    subprocess.run(['true'])\n    print('ran')\nexcept PermissionError:\n"
        "    print('blocked')"
    )
    assert run_python_sandboxed(code, backend=backend).stdout == "blocked\n"
    assert run_python_sandboxed(code, allow_subprocess=True, backend=backend).stdout == "ran\n"


# ---- the bwrap backend -----------------------------------------------------------------------------------


def test_bwrap_refuses_reads_outside_its_directory(bwrap):
    with tempfile.NamedTemporaryFile(
        "w", dir=Path.home(), prefix="miles-sandbox-test-", suffix=".txt"
    ) as secret:
        secret.write("home secret")
        secret.flush()
        targets = [
            "/etc/passwd",
            "/proc/1/environ",
            "/proc/self/environ",
            str(REPO / "README.md"),
            str(Path(__file__).resolve()),
            secret.name,
        ]
        code = (
            "import os\nprint(os.path.dirname(os.getcwd()), os.path.basename(os.getcwd()), "
            "*sorted(os.listdir(os.path.dirname(os.getcwd()))))\n"
            f"for path in {targets!r}:\n"
            "    try:\n        print(path, open(path).read()[:20])\n"
            "    except OSError as exc:\n        print(path, 'refused', type(exc).__name__)\n"
        )
        res = run_python_sandboxed(code, backend=bwrap)
        audit = run_python_sandboxed(code, backend="audit")
    assert res.returncode == 0 and res.backend == "bwrap", res.stderr
    lines = res.stdout.splitlines()
    parent, own, *seen = lines[0].split(" ")
    # Beside its own directory, the parent shows only where the read-only runtime is mounted (a virtualenv
    # under /tmp, say): other runs' directories, and whatever else is there on the host, are not visible.
    runtime = {
        m.dest[len(parent) + 1 :].split("/")[0] for m in runtime_mounts() if m.dest.startswith(parent + "/")
    }
    assert own in seen and set(seen) - {own} <= runtime, (seen, runtime)
    assert lines[1:] == [f"{path} refused FileNotFoundError" for path in targets]
    # The same reads under the audit backend succeed: the refusal above is bwrap's doing.
    assert f"{secret.name} home secret" in audit.stdout and "/etc/passwd refused" not in audit.stdout


def test_bwrap_refuses_writes_outside_and_keeps_inside_writes_private(bwrap, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    created = tmp_path / "created.txt"
    escape = f"escape-{uuid.uuid4().hex}"  # a fresh name: nothing by it exists anywhere yet
    code = f"""
import os
print(os.getcwd())
attempts = {{
    'append_host_file': lambda: open({str(victim)!r}, 'a'),
    'create_in_host_dir': lambda: open({str(created)!r}, 'w'),
    'remove_host_file': lambda: os.remove({str(victim)!r}),
    'parent_dir': lambda: open('../{escape}', 'w'),
    'tmp': lambda: open('/tmp/{escape}', 'w'),
    'runtime': lambda: open({sys.prefix + "/" + escape!r}, 'w'),
    'usr': lambda: os.mkdir('/usr/lib/{escape}'),
    'root': lambda: open('/{escape}', 'w'),
    'dev_shm': lambda: open('/dev/shm/{escape}', 'w'),
}}
os.symlink({str(victim)!r}, 'link.txt')
attempts['through_symlink'] = lambda: open('link.txt', 'w')
for name, fn in attempts.items():
    try:
        fn()
        print(name, 'ESCAPED')
    except OSError as exc:
        print(name, 'refused', 'sandbox:' in str(exc))
with open('inside.txt', 'w') as fh:
    fh.write('private')
print(open('inside.txt').read())
"""
    res = run_python_sandboxed(code, backend=bwrap)
    assert res.returncode == 0, res.stderr
    workdir, *lines, last = res.stdout.splitlines()
    # Refused by the kernel (no such path, read-only file system), not by the audit hook.
    assert len(lines) == 10 and all(line.endswith(" refused False") for line in lines), res.stdout
    assert last == "private"
    assert victim.read_text() == "original" and not created.exists()
    assert not Path(workdir).exists()
    for place in (
        Path(workdir).parent,
        Path("/tmp"),
        Path(sys.prefix),
        Path("/usr/lib"),
        Path("/"),
        Path("/dev/shm"),
    ):
        assert not (place / escape).exists()


def test_bwrap_has_no_network(bwrap):
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0.2)
        port = server.getsockname()[1]
        accepted = []

        def accept() -> None:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                accepted.append(conn.recv(16))
                conn.close()
                return

        code = (
            f"import socket\ntry:\n    s = socket.create_connection(('127.0.0.1', {port}), timeout=5)\n"
            "    s.sendall(b'hello host')\n    print('connected')\n"
            "except OSError as exc:\n    print('refused', type(exc).__name__)\n"
        )
        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        isolated = run_python_sandboxed(code, backend=bwrap)
        assert isolated.stdout.splitlines()[0] == "refused ConnectionRefusedError", isolated.stderr
        assert accepted == []
        # With the network namespace shared the same code reaches the server: the refusal was the namespace.
        shared = run_python_sandboxed(code, backend=bwrap, allow_network=True)
        thread.join(timeout=20)
        assert shared.stdout.splitlines()[0] == "connected" and accepted == [b"hello host"]


def test_bwrap_contains_a_fork_bomb(bwrap):
    # Bounded at 200 so that a broken limit fails the test instead of the machine.
    code = """
import os, time
print(os.getcwd(), flush=True)
forked = 0
try:
    for _ in range(200):
        if os.fork() == 0:
            os.setsid()  # leave the process group: only the pid namespace can still catch it
            time.sleep(60)
            os._exit(0)
        forked += 1
except BlockingIOError:
    print('fork refused after', forked, flush=True)
"""
    res = run_python_sandboxed(code, allow_subprocess=True, max_processes=16, timeout_s=30, backend=bwrap)
    assert res.returncode == 0 and not res.timed_out, res.stderr
    workdir, verdict = res.stdout.splitlines()
    assert verdict.startswith("fork refused after ") and int(verdict.split()[-1]) < 16
    assert _survivors(workdir) == []  # the sleeping children, outside the group, died with the run


def test_bwrap_fork_limit_defaults_on(bwrap):
    res = run_python_sandboxed(
        "import resource; print(resource.getrlimit(resource.RLIMIT_NPROC)[0])", backend=bwrap
    )
    assert res.stdout == "64\n"


# ---- choosing the backend --------------------------------------------------------------------------------


def test_backend_choice_and_errors(monkeypatch):
    monkeypatch.setenv("MILES_SANDBOX", "audit")
    assert sandbox_backend() == "audit" and run_python_sandboxed("print(1)").backend == "audit"
    assert run_python_sandboxed("print(open('/etc/passwd').read() != '')").stdout == "True\n"  # audit reads
    monkeypatch.setenv("MILES_SANDBOX", "docker")
    with pytest.raises(
        SandboxError, match="MILES_SANDBOX='docker' is not a sandbox backend; use one of auto"
    ):
        run_python_sandboxed("print(1)")
    with pytest.raises(SandboxError, match="backend='nope'"):
        sandbox_backend("nope")


def test_bwrap_is_the_default_where_it_works(monkeypatch):
    require_bwrap()
    monkeypatch.delenv("MILES_SANDBOX", raising=False)
    assert sandbox_backend() == "bwrap" and sandbox_backend("auto") == "bwrap"
    assert run_python_sandboxed("print(1)").backend == "bwrap"


def test_falls_back_to_audit_with_one_warning_where_bwrap_is_missing(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(sandbox_module, "_PROBE", sandbox_module._BwrapProbe())  # this process, probed afresh
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH without bwrap
    monkeypatch.setenv("MILES_SANDBOX", "auto")
    with caplog.at_level(logging.WARNING, logger="miles.tools.sandbox"):
        results = [run_python_sandboxed("print(6 * 7)") for _ in range(2)]
    assert bwrap_problem() == "bubblewrap (bwrap) is not on PATH"
    assert [r.backend for r in results] == ["audit", "audit"] and results[1].stdout == "42\n"
    assert len(caplog.records) == 1 and "audit-hook sandbox" in caplog.records[0].getMessage()
    with pytest.raises(SandboxError) as failed:
        run_python_sandboxed("print(1)", backend="bwrap")
    assert str(failed.value).startswith(
        "the bwrap sandbox was asked for but bubblewrap (bwrap) is not on PATH; "
        "install bubblewrap (Debian/Ubuntu: apt-get install -y bubblewrap)"
    )


# ---- the audit backend (the fallback) --------------------------------------------------------------------


def test_audit_cannot_write_outside_working_directory(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    target = tmp_path / "created.txt"
    code = f"""
import os, shutil
attempts = {{
    'open_w': lambda: open({str(target)!r}, 'w'),
    'open_a': lambda: open({str(victim)!r}, 'a'),
    'os_open': lambda: os.open({str(target)!r}, os.O_CREAT | os.O_WRONLY),
    'parent': lambda: open('../escape.txt', 'w'),
    'remove': lambda: os.remove({str(victim)!r}),
    'rename': lambda: os.rename({str(victim)!r}, 'stolen.txt'),
    'mkdir': lambda: os.mkdir({str(tmp_path / "newdir")!r}),
    'chmod': lambda: os.chmod({str(victim)!r}, 0o777),
    'rmtree': lambda: shutil.rmtree({str(tmp_path)!r}),
    'copy': lambda: shutil.copy('mine.txt', {str(target)!r}),
}}
open('mine.txt', 'w').write('x')
os.symlink({str(victim)!r}, 'link.txt')
attempts['symlink_write'] = lambda: open('link.txt', 'w')
for name, fn in attempts.items():
    try:
        fn()
        print(name, 'ESCAPED')
    except PermissionError as exc:
        print(name, 'blocked', 'sandbox:' in str(exc))
"""
    res = run_python_sandboxed(code, backend="audit")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 11 and all(line.endswith("blocked True") for line in lines), res.stdout
    assert victim.read_text() == "original" and oct(victim.stat().st_mode)[-3:] != "777"
    assert not target.exists() and not (tmp_path / "newdir").exists()
    assert not (tmp_path.parent / "escape.txt").exists()


def test_audit_blocks_network_signals_and_other_processes_environ():
    code = """
import os, socket
for name, fn in [('connect', lambda: socket.create_connection(('127.0.0.1', 9), timeout=1)),
                 ('kill', lambda: os.kill(os.getppid(), 0)),
                 ('environ', lambda: open(f'/proc/{os.getppid()}/environ', 'rb').read())]:
    try:
        fn(); print(name, 'ALLOWED')
    except PermissionError:
        print(name, 'blocked')
"""
    res = run_python_sandboxed(code, backend="audit")
    assert res.stdout.split() == ["connect", "blocked", "kill", "blocked", "environ", "blocked"]


def test_bad_arguments_raise_named_error():
    for kwargs in ({"files": {"../x.py": ""}}, {"files": {"/etc/x": ""}}, {"timeout_s": 0}, {"memory_mb": 1}):
        with pytest.raises(SandboxError):
            run_python_sandboxed("print(1)", **kwargs)
    with pytest.raises(SandboxError):
        run_python_sandboxed(b"print(1)")


# ---- the run_python tool ---------------------------------------------------------------------------------


async def test_run_python_tool_through_toolbox():
    spec = get_spec(run_python)
    assert spec.name == "run_python" and list(spec.parameters["properties"]) == ["code"]
    slow = make_run_python_tool(timeout_s=0.5, name="run_python_fast")
    audit = make_run_python_tool(name="run_python_audit", backend="audit")
    box = ToolBox([run_python, slow, audit])
    ok, failing, timeout, hooked = await box.execute(
        [
            ToolCall("run_python", {"code": "print(6 * 7)"}, id="a"),
            ToolCall("run_python", {"code": "1/0"}, id="b"),
            ToolCall("run_python_fast", {"code": "import time; time.sleep(10)"}, id="c"),
            ToolCall("run_python_audit", {"code": "import os; os.system('true')"}, id="d"),
        ]
    )
    assert ok.content == "42" and ok.error is None
    assert "ZeroDivisionError" in failing.content and failing.content.endswith("[exit code 1]")
    assert "[timed out after" in timeout.content
    assert "sandbox: starting processes (os.system) is not allowed" in hooked.content
    res = await arun_python_sandboxed("print('async')")
    assert res.stdout == "async\n"
    assert run_python("pass") == "[no output]"
