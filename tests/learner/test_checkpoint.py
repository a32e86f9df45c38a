"""Checkpoints: atomic layout, RNG round trips, and bit-identical resume of training."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from miles.learner.checkpoint import (
    capture_rng_state,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from miles.learner.errors import CheckpointError
from miles.learner.losses import LossConfig
from miles.learner.torch_backend import AlgorithmConfig, TorchTrainer, TorchTrainerConfig
from miles.tiny import make_tiny_model
from miles.trajectory import Trajectory, TrajectoryBatch, TrajectoryMeta

VOCAB = 64


def random_batch() -> TrajectoryBatch:
    """A batch drawn from the *global* RNGs (python, numpy, torch), so resuming must restore all three."""
    trajs = []
    for i in range(6):
        n = random.randint(4, 10)
        ids = torch.randint(0, VOCAB, (n,)).tolist()
        lps = (-np.random.rand(n - 2) * 3).tolist()
        trajs.append(
            Trajectory(
                token_ids=ids,
                loss_mask=[0, 0] + [1] * (n - 2),
                rollout_logprobs=[0.0, 0.0] + lps,
                reward=float(np.random.rand() > 0.5),
                meta=TrajectoryMeta(group_id=f"g{i // 3}"),
            )
        )
    return TrajectoryBatch.from_trajectories(trajs)


def new_trainer(seed: int = 0) -> TorchTrainer:
    cfg = TorchTrainerConfig(
        lr=5e-3, micro_batch_tokens=20, lr_schedule="cosine", warmup_steps=1, total_steps=6
    )
    alg = AlgorithmConfig(loss=LossConfig(tis_cap=2.0), num_mini_batches=2)
    return TorchTrainer(make_tiny_model("0.1m", vocab_size=VOCAB, seed=seed), cfg, alg)


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    seed_all(7)
    straight = new_trainer()
    want = [straight.train_step(random_batch()) for _ in range(4)]

    seed_all(7)
    first = new_trainer()
    got = [first.train_step(random_batch()) for _ in range(2)]
    path = first.save_checkpoint(tmp_path / "ckpt", data_cursor={"epoch": 0, "index": 12})
    del first
    seed_all(999)  # a different process state, and a differently initialised model
    resumed = new_trainer(seed=3)
    ckpt = resumed.load_checkpoint(tmp_path / "ckpt")
    assert ckpt.path == path and ckpt.data_cursor == {"epoch": 0, "index": 12}
    assert resumed.step == 4  # 2 train steps x 2 mini-batches
    got += [resumed.train_step(random_batch()) for _ in range(2)]

    drop = {"step_time_s"}
    for g, w in zip(got, want, strict=True):
        assert {k: v for k, v in g.items() if k not in drop} == {k: v for k, v in w.items() if k not in drop}
    a, b = straight.hf_state_dict(), resumed.hf_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)


def test_layout_latest_pointer_and_pruning(tmp_path):
    model = {"w": torch.arange(6.0).reshape(2, 3)}
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step=step, model_state=model, data_cursor={"i": step}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    assert (tmp_path / "latest").read_text() == "step_00000003"
    assert json.loads((tmp_path / "step_00000003" / "meta.json").read_text())["data_cursor"] == {"i": 3}
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.step == 3 and torch.equal(ckpt.model["w"], model["w"]) and ckpt.optimizer is None
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir() if p.is_dir())


def test_incomplete_checkpoints_are_ignored(tmp_path):
    save_checkpoint(tmp_path, step=5, model_state={"w": torch.ones(2)})
    # what a run killed mid-save leaves behind: a hidden temp dir and a step dir without meta.json
    (tmp_path / ".tmp-step_00000009-abc").mkdir()
    (tmp_path / ".tmp-step_00000009-abc" / "model.safetensors").write_bytes(b"partial")
    (tmp_path / "step_00000008").mkdir()
    (tmp_path / "step_00000008" / "model.safetensors").write_bytes(b"partial")
    (tmp_path / "latest").write_text("step_00000008")
    assert latest_checkpoint(tmp_path).name == "step_00000005"
    assert load_checkpoint(tmp_path).step == 5


def test_saving_the_same_step_twice_replaces_it(tmp_path):
    save_checkpoint(tmp_path, step=1, model_state={"w": torch.zeros(2)})
    save_checkpoint(tmp_path, step=1, model_state={"w": torch.ones(2)})
    assert torch.equal(load_checkpoint(tmp_path / "step_00000001").model["w"], torch.ones(2))


def test_errors_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_checkpoint(tmp_path / "nothing")
    with pytest.raises(CheckpointError, match="JSON"):
        save_checkpoint(tmp_path, step=1, model_state={}, data_cursor={"obj": object()})
    assert list_checkpoints(tmp_path) == []
    save_checkpoint(tmp_path, step=1, model_state={"not.a.param": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="do not fit"):
        new_trainer().load_checkpoint(tmp_path)


def test_rng_state_round_trip():
    seed_all(11)
    state = capture_rng_state()
    want = (random.random(), float(np.random.rand()), float(torch.rand(())), float(np.random.randn()))
    seed_all(12)
    restore_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(())), float(np.random.randn())) == want


@pytest.mark.parametrize(
    "damage", ["flip a byte of the weights", "truncate the optimizer", "garble meta.json"]
)
def test_a_damaged_newest_checkpoint_is_passed_over_for_the_one_before(damage, tmp_path):
    for step in (1, 2):
        save_checkpoint(
            tmp_path,
            step=step,
            model_state={"w": torch.full((64,), float(step))},
            optimizer_state={"state": {}, "param_groups": []},
        )
    newest = tmp_path / "step_00000002"
    if damage.startswith("flip"):
        data = bytearray((newest / "model.safetensors").read_bytes())
        data[-3] ^= 0xFF
        (newest / "model.safetensors").write_bytes(bytes(data))
    elif damage.startswith("truncate"):
        (newest / "optimizer.pt").write_bytes((newest / "optimizer.pt").read_bytes()[:10])
    else:
        (newest / "meta.json").write_text("{not json")
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.step == 1 and torch.equal(ckpt.model["w"], torch.ones(64))
    assert len(ckpt.passed_over) == 1 and ckpt.passed_over[0].startswith("step_00000002")
    with pytest.raises(CheckpointError, match="step_00000002"):
        load_checkpoint(newest)
    (tmp_path / "step_00000001" / "state.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="every checkpoint under .* is damaged"):
        load_checkpoint(tmp_path)


REPO = Path(__file__).resolve().parents[2]


def _calculator_run(out: Path, *sets: str) -> list[str]:
    """`miles train` on the calculator example, a checkpoint per step, small steps and evaluations."""
    return [
        "train",
        "--config",
        str(REPO / "configs" / "calculator.yaml"),
        "--output-dir",
        str(out),
        "--set",
        "rollout.tasks_per_step=2",
        "--set",
        "checkpoint.every=1",
        "--set",
        "checkpoint.keep=5",
        *(x for s in sets for x in ("--set", s)),
    ]


def test_resume_passes_over_a_damaged_checkpoint_and_a_damaged_warm_start_is_one_line(
    tmp_path, capsys, monkeypatch
):
    from miles.cli import main

    repo = REPO
    monkeypatch.chdir(repo)
    args = _calculator_run(tmp_path / "r", "eval.num_tasks=2")
    assert main([*args, "--set", "steps=2"]) == 0
    weights = tmp_path / "r" / "checkpoints" / "step_00000002" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    capsys.readouterr()
    assert main([*args, "--set", "steps=3", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "[resume] passed over a damaged checkpoint: step_00000002: model.safetensors is damaged" in out
    assert "[resume] from step_00000001: step 1" in out and "[step 3/3]" in out
    warm = tmp_path / "warm"
    warm.mkdir()
    for f in (repo / "checkpoints" / "calculator-sft-1m").iterdir():
        (warm / f.name).write_bytes(f.read_bytes()[:-200] if f.suffix == ".safetensors" else f.read_bytes())
    assert (
        main(
            [
                "train",
                "--config",
                str(repo / "configs" / "calculator.yaml"),
                "--output-dir",
                str(tmp_path / "w"),
                "--set",
                f"model.init_from={warm}",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"miles train: config error: model.init_from: cannot load '{warm}': ")


def test_a_resumed_run_keeps_its_budget_and_its_start_evaluation(tmp_path, capsys, monkeypatch):
    """`max_seconds` counts the time a resumed run had spent before (`--extend` starts a new budget), and its
    table still compares held-out success with the start of the run."""
    from miles.cli import main

    monkeypatch.chdir(REPO)
    args = _calculator_run(tmp_path / "r", "eval.num_tasks=4", "max_seconds=600")
    assert main([*args, "--set", "steps=2"]) == 0
    meta = json.loads((tmp_path / "r" / "checkpoints" / "step_00000002" / "meta.json").read_text())
    assert meta["extra"]["elapsed_s"] > 0
    capsys.readouterr()
    assert main([*args, "--set", "steps=3", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "[resume] from step_00000002: step 2; " in out and " s of max_seconds (600 s) spent" in out
    assert "after SFT" in out and "after RL" in out and "RL gain (greedy)" in out
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert set(summary["evals"]) == {"start", "final"}
    later = json.loads((tmp_path / "r" / "checkpoints" / "step_00000003" / "meta.json").read_text())
    assert later["extra"]["elapsed_s"] > meta["extra"]["elapsed_s"]  # the budget's clock went on from there
    assert main([*args, "--set", "steps=4", "--resume", "--extend"]) == 0
    out = capsys.readouterr().out
    assert "[resume] from step_00000003: step 3\n" in out
