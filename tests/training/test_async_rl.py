"""Fully asynchronous RL: token-level weight versions, the staleness bound (admission in the rollout manager,
the filter in the trainer), `max_staleness: 0` reproducing the synchronous loop on the calculator example's config, and a
killed rollout process followed by `--resume`."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.engine import SamplingParams
from miles.engines.embedded import EmbeddedEngine
from miles.engines.testing import exits_within, small_qwen2, spawned_child
from miles.sessions.config import SchedulerConfig, SessionConfig
from miles.sessions.instant import InstantEngine
from miles.sessions.manager import RolloutManager, TaskFeed
from miles.sessions.recorder import read_sessions
from miles.sessions.records import SessionRecord
from miles.sessions.scheduler import SessionScheduler
from miles.sessions.staleness import StalenessBound
from miles.tito.conversation import Conversation
from miles.training.async_rollout import ProcessSource
from miles.training.config import ASYNC_DUAL_CLIP_C, ASYNC_TIS_CAP, load_train_config
from miles.training.metrics_log import read_metrics
from miles.training.rollout_process import Finished
from miles.trajectory import Trajectory, TrajectoryBatch, TurnSpan
from tests.support.sessions import AddEnv, tito

REPO = Path(__file__).resolve().parents[2]


# ---- token-level versions ------------------------------------------------------------------------------
async def test_a_weight_update_between_decode_steps_is_recorded_token_by_token():
    engine = EmbeddedEngine(small_qwen2(0), max_batch_size=4)
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=2000, seed=1)  # long enough for a loaded box
        running = asyncio.create_task(engine.generate([1, 2, 3], params))
        while not engine.stats["decode_tokens"]:
            await asyncio.sleep(0.001)
        await engine.update_weights(state_dict=dict(small_qwen2(1).state_dict()), version=5)
        result = await running
    finally:
        await engine.close()
    versions = result.token_versions
    assert versions is not None and len(versions) == len(result.output_ids) == 2000
    assert versions[0] == 0 and versions[-1] == 5 and versions == sorted(versions)

    conv = Conversation(tito(), [{"role": "user", "content": "hi"}])
    conv.append_generation(
        result.output_ids,
        result.output_logprobs,
        weight_version=result.weight_version,
        finish_reason=result.finish_reason,
        token_versions=versions,
    )
    spans = [s for s in conv.trajectory.spans if s.role == "assistant"]
    assert [s.weight_version for s in spans] == [0, 5] and spans[0].end == spans[1].start
    assert spans[0].end - spans[0].start == versions.count(0)
    assert conv.trajectory.oldest_weight_version == 0


def _traj(*versions: int | None) -> Trajectory:
    ids = list(range(len(versions)))
    return Trajectory(
        token_ids=ids,
        loss_mask=[1] * len(ids),
        rollout_logprobs=[-0.1] * len(ids),
        spans=[TurnSpan("assistant", i, i + 1, v) for i, v in enumerate(versions)],
    )


def test_the_batch_carries_each_samples_oldest_version_and_its_staleness():
    batch = TrajectoryBatch.from_trajectories([_traj(3, 5), _traj(7), _traj(None)])
    assert batch.oldest_versions.tolist() == [3, 7, -1]
    assert batch.staleness(7).tolist() == [4, 0, 0]


# ---- admission in the rollout manager ------------------------------------------------------------------
async def test_the_manager_admits_groups_only_within_the_staleness_bound():
    engine = InstantEngine(
        respond=lambda ids, sid, k: tito().tokenizer.encode("The answer is 3.") + [tito().stop_token_ids[0]]
    )
    sched = SessionScheduler(
        engine,
        tokenizer=tito(),
        env_factory=AddEnv,
        config=SchedulerConfig(
            group_size=2, progress=False, session=SessionConfig(sampling=SamplingParams(max_new_tokens=8))
        ),
    )
    tasks = AddEnv().tasks.take(8)
    manager = RolloutManager(
        sched, TaskFeed(lambda p: tasks[p % 8]), groups_per_version=2, max_staleness=1, first_version=3
    )
    got: list[int] = []

    async def consume() -> None:
        async for _, position in manager.stream():
            got.append(position)

    consumer = asyncio.create_task(consume())

    async def settled(expected: list[int]) -> list[int]:
        """`got` once the expected groups are in and nothing runs, plus a moment for an over-admission."""
        async with asyncio.timeout(120):
            while len(got) < len(expected) or sched.stats.running:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        return sorted(got)

    try:
        assert await settled([0, 1, 2, 3]) == [0, 1, 2, 3]  # (version 3 - 3 + 1 + 1) * 2 groups
        manager.set_version(4)
        assert await settled([0, 1, 2, 3, 4, 5]) == [0, 1, 2, 3, 4, 5]
        manager.replace(2, rerun=True)  # too stale at the trainer: run again, on top of the bound
        assert await settled([0, 1, 2, 2, 3, 4, 5]) == [0, 1, 2, 2, 3, 4, 5]
        manager.replace(4, rerun=False)  # dropped: the next task takes its place
        assert await settled([0, 1, 2, 2, 3, 4, 5, 6]) == [0, 1, 2, 2, 3, 4, 5, 6]
    finally:
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        await sched.aclose()


# ---- the trainer's filter ------------------------------------------------------------------------------
def _record(oldest: int | None) -> SessionRecord:
    rec = SessionRecord(session_id="s", task={}, group_id="g")
    rec.trajectory = _traj(oldest)
    return rec


class _FakeProcess:
    def __init__(self, groups: list[Finished]) -> None:
        self.groups = deque(groups)
        self.requeued: list[int] = []
        self.replaced: list[int] = []
        self.buffered = 0

    async def next_group(self) -> Finished:
        return self.groups.popleft()

    def requeue(self, position: int, *, rerun: bool) -> None:
        self.replaced.append(position)
        if rerun:
            self.requeued.append(position)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=3), min_size=12, max_size=12),
    st.integers(0, 4),
    st.sampled_from(["drop", "regenerate"]),
)
def test_no_group_over_the_bound_is_ever_trained_on(versions, bound, stale):
    trainer_version = 12
    cfg = load_train_config(
        None,
        [
            "rollout.tasks_per_step=2",
            f"async.max_staleness={bound}",
            f"async.stale={stale}",
            "async.enabled=true",
        ],
    )
    versions = [*versions, [trainer_version], [trainer_version]]  # the stream always has two fresh groups
    groups = [
        Finished(records=[_record(v) for v in vs], position=i, engine_idle_s=0.0)
        for i, vs in enumerate(versions)
    ]
    fresh = [g for g in groups if StalenessBound.staleness(g.records, trainer_version) <= bound]
    rollout = ProcessSource(cfg, http=False, push=None)  # type: ignore[arg-type]
    rollout.process = _FakeProcess(groups)  # type: ignore[assignment]
    taken = asyncio.run(rollout.collect(trainer_version))
    assert all(trainer_version - r.trajectory.oldest_weight_version <= bound for r in taken.records)
    assert taken.records == [r for g in fresh[:2] for r in g.records]
    skipped = [g.position for g in groups[: groups.index(fresh[1]) + 1] if g not in fresh]
    assert taken.metrics["stale_groups_dropped"] == len(skipped)
    assert taken.metrics["staleness_max"] <= bound
    assert rollout.process.replaced == skipped  # type: ignore[attr-defined]  # every drop frees its place
    if stale == "regenerate":
        assert rollout.process.requeued == skipped  # type: ignore[attr-defined]
    else:
        assert rollout.data_cursor()["position"] == (groups.index(fresh[1]) + 1)  # trained or dropped


class _SlowSessions(InstantEngine):
    """Answers at once, except to the sessions in `slow`, which take `slow_s` (a long-tail group)."""

    def __init__(self, slow: set[str], slow_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.slow, self.slow_s = slow, slow_s

    async def generate(self, input_ids: list[int], sampling_params: SamplingParams, **kwargs: Any) -> Any:
        if kwargs.get("session_id") in self.slow:
            await asyncio.sleep(self.slow_s)
        return await super().generate(input_ids, sampling_params, **kwargs)


class _InProcessManager:
    """What the rollout process sends, from a `RolloutManager` in this process."""

    def __init__(self, manager: RolloutManager) -> None:
        self.manager, self.stream, self.buffered = manager, manager.stream(), 0

    async def next_group(self) -> Finished:
        group, position = await anext(self.stream)
        return Finished(
            records=group.records,
            position=position,
            engine_idle_s=0.0,
            oldest_running=self.manager.oldest_running,
        )

    def requeue(self, position: int, *, rerun: bool) -> None:
        self.manager.replace(position, rerun=rerun)


async def test_a_long_tail_group_is_trained_late_not_dropped_as_stale():
    reply = tito().tokenizer.encode("The answer is 3.") + [tito().stop_token_ids[0]]
    engine = _SlowSessions({"t-s0", "t-s1"}, 0.5, respond=lambda ids, sid, k: reply, weight_version=1)
    sched = SessionScheduler(
        engine,
        tokenizer=tito(),
        env_factory=AddEnv,
        run_id="t",
        config=SchedulerConfig(
            group_size=2, progress=False, session=SessionConfig(sampling=SamplingParams(max_new_tokens=8))
        ),
    )
    tasks = AddEnv().tasks.take(8)
    manager = RolloutManager(
        sched, TaskFeed(lambda p: tasks[p % 8]), groups_per_version=2, max_staleness=1, first_version=1
    )
    cfg = load_train_config(None, ["rollout.tasks_per_step=2", "async.enabled=true", "async.max_staleness=1"])
    rollout = ProcessSource(cfg, http=False, push=None)  # type: ignore[arg-type]
    rollout.process = _InProcessManager(manager)  # type: ignore[assignment]
    version, trained = 1, []
    try:
        for _ in range(5):
            taken = await rollout.collect(version)
            assert taken.metrics["stale_groups_dropped"] == 0, version
            assert taken.metrics["staleness_max"] <= 1
            # the step's share, plus only the groups that would be over the bound at the next version
            assert len({r.group_id for r in taken.records}) == 2 + taken.metrics["late_groups"]
            trained += [r.session_id for r in taken.records]
            version += 1
            engine._version = version
            manager.set_version(version)
    finally:
        await rollout.process.stream.aclose()  # type: ignore[attr-defined]
        await sched.aclose()
    assert {"t-s0", "t-s1"} <= set(trained)


@pytest.mark.parametrize("inflight", ["pause", "continue"])
async def test_a_weight_update_meets_turns_in_flight_as_async_inflight_says(inflight):
    """`pause` (the default) loads new weights while a turn decodes; `continue` first lets it finish."""
    assert load_train_config(None, ["async.enabled=true"]).asynchronous.inflight == "pause"
    reply = tito().tokenizer.encode("The answer is 3.") + [tito().stop_token_ids[0]]
    engine = _SlowSessions({"t-s0"}, 0.5, respond=lambda ids, sid, k: reply, weight_version=1)
    sched = SessionScheduler(
        engine,
        tokenizer=tito(),
        env_factory=AddEnv,
        run_id="t",
        config=SchedulerConfig(
            group_size=1, progress=False, session=SessionConfig(sampling=SamplingParams(max_new_tokens=8))
        ),
    )
    tasks = AddEnv().tasks.take(1)
    manager = RolloutManager(
        sched, TaskFeed(lambda p: tasks[0]), groups_per_version=1, max_staleness=0, first_version=1
    )
    stream = manager.stream()
    first = asyncio.create_task(anext(stream))
    in_flight_at_load: list[int] = []

    async def load() -> None:
        in_flight_at_load.append(sched.router.inflight)

    try:
        while sched.router.inflight == 0:
            await asyncio.sleep(0.01)
        await manager.update_weights(load, inflight)
        assert in_flight_at_load == ([1] if inflight == "pause" else [0])
        group, _ = await first
        assert [r.termination.value for r in group.records] == ["done"]
    finally:
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await stream.aclose()
        await sched.aclose()


# ---- through `miles train` -----------------------------------------------------------------------------
def _train(
    out: Path, *sets: str, resume: bool = False, config: str = "configs/calculator.yaml", wait: bool = True
) -> subprocess.CompletedProcess[str] | subprocess.Popen[str]:
    args = [
        sys.executable,
        "-m",
        "miles.cli",
        "train",
        "--config",
        str(REPO / config),
        "--output-dir",
        str(out),
        "--set",
        "max_seconds=null",
        "--set",
        "eval.num_tasks=4",
        *(x for s in sets for x in ("--set", s)),
    ]
    if resume:
        args.append("--resume")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not wait:
        return subprocess.Popen(
            args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)


def _rows(out: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]


SMALL = ("steps=3", "rollout.tasks_per_step=4", "rollout.scheduler.group_size=4")


@pytest.mark.slow
def test_max_staleness_0_reproduces_the_synchronous_loop_on_the_calculator_example(tmp_path):
    for mode in ("false", "true"):
        proc = _train(tmp_path / mode, *SMALL, f"async.enabled={mode}", "async.max_staleness=0")
        assert proc.returncode == 0, proc.stderr[-3000:]
    sync, asyn = _rows(tmp_path / "false"), _rows(tmp_path / "true")
    assert len(sync) == len(asyn) == 3
    for a, b in zip(sync, asyn, strict=True):
        for key in ("rollout_reward_mean", "rollout_success_rate", "trained_sessions", "generated_tokens"):
            assert a[key] == b[key], (key, a[key], b[key])
        # Same tokens, trained the same way; the rollout logprobs of two engine processes may differ in the last
        # float bits (batch composition), which the mismatch metrics and the importance weights see. The
        # on-policy loss is a mean of O(1) terms that cancels to ~1e-9, so it gets an absolute tolerance;
        # the gradient norm (O(0.1)) is the sharp check (to 1e-5: the rollout logprobs enter the PPO ratio).
        for key in ("grad_norm", "clip_frac", "entropy", "mismatch_kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-9), (key, a[key], b[key])
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-7)
        assert b["staleness_max"] == 0
    assert any(r["loss"] != 0 for r in sync)  # the runs learned something to compare
    trained = {
        r.session_id: r.trajectory.token_ids
        for r in read_sessions(tmp_path / "false" / "sessions.jsonl").records
    }
    asynced = {
        r.session_id: r.trajectory.token_ids
        for r in read_sessions(tmp_path / "true" / "sessions.jsonl").records
    }
    assert all(asynced[sid] == ids for sid, ids in trained.items())


@pytest.mark.slow
def test_an_async_run_on_an_http_engine_pauses_it_around_each_update(tmp_path):
    """On SGLang a weight update waits for the requests in flight unless generation is paused: with
    `async.inflight: pause` (the default) the trainer's sync calls `/pause_generation` and `/continue_generation`
    around every load, and the server's own pause counter sees each one."""
    import httpx

    from miles.engines.testing import ServerProcess

    server = ServerProcess(REPO / "checkpoints" / "calculator-sft-1m")
    try:
        proc = _train(
            tmp_path / "run",
            *SMALL,
            "async.enabled=true",
            "async.max_staleness=1",
            "engine.kind=sglang",
            f"engine.urls=[{server.url}]",
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
    finally:
        server.kill()
    pauses = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("miles_engine_pauses_total")
    )
    syncs = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "sync"]
    assert len(syncs) >= 2 and pauses == len(syncs), (pauses, len(syncs))


