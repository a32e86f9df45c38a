"""`algorithm.loss.mismatch_kl_target`: each optimizer step's learning rate times ``min(1, target / mismatch_kl)``
of its mini-batch: the rule, its config check, the torch backend's step, and an asynchronous `miles train` run."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from miles.learner.config import AlgorithmConfig, TorchTrainerConfig
from miles.learner.errors import ConfigError
from miles.learner.losses import LossConfig, mismatch_lr_scale
from miles.learner.torch_backend import TorchTrainer
from miles.tiny import make_tiny_model
from miles.training.config import load_train_config
from miles.trajectory import Trajectory, TrajectoryBatch, TrajectoryMeta
from tests.support.runs import SHORT_ASYNC, trained_rows

VOCAB = 64
LR = 1e-2


def test_the_rule():
    assert mismatch_lr_scale((0.5, 10.0), None) == 1.0  # off
    assert mismatch_lr_scale((0.01, 10.0), 0.002) == 1.0  # kl 0.001, under the target
    assert mismatch_lr_scale((0.02, 10.0), 0.002) == 1.0  # at the target
    assert mismatch_lr_scale((0.5, 10.0), 0.002) == pytest.approx(0.04)  # kl 0.05: 0.002 / 0.05
    assert mismatch_lr_scale((0.0, 0.0), 0.002) == 1.0  # no trained token counted
    assert mismatch_lr_scale((math.inf, 10.0), 0.002) == 0.0
    assert mismatch_lr_scale((math.nan, 10.0), 0.002) == 0.0


@pytest.mark.parametrize("bad", ["0", "-0.1", "inf", "nan"])
def test_a_bad_target_is_a_one_line_error_naming_the_key(bad):
    with pytest.raises(ConfigError) as err:
        load_train_config(None, [f"algorithm.loss.mismatch_kl_target={bad}"])
    message = str(err.value)
    assert "algorithm.loss.mismatch_kl_target" in message and "\n" not in message


def test_the_target_is_off_by_default_and_keeps_the_async_defaults():
    assert LossConfig().mismatch_kl_target is None
    lc = load_train_config(
        None, ["async.enabled=true", "async.max_staleness=4", "algorithm.loss.mismatch_kl_target=0.002"]
    ).algorithm.loss
    assert (lc.ratio_to, lc.tis_cap, lc.mismatch_kl_target) == ("rollout", None, 0.002)


def make_batch(rollout_logprobs: torch.Tensor | None = None) -> TrajectoryBatch:
    g = torch.Generator().manual_seed(1)
    trajs = []
    for i, n in enumerate((5, 9, 3, 12, 7, 6)):
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        lps = [0.0, 0.0] + (-torch.rand(n - 2, generator=g) * 4).tolist()
        trajs.append(
            Trajectory(
                token_ids=ids,
                loss_mask=[0, 0] + [1] * (n - 2),
                rollout_logprobs=lps,
                reward=float(i % 2),
                meta=TrajectoryMeta(group_id=f"g{i // 3}"),
            )
        )
    batch = TrajectoryBatch.from_trajectories(trajs)
    if rollout_logprobs is not None:
        batch.rollout_logprobs = rollout_logprobs * batch.loss_mask
    return batch


def one_step(model, batch: TrajectoryBatch, target: float | None) -> tuple[dict, dict, TorchTrainer]:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    alg = AlgorithmConfig(loss=LossConfig(ratio_to="rollout", dual_clip_c=3.0, mismatch_kl_target=target))
    trainer = TorchTrainer(copy.deepcopy(model), TorchTrainerConfig(lr=LR, adam_eps=1e-2), alg)
    metrics = trainer.train_step(batch)
    after = trainer.model.state_dict()
    return metrics, {k: after[k] - before[k] for k in before}, trainer


def test_a_batch_far_from_the_policy_steps_at_the_scaled_rate():
    """Adam's first step is linear in the learning rate (adam_eps 1e-2 keeps it off sign(g)): the update with
    the target is the plain update times `lr_scale`, and the scheduled rate is back afterwards."""
    model = make_tiny_model("0.1m", vocab_size=VOCAB, seed=0)
    batch = make_batch()  # rollout logprobs drawn at random: far from the tiny model's own
    plain, plain_delta, _ = one_step(model, batch, None)
    scaled, delta, trainer = one_step(model, batch, 0.01)
    assert "lr_scale" not in plain
    assert scaled["mismatch_kl"] > 0.05
    assert scaled["lr_scale"] == pytest.approx(0.01 / scaled["mismatch_kl"], rel=1e-6)
    assert scaled["lr"] == LR and trainer.optimizer.param_groups[0]["lr"] == LR
    moved = [k for k in delta if plain_delta[k].abs().max() > 0]
    assert moved
    for k in moved:
        # atol: two float32 ulps at 1.0 (the weights are stored after the update)
        torch.testing.assert_close(delta[k], plain_delta[k] * scaled["lr_scale"], rtol=1e-3, atol=2.4e-7)


def test_an_on_policy_batch_steps_at_the_full_rate():
    model = make_tiny_model("0.1m", vocab_size=VOCAB, seed=0)
    own = TorchTrainer(copy.deepcopy(model)).compute_logprobs(make_batch())
    batch = make_batch(own)
    plain, plain_delta, _ = one_step(model, batch, None)
    scaled, delta, _ = one_step(model, batch, 0.01)
    assert scaled["mismatch_kl"] < 1e-6 and scaled["lr_scale"] == 1.0
    for k in delta:
        torch.testing.assert_close(delta[k], plain_delta[k], rtol=0, atol=0)


@pytest.mark.slow
def test_an_async_run_reports_the_scale_it_applied(tmp_path):
    # a target below any stale batch's mismatch: every such step scales
    rows = trained_rows(tmp_path, *SHORT_ASYNC, "algorithm.loss.mismatch_kl_target=1e-6")
    assert rows and all(0.0 < r["lr_scale"] <= 1.0 and r["lr"] == 3e-4 for r in rows)
    stale = [r for r in rows if r["mismatch_kl"] > 1e-6]
    assert stale, "no stale batch in the run"
    for r in stale:
        assert r["lr_scale"] == pytest.approx(1e-6 / r["mismatch_kl"], rel=1e-6)
