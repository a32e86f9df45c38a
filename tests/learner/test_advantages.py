"""Advantage estimators and reward metrics against hand-computed numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.learner.advantages import AdvantageConfig, compute_advantages, expand_to_tokens, sequence_index
from miles.learner.errors import ConfigError
from miles.learner.metrics import reward_metrics

# group 0: three samples (1, 0, 0); group 7: two equal rewards; group 3: one sample (others filtered out)
REWARDS = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 5.0])
GROUPS = torch.tensor([0, 0, 0, 7, 7, 3])


def test_grpo_std_normalized_by_hand():
    adv = compute_advantages(REWARDS, GROUPS, AdvantageConfig("grpo"))
    # group 0: mean 1/3, sample std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    s = math.sqrt(1 / 3)
    expected = [(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, 0.0, 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-5)


def test_grpo_without_std_and_dr_grpo_remove_only_the_group_mean():
    expected = [2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0]
    for cfg in (AdvantageConfig("grpo", normalize_std=False), AdvantageConfig("dr_grpo")):
        assert compute_advantages(REWARDS, GROUPS, cfg).tolist() == pytest.approx(expected, abs=1e-6)


def test_rloo_uses_the_mean_of_the_other_samples():
    adv = compute_advantages(REWARDS, GROUPS, AdvantageConfig("rloo"))
    assert adv.tolist() == pytest.approx([1.0, -0.5, -0.5, 0.0, 0.0, 0.0], abs=1e-6)


def test_reinforce_pp_baseline_whitens_over_the_batch():
    adv = compute_advantages(REWARDS, GROUPS, AdvantageConfig("reinforce_pp_baseline"))
    # centered [2/3, -1/3, -1/3, 0, 0, 0]: mean 0, population std 1/3
    assert adv.tolist() == pytest.approx([2.0, -1.0, -1.0, 0.0, 0.0, 0.0], abs=1e-5)


def test_reinforce_pp_baseline_token_weighted():
    counts = torch.tensor([1.0, 2.0, 1.0, 1.0, 1.0, 1.0])
    adv = compute_advantages(REWARDS, GROUPS, AdvantageConfig("reinforce_pp_baseline"), token_counts=counts)
    c = np.array([2 / 3, -1 / 3, -1 / 3, 0, 0, 0])
    w = counts.numpy().astype(np.float64)
    mu = (w * c).sum() / w.sum()
    sd = np.sqrt((w * (c - mu) ** 2).sum() / w.sum())
    assert adv.tolist() == pytest.approx(list((c - mu) / sd), abs=1e-5)


def test_group_ids_not_positions_define_groups():
    perm = torch.tensor([5, 3, 0, 4, 2, 1])
    base = compute_advantages(REWARDS, GROUPS)
    shuffled = compute_advantages(REWARDS[perm], GROUPS[perm])
    assert torch.allclose(shuffled, base[perm], atol=1e-6)


def test_bad_config_names_the_key():
    with pytest.raises(ConfigError) as e:
        AdvantageConfig("ppo")  # type: ignore[arg-type]
    assert e.value.key == "estimator"
    with pytest.raises(ConfigError):
        AdvantageConfig(eps=0.0)


def test_mismatched_shapes_raise():
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages(REWARDS, GROUPS[:3])


def test_expand_and_sequence_index():
    cu = torch.tensor([0, 2, 5, 6])
    assert expand_to_tokens(torch.tensor([1.0, -2.0, 3.0]), cu).tolist() == [1, 1, -2, -2, -2, 3]
    assert sequence_index(cu).tolist() == [0, 0, 1, 1, 1, 2]


def test_reward_metrics_by_group():
    m = reward_metrics(REWARDS, GROUPS)
    assert m["reward_mean"] == pytest.approx(10 / 6)
    assert m["reward_std"] == pytest.approx(float(np.std(REWARDS.numpy(), ddof=1)))
    assert m["group_reward_mean"] == pytest.approx((1 / 3 + 2 + 5) / 3)
    assert m["group_reward_std"] == pytest.approx(math.sqrt(1 / 3) / 3)
    assert m["zero_std_group_frac"] == pytest.approx(2 / 3)  # groups 7 (equal rewards) and 3 (single sample)
    assert m["num_groups"] == 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.floats(-10, 10, allow_nan=False)), min_size=1, max_size=20))
def test_grpo_groups_have_zero_mean_and_unit_std(rows):
    rewards = torch.tensor([r for _, r in rows], dtype=torch.float32)
    groups = torch.tensor([g for g, _ in rows])
    adv = compute_advantages(rewards, groups, AdvantageConfig("grpo"))
    for g in set(groups.tolist()):
        a = adv[groups == g].double()
        r = rewards[groups == g].double()
        assert abs(float(a.mean())) < 1e-4
        if a.numel() > 1 and float(r.std()) > 1e-3:
            assert float(a.std()) == pytest.approx(1.0, abs=1e-3)
