"""Routing over real HTTP: the real sglang-router in front of embedded-server subprocesses, and the project's
`Router` (session affinity, suspect engines, load-aware deadlines) in front of embedded servers and a black
hole, plus the routing decision as a property and SGLang's `/v1/loads` wire format."""

from __future__ import annotations

import ast
import asyncio
import importlib.util
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from miles.engine import FinishReason, SamplingParams
from miles.engines import SGLangClient, SGLangRouter
from miles.engines.load import EngineLoad, loads_body, parse_loads
from miles.engines.testing import ServerProcess, small_qwen2
from miles.envs import Task
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
from miles.sessions.router import EngineView, choose_engine
from miles.types import TerminationReason
from tests.support.router import StubServer, black_hole, embedded_server
from tests.support.sessions import AddEnv, tito

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=8)
OK_ENDS = {TerminationReason.DONE, TerminationReason.MAX_TURNS}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    small_qwen2(0).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def two_servers(model_dir):
    servers = ServerProcess.start_many(model_dir, 2)
    yield servers
    for s in servers:
        s.kill()


async def rollout(engine, sessions: int, turns: int) -> list[list]:
    async def one(s: int) -> list:
        ctx, results = [1 + s, 2, 3], []
        for _ in range(turns):
            r = await engine.generate(ctx, PARAMS, session_id=f"sess-{s}")
            results.append(r)
            ctx = ctx + r.output_ids + [4, 5]
        return results

    return await asyncio.gather(*(one(s) for s in range(sessions)))


async def test_two_servers_behind_the_real_sglang_router(two_servers, model_dir):
    urls = [s.url for s in two_servers]
    router = await SGLangRouter.launch(urls, startup_timeout_s=60)
    try:
        assert await router.health()
        results = await rollout(router, sessions=6, turns=3)
        for session in results:
            assert all(r.finish_reason is FinishReason.LENGTH and len(r.output_ids) == 8 for r in session)
            # manual policy + routing key: later turns land on the engine holding the session's cache
            assert all(r.cached_tokens > 0 for r in session[1:])
        await router.remove_worker(urls[1])
        assert [w["url"] for w in await router.list_workers()] == [urls[0]]
        assert len((await router.generate([1, 2], PARAMS)).output_ids) == 8
        await router.add_worker(urls[1])
        assert sorted(w["url"] for w in await router.list_workers()) == sorted(urls)
        assert await router.update_weights(path=str(model_dir)) == 1
        assert (await router.generate([1, 2], PARAMS)).weight_version == 1
    finally:
        await router.close()


# ---- the routing decision -------------------------------------------------------------------------------
views_st = st.lists(
    st.builds(
        EngineView, state=st.sampled_from(EngineState), inflight=st.integers(0, 6), limit=st.integers(1, 4)
    ),
    min_size=1,
    max_size=6,
)


@given(views=views_st, data=st.data())
def test_routing_never_picks_a_suspect_engine_and_keeps_affinity(views: list[EngineView], data: Any) -> None:
    n = len(views)
    cache = data.draw(st.none() | st.integers(0, n - 1))
    exclude = data.draw(st.frozensets(st.integers(0, n - 1)))
    start = data.draw(st.integers(0, 10))
    i = choose_engine(views, cache=cache, exclude=exclude, start=start)
    usable = [k for k, v in enumerate(views) if k not in exclude and v.accepts]
    room = [k for k in usable if views[k].has_room]
    if not usable:
        assert i is None
        return
    assert i in usable  # never suspect, never excluded, never a probation engine with its trial running
    assert views[i].state is not EngineState.SUSPECT
    if room:
        assert i in room  # never a full or suspect engine while a healthy one has room
    if cache in usable and (views[cache].has_room or not room):
        assert i == cache  # affinity holds when the cache engine is usable and not overloaded
    if i != cache and room:
        assert views[i].inflight == min(views[k].inflight for k in room)  # least outstanding


# ---- the project's Router over real HTTP -------------------------------------------------------------------
def scheduler(
    engines: list,
    tmp_path: Path,
    *,
    sessions: int,
    max_turns: int,
    max_new_tokens: int = 16,
    timeouts: TimeoutConfig | None = None,
    env: Any = AddEnv,
    group_size: int = 4,
) -> SessionScheduler:
    session = SessionConfig(
        sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0),
        parser="test-always-add",
        max_turns=max_turns,
        timeouts=timeouts or TimeoutConfig(),
        retry=RetryConfig(max_retries=2, base_delay_s=0.01, max_delay_s=0.05),
    )
    return SessionScheduler(
        engines,
        tokenizer=tito(),
        env_factory=env,
        recorder=tmp_path / "sessions.jsonl",
        config=SchedulerConfig(
            session=session,
            group_size=group_size,
            progress=False,
            max_concurrent_sessions=max(sessions, group_size),
        ),
    )


