"""SessionScheduler: groups, back-fill, over-sampling, isolation, recording of every session, progress."""

from __future__ import annotations

import asyncio
import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from miles.engine import SamplingParams
from miles.envs import Task
from miles.sessions import (
    InstantEngine,
    InvalidTaskError,
    ProgressDisplay,
    RetryConfig,
    RunStats,
    SchedulerConfig,
    SessionConfig,
    SessionScheduler,
    TimeoutConfig,
    read_sessions,
)
from miles.types import TerminationReason
from tests.support.sessions import (
    AddEnv,
    FlakyEngine,
    ResetFailsEnv,
    StepFailsEnv,
    call_text,
    ids,
    tito,
)


def solve(i: int) -> list[list[int]]:
    return [ids(call_text("add", a=i, b=i + 1)), ids(str(2 * i + 1))]


def responder(input_ids: list[int], session_id: str | None, k: int) -> list[int]:
    """Solve whatever task the prompt asks about (the prompt says 'What is i + i+1?')."""
    text = tito().decode(input_ids)
    i = int(text.split("What is ")[1].split(" ")[0])
    return solve(i)[min(k, 1)]


def config(**kw: Any) -> SchedulerConfig:
    session = kw.pop(
        "session",
        SessionConfig(
            sampling=SamplingParams(max_new_tokens=64), retry=RetryConfig(max_retries=2, base_delay_s=0.001)
        ),
    )
    return SchedulerConfig(session=session, **kw)


class CountingEnv(AddEnv):
    """Tracks how many episodes are live at once."""

    live = 0
    peak = 0
    events: list[tuple[str, str]] = []  # ("start" | "end", task id), in order

    async def on_reset(self, task: Any) -> None:
        CountingEnv.live += 1
        CountingEnv.peak = max(CountingEnv.peak, CountingEnv.live)
        CountingEnv.events.append(("start", task.id))
        await asyncio.sleep(0.01)

    async def aclose(self) -> None:
        CountingEnv.live -= 1
        CountingEnv.events.append(("end", self.task.id))
        await super().aclose()


class SlowTaskEnv(AddEnv):
    """Tasks whose data says `slow` make every step take that many seconds."""

    async def react(self, action: Any) -> list:
        await asyncio.sleep(float(self.task.data.get("slow", 0.0)))
        return await super().react(action)


async def test_groups_of_n_samples_are_all_recorded(tmp_path: Path) -> None:
    path = tmp_path / "sessions.jsonl"
    sched = SessionScheduler(
        InstantEngine(respond=responder),
        tokenizer=tito(),
        env_factory=AddEnv,
        config=config(group_size=3, seed=100),
        recorder=path,
        run_id="r1",
    )
    groups = await sched.run([f"t{i}" for i in range(5)])
    await sched.aclose()
    assert sorted(g.index for g in groups) == list(range(5))
    for g in groups:
        assert [r.sample_index for r in g.records] == [0, 1, 2]
        assert {r.task["task_id"] for r in g.records} == {f"t{g.index}"}
        assert {r.group_id for r in g.records} == {g.group_id}
        assert g.all_ok and g.rewards == [1.0, 1.0, 1.0]
        assert len({r.seed for r in g.records}) == 3
    seeds = sorted(r.seed for g in groups for r in g.records)
    assert seeds == list(range(100, 115))
    recorded = read_sessions(path)
    assert recorded.bad_lines == []
    assert sorted(r.session_id for r in recorded.records) == sorted(f"r1-s{k}" for k in range(15))
    assert sched.stats.scheduled == sched.stats.recorded == 15 and sched.stats.finished == 15
    assert sched.stats.mean_reward == 1.0 and sched.stats.groups_done == 5


