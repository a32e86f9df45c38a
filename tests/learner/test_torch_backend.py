"""TorchTrainer on a tiny HF Qwen2 model on CPU: packing, logprob recomputation, accumulation, FSDP2."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.multiprocessing as mp

from miles.config import from_dict
from miles.learner.batching import plan_micro_batches
from miles.learner.config import AlgorithmConfig, TorchTrainerConfig, lr_lambda
from miles.learner.errors import ConfigError
from miles.learner.losses import LossConfig
from miles.learner.torch_backend import TorchTrainer
from miles.ports import free_port
from miles.tiny import make_tiny_model
from miles.trajectory import Trajectory, TrajectoryBatch, TrajectoryMeta

VOCAB = 64
LENGTHS = (5, 9, 3, 12, 7, 6, 4)


def make_batch(lengths=LENGTHS, *, seed=1, temperature=None) -> TrajectoryBatch:
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        gen = n - 2
        lps = (-torch.rand(gen, generator=g) * 4).tolist()
        sp = {} if temperature is None else {"temperature": temperature}
        trajs.append(
            Trajectory(
                token_ids=ids,
                loss_mask=[0, 0] + [1] * gen,
                rollout_logprobs=[0.0, 0.0] + lps,
                reward=float(i % 2),
                meta=TrajectoryMeta(group_id=f"g{i // 3}", sampling_params=sp),
            )
        )
    return TrajectoryBatch.from_trajectories(trajs)


def tiny(seed: int = 0):
    return make_tiny_model("0.1m", vocab_size=VOCAB, seed=seed)


def per_sequence_logprobs(model, batch: TrajectoryBatch, temperature: float = 1.0) -> torch.Tensor:
    """Independent reference: one plain forward per sequence, log_softmax(logits / T), gather the next token."""
    out = []
    with torch.no_grad():
        for i in range(batch.num_sequences):
            ids = batch.token_ids[batch.sequence(i)]
            logp = torch.log_softmax(model(input_ids=ids[None]).logits[0].float() / temperature, -1)
            lp = torch.zeros(ids.numel())
            lp[1:] = logp[:-1].gather(-1, ids[1:, None])[:, 0]
            out.append(lp)
    return torch.cat(out)


@pytest.mark.parametrize("packing", ["auto", "varlen", "packed", "padded"])
def test_packed_forward_equals_per_sequence_forward(packing):
    model = tiny()
    batch = make_batch()
    trainer = TorchTrainer(model, TorchTrainerConfig(micro_batch_tokens=20, packing=packing))
    assert trainer.packing == ("varlen" if packing == "auto" else packing)
    got = trainer.compute_logprobs(batch)
    want = per_sequence_logprobs(model, batch)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_naive_concatenation_would_leak_across_sequences():
    # the control for the test above: positions that do not restart make later sequences differ
    model = tiny()
    batch = make_batch()
    with torch.no_grad():
        logits = model(input_ids=batch.token_ids[None]).logits[0]
    want = per_sequence_logprobs(model, batch)
    logp = torch.log_softmax(logits.float(), -1)
    leaky = torch.zeros_like(want)
    leaky[1:] = logp[:-1].gather(-1, batch.token_ids[1:, None])[:, 0]
    s = batch.sequence(1)
    assert not torch.allclose(leaky[s][1:], want[s][1:], atol=1e-4)


def test_temperature_from_batch_and_from_config():
    model = tiny()
    batch = make_batch(temperature=0.7)
    want = per_sequence_logprobs(model, batch, temperature=0.7)
    assert torch.allclose(TorchTrainer(model).compute_logprobs(batch), want, atol=1e-5)
    cfg = TorchTrainerConfig(temperature=0.7)
    assert torch.allclose(TorchTrainer(model, cfg).compute_logprobs(make_batch()), want, atol=1e-5)


def test_mixed_temperatures_are_rejected():
    a, b = make_batch((4, 5), temperature=0.7), make_batch((4, 5), temperature=1.0)
    mixed = TrajectoryBatch(
        token_ids=a.token_ids,
        loss_mask=a.loss_mask,
        rollout_logprobs=a.rollout_logprobs,
        cu_seqlens=a.cu_seqlens,
        rewards=a.rewards,
        group_ids=a.group_ids,
        meta=[a.meta[0], b.meta[1]],
    )
    with pytest.raises(ValueError, match="temperature"):
        TorchTrainer(tiny()).train_step(mixed)


def test_micro_batch_plan():
    assert plan_micro_batches([5, 9, 3, 12, 7], 14) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert plan_micro_batches([30, 2], 10) == [(0, 1), (1, 2)]
    assert plan_micro_batches([], 10) == []
    # padded cost is count * longest: [5, 9] costs 18 > 14
    assert plan_micro_batches([5, 9, 3, 2], 14, padded=True) == [(0, 1), (1, 2), (2, 4)]


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_gradient_accumulation_equals_one_full_batch(aggregation):
    batch = make_batch()
    alg = AlgorithmConfig(loss=LossConfig(aggregation=aggregation, tis_cap=2.0))
    results = []
    for budget in (10_000, 12):  # one micro-batch vs. five
        model = tiny()
        # adam_eps >> |g| makes the first Adam update ~ lr * g, so the weights compare the gradients themselves
        cfg = TorchTrainerConfig(micro_batch_tokens=budget, lr=1.0, adam_eps=1.0, max_grad_norm=None)
        trainer = TorchTrainer(model, cfg, alg)
        m = trainer.train_step(batch)
        results.append((m, {k: v.clone() for k, v in trainer.hf_state_dict().items()}))
    (m1, w1), (m2, w2) = results
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-4)
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=1e-6), k


def test_grpo_steps_raise_logprob_of_rewarded_sequences():
    batch = make_batch()
    trainer = TorchTrainer(
        tiny(),
        TorchTrainerConfig(lr=3e-3, micro_batch_tokens=24),
        AlgorithmConfig(num_mini_batches=2, ppo_epochs=2),
    )
    rewarded = torch.cat(
        [
            torch.full((batch.sequence(i).stop - batch.sequence(i).start,), float(batch.rewards[i]))
            for i in range(batch.num_sequences)
        ]
    )
    mask = batch.loss_mask

    def gap() -> float:
        lp = trainer.compute_logprobs(batch)
        pos, neg = mask * (rewarded == 1), mask * (rewarded == 0)
        return float((lp * pos).sum() / pos.sum() - (lp * neg).sum() / neg.sum())

    before = gap()
    for _ in range(4):
        m = trainer.train_step(batch)
    assert gap() > before + 0.05
    assert m["optimizer_steps"] == 4 and trainer.step == 16
    assert m["approx_kl"] > 0  # later mini-batches/epochs see a policy that already moved
    for key in ("clip_frac", "mismatch_abs", "mismatch_kl", "entropy", "reward_mean", "zero_std_group_frac"):
        assert key in m


def test_sft_step_lowers_nll():
    batch = make_batch()
    trainer = TorchTrainer(tiny(), TorchTrainerConfig(lr=1e-2, micro_batch_tokens=16))
    first = trainer.sft_step(batch)["sft_nll"]
    for _ in range(5):
        last = trainer.sft_step(batch)["sft_nll"]
    assert last < first - 0.2


def test_reference_model_kl():
    """kl_coef > 0 without a ref_model: the trainer keeps a frozen copy of the initial policy."""
    alg = AlgorithmConfig(loss=LossConfig(kl_coef=0.5))
    batch = make_batch()
    for ref in (None, tiny()):
        trainer = TorchTrainer(tiny(), TorchTrainerConfig(lr=1e-2), alg, ref_model=copy.deepcopy(ref))
        first = trainer.train_step(batch)["ref_kl"]
        if ref is None:
            assert first == pytest.approx(0.0, abs=1e-6)  # the policy is its own reference before any update
        assert trainer.train_step(batch)["ref_kl"] > 1e-6
        assert all(not p.requires_grad for p in trainer.ref_model.parameters())
    assert TorchTrainer(tiny(), TorchTrainerConfig(lr=1e-2)).ref_model is None  # no KL, no reference


def test_sft_gets_its_own_optimizer_then_rl_starts_fresh():
    """begin_sft: SFT steps at sft lr (with warmup) on a fresh optimizer; the next RL step rebuilds the
    optimizer at trainer.lr (no SFT moments) and re-takes the KL reference from the SFT'd policy."""
    alg = AlgorithmConfig(loss=LossConfig(kl_coef=0.1))
    trainer = TorchTrainer(tiny(), TorchTrainerConfig(lr=1e-3), alg)
    trainer.begin_sft(5e-2, warmup_steps=2)
    lrs = [trainer.sft_step(make_batch())["lr"] for _ in range(3)]
    assert lrs == pytest.approx([2.5e-2, 5e-2, 5e-2])
    rl = trainer.train_step(make_batch())
    assert rl["lr"] == pytest.approx(1e-3)
    assert rl["ref_kl"] == pytest.approx(0.0, abs=1e-6)  # the reference is the policy as SFT left it
    assert all(len(s) and float(s["step"]) == 1 for s in trainer.optimizer.state.values())

    # Without begin_sft, sft_step uses the RL optimizer and its schedule.
    plain = TorchTrainer(tiny(), TorchTrainerConfig(lr=1e-3))
    assert plain.sft_step(make_batch())["lr"] == pytest.approx(1e-3)


