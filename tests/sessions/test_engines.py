"""Done-when tests of issue 5 against real engines over loopback: embedded-engine servers (one in a
thread, two in killable subprocesses) reached through SGLangClient, running the tiny random model."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from miles.engine import SamplingParams
from miles.engines import EmbeddedEngine, SGLangClient, serve_in_thread
from miles.engines.testing import ServerProcess
from miles.sessions import (
    EngineState,
    RetryConfig,
    SchedulerConfig,
    SessionConfig,
    SessionRecord,
    SessionScheduler,
    TimeoutConfig,
    read_sessions,
)
from miles.sessions.replay import check_tito
from miles.tiny import make_tiny_model
from miles.types import TerminationReason
from tests.support.sessions import AddEnv, ResetFailsEnv, StepFailsEnv, tito

pytestmark = pytest.mark.slow
OK_ENDS = {TerminationReason.DONE, TerminationReason.MAX_TURNS}


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Any]]:
    holder: dict[str, Any] = {}

    def start() -> None:
        try:
            holder["proc"] = ServerProcess("tiny", startup_timeout_s=120)
        except BaseException as exc:
            holder["error"] = exc

    thread = threading.Thread(target=start)
    thread.start()  # the subprocess boots while the in-thread server is built
    engine = EmbeddedEngine(make_tiny_model("0.1m", vocab_size=len(tito().tokenizer)), engine_id="thread-0")
    handle = serve_in_thread(engine)
    thread.join()
    try:
        if "error" in holder:
            raise holder["error"]
        yield {"proc": holder["proc"], "thread": handle}
    finally:
        if "proc" in holder:
            holder["proc"].kill()
        handle.stop()


def scheduler(
    engines: list,
    tmp_path,
    *,
    env=AddEnv,
    parser: str | None = "hermes",
    group_size: int = 2,
    max_new_tokens: int = 24,
    **session_kw: Any,
) -> SessionScheduler:
    session_kw.setdefault("retry", RetryConfig(max_retries=2, base_delay_s=0.01, max_delay_s=0.05))
    session_kw.setdefault("timeouts", TimeoutConfig(turn_floor_s=60))  # a shared 2-core machine is slow
    session = SessionConfig(
        sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0), parser=parser, **session_kw
    )
    return SessionScheduler(
        engines,
        tokenizer=tito(),
        env_factory=env,
        recorder=tmp_path / "sessions.jsonl",
        config=SchedulerConfig(session=session, group_size=group_size, progress=False),
    )


def assert_consistent(rec: SessionRecord) -> None:
    rec.trajectory.check()
    outputs = [i for t in rec.turns for i in range(t.output_start, t.output_end)]
    assert [i for i, m in enumerate(rec.trajectory.loss_mask) if m] == outputs  # each output once, in place
    tito_check = check_tito(rec, tito())
    assert tito_check.ok, tito_check.message


async def run_all(sched: SessionScheduler, tasks: list[str]) -> list[SessionRecord]:
    groups = await sched.run(tasks)
    await sched.aclose()
    records = [r for g in groups for r in g.records]
    assert len(read_sessions(sched.recorder.path).records) == sched.stats.scheduled == len(records)
    return records


async def test_engine_killed_mid_turn_fails_over_or_ends_as_engine_error(servers, tmp_path) -> None:
    """Two runs share the victim: one has a spare engine and fails over, the other has none."""
    victim = SGLangClient(servers["proc"].url, engine_id="victim", timeout_s=60)
    victim_alone = SGLangClient(servers["proc"].url, engine_id="victim-alone", timeout_s=60)
    survivor = SGLangClient(servers["thread"].url, engine_id="survivor", timeout_s=60)
    # turns long enough that both runs are still decoding on the victim when it dies, however busy the box
    with_spare = scheduler(
        [victim, survivor],
        tmp_path / "spare",
        parser="test-always-add",
        group_size=3,
        max_new_tokens=160,
        max_turns=2,
    )
    alone = scheduler(
        [victim_alone],
        tmp_path / "alone",
        parser="test-always-add",
        group_size=2,
        max_new_tokens=160,
        max_turns=2,
    )

    async def kill_when_busy() -> None:
        routers = [with_spare.router, alone.router]
        async with asyncio.timeout(120):
            while not all(r.stats().engines[0].inflight for r in routers):
                await asyncio.sleep(0.002)
        await asyncio.to_thread(servers["proc"].kill)

    killer = asyncio.create_task(kill_when_busy())
    spare_records, alone_records = await asyncio.gather(
        run_all(with_spare, ["t1", "t2"]), run_all(alone, ["t1", "t2"])
    )
    await killer
    # With a spare: every session resumed on the survivor at the failed turn.
    assert all(r.termination in OK_ENDS for r in spare_records), [r.error for r in spare_records]
    failed_turns = [t for r in spare_records for t in r.turns if t.attempts]
    assert failed_turns and all(a.engine_id == "victim" for t in failed_turns for a in t.attempts)
    assert all(t.engine_id == "survivor" for t in failed_turns)
    assert (
        with_spare.router.states()[0] is EngineState.SUSPECT
        and with_spare.router.stats().engines[0].suspect_marks
    )
    # Without one: the sessions caught on the dead engine end as engine_error once retries run out, naming why.
    ends = {r.termination for r in alone_records}
    assert TerminationReason.ENGINE_ERROR in ends and ends <= OK_ENDS | {TerminationReason.ENGINE_ERROR}
    for r in alone_records:
        if r.termination == TerminationReason.ENGINE_ERROR:
            assert r.reward == 0.0 and "gave up after 3 attempts" in r.error.message
            assert r.error.type == "NoHealthyEngineError" and "victim-alone" in r.error.message
    for r in spare_records + alone_records:
        assert_consistent(r)
    for c in (victim, victim_alone, survivor):
        await c.close()


async def test_hanging_tool_times_out_and_the_episode_goes_on(servers, tmp_path) -> None:
    client = SGLangClient(servers["thread"].url, engine_id="thread")
    sched = scheduler([client], tmp_path, parser="test-always-hang", max_turns=3, max_new_tokens=8)
    records = await run_all(sched, ["t1", "t2"])
    for r in records:
        assert r.termination == TerminationReason.MAX_TURNS
        assert [t.tool_errors for t in r.turns] == [{"timeout": 1}] * 3
        assert all("timed out" in t.observation[0]["content"] for t in r.turns)
        assert_consistent(r)
    await client.close()


async def test_context_filling_up_ends_as_context_full(servers, tmp_path) -> None:
    client = SGLangClient(servers["thread"].url, engine_id="thread")
    sched = scheduler(
        [client],
        tmp_path,
        parser="test-always-add",
        env=lambda: AddEnv(max_turns=100),
        max_turns=100,
        context_length=560,
        max_new_tokens=16,
        group_size=1,
    )
    records = await run_all(sched, ["t1", "t2"])
    for r in records:
        assert r.termination == TerminationReason.CONTEXT_FULL
        assert len(r.turns) >= 2 and len(r.trajectory) + 16 > 560
        assert all(t.prompt_tokens + 16 <= 560 for t in r.turns)
        assert_consistent(r)
    await client.close()


async def test_garbage_model_output_never_breaks_a_session(servers, tmp_path) -> None:
    client = SGLangClient(servers["thread"].url, engine_id="thread")
    # The random model's text, parsed by the real hermes parser: whatever it is, the session ends typed.
    records = await run_all(scheduler([client], tmp_path, max_turns=2, max_new_tokens=16), ["t1", "t2"])
    assert all(r.termination in OK_ENDS for r in records)
    for r in records:
        assert_consistent(r)
    # Its text as tool-call arguments: invalid JSON every turn, reported to the model, episode goes on.
    sched = scheduler(
        [client], tmp_path / "garbage", parser="test-garbage-args", max_turns=2, max_new_tokens=16
    )
    records = await run_all(sched, ["t1", "t2"])
    for r in records:
        assert r.termination == TerminationReason.MAX_TURNS
        assert [t.tool_errors for t in r.turns] == [{"invalid_json": 1}] * 2
        assert_consistent(r)
    await client.close()


async def test_env_raising_in_reset_or_step_is_isolated(servers, tmp_path) -> None:
    client = SGLangClient(servers["thread"].url, engine_id="thread")
    kinds = iter([AddEnv, ResetFailsEnv, StepFailsEnv] * 4)
    sched = scheduler(
        [client],
        tmp_path,
        env=lambda: next(kinds)(),
        parser="test-always-add",
        group_size=3,
        max_turns=2,
        max_new_tokens=16,
    )
    records = await run_all(sched, ["t1"])
    by_env = {r.env_id: r for r in records}
    assert by_env["Add-v0"].termination == TerminationReason.MAX_TURNS
    reset, step = by_env["ResetFails-v0"], by_env["StepFails-v0"]
    assert reset.termination == step.termination == TerminationReason.ENV_ERROR
    assert reset.error.where == "reset" and step.error.where == "step" and step.trajectory.num_generated > 0
    for r in records:
        assert_consistent(r)
    await client.close()
