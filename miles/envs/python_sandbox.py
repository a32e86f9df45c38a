"""`PythonSandbox-v0`: write a function; hidden tests run in the sandbox decide the reward.

The model may try code with the `run_python` tool, then answers with a final ```python code block. The
final code runs in `miles.tools.run_python_sandboxed` under a harness that evaluates each hidden test call
and prints the results as JSON behind a per-run random marker; the env compares them with the expected
values itself, so a solution that prints fake results or returns an object overriding `==` passes
nothing. (The sandbox limits damage; it is not a defence against code built to subvert the harness.)
Which sandbox backend judged an episode is recorded in `info["sandbox_backend"]`.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.envs.base import OraclePolicy
from miles.envs.hooks import reward
from miles.envs.tasks import TaskSource
from miles.envs.tool_env import ToolEnv
from miles.tools import arun_python_sandboxed, make_run_python_tool
from miles.tools import sandbox_backend as resolve_sandbox_backend
from miles.types import Message, ToolCall

TASKS_FILE = Path(__file__).parent / "data" / "python_tasks.jsonl"
_CODE_RE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)

_HARNESS = """
import json as _json
_dumps = _json.dumps
_MARK = {mark!r}
_CALLS = {calls!r}
_results = []
try:
    _ns = {{"__name__": "solution"}}
    with open("solution.py", encoding="utf-8") as _fh:
        exec(compile(_fh.read(), "solution.py", "exec"), _ns)
    _load_error = None
except BaseException as _exc:
    _load_error = type(_exc).__name__ + ": " + str(_exc)
for _call in _CALLS:
    if _load_error is not None:
        _results.append(_dumps({{"ok": False, "error": _load_error}}))
        continue
    try:
        _value = eval(_call, dict(_ns))
        _results.append(_dumps({{"ok": True, "value": _value}}))
    except BaseException as _exc:
        _results.append(_dumps({{"ok": False, "error": type(_exc).__name__ + ": " + str(_exc)[:200]}}))
print("\\n" + _MARK + "[" + ",".join(_results) + "]", flush=True)
"""


def extract_code(final: str) -> str | None:
    """The last fenced code block of the final message (``` or ```python), or None."""
    blocks = _CODE_RE.findall(final)
    return blocks[-1] if blocks else None


@dataclass(frozen=True)
class HiddenTestResults:
    """Per-test outcomes of one solution, and the sandbox backend ("bwrap" or "audit") that ran them."""

    passed: tuple[bool, ...]
    backend: str


async def run_hidden_tests(
    code: str, tests: list[dict[str, Any]], *, timeout_s: float = 10.0, backend: str | None = None
) -> HiddenTestResults:
    """Whether each hidden test `{"call", "expected"}` passes for `code`, run in the sandbox (`backend` as
    in `miles.tools.run_python_sandboxed`)."""
    mark = f"@@miles-results-{secrets.token_hex(16)}@@"
    harness = _HARNESS.format(mark=mark, calls=[t["call"] for t in tests])
    result = await arun_python_sandboxed(
        harness, timeout_s=timeout_s, files={"solution.py": code}, backend=backend
    )
    return HiddenTestResults(passed=tuple(_judge(result.stdout, mark, tests)), backend=result.backend)


def _judge(stdout: str, mark: str, tests: list[dict[str, Any]]) -> list[bool]:
    lines = [ln for ln in stdout.splitlines() if ln.startswith(mark)]
    if len(lines) != 1:
        return [False] * len(tests)
    try:
        outcomes = json.loads(lines[0][len(mark) :])
    except json.JSONDecodeError:
        return [False] * len(tests)
    if not isinstance(outcomes, list) or len(outcomes) != len(tests):
        return [False] * len(tests)
    # JSON round-trips the expected value too, so tuples and lists compare alike.
    return [
        isinstance(o, dict)
        and o.get("ok") is True
        and "value" in o
        and o["value"] == json.loads(json.dumps(t["expected"]))
        and type(o["value"]) is type(json.loads(json.dumps(t["expected"])))
        for o, t in zip(outcomes, tests, strict=True)
    ]


class PythonSandboxOracle(OraclePolicy):
    """Tries the reference solution once with run_python, then submits it."""

    def act(self, messages: list[Message]) -> Message:
        data = self.task.data
        if not any(m.role == "tool" for m in messages):
            probe = data["solution"] + f"\nprint({data['tests'][0]['call']})\n"
            return Message(
                role="assistant",
                content="Let me try it first.",
                tool_calls=[ToolCall(name="run_python", arguments={"code": probe}, id="call_0")],
            )
        return Message(role="assistant", content=f"```python\n{data['solution']}```")


class PythonSandboxEnv(ToolEnv):
    """Coding tasks checked by hidden tests.

    Args:
        split: "all", "train" or "held_out".
        held_out_fraction: share of tasks held out.
        test_timeout_s: wall-clock limit for running the hidden tests.
        sandbox_backend: "auto", "bwrap" or "audit" for both `run_python` and the hidden tests; None
            defers to $MILES_SANDBOX (see `miles.tools.sandbox_backend`).
    """

    max_turns = 6
    success_component = "all_passed"

    held_out_fraction = 0.2
    split_salt = "python"

    def __init__(
        self, *, test_timeout_s: float = 10.0, sandbox_backend: str | None = None, **kwargs: Any
    ) -> None:
        self.test_timeout_s = test_timeout_s
        if sandbox_backend is not None:
            resolve_sandbox_backend(
                sandbox_backend
            )  # a misspelt or unusable backend fails here, not mid-episode
        self.sandbox_backend = sandbox_backend
        super().__init__(tools=[make_run_python_tool(timeout_s=5.0, backend=sandbox_backend)], **kwargs)

    def default_tasks(self) -> TaskSource:
        return TaskSource.from_jsonl(TASKS_FILE)

    def oracle(self) -> PythonSandboxOracle:
        return PythonSandboxOracle().bind(self)

    async def _hidden(
        self, final: str, task_data: dict[str, Any], state: dict[str, Any]
    ) -> HiddenTestResults | None:
        """The hidden tests' results, or None when the final message has no code block to run."""
        if "hidden_results" not in state:
            code = extract_code(final)
            state["hidden_results"] = (
                None
                if code is None
                else await run_hidden_tests(
                    code, task_data["tests"], timeout_s=self.test_timeout_s, backend=self.sandbox_backend
                )
            )
        return state["hidden_results"]

    @reward(weight=1.0)
    async def passed_fraction(
        self, final: str, task: Any, state: dict[str, Any], info: dict[str, Any]
    ) -> float:
        """The share of hidden tests the final code block passes (per-test outcomes and the sandbox backend
        go to info)."""
        results = await self._hidden(final, task.data, state)
        passed = [False] * len(task.data["tests"]) if results is None else list(results.passed)
        info["hidden_tests"] = passed
        if results is not None:
            info["sandbox_backend"] = results.backend
        return sum(passed) / len(passed)

    @reward(weight=0.0)
    async def all_passed(self, final: str, task: Any, state: dict[str, Any]) -> float:
        """1 iff every hidden test passes."""
        results = await self._hidden(final, task.data, state)
        return float(results is not None and all(results.passed))
