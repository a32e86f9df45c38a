"""Every trainer layout from `miles train`: the `Trainer` protocol on both backends (and rank 0's collective
handle), weight exports that are snapshots, FSDP2 ranks for the torch backend, Megatron knobs from YAML,
SFT's own lr and the KL reference on both backends, and the trainer-side setup errors.

The CLI runs use the 0.1M-parameter tiny model on Calculator-v0 (2 steps of 2 groups x 4 sessions). Its
rewards are all 0, so the entropy bonus and the KL term are what move the weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from miles.config import ConfigError
from miles.learner.config import AlgorithmConfig
from miles.learner.losses import LossConfig
from miles.learner.protocol import Trainer
from miles.trajectory import Trajectory, TrajectoryBatch, TrajectoryMeta

CONFIG = {
    "seed": 0,
    "steps": 2,
    "env": {"id": "Calculator-v0", "num_train_tasks": 64},
    "model": {"name": "tiny", "size": "0.1m"},
    "rollout": {
        "tasks_per_step": 2,
        "scheduler": {"group_size": 4, "session": {"sampling": {"temperature": 1.0, "max_new_tokens": 24}}},
    },
    "algorithm": {"loss": {"entropy_coef": 0.01, "kl_coef": 0.1}},
    "trainer": {"lr": 1e-3, "micro_batch_tokens": 256},
    "eval": {"num_tasks": 2, "max_new_tokens": 24},
}


def write_config(directory: Path, **sections: object) -> Path:
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump({**CONFIG, **sections}))
    return path


def miles_train(config: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        full_env.pop(key, None)
    return subprocess.run(
        [sys.executable, "-m", "miles.cli", "train", "--config", str(config), *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=420,
    )


def rows(run_dir: Path, kind: str) -> list[dict]:
    return [
        r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind
    ]


def tiny_hf(seed: int = 0):
    from miles.tiny import make_tiny_model

    return make_tiny_model("0.1m", vocab_size=100, seed=seed)


def batch() -> TrajectoryBatch:
    g = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(4):
        length, prompt = 8 + 3 * i, 3
        trajs.append(
            Trajectory(
                token_ids=torch.randint(0, 100, (length,), generator=g).tolist(),
                loss_mask=[0] * prompt + [1] * (length - prompt),
                rollout_logprobs=[0.0] * prompt + [-1.0] * (length - prompt),
                reward=float(i % 2),
                meta=TrajectoryMeta(group_id=str(i // 2)),
            )
        )
    return TrajectoryBatch.from_trajectories(trajs)


def assert_export_is_a_snapshot(trainer: Trainer, live_params: list[torch.nn.Parameter]) -> None:
    """Mutating the policy after an export (an optimizer step, then an in-place edit) leaves the export as it
    was; a fresh export sees the change."""
    for cpu in (False, True):
        exported = trainer.hf_state_dict(cpu=cpu)
        kept = {k: v.clone() for k, v in exported.items()}
        trainer.sft_step(batch())
        with torch.no_grad():
            for p in live_params:
                p.add_(1.0)
        for name, tensor in exported.items():
            assert torch.equal(tensor, kept[name]), f"{name} changed after the export (cpu={cpu})"
        fresh = trainer.hf_state_dict(cpu=cpu)
        assert all(not torch.equal(fresh[k], kept[k]) for k in kept if k.endswith("q_proj.weight"))


# ------------------------------------------------------------------ the protocol, in-process


def test_torch_trainer_is_a_trainer_and_exports_a_snapshot():
    from miles.learner.torch_backend import TorchTrainer, TorchTrainerConfig

    trainer = TorchTrainer(tiny_hf(), TorchTrainerConfig(lr=1e-2, device="cpu"))
    assert isinstance(trainer, Trainer)
    assert_export_is_a_snapshot(trainer, list(trainer.model.parameters()))


def test_collective_trainer_is_a_trainer():
    from miles.learner.collective import COLLECTIVE_METHODS, CollectiveTrainer
    from miles.learner.torch_backend import TorchTrainer

    assert isinstance(CollectiveTrainer(TorchTrainer(tiny_hf()), channel=None), Trainer)
    methods = {n for n in dir(Trainer) if not n.startswith("_") and callable(getattr(Trainer, n))}
    assert methods == set(COLLECTIVE_METHODS)  # every protocol call reaches the worker ranks


def test_megatron_trainer_is_a_trainer_exports_a_snapshot_and_keeps_a_reference(megatron_process):
    from miles.learner.megatron import MegatronTrainer, MegatronTrainerConfig

    trainer = MegatronTrainer(tiny_hf(), MegatronTrainerConfig(lr=1e-2))
    assert isinstance(trainer, Trainer) and trainer.ref_model is None
    assert_export_is_a_snapshot(trainer, list(trainer.model.parameters()))

    # kl_coef > 0: a frozen copy of the initial policy, re-taken from the policy when RL follows SFT.
    kl = MegatronTrainer(
        tiny_hf(), MegatronTrainerConfig(lr=1e-2), AlgorithmConfig(loss=LossConfig(kl_coef=0.5))
    )
    assert all(not p.requires_grad for p in kl.ref_model.parameters())
    assert kl.train_step(batch())["ref_kl"] == pytest.approx(0.0, abs=1e-7)
    assert kl.train_step(batch())["ref_kl"] > 1e-6
    kl.begin_sft(5e-3)
    assert kl.sft_step(batch())["lr"] == pytest.approx(5e-3)
    first_rl = kl.train_step(batch())
    assert first_rl["lr"] == pytest.approx(1e-2)
    assert first_rl["ref_kl"] == pytest.approx(0.0, abs=1e-7)


def test_megatron_recompute_reruns_layers_in_backward_with_the_same_step(megatron_process):
    """megatron.recompute: full recomputes every layer's forward during backward; the update is unchanged."""
    from miles.learner.megatron import MegatronTrainer, MegatronTrainerConfig

    results = {}
    for recompute in ("none", "full"):
        trainer = MegatronTrainer(tiny_hf(), MegatronTrainerConfig(lr=1e-2, recompute=recompute))
        calls = []
        trainer.model.decoder.layers[0].mlp.register_forward_hook(lambda *_, c=calls: c.append(1))
        metrics = trainer.train_step(batch())
        results[recompute] = (len(calls), metrics["micro_batches"], metrics["loss"], metrics["grad_norm"])
    assert results["none"][0] == results["none"][1] and results["full"][0] == 2 * results["full"][1]
    assert results["full"][2:] == pytest.approx(results["none"][2:], rel=1e-6)


