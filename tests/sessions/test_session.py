"""Session: the multi-turn loop, its typed endings, deadlines, retries and failover (in-process engines)."""

from __future__ import annotations

import asyncio
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles.engine import SamplingParams
from miles.envs import Task
from miles.sessions import (
    InstantEngine,
    RetryConfig,
    Router,
    Session,
    SessionConfig,
    SessionRecord,
    SessionSpec,
    TaskSpec,
    TimeoutConfig,
    encode_record,
)
from miles.types import TerminationReason
from tests.support.sessions import (
    TASKS,
    AddEnv,
    FlakyEngine,
    ResetFailsEnv,
    StepFailsEnv,
    StuckEnv,
    call_text,
    ids,
    tito,
)

FAST_RETRY = RetryConfig(max_retries=2, base_delay_s=0.001, max_delay_s=0.01)


def solve_script(i: int = 2) -> list[list[int]]:
    return [ids(call_text("add", a=i, b=i + 1)), ids(str(2 * i + 1))]


def cfg(**kw) -> SessionConfig:
    kw.setdefault("retry", FAST_RETRY)
    kw.setdefault("sampling", SamplingParams(max_new_tokens=64))
    return SessionConfig(**kw)


async def run(engines, env=None, *, task="t2", seed=7, config=None, parser=None) -> SessionRecord:
    spec = SessionSpec(session_id="s-1", task=TaskSpec.of(task), group_id="g-1", sample_index=3, seed=seed)
    return await Session(
        spec, env=env or AddEnv(), tokenizer=tito(), engines=engines, config=config or cfg(), parser=parser
    ).run()


def assert_consistent(rec: SessionRecord) -> None:
    """Generated tokens are exactly the recorded turns' outputs, once each; the line encodes and parses."""
    traj = rec.trajectory
    traj.check()
    outputs = [i for t in rec.turns for i in range(t.output_start, t.output_end)]
    assert len(outputs) == len(set(outputs))
    assert [i for i, m in enumerate(traj.loss_mask) if m] == outputs
    assert SessionRecord.from_dict(json.loads(encode_record(rec))).to_dict() == rec.to_dict()


