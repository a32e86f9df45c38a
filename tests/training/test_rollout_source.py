"""The rollout contract: `SessionSource` on a real scheduler and the tiny model's embedded engine, and
`run_step`, the one step body every mode runs (the train loop once per step, a LoRA run once per adapter)."""

from __future__ import annotations

import pytest

from miles.engine import EngineError, SamplingParams
from miles.engines import EmbeddedEngine
from miles.envs import EnvRecipe
from miles.sessions.config import SchedulerConfig, SessionConfig
from miles.sessions.recorder import Recorder, read_sessions
from miles.sessions.scheduler import SessionScheduler
from miles.training.async_rollout import ProcessSource
from miles.training.config import ModelConfig, TrainConfig
from miles.training.data import TaskCursor, load_tasks
from miles.training.evaluate import EvalSet
from miles.training.models import build_policy, build_tito
from miles.training.protocol import RolloutSource, StepRollout
from miles.training.rl_step import run_step
from miles.training.sources import EngineEvaluation, SessionSource

RECIPE = EnvRecipe("Calculator-v0")
TASKS_PER_STEP, GROUP_SIZE = 3, 2


@pytest.fixture
async def source(tmp_path):
    model_cfg = ModelConfig(name="tiny", size="0.1m")
    tito = build_tito(model_cfg)
    engine = EmbeddedEngine(build_policy(model_cfg, tito.tokenizer))
    session = SessionConfig(context_length=512, sampling=SamplingParams(max_new_tokens=16))
    config = SchedulerConfig(group_size=GROUP_SIZE, progress=False, session=session)
    recorder = Recorder(tmp_path / "sessions.jsonl")
    scheduler = SessionScheduler(
        [engine], tokenizer=tito, config=config, recorder=recorder, run_id="train", recipe=RECIPE
    )
    tasks = load_tasks(RECIPE, "train", 32)
    pushed: list[tuple[int, dict]] = []

    async def push(version, weights):
        pushed.append((version, weights()))

    src = SessionSource(
        scheduler,
        tasks=tasks,
        cursor=TaskCursor(len(tasks), seed=0),
        tasks_per_step=TASKS_PER_STEP,
        oversample=0,
        push=push,
        evaluation=EngineEvaluation([engine], tito, config, None, 16),
        recorder=recorder,
    )
    src.pushed = pushed  # type: ignore[attr-defined]
    yield src
    await src.aclose()
    await engine.close()


def test_the_process_source_meets_the_contract():
    process_source = ProcessSource(TrainConfig(), http=False, push=None)  # type: ignore[arg-type]
    assert isinstance(process_source, RolloutSource)
    assert not process_source.checkpoints_when_aborted and process_source.router_stats() is None


async def test_a_session_source_collects_its_step_from_the_cursor_and_records_every_session(source, tmp_path):
    assert isinstance(source, RolloutSource)
    await source.start(0, dict, run_id="train-r5", resume_time=None)
    taken = await source.collect(0)
    assert len(taken.records) == TASKS_PER_STEP * GROUP_SIZE
    assert len({r.group_id for r in taken.records}) == TASKS_PER_STEP
    assert all(r.session_id.startswith("train-r5") for r in taken.records)
    assert source.data_cursor()["position"] == TASKS_PER_STEP
    assert source.router_stats() is not None and source.record_failures == 0
    await source.recorder.flush()
    recorded = read_sessions(tmp_path / "sessions.jsonl").records
    assert sorted(r.session_id for r in recorded) == sorted(r.session_id for r in taken.records)


async def test_a_session_source_publishes_through_its_push_and_evaluates_on_the_engines(source):
    await source.publish(7, lambda: {"w": 1})
    assert source.pushed == [(7, {"w": 1})]
    part = EvalSet("", RECIPE.with_kwargs(split="held_out"), load_tasks(RECIPE, "held_out", 4, distinct=True))
    result = await source.evaluate(part, greedy=True, run_id="eval-x")
    assert result.mode == "greedy" and result.num_tasks == 4