# ------------------------------------------------------------------ setup errors


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["megatron.attention=local"], "megatron.attention"),  # a Megatron knob with the torch backend
        (["backend=megatron", "torch.packing=varlen"], "torch.packing"),
        (["parallel.tp=2"], "parallel.tp"),  # the torch backend has no tensor parallelism
        (["parallel.dp=0"], "parallel.dp"),
        (["backend=megatron", "megatron.recompute=most"], "megatron.recompute"),
        (["backend=megatron", "megatron.vocab_divisible_by=0"], "megatron.vocab_divisible_by"),
        (["trainer.packing=padded"], "trainer.packing"),  # a torch knob lives in torch:, not trainer:
        (["trainer.betas=[0.9, 1.5]"], "trainer.betas"),
    ],
)
def test_trainer_config_errors_name_the_key(overrides, key):
    from miles.training.config import load_train_config

    with pytest.raises(ConfigError) as e:
        load_train_config(None, overrides)
    assert e.value.key == key


def test_model_that_does_not_split_over_tp_or_pp_is_named():
    from miles.training.config import load_train_config
    from miles.training.trainer_setup import check_model_fits

    hf_config = tiny_hf().config
    kv, layers = hf_config.num_key_value_heads, hf_config.num_hidden_layers
    check_model_fits(load_train_config(None, ["backend=megatron", f"parallel.tp={kv}"]), hf_config)
    with pytest.raises(ConfigError) as e:
        check_model_fits(load_train_config(None, ["backend=megatron", f"parallel.tp={kv + 1}"]), hf_config)
    assert e.value.key == "parallel.tp"
    with pytest.raises(ConfigError) as e:
        check_model_fits(
            load_train_config(None, ["backend=megatron", f"parallel.pp={layers + 1}"]), hf_config
        )
    assert e.value.key == "parallel.pp"


def test_several_ranks_need_the_launcher():
    from miles.training.config import load_train_config
    from miles.training.placement import build_trainer

    with pytest.raises(ConfigError, match="miles train") as e:
        build_trainer(load_train_config(None, ["parallel.dp=2"]), tiny_hf())
    assert e.value.key == "parallel"


def test_cli_setup_errors_are_one_line(tmp_path):
    config = write_config(tmp_path)
    proc = miles_train(config, "--set", "megatron.distributed_optimizer=false")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "miles train: config error: megatron.distributed_optimizer: a megatron-backend setting, but backend is "
        "torch: remove it, or set backend: megatron"
    ]

    # Without megatron-core (an empty `megatron` package shadows the installed one).
    (tmp_path / "shadow" / "megatron").mkdir(parents=True)
    (tmp_path / "shadow" / "megatron" / "__init__.py").write_text("")
    proc = miles_train(
        config,
        "--backend",
        "megatron",
        "--output-dir",
        str(tmp_path / "run"),
        env={"PYTHONPATH": str(tmp_path / "shadow")},
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "backend: the megatron backend needs megatron-core" in lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing started


# ------------------------------------------------------------------ the torch backend: --dp 1 vs --dp 2


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory):
    """`miles train` with the torch backend on one process and on two FSDP2 ranks (torchrun, gloo)."""
    base = tmp_path_factory.mktemp("torch_layouts")
    config = write_config(base)
    runs = {}
    for dp in (1, 2):
        out = base / f"dp{dp}"
        proc = miles_train(config, "--dp", str(dp), "--output-dir", str(out))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        (out / "stdout.txt").write_text(proc.stdout)
        runs[dp] = out
    return runs


