"""The sandboxed run_python: real subprocesses with timeouts, rlimits, a temp dir and a minimal env."""

import signal
import time
from pathlib import Path

import pytest

from miles.tools import (
    SandboxError,
    ToolBox,
    arun_python_sandboxed,
    get_spec,
    make_run_python_tool,
    run_python,
    run_python_sandboxed,
)
from miles.types import ToolCall


def test_runs_code_with_files_and_captures_output():
    res = run_python_sandboxed(
        "import sys, helper\nprint(helper.double(21))\nprint('oops', file=sys.stderr)\n"
        "open('out.txt', 'w').write('inside is fine')\nprint(open('out.txt').read())\nprint('é')",
        files={"helper.py": "def double(x):\n    return 2 * x\n", "data/in.txt": "x"})
    assert res.ok and res.returncode == 0 and not res.timed_out
    assert res.stdout == "42\ninside is fine\né\n" and res.stderr == "oops\n"


def test_error_exit_code_and_clean_traceback():
    res = run_python_sandboxed("def f():\n    raise ValueError('bad input')\nf()")
    assert res.returncode == 1 and not res.ok
    assert 'File "<sandbox>", line 2, in f' in res.stderr and "ValueError: bad input" in res.stderr
    assert "sandbox_boot" not in res.stderr
    assert run_python_sandboxed("import sys; sys.exit(3)").returncode == 3
    syntax = run_python_sandboxed("def (:")
    assert syntax.returncode == 1 and "SyntaxError" in syntax.stderr


def test_cannot_write_outside_working_directory(tmp_path):
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
    'mkdir': lambda: os.mkdir({str(tmp_path / 'newdir')!r}),
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
    res = run_python_sandboxed(code)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 11 and all(line.endswith("blocked True") for line in lines), res.stdout
    assert victim.read_text() == "original" and oct(victim.stat().st_mode)[-3:] != "777"
    assert not target.exists() and not (tmp_path / "newdir").exists()
    assert not (tmp_path.parent / "escape.txt").exists()


def test_no_subprocess_network_or_signals_by_default():
    code = """
import os, socket, subprocess
for name, fn in [('popen', lambda: subprocess.run(['true'])), ('system', lambda: os.system('true')),
                 ('connect', lambda: socket.create_connection(('127.0.0.1', 9), timeout=1)),
                 ('kill', lambda: os.kill(os.getppid(), 0))]:
    try:
        fn(); print(name, 'ALLOWED')
    except PermissionError:
        print(name, 'blocked')
"""
    res = run_python_sandboxed(code)
    assert res.stdout.split() == ["popen", "blocked", "system", "blocked", "connect", "blocked", "kill", "blocked"]


def test_secrets_are_not_visible(monkeypatch):
    monkeypatch.setenv("MILES_TEST_API_KEY", "sk-very-secret")
    code = """
import os
print(sorted(os.environ))
print(os.environ.get('HOME') == os.getcwd())
try:
    print(open(f'/proc/{os.getppid()}/environ', 'rb').read())
except PermissionError:
    print('parent environ blocked')
"""
    res = run_python_sandboxed(code)
    assert res.returncode == 0, res.stderr
    assert "sk-very-secret" not in res.stdout and "MILES_TEST_API_KEY" not in res.stdout
    assert "True\nparent environ blocked" in res.stdout


def test_wall_clock_timeout_kills_the_process_group():
    res = run_python_sandboxed(
        "import subprocess, time\np = subprocess.Popen(['sleep', '60'])\nprint(p.pid, flush=True)\n"
        "print('started')\ntime.sleep(60)", timeout_s=1.0, allow_subprocess=True)
    assert res.timed_out and res.returncode == -signal.SIGKILL and not res.ok
    child_pid = int(res.stdout.split()[0])
    assert "started" in res.stdout  # output printed before the kill is kept
    assert _dead_or_zombie(child_pid)  # the grandchild died with its group


def _dead_or_zombie(pid: int) -> bool:
    # After its parent was killed the orphan is re-parented; a zombie there is dead but not yet reaped.
    for _ in range(50):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def test_memory_limit():
    res = run_python_sandboxed("x = bytearray(1024 * 1024 * 1024)\nprint('allocated')", memory_mb=256)
    assert res.returncode == 1 and "MemoryError" in res.stderr and "allocated" not in res.stdout


def test_cpu_limit():
    res = run_python_sandboxed("while True:\n    pass", timeout_s=30, cpu_s=1)
    assert not res.timed_out and res.returncode == -signal.SIGXCPU


def test_file_size_limit():
    res = run_python_sandboxed("open('big.bin', 'wb').write(b'x' * (3 * 1024 * 1024))", max_file_mb=1)
    assert res.returncode != 0 and not res.timed_out


def test_output_cap():
    res = run_python_sandboxed("print('y' * 100000)", max_output_bytes=1000)
    assert res.output_truncated and res.stdout.startswith("y" * 1000)
    assert res.stdout.endswith("[output truncated: 100001 bytes, limit 1000]")


def test_bad_arguments_raise_named_error():
    for kwargs in ({"files": {"../x.py": ""}}, {"files": {"/etc/x": ""}}, {"timeout_s": 0}, {"memory_mb": 1}):
        with pytest.raises(SandboxError):
            run_python_sandboxed("print(1)", **kwargs)
    with pytest.raises(SandboxError):
        run_python_sandboxed(b"print(1)")


def test_working_directory_is_removed():
    res = run_python_sandboxed("import os; print(os.getcwd())")
    workdir = Path(res.stdout.strip())
    assert workdir.name.startswith("miles-sandbox-") and not workdir.exists()


async def test_run_python_tool_through_toolbox():
    spec = get_spec(run_python)
    assert spec.name == "run_python" and list(spec.parameters["properties"]) == ["code"]
    slow = make_run_python_tool(timeout_s=0.5, name="run_python_fast")
    box = ToolBox([run_python, slow])
    ok, failing, timeout = await box.execute([
        ToolCall("run_python", {"code": "print(6 * 7)"}, id="a"),
        ToolCall("run_python", {"code": "1/0"}, id="b"),
        ToolCall("run_python_fast", {"code": "import time; time.sleep(10)"}, id="c"),
    ])
    assert ok.content == "42" and ok.error is None
    assert "ZeroDivisionError" in failing.content and failing.content.endswith("[exit code 1]")
    assert "[timed out after" in timeout.content
    res = await arun_python_sandboxed("print('async')")
    assert res.stdout == "async\n"
    assert run_python("pass") == "[no output]"