@pytest.mark.parametrize("mode", ["unit", "backfill"])
async def test_concurrency_limit_holds_in_both_group_modes(mode: str) -> None:
    CountingEnv.live = CountingEnv.peak = 0
    CountingEnv.events = []
    sched = SessionScheduler(
        InstantEngine(respond=responder),
        tokenizer=tito(),
        env_factory=CountingEnv,
        config=config(group_size=2, group_mode=mode, max_concurrent_sessions=3),
    )
    groups = await sched.run([f"t{i}" for i in range(6)])
    assert len(groups) == 6 and all(g.all_ok for g in groups)
    assert CountingEnv.peak <= 3 and CountingEnv.live == 0
    if mode == "unit":  # a group waits until it fits whole: the third slot stays free until an episode ends
        assert CountingEnv.events[:3] == [("start", "t0"), ("start", "t0"), ("end", "t0")], CountingEnv.events
    else:  # backfill fills every slot at once: half of the second group starts beside the first
        assert CountingEnv.peak == 3 and CountingEnv.events[:3] == [
            ("start", "t0"),
            ("start", "t0"),
            ("start", "t1"),
        ]


async def test_oversampling_keeps_the_first_groups_and_records_the_aborted(tmp_path: Path) -> None:
    tasks = [
        Task(
            id=f"t{i}",
            prompt=f"What is {i} + {i + 1}?",
            answer=str(2 * i + 1),
            data={"slow": 30.0 if i in (0, 3) else 0.0},
        )
        for i in range(4)
    ]
    path = tmp_path / "sessions.jsonl"
    sched = SessionScheduler(
        InstantEngine(respond=responder),
        tokenizer=tito(),
        env_factory=SlowTaskEnv,
        config=config(group_size=2, oversample_groups=2),
        recorder=path,
    )
    kept = []
    async with contextlib.aclosing(sched.run_groups(tasks, num_groups=2)) as groups:
        async for g in groups:
            kept.append(g)
    assert sorted(g.task.task_id for g in kept) == ["t1", "t2"]
    records = read_sessions(path).records
    assert len(records) == sched.stats.scheduled == 8
    aborted = [r for r in records if r.termination == TerminationReason.ABORTED]
    assert sorted({r.task["task_id"] for r in aborted}) == ["t0", "t3"] and len(aborted) == 4
    assert all(r.reward == 0.0 and r.error.message == "aborted by the scheduler" for r in aborted)
    assert sched.stats.aborted == 4 and sched.stats.running == 0


async def test_one_failing_env_never_affects_the_others(tmp_path: Path) -> None:
    kinds = [AddEnv, ResetFailsEnv, AddEnv, StepFailsEnv]
    made = iter(range(1000))

    def factory() -> AddEnv:
        k = next(made)
        if k == 5:
            raise RuntimeError("cannot build env")
        return kinds[k % 4]()

    path = tmp_path / "sessions.jsonl"
    sched = SessionScheduler(
        InstantEngine(respond=responder),
        tokenizer=tito(),
        env_factory=factory,
        config=config(group_size=4),
        recorder=path,
    )
    groups = await sched.run(["t1", "t2"])
    by_kind: dict[str, list[TerminationReason]] = {}
    for r in (r for g in groups for r in g.records):
        by_kind.setdefault(r.env_id or "factory", []).append(r.termination)
    assert by_kind["Add-v0"] == [TerminationReason.DONE] * 4  # factory calls 0, 2, 4, 6
    assert set(by_kind["ResetFails-v0"]) == {TerminationReason.ENV_ERROR}
    assert set(by_kind["StepFails-v0"]) == {TerminationReason.ENV_ERROR}
    assert by_kind["factory"] == [TerminationReason.ENV_ERROR]
    assert len(read_sessions(path).records) == 8 == sched.stats.recorded
    assert sched.stats.failed == 4 and sched.stats.finished == 4


