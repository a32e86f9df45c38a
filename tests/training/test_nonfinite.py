"""One reward must never destroy the model: rewards are finite and within ±1e6 at every entry (the agent
endpoint's refusal is tested with its other routes), a NaN or inf update is skipped and counted, a run whose updates keep coming out non-finite stops with exit 3, and weights
holding a NaN are never synced or checkpointed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import miles.learner.torch_backend as torch_backend
from miles.cli import main
from miles.envs import make, run_episode
from miles.envs.base import HookError
from miles.learner.checkpoint import load_checkpoint
from miles.learner.torch_backend import TorchTrainer, TorchTrainerConfig
from miles.tiny import make_tiny_model
from miles.trajectory import Trajectory, TrajectoryBatch, TrajectoryMeta
from miles.types import MAX_ABS_REWARD, reward_problem

REPO = Path(__file__).resolve().parents[2]
MAIN_JOB = str(REPO / "configs" / "calculator.yaml")


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        (1.0, True),
        (-MAX_ABS_REWARD, True),
        (1e300, False),
        (float("nan"), False),
        (float("-inf"), False),
        (True, False),
        ("1", False),
        (2 * MAX_ABS_REWARD, False),
    ],
)
def test_a_reward_is_a_finite_number_within_the_bound(value, ok):
    assert (reward_problem(value) is None) == ok


def test_an_env_reward_of_1e300_is_a_named_hook_error():
    from miles.envs import ToolEnv, reward

    class Greedy(ToolEnv):
        @reward
        def huge(self) -> float:
            return 1e300

    env = Greedy(tasks=[{"prompt": "hi"}])
    with pytest.raises(HookError, match=r"reward 'huge' returned 1e\+300 is outside \[-1e\+06, 1e\+06\]"):
        run_episode(env, lambda m: __import__("miles.types").types.Message("assistant", "done"))
    assert make("Calculator-v0")  # the built-in envs are untouched


def _batch(reward: float) -> TrajectoryBatch:
    trajs = []
    for i, r in enumerate((reward, 0.0)):
        traj = Trajectory(
            token_ids=[5, 6, 7, 8],
            loss_mask=[0, 1, 1, 1],
            rollout_logprobs=[0.0, -1.0, -1.0, -1.0],
            meta=TrajectoryMeta(group_id="g", sample_index=i),
        )
        traj.reward = r
        trajs.append(traj)
    return TrajectoryBatch.from_trajectories(trajs)


def test_a_nan_update_is_skipped_and_counted_and_leaves_every_weight_as_it_was():
    torch.manual_seed(0)
    trainer = TorchTrainer(make_tiny_model("0.1m"), TorchTrainerConfig(lr=1e-2, max_grad_norm=1.0))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    metrics = trainer.train_step(_batch(float("inf")))  # an inf reward: NaN advantages, loss and gradient
    assert metrics["nonfinite_steps"] == 1.0 and metrics["optimizer_steps"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    assert trainer.step == 1 and trainer.nonfinite_steps == 1
    metrics = trainer.train_step(_batch(1.0))
    assert metrics["nonfinite_steps"] == 0.0 and torch.isfinite(torch.tensor(metrics["grad_norm"]))
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def _short(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--config",
        MAIN_JOB,
        "--output-dir",
        str(tmp_path / "run"),
        "--set",
        "steps=8",
        "--set",
        "rollout.tasks_per_step=2",
        "--set",
        "eval.num_tasks=4",
        "--set",
        "checkpoint.every=1",
        *extra,
    ]


def test_updates_that_keep_coming_out_nan_stop_the_run_with_exit_3(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    real = torch_backend.policy_loss

    def nan_loss(*args, **kwargs):
        out = real(*args, **kwargs)
        out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(torch_backend, "policy_loss", nan_loss)
    assert main(_short(tmp_path)) == 3
    err = capsys.readouterr().err.splitlines()[-1]  # after transformers' loading bar
    assert err.startswith("miles train: the run is broken: the update was NaN or inf in 3 steps in a row")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["nonfinite_steps"] for r in rows if r["kind"] == "train" and "nonfinite_steps" in r][-3:] == [
        1.0
    ] * 3
    ckpt = load_checkpoint(tmp_path / "run" / "checkpoints")
    assert all(bool(torch.isfinite(t).all()) for t in ckpt.model.values())


def test_weights_holding_a_nan_are_never_synced_or_checkpointed(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    real = TorchTrainer.train_step

    def poison(self, batch):
        metrics = real(self, batch)
        if self.step == 2:
            with torch.no_grad():
                next(self.model.parameters()).view(-1)[0] = float("nan")
        return metrics

    monkeypatch.setattr(TorchTrainer, "train_step", poison)
    assert main(_short(tmp_path)) == 3
    err = capsys.readouterr().err
    assert "the weights hold NaN or inf after step 2 (first: " in err and "were not synced" in err
    ckpt = load_checkpoint(tmp_path / "run" / "checkpoints")
    assert ckpt.step == 1 and all(bool(torch.isfinite(t).all()) for t in ckpt.model.values())
    syncs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in syncs if r["kind"] == "sync"] == [0, 1]  # the warm start, step 1; never step 2
