"""MultiLoraTrainer: adapters trained together end where each would trained alone; gradients stay in their own
adapter; the base stays frozen; checkpoints and PEFT folders round-trip (peft loads them)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles.engine import BASE_POLICY
from miles.engines.lora import AdapterWeights
from miles.learner.config import AlgorithmConfig, TorchOptions, TrainerConfig
from miles.learner.lora.config import LoraSpec
from miles.learner.lora.trainer import AdapterSpec, MultiLoraTrainer
from miles.tiny import make_tiny_model
from miles.trajectory import Trajectory, TrajectoryBatch, TrajectoryMeta

VOCAB = 64
NAMES = ("calc-terse", "calc-verbose", "orders")
# Clipping, weight decay and a schedule all make a shared optimizer (or a global grad norm) visible.
TRAINER = TrainerConfig(lr=2e-2, weight_decay=0.1, max_grad_norm=0.05, lr_schedule="linear", total_steps=20)
OPTIONS = TorchOptions(device="cpu")


def _base() -> torch.nn.Module:
    return make_tiny_model("0.1m", vocab_size=VOCAB, seed=3)


def _specs(names=NAMES) -> list[AdapterSpec]:
    ranks = {"calc-terse": 4, "calc-verbose": 8, "orders": 2}
    return [
        AdapterSpec(
            n,
            LoraSpec(rank=ranks[n], alpha=2.0 * ranks[n]),
            dataclasses.replace(TRAINER, lr=TRAINER.lr * (1 + i)),
            seed=10 + i,
        )
        for i, n in enumerate(NAMES)
        if n in names
    ]


def _group(gen: torch.Generator, policy: str, gid: str, size: int = 3) -> list[Trajectory]:
    out = []
    for k in range(size):
        prompt = torch.randint(
            0, VOCAB, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen
        ).tolist()
        answer = torch.randint(
            0, VOCAB, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen
        ).tolist()
        lps = (-torch.rand(len(answer), generator=gen) * 3).tolist()
        t = Trajectory(
            meta=TrajectoryMeta(
                group_id=gid, policy_id=policy, sample_index=k, sampling_params={"temperature": 1.0}
            )
        )
        t.append(prompt, role="user", generated=False)
        t.append(answer, role="assistant", generated=True, logprobs=lps)
        t.reward = float(torch.rand(1, generator=gen))
        out.append(t)
    return out


def _steps(plan: list[list[str]], seed: int = 0) -> list[list[Trajectory]]:
    """Each step: one group per entry of its policy list (a policy may appear several times or not at all)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        [t for j, p in enumerate(step) for t in _group(gen, p, f"s{i}-g{j}")] for i, step in enumerate(plan)
    ]


def _train(
    names, steps: list[list[Trajectory]], algorithm: AlgorithmConfig | None = None
) -> MultiLoraTrainer:
    trainer = MultiLoraTrainer(_base(), _specs(names), OPTIONS, algorithm)
    for trajs in steps:
        mine = [t for t in trajs if t.meta.policy_id in names]
        if mine:
            trainer.train_step(TrajectoryBatch.from_trajectories(mine))
    return trainer


def _max_diff(a: AdapterWeights, b: AdapterWeights) -> float:
    assert a.tensors.keys() == b.tensors.keys()
    return max(float((a.tensors[k] - b.tensors[k]).abs().max()) for k in a.tensors)


PLAN = [list(NAMES), ["calc-terse", "orders", "calc-terse"], ["calc-verbose"], list(NAMES) + ["orders"]]


def test_three_adapters_together_end_as_each_alone():
    steps = _steps(PLAN)
    together = _train(NAMES, steps)
    for name in NAMES:
        alone = _train((name,), steps)
        diff = _max_diff(together.adapter_weights(name), alone.adapter_weights(name))
        assert diff <= 1e-5, f"{name}: max |dw| {diff}"
        start = MultiLoraTrainer(_base(), _specs((name,)), OPTIONS).adapter_weights(name)
        assert _max_diff(start, alone.adapter_weights(name)) > 1e-3  # it did train


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=st.lists(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4), min_size=1, max_size=3),
    seed=st.integers(0, 100),
)
def test_equivalence_holds_for_any_mix_of_groups(plan, seed):
    steps = _steps(plan, seed)
    together = _train(NAMES, steps)
    for name in {p for step in plan for p in step}:
        assert _max_diff(together.adapter_weights(name), _train((name,), steps).adapter_weights(name)) <= 1e-5


