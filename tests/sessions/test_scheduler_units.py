"""Deadlines from measured throughput and engine queues, retry classification and backoff, the router's
engine choice and health states, slots, task specs."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from miles.engine import EngineError, SamplingParams
from miles.sessions import (
    ConfigError,
    EngineState,
    InstantEngine,
    InvalidTaskError,
    NoHealthyEngineError,
    Placement,
    RetryConfig,
    Router,
    SchedulerConfig,
    SessionConfig,
    TaskSpec,
    ThroughputEstimator,
    TimeoutConfig,
    backoff_delay_s,
    is_retryable,
)
from miles.sessions.scheduler import _Slots

PARAMS = SamplingParams(max_new_tokens=4)


def test_deadline_uses_prior_until_measured_then_follows_the_engine() -> None:
    cfg = TimeoutConfig(
        turn_floor_s=0.01,
        turn_cap_s=1000.0,
        slack=2.0,
        prior_prefill_tokens_per_s=1000.0,
        prior_decode_tokens_per_s=10.0,
        prior_overhead_s=0.0,
        min_observations=3,
    )
    est = ThroughputEstimator(cfg)
    assert est.turn_deadline_s(1000, 100) == pytest.approx(2.0 * (1.0 + 10.0))
    # The engine is really 0.2 ms per prompt token, 5 ms per output token, 20 ms per call.
    rng = random.Random(0)
    for _ in range(40):
        p, o = rng.randint(10, 3000), rng.randint(1, 256)
        est.observe(p, o, 0.02 + p * 2e-4 + o * 5e-3)
    e = est.estimate()
    assert e.prefill_s_per_token == pytest.approx(2e-4, rel=0.05)
    assert e.decode_s_per_token == pytest.approx(5e-3, rel=0.05)
    assert e.overhead_s == pytest.approx(0.02, rel=0.2)
    assert e.decode_tokens_per_s == pytest.approx(200, rel=0.05)
    assert est.turn_deadline_s(1000, 100) == pytest.approx(2.0 * (0.02 + 0.2 + 0.5), rel=0.05)
    # A longer prompt and a larger budget give a longer deadline.
    assert est.turn_deadline_s(4000, 100) > est.turn_deadline_s(1000, 100)
    assert est.turn_deadline_s(1000, 400) > est.turn_deadline_s(1000, 100)


def test_deadline_is_clamped_to_floor_and_cap() -> None:
    est = ThroughputEstimator(TimeoutConfig(turn_floor_s=3.0, turn_cap_s=7.0))
    assert est.turn_deadline_s(1, 1) == 3.0
    assert est.turn_deadline_s(10**6, 10**5) == 7.0


def test_throughput_fit_adapts_when_the_engine_slows_down() -> None:
    est = ThroughputEstimator(TimeoutConfig(ema_decay=0.8, min_observations=1, turn_floor_s=0.01))
    for _ in range(30):
        est.observe(100, 100, 0.01 + 100 * 1e-3 + 100 * 1e-4)
    fast = est.turn_deadline_s(100, 100)
    for _ in range(30):
        est.observe(100, 100, 10 * (0.01 + 100 * 1e-3 + 100 * 1e-4))
    assert fast == pytest.approx(3.0 * 0.12, rel=0.05)
    assert est.turn_deadline_s(100, 100) == pytest.approx(3.0 * 1.2, rel=0.05)


def test_retryable_classification() -> None:
    assert is_retryable(EngineError("down"))
    assert not is_retryable(EngineError("prompt too long", retryable=False))
    assert is_retryable(httpx.ConnectError("refused"))
    assert is_retryable(httpx.ReadError("reset"))
    assert is_retryable(ConnectionResetError())
    assert not is_retryable(ValueError("bad output"))
    assert not is_retryable(KeyError("x"))


def test_backoff_grows_exponentially_within_jitter_and_cap() -> None:
    cfg = RetryConfig(base_delay_s=0.1, max_delay_s=1.0, jitter=0.5)
    rng = random.Random(1)
    for attempt, base in [(0, 0.1), (1, 0.2), (2, 0.4), (3, 0.8)]:
        values = [backoff_delay_s(attempt, cfg, rng) for _ in range(200)]
        assert min(values) >= base * 0.5 - 1e-12 and max(values) <= min(1.0, base * 1.5) + 1e-12
        assert max(values) - min(values) > base * 0.5  # jitter really spreads the delays
    assert all(backoff_delay_s(30, cfg, rng) <= 1.0 for _ in range(50))
    assert backoff_delay_s(2, RetryConfig(base_delay_s=0.1, jitter=0.0)) == pytest.approx(0.4)


async def test_router_places_least_loaded_keeps_affinity_and_avoids_suspect_engines() -> None:
    engines = [InstantEngine([[1]], engine_id=f"e{i}") for i in range(3)]
    router = Router(engines, timeouts=TimeoutConfig(), max_inflight_per_engine=2)
    a = await router.acquire("s-a", prompt_tokens=10, max_new_tokens=4)
    b = await router.acquire("s-b", prompt_tokens=10, max_new_tokens=4)
    assert a.index != b.index and a.placement is b.placement is Placement.NEW
    router.succeeded(a, await a.engine.generate([1], PARAMS), 0.01)
    again = await router.acquire("s-a", prompt_tokens=14, max_new_tokens=4)
    assert again.index == a.index and again.placement is Placement.STAYED and again.uncached_tokens == 14 - 11
    router.failed(b, EngineError("connection refused"), suspect=True)
    assert router.states()[b.index] is EngineState.SUSPECT
    placed = [await router.acquire(f"n{k}", prompt_tokens=5, max_new_tokens=4) for k in range(3)]
    assert b.index not in {lease.index for lease in placed}  # no new work for the suspect engine
    router.succeeded(again, await again.engine.generate([1], PARAMS), 0.01)
    for lease in placed:
        router.release(lease)
    # Every engine excluded: a named error, not a silent fallback.
    with pytest.raises(NoHealthyEngineError, match="no healthy engine left"):
        await router.acquire("x", prompt_tokens=5, max_new_tokens=4, exclude={0, 1, 2})
    stats = router.stats(reset=True)
    assert [e.suspect_marks for e in stats.engines] == [int(i == b.index) for i in range(3)]
    assert sum(e.stayed for e in stats.engines) == 1 and sum(e.new_sessions for e in stats.engines) == 1
    assert stats.engines[b.index].failures == 1
    assert sum(e.failures for e in router.stats().engines) == 0  # the window was reset
    await router.aclose()


async def test_router_probes_a_suspect_engine_back_on_probation_when_nothing_else_is_left() -> None:
    engine = InstantEngine([[1]], engine_id="only")
    router = Router(engine, timeouts=TimeoutConfig())
    lease = await router.acquire("s", prompt_tokens=5, max_new_tokens=4)
    router.failed(lease, EngineError("reset by peer"), suspect=True)
    trial = await router.acquire("s", prompt_tokens=5, max_new_tokens=4, avoid={0}, retry=True)
    assert router.states() == [EngineState.PROBATION]  # its health() passed; one call at a time
    second = asyncio.create_task(router.acquire("t", prompt_tokens=5, max_new_tokens=4))
    await asyncio.sleep(0.05)
    assert not second.done()  # waits for the trial to settle the engine
    router.succeeded(trial, await engine.generate([1], PARAMS), 0.01)
    router.release(await asyncio.wait_for(second, 1))
    assert router.states() == [EngineState.HEALTHY] and router.stats().engines[0].retries == 1
    await engine.close()  # dead now: its probe fails and nothing is left
    lease = await router.acquire("s", prompt_tokens=5, max_new_tokens=4)
    router.failed(lease, EngineError("gone"), suspect=True)
    with pytest.raises(NoHealthyEngineError, match="only"):
        await router.acquire("s", prompt_tokens=5, max_new_tokens=4)
    await router.aclose()


async def test_router_limits_inflight_per_engine() -> None:
    router = Router(InstantEngine([[1]]), timeouts=TimeoutConfig(), max_inflight_per_engine=2)
    s1, s2 = [await router.acquire(None, prompt_tokens=3, max_new_tokens=2) for _ in range(2)]
    third = asyncio.create_task(router.acquire(None, prompt_tokens=3, max_new_tokens=2))
    await asyncio.sleep(0.01)
    assert not third.done()
    router.release(s1)
    s3 = await asyncio.wait_for(third, 1)
    router.release(s2)
    router.release(s3)
    router.release(s3)  # handing a lease back twice is harmless
    assert router.stats().engines[0].inflight == 0
    await router.aclose()


async def test_router_rate_limit_spaces_requests() -> None:
    router = Router(InstantEngine([[1]]), timeouts=TimeoutConfig(), requests_per_s=5)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    for _ in range(7):
        router.release(await router.acquire(None, prompt_tokens=3, max_new_tokens=2))
    assert loop.time() - t0 >= 0.9  # 5 in the first second, the 6th waits for the window
    await router.aclose()


def test_turn_deadline_includes_the_queue_and_grows_with_arrivals_behind() -> None:
    cfg = TimeoutConfig(
        turn_floor_s=0.01,
        turn_cap_s=1000.0,
        slack=2.0,
        prior_prefill_tokens_per_s=1000.0,
        prior_decode_tokens_per_s=10.0,
        prior_overhead_s=0.5,
        batch_slowdown=0.1,
    )
    est = ThroughputEstimator(cfg)
    idle = est.deadline(1000, 100)
    assert idle.expected_s == pytest.approx(0.5 + 1.0 + 10.0) and idle.seconds == pytest.approx(23.0)
    loaded = est.deadline(1000, 100, prefill_wait_s=3.0, requests_ahead=4)
    assert loaded.expected_s == pytest.approx(0.5 + 3.0 + 1.0 + 10.0 * (1 + 0.1 * 4))
    loaded.add_arrivals(500)  # prefilled before this call's next decode step, and one more row in the batch
    assert loaded.expected_s == pytest.approx(0.5 + 3.0 + 1.0 + 10.0 * 1.4 + 0.5 + 0.1 * 10.0)
    assert est.turn_deadline_s(1000, 100) == idle.seconds
    capped = ThroughputEstimator(TimeoutConfig(turn_cap_s=30.0)).deadline(10, 10, prefill_wait_s=1e6)
    assert capped.seconds == 30.0


async def test_router_deadline_counts_the_prefill_queued_at_its_engine() -> None:
    cfg = TimeoutConfig(
        turn_floor_s=0.01,
        slack=1.0,
        prior_prefill_tokens_per_s=1000.0,
        prior_decode_tokens_per_s=100.0,
        prior_overhead_s=0.0,
        batch_slowdown=0.0,
    )
    router = Router(InstantEngine([[1]]), timeouts=cfg)
    leases = [await router.acquire(f"s{k}", prompt_tokens=2000, max_new_tokens=10) for k in range(3)]
    first, second, third = (lease.deadline_s for lease in leases)
    # 2 s of prefill per call: each waits for the ones ahead of it (less the moment that passed).
    assert first > 2.0 + 0.1 + 2 * 2.0 - 0.5  # grown by the two arrivals behind it
    assert second == pytest.approx(2.0 + 2.0 + 0.1 + 2.0, abs=0.5)
    assert third == pytest.approx(2 * 2.0 + 2.0 + 0.1, abs=0.5)
    router.succeeded(leases[1], await leases[1].engine.generate([1], PARAMS), 0.01)
    fourth = await router.acquire("s3", prompt_tokens=2000, max_new_tokens=10)
    assert fourth.deadline_s == pytest.approx(2.0 + 2.0 + 0.1, abs=0.5)  # only the third is still queued
    for lease in (leases[0], leases[2], fourth):
        router.release(lease)
    await router.aclose()


async def test_slots_take_whole_groups_in_fifo_order() -> None:
    slots = _Slots(4)
    await slots.acquire(3)
    order: list[str] = []

    async def take(name: str, k: int) -> None:
        await slots.acquire(k)
        order.append(name)

    big = asyncio.create_task(take("big", 4))
    small = asyncio.create_task(take("small", 1))
    await asyncio.sleep(0.01)
    assert order == []  # the small one does not overtake the waiting group
    slots.release(3)
    await asyncio.sleep(0.01)
    assert order == ["big"]
    slots.release(4)
    await asyncio.wait_for(small, 1)
    assert order == ["big", "small"] and slots.free == 3
    await asyncio.gather(big, small)


async def test_cancelled_slot_waiter_does_not_block_others() -> None:
    slots = _Slots(1)
    await slots.acquire(1)
    waiter = asyncio.create_task(slots.acquire(1))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    nxt = asyncio.create_task(slots.acquire(1))
    slots.release(1)
    await asyncio.wait_for(nxt, 1)
    assert slots.free == 0


def test_task_spec_normalisation() -> None:
    from miles.envs import Task

    t = Task(id="t1", prompt="2+2?", answer=4)
    spec = TaskSpec.of(t)
    assert spec.task_id == "t1" and spec.options == {"task": t}
    assert spec.to_record() == {
        "task_id": "t1",
        "seed": None,
        "options": {"task": {"id": "t1", "prompt": "2+2?", "answer": 4, "data": {}}},
    }
    assert TaskSpec.of("t7").options == {"task_id": "t7"}
    assert TaskSpec.of(5).seed == 5
    assert TaskSpec.of({"task_id": "x", "level": 2}).options == {"task_id": "x", "level": 2}
    with pytest.raises(InvalidTaskError):
        TaskSpec.of(3.5)
    with pytest.raises(InvalidTaskError):
        TaskSpec.of(True)


@pytest.mark.parametrize(
    "cfg",
    [
        SchedulerConfig(group_size=0),
        SchedulerConfig(group_mode="random"),
        SchedulerConfig(group_size=8, max_concurrent_sessions=4),
        SchedulerConfig(requests_per_s=0),
        SchedulerConfig(session=SessionConfig(context_length=0)),
        SchedulerConfig(session=SessionConfig(timeouts=TimeoutConfig(turn_floor_s=10, turn_cap_s=1))),
        SchedulerConfig(session=SessionConfig(retry=RetryConfig(jitter=2))),
        SchedulerConfig(session=SessionConfig(retry=RetryConfig(suspect_after_timeouts=0))),
        SchedulerConfig(session=SessionConfig(retry=RetryConfig(probe_timeout_s=0))),
        SchedulerConfig(session=SessionConfig(timeouts=TimeoutConfig(batch_slowdown=1.5))),
    ],
)
def test_bad_config_is_a_named_error(cfg: SchedulerConfig) -> None:
    with pytest.raises(ConfigError):
        cfg.validate()