@pytest.mark.slow
def test_each_run_says_and_records_where_its_ranks_ran(torch_runs):
    for dp, ranks in ((1, "in this process"), (2, "on 2 torchrun ranks")):
        placement = json.loads((torch_runs[dp] / "summary.json").read_text())["placement"]
        assert placement["ranks"] == ranks
        assert (
            placement["rollout"]
            == ("the trainer's process" if dp == 1 else "rank 0's process") + " (synchronous)"
        )
        printed = [
            line for line in (torch_runs[dp] / "stdout.txt").read_text().splitlines() if "[placement]" in line
        ]
        assert printed == [
            f"[placement] trainer: {placement['trainer']} {ranks} · rollout: {placement['rollout']} · "
            f"engines: {placement['engines']}"
        ]


@pytest.mark.slow
def test_torch_dp2_reaches_the_same_loss_as_dp1(torch_runs):
    """Same seed, so the first step trains on the same batch (checked: same sessions and tokens)."""
    one, two = rows(torch_runs[1], "train")[0], rows(torch_runs[2], "train")[0]
    assert (one["sessions"], one["generated_tokens"]) == (two["sessions"], two["generated_tokens"])
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-3)
    assert one["grad_norm"] > 0
    # Each rank ran its own share: fewer forward/backward passes on rank 0 than the whole batch needs.
    assert two["micro_batches"] < one["micro_batches"]
    # The FSDP2 weights reached the engine on rank 0: its next rollouts match the trainer's logprobs.
    assert [s["version"] for s in rows(torch_runs[2], "sync")] == [1, 2]
    assert all(r["mismatch_abs"] < 1e-5 for r in rows(torch_runs[2], "train"))


@pytest.mark.slow
def test_kl_reference_on_the_torch_backend(torch_runs):
    for dp, run in torch_runs.items():
        kl = [r["ref_kl"] for r in rows(run, "train")]
        assert kl[0] == pytest.approx(0.0, abs=1e-7), dp  # the reference is the initial policy
        assert kl[1] > 1e-6, dp  # after one update the policy has left it


# ------------------------------------------------------------------ the Megatron backend: YAML knobs, SFT lr, KL


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory):
    """`miles train` on Megatron with two Megatron-only knobs from YAML, SFT at its own lr, and a KL penalty."""
    base = tmp_path_factory.mktemp("megatron_layouts")
    config = write_config(
        base,
        backend="megatron",
        trainer={"lr": 1e-3, "micro_batch_tokens": 4096},
        megatron={"attention": "local", "distributed_optimizer": False},
        sft={"enabled": True, "num_demos": 40, "batch_size": 4, "lr": 4e-3},
    )
    out = base / "run"
    proc = miles_train(config, "--output-dir", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


@pytest.mark.slow
def test_megatron_knobs_from_yaml_take_effect(megatron_run):
    train = rows(megatron_run, "train")
    assert len(train) == 2
    # attention: local cannot pack: one sequence per micro-batch (sdpa packs all 8 into one 4096-token pass).
    assert all(r["micro_batches"] == r["num_sequences"] > 1 for r in train)
    # distributed_optimizer: false is recorded with the optimizer state (a resume needs the same layout).
    optimizer = torch.load(megatron_run / "checkpoints" / "step_00000002" / "optimizer.pt", weights_only=True)
    assert optimizer["distributed_optimizer"] is False


@pytest.mark.slow
def test_megatron_sft_uses_sft_lr_then_rl_uses_trainer_lr(megatron_run):
    sft = rows(megatron_run, "sft")
    assert sft and all(r["lr"] == pytest.approx(4e-3) for r in sft)
    assert all(r["lr"] == pytest.approx(1e-3) for r in rows(megatron_run, "train"))


@pytest.mark.slow
def test_kl_reference_on_the_megatron_backend(megatron_run):
    kl = [r["ref_kl"] for r in rows(megatron_run, "train")]
    assert kl[0] == pytest.approx(0.0, abs=1e-7)  # the reference is the policy as SFT left it
    assert kl[1] > 1e-6