def test_a_step_touches_only_the_adapters_in_it_and_never_the_base():
    from miles.learner.protocol import Trainer

    trainer = MultiLoraTrainer(_base(), _specs(), OPTIONS)
    assert isinstance(trainer, Trainer)
    base = trainer.hf_state_dict(cpu=True)
    before = {n: trainer.adapter_weights(n) for n in NAMES}
    metrics = trainer.train_step(TrajectoryBatch.from_trajectories(_steps([["calc-verbose"]])[0]))
    assert trainer.last_trained == ("calc-verbose",)
    assert (
        metrics["adapters_trained"] == 1 and "calc-verbose/loss" in metrics and "orders/loss" not in metrics
    )
    for name in ("calc-terse", "orders"):
        assert _max_diff(before[name], trainer.adapter_weights(name)) == 0.0
        assert not trainer.trainers[name].optimizer.state  # no moments, no weight decay, no schedule step
        assert trainer.trainers[name].step == 0
    assert _max_diff(before["calc-verbose"], trainer.adapter_weights("calc-verbose")) > 0
    after = trainer.hf_state_dict(cpu=True)
    assert base.keys() == after.keys() == _base().state_dict().keys()
    assert all(torch.equal(base[k], after[k]) for k in base)


def test_kl_reference_is_the_base_and_equivalence_holds_with_it():
    from miles.learner.losses import LossConfig

    algorithm = AlgorithmConfig(loss=LossConfig(kl_coef=0.1), num_mini_batches=2)
    steps = _steps(PLAN[:2])
    together = _train(NAMES, steps, algorithm)
    assert (
        _max_diff(
            together.adapter_weights("orders"),
            _train(("orders",), steps, algorithm).adapter_weights("orders"),
        )
        <= 1e-5
    )


def test_batches_of_unknown_policies_are_refused_by_name():
    trainer = MultiLoraTrainer(_base(), _specs(("orders",)), OPTIONS)
    batch = TrajectoryBatch.from_trajectories(_steps([["orders", BASE_POLICY]])[0])
    with pytest.raises(ValueError, match=r"\['base'\].*frozen base"):
        trainer.train_step(batch)


def test_logprobs_follow_each_sequences_policy():
    trainer = _train(NAMES, _steps(PLAN[:1]))
    trajs = _steps([["orders", BASE_POLICY, "calc-terse"]], seed=5)[0]
    batch = TrajectoryBatch.from_trajectories(trajs)
    mixed = trainer.compute_logprobs(batch, temperature=1.0)
    for i, t in enumerate(trajs):
        alone = TrajectoryBatch.from_trajectories([t])
        if t.meta.policy_id == BASE_POLICY:
            ref = MultiLoraTrainer(
                _base(), _specs(("orders",)), OPTIONS
            )  # a fresh adapter is the base (B = 0)
            expect = ref.compute_logprobs(dataclasses.replace(alone, policy_ids=("orders",)), temperature=1.0)
        else:
            expect = trainer.compute_logprobs(alone, temperature=1.0)
        assert torch.allclose(mixed[batch.sequence(i)], expect, atol=1e-6)


def test_peft_loads_the_adapter_files_and_computes_the_same_logits(tmp_path):
    from peft import PeftModel

    trainer = _train(NAMES, _steps(PLAN[:2]))
    trainer.save_pretrained(tmp_path / "export")
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))
    for name in NAMES:
        with trainer._active(name):
            expect = trainer.model(input_ids=ids).logits
        base = type(_base()).from_pretrained(tmp_path / "export")
        loaded = PeftModel.from_pretrained(base, tmp_path / "export" / "adapters" / name).eval()
        assert torch.allclose(loaded(input_ids=ids).logits, expect, atol=1e-5)
        assert (
            AdapterWeights.load(tmp_path / "export" / "adapters" / name).rank == trainer.specs[name].lora.rank
        )


def test_checkpoint_round_trip_continues_identically(tmp_path):
    steps = _steps(PLAN)
    straight = _train(NAMES, steps)
    first = _train(NAMES, steps[:2])
    path = first.save_checkpoint(tmp_path / "ckpt", data_cursor={"position": 7})
    assert sorted(p.name for p in (path / "adapters").iterdir()) == sorted(NAMES)
    resumed = MultiLoraTrainer(_base(), _specs(), OPTIONS)
    ckpt = resumed.load_checkpoint(tmp_path / "ckpt")
    assert ckpt.data_cursor == {"position": 7} and resumed.step == 2
    for trajs in steps[2:]:
        resumed.train_step(TrajectoryBatch.from_trajectories(trajs))
    for name in NAMES:
        assert _max_diff(straight.adapter_weights(name), resumed.adapter_weights(name)) <= 1e-6
        assert resumed.trainers[name].step == straight.trainers[name].step


def test_a_checkpoint_of_other_adapters_is_refused(tmp_path):
    from miles.learner.errors import CheckpointError

    _train(("orders",), _steps(PLAN[:1])).save_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="no adapter 'calc-terse'"):
        MultiLoraTrainer(_base(), _specs(("calc-terse",)), OPTIONS).load_checkpoint(tmp_path / "ckpt")


def test_a_target_module_the_model_lacks_names_the_adapter():
    from miles.config import ConfigError

    spec = AdapterSpec("calc", LoraSpec(target_modules=("q_proj", "no_such_proj")))
    with pytest.raises(ConfigError, match=r"adapters\[calc\]\.lora\.target_modules"):
        MultiLoraTrainer(copy.deepcopy(_base()), [spec], OPTIONS)
