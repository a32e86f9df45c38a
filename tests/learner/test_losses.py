"""Policy losses, aggregation, off-policy correction and metrics against hand-computed references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from miles.learner.errors import ConfigError
from miles.learner.logprobs import shifted_entropy, shifted_token_logprobs
from miles.learner.losses import LossConfig, LossInputs, aggregate, kl_penalty, policy_loss, sft_loss
from miles.learner.metrics import MetricAccumulator, logprob_mismatch


def _inputs(log_ratios, adv, *, mask=None, seq=None, rollout_shift=None, ref=None, entropy=None):
    """Current logprobs get `requires_grad`; old = current - log_ratio."""
    n = len(log_ratios)
    lp = torch.full((n,), -1.0, dtype=torch.float64, requires_grad=True)
    old = lp.detach() - torch.tensor(log_ratios, dtype=torch.float64)
    rollout = None if rollout_shift is None else old - torch.tensor(rollout_shift, dtype=torch.float64)
    return LossInputs(
        logprobs=lp,
        old_logprobs=old,
        advantages=torch.tensor(adv, dtype=torch.float64),
        loss_mask=torch.tensor(mask or [1.0] * n, dtype=torch.float64),
        seq_index=torch.tensor(seq or [0] * n),
        rollout_logprobs=rollout,
        ref_logprobs=None if ref is None else torch.tensor(ref, dtype=torch.float64),
        entropy=None if entropy is None else torch.tensor(entropy, dtype=torch.float64),
    )


def _metrics(out):
    acc = MetricAccumulator()
    acc.update(out.metric_sums)
    return acc.result()


def test_ppo_clip_by_hand():
    # ratios 1.5, 0.5, 1.1, 0.7 with advantages +1, +1, -1, -1 and eps 0.2:
    # per-token max(-A r, -A clip(r)) = -1.2 (clipped), -0.5, 1.1, 0.8 (clipped)
    x = _inputs([math.log(1.5), math.log(0.5), math.log(1.1), math.log(0.7)], [1, 1, -1, -1])
    out = policy_loss(x, LossConfig(eps_clip_low=0.2, eps_clip_high=0.2))
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 1.1 + 0.8) / 4)
    out.loss.backward()
    # d/dlogp of -A r / 4 is -A r / 4 on unclipped tokens, 0 on clipped ones
    assert x.logprobs.grad.tolist() == pytest.approx([0.0, -0.5 / 4, 1.1 / 4, 0.0])
    m = _metrics(out)
    assert m["clip_frac"] == pytest.approx(0.5)
    assert m["clip_frac_high"] == pytest.approx(0.25)
    assert m["clip_frac_low"] == pytest.approx(0.25)
    # approx KL(old||new) by k3: mean(r - 1 - log r)
    rs = np.array([1.5, 0.5, 1.1, 0.7])
    assert m["approx_kl"] == pytest.approx(float(np.mean(rs - 1 - np.log(rs))))


def test_asymmetric_clip_uses_separate_low_and_high():
    # ratio 1.25 with A=+1: clipped at 1.2 under eps_high=0.2, free under eps_high=0.3
    x = _inputs([math.log(1.25)], [1.0])
    assert policy_loss(x, LossConfig(eps_clip_low=0.1, eps_clip_high=0.2)).loss.item() == pytest.approx(-1.2)
    assert policy_loss(x, LossConfig(eps_clip_low=0.1, eps_clip_high=0.3)).loss.item() == pytest.approx(-1.25)
    # ratio 0.85 with A=-1: clipped at 0.9 under eps_low=0.1 (loss 0.9), free under eps_low=0.2 (0.85)
    y = _inputs([math.log(0.85)], [-1.0])
    assert policy_loss(y, LossConfig(eps_clip_low=0.1, eps_clip_high=0.3)).loss.item() == pytest.approx(0.9)
    assert policy_loss(y, LossConfig(eps_clip_low=0.2, eps_clip_high=0.3)).loss.item() == pytest.approx(0.85)


def test_dual_clip_caps_negative_advantage_loss():
    # ratio 5 with A = -1: plain PPO loss max(5, 1.2) = 5; dual clip c=3 caps it at 3 (and kills the gradient)
    x = _inputs([math.log(5.0), math.log(5.0)], [-1.0, 2.0])
    plain = policy_loss(x, LossConfig())
    assert plain.loss.item() == pytest.approx((5.0 + -2 * 1.2) / 2)
    dual = policy_loss(x, LossConfig(dual_clip_c=3.0))
    assert dual.loss.item() == pytest.approx((3.0 + -2 * 1.2) / 2)
    dual.loss.backward()
    assert x.logprobs.grad.tolist() == pytest.approx([0.0, 0.0])
    assert _metrics(dual)["dual_clip_frac"] == pytest.approx(0.5)


def test_aggregation_modes_by_hand():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
    seq = torch.tensor([0, 0, 0, 1])
    assert float(aggregate(values, mask, seq, "token-mean")) == pytest.approx(7 / 3)
    assert float(aggregate(values, mask, seq, "seq-mean-token-sum")) == pytest.approx((3 + 4) / 2)
    assert float(aggregate(values, mask, seq, "seq-mean-token-mean")) == pytest.approx((1.5 + 4) / 2)
    assert float(aggregate(values, mask, seq, "seq-mean-token-sum-norm", norm_length=4)) == pytest.approx(
        7 / 8
    )
    # global denominators (gradient accumulation): 10 tokens, 5 sequences in the whole mini-batch
    assert float(aggregate(values, mask, seq, "token-mean", num_tokens=10)) == pytest.approx(0.7)
    assert float(aggregate(values, mask, seq, "seq-mean-token-mean", num_seqs=5)) == pytest.approx(5.5 / 5)


def test_policy_loss_aggregation_on_policy():
    # on-policy ratio 1 -> per-token loss is -A; seq 0 has A=1 on 2 tokens, seq 1 has A=-3 on 1 token
    x = _inputs([0.0, 0.0, 0.0], [1.0, 1.0, -3.0], seq=[0, 0, 1])
    assert policy_loss(x, LossConfig(aggregation="token-mean")).loss.item() == pytest.approx((-2 + 3) / 3)
    assert policy_loss(x, LossConfig(aggregation="seq-mean-token-sum")).loss.item() == pytest.approx(
        (-2 + 3) / 2
    )
    assert policy_loss(x, LossConfig(aggregation="seq-mean-token-mean")).loss.item() == pytest.approx(
        (-1 + 3) / 2
    )


def test_gspo_sequence_ratio_is_geometric_mean():
    # seq 0: token log-ratios ln 2 and ln 0.5 -> geometric mean 1 (no clip, although each token is far off)
    # seq 1: log-ratios 0.2 and 0.4 -> s = e^0.3 = 1.3499 > 1.2; with A = -1 the unclipped branch is taken
    x = _inputs([math.log(2), math.log(0.5), 0.2, 0.4], [1.0, 1.0, -1.0, -1.0], seq=[0, 0, 1, 1])
    out = policy_loss(x, LossConfig(policy_loss="gspo", aggregation="seq-mean-token-mean"))
    s1 = math.exp(0.3)
    assert out.loss.item() == pytest.approx((-1.0 + s1) / 2)
    out.loss.backward()
    # sequence-level GSPO: d(-A s)/dlogp_t = -A s / |y|, then / num_seqs
    assert x.logprobs.grad.tolist() == pytest.approx([-1 / 2 / 2, -1 / 2 / 2, s1 / 2 / 2, s1 / 2 / 2])
    assert _metrics(out)["ratio_mean"] == pytest.approx((1 + 1 + s1 + s1) / 4)


def test_gspo_clips_the_sequence_not_the_token():
    x = _inputs([0.2, 0.4], [1.0, 1.0])
    out = policy_loss(x, LossConfig(policy_loss="gspo", aggregation="seq-mean-token-mean"))
    assert out.loss.item() == pytest.approx(-1.2)
    out.loss.backward()
    assert x.logprobs.grad.tolist() == pytest.approx([0.0, 0.0])
    assert _metrics(out)["clip_frac"] == pytest.approx(1.0)


def test_tis_truncates_importance_weights():
    # exp(old - rollout) = 0.5 and 3.0; cap 2 -> weights 0.5 and 2; on-policy loss -A w
    x = _inputs([0.0, 0.0], [1.0, 1.0], rollout_shift=[math.log(0.5), math.log(3.0)])
    out = policy_loss(x, LossConfig(tis_cap=2.0))
    assert out.loss.item() == pytest.approx(-(0.5 + 2.0) / 2)
    m = _metrics(out)
    assert m["tis_clip_frac"] == pytest.approx(0.5)
    assert m["tis_weight_mean"] == pytest.approx(1.25)
    # mismatch metrics on the same tokens: |d| and k3 of d = old - rollout
    d = np.log([0.5, 3.0])
    assert m["mismatch_abs"] == pytest.approx(float(np.mean(np.abs(d))))
    assert m["mismatch_kl"] == pytest.approx(float(np.mean(np.exp(d) - d - 1)))


def test_icepop_masks_tokens_outside_the_band():
    x = _inputs([0.0, 0.0, 0.0], [1.0, 1.0, 1.0], rollout_shift=[math.log(0.4), 0.0, math.log(2.5)])
    out = policy_loss(x, LossConfig(icepop=(0.5, 2.0)))
    assert out.loss.item() == pytest.approx(-1 / 3)  # only the middle token counts; denominator stays 3
    out.loss.backward()
    assert x.logprobs.grad.tolist() == pytest.approx([0.0, -1 / 3, 0.0])
    assert _metrics(out)["icepop_masked_frac"] == pytest.approx(2 / 3)


def test_the_ratio_against_the_rollout_policy_clips_tokens_that_already_moved():
    # one optimizer step: old == current (ratio 1 against the proximal policy); since the rollout the tokens'
    # probabilities moved by factors 1.5, 0.5, 1.1, 0.7 (advantages +1, +1, -1, -1)
    x = _inputs(
        [0.0] * 4, [1, 1, -1, -1], rollout_shift=[math.log(1.5), math.log(0.5), math.log(1.1), math.log(0.7)]
    )
    out = policy_loss(x, LossConfig(ratio_to="rollout"))
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 1.1 + 0.8) / 4)
    out.loss.backward()
    assert x.logprobs.grad.tolist() == pytest.approx([0.0, -0.5 / 4, 1.1 / 4, 0.0])
    m = _metrics(out)
    assert m["clip_frac"] == pytest.approx(0.5)
    rs = np.array([1.5, 0.5, 1.1, 0.7])
    assert m["approx_kl"] == pytest.approx(float(np.mean(rs - 1 - np.log(rs))))
    # against the proximal policy the same tokens all count, each with weight 1
    x = _inputs(
        [0.0] * 4, [1, 1, -1, -1], rollout_shift=[math.log(1.5), math.log(0.5), math.log(1.1), math.log(0.7)]
    )
    policy_loss(x, LossConfig()).loss.backward()
    assert x.logprobs.grad.tolist() == pytest.approx([-0.25, -0.25, 0.25, 0.25])


def test_the_ratio_against_the_rollout_policy_takes_no_other_importance_weight():
    for kwargs in ({"tis_cap": 2.0}, {"icepop": (0.5, 2.0)}):
        with pytest.raises(ConfigError) as e:
            LossConfig(ratio_to="rollout", **kwargs)
        assert e.value.key == "ratio_to"
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_loss(_inputs([0.0], [1.0]), LossConfig(ratio_to="rollout"))


def test_off_policy_correction_needs_rollout_logprobs():
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_loss(_inputs([0.0], [1.0]), LossConfig(tis_cap=2.0))


def test_kl_estimators_and_penalty():
    lp = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    assert kl_penalty(lp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1 - 1]
    assert kl_penalty(lp, ref, "k3").tolist() == pytest.approx(k3)
    x = _inputs([0.0, 0.0], [0.0, 0.0])
    x.logprobs = lp.clone().requires_grad_(True)
    x.old_logprobs = lp.clone()
    x.ref_logprobs = ref
    out = policy_loss(x, LossConfig(kl_coef=0.1, kl_estimator="k3"))
    assert out.loss.item() == pytest.approx(0.1 * sum(k3) / 2)
    assert _metrics(out)["ref_kl"] == pytest.approx(sum(k3) / 2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(_inputs([0.0], [1.0]), LossConfig(kl_coef=0.1))


def test_entropy_bonus_and_metric():
    x = _inputs([0.0, 0.0], [0.0, 0.0], entropy=[1.0, 3.0])
    out = policy_loss(x, LossConfig(entropy_coef=0.5))
    assert out.loss.item() == pytest.approx(-0.5 * 2.0)
    assert _metrics(out)["entropy"] == pytest.approx(2.0)


def test_sft_loss_is_masked_token_mean_nll():
    lp = torch.tensor([-9.0, -1.0, -3.0])
    out = sft_loss(lp, torch.tensor([0.0, 1.0, 1.0]))
    assert out.loss.item() == pytest.approx(2.0)
    assert sft_loss(lp, torch.tensor([0.0, 1.0, 1.0]), num_tokens=8).loss.item() == pytest.approx(0.5)


def test_shifted_logprobs_and_entropy_match_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 7))
    ids = np.array([3, 1, 6, 0, 2])
    starts = torch.tensor([0, 3])  # two packed sequences: tokens 0-2 and 3-4
    t = 0.7
    z = logits / t
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    expected = [0.0, logp[0, 1], logp[1, 6], 0.0, logp[3, 2]]
    got = shifted_token_logprobs(torch.tensor(logits), torch.tensor(ids), starts, temperature=t)
    assert got.tolist() == pytest.approx(expected, abs=1e-5)
    ent = -(np.exp(logp) * logp).sum(-1)
    got_e = shifted_entropy(torch.tensor(logits), starts, temperature=t)
    assert got_e.tolist() == pytest.approx([0.0, ent[0], ent[1], 0.0, ent[3]], abs=1e-5)


def test_logprob_mismatch_metric():
    train = torch.tensor([-1.0, -2.0, -7.0])
    rollout = torch.tensor([-1.5, -1.0, 0.0])
    m = logprob_mismatch(train, rollout, torch.tensor([1.0, 1.0, 0.0]))
    assert m["mismatch_abs"] == pytest.approx(0.75)
    assert m["mismatch_kl"] == pytest.approx(((math.exp(0.5) - 1.5) + (math.exp(-1) + 1 - 1)) / 2)
    assert m["mismatch_k1"] == pytest.approx((-0.5 + 1.0) / 2)


@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"eps_clip_low": 1.0}, "eps_clip_low"),
        ({"dual_clip_c": 1.0}, "dual_clip_c"),
        ({"aggregation": "sum"}, "aggregation"),
        ({"aggregation": "seq-mean-token-sum-norm"}, "norm_length"),
        ({"icepop": (2.0, 1.0)}, "icepop"),
        ({"policy_loss": "dpo"}, "policy_loss"),
        ({"tis_cap": 0.0}, "tis_cap"),
        ({"kl_estimator": "k2"}, "kl_estimator"),
        ({"ratio_to": "behaviour"}, "ratio_to"),
    ],
)
def test_loss_config_validation_names_the_key(kwargs, key):
    with pytest.raises(ConfigError) as e:
        LossConfig(**kwargs)
    assert e.value.key == key


@pytest.mark.parametrize("ratio_to,forward_pass", [("proximal", True), ("rollout", False)])
def test_several_optimizer_steps_recompute_old_logprobs_only_for_a_proximal_ratio(ratio_to, forward_pass):
    from miles.learner.config import AlgorithmConfig
    from miles.learner.step import RLStep

    def step(**kwargs):
        algo = AlgorithmConfig(loss=LossConfig(ratio_to=ratio_to), **kwargs)
        return RLStep(
            batch=None, temperature=1.0, token_counts=None, adv_seq=None, adv_tok=None, algorithm=algo
        )

    assert step(num_mini_batches=2).needs_old_logprobs is forward_pass
    assert step(ppo_epochs=2).needs_old_logprobs is forward_pass
    assert step().needs_old_logprobs is False  # one optimizer step: the current logprobs are the old ones


def test_the_mismatch_tail_and_its_split_by_model_turn():
    """The shares of tokens whose importance ratio leaves [0.9, 1.1] and [0.5, 2], the largest |log ratio|, and
    the mean and max |log ratio| of each of the first three model turns and of the later ones."""
    from miles.learner.metrics import MetricAccumulator, logprob_mismatch_sums

    rollout = torch.zeros(8)
    train = torch.tensor([0.0, 0.05, -0.2, 0.0, 1.0, 0.0, -0.9, 0.3])  # log ratios
    mask = torch.tensor([0.0, 1, 1, 1, 1, 1, 1, 1])
    turns = torch.tensor([-1, 0, 0, 1, 2, 3, 4, 4])
    acc = MetricAccumulator()
    acc.update(logprob_mismatch_sums(train, rollout, mask, turn_index=turns))
    m = acc.result()
    assert m["ratio_outside_10pct"] == pytest.approx(4 / 7)  # 0.05 and the two zeros stay inside
    assert m["ratio_outside_2x"] == pytest.approx(2 / 7)  # |log| > log 2 = 0.693: 1.0 and -0.9
    assert m["log_ratio_abs_max"] == pytest.approx(1.0)
    assert m["mismatch_abs_turn0"] == pytest.approx(0.125) and m["log_ratio_abs_max_turn0"] == pytest.approx(
        0.2
    )
    assert m["mismatch_abs_turn1"] == 0.0 and m["mismatch_abs_turn2"] == pytest.approx(1.0)
    assert m["mismatch_abs_turn3plus"] == pytest.approx((0.0 + 0.9 + 0.3) / 3)


def test_the_sequence_mask_drops_a_whole_sequence_with_one_token_far_from_the_rollout_policy():
    # two sequences of two tokens; the second's last token moved by a factor e (log ratio 1 > 0.693)
    x = _inputs([0.0] * 4, [1.0, 1.0, -1.0, -1.0], seq=[0, 0, 1, 1], rollout_shift=[0.1, -0.1, 0.0, 1.0])
    out = policy_loss(x, LossConfig(ratio_to="rollout", dual_clip_c=3.0, seq_mask_log_ratio=0.693))
    out.loss.backward()
    r0, r1 = math.exp(0.1), math.exp(-0.1)
    assert out.loss.item() == pytest.approx(-(r0 + r1) / 4)  # the second sequence leaves; denominator stays 4
    assert x.logprobs.grad.tolist() == pytest.approx([-r0 / 4, -r1 / 4, 0.0, 0.0])
    m = _metrics(out)
    assert m["seq_masked_frac"] == pytest.approx(0.5)
    assert m["seq_masked_token_frac"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_loss(_inputs([0.0], [1.0]), LossConfig(seq_mask_log_ratio=0.693))
    with pytest.raises(ConfigError) as e:
        LossConfig(seq_mask_log_ratio=-1.0)
    assert e.value.key == "seq_mask_log_ratio"