@pytest.mark.slow
def test_an_async_run_takes_the_ratio_against_the_rollout_policy(tmp_path):
    proc = _train(
        tmp_path,
        "steps=6",
        "rollout.tasks_per_step=4",
        "rollout.scheduler.group_size=4",
        "async.enabled=true",
        "async.max_staleness=2",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in _rows(tmp_path) if "approx_kl" in r]
    assert "tis_weight_mean" not in rows[0] and "dual_clip_frac" in rows[0]  # no second weight; dual clip on
    # against the trainer's own weights one optimizer step has ratio 1 (approx_kl exactly 0); against the
    # rollout policy a stale batch's ratio is its importance weight
    stale = [r for r in rows if r["staleness_max"] >= 1]
    assert stale and all(r["approx_kl"] > 1e-6 for r in stale), [
        (r["staleness_max"], r["approx_kl"]) for r in rows
    ]


DEAD_PEER_SCRIPT = """
import os, socket, sys, time
from multiprocessing import resource_sharer
if sys.argv[1] == "quiet":
    from miles.training.rollout_process import _quiet_dead_peer_handshakes
    _quiet_dead_peer_handshakes()
resource_sharer.DupFd(os.open(os.devnull, os.O_RDONLY))  # starts the descriptor-serving thread
peer = socket.socket(socket.AF_UNIX)
peer.connect(resource_sharer._resource_sharer._address)
peer.close()  # a peer that dies in the middle of the handshake
time.sleep(0.5)
try:
    raise ValueError("other errors still reach stderr")
except ValueError:
    sys.excepthook(*sys.exc_info())
"""


