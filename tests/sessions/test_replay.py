"""Replay: list/filter, render with a token view, --check, --rescore and --tito, all without an engine."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest

from miles.envs import reward
from miles.sessions import InstantEngine, SchedulerConfig, SessionScheduler, read_sessions
from miles.sessions.replay import check, check_tito, filter_records, rescore, tokenizer_spec_for
from miles.sessions.replay_cli import main
from miles.tito import MismatchKind, TITOTokenizer
from miles.tools import tool
from miles.types import TerminationReason
from tests.support.sessions import AddEnv, StepFailsEnv, call_text, ids, tito


class AddEnvOffByOne(AddEnv):
    """A regression: `add` is off by one."""

    @tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first.
            b: the second.
        """
        return a + b + 1


class AddEnvStricter(AddEnv):
    """A changed reward function: the answer must be followed by a period."""

    @reward
    def correct(self, final: str, answer: str) -> float:
        return float(final.strip() == answer + ".")


def make_env() -> AddEnv:
    return AddEnvOffByOne()


def make_stricter() -> AddEnv:
    return AddEnvStricter()


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("replay") / "sessions.jsonl"
    kinds = iter([AddEnv, AddEnv, StepFailsEnv, AddEnv])
    engine = InstantEngine([ids(call_text("add", a=2, b=3)), ids("5")])
    sched = SessionScheduler(
        engine,
        tokenizer=tito(),
        env_factory=lambda: next(kinds)(),
        recorder=path,
        config=SchedulerConfig(group_size=2),
        run_id="rp",
    )
    asyncio.run(sched.run(["t2", "t3"]))  # t2 is solved by the script, t3 is not
    return path


def cli(*argv: str) -> tuple[int, str]:
    buf = io.StringIO()
    code = main(list(argv), stdout=buf)
    return code, buf.getvalue()


def test_list_and_filters(recording: Path) -> None:
    code, out = cli(str(recording))
    assert code == 0 and "4 of 4 sessions" in out
    assert all(f"rp-s{k}" in out for k in range(4))
    code, out = cli(str(recording), "--termination", "env_error")
    assert code == 0 and "1 of 4 sessions" in out and "StepFails-v0" in out
    code, out = cli(str(recording), "--min-reward", "0.5")
    assert "2 of 4" in out
    records = read_sessions(recording).records
    assert [r.session_id for r in filter_records(records, env="StepFails-v0")] == ["rp-s2"]
    with pytest.raises(ValueError, match="unknown termination"):
        filter_records(records, termination="exploded")
    assert cli(str(recording), "--termination", "exploded")[0] == 2


def test_render_one_session_with_token_view(recording: Path) -> None:
    code, out = cli(str(recording), "--session", "rp-s0", "--tokenizer", "tiny")
    assert code == 0
    assert "turn 0" in out and "turn 1" in out and "-> add(" in out and "[tool] 5" in out
    assert "mask=0" in out and "mask=1" in out and "<|im_start|>assistant" in out
    code, _ = cli(str(recording), "--session", "nope")
    assert code == 2


def test_check_passes_on_the_recorded_env_and_finds_a_regression(recording: Path) -> None:
    records = read_sessions(recording).records
    for r in records:
        res = asyncio.run(check(r))
        assert res.ok, (r.session_id, res.divergence)
    failed = next(r for r in records if r.env_id == "StepFails-v0")
    assert failed.termination == TerminationReason.ENV_ERROR  # and check reproduced it: the env raised again
    solved = next(r for r in records if r.session_id == "rp-s0")
    res = asyncio.run(check(solved, lambda _: AddEnvOffByOne()))
    assert res.divergence is not None and res.divergence.turn == 0 and res.divergence.field == "tool results"
    assert res.divergence.recorded[0]["content"] == "5" and res.divergence.replayed[0]["content"] == "6"
    code, out = cli(str(recording), "--session", "rp-s0", "--check", "--env-factory", f"{__name__}:make_env")
    assert code == 1 and "DIVERGED" in out and "turn 0: tool results differ" in out
    code, out = cli(str(recording), "--check")
    assert code == 0 and out.count("check ok") == 4


def test_rescore_uses_the_current_reward_functions(recording: Path) -> None:
    r = next(r for r in read_sessions(recording).records if r.session_id == "rp-s0")
    same = asyncio.run(rescore(r))
    assert not same.changed and same.reward == 1.0
    new = asyncio.run(rescore(r, lambda _: AddEnvStricter()))
    assert new.changed and new.reward == 0.0 and new.recorded_reward == 1.0
    code, out = cli(
        str(recording), "--session", "rp-s0", "--rescore", "--env-factory", f"{__name__}:make_stricter"
    )
    assert code == 0 and "reward 1 -> 0 (CHANGED)" in out


