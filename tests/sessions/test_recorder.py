"""Recorder: one complete JSON line per session, crash-safe, and a reader that reports torn lines."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from miles.sessions import (
    ErrorInfo,
    InstantEngine,
    Recorder,
    SchedulerConfig,
    SessionRecord,
    SessionScheduler,
    TurnRecord,
    encode_record,
    jsonable,
    read_sessions,
)
from miles.sessions.records import AttemptRecord
from miles.trajectory import Trajectory
from miles.types import Message, TerminationReason
from tests.support.sessions import AddEnv, call_text, ids, tito


def make_record(i: int, text: str = "hello") -> SessionRecord:
    traj = Trajectory(messages=[Message(role="user", content=text)])
    traj.append([1, 2, 3], role="user", generated=False)
    traj.append([7, 8], role="assistant", generated=True, logprobs=[-0.25, -1.5], weight_version=3)
    traj.reward = 0.5
    turn = TurnRecord(
        index=0,
        engine_id="e0",
        rid=f"s{i}-t0-a1",
        weight_version=3,
        prompt_tokens=3,
        output_start=3,
        output_end=5,
        finish_reason="stop",
        text=text,
        tool_calls=[{"id": "call_0", "type": "function", "function": {"name": "f", "arguments": {}}}],
        attempts=[AttemptRecord("e1", f"s{i}-t0-a0", ErrorInfo("generate", "EngineError", "down"), 0.01)],
    )
    return SessionRecord(
        session_id=f"s{i}",
        env_id="Test-v0",
        turns=[turn],
        reward=0.5,
        reward_components={"correct": 0.5},
        termination=TerminationReason.DONE,
        trajectory=traj,
        initial_messages=[{"role": "user", "content": text}],
    )


def test_roundtrip_keeps_every_field(tmp_path: Path) -> None:
    path = tmp_path / "run" / "sessions.jsonl"
    with Recorder(path, fsync="line") as rec:
        for i in range(3):
            rec.write(make_record(i, text=f"line\nbreak {i} ✓"))
        assert rec.count == 3
    lines = path.read_bytes().split(b"\n")
    assert len(lines) == 4 and lines[-1] == b""
    result = read_sessions(path)
    assert result.bad_lines == []
    assert [r.to_dict() for r in result.records] == [
        make_record(i, f"line\nbreak {i} ✓").to_dict() for i in range(3)
    ]
    r0 = result.records[0]
    assert r0.turns[0].attempts[0].error.message == "down"
    assert r0.trajectory.rollout_logprobs == [0.0, 0.0, 0.0, -0.25, -1.5]
    assert r0.weight_versions == [3]


def test_truncated_file_reports_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "sessions.jsonl"
    with Recorder(path) as rec:
        for i in range(4):
            rec.write(make_record(i))
    data = path.read_bytes()
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    cut = last_start + (len(data) - last_start) // 2
    path.write_bytes(data[:cut])
    result = read_sessions(path)
    assert [r.session_id for r in result.records] == ["s0", "s1", "s2"]
    torn = result.torn_tail
    assert torn is not None and torn.line_no == 4 and torn.offset == last_start


def test_reopening_a_torn_file_quarantines_the_tail_and_keeps_every_record(tmp_path: Path) -> None:
    """What `--resume` does after a kill: reopen the recording and append. The next record must be whole."""
    path = tmp_path / "sessions.jsonl"
    with Recorder(path) as rec:
        for i in range(4):
            rec.write(make_record(i))
    data = path.read_bytes()
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    cut = last_start + (len(data) - last_start) // 2
    path.write_bytes(data[:cut])
    with Recorder(path) as rec:
        rec.write(make_record(9))
        rec.write(make_record(10))
    result = read_sessions(path)
    assert [r.session_id for r in result.records] == ["s0", "s1", "s2", "s9", "s10"]
    assert result.bad_lines == []
    assert path.read_bytes()[:last_start] == data[:last_start]
    assert (tmp_path / "sessions.jsonl.torn").read_bytes() == data[last_start:cut] + b"\n"
    assert rec.torn_bytes == cut - last_start


def test_a_last_record_that_lost_only_its_newline_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "sessions.jsonl"
    with Recorder(path) as rec:
        for i in range(3):
            rec.write(make_record(i))
    path.write_bytes(path.read_bytes().rstrip(b"\n"))
    assert [r.session_id for r in read_sessions(path).records] == ["s0", "s1"]
    with Recorder(path) as rec:
        rec.write(make_record(3))
    result = read_sessions(path)
    assert [r.session_id for r in result.records] == ["s0", "s1", "s2", "s3"] and result.bad_lines == []
    assert not (tmp_path / "sessions.jsonl.torn").exists()


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 4), where=st.floats(0, 1), texts=st.lists(st.text(max_size=30), min_size=4, max_size=4)
)
def test_any_cut_then_reopen_loses_no_complete_record(n: int, where: float, texts: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sessions.jsonl"
        lines = [encode_record(make_record(i, texts[i])).encode() for i in range(n)]
        data = b"".join(lines)
        cut = int(where * len(data))
        path.write_bytes(data[:cut])
        whole, torn, offset = [], b"", 0
        for i, line in enumerate(lines):  # a record survives when its JSON is complete, newline or not
            if offset + len(line) - 1 <= cut:
                whole.append(f"s{i}")
            elif offset < cut:
                torn = data[offset:cut]
            offset += len(line)
        with Recorder(path) as rec:
            rec.write(make_record(99))
        result = read_sessions(path)
        assert [r.session_id for r in result.records] == [*whole, "s99"]
        assert result.bad_lines == []
        sidecar = Path(tmp) / "sessions.jsonl.torn"
        assert (sidecar.read_bytes() if sidecar.exists() else b"") == (torn + b"\n" if torn else b"")


def test_drop_after_moves_redone_sessions_aside(tmp_path: Path) -> None:
    path = tmp_path / "sessions.jsonl"
    rec = Recorder(path)
    for i in range(6):
        r = make_record(i)
        r.started_at = 100.0 + i
        rec.write(r)
    assert rec.drop_after(102.5) == 3
    rec.write(make_record(7))
    rec.close()
    assert [r.session_id for r in read_sessions(path).records] == ["s0", "s1", "s2", "s7"]
    assert [r.session_id for r in read_sessions(tmp_path / "sessions.jsonl.dropped").records] == [
        "s3",
        "s4",
        "s5",
    ]
    with Recorder(path) as again:
        assert again.drop_after(1000.0) == 0
    assert not (tmp_path / "sessions.jsonl.tmp").exists()


async def test_a_resumed_run_records_each_session_once(tmp_path: Path) -> None:
    """Killed after a checkpoint (mid-write), resumed: the redone sessions replace the first tries."""
    path = tmp_path / "sessions.jsonl"
    engine = InstantEngine([ids(call_text("add", a=2, b=3)), ids("5")])

    async def step(run_id: str, tasks: list[str], recorder: Recorder) -> None:
        sched = SessionScheduler(
            engine,
            tokenizer=tito(),
            env_factory=AddEnv,
            recorder=recorder,
            run_id=run_id,
            config=SchedulerConfig(group_size=2, progress=False),
        )
        await sched.run(tasks)

    rec = Recorder(path)
    await step("a", ["t0", "t1"], rec)
    checkpoint_time = time.time()
    await step("b", ["t2", "t3"], rec)
    await rec.aclose()
    with open(path, "ab") as f:  # the kill lands mid-write
        f.write(b'{"session_id": "b-s4", "env_id": "Add-')
    rec = Recorder(path)  # --resume
    assert rec.drop_after(checkpoint_time) == 4
    await step("c", ["t2", "t3"], rec)
    await rec.aclose()
    result = read_sessions(path)
    assert result.bad_lines == []
    assert sorted((r.task["task_id"], r.session_id[0]) for r in result.records) == [
        ("t0", "a"),
        ("t0", "a"),
        ("t1", "a"),
        ("t1", "a"),
        ("t2", "c"),
        ("t2", "c"),
        ("t3", "c"),
        ("t3", "c"),
    ]
    dropped = read_sessions(tmp_path / "sessions.jsonl.dropped").records
    assert sorted(r.session_id for r in dropped) == [f"b-s{k}" for k in range(4)]


def test_complete_but_unparseable_line_is_bad_not_torn(tmp_path: Path) -> None:
    path = tmp_path / "sessions.jsonl"
    path.write_text(encode_record(make_record(0)) + "{not json}\n[1, 2]\n" + encode_record(make_record(1)))
    result = read_sessions(path)
    assert [r.session_id for r in result.records] == ["s0", "s1"]
    assert [(b.line_no, b.torn_tail) for b in result.bad_lines] == [(2, False), (3, False)]
    assert result.torn_tail is None


async def test_concurrent_appends_are_grouped_and_all_durable(tmp_path: Path) -> None:
    path = tmp_path / "sessions.jsonl"
    rec = Recorder(path, fsync="batch")
    await asyncio.gather(*(rec.append(make_record(i)) for i in range(200)))
    await rec.aclose()
    result = read_sessions(path)
    assert sorted(int(r.session_id[1:]) for r in result.records) == list(range(200))
    assert rec.count == 200


async def test_cancelled_appender_still_gets_its_line_written(tmp_path: Path) -> None:
    path = tmp_path / "sessions.jsonl"
    rec = Recorder(path)
    task = asyncio.create_task(rec.append(make_record(0)))
    await asyncio.sleep(0)
    task.cancel()
    await rec.aclose()
    assert [r.session_id for r in read_sessions(path).records] == ["s0"]


WRITER = r"""
import sys, time
sys.path.insert(0, sys.argv[2])
from tests.sessions.test_recorder import make_record
from miles.sessions import Recorder
rec = Recorder(sys.argv[1], fsync="line")
i = 0
while True:
    rec.write(make_record(i, text="x" * (i % 5000)))
    if i == 20:
        print("ready", flush=True)
    i += 1