async def run_all(sched: SessionScheduler, tasks: list[Any]) -> list[SessionRecord]:
    groups = await sched.run(tasks)
    await sched.aclose()
    records = [r for g in groups for r in g.records]
    assert (
        len(read_sessions(sched.recorder.path).records) == sched.stats.scheduled == len(records)
    )  # none lost
    return records


class JitterEnv(AddEnv):
    """Each step takes 0-50 ms (drawn from the session's seeded RNG), so sessions come back for their next
    turn in shifting orders: a router that ignored affinity would scatter them."""

    async def react(self, action: Any) -> list:
        await asyncio.sleep(0.05 * float(self.np_random.random()))
        return await super().react(action)


async def test_later_turns_stay_on_the_engine_holding_their_cache(tmp_path) -> None:
    servers = [embedded_server(f"embedded-{i}") for i in range(2)]
    clients = [SGLangClient(handle.url, engine_id=engine.engine_id) for engine, handle in servers]
    try:
        # a generous floor: this test is about where turns go, not about deadlines on a shared 2-core machine
        sched = scheduler(
            clients,
            tmp_path,
            sessions=32,
            max_turns=4,
            timeouts=TimeoutConfig(turn_floor_s=60),
            env=JitterEnv,
        )
        records = await run_all(sched, [f"t{i}" for i in range(8)])
        assert len(records) == 32 and all(r.termination in OK_ENDS for r in records), [
            r.error for r in records
        ]
        later = [(prev, turn) for r in records for prev, turn in zip(r.turns, r.turns[1:], strict=False)]
        assert len(later) == 32 * 3
        on_cache = sum(turn.engine_id == prev.engine_id and turn.cached_tokens > 0 for prev, turn in later)
        assert on_cache / len(later) >= 0.95, f"{on_cache} of {len(later)} later turns stayed on their cache"
        assert {r.turns[0].engine_id for r in records} == {
            "embedded-0",
            "embedded-1",
        }  # both engines got sessions
        stats = sched.router.stats()
        assert stats.affinity >= 0.95 and sum(e.stayed for e in stats.engines) == on_cache
        assert stats.cached_token_ratio > 0.5 and sum(e.suspect_marks for e in stats.engines) == 0
        metrics = stats.to_metrics()
        assert (
            metrics["router_cached_token_ratio"] == stats.cached_token_ratio
            and metrics["router_turns"] == 128
        )
    finally:
        for c in clients:
            await c.close()
        for engine, handle in servers:
            handle.stop()
            await engine.close()


@pytest.mark.slow
async def test_black_hole_engine_is_suspected_and_its_turns_retried_elsewhere(tmp_path) -> None:
    hole = black_hole()
    engine, handle = embedded_server("healthy")
    clients = [SGLangClient(hole.url, engine_id="black-hole"), SGLangClient(handle.url, engine_id="healthy")]
    try:
        sched = scheduler(clients, tmp_path, sessions=16, max_turns=3)  # the default deadlines (5 s floor)
        records = await run_all(sched, [f"t{i}" for i in range(4)])
        assert len(records) == 16
        assert all(r.termination in OK_ENDS for r in records), [(r.termination, r.error) for r in records]
        assert hole.generate_calls > 0
        retried = [t for r in records for t in r.turns if t.attempts]
        assert retried and all(t.engine_id == "healthy" for t in retried)
        assert all(
            a.engine_id == "black-hole" and a.error.type == "TurnTimeout" for t in retried for a in t.attempts
        )
        assert all(
            t.engine_id == "healthy" for r in records for t in r.turns
        )  # no turn was answered by the hole
        hole_stats, healthy_stats = sched.router.stats().engines
        assert hole_stats.suspect_marks >= 1 and healthy_stats.suspect_marks == 0
        assert hole_stats.suspect_marked_at[0] - hole_stats.first_sent_at <= 10.0
        assert healthy_stats.retries == len(retried) and hole_stats.timeouts >= len(retried)
    finally:
        for c in clients:
            await c.close()
        hole.stop()
        handle.stop()
        await engine.close()


LONG_PROMPT = " ".join(f"item {i} costs {i * 7 % 13} coins;" for i in range(110))
PREFILL_S_PER_TOKEN = 0.00045  # a bit faster than the default prior (2000 tokens/s)
DECODE_S_PER_STEP = 0.01


