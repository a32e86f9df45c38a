"""Exact replay: a user's env rebuilt from its recorded recipe in a fresh process, length-cut tool calls,
the recorded chat-template override for --tito, exit codes, version 1 records, one copy of each message."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from miles.engine import SamplingParams
from miles.envs import EnvRecipe
from miles.sessions import InstantEngine, SchedulerConfig, SessionConfig, SessionScheduler, read_sessions
from miles.sessions.replay import check
from miles.sessions.replay_cli import main
from miles.tito import TITOTokenizer, TokenizerSpec

V1_FILE = Path(__file__).parents[1] / "data" / "sessions_v1.jsonl"
NOT_CLOSED = "(the <tool_call> tag was not closed)"

BANK_ENV = '''
from miles.envs import ToolEnv, register, reward
from miles.tools import tool


class BankEnv(ToolEnv):
    """Withdraw money; the reward checks the final balance."""

    max_turns = 4

    def __init__(self, *, opening: int = 100, **kwargs):
        self.opening = opening
        super().__init__(**kwargs)

    async def on_reset(self, task):
        self.state["balance"] = self.opening

    @tool
    def withdraw(self, amount: int) -> int:
        """Withdraw `amount` and return the new balance.

        Args:
            amount: how much to take out.
        """
        if amount > self.state["balance"]:
            raise ValueError("insufficient funds")
        self.state["balance"] -= amount
        return self.state["balance"]

    @reward
    def balance_right(self, state: dict, answer: int) -> float:
        return float(state["balance"] == answer)


register("{env_id}", BankEnv, tasks=[{{"id": "b{{}}".format(i), "prompt": "Take out {{}}.".format(10 * i),
                                      "answer": 250 - 10 * i}} for i in range(1, 9)])
'''


def tokens(tito, text: str, *, stop: bool = True) -> list[int]:
    ids = tito.tokenizer.encode(text, add_special_tokens=False)
    return ids + [tito.stop_token_ids[0]] if stop else ids


def call(name: str, **arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def compact_tito():
    return TITOTokenizer.from_spec(TokenizerSpec("tiny", "compact"))


@pytest.fixture(scope="module")
def bank_run(tmp_path_factory, compact_tito):
    """A user env in a temporary package (not under envs/), recorded through the scheduler with its recipe.

    Each session: a withdraw cut by the token limit (a tool error), a withdraw, then an answer."""
    root = tmp_path_factory.mktemp("user")
    module = f"bank_env_{uuid.uuid4().hex[:8]}"
    env_id = f"Bank-{uuid.uuid4().hex[:6]}-v0"
    (root / "pkg").mkdir()
    (root / "pkg" / f"{module}.py").write_text(BANK_ENV.format(env_id=env_id))
    recipe = EnvRecipe(env_id, {"opening": 250}, (str(root / "pkg" / f"{module}.py"),))
    cut = tokens(compact_tito, call("withdraw", amount=12345678), stop=False)[:-4]
    replies = [cut, tokens(compact_tito, call("withdraw", amount=30)), tokens(compact_tito, "Done.")]
    engine = InstantEngine(replies)
    path = root / "run" / "sessions.jsonl"
    config = SchedulerConfig(
        group_size=2, progress=False, session=SessionConfig(sampling=SamplingParams(max_new_tokens=len(cut)))
    )
    sched = SessionScheduler(
        engine, tokenizer=compact_tito, recipe=recipe, recorder=path, config=config, run_id="bank"
    )
    asyncio.run(sched.run([f"b{i}" for i in range(1, 5)]))
    asyncio.run(sched.aclose())
    return root, module, path


def replay(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "miles.cli", "replay", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


def test_recording_holds_what_rebuilds_the_episode(bank_run):
    _, module, path = bank_run
    records = read_sessions(path).records
    assert len(records) == 8 and all(r.ok for r in records)
    r = records[0]
    assert r.version == 2 and r.recipe is not None and r.recipe.kwargs == {"opening": 250}
    assert r.recipe.imports[0].endswith(f"{module}.py")
    assert r.tokenizer_spec is not None and r.tokenizer_spec.chat_template == "compact"
    assert len(r.tokenizer_spec.template_sha256) == 64 and r.parser == "hermes"
    assert [t.finish_reason for t in r.turns] == ["length", "stop", "stop"]
    assert NOT_CLOSED in r.turns[0].observation[0]["content"]
    assert sorted({r.reward for r in records}) == [0.0, 1.0]  # b3 (answer 220) is the one solved by 30


@pytest.mark.slow  # two fresh interpreters
def test_replay_check_and_tito_in_a_fresh_process(bank_run, tmp_path):
    root, module, path = bank_run
    # From the run's folder with --import by module name: the package folder is not on sys.path otherwise.
    proc = replay(str(path), "--check", "--tito", "--import", f"pkg/{module}.py", cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("check ok (3 steps)") == 8 and proc.stdout.count("tito ok") == 8
    # From anywhere else: the recorded (absolute) import path rebuilds it alone.
    proc = replay(str(path), "--check", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.count("check ok") == 8, proc.stdout + proc.stderr


def test_an_env_that_cannot_be_rebuilt_exits_2_with_one_line(bank_run, tmp_path, capsys):
    _, _, path = bank_run
    data = [json.loads(line) for line in path.read_text().splitlines()]
    for d in data:
        d["recipe"]["id"] = "Bank-moved-v0"
        d["recipe"]["imports"] = ["bank_env_that_moved"]
    moved = tmp_path / "moved.jsonl"
    moved.write_text("".join(json.dumps(d) + "\n" for d in data))
    code, out = cli(str(moved), "--check")
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "check ok" not in out and "Traceback" not in err
    assert err.startswith(
        "miles replay: cannot rebuild env 'Bank-moved-v0' of session bank-s0: cannot import "
        "'bank_env_that_moved': no module named 'bank_env_that_moved'"
    )
    assert err.endswith("or pass --import MODULE (a module name or a .py path)")
    code, _ = cli(str(moved), "--check", "--import", "no_such_user_module")
    err = capsys.readouterr().err
    assert code == 2 and "env.import: cannot import 'no_such_user_module'" in err


def raising_factory():
    raise RuntimeError("the sandbox image is missing")


def cli(*argv: str) -> tuple[int, str]:
    buf = io.StringIO()
    return main(list(argv), stdout=buf), buf.getvalue()


def test_a_raising_env_factory_exits_2(bank_run, capsys):
    _, _, path = bank_run
    code, out = cli(str(path), "--check", "--env-factory", f"{__name__}:raising_factory")
    err = capsys.readouterr().err
    assert code == 2 and "check ok" not in out
    assert "cannot rebuild the env of session bank-s0: RuntimeError: the sandbox image is missing" in err
    assert cli(str(path), "--check", "--env-factory", f"{__name__}:nothing_here")[0] == 2


def test_tito_uses_the_recorded_chat_template(bank_run, capsys):
    _, _, path = bank_run
    code, out = cli(str(path), "--tito", "--session", "bank-s0")
    assert code == 0 and "tito ok" in out
    code, out = cli(str(path), "--tito", "--session", "bank-s0", "--chat-template", "")
    assert code == 1 and "MISALIGNED" in out and "is not the one recorded" in out


def test_length_cut_tool_call_replays_without_divergence(compact_tito, tmp_path):
    cut = tokens(compact_tito, call("calculate", expression="3 + 4 * 2 - 1 + 5"), stop=False)[:-8]
    replies = [
        cut,
        tokens(compact_tito, call("calculate", expression="3 + 4")),
        tokens(compact_tito, "The answer is 7."),
    ]
    path = tmp_path / "sessions.jsonl"
    config = SchedulerConfig(
        group_size=4, progress=False, session=SessionConfig(sampling=SamplingParams(max_new_tokens=len(cut)))
    )
    sched = SessionScheduler(
        InstantEngine(replies),
        tokenizer=compact_tito,
        recorder=path,
        config=config,
        recipe=EnvRecipe("Calculator-v0", {"split": "train"}),
        run_id="cut",
    )
    asyncio.run(sched.run([0]))
    asyncio.run(sched.aclose())
    records = read_sessions(path).records
    assert len(records) == 4
    for r in records:
        assert r.turns[0].finish_reason == "length" and NOT_CLOSED in r.turns[0].tool_results[0]["content"]
        assert r.turns[0].tool_calls[0]["parse_error"].endswith(NOT_CLOSED)
        res = asyncio.run(check(r))
        assert res.ok and res.steps == 3, res.divergence and res.divergence.describe()
    code, out = cli(str(path), "--check", "--tito")
    assert code == 0 and out.count("check ok") == 4 and out.count("tito ok") == 4


def test_each_message_is_stored_once(bank_run):
    _, _, path = bank_run
    line = path.read_text().splitlines()[0]
    record = read_sessions(path).records[0]
    error_text = json.dumps(record.turns[0].observation[0]["content"])[1:-1]
    assert line.count(error_text) == 1  # version 1 repeated it in tool_results and trajectory.messages
    assert line.count('"prompt"') <= 1 and line.count("Take out") == 1
    assert [m.role for m in record.trajectory.messages] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert record.turns[1].tool_results == [{"call_id": "call_0", "name": "withdraw", "content": "220"}]
    assert record.turns[1].tool_calls == [
        {"id": "call_0", "type": "function", "function": {"name": "withdraw", "arguments": {"amount": 30}}}
    ]


def test_version_1_records_still_load_and_replay(capsys):
    records = read_sessions(V1_FILE).records
    assert len(records) == 1
    r = records[0]
    assert (
        r.version == 1 and r.recipe is None and r.tokenizer_spec is None and r.tokenizer == "tiny:miles-tiny"
    )
    assert [m.role for m in r.trajectory.messages] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert r.turns[0].finish_reason == "length" and NOT_CLOSED in r.turns[0].tool_results[0]["content"]
    res = asyncio.run(check(r))  # the lost parse error comes back from re-parsing with the recorded parser
    assert res.ok and res.steps == 3, res.divergence and res.divergence.describe()
    code, out = cli(str(V1_FILE), "--check", "--tito", "--chat-template", "compact")
    assert code == 0 and "check ok" in out and "tito ok" in out
    code, out = cli(str(V1_FILE), "--tito")  # version 1 did not record the template override
    assert code == 1 and "MISALIGNED" in out