@pytest.mark.parametrize("mode", ["quiet", "default"])
def test_a_dead_peer_in_a_descriptor_handshake_prints_no_traceback(mode):
    """Killing the rollout process while the trainer hands it a shared tensor's descriptor made the trainer's
    `multiprocessing.resource_sharer` thread print a traceback beside the one-line error; other errors print."""
    proc = subprocess.run(
        [sys.executable, "-c", DEAD_PEER_SCRIPT, mode], capture_output=True, text=True, timeout=60
    )
    assert "other errors still reach stderr" in proc.stderr
    assert ("resource_sharer.py" in proc.stderr) == (mode == "default"), proc.stderr


@pytest.mark.slow
def test_a_killed_rollout_process_is_a_named_error_and_resume_loses_no_step(tmp_path):
    out = tmp_path / "run"
    sets = (
        "steps=5",
        "rollout.tasks_per_step=2",
        "rollout.scheduler.group_size=4",
        "checkpoint.every=1",
        "async.enabled=true",
        "async.max_staleness=2",
    )
    proc = _train(out, *sets, wait=False)
    try:
        deadline = time.monotonic() + 600
        while not (out / "metrics.jsonl").exists() or len(_rows(out)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        pid = spawned_child(proc.pid)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    # One line names the failure (multiprocessing's resource tracker may add a warning about the semaphore
    # the killed process held, which it then cleans up).
    assert [line for line in err.splitlines() if line.startswith("miles train:")] == [
        "miles train: the rollout process exited with code -9; continue the run with --resume"
    ]
    assert "Traceback" not in err
    done = len(_rows(out))
    assert 2 <= done < 5

    resumed = _train(out, *sets, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [r["step"] for r in _rows(out)]
    assert steps == [0, 1, 2, 3, 4]  # every step once: none lost, none repeated
    records = read_sessions(out / "sessions.jsonl").records
    assert len({r.session_id for r in records}) == len(records)
    dropped = out / "sessions.jsonl.dropped"
    kept = {r.session_id for r in records}
    if dropped.exists():  # sessions redone after the resume: their first tries are kept aside, not lost
        assert not kept & {json.loads(line)["session_id"] for line in dropped.read_text().splitlines()}


@pytest.mark.slow
def test_the_rollout_process_leaves_with_a_trainer_killed_mid_run_while_the_pipe_is_full(tmp_path):
    """The trainer is frozen mid-run (SIGSTOP) while the rollout process keeps finishing groups, so the pipe
    between them fills and the rollout's sender blocks on it; then the trainer is SIGKILLed. The rollout process
    still records what it can and leaves (it holds the pipe's other end itself, so the pipe never breaks)."""
    from miles.training.rollout_process import ORPHAN_EXIT_S

    proc = _train(
        tmp_path / "run",
        "steps=500",
        "rollout.tasks_per_step=8",
        "rollout.scheduler.group_size=8",
        "async.enabled=true",
        "async.max_staleness=8",
        wait=False,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # training, with groups flowing
            if line.startswith("[step 2/"):
                break
        pid = spawned_child(proc.pid)
        assert pid is not None
        proc.send_signal(signal.SIGSTOP)
        time.sleep(5)  # the rollout keeps finishing groups nobody reads: its pipe fills
        proc.kill()  # SIGKILL: no cleanup runs in the trainer
        proc.wait()
        assert exits_within(pid, ORPHAN_EXIT_S + 30), "the rollout process outlived its trainer"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_stale_samples_are_weighed_against_the_rollout_policy_by_default():
    def loss(*sets: str) -> tuple[str | None, float | None, float | None]:
        lc = load_train_config(None, list(sets)).algorithm.loss
        return lc.ratio_to, lc.tis_cap, lc.dual_clip_c

    assert loss("async.enabled=true", "async.max_staleness=2") == ("rollout", None, ASYNC_DUAL_CLIP_C)
    assert loss("async.enabled=true", "async.max_staleness=2", "algorithm.loss.dual_clip_c=5") == (
        "rollout",
        None,
        5,
    )
    assert loss("async.enabled=true", "async.max_staleness=0") == (
        None,
        None,
        None,
    )  # the synchronous loop's loss
    assert loss("async.enabled=false") == (None, None, None)
    assert loss("async.enabled=true", "algorithm.loss.ratio_to=proximal") == ("proximal", ASYNC_TIS_CAP, None)
    assert loss("async.enabled=true", "algorithm.loss.tis_cap=5") == (None, 5.0, None)
    assert loss("async.enabled=true", "algorithm.loss.icepop=[0.5,2.0]") == (None, None, None)


def test_groups_of_a_step_that_trained_nothing_free_their_places():
    cfg = load_train_config(None, ["rollout.tasks_per_step=2", "async.enabled=true", "async.max_staleness=1"])
    groups = [Finished(records=[_record(5)], position=p, engine_idle_s=0.0) for p in (7, 8, 9)]
    rollout = ProcessSource(cfg, http=False, push=None)  # type: ignore[arg-type]
    rollout.process = _FakeProcess(groups)  # type: ignore[assignment]
    asyncio.run(rollout.collect(5))
    assert rollout.process.replaced == []  # type: ignore[attr-defined]
    rollout.untrained()
    assert rollout.process.replaced == [7, 8] and rollout.process.requeued == []  # type: ignore[attr-defined]


@pytest.mark.slow
def test_the_rollout_process_stops_at_once_with_finished_groups_the_trainer_never_read(tmp_path):
    from miles.training.placement import launch_rollout
    from miles.training.rollout_process import RolloutStart

    cfg = load_train_config(
        str(REPO / "configs" / "calculator.yaml"),
        [f"output_dir={tmp_path}", "async.enabled=true", "async.max_staleness=2"],
    )

    async def go() -> tuple[int | None, float, int]:
        process = launch_rollout(cfg, RolloutStart())
        await process.ready()
        process.publish(1, None)  # the engines keep the warm start they loaded
        await process.wait_acked(1)
        deadline = time.monotonic() + 120
        while process.buffered < 2 * cfg.rollout.tasks_per_step and time.monotonic() < deadline:
            await asyncio.sleep(0.2)  # groups pile up unread (more than a pipe holds)
        buffered = process.buffered
        t0 = time.monotonic()
        await process.close(timeout_s=30)
        return process.link.exit_code(), time.monotonic() - t0, buffered

    exitcode, seconds, buffered = asyncio.run(go())
    assert buffered >= 2 * cfg.rollout.tasks_per_step
    assert exitcode == 0 and seconds < 30  # it left on Stop, not on the terminate after the timeout


def _dead_process() -> multiprocessing.process.BaseProcess:
    process = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,))
    process.start()
    process.join()
    return process


class _BrokenInbox:
    """An inbox whose message broke off: the trainer died while handing over a shared tensor's descriptor."""

    def get(self, timeout: float) -> None:
        raise ConnectionResetError("the peer of a descriptor handshake is gone")


class _Outbox:
    def cancel_join_thread(self) -> None:
        pass


def test_a_dead_trainer_stops_the_rollout_process_whatever_its_reader_is_blocked_on():
    from miles.training.rollout_process import Stop, _watch_trainer

    async def go() -> tuple[object, list[str]]:
        messages: asyncio.Queue[object] = asyncio.Queue()
        exits: list[str] = []
        loop = asyncio.get_running_loop()
        args = (None, _Outbox(), loop, messages, _dead_process(), lambda: exits.append("exit"))
        await asyncio.wait_for(asyncio.to_thread(_watch_trainer, *args), 30)
        return await asyncio.wait_for(messages.get(), 5), exits

    msg, exits = asyncio.run(go())
    assert isinstance(msg, Stop) and exits == ["exit"]


def test_a_message_the_dead_trainer_left_half_sent_ends_the_reader_quietly_and_a_live_ones_is_raised():
    from miles.training.rollout_process import _forward

    messages: asyncio.Queue[object] = asyncio.Queue()
    loop = asyncio.new_event_loop()
    try:
        _forward(_BrokenInbox(), _Outbox(), loop, messages, _dead_process())  # returns: nothing to raise
        assert messages.empty()
        live = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
        live.start()
        try:
            with pytest.raises(ConnectionResetError):
                _forward(_BrokenInbox(), _Outbox(), loop, messages, live)
        finally:
            live.kill()
            live.join()
    finally:
        loop.close()