"""


def test_killed_writer_leaves_only_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / "sessions.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), str(Path(__file__).resolve().parents[2])],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    raw_lines = path.read_bytes().split(b"\n")
    result = read_sessions(path)
    complete = [ln for ln in raw_lines[:-1] if ln]
    assert len(result.records) == len(complete) > 20
    assert [r.session_id for r in result.records] == [f"s{i}" for i in range(len(complete))]
    assert all(json.loads(ln) for ln in complete)
    assert len(result.bad_lines) == (1 if raw_lines[-1] else 0)
    with Recorder(path) as rec:  # --resume reopens it: the next record is whole
        rec.write(make_record(10**6))
    after = read_sessions(path)
    assert [r.session_id for r in after.records] == [f"s{i}" for i in range(len(complete))] + [f"s{10**6}"]
    assert after.bad_lines == []


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=60, deadline=None)
@given(value=json_values, text=st.text())
def test_any_record_encodes_to_exactly_one_parseable_line(value: object, text: str) -> None:
    rec = make_record(0, text=text)
    rec.final_info = {"anything": value, "obj": object(), "msg": Message(role="tool", content=text)}
    line = encode_record(rec)
    assert line.endswith("\n") and line.count("\n") == 1
    back = SessionRecord.from_dict(json.loads(line))
    assert back.turns[0].text == text
    assert back.final_info["anything"] == jsonable(value)
    assert back.final_info["msg"]["content"] == text


def test_a_lone_surrogate_in_model_text_is_recorded_and_reads_back_the_same(tmp_path: Path) -> None:
    path = tmp_path / "sessions.jsonl"
    with Recorder(path, fsync="line") as rec:
        rec.write(make_record(0, text="before \ud800 after é"))
        rec.write(make_record(1))
    result = read_sessions(path)
    assert result.bad_lines == [] and [r.session_id for r in result.records] == ["s0", "s1"]
    assert result.records[0].turns[0].text == "before \ud800 after é"
    assert path.read_bytes().decode("utf-8")  # the file itself stays valid UTF-8


def test_a_record_that_cannot_be_written_stops_the_run_with_exit_3(tmp_path, capsys, monkeypatch) -> None:
    from miles.cli import main

    real = Recorder.append
    calls = {"n": 0}

    async def failing(self, record):
        calls["n"] += 1
        if calls["n"] == 3 and self.path.name == "sessions.jsonl":
            raise OSError("No space left on device")
        await real(self, record)

    monkeypatch.setattr(Recorder, "append", failing)
    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    assert (
        main(
            [
                "train",
                "--config",
                str(repo / "configs" / "calculator.yaml"),
                "--output-dir",
                str(tmp_path / "r"),
                "--set",
                "steps=3",
                "--set",
                "eval.num_tasks=2",
                "--set",
                "rollout.tasks_per_step=1",
            ]
        )
        == 3
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("miles train: the run is broken: 1 session record(s) could not be written to ")