def test_bf16_stays_close_to_fp32():
    model = tiny()
    batch = make_batch()
    lp32 = TorchTrainer(model).compute_logprobs(batch)
    lp16 = TorchTrainer(copy.deepcopy(model), TorchTrainerConfig(precision="bf16")).compute_logprobs(batch)
    assert not torch.equal(lp16, lp32)
    assert float((lp16 - lp32)[batch.loss_mask > 0].abs().mean()) < 0.1


def test_bf16_parameters_train_float32_masters():
    """bf16: the model computes in bf16, the optimizer steps float32 masters (fed float32 gradients summed over
    micro-batches), and the bf16 parameters are the rounded masters."""
    batch = make_batch()
    results = []
    for budget in (10_000, 12):  # one micro-batch vs five
        trainer = TorchTrainer(
            tiny(),
            TorchTrainerConfig(
                precision="bf16", micro_batch_tokens=budget, lr=1.0, adam_eps=1.0, max_grad_norm=None
            ),
        )
        assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
        masters = trainer.masters.masters
        assert all(m.dtype == torch.float32 for m in masters)
        assert [p for g in trainer.optimizer.param_groups for p in g["params"]] == masters
        start = [m.detach().clone() for m in masters]
        trainer.train_step(batch)
        for p, m in zip(trainer.masters.params, masters, strict=True):
            assert torch.equal(p, m.to(torch.bfloat16))
            assert p.grad is None
        assert trainer.hf_state_dict()["lm_head.weight"].dtype == torch.bfloat16
        results.append([m.detach() - s for m, s in zip(masters, start, strict=True)])
    one, five = results
    moved = max(float(d.abs().max()) for d in one)
    assert moved > 1e-3
    # accumulated in float32 over five micro-batches = one micro-batch (bf16 forward noise aside)
    assert max(float((a - b).abs().max()) for a, b in zip(one, five, strict=True)) < 0.05 * moved


