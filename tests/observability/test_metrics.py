"""Observability: every metric kind changes when its cause happens (sessions through the real scheduler,
engines through the real embedded engine, steps/trainer/sync through the loop's own structures), the GPU
fragmentation math on torch's documented allocator structures, and the `/metrics` server."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from miles.config import ConfigError
from miles.engine import SamplingParams
from miles.engines.embedded import EmbeddedEngine
from miles.engines.metrics import engine_collector
from miles.observability import (
    FAMILIES,
    GpuCollector,
    Metrics,
    ObservabilityConfig,
    RunLabels,
    RunMetrics,
    device_peak_flops,
    gpu_memory,
    largest_free_block,
    process_metrics,
    sample_value,
    serve_metrics,
    start_observability,
)
from miles.sessions import (
    InstantEngine,
    RetryConfig,
    SchedulerConfig,
    SessionConfig,
    SessionRecord,
    SessionScheduler,
    TimeoutConfig,
    TurnRecord,
)
from miles.sessions.metrics import SessionMetrics
from miles.sessions.records import AttemptRecord, ErrorInfo
from miles.sessions.router import EngineState, EngineStats, RouterStats
from miles.tiny import make_tiny_model
from miles.types import TerminationReason
from miles.weight_sync import SyncReport
from tests.support.sessions import AddEnv, FlakyEngine, StuckEnv, call_text, ids, tito

LABELS = RunLabels(run="r1", env="Add-v0", model="tiny", adapter="base")
RUN = {"run": "r1", "model": "tiny", "adapter": "base"}
ENV = {**RUN, "env": "Add-v0"}


def fresh() -> Metrics:
    return Metrics(CollectorRegistry())


def val(m: Metrics, name: str, **labels: str) -> float:
    return sample_value(m, name, labels) or 0.0


# ---- the declarations -------------------------------------------------------------------------------------
def test_family_names_follow_the_conventions():
    names = [f.name for f in FAMILIES]
    assert len(names) == len(set(names))
    for f in FAMILIES:
        assert f.name.startswith("miles_") and f.help
        assert f.name.endswith("_total") == (f.kind == "counter"), f.name
        assert "version" not in f.labels  # the weight version is a gauge, never a label
        assert (f.kind == "histogram") == bool(f.buckets)
        assert list(f.buckets) == sorted(f.buckets)
    # one registry holds every observed family; the collectors add the rest at scrape time
    text = fresh().render().decode()
    for f in FAMILIES:
        assert (f"# TYPE {f.name} " in text) == (f.source not in ("engine", "gpu")), f.name


# ---- sessions through the real scheduler ----------------------------------------------------------------
def responder(input_ids: list[int], session_id: str | None, k: int) -> list[int]:
    i = int(tito().decode(input_ids).split("What is ")[1].split(" ")[0])
    return ids(call_text("add", a=i, b=i + 1)) if k == 0 else ids(str(2 * i + 1))


async def run_sessions(
    engine, m: Metrics, *, env=AddEnv, groups: int = 2, **session_kw
) -> list[SessionRecord]:
    session = SessionConfig(
        sampling=SamplingParams(max_new_tokens=64),
        retry=RetryConfig(max_retries=2, base_delay_s=0.001),
        **session_kw,
    )
    sched = SessionScheduler(
        engine,
        tokenizer=tito(),
        env_factory=env,
        observer=SessionMetrics(LABELS, metrics=m),
        config=SchedulerConfig(session=session, group_size=2),
    )
    try:
        out = await sched.run([f"t{i}" for i in range(groups)])
    finally:
        await sched.aclose()
    return [r for g in out for r in g.records]


async def test_finished_sessions_feed_latency_reward_length_turn_and_tool_families():
    m = fresh()
    records = await run_sessions(InstantEngine(respond=responder), m)
    n = len(records)
    assert n == 4 and all(r.reward == 1.0 for r in records)
    assert val(m, "miles_sessions_total", **ENV, termination="done") == n
    assert val(m, "miles_session_duration_seconds_count", **ENV) == n
    assert val(m, "miles_session_duration_seconds_sum", **ENV) == pytest.approx(
        sum(r.duration_s for r in records)
    )
    assert val(m, "miles_session_turns_sum", **ENV) == 2 * n
    assert val(m, "miles_session_turns_bucket", **ENV, le="1.0") == 0  # every session took 2 turns
    assert val(m, "miles_session_turns_bucket", **ENV, le="2.0") == n
    assert val(m, "miles_session_reward_bucket", **ENV, le="0.9") == 0  # reward 1.0 lands above 0.9
    assert val(m, "miles_session_reward_bucket", **ENV, le="1.0") == n
    assert val(m, "miles_session_reward_component_count", **ENV, component="correct") == n
    generated = sum(r.trajectory.num_generated for r in records)
    assert val(m, "miles_session_generated_tokens_sum", **ENV) == generated
    turn = {**ENV, "engine": "instant-0"}
    assert val(m, "miles_turn_generate_seconds_count", **turn) == 2 * n
    assert val(m, "miles_turn_output_tokens_sum", **turn) == generated
    assert val(m, "miles_turns_total", **turn, finish_reason="stop") == 2 * n
    assert val(m, "miles_turn_prompt_tokens_total", **turn) == sum(
        t.prompt_tokens for r in records for t in r.turns
    )
    assert val(m, "miles_turn_env_seconds_count", **ENV) == 2 * n
    assert val(m, "miles_tool_calls_total", **ENV, tool="add") == n
    # counters with known label values start at 0, so rate() sees their first increase
    assert sample_value(m, "miles_tool_errors_total", {**ENV, "kind": "timeout"}) == 0.0
    assert sample_value(m, "miles_sessions_total", {**ENV, "termination": "engine_error"}) == 0.0
    assert sample_value(m, "miles_turn_retries_total", {**turn, "reason": "timeout"}) == 0.0


async def test_failed_attempts_count_as_retries_by_engine_and_error():
    m = fresh()
    flaky = FlakyEngine(InstantEngine(respond=responder), fail_calls={0, 3})
    records = await run_sessions(flaky, m, groups=1)
    assert all(r.termination is TerminationReason.DONE for r in records)
    assert val(m, "miles_turn_retries_total", **ENV, engine="flaky", reason="error") == 2
    assert val(m, "miles_turns_total", **ENV, engine="flaky", finish_reason="stop") == 4


async def test_timeouts_and_aborts_are_counted_by_termination():
    m = fresh()
    records = await run_sessions(
        InstantEngine(respond=responder), m, env=StuckEnv, groups=1, timeouts=TimeoutConfig(env_step_s=0.05)
    )
    assert {r.termination for r in records} == {TerminationReason.TIMEOUT}
    assert val(m, "miles_sessions_total", **{**ENV, "env": "Stuck-v0"}, termination="timeout") == 2

    slow = InstantEngine(respond=responder, delay_s=30.0)
    session = SessionConfig(sampling=SamplingParams(max_new_tokens=8))
    sched = SessionScheduler(
        slow,
        tokenizer=tito(),
        env_factory=AddEnv,
        observer=SessionMetrics(LABELS, metrics=m),
        config=SchedulerConfig(session=session, group_size=2),
    )
    task = asyncio.ensure_future(sched.run(["t0"]))
    while sched.stats.running < 2:
        await asyncio.sleep(0.01)
    await sched.aclose()  # aborts what runs: both sessions end `aborted`
    with contextlib.suppress(Exception):
        await task
    assert val(m, "miles_sessions_total", **ENV, termination="aborted") == 2


async def test_tool_errors_by_kind_and_unknown_tool_names_stay_bounded():
    m = fresh()

    def bad(input_ids, session_id, k):  # a made-up tool, then garbage arguments, then give up
        texts = [call_text("teleport", to="mars"), "<tool_call>\n{not json\n</tool_call>", "done"]
        return ids(texts[min(k, 2)])

    await run_sessions(InstantEngine(respond=bad), m, groups=1)
    assert val(m, "miles_tool_errors_total", **ENV, kind="unknown_tool") == 2
    assert val(m, "miles_tool_errors_total", **ENV, kind="invalid_json") == 2
    assert val(m, "miles_tool_calls_total", **ENV, tool="unknown") == 4  # "teleport" and the unparsed one
    assert "teleport" not in m.render().decode()


def test_tool_durations_from_env_reported_results():
    m = fresh()
    tools = [{"type": "function", "function": {"name": "add"}}]
    turn = TurnRecord(
        index=0,
        finish_reason="stop",
        engine_id="e0",
        generate_s=0.5,
        queue_s=0.25,
        assistant={"role": "assistant"},
        tool_calls=[{"function": {"name": "add"}}],
        tool_results=[
            {"name": "add", "content": "3", "duration_s": 0.02},
            {"name": "rm -rf", "content": "", "duration_s": 7.0},
        ],
        attempts=[AttemptRecord("e1", "rid", ErrorInfo("generate", "TurnTimeout", "late"), 3.0)],
    )
    SessionMetrics(LABELS, metrics=m).observe(
        SessionRecord(
            session_id="s", env_id="Add-v0", tools=tools, turns=[turn], termination=TerminationReason.DONE
        )
    )
    assert val(m, "miles_tool_duration_seconds_sum", **ENV, tool="add") == pytest.approx(0.02)
    assert val(m, "miles_tool_duration_seconds_sum", **ENV, tool="unknown") == pytest.approx(7.0)
    assert val(m, "miles_turn_queue_seconds_sum", **ENV, engine="e0") == pytest.approx(0.25)
    assert val(m, "miles_turn_retries_total", **ENV, engine="e1", reason="timeout") == 1


def test_router_stats_windows_feed_placements_suspects_and_state():
    m = fresh()
    obs = SessionMetrics(LABELS, metrics=m)

    def stats(state: EngineState, stayed: int, marks: int) -> RouterStats:
        return RouterStats(
            (EngineStats("e0", state, 0, stayed + 1, 10, 5, 1, stayed, 0, 0, 0, 0, marks, (), None),)
        )

    obs.observe_router(stats(EngineState.HEALTHY, 3, 0))
    obs.observe_router(stats(EngineState.SUSPECT, 2, 1))
    eng = {"run": "r1", "model": "tiny", "engine": "e0"}
    assert val(m, "miles_router_turns_total", **eng, placement="stayed") == 5
    assert val(m, "miles_router_turns_total", **eng, placement="new") == 2
    assert val(m, "miles_router_suspect_marks_total", **eng) == 1
    assert val(m, "miles_router_engine_state", **eng, state="suspect") == 1
    assert val(m, "miles_router_engine_state", **eng, state="healthy") == 0


# ---- the embedded engine ---------------------------------------------------------------------------------
async def test_engine_counters_histograms_and_queue_follow_real_generation():
    m = fresh()
    engine = EmbeddedEngine(
        make_tiny_model(vocab_size=len(tito().tokenizer), size="0.1m"),
        max_batch_size=1,
        engine_id="emb-metrics",
        model_path="tiny",
    )
    engine_collector(m).track(engine, run="r1")
    eng = {"run": "r1", "model": "tiny", "engine": "emb-metrics"}
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=256)  # a queue that lasts, to be sampled
        calls = [
            asyncio.ensure_future(engine.generate([1, 2, 3, 4], params, session_id=f"s{i}", ignore_eos=True))
            for i in range(3)
        ]
        seen = set()
        while not all(c.done() for c in calls):  # with one slot, the other two wait in the queue
            seen.add(
                (
                    val(m, "miles_engine_running_requests", **eng),
                    val(m, "miles_engine_waiting_requests", **eng),
                )
            )
            await asyncio.sleep(0.005)
        results = await asyncio.gather(*calls)
        assert (1.0, 2.0) in seen or (1.0, 1.0) in seen
        assert val(m, "miles_engine_waiting_requests", **eng) == 0
        decoded = sum(len(r.output_ids) - 1 for r in results)  # the first token of each comes from prefill
        assert val(m, "miles_engine_decode_tokens_total", **eng) == decoded
        assert val(m, "miles_engine_decode_steps_total", **eng) == decoded  # batch 1: one token per step
        assert val(m, "miles_engine_batch_size_bucket", **eng, le="1.0") == decoded
        assert val(m, "miles_engine_time_to_first_token_seconds_count", **eng) == 3
        assert val(m, "miles_engine_prefill_tokens_total", **eng) == 12
        follow = results[0].output_ids[:5]  # the session's next turn reuses its cached prefix
        await engine.generate([1, 2, 3, 4, *follow], SamplingParams(max_new_tokens=2), session_id="s0")
        assert val(m, "miles_engine_cached_tokens_total", **eng) == 8
        await engine.update_weights(state_dict={}, version=7)
        assert val(m, "miles_engine_weight_version", **eng) == 7
    finally:
        await engine.close()


# ---- steps, trainer, sync --------------------------------------------------------------------------------
def test_step_rows_feed_phases_idle_throughput_mfu_and_trainer_gauges():
    m = fresh()
    run = RunMetrics(LABELS, metrics=m, flops_per_token=6e6, peak_flops=1e12)
    row = {
        "rollout_s": 3.0,
        "train_s": 0.5,
        "sync_s": 0.5,
        "step_s": 4.0,
        "num_tokens": 1000.0,
        "generated_tokens": 600,
        "rollout_zero_std_group_frac": 0.25,
        "mismatch_kl": 0.01,
        "mismatch_kl_max": 0.3,
        "mismatch_abs": 0.05,
        "approx_kl": 0.002,
        "entropy": 1.5,
        "clip_frac": 0.1,
        "grad_norm": 2.0,
        "loss": -0.1,
        "lr": 3e-4,
        "method": "in_process",
    }
    run.observe_step(row)
    assert val(m, "miles_steps_total", **ENV) == 1
    assert val(m, "miles_step_phase_seconds_sum", **ENV, phase="rollout") == 3.0
    assert val(m, "miles_step_phase_seconds_sum", **ENV, phase="sync") == 0.5
    assert val(m, "miles_trainer_idle_ratio", **ENV) == 0.75
    assert val(m, "miles_rollout_idle_ratio", **ENV) == 0.25
    assert val(m, "miles_train_tokens_per_second", **ENV) == 2000.0
    assert val(m, "miles_rollout_tokens_per_second", **ENV) == 200.0
    assert val(m, "miles_mfu_ratio", **ENV) == pytest.approx(6e6 * 2000 / 1e12)
    assert val(m, "miles_train_rollout_kl", **ENV, stat="mean") == 0.01
    assert val(m, "miles_train_rollout_kl", **ENV, stat="max") == 0.3
    for name, value in (
        ("miles_policy_entropy", 1.5),
        ("miles_policy_clip_ratio", 0.1),
        ("miles_grad_norm", 2.0),
        ("miles_policy_approx_kl", 0.002),
        ("miles_rollout_zero_std_group_ratio", 0.25),
    ):
        assert val(m, name, **ENV) == value, name
    run.observe_step(
        {
            **row,
            "trainer_idle_ratio": 0.05,
            "rollout_idle_ratio": 0.1,
            "stale_groups_dropped": 2,
            "late_groups": 4,
            "buffer_groups": 3,
        }
    )  # the async loop's own numbers win
    assert (
        val(m, "miles_trainer_idle_ratio", **ENV) == 0.05 and val(m, "miles_rollout_idle_ratio", **ENV) == 0.1
    )
    assert val(m, "miles_stale_groups_dropped_total", **ENV) == 2
    assert val(m, "miles_late_groups_total", **ENV) == 4
    assert val(m, "miles_rollout_buffer_groups", **ENV) == 3
    run.observe_staleness([0, 1, 4])
    assert val(m, "miles_sample_staleness_count", **ENV) == 3
    assert val(m, "miles_sample_staleness_bucket", **ENV, le="1.0") == 2
    assert "miles_mfu_ratio{" not in fresh_run_without_peak(row)


def fresh_run_without_peak(row) -> str:
    m = fresh()
    RunMetrics(LABELS, metrics=m, flops_per_token=6e6).observe_step(row)
    return m.render().decode()


def test_sync_reports_feed_time_bytes_and_the_version_gauge():
    m = fresh()
    run = RunMetrics(LABELS, metrics=m)
    run.observe_sync(
        SyncReport(version=3, method="disk", seconds=1.5, drain_seconds=0.25, num_bytes=1000, num_engines=2)
    )
    run.observe_sync(
        SyncReport(version=4, method="disk", seconds=0.5, drain_seconds=0.0, num_bytes=1000, num_engines=2)
    )
    assert val(m, "miles_weight_sync_seconds_sum", **RUN, method="disk") == 2.0
    assert val(m, "miles_weight_sync_drain_seconds_sum", **RUN, method="disk") == 0.25
    assert val(m, "miles_weight_sync_bytes_total", **RUN, method="disk") == 2000
    assert val(m, "miles_weight_version", **RUN) == 4


def test_the_trainers_own_metrics_feed_every_trainer_gauge():
    """A real torch train step (with a KL reference) reports every key the mapping reads: a renamed trainer
    metric fails here rather than leaving a dashboard panel empty."""
    import torch

    from miles.learner.config import AlgorithmConfig, TorchTrainerConfig
    from miles.learner.losses import LossConfig
    from miles.learner.metrics import logprob_mismatch
    from miles.learner.torch_backend import TorchTrainer
    from miles.trajectory import Trajectory, TrajectoryBatch, TrajectoryMeta

    g = torch.Generator().manual_seed(0)
    trajs = [
        Trajectory(
            token_ids=torch.randint(0, 64, (8,), generator=g).tolist(),
            loss_mask=[0, 0] + [1] * 6,
            rollout_logprobs=[0.0, 0.0] + (-torch.rand(6, generator=g) * 4).tolist(),
            reward=float(i % 2),
            meta=TrajectoryMeta(group_id=f"g{i // 2}"),
        )
        for i in range(4)
    ]
    trainer = TorchTrainer(
        make_tiny_model("0.1m", vocab_size=64),
        TorchTrainerConfig(lr=1e-3),
        AlgorithmConfig(loss=LossConfig(kl_coef=0.1)),
    )
    metrics = trainer.train_step(TrajectoryBatch.from_trajectories(trajs))
    from miles.observability.run import TRAIN_GAUGES

    assert set(TRAIN_GAUGES) <= set(metrics)
    assert metrics["mismatch_kl_max"] >= metrics["mismatch_kl"] > 0
    m = fresh()
    RunMetrics(LABELS, metrics=m).observe_train(metrics)
    for key, (name, extra) in TRAIN_GAUGES.items():
        labels = dict(ENV, stat=extra[0]) if extra else ENV
        assert val(m, name, **labels) == pytest.approx(metrics[key]), key
    # the max is the largest per-token term, also across micro-batches
    d = torch.tensor([[0.0, -0.1, -2.0, 0.3]])
    mask = torch.tensor([[0, 1, 1, 1]])
    got = logprob_mismatch(d, torch.zeros_like(d), mask)
    assert got["mismatch_kl_max"] == pytest.approx(float(torch.exp(torch.tensor(-2.0)) + 2.0 - 1.0))


def test_device_peaks():
    assert device_peak_flops("NVIDIA H200") == 989e12
    assert device_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert device_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert device_peak_flops("cpu") is None


# ---- GPU memory --------------------------------------------------------------------------------------------
MiB = 1 << 20


def segment(device: int, blocks: list[tuple[int, str]], kind: str = "large") -> dict:
    """A segment as `torch.cuda.memory_snapshot()` lists it (the keys checked against torch 2.11 on an H200)."""
    address, out = 0x7F0000000000 + device * (1 << 36), []
    for size, state in blocks:
        out.append(
            {
                "address": address,
                "size": size,
                "requested_size": size if state != "inactive" else 0,
                "state": state,
                "frames": [],
            }
        )
        address += size
    total = sum(s for s, _ in blocks)
    return {
        "device": device,
        "address": out[0]["address"],
        "total_size": total,
        "stream": 0,
        "frames": [],
        "segment_type": kind,
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "allocated_size": sum(s for s, st in blocks if st == "active_allocated"),
        "active_size": sum(s for s, st in blocks if st != "inactive"),
        "requested_size": 0,
        "blocks": out,
    }


def stats(allocated: int, reserved: int, peak: int, retries: int = 0) -> dict:
    """The keys of `torch.cuda.memory_stats()` that matter here, among the many it returns."""
    return {
        "allocated_bytes.all.current": allocated,
        "allocated_bytes.all.peak": peak,
        "reserved_bytes.all.current": reserved,
        "reserved_bytes.all.peak": reserved,
        "num_alloc_retries": retries,
        "num_ooms": 0,
        "active_bytes.all.current": allocated,
        "inactive_split_bytes.all.current": 0,
    }


def test_fragmentation_from_allocator_structures():
    segs = [
        segment(
            0,
            [
                (20 * MiB, "active_allocated"),
                (2 * MiB, "inactive"),
                (10 * MiB, "active_allocated"),
                (6 * MiB, "inactive"),
            ],
        ),
        segment(0, [(1 * MiB, "inactive"), (1 * MiB, "active_awaiting_free")], kind="small"),
        segment(1, [(64 * MiB, "inactive")]),
    ]
    mem = gpu_memory(0, stats(allocated=30 * MiB, reserved=40 * MiB, peak=35 * MiB, retries=2), segs)
    assert mem.free_reserved == 10 * MiB
    assert mem.largest_free_block == 6 * MiB  # device 1's 64 MiB block is not device 0's
    assert mem.fragmentation_ratio == pytest.approx(1 - 6 / 10)
    assert largest_free_block(segs, 1) == 64 * MiB
    whole = gpu_memory(1, stats(0, 64 * MiB, 0), segs)
    assert whole.fragmentation_ratio == 0.0  # all free memory in one block
    assert gpu_memory(0, stats(0, 0, 0), []).fragmentation_ratio == 0.0


@given(
    st.lists(
        st.tuples(
            st.integers(1, 1 << 30), st.sampled_from(["active_allocated", "inactive", "active_awaiting_free"])
        ),
        min_size=1,
    )
)
def test_fragmentation_ratio_is_a_ratio(blocks):
    seg = segment(0, blocks)
    mem = gpu_memory(0, stats(seg["allocated_size"], seg["total_size"], seg["allocated_size"]), [seg])
    assert 0.0 <= mem.fragmentation_ratio <= 1.0
    assert mem.largest_free_block <= mem.free_reserved + sum(
        s for s, st in blocks if st == "active_awaiting_free"
    )


def test_gpu_collector_exports_only_with_cuda():
    m = fresh()
    segs = [segment(0, [(8 * MiB, "active_allocated"), (8 * MiB, "inactive")])]
    readings = []
    m.registry.register(GpuCollector("r1", reader=lambda: list(readings)))
    assert "miles_gpu" not in m.render().decode()  # no CUDA: nothing exported
    readings.append(gpu_memory(0, stats(8 * MiB, 16 * MiB, 12 * MiB, retries=1), segs))
    dev = {"run": "r1", "device": "0"}
    assert val(m, "miles_gpu_memory_fragmentation_bytes", **dev) == 8 * MiB
    assert val(m, "miles_gpu_memory_largest_free_block_bytes", **dev) == 8 * MiB
    assert val(m, "miles_gpu_memory_peak_allocated_bytes", **dev) == 12 * MiB
    assert val(m, "miles_gpu_alloc_retries_total", **dev) == 1


# ---- the process collector and the server --------------------------------------------------------------------
def test_process_cpu_and_rss_move_with_the_process():
    m = process_metrics()
    cpu0, rss0 = val(m, "process_cpu_seconds_total"), val(m, "process_resident_memory_bytes")
    total = 0
    while val(m, "process_cpu_seconds_total") < cpu0 + 0.05:  # the kernel counts CPU time in ticks
        total += sum(range(100_000))
    block = bytearray(256 * MiB)
    block[::4096] = b"\x01" * len(block[::4096])  # touch every page
    assert val(m, "process_resident_memory_bytes") > rss0 + 128 * MiB
    del block


async def test_metrics_server_serves_the_registry_and_reports_a_busy_port():
    m = fresh()
    RunMetrics(LABELS, metrics=m).observe_step({"step_s": 1.0})
    server = serve_metrics(m, "127.0.0.1", 0)
    try:
        async with httpx.AsyncClient() as http:
            text = (await http.get(server.url)).text
        assert 'miles_steps_total{adapter="base",env="Add-v0",model="tiny",run="r1"} 1.0' in text
        with pytest.raises(ConfigError, match="observability.metrics_port: cannot serve metrics on"):
            serve_metrics(m, "127.0.0.1", server.port)
    finally:
        server.close()


def test_config_errors_name_the_key():
    from miles.config import from_dict

    with pytest.raises(ConfigError, match="observability.metrics_port: 70000 is not a port"):
        from_dict(ObservabilityConfig, {"metrics_port": 70000}, "observability")
    with pytest.raises(ConfigError, match="observability.peak_tflops"):
        from_dict(ObservabilityConfig, {"peak_tflops": 0}, "observability")
    with pytest.raises(ConfigError, match="observability.metrics_linger_s: must be >= 0"):
        from_dict(ObservabilityConfig, {"metrics_linger_s": -1}, "observability")
    assert from_dict(ObservabilityConfig, {"metrics_port": 0}).metrics_port == 0


def test_start_observability_announces_the_port_and_enables_mfu_with_a_peak():
    said = []
    obs = start_observability(
        ObservabilityConfig(metrics_port=0, peak_tflops=1.0),
        LABELS,
        metrics=fresh(),
        num_params=1000,
        echo=said.append,
    )
    try:
        assert said == [f"[metrics] serving http://127.0.0.1:{obs.server.port}/metrics"]
        assert obs.run.peak_flops == 1e12 and obs.run.flops_per_token == 6000.0
    finally:
        obs.close()
    quiet = start_observability(ObservabilityConfig(), LABELS, metrics=fresh(), echo=said.append)
    assert quiet.server is None and len(said) == 1
