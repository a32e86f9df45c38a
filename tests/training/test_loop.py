"""The train loop end to end on the tiny model: artifacts, recorded sessions, weight versions, `--resume`,
and config errors through the CLI."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from miles.cli import main as cli_main
from miles.config import ConfigError, from_dict
from miles.sessions.recorder import read_sessions
from miles.training.config import TrainConfig, load_train_config
from miles.training.loop import TrainLoop
from miles.training.metrics_log import read_metrics

TASKS_PER_STEP = 2
GROUP_SIZE = 2
PER_STEP = TASKS_PER_STEP * GROUP_SIZE


def tiny_config(output_dir: Path, **top: object) -> TrainConfig:
    data = {
        "seed": 3,
        "output_dir": str(output_dir),
        "steps": 2,
        "env": {"id": "Calculator-v0", "num_train_tasks": 64},
        "model": {"name": "tiny", "size": "0.1m"},
        "rollout": {
            "tasks_per_step": TASKS_PER_STEP,
            "scheduler": {
                "group_size": GROUP_SIZE,
                "progress": False,
                "session": {"sampling": {"temperature": 1.0, "max_new_tokens": 48}},
            },
        },
        "trainer": {"lr": 1e-3},
        "sft": {"enabled": True, "num_demos": 8, "batch_size": 8},
        "eval": {"num_tasks": 2, "max_new_tokens": 48},
    }
    data.update(top)
    return from_dict(TrainConfig, data)


def run(cfg: TrainConfig, *, resume: bool = False):
    return asyncio.run(TrainLoop(cfg, resume=resume, echo=lambda _: None).run())


def train_rows(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]


def task_ids_by_step(out: Path) -> list[list[str]]:
    """Each step's task ids, in recording order (a step's sessions all end before the next step starts)."""
    records = read_sessions(out / "sessions.jsonl").records
    assert len(records) % PER_STEP == 0
    return [
        sorted(r.task["task_id"] for r in records[i : i + PER_STEP]) for i in range(0, len(records), PER_STEP)
    ]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, object]:
    out = tmp_path_factory.mktemp("runs") / "full"
    summary = run(tiny_config(out, steps=4))
    return out, summary


def test_a_run_writes_every_artifact(uninterrupted):
    out, summary = uninterrupted
    for name in (
        "config.yaml",
        "sessions.jsonl",
        "eval_sessions.jsonl",
        "metrics.jsonl",
        "curves.png",
        "summary.json",
    ):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_00000004"]
    saved = json.loads((out / "summary.json").read_text())
    assert saved["steps_done"] == 4 == summary.steps_done
    assert set(saved["evals"]) == {"start", "final"} and saved["evals"]["final"]["greedy"]["num_tasks"] == 2
    assert load_train_config(str(out / "config.yaml")).steps == 4  # the recorded config loads back
    kinds = {r["kind"] for r in read_metrics(out / "metrics.jsonl")}
    assert {"train", "eval", "sync"} <= kinds
    syncs = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "sync"]
    assert all(r["seconds"] > 0 for r in syncs)


def test_every_session_is_recorded_with_its_weight_version(uninterrupted):
    out, _ = uninterrupted
    result = read_sessions(out / "sessions.jsonl")
    assert result.bad_lines == []
    assert len(result.records) == 4 * PER_STEP
    assert len({r.session_id for r in result.records}) == len(result.records)
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["sessions"] == PER_STEP for r in rows)
    # the routing stats of each step: every turn counted, later turns found their session's cache
    turns = [
        sum(len(r.turns) for r in result.records[i : i + PER_STEP]) for i in range(0, 4 * PER_STEP, PER_STEP)
    ]
    assert [r["router_turns"] for r in rows] == turns
    assert all(0 < r["router_cached_token_ratio"] <= 1 for r in rows if r["router_stayed"] > 0)
    step_versions = []
    for i in range(0, len(result.records), PER_STEP):
        versions = {v for r in result.records[i : i + PER_STEP] for v in r.weight_versions}
        assert versions and None not in versions
        assert all(r.turns for r in result.records[i : i + PER_STEP])
        assert all(
            span.weight_version is not None
            for r in result.records[i : i + PER_STEP]
            for span in r.trajectory.spans
            if span.role == "assistant"
        )
        step_versions.append(versions)
    # drain policy: one version per step, and each step's rollouts use newer weights than the last
    assert all(len(v) == 1 for v in step_versions)
    flat = [next(iter(v)) for v in step_versions]
    assert flat == sorted(flat) and len(set(flat)) == len(flat), flat
    assert flat[0] >= 1  # the SFT warm start was synced before the first rollout
    evals = read_sessions(out / "eval_sessions.jsonl").records
    assert len(evals) == 2 * 2  # start and final, 2 held-out tasks each
    assert len({r.session_id for r in evals}) == len(evals)  # each evaluation has its own ids
    # every record holds everything its env was built with, the loop's split included
    assert {r.recipe.to_record()["kwargs"].get("split") for r in result.records} == {"train"}
    assert {r.recipe.to_record()["kwargs"].get("split") for r in evals} == {"held_out"}


def test_resume_continues_at_the_next_step_with_the_same_data(uninterrupted, tmp_path):
    full, _ = uninterrupted
    out = tmp_path / "resumed"
    first = run(tiny_config(out, steps=2, checkpoint={"every": 1}))
    assert first.steps_done == 2
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_00000001", "step_00000002"]
    second = run(tiny_config(out, steps=4, checkpoint={"every": 1}), resume=True)
    assert second.steps_done == 4
    assert second.evals["start"] == first.evals["start"]  # kept from the first run's metrics, not redone
    assert [r["step"] for r in train_rows(out)] == [0, 1, 2, 3]  # none repeated, none lost
    assert read_sessions(out / "sessions.jsonl").bad_lines == []
    assert task_ids_by_step(out) == task_ids_by_step(full)  # the data cursor continued
    start_evals = [
        r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "eval" and r["stage"] == "start"
    ]
    assert len(start_evals) == 1


def test_resume_without_a_checkpoint_starts_from_scratch(tmp_path):
    out = tmp_path / "fresh"
    summary = run(tiny_config(out, steps=1, sft={"enabled": False}), resume=True)
    assert summary.steps_done == 1 and [r["step"] for r in train_rows(out)] == [0]
    assert len(read_sessions(out / "sessions.jsonl").records) == PER_STEP
    # killed before its first checkpoint: resuming redoes everything, and the first tries are moved aside
    shutil.rmtree(out / "checkpoints")
    first_try = {r.session_id for r in read_sessions(out / "sessions.jsonl").records}
    summary = run(tiny_config(out, steps=1, sft={"enabled": False}), resume=True)
    assert summary.steps_done == 1 and [r["step"] for r in train_rows(out)] == [0]
    assert len(read_sessions(out / "sessions.jsonl").records) == PER_STEP
    assert {r.session_id for r in read_sessions(out / "sessions.jsonl.dropped").records} == first_try
    assert len([r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "eval"]) == 2  # start, final


def test_a_new_run_into_a_folder_holding_a_run_is_refused_and_touches_nothing(
    uninterrupted, tmp_path, capsys
):
    out, _ = uninterrupted
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".miles.lock"}
    with pytest.raises(ConfigError, match="already holds a run .*continue it with --resume") as err:
        run(tiny_config(out, steps=1))
    assert err.value.key == "output_dir"
    assert {
        p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".miles.lock"
    } == before
    assert cli_main(["train", "--config", str(out / "config.yaml")]) == 2  # through the CLI: one line
    assert capsys.readouterr().err.count("\n") == 1


def test_config_errors_name_the_bad_key(tmp_path, capsys):
    with pytest.raises(ConfigError) as err:
        load_train_config(None, ["trainer.lrr=1"])
    assert err.value.key == "trainer.lrr"
    with pytest.raises(ConfigError, match="env.num_train_tasks"):
        load_train_config(None, ["env.num_train_tasks=0"])
    with pytest.raises(ConfigError, match="rollout.tasks_per_step"):
        load_train_config(None, ["rollout.tasks_per_step=many"])

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"output_dir: {tmp_path / 'never'}\nsteps: 1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "miles.cli", "train", "--config", str(cfg), "--set", "trainer.lrr=1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "trainer.lrr" in proc.stderr and "unknown key" in proc.stderr and "Traceback" not in proc.stderr
    for override, key in (
        ("steps=-1", "steps"),
        ("engine.kind=warp", "engine.kind"),
        ("sft.lr=fast", "sft.lr"),
    ):
        assert cli_main(["train", "--config", str(cfg), "--set", override]) == 2
        assert key in capsys.readouterr().err
    assert cli_main(["sft", "--config", str(cfg), "--set", "sft.bogus=1"]) == 2
    assert "sft.bogus" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


def test_groups_without_reward_spread_are_dropped_and_counted():
    from miles.training.rl_step import split_by_reward_spread
    from miles.trajectory import Trajectory, TrajectoryMeta

    def traj(group: str, reward: float) -> Trajectory:
        return Trajectory(
            token_ids=[1, 2],
            loss_mask=[0, 1],
            rollout_logprobs=[0.0, -0.5],
            reward=reward,
            meta=TrajectoryMeta(group_id=group),
        )

    trajs = [traj("a", 0.0), traj("a", 0.0), traj("b", 1.0), traj("b", 0.0), traj("c", 1.0), traj("c", 1.0)]
    kept, num_groups, flat = split_by_reward_spread(trajs)
    assert (num_groups, flat) == (3, 2)
    assert [t.meta.group_id for t in kept] == ["b", "b"] and [t.reward for t in kept] == [1.0, 0.0]


def test_one_run_at_a_time_writes_a_folder(tmp_path):
    """A second run into a folder another process is writing (here: holds the lock) is one line naming it;
    the lock is released when a run ends, so a resume right after goes ahead."""
    import os

    from miles.training.output_dir import OutputDirLock

    out = tmp_path / "busy"
    held = OutputDirLock(out)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"output_dir: {out}\nsteps: 1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "miles.cli", "train", "--config", str(cfg), "--resume"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"miles train: config error: output_dir: {str(out)!r} is being written by another run (pid {os.getpid()}); "
        "wait for it to end, or give another --output-dir"
    ], proc.stderr
    held.release()
    loop = TrainLoop(tiny_config(out, steps=1, sft={"enabled": False}), resume=True, echo=lambda _: None)
    with pytest.raises(ConfigError, match="is being written by another run"):  # the loop holds it now
        TrainLoop(tiny_config(out, steps=1), resume=True)
    assert asyncio.run(loop.run()).steps_done == 1
    OutputDirLock(out).release()  # free again once the run ended


def test_a_ray_run_into_a_folder_another_ray_run_drives_stops_before_it_starts_anything(tmp_path):
    """On Ray the loop (and its lock) is in an actor; the driver holds a lock of its own from the start, so a
    second run into the folder is one line before it starts Ray or writes `cluster.json`."""
    import os

    from miles.training.output_dir import DRIVER_LOCK_NAME, OutputDirLock

    out = tmp_path / "busy"
    held = OutputDirLock(out, DRIVER_LOCK_NAME)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"output_dir: {out}\nsteps: 1\ncluster: {{kind: ray}}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "miles.cli", "train", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"miles train: config error: output_dir: {str(out)!r} is being written by another run (pid {os.getpid()}); "
        "wait for it to end, or give another --output-dir"
    ], proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [DRIVER_LOCK_NAME]
    held.release()


def test_a_file_system_without_locks_runs_unguarded_with_a_warning(tmp_path, monkeypatch, caplog):
    import errno

    from miles.training import output_dir

    def no_flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(output_dir.fcntl, "flock", no_flock)
    lock = output_dir.OutputDirLock(tmp_path / "nfs")
    assert "a second run into this folder would not be detected" in caplog.text
    lock.release()


# What each way of ending trains, as the docs say: a session that ended on its own terms (done, max_turns, or
# context_full: the policy ran out of room) trains; one the infrastructure ended (engine_error, aborted,
# env_error) never does; a timed-out one trains with reward 0 under `rollout.on_timeout: zero`, else never.
TRAINED_BY_TERMINATION = {
    "done": (True, True),
    "max_turns": (True, True),
    "context_full": (True, True),
    "timeout": (False, True),
    "env_error": (False, False),
    "engine_error": (False, False),
    "aborted": (False, False),
}


@pytest.mark.parametrize("termination", sorted(TRAINED_BY_TERMINATION))
def test_which_sessions_train_follows_how_they_ended(termination):
    from miles.sessions.records import SessionRecord
    from miles.training.rl_step import trainable
    from miles.trajectory import Trajectory
    from miles.types import TerminationReason

    def record(generated: bool) -> SessionRecord:
        traj = Trajectory()
        traj.append([1, 2, 3], role="user", generated=False)
        if generated:
            traj.append([4, 5], role="assistant", generated=True, logprobs=[-0.1, -0.2], weight_version=0)
        return SessionRecord(
            session_id="s", termination=TerminationReason(termination), reward=0.5, trajectory=traj
        )

    drop_timeouts, zero_timeouts = TRAINED_BY_TERMINATION[termination]
    assert bool(trainable([record(True)], on_timeout="drop")) is drop_timeouts
    trained = trainable([record(True)], on_timeout="zero")
    assert bool(trained) is zero_timeouts
    assert [t.reward for t in trained] == ([0.0] if termination == "timeout" else [0.5] if trained else [])
    assert trainable([record(False)], on_timeout="zero") == []  # nothing generated: nothing to train


def test_every_termination_has_a_documented_training_rule():
    from miles.types import TerminationReason

    assert set(TRAINED_BY_TERMINATION) == {t.value for t in TerminationReason}
