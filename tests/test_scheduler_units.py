"""Deadlines from measured throughput, retry classification and backoff, engine choice, slots, task specs."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from miles.engine import EngineError
from miles.sessions import (
    ConfigError,
    EnginePool,
    InstantEngine,
    InvalidTaskError,
    RetryConfig,
    SchedulerConfig,
    SessionConfig,
    TaskSpec,
    ThroughputEstimator,
    TimeoutConfig,
    backoff_delay_s,
    is_retryable,
)
from miles.sessions.scheduler import _Slots


def test_deadline_uses_prior_until_measured_then_follows_the_engine() -> None:
    cfg = TimeoutConfig(turn_floor_s=0.01, turn_cap_s=1000.0, slack=2.0, prior_prefill_tokens_per_s=1000.0,
                        prior_decode_tokens_per_s=10.0, prior_overhead_s=0.0, min_observations=3)
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


async def test_pool_prefers_least_loaded_and_avoids_failed_engines() -> None:
    engines = [InstantEngine([[1]], engine_id=f"e{i}") for i in range(3)]
    pool = EnginePool(engines, timeouts=TimeoutConfig(), max_inflight_per_engine=2, cooldown_s=60)
    a = await pool.acquire()
    b = await pool.acquire()
    assert a.engine_id != b.engine_id
    c = pool.choose()
    assert c.engine_id not in (a.engine_id, b.engine_id)
    pool.mark_failed(c)
    assert pool.choose().engine_id != c.engine_id
    assert pool.choose(frozenset({a.engine_id})).engine_id == b.engine_id
    # When every engine is excluded or cooling, the pool still answers (retry on what is left).
    pool.mark_failed(a)
    pool.mark_failed(b)
    assert pool.choose().engine_id in {"e0", "e1", "e2"}
    pool.release(a)
    pool.release(b)
    assert all(s.inflight == 0 for s in pool.slots)


async def test_pool_limits_inflight_per_engine() -> None:
    pool = EnginePool(InstantEngine([[1]]), timeouts=TimeoutConfig(), max_inflight_per_engine=2)
    s1, s2 = await pool.acquire(), await pool.acquire()
    third = asyncio.create_task(pool.acquire())
    await asyncio.sleep(0.01)
    assert not third.done()
    pool.release(s1)
    s3 = await asyncio.wait_for(third, 1)
    pool.release(s2)
    pool.release(s3)
    assert pool.slots[0].inflight == 0


async def test_pool_rate_limit_spaces_requests() -> None:
    pool = EnginePool(InstantEngine([[1]]), timeouts=TimeoutConfig(), requests_per_s=5)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    for _ in range(7):
        pool.release(await pool.acquire())
    assert loop.time() - t0 >= 0.9  # 5 in the first second, the 6th waits for the window


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
    assert spec.to_record() == {"task_id": "t1", "seed": None,
                                "options": {"task": {"id": "t1", "prompt": "2+2?", "answer": 4, "data": {}}}}
    assert TaskSpec.of("t7").options == {"task_id": "t7"}
    assert TaskSpec.of(5).seed == 5
    assert TaskSpec.of({"task_id": "x", "level": 2}).options == {"task_id": "x", "level": 2}
    with pytest.raises(InvalidTaskError):
        TaskSpec.of(3.5)
    with pytest.raises(InvalidTaskError):
        TaskSpec.of(True)


@pytest.mark.parametrize("cfg", [
    SchedulerConfig(group_size=0),
    SchedulerConfig(group_mode="random"),
    SchedulerConfig(group_size=8, max_concurrent_sessions=4),
    SchedulerConfig(requests_per_s=0),
    SchedulerConfig(session=SessionConfig(context_length=0)),
    SchedulerConfig(session=SessionConfig(timeouts=TimeoutConfig(turn_floor_s=10, turn_cap_s=1))),
    SchedulerConfig(session=SessionConfig(retry=RetryConfig(jitter=2))),
])
def test_bad_config_is_a_named_error(cfg: SchedulerConfig) -> None:
    with pytest.raises(ConfigError):
        cfg.validate()