def test_tito_alignment_is_verified_and_tampering_is_found(recording: Path, tmp_path: Path) -> None:
    records = read_sessions(recording).records
    assert all(check_tito(r, tito()).ok for r in records)
    code, out = cli(str(recording), "--tito", "--tokenizer", "tiny")
    assert code == 0 and out.count("tito ok") == 4
    data = next(d for d in map(json.loads, recording.read_text().splitlines()) if d["session_id"] == "rp-s0")
    data["trajectory"]["token_ids"][5] = (data["trajectory"]["token_ids"][5] + 1) % 1000
    bad = tmp_path / "tampered.jsonl"
    bad.write_text(json.dumps(data) + "\n")
    code, out = cli(str(bad), "--tito", "--tokenizer", "tiny")
    assert code == 1 and "MISALIGNED" in out and "token 5" in out


NESTED_CALLS = Path(__file__).parents[1] / "data" / "orders_agent_nested_tool_calls.jsonl"


def test_tito_of_an_agent_session_with_nested_cut_tool_calls(tmp_path: Path) -> None:
    """An external agent's Orders-v0 session with the tiny model: nested <tool_call> tags, two turns cut at
    max_new_tokens, the same tool error three times. Every re-render difference lies in the model's own turns,
    where it is explained; the session's own verdict (final_info["tito"]) was the misaligned one."""
    (record,) = read_sessions(NESTED_CALLS).records
    tc = check_tito(record, TITOTokenizer.from_spec(tokenizer_spec_for(record)))
    assert tc.ok, tc.message
    counts = tc.report.counts()
    assert not tc.report.exact and counts["special_tokens"] == counts["non_assistant_text"] == 0
    assert all(m.kind is MismatchKind.ASSISTANT_TEXT for m in tc.report.mismatches)
    code, out = cli(str(NESTED_CALLS), "--session", "train-s5", "--tito")
    assert code == 0 and "train-s5: tito ok: 789 tokens aligned" in out
    data = json.loads(NESTED_CALLS.read_text())
    data["turns"][1]["observation"][0]["content"] = data["turns"][1]["observation"][0]["content"].replace(
        "JSON", "YAML"
    )
    bad = tmp_path / "tampered.jsonl"
    bad.write_text(json.dumps(data) + "\n")
    code, out = cli(str(bad), "--tito")
    assert code == 1 and "MISALIGNED" in out


def test_torn_last_line_is_skipped_and_reported(recording: Path, tmp_path: Path, capsys) -> None:
    raw = recording.read_bytes()
    torn = tmp_path / "torn.jsonl"
    torn.write_bytes(raw[: len(raw) - 100])
    code, out = cli(str(torn))
    assert code == 0 and "3 of 3 sessions" in out
    assert "torn last line" in capsys.readouterr().err
    assert cli(str(tmp_path / "missing.jsonl"))[0] == 2


def test_check_on_a_file_with_no_session_record_fails(tmp_path, capsys):
    from miles.sessions.replay_cli import main as replay

    noise = tmp_path / "noise.jsonl"
    noise.write_bytes(bytes(range(256)) * 40 + b'\n{"not": "a record"}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    for path in (noise, empty):
        assert replay([str(path), "--check"]) == 2
        assert f"miles replay: {path} holds no session record" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("field", "tamper"),
    [
        ("tool results", lambda r: r.turns[0].tool_results[0].update(content="6")),
        ("observation", lambda r: r.turns[0].observation.append({"role": "user", "content": "extra"})),
        ("reward", lambda r: setattr(r.turns[1], "reward", 0.25)),
        ("terminated", lambda r: setattr(r.turns[1], "terminated", False)),
        ("truncated", lambda r: setattr(r.turns[1], "truncated", True)),
        ("final reward", lambda r: setattr(r, "reward", 0.5)),
    ],
)
def test_check_compares_every_recorded_field(recording: Path, field, tamper) -> None:
    """Change one recorded value of a session that re-drives cleanly: the check names exactly that field (so a
    comparison dropped from the replay fails here)."""
    [record] = [r for r in read_sessions(recording).records if r.session_id == "rp-s0"]
    assert asyncio.run(check(record, lambda _: AddEnv())).divergence is None
    tamper(record)
    divergence = asyncio.run(check(record, lambda _: AddEnv())).divergence
    assert divergence is not None and divergence.field == field, divergence


def test_a_session_the_run_aborted_during_an_env_step_is_no_divergence(recording: Path) -> None:
    [record] = [r for r in read_sessions(recording).records if r.session_id == "rp-s0"]
    last = record.turns[-1]
    last.reward, last.terminated, last.observation, last.tool_results = None, False, [], []
    record.termination = TerminationReason.ABORTED
    assert asyncio.run(check(record, lambda _: AddEnv())).divergence is None
    record.termination = TerminationReason.DONE  # a session that ended on its own must have its step
    assert asyncio.run(check(record, lambda _: AddEnv())).divergence.field == "step"