def test_bf16_checkpoint_keeps_the_float32_masters(tmp_path):
    batch = make_batch()
    cfg = TorchTrainerConfig(precision="bf16", lr=1e-2)
    first = TorchTrainer(tiny(), cfg)
    first.train_step(batch)
    first.save_checkpoint(tmp_path)
    resumed = TorchTrainer(tiny(seed=9), cfg)
    resumed.load_checkpoint(tmp_path)
    for a, b in zip(first.masters.masters, resumed.masters.masters, strict=True):
        assert torch.equal(a, b)
    assert not all(
        torch.equal(m, m.to(torch.bfloat16).float()) for m in first.masters.masters
    )  # not just bf16
    for _ in range(2):
        assert first.train_step(batch)["loss"] == resumed.train_step(batch)["loss"]
    for a, b in zip(first.masters.masters, resumed.masters.masters, strict=True):
        assert torch.equal(a, b)


def test_the_lm_head_never_runs_over_the_batch():
    """The head's logits come chunk by chunk from its input: the module itself only ever sees zero positions."""
    trainer = TorchTrainer(tiny(), TorchTrainerConfig(micro_batch_tokens=20), AlgorithmConfig())
    head = trainer.model.get_output_embeddings()
    seen = []
    hook = head.register_forward_hook(lambda m, args, out: seen.append(out.shape[-2]))
    batch = make_batch()
    trainer.train_step(batch)
    lp = trainer.compute_logprobs(batch)
    hook.remove()
    assert seen and set(seen) == {0}
    assert not head._forward_pre_hooks  # the capture is gone once a forward is done
    assert torch.allclose(lp, per_sequence_logprobs(trainer.model, batch), atol=1e-5)


