"""Routing over real HTTP: embedded servers as subprocesses, behind the real sglang-router and behind the
in-process router; one server is killed mid-rollout and every session still finishes."""

from __future__ import annotations

import asyncio

import pytest

from miles.engine import EngineError, FinishReason, SamplingParams
from miles.engines import EmbeddedEngine, InProcessRouter, SGLangClient, SGLangRouter
from miles.engines.testing import ServerProcess, small_qwen2

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=8)


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


async def rollout(engine, sessions: int, turns: int, *, on_turn=None) -> list[list]:
    async def one(s: int) -> list:
        ctx, results = [1 + s, 2, 3], []
        for t in range(turns):
            r = await engine.generate(ctx, PARAMS, session_id=f"sess-{s}")
            results.append(r)
            ctx = ctx + r.output_ids + [4, 5]
            if on_turn is not None:
                await on_turn(s, t)
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


async def test_failover_when_a_server_dies_mid_rollout(two_servers):
    servers = two_servers  # runs after the sglang-router test: it kills one of the shared servers
    clients = [SGLangClient(s.url, timeout_s=30) for s in servers]
    router = InProcessRouter(clients, health_interval_s=0.5)
    killed = asyncio.Event()

    async def kill_after_first_turn(session: int, turn: int) -> None:
        if turn == 1 and not killed.is_set():
            killed.set()
            servers[0].kill()

    try:
        results = await rollout(router, sessions=8, turns=4, on_turn=kill_after_first_turn)
        assert killed.is_set()
        assert all(len(session) == 4 for session in results)
        assert all(len(r.output_ids) == 8 for session in results for r in session)
        late = [r for session in results for r in session[2:]]
        assert {r.extra["routed_to"] for r in late} == {clients[1].engine_id}
        assert router.failovers >= 1 or not router.alive[0]
        assert router.alive == [False, True]
    finally:
        await router.close()


async def test_inprocess_router_sticky_and_least_outstanding():
    engines = [EmbeddedEngine(small_qwen2(0), engine_id=f"e{i}") for i in range(2)]
    router = InProcessRouter(engines, health_interval_s=0.2)
    try:
        long = asyncio.create_task(router.generate([1, 2], SamplingParams(max_new_tokens=400), session_id="busy"))
        await asyncio.sleep(0.05)
        assert router.outstanding in ([1, 0], [0, 1]) and router.num_in_flight == 1
        busy = router.outstanding.index(1)
        quick = await router.generate([3, 4], PARAMS, session_id="new")
        assert quick.engine_id == f"e{1 - busy}"  # the idle engine got the new session
        again = await router.generate([3, 4] + quick.output_ids + [5], PARAMS, session_id="new")
        assert again.engine_id == quick.engine_id and again.cached_tokens > 0  # sticky
        assert (await long).engine_id == f"e{busy}"
        await engines[busy].close()
        await asyncio.sleep(0.5)  # the periodic health check notices
        assert router.alive[busy] is False
        moved = await router.generate([1, 2, 3], PARAMS, session_id="busy")
        assert moved.engine_id == f"e{1 - busy}"
        await engines[1 - busy].close()
        with pytest.raises(EngineError):
            await router.generate([1], PARAMS)
    finally:
        await router.close()