async def test_restore_continues_the_cursor_and_sets_aside_later_sessions(source, tmp_path):
    await source.start(0, dict, run_id="train", resume_time=None)
    await source.collect(0)
    await source.recorder.flush()
    source.restore({"position": 11}, saved_at=0.0)  # everything recorded after the epoch is redone
    assert source.data_cursor()["position"] == 11
    assert read_sessions(tmp_path / "sessions.jsonl").records == []


class ScriptedSource:
    """A `RolloutSource` whose step is given: records what the step body asks of it."""

    checkpoints_when_aborted = True

    def __init__(self, records, *, publish_fails: bool = False) -> None:
        self.records, self.publish_fails = records, publish_fails
        self.calls: list[tuple] = []

    def restore(self, cursor, *, saved_at):
        self.calls.append(("restore",))

    async def start(self, version, weights, *, run_id, resume_time):
        self.calls.append(("start", version))

    async def collect(self, version):
        self.calls.append(("collect", version))
        return StepRollout(list(self.records), {"buffer_groups": 2.0})

    def untrained(self):
        self.calls.append(("untrained",))

    async def publish(self, version, weights):
        self.calls.append(("publish", version, weights()))
        if self.publish_fails:
            raise EngineError("engine e0 is gone", engine_id="e0")

    async def evaluate(self, part, *, greedy, run_id):
        raise AssertionError("not used")

    def data_cursor(self):
        return {}

    def router_stats(self):
        return None

    @property
    def record_failures(self):
        return 0

    async def stop(self):
        pass

    async def aclose(self):
        pass


async def test_the_step_trains_on_what_it_selects_and_publishes_the_next_version(tmp_path):
    src = ScriptedSource(["r1", "r2"])
    learned = []

    async def learn(batch):
        learned.append(batch)
        return {"loss": 0.5, "step": 3}, lambda: {"v": 2}

    done = await run_step(
        src,
        version=4,
        select=lambda records: [_trajectory(), _trajectory()] if records else [],
        learn=learn,
        warn=pytest.fail,
    )
    assert src.calls == [("collect", 4), ("publish", 5, {"v": 2})]
    assert done.published and done.records == ["r1", "r2"] and len(done.trained) == 2
    assert len(learned) == 1 and learned[0].num_sequences == 2
    assert done.metrics["loss"] == 0.5 and "step" not in done.metrics
    assert done.metrics["buffer_groups"] == 2.0
    assert {"rollout_s", "train_s", "sync_s"} <= set(done.metrics)


async def test_a_step_with_nothing_to_train_tells_the_source_and_publishes_nothing():
    src = ScriptedSource(["r1"])

    async def learn(batch):
        raise AssertionError("nothing trains")

    done = await run_step(src, version=1, select=lambda records: [], learn=learn, warn=pytest.fail)
    assert src.calls == [("collect", 1), ("untrained",)]
    assert not done.published and done.trained == [] and "train_s" not in done.metrics


async def test_a_weight_update_that_misses_the_engines_is_a_warning_and_a_counted_failure():
    src = ScriptedSource(["r1"], publish_fails=True)
    warnings: list[str] = []

    async def learn(batch):
        return {}, dict

    done = await run_step(
        src, version=2, select=lambda records: [_trajectory()], learn=learn, warn=warnings.append
    )
    assert not done.published and done.metrics["sync_failed"] == 1.0
    assert len(warnings) == 1 and "keep version 2" in warnings[0] and "e0 is gone" in warnings[0]


def _trajectory():
    from miles.trajectory import Trajectory

    traj = Trajectory()
    traj.append([1, 2, 3], role="prompt", generated=False)
    traj.append([4, 5], role="assistant", generated=True, logprobs=[-0.1, -0.2])
    traj.reward = 1.0
    traj.meta.group_id = "g0"
    return traj
