"""The ready-made `run_python` tool, backed by `run_python_sandboxed`."""

from __future__ import annotations

from collections.abc import Callable

from miles.tools.sandbox import SandboxResult, run_python_sandboxed
from miles.tools.spec import tool


def format_sandbox_result(result: SandboxResult) -> str:
    """The text the model sees: stdout, then stderr and the exit status when they matter."""
    parts = [result.stdout.rstrip("\n")] if result.stdout else []
    if result.stderr:
        parts.append("[stderr]\n" + result.stderr.rstrip("\n"))
    if result.timed_out:
        parts.append(f"[timed out after {result.duration_s:.1f} s]")
    elif result.returncode != 0:
        parts.append(f"[exit code {result.returncode}]")
    return "\n".join(parts) if parts else "[no output]"


def make_run_python_tool(
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    files: dict[str, str] | None = None,
    max_output_chars: int = 4096,
    name: str = "run_python",
    backend: str | None = None,
) -> Callable[[str], str]:
    """A `run_python(code)` tool with the given limits; `files` are placed in every run's working directory.
    `backend` ("auto", "bwrap" or "audit"; None defers to $MILES_SANDBOX) is resolved at each call, see
    `miles.tools.sandbox_backend`."""
    description = (
        f"Run a Python 3 program in a sandbox and return what it printed (stdout, then stderr). "
        f"Each call is a fresh process in an empty temporary directory, limited to {timeout_s:g} s "
        f"and {memory_mb} MB, without network or subprocesses. Use print() to show results."
    )

    def run_python(code: str) -> str:
        """Run Python code in a sandbox.

        Args:
            code: The complete Python program to run.
        """
        return format_sandbox_result(
            run_python_sandboxed(code, timeout_s=timeout_s, memory_mb=memory_mb, files=files, backend=backend)
        )

    return tool(
        run_python,
        name=name,
        description=description,
        timeout_s=timeout_s + 5.0,
        max_output_chars=max_output_chars,
    )


run_python = make_run_python_tool()
