"""The Megatron backend against the torch backend: same HF weights, same batch, one train step, over gloo.

Each test launches real ranks with torchrun (``python -m torch.distributed.run``) running this file's worker
(`_worker`), which builds a `MegatronTrainer`, checks that HF -> Megatron -> HF is bit-identical, trains one
step, and writes its loss and the exported HF weights; the test compares them with `TorchTrainer` run here.
"""

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
# adam_eps=1e-2 keeps Adam's first step linear in the gradient (with eps ~ 1e-8 it is lr * sign(g), which
# turns fp32 rounding noise in near-zero gradients into full-size differences).
TRAIN = dict(lr=1e-3, micro_batch_tokens=48, max_grad_norm=1.0, weight_decay=0.01, adam_eps=1e-2)


def make_hf(family: str) -> transformers.PreTrainedModel:
    """A tiny random model of `family`; vocab 300 is padded to 384/512 in Megatron (exercises the padding)."""
    common = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_theta": 50000.0, "rope_type": "default"},
    )
    torch.manual_seed(0)
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True))
    if family == "qwen3":
        return transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=False)
        )
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=False))


def make_batch(seed: int = 1, n: int = 6) -> TrajectoryBatch:
    """Trajectories of different lengths (prompt masked out), two GRPO groups, rollout logprobs off by a bit."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(n):
        length, prompt = 9 + 4 * i, 3 + i % 3
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


def _algorithm(name: str):
    from miles.learner.config import AlgorithmConfig
    from miles.learner.losses import LossConfig

    if (
        name == "gspo-kl-2mini"
    ):  # two optimizer steps, old and reference logprobs from forward-only passes, TIS
        return AlgorithmConfig(
            loss=LossConfig(
                policy_loss="gspo",
                aggregation="seq-mean-token-mean",
                tis_cap=2.0,
                kl_coef=0.2,
                kl_estimator="k1",
            ),
            num_mini_batches=2,
        )
    if name == "kl-2mini":  # a frozen reference; after the first optimizer step the policy has left it
        return AlgorithmConfig(loss=LossConfig(kl_coef=0.5, entropy_coef=0.01), num_mini_batches=2)
    return AlgorithmConfig(loss=LossConfig(entropy_coef=0.01))


def megatron_step(family: str, tp: int, pp: int, alg: str):
    """Build a MegatronTrainer from `make_hf(family)`, check the export round trip, train one step.

    Returns (round trip bit-identical?, metrics, exported HF weights after the step, dp size)."""
    from miles.learner.megatron import MegatronTrainer, MegatronTrainerConfig

    hf = make_hf(family)
    ref = {k: v.clone() for k, v in hf.state_dict().items()}
    trainer = MegatronTrainer(hf, MegatronTrainerConfig(tp=tp, pp=pp, **TRAIN), _algorithm(alg))
    exported = trainer.hf_state_dict(cpu=True)
    roundtrip = sorted(exported) == sorted(
        k for k in ref if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)
    ) and all(torch.equal(exported[k], ref[k]) for k in exported)
    metrics = trainer.train_step(make_batch())
    return roundtrip, metrics, trainer.hf_state_dict(cpu=True), trainer.info.dp_size


def _worker() -> None:
    """torchrun entry: argv = family tp pp algorithm outdir."""
    import warnings

    warnings.filterwarnings("ignore")
    family, tp, pp, alg, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], Path(sys.argv[5])
    from miles.learner.megatron.parallel import destroy_parallel

    roundtrip, metrics, updated, dp = megatron_step(family, tp, pp, alg)
    if int(os.environ["RANK"]) == 0:
        save_file({k: v.contiguous() for k, v in updated.items()}, str(out / "weights.safetensors"))
        (out / "result.json").write_text(json.dumps({"roundtrip": roundtrip, "metrics": metrics, "dp": dp}))
    destroy_parallel()  # a gloo group left to the interpreter's exit can abort a rank (SIGABRT, CI flake)


def run_megatron(tmp_path: Path, family: str, tp: int, pp: int, nproc: int, alg: str = "ppo"):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    from miles.training.torchrun import torchrun_command

    cmd = torchrun_command([str(HERE), family, str(tp), str(pp), alg, str(tmp_path)], nproc)  # --standalone
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads((tmp_path / "result.json").read_text())
    return result, load_file(str(tmp_path / "weights.safetensors"))


def run_torch(family: str, alg: str = "ppo"):
    from miles.learner.torch_backend import TorchTrainer, TorchTrainerConfig

    hf = make_hf(family)
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    trainer = TorchTrainer(
        copy.deepcopy(hf), TorchTrainerConfig(**TRAIN, device="cpu", precision="fp32"), _algorithm(alg)
    )
    metrics = trainer.train_step(make_batch())
    return metrics, trainer.hf_state_dict(cpu=True), before


def assert_same_step(result, weights, family: str, alg: str = "ppo") -> None:
    metrics, ref_weights, before = run_torch(family, alg)
    assert result["roundtrip"], "HF -> Megatron -> HF was not bit-identical"
    mg = result["metrics"]
    assert mg["loss"] == pytest.approx(metrics["loss"], rel=1e-5, abs=1e-6)
    assert mg["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-4)
    assert mg["entropy"] == pytest.approx(metrics["entropy"], rel=1e-5)
    assert mg["clip_frac"] == pytest.approx(metrics["clip_frac"], abs=1e-9)
    if "kl" in alg:  # mean over both mini-batches: 0 on the first, != 0 on the second
        assert abs(metrics["ref_kl"]) > 1e-8
        assert mg["ref_kl"] == pytest.approx(metrics["ref_kl"], rel=1e-3, abs=1e-9)
    tied = {"lm_head.weight"} if make_hf(family).config.tie_word_embeddings else set()
    assert set(weights) == set(ref_weights) - tied
    for name, ref in ref_weights.items():
        if name in tied:
            continue
        assert (ref - before[name]).abs().max() > 0 or name.endswith("norm.weight"), f"{name} did not move"
        # atol: two float32 ulps at 1.0 (norm weights sit near 1, their updates are ~1e-5).
        torch.testing.assert_close(
            weights[name] - before[name],
            ref - before[name],
            rtol=1e-3,
            atol=2.4e-7,
            msg=lambda m, n=name: f"update of {n}: {m}",
        )


@pytest.mark.slow
def test_tp2_qwen2_tied_with_kl_reference_matches_torch_backend(tmp_path):
    result, weights = run_megatron(tmp_path, "qwen2", tp=2, pp=1, nproc=2, alg="kl-2mini")
    assert_same_step(result, weights, "qwen2", "kl-2mini")


@pytest.mark.slow
def test_pp2_llama_gspo_kl_two_steps_matches_torch_backend(tmp_path):
    result, weights = run_megatron(tmp_path, "llama", tp=1, pp=2, nproc=2, alg="gspo-kl-2mini")
    assert_same_step(result, weights, "llama", "gspo-kl-2mini")


@pytest.mark.slow
def test_dp2_qwen2_tied_matches_torch_backend(tmp_path):
    result, weights = run_megatron(tmp_path, "qwen2", tp=1, pp=1, nproc=2)
    assert result["dp"] == 2
    assert_same_step(result, weights, "qwen2")


if __name__ == "__main__":
    _worker()
