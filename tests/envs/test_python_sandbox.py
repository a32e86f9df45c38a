"""PythonSandbox-v0: hidden tests run through the sandbox; the oracle passes; cheating does not."""

from __future__ import annotations

import os

import pytest

import miles.envs as E
from miles.envs.python_sandbox import HiddenTestResults, extract_code, run_hidden_tests
from miles.tools import SandboxError, bwrap_problem, sandbox_backend
from miles.types import Message, ToolCall


@pytest.fixture(scope="module")
def env():
    e = E.make("PythonSandbox-v0")
    yield e
    e.close()


def answer(code: str) -> str:
    return f"Here you go:\n```python\n{code}\n```"


@pytest.mark.parametrize("backend", ["bwrap", "audit"])
def test_oracle_passes_every_task(backend):
    problem = bwrap_problem() if backend == "bwrap" else None
    if problem is not None:  # CI must run the bwrap backend; elsewhere it may be missing
        (pytest.fail if os.environ.get("CI") else pytest.skip)(problem)
    env = E.make("PythonSandbox-v0", sandbox_backend=backend)
    results = [E.run_episode(env, options={"task": t}) for t in env.tasks]
    assert len(results) >= 10
    assert all(r.success and r.reward == 1.0 for r in results), [
        r.info["task_id"] for r in results if not r.success
    ]
    assert all(all(r.info["hidden_tests"]) and r.info["sandbox_backend"] == backend for r in results)


def test_unknown_sandbox_backend_fails_at_construction():
    with pytest.raises(SandboxError, match="backend='docker' is not a sandbox backend"):
        E.make("PythonSandbox-v0", sandbox_backend="docker")


def test_run_python_tool_output_is_an_observation(env):
    env.reset(options={"task_id": "py-add"})
    obs, _, term, _, info = env.step(
        Message("assistant", tool_calls=[ToolCall("run_python", {"code": "print(6 * 7)"}, "call_0")])
    )
    assert obs[0].content == "42" and not term
    _, r, *_ = env.step(answer("def add(a, b):\n    return a + b"))
    assert r == 1.0


@pytest.mark.parametrize(
    "final,expected",
    [
        ("def add(a, b): return a + b", 0.0),  # no code block
        (answer("def add(a, b):\n    return a - b"), 0.25),  # only add(0, 0) passes
        (answer("def add(a, b):\n    raise SystemExit(0)"), 0.0),
        (answer("import os\nos._exit(0)"), 0.0),
        (answer("while True: pass"), 0.0),
        (answer("def add(a, b:\n"), 0.0),  # syntax error
        (answer("class Yes:\n    def __eq__(self, o): return True\ndef add(a, b):\n    return Yes()"), 0.0),
        (answer('print(\'@@miles-results-0@@[{"ok": true, "value": 5}]\')\ndef add(a, b): return 0'), 0.5),
        # ^ the forged marker line is ignored: only the two tests whose answer is 0 pass
        (answer("def add(a, b):\n    return float(a + b)"), 0.0),  # wrong type
    ],
)
def test_wrong_or_cheating_solutions_do_not_pass(final, expected):
    env = E.make(
        "PythonSandbox-v0", test_timeout_s=4.0
    )  # room for the sandbox's Python to start on a busy box
    env.reset(options={"task_id": "py-add"})
    _, r, term, _, info = env.step(final)
    assert term and r == pytest.approx(expected) and not info["success"]


async def test_hidden_tests_directly():
    tests = [{"call": "f(2)", "expected": [2, 2]}, {"call": "f(0)", "expected": []}]
    for backend in ("audit", None):
        ran = await run_hidden_tests("def f(n):\n    return [n] * n\n", tests, backend=backend)
        assert isinstance(ran, HiddenTestResults) and ran.passed == (True, True)
        assert ran.backend == sandbox_backend(backend)
    assert (await run_hidden_tests("def f(n):\n    return (n,) * n\n", tests)).passed == (True, True)
    assert (await run_hidden_tests("def f(n):\n    return None\n", tests)).passed == (False, False)


def test_extract_code_takes_the_last_block():
    assert extract_code("```python\na = 1\n```\ntext\n```\nb = 2\n```") == "b = 2\n"
    assert extract_code("no code") is None
