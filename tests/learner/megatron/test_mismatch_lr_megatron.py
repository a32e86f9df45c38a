"""`algorithm.loss.mismatch_kl_target` on the Megatron backend: two data-parallel ranks (gloo) and two mini-batches
take the same per-mini-batch learning-rate factor, and the same update, as the torch backend in one process.

The test launches this file under torchrun (`_worker`): each rank builds a `MegatronTrainer` from the same tiny
HF model and trains one step; rank 0 writes the metrics and the exported HF weights."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from miles.trajectory import Trajectory, TrajectoryBatch, TrajectoryMeta

HERE = Path(__file__).resolve()
# adam_eps=1e-2 keeps Adam's first step linear in the gradient (with eps ~ 1e-8 it is lr * sign(g)).
TRAIN = dict(lr=1e-3, micro_batch_tokens=48, max_grad_norm=1.0, adam_eps=1e-2)
TARGET = 0.05


def make_hf() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_theta": 50000.0, "rope_type": "default"},
        tie_word_embeddings=False,
    )
    return transformers.Qwen2ForCausalLM(config)


def make_batch() -> TrajectoryBatch:
    """Rollout logprobs drawn at random, far from the model's own: every mini-batch's mismatch is over TARGET."""
    g = torch.Generator().manual_seed(1)
    trajs = []
    for i in range(8):
        length, prompt = 9 + 3 * i, 3 + i % 3
        ids = torch.randint(0, 300, (length,), generator=g).tolist()
        lps = [0.0] * prompt + (-torch.rand(length - prompt, generator=g) * 3).tolist()
        trajs.append(
            Trajectory(
                token_ids=ids,
                loss_mask=[0] * prompt + [1] * (length - prompt),
                rollout_logprobs=lps,
                reward=float((i * 7) % 3),
                meta=TrajectoryMeta(group_id=str(i % 2)),
            )
        )
    return TrajectoryBatch.from_trajectories(trajs)


def algorithm(target: float | None):
    from miles.learner.config import AlgorithmConfig
    from miles.learner.losses import LossConfig

    loss = LossConfig(ratio_to="rollout", dual_clip_c=3.0, mismatch_kl_target=target)
    return AlgorithmConfig(loss=loss, num_mini_batches=2)


def _worker() -> None:
    """torchrun entry: argv = outdir."""
    import warnings

    warnings.filterwarnings("ignore")
    out = Path(sys.argv[1])
    from miles.learner.megatron import MegatronTrainer, MegatronTrainerConfig
    from miles.learner.megatron.parallel import destroy_parallel

    trainer = MegatronTrainer(make_hf(), MegatronTrainerConfig(**TRAIN), algorithm(TARGET))
    metrics = trainer.train_step(make_batch())
    weights = trainer.hf_state_dict(cpu=True)
    if int(os.environ["RANK"]) == 0:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "weights.safetensors"))
        (out / "result.json").write_text(json.dumps({"metrics": metrics, "dp": trainer.info.dp_size}))
    destroy_parallel()


def torch_step(target: float | None) -> tuple[dict, dict]:
    from miles.learner.torch_backend import TorchTrainer, TorchTrainerConfig

    hf = make_hf()
    cfg = TorchTrainerConfig(**TRAIN, device="cpu", precision="fp32")
    trainer = TorchTrainer(copy.deepcopy(hf), cfg, algorithm(target))
    metrics = trainer.train_step(make_batch())
    after = trainer.hf_state_dict(cpu=True)
    before = hf.state_dict()
    return metrics, {k: after[k] - before[k] for k in after}


@pytest.mark.slow
def test_dp2_two_mini_batches_scale_the_lr_as_the_torch_backend_does(tmp_path):
    from miles.training.torchrun import torchrun_command

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        torchrun_command([str(HERE), str(tmp_path)], 2), env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads((tmp_path / "result.json").read_text())
    weights = load_file(str(tmp_path / "weights.safetensors"))
    metrics, delta = torch_step(TARGET)
    _, plain_delta = torch_step(None)
    mg = result["metrics"]
    assert result["dp"] == 2
    assert 0.0 < metrics["lr_scale"] < 0.5  # both mini-batches were cut
    assert mg["lr_scale"] == pytest.approx(metrics["lr_scale"], rel=1e-4)
    assert mg["lr"] == metrics["lr"] == TRAIN["lr"]
    before = make_hf().state_dict()
    moved = 0
    for name, ref in delta.items():
        got = weights[name] - before[name]
        # atol: two float32 ulps at 1.0 (norm weights sit near 1)
        torch.testing.assert_close(got, ref, rtol=1e-3, atol=2.4e-7, msg=lambda m, n=name: f"{n}: {m}")
        if plain_delta[name].abs().max() > 1e-5:
            moved += 1
            assert not torch.allclose(got, plain_delta[name], rtol=1e-2, atol=1e-6), (
                f"{name} took the full step"
            )
    assert moved


if __name__ == "__main__":
    _worker()