def test_models_with_a_soft_capped_head_take_the_full_logits():
    """A family outside FUSED_HEAD_FAMILIES (Gemma-2 soft-caps its logits after the head) is trained on the
    model's own logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from miles.learner.logprobs import token_logprobs_from_hidden
    from miles.learner.torch_backend import fused_lm_head

    cfg = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=0.05,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(cfg)
    assert fused_lm_head(model) is None and fused_lm_head(tiny()) is not None
    batch = make_batch()
    got = TorchTrainer(model, TorchTrainerConfig(packing="padded")).compute_logprobs(batch)
    want = per_sequence_logprobs(model, batch)
    assert torch.allclose(got, want, atol=1e-5)
    with torch.no_grad():  # the control: the head's own logits (no cap) would give other logprobs
        s = batch.sequence(0)
        ids = batch.token_ids[s]
        hidden = model.model(input_ids=ids[None]).last_hidden_state[0]
        uncapped = token_logprobs_from_hidden(hidden, model.lm_head.weight, ids, torch.tensor([0]))[0]
    assert not torch.allclose(uncapped, want[s], atol=1e-3)


def test_lr_schedule_warmup_then_cosine():
    cfg = TorchTrainerConfig(lr_schedule="cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    got = [lr_lambda(s, cfg) for s in range(7)]
    # warmup 1/2, 2/2; then 0.1 + 0.9 * 0.5 (1 + cos(pi * k / 4)) for k = 0..4
    import math

    want = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)]
    assert got == pytest.approx(want)
    trainer = TorchTrainer(tiny(), cfg)
    lrs = [trainer.sft_step(make_batch((4, 4)))["lr"] for _ in range(3)]
    assert lrs == pytest.approx([1e-5 * w for w in want[:3]])


def test_hf_state_dict_loads_into_a_fresh_hf_model():
    trainer = TorchTrainer(tiny(), TorchTrainerConfig(lr=1e-2))
    trainer.sft_step(make_batch())
    other = tiny(seed=5)
    other.load_state_dict(trainer.hf_state_dict(cpu=True), strict=True)
    batch = make_batch()
    assert torch.allclose(per_sequence_logprobs(other, batch), trainer.compute_logprobs(batch), atol=1e-5)


@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"lr": 0.0}, "lr"),
        ({"lr_schedule": "cosine"}, "total_steps"),
        ({"packing": "zigzag"}, "packing"),
        ({"micro_batch_tokens": 0}, "micro_batch_tokens"),
        ({"precision": "fp8"}, "precision"),
    ],
)
def test_trainer_config_validation(kwargs, key):
    with pytest.raises(ConfigError) as e:
        TorchTrainerConfig(**kwargs)
    assert e.value.key == key


def test_algorithm_config_from_dict_names_bad_keys():
    alg = from_dict(
        AlgorithmConfig,
        {
            "advantage": {"estimator": "dr_grpo"},
            "loss": {"policy_loss": "gspo", "icepop": [0.5, 2.0]},
            "ppo_epochs": 2,
        },
        "algorithm",
    )
    assert alg.loss.icepop == (0.5, 2.0) and alg.advantage.estimator == "dr_grpo"
    with pytest.raises(ConfigError) as e:
        from_dict(AlgorithmConfig, {"loss": {"eps_clip": 0.2}}, "algorithm")
    assert e.value.key == "algorithm.loss.eps_clip"
    with pytest.raises(ConfigError) as e:
        from_dict(AlgorithmConfig, {"loss": {"dual_clip_c": 0.5}}, "algorithm")
    assert e.value.key == "algorithm.loss.dual_clip_c"


def test_malformed_batch_is_rejected():
    b = make_batch((4, 5))
    bad = TrajectoryBatch(
        token_ids=b.token_ids,
        loss_mask=b.loss_mask[:-1],
        rollout_logprobs=b.rollout_logprobs,
        cu_seqlens=b.cu_seqlens,
        rewards=b.rewards,
        group_ids=b.group_ids,
    )
    with pytest.raises(ValueError, match="disagree"):
        TorchTrainer(tiny()).train_step(bad)


# ------------------------------------------------------------------ FSDP2 over gloo, world size 2


def _fsdp_steps() -> tuple[TorchTrainer, list[dict]]:
    """RL with a KL reference, SFT on its own optimizer, then RL again (fresh optimizer, re-taken reference).

    adam_eps >> |g| makes each Adam update ~ lr * (moment of g): linear in the gradients, so the weights compare
    the gradients themselves (a plain Adam step is ~ lr * sign(g), which float noise in near-zero gradient
    entries flips: a first step of a fresh optimizer then differs by up to 2 lr in those entries).
    """
    alg = AlgorithmConfig(loss=LossConfig(kl_coef=0.1))
    trainer = TorchTrainer(tiny(), TorchTrainerConfig(micro_batch_tokens=10, lr=1.0, adam_eps=1.0), alg)
    batch = make_batch()
    metrics = [trainer.train_step(batch) for _ in range(2)]
    trainer.begin_sft(1.0)
    metrics.append(trainer.sft_step(batch))
    metrics.append(trainer.train_step(batch))
    return trainer, metrics


def _fsdp_worker(rank: int, world: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        trainer, metrics = _fsdp_steps()
        batch = make_batch()
        state = trainer.hf_state_dict()
        lp = trainer.compute_logprobs(batch)
        if rank == 0:
            torch.save({"metrics": metrics, "state": state, "lp": lp}, out_path)
        torch.distributed.barrier()  # rank 0 hosts the store: neither rank tears down while the other still uses it
    finally:
        torch.distributed.destroy_process_group()


def test_fsdp2_world_size_two_matches_single_process(tmp_path):
    out = str(tmp_path / "fsdp.pt")
    mp.start_processes(_fsdp_worker, args=(2, free_port(), out), nprocs=2, join=True, start_method="spawn")
    got = torch.load(out, weights_only=False)
    trainer, want = _fsdp_steps()
    batch = make_batch()
    assert want[1]["ref_kl"] > 1e-6 and want[3]["ref_kl"] == pytest.approx(0.0, abs=1e-6)
    for g, w in zip(got["metrics"], want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], abs=1e-5)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4)
        assert g["lr"] == w["lr"] and g.get("ref_kl") == pytest.approx(w.get("ref_kl"), abs=1e-6)
    state = trainer.hf_state_dict()
    assert set(got["state"]) == set(state)
    for k, v in state.items():
        assert torch.allclose(got["state"][k], v, atol=1e-5), k
    assert torch.allclose(got["lp"], trainer.compute_logprobs(batch), atol=1e-4)