@pytest.mark.slow
async def test_concurrent_first_turns_on_a_loaded_engine_fit_their_deadline_and_a_black_hole_still_times_out(
    tmp_path,
) -> None:
    tasks = [{"task": Task(id=f"long{i}", prompt=LONG_PROMPT, answer="3")} for i in range(8)]
    engine, handle = embedded_server(
        "loaded",
        max_positions=4096,
        prefill_s_per_token=PREFILL_S_PER_TOKEN,
        decode_s_per_step=DECODE_S_PER_STEP,
    )
    client = SGLangClient(handle.url, engine_id="loaded")
    floor = TimeoutConfig().turn_floor_s
    try:
        sched = scheduler([client], tmp_path / "loaded", sessions=8, max_turns=1, group_size=1)
        records = await run_all(sched, tasks)
        turns = [r.turns[0] for r in records]
        assert len(records) == 8 and all(r.termination in OK_ENDS for r in records), [
            r.error for r in records
        ]
        assert all(not t.attempts for t in turns)
        # The 8 prefills queue in one engine: the last turn took longer than the default floor, which would
        # have been its whole deadline without the load term (an idle-engine deadline stays below the floor).
        assert sched.router.estimate(0).observations == 8
        prompt = turns[0].prompt_tokens
        assert prompt > 1400 and TimeoutConfig().slack * (0.05 + prompt / 2000 + 16 / 50) < floor
        assert max(t.generate_s for t in turns) > floor
        assert all(t.deadline_s > t.generate_s for t in turns)
    finally:
        await client.close()
        handle.stop()
        await engine.close()
    hole = black_hole()
    client = SGLangClient(hole.url, engine_id="black-hole")
    try:
        sched = scheduler([client], tmp_path / "hole", sessions=8, max_turns=1, group_size=1)
        records = await run_all(sched, tasks)
        assert [r.termination for r in records] == [TerminationReason.TIMEOUT] * 8
        assert all(r.error.where == "generate" and r.trajectory.num_generated == 0 for r in records)
        # The deadlines grew with the queue, but stayed finite: a few times the expected queue, not the cap.
        assert all(floor < r.turns[0].deadline_s < 60.0 for r in records)
    finally:
        await client.close()
        hole.stop()


# ---- engine load reports -------------------------------------------------------------------------------------
def sglang_load_snapshot_fields() -> set[str]:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).parent / "srt" / "managers" / "load_snapshot.py"
    tree = ast.parse(source.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LoadSnapshot")
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


async def test_sglang_v1_loads_wire_format_and_client() -> None:
    fields = sglang_load_snapshot_fields()
    body = loads_body(EngineLoad(running=3, waiting=2, waiting_tokens=900))
    assert set(body["loads"][0]) <= fields  # every key we serve or read is SGLang's
    two_ranks = {
        "loads": [
            {**body["loads"][0], "dp_rank": 0},
            {
                "dp_rank": 1,
                "num_running_reqs": 4,
                "num_waiting_reqs": 0,
                "num_waiting_uncached_tokens": 0,
                "gen_throughput": 12.5,
            },
        ]
    }
    server = StubServer({"/v1/loads": two_ranks})
    client = SGLangClient(server.url)
    try:
        assert await client.load() == EngineLoad(running=7, waiting=2, waiting_tokens=900)
    finally:
        await client.close()
        server.stop()
    assert parse_loads({"loads": [{"num_running_reqs": 1, "num_waiting_reqs": 1}]}).waiting_tokens is None
    with pytest.raises(Exception, match="not a count"):
        parse_loads({"loads": [{"num_running_reqs": -1}]})


async def test_embedded_engine_reports_its_queue_in_process_and_over_http() -> None:
    engine, handle = embedded_server("queued", prefill_s_per_token=0.002, decode_s_per_step=0.001)
    client = SGLangClient(handle.url)
    try:
        assert await engine.load() == await client.load() == EngineLoad(0, 0)
        calls = [
            asyncio.create_task(engine.generate([1] * 400, SamplingParams(max_new_tokens=2)))
            for _ in range(3)
        ]
        async with asyncio.timeout(30):
            while (seen := await client.load()).requests < 3:  # each prefill takes 0.8 s: all 3 are seen
                await asyncio.sleep(0.01)
        assert seen.waiting >= 2 and seen.waiting_tokens is None
        await asyncio.gather(*calls)
        assert await engine.load() == await client.load() == EngineLoad(0, 0)
    finally:
        await client.close()
        handle.stop()
        await engine.close()