async def test_solved_episode_records_everything() -> None:
    engine = InstantEngine(solve_script(), weight_version=5)
    rec = await run(engine)
    assert rec.termination == TerminationReason.DONE and rec.error is None
    assert rec.reward == 1.0 and rec.reward_components == {"correct": 1.0}
    assert len(rec.turns) == 2 and rec.weight_versions == [5, 5]
    t0, t1 = rec.turns
    assert t0.tool_calls[0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert t0.tool_results == [{"call_id": "call_0", "name": "add", "content": "5"}]
    assert t0.observation[0]["role"] == "tool" and t0.reward == 0.0 and not t0.terminated
    assert t1.text == "5" and t1.terminated and t1.reward == 1.0
    assert t0.engine_id == "instant-0" and t0.finish_reason == "stop" and t0.prompt_tokens > 0
    assert t1.prompt_tokens > t0.output_end  # the observation came in between
    traj = rec.trajectory
    assert traj.termination == TerminationReason.DONE and traj.reward == 1.0
    assert traj.meta.task_id == "t2" and traj.meta.group_id == "g-1" and traj.meta.sample_index == 3
    assert traj.meta.seed == 7 and traj.meta.sampling_params["seed"] == 7
    assert traj.meta.sampling_params["stop_token_ids"] == list(tito().stop_token_ids)
    assert [s.weight_version for s in traj.spans if s.role == "assistant"] == [5, 5]
    assert traj.num_generated == len(solve_script()[0]) + len(solve_script()[1])
    assert [m.role for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
    assert rec.tools and rec.tools[0]["function"]["name"] == "add"
    assert rec.task == {"task_id": "t2", "seed": None, "options": {"task_id": "t2"}}
    assert_consistent(rec)


async def test_env_truncates_at_max_turns() -> None:
    engine = InstantEngine([ids(call_text("add", a=1, b=1))])
    rec = await run(engine)
    assert rec.termination == TerminationReason.MAX_TURNS
    assert len(rec.turns) == AddEnv.max_turns and rec.turns[-1].truncated
    assert rec.reward == 0.0 and rec.reward_components == {"correct": 0.0}
    assert_consistent(rec)


async def test_session_max_turns_overrides_env() -> None:
    rec = await run(InstantEngine([ids(call_text("add", a=1, b=1))]), config=cfg(max_turns=2))
    assert rec.termination == TerminationReason.MAX_TURNS and len(rec.turns) == 2


async def test_context_full_is_checked_before_generating() -> None:
    engine = InstantEngine([ids(call_text("add", a=1, b=1))])
    first = await run(engine, config=cfg(max_turns=10))
    ctx = first.turns[2].prompt_tokens + 64 - 1  # the third turn no longer fits
    rec = await run(
        InstantEngine([ids(call_text("add", a=1, b=1))]), config=cfg(max_turns=10, context_length=ctx)
    )
    assert rec.termination == TerminationReason.CONTEXT_FULL
    assert len(rec.turns) == 2 and "context" in rec.error.message
    assert rec.trajectory.token_ids == first.trajectory.token_ids[: len(rec.trajectory)]
    assert len(rec.trajectory) + 64 > ctx
    # The engine's own context_length is used when the config has none.
    rec2 = await run(
        InstantEngine([ids(call_text("add", a=1, b=1))], context_length=ctx), config=cfg(max_turns=10)
    )
    assert rec2.termination == TerminationReason.CONTEXT_FULL and len(rec2.turns) == 2
    assert_consistent(rec)


async def test_garbage_outputs_are_handled_as_model_mistakes() -> None:
    script = [
        ids("<tool_call>{not json</tool_call>"),
        ids(call_text("nope", x=1)),
        ids(call_text("add", a="two", b=3)),
        ids("<tool_call>"),
        ids("7", stop=False),
    ]
    rec = await run(InstantEngine(script), AddEnv(max_turns=6))
    assert rec.termination == TerminationReason.DONE  # the last, unstopped "7" is a final answer
    errors = [t.tool_errors for t in rec.turns]
    assert errors[0] == {"invalid_json": 1} and errors[1] == {"unknown_tool": 1}
    assert errors[2] == {"schema_violation": 1}
    assert rec.turns[-1].finish_reason == "length"
    assert_consistent(rec)


async def test_out_of_vocabulary_ids_end_as_engine_error() -> None:
    rec = await run(InstantEngine([[10**6, 3]]))
    assert rec.termination == TerminationReason.ENGINE_ERROR and rec.error.where == "generate"
    assert rec.reward == 0.0 and len(rec.trajectory) > 0
    assert_consistent(rec)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    outputs=st.lists(st.lists(st.integers(0, len(tito().tokenizer) - 1), max_size=40), min_size=1, max_size=4)
)
def test_any_token_output_ends_typed_and_consistent(outputs: list[list[int]]) -> None:
    rec = asyncio.run(run(InstantEngine(outputs), config=cfg(max_turns=4)))
    assert rec.termination in (TerminationReason.DONE, TerminationReason.MAX_TURNS)
    assert 1 <= len(rec.turns) <= 4
    assert_consistent(rec)


async def test_env_raising_in_reset_or_step_ends_as_env_error() -> None:
    rec = await run(InstantEngine(solve_script()), ResetFailsEnv())
    assert rec.termination == TerminationReason.ENV_ERROR and rec.error.where == "reset"
    assert "database unavailable" in rec.error.message and rec.turns == [] and rec.reward == 0.0
    rec = await run(InstantEngine(solve_script()), StepFailsEnv())
    assert rec.termination == TerminationReason.ENV_ERROR and rec.error.where == "step"
    assert "crashed" in rec.error.message and rec.reward == 0.0 and rec.reward_components == {}
    assert len(rec.turns) == 1 and rec.turns[0].output_end > rec.turns[0].output_start
    assert rec.trajectory.messages[-1].role == "assistant"  # the action that broke the env is kept
    assert_consistent(rec)


async def test_hanging_tools_time_out_and_the_episode_goes_on() -> None:
    script = [ids(call_text("hang")), ids(call_text("hang_sync")), ids("3")]
    rec = await run(InstantEngine(script), task="t1")
    assert rec.termination == TerminationReason.DONE and rec.reward == 1.0
    assert rec.turns[0].tool_errors == {"timeout": 1} and rec.turns[1].tool_errors == {"timeout": 1}


async def test_hanging_env_step_times_out() -> None:
    config = cfg(timeouts=TimeoutConfig(env_step_s=0.2))
    rec = await run(InstantEngine(solve_script()), StuckEnv(), config=config)
    assert rec.termination == TerminationReason.TIMEOUT and rec.error.where == "step"
    assert rec.error.type == "EnvTimeout" and rec.reward == 0.0


async def test_slow_engine_hits_the_turn_deadline_and_is_aborted() -> None:
    engine = InstantEngine(solve_script(), delay_s=30)
    config = cfg(timeouts=TimeoutConfig(turn_floor_s=0.1, turn_cap_s=0.2))
    rec = await run(engine, config=config)
    assert rec.termination == TerminationReason.TIMEOUT and rec.error.type == "TurnTimeout"
    assert engine.aborted == ["s-1-t0-a0"] and rec.turns[0].deadline_s == 0.2
    assert rec.trajectory.num_generated == 0


async def test_session_budget_bounds_the_whole_episode() -> None:
    """Tool calls that would nap for 30 s each: the session ends TIMEOUT at its 0.5 s budget (without it, each
    call would time out as a tool error and the session would go on to `max_turns`)."""
    script = [ids(call_text("nap", seconds=30))]
    config = cfg(max_turns=50, timeouts=TimeoutConfig(session_budget_s=0.5))
    rec = await asyncio.wait_for(run(InstantEngine(script), config=config), 25)
    assert rec.termination == TerminationReason.TIMEOUT, rec.error
    assert rec.error.type in ("EnvTimeout", "SessionBudgetExceeded") and len(rec.turns) < 50


async def test_retry_resumes_at_the_failed_turn_without_duplicating_tokens() -> None:
    clean = await run(InstantEngine(solve_script()))
    flaky = FlakyEngine(InstantEngine(solve_script()), fail_calls={1, 2})
    rec = await run(flaky)
    assert rec.termination == TerminationReason.DONE and rec.reward == 1.0
    assert rec.trajectory.token_ids == clean.trajectory.token_ids
    assert rec.trajectory.loss_mask == clean.trajectory.loss_mask
    assert [len(t.attempts) for t in rec.turns] == [0, 2]
    assert [a.rid for a in rec.turns[1].attempts] == ["s-1-t1-a0", "s-1-t1-a1"]
    assert rec.turns[1].rid == "s-1-t1-a2"
    assert_consistent(rec)


async def test_retries_exhausted_end_as_engine_error() -> None:
    flaky = FlakyEngine(InstantEngine(solve_script()), fail_calls=set(range(1, 100)))
    rec = await run(flaky)
    assert (
        rec.termination == TerminationReason.ENGINE_ERROR and "gave up after 3 attempts" in rec.error.message
    )
    assert len(rec.turns) == 2 and len(rec.turns[1].attempts) == 3 and rec.reward == 0.0
    assert_consistent(rec)


async def test_model_errors_are_not_retried() -> None:
    flaky = FlakyEngine(InstantEngine(solve_script()), fail_calls={0}, retryable=False)
    rec = await run(flaky)
    assert rec.termination == TerminationReason.ENGINE_ERROR and len(rec.turns[0].attempts) == 1
    assert flaky.calls == 1


async def test_failover_to_another_engine() -> None:
    dead = FlakyEngine(InstantEngine(solve_script()), fail_calls=set(range(100)), engine_id="dead")
    alive = FlakyEngine(InstantEngine(solve_script()), fail_calls=set(), engine_id="alive")
    pool = Router([dead, alive], timeouts=TimeoutConfig())
    recs = [await run(pool) for _ in range(3)]
    assert all(r.termination == TerminationReason.DONE for r in recs)
    assert all(t.engine_id == "alive" for r in recs for t in r.turns)
    assert sum(len(t.attempts) for r in recs for t in r.turns) >= 1
    assert dead.calls == 1  # after one failure the shared router keeps the (suspect) dead engine out


async def test_cancelled_session_ends_as_aborted_and_aborts_its_request() -> None:
    engine = InstantEngine(solve_script(), delay_s=30)
    spec = SessionSpec(session_id="s-x", task=TaskSpec.of(Task.from_row(TASKS[0], default_id="x")))
    session = Session(spec, env=AddEnv(), tokenizer=tito(), engines=engine, config=cfg())
    task = asyncio.create_task(session.run())
    await asyncio.sleep(0.05)
    session.request_abort()
    task.cancel()
    rec = await task
    assert rec.termination == TerminationReason.ABORTED and rec.error.message == "aborted by the scheduler"
    assert engine.aborted == ["s-x-t0-a0"]
    assert rec.task["options"]["task"]["id"] == "t0"
    assert_consistent(rec)


async def test_a_tasks_own_sampling_overrides_the_sessions() -> None:
    seen: list[int] = []

    class Recording(InstantEngine):
        async def generate(self, input_ids, sampling_params, **kw):  # type: ignore[override]
            seen.append(sampling_params.max_new_tokens)
            return await super().generate(input_ids, sampling_params, **kw)

    long_task = Task(id="t9", prompt="What is 1 + 2?", answer="3", data={"sampling": {"max_new_tokens": 7}})
    rec = await run(Recording(solve_script(1)), task={"task": long_task})
    assert seen == [7, 7] and rec.sampling_params["max_new_tokens"] == 7

    bad = Task(id="t8", prompt="What is 1 + 2?", answer="3", data={"sampling": {"max_new_tokenz": 7}})
    from miles.sessions import SessionScheduler

    sched = SessionScheduler(InstantEngine(solve_script(1)), tokenizer=tito(), env_factory=AddEnv)
    (group,) = await sched.run([{"task": bad}])
    await sched.aclose()
    assert group.records[0].termination is TerminationReason.ENV_ERROR
    assert "max_new_tokenz" in group.records[0].error.message