async def test_failover_and_per_engine_limits_across_many_sessions() -> None:
    dead = FlakyEngine(InstantEngine(respond=responder), fail_calls=set(range(10**6)), engine_id="dead")
    ok = [InstantEngine(respond=responder, engine_id=f"ok{i}", delay_s=0.002) for i in range(2)]
    sched = SessionScheduler(
        [dead, *ok],
        tokenizer=tito(),
        env_factory=AddEnv,
        config=config(group_size=4, max_inflight_per_engine=2),
    )
    groups = await sched.run([f"t{i % 8}" for i in range(10)])
    records = [r for g in groups for r in g.records]
    assert len(records) == 40 and all(r.termination == TerminationReason.DONE for r in records)
    assert {t.engine_id for r in records for t in r.turns} == {"ok0", "ok1"}


async def test_invalid_task_is_a_named_error() -> None:
    sched = SessionScheduler(
        InstantEngine(respond=responder), tokenizer=tito(), env_factory=AddEnv, config=config()
    )
    with pytest.raises(InvalidTaskError):
        await sched.run(["t1", 2.5])
    assert sched.stats.running == 0


async def test_consumer_leaving_early_still_records_every_started_session(tmp_path: Path) -> None:
    path = tmp_path / "sessions.jsonl"

    class FirstTaskFast(InstantEngine):
        """Task t0 is answered at once; every other request waits until it is aborted (or 60 s)."""

        async def generate(self, input_ids, sampling_params, *, session_id=None, rid=None):
            self.delay_s = 0.0 if "What is 0 " in tito().decode(input_ids) else 60.0
            return await super().generate(input_ids, sampling_params, session_id=session_id, rid=rid)

    engine = FirstTaskFast(respond=responder)
    sched = SessionScheduler(
        engine,
        tokenizer=tito(),
        env_factory=AddEnv,
        recorder=path,
        config=config(group_size=2, max_concurrent_sessions=4),
    )
    async with contextlib.aclosing(sched.run_groups([f"t{i % 8}" for i in range(50)])) as groups:
        async for _ in groups:
            break
    await sched.aclose()
    records = read_sessions(path).records
    assert len(records) == sched.stats.scheduled and 2 <= len(records) <= 8
    assert any(r.termination == TerminationReason.ABORTED for r in records)
    assert engine.aborted  # in-flight requests were aborted on the engine


async def test_turn_deadlines_follow_measured_engine_speed() -> None:
    timeouts = TimeoutConfig(turn_floor_s=0.3, turn_cap_s=100.0, slack=2.0, min_observations=2)
    session = SessionConfig(sampling=SamplingParams(max_new_tokens=64), timeouts=timeouts)
    sched = SessionScheduler(
        InstantEngine(respond=responder, delay_s=0.01),
        tokenizer=tito(),
        env_factory=AddEnv,
        config=config(session=session, group_size=2),
    )
    groups = await sched.run(["t1", "t2", "t3"])
    assert all(r.termination == TerminationReason.DONE for g in groups for r in g.records)
    deadlines = [t.deadline_s for g in groups for r in g.records for t in r.turns]
    assert deadlines[0] > 1.0  # the prior: 50 tokens/s decode for 64 tokens
    est = sched.router.estimate(0)
    assert est.observations == 12
    assert min(deadlines) < 0.5  # once measured, the instant-ish engine gets tight deadlines (the floor, 0.3)


def test_progress_display_renders_counts_and_is_silent_off_a_terminal(capsys: pytest.CaptureFixture) -> None:
    stats = RunStats(scheduled=3, running=1, finished=2, reward_sum=1.5)
    buf = io.StringIO()
    shown = ProgressDisplay(stats, enabled=True, console=Console(file=buf, width=100))
    shown.start()
    shown.stop()
    text = buf.getvalue()
    assert "running" in text and "finished" in text and "0.750" in text
    quiet = ProgressDisplay(stats)  # stdout is captured by pytest: not a terminal
    assert quiet.enabled is False
    quiet.start()
    quiet.stop()
    assert capsys.readouterr().out == ""
