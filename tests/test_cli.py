"""The `miles` command line: `envs`, `tito check`, `replay`, and how it reports bad input.

(`miles rollout` is exercised by the engine tests, which start it as a server subprocess.)"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from miles.cli import build_parser, main
from miles.engine import SamplingParams
from miles.engines.embedded import EmbeddedEngine
from miles.engines.testing import small_qwen2
from miles.envs import make
from miles.sessions.config import SchedulerConfig, SessionConfig
from miles.sessions.recorder import Recorder, read_sessions
from miles.sessions.scheduler import SessionScheduler
from miles.tiny import load_tiny_tokenizer
from miles.tito import TITOTokenizer

BUILT_INS = ("Calculator-v0", "Orders-v0", "PythonSandbox-v0", "SQL-v0")


def test_envs_lists_the_built_in_environments_from_the_console_script():
    proc = subprocess.run(
        [sys.executable, "-m", "miles.cli", "envs"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    listed = {line.split()[0]: line.split()[1] for line in proc.stdout.splitlines() if line.strip()}
    for env_id in BUILT_INS:
        assert env_id in listed
    assert listed["Calculator-v0"] == "miles.envs.calculator:CalculatorEnv"


def test_tito_check_on_the_tiny_tokenizer(capsys):
    assert main(["tito", "check", "--tokenizer", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "append-only" in out and "verdict" in out


def test_unknown_commands_and_missing_arguments_exit_with_usage(capsys):
    for argv in (["nope"], ["train"], ["tito"], []):
        with pytest.raises(SystemExit) as err:
            main(argv)
        assert err.value.code == 2
    assert "usage: miles" in capsys.readouterr().err
    names = set(build_parser()._subparsers._group_actions[0].choices)  # noqa: SLF001
    assert {"envs", "rollout", "replay", "tito", "train", "sft"} <= names


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A real sessions.jsonl: 3 Calculator sessions of the tiny model, scheduled and recorded."""
    path = tmp_path_factory.mktemp("replay") / "sessions.jsonl"
    tok = load_tiny_tokenizer()

    async def record() -> None:
        engine = EmbeddedEngine(small_qwen2(0, vocab_size=len(tok)))
        recorder = Recorder(path)
        config = SchedulerConfig(
            group_size=1,
            progress=False,
            session=SessionConfig(max_turns=2, sampling=SamplingParams(max_new_tokens=16)),
        )
        sched = SessionScheduler(
            engine,
            tokenizer=TITOTokenizer(tok),
            config=config,
            recorder=recorder,
            env_factory=lambda: make("Calculator-v0"),
            run_id="cli",
        )
        env = make("Calculator-v0")
        try:
            await sched.run([{"task": t} for t in env.tasks.take(3)])
        finally:
            await sched.aclose()
            await recorder.aclose()
            await engine.close()
            env.close()

    asyncio.run(record())
    return path


def test_replay_lists_recorded_sessions(recorded, capsys):
    ids = [r.session_id for r in read_sessions(recorded).records]
    assert len(ids) == 3
    assert main(["replay", str(recorded)]) == 0
    out = capsys.readouterr().out
    assert all(i in out for i in ids) and "3 of 3 sessions" in out
    assert main(["replay", str(recorded), "--session", ids[1]]) == 0
    assert ids[1] in capsys.readouterr().out


def test_replay_reports_bad_input(recorded, tmp_path, capsys):
    assert main(["replay", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main(["replay", str(recorded), "--session", "no-such-session"]) == 2
    assert "no-such-session" in capsys.readouterr().err
    torn = tmp_path / "torn.jsonl"
    torn.write_text(recorded.read_text() + '{"session_id": "half')
    assert main(["replay", str(torn)]) == 0
    captured = capsys.readouterr()
    assert "3 of 3 sessions" in captured.out and "torn" in captured.err


def test_the_final_table_fits_long_adapter_modes_in_one_column():
    from miles.training.command import format_summary
    from miles.training.evaluate import EvalResult
    from miles.training.loop import RunSummary

    def result(mode: str, rate: float) -> EvalResult:
        return EvalResult(mode=mode, num_tasks=10, success_rate=rate, mean_reward=rate, terminations={})

    modes = ("mul/greedy", "addsub/greedy")
    summary = RunSummary(
        output_dir="out",
        steps_done=1,
        evals={"start": {m: result(m, 0.5) for m in modes}, "final": {m: result(m, 0.75) for m in modes}},
    )
    rows = format_summary(summary).splitlines()[1:6]
    header, body = rows[0], rows[1:]
    assert [r.index("%") + 1 for r in body] == [header.index("success") + len("success")] * 4, "\n".join(rows)
    assert [r.split()[-3] for r in body] == ["50.0%", "50.0%", "75.0%", "75.0%"]
