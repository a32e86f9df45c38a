"""Policy-gradient losses on packed (padding-free) token tensors.

All inputs are flat ``[T]`` tensors over the packed tokens of a micro-batch, plus ``seq_index`` mapping each
token to its sequence. Aggregation divides by *global* denominators (``num_tokens`` / ``num_seqs`` of the whole
optimizer mini-batch) so that gradient accumulation over micro-batches equals one full-batch step.

Conventions: ``old_logprobs`` are the training policy's logprobs before the update (for a single on-policy
optimizer step they equal the current logprobs, detached); ``rollout_logprobs`` come from the rollout engine.
Off-policy correction uses the ratio ``exp(old_logprobs - rollout_logprobs)`` per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from miles.learner.errors import ConfigError
from miles.learner.metrics import logprob_mismatch_sums

PolicyLoss = Literal["ppo", "gspo"]
RatioTo = Literal["proximal", "rollout"]
Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
POLICY_LOSSES: tuple[str, ...] = ("ppo", "gspo")
AGGREGATIONS: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k3")
RATIO_TO: tuple[str, ...] = ("proximal", "rollout")


@dataclass(frozen=True)
class LossConfig:
    """Policy-loss settings.

    - ``policy_loss``: ``ppo`` (token ratio) or ``gspo`` (sequence ratio: geometric mean of token ratios).
    - ``eps_clip_low`` / ``eps_clip_high``: the ratio is clipped to ``[1 - low, 1 + high]``.
    - ``dual_clip_c``: for negative advantages the loss is capped at ``-A * c`` (c > 1); ``None`` disables.
    - ``aggregation``: ``token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-mean`` or
      ``seq-mean-token-sum-norm`` (sum over tokens / (num_seqs * ``norm_length``), Dr.GRPO's constant).
    - ``ratio_to``: what the clipped ratio is taken against (``None``: ``proximal``; an asynchronous run with
      ``max_staleness > 0`` that sets none of ``ratio_to``, ``tis_cap``, ``icepop`` gets ``rollout``, with
      ``dual_clip_c`` 3 unless set). ``proximal`` (decoupled PPO): the trainer's policy
      before this update (``old_logprobs``; for one optimizer step per batch the ratio is then 1 and nothing
      clips), with ``tis_cap``/``icepop`` weighing the rollout policy's tokens. ``rollout`` (PPO's own off-policy
      form): the policy that sampled the tokens (``rollout_logprobs``), so a token whose probability already
      moved past the clip range since it was sampled, in its advantage's direction, adds no gradient; the ratio
      is then the importance weight itself, and ``tis_cap``/``icepop`` must stay unset.
    - ``tis_cap``: truncated importance sampling, weight ``min(exp(old - rollout), cap)``; ``None`` disables.
    - ``icepop``: ``(low, high)``; tokens whose ``exp(old - rollout)`` falls outside are dropped; ``None`` disables.
    - ``seq_mask_log_ratio``: a sequence any of whose trained tokens has ``|old - rollout|`` above this (a log ratio;
      ``0.693``: a factor of 2) leaves the loss whole, the denominators unchanged: the policy has moved so far
      from the one that sampled it that its reward no longer scores the current policy's own behaviour. Works
      with either ``ratio_to``; ``None`` disables. On the calculator example at ``max_staleness: 4`` it does not
      prevent the collapse (docs/benchmarks/async_rl.md).
    - ``mismatch_kl_target``: a trust region on the policy's drift from the samples it trains on: each optimizer
      step's learning rate is multiplied by ``min(1, target / mismatch_kl)``, where ``mismatch_kl`` is the
      mini-batch's KL(rollout || current policy) per trained token (the ``mismatch_kl`` metric). Under Adam the
      step size is about the learning rate whatever the gradient's size, so shrinking the gradient cannot
      slow a policy that runs ahead of its stale samples; this shrinks the step. On-policy batches (the
      synchronous loop) have a mismatch near 0 and train at the full rate. The applied factor is the
      ``lr_scale`` metric. ``None`` disables. On the calculator example at ``max_staleness: 4``, ``0.002``
      matches the synchronous loop's held-out success with no collapse (docs/benchmarks/async_rl.md).
    - ``kl_coef`` / ``kl_estimator``: KL penalty to a reference policy (``k1`` or ``k3``); 0 disables.
    - ``entropy_coef``: entropy bonus (subtracted from the loss); the entropy metric is reported regardless.
    """

    policy_loss: PolicyLoss = "ppo"
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2
    dual_clip_c: float | None = None
    aggregation: Aggregation = "token-mean"
    norm_length: int | None = None
    tis_cap: float | None = None
    icepop: tuple[float, float] | None = None
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k3"] = "k3"
    entropy_coef: float = 0.0
    ratio_to: RatioTo | None = None
    seq_mask_log_ratio: float | None = None
    mismatch_kl_target: float | None = None

    def __post_init__(self) -> None:
        if self.policy_loss not in POLICY_LOSSES:
            raise ConfigError("policy_loss", f"must be one of {POLICY_LOSSES}, got {self.policy_loss!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError("aggregation", f"must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if not 0 <= self.eps_clip_low < 1:
            raise ConfigError("eps_clip_low", f"must be in [0, 1), got {self.eps_clip_low}")
        if not self.eps_clip_high >= 0:
            raise ConfigError("eps_clip_high", f"must be >= 0, got {self.eps_clip_high}")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1:
            raise ConfigError("dual_clip_c", f"must be > 1 (or null), got {self.dual_clip_c}")
        if self.aggregation == "seq-mean-token-sum-norm" and not (self.norm_length and self.norm_length > 0):
            raise ConfigError("norm_length", "seq-mean-token-sum-norm needs a positive norm_length")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ConfigError("tis_cap", f"must be > 0 (or null), got {self.tis_cap}")
        if self.icepop is not None:
            if len(self.icepop) != 2 or not 0 <= self.icepop[0] < self.icepop[1]:
                raise ConfigError("icepop", f"must be [low, high] with 0 <= low < high, got {self.icepop}")
            object.__setattr__(self, "icepop", (float(self.icepop[0]), float(self.icepop[1])))
        if self.ratio_to is not None and self.ratio_to not in RATIO_TO:
            raise ConfigError("ratio_to", f"must be one of {RATIO_TO}, got {self.ratio_to!r}")
        if self.ratio_to == "rollout" and (self.tis_cap is not None or self.icepop is not None):
            raise ConfigError(
                "ratio_to",
                "with ratio_to: rollout the ratio is already the importance weight of "
                "the rollout policy; set tis_cap and icepop to null",
            )
        if self.seq_mask_log_ratio is not None and not self.seq_mask_log_ratio > 0:
            raise ConfigError("seq_mask_log_ratio", f"must be > 0 (or null), got {self.seq_mask_log_ratio}")
        if self.mismatch_kl_target is not None and not (
            math.isfinite(self.mismatch_kl_target) and self.mismatch_kl_target > 0
        ):
            raise ConfigError(
                "mismatch_kl_target", f"must be a finite number > 0 (or null), got {self.mismatch_kl_target}"
            )
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError("kl_estimator", f"must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.kl_coef < 0:
            raise ConfigError("kl_coef", f"must be >= 0, got {self.kl_coef}")

    @property
    def needs_rollout_logprobs(self) -> bool:
        return self.tis_cap is not None or self.icepop is not None or self.ratio_to == "rollout"


@dataclass
class LossInputs:
    """Flat per-token tensors of one micro-batch (all ``[T]``)."""

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    seq_index: torch.Tensor
    rollout_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    turn_index: torch.Tensor | None = None  # the model turn of each token (-1: not the model's)


@dataclass
class LossOutput:
    """The scalar loss to backpropagate, and metric ``(sum, count)`` pairs to reduce over micro-batches."""

    loss: torch.Tensor
    pg_loss: torch.Tensor | None = None
    metric_sums: dict[str, tuple[float, float]] = field(default_factory=dict)


def aggregate(
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_index: torch.Tensor,
    mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_length: int | None = None,
) -> torch.Tensor:
    """Reduce per-token ``values`` (already zero where they should not count) to a scalar.

    Denominators come from ``loss_mask``; ``num_tokens`` / ``num_seqs`` default to this micro-batch's own
    (masked tokens, sequences with at least one masked token).
    """
    mask = loss_mask.to(values.dtype)
    masked = values * mask
    if num_tokens is None:
        num_tokens = float(mask.sum())
    if num_seqs is None:
        num_seqs = float(_seq_sums(mask, seq_index).gt(0).sum())
    if mode == "token-mean":
        return masked.sum() / max(num_tokens, 1.0)
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(num_seqs, 1.0)
    if mode == "seq-mean-token-sum-norm":
        if not norm_length:
            raise ValueError("seq-mean-token-sum-norm needs norm_length")
        return masked.sum() / (max(num_seqs, 1.0) * norm_length)
    if mode == "seq-mean-token-mean":
        per_seq = _seq_sums(masked, seq_index)
        counts = _seq_sums(mask, seq_index)
        return (per_seq / counts.clamp(min=1.0)).sum() / max(num_seqs, 1.0)
    raise ValueError(f"unknown aggregation {mode!r}; expected one of {AGGREGATIONS}")


def _seq_sums(values: torch.Tensor, seq_index: torch.Tensor) -> torch.Tensor:
    n = int(seq_index.max()) + 1 if seq_index.numel() else 0
    return torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, seq_index, values)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate from samples of pi: k1 = log pi - log ref; k3 = e^d - d - 1, d = ref - pi."""
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k3":
        d = ref_logprobs - logprobs
        return torch.exp(d) - d - 1
    raise ValueError(f"unknown kl estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


def seq_keep_mask(
    log_ratio: torch.Tensor, loss_mask: torch.Tensor, seq_index: torch.Tensor, threshold: float
) -> torch.Tensor:
    """Per token: 1 where the token's sequence has no loss-masked token with ``|log_ratio|`` above
    ``threshold``, else 0."""
    far = ((log_ratio.detach().abs() > threshold) & (loss_mask > 0)).to(torch.float64)
    bad_seq = _seq_sums(far, seq_index) > 0
    return (~bad_seq[seq_index]).to(loss_mask.dtype)


def mismatch_lr_scale(mismatch: tuple[float, float] | None, target: float | None) -> float:
    """The factor `LossConfig.mismatch_kl_target` puts on one optimizer step's learning rate:
    ``min(1, target / kl)`` for the mini-batch's mismatch ``(sum, count)`` of per-token KL(rollout || current)
    (the ``mismatch_kl`` metric's pair, summed over the mini-batch's micro-batches and ranks); 1 when the rule is
    off, when no token was counted, or when the KL is at most the target. A non-finite KL gives 0 (no move)."""
    if target is None or mismatch is None or mismatch[1] <= 0:
        return 1.0
    kl = mismatch[0] / mismatch[1]
    if not math.isfinite(kl):
        return 0.0
    return 1.0 if kl <= target else target / kl


def ratio_reference(inputs: LossInputs, config: LossConfig) -> torch.Tensor:
    """The logprobs the ratio is taken against: ``old_logprobs``, or ``rollout_logprobs`` for ``ratio_to:
    rollout``."""
    if config.ratio_to != "rollout":
        return inputs.old_logprobs
    if inputs.rollout_logprobs is None:
        raise ValueError("ratio_to: rollout needs rollout_logprobs")
    return inputs.rollout_logprobs.to(inputs.logprobs.dtype)


def policy_ratio(inputs: LossInputs, config: LossConfig) -> torch.Tensor:
    """Per-token importance ratio: the token ratio (PPO) or the sequence's geometric-mean ratio (GSPO).

    For GSPO the value of every token's ratio is ``exp(mean_t(logp - old))`` over the sequence's masked tokens,
    and its gradient is that of ``exp(logp_t)`` scaled by the sequence ratio (GSPO-token form), which with
    ``seq-mean-token-mean`` aggregation gives exactly the sequence-level GSPO gradient.
    """
    log_ratio = inputs.logprobs - ratio_reference(inputs, config)
    if config.policy_loss == "ppo":
        return torch.exp(log_ratio)
    mask = inputs.loss_mask.to(log_ratio.dtype)
    seq_log_ratio = _seq_sums(log_ratio * mask, inputs.seq_index) / _seq_sums(mask, inputs.seq_index).clamp(
        min=1
    )
    token_seq_log_ratio = seq_log_ratio.detach()[inputs.seq_index]
    return torch.exp(token_seq_log_ratio + inputs.logprobs - inputs.logprobs.detach())


def policy_loss(
    inputs: LossInputs, config: LossConfig, *, num_tokens: float | None = None, num_seqs: float | None = None
) -> LossOutput:
    """PPO-clip / GSPO loss with optional dual clip, TIS, IcePop masking, KL penalty and entropy bonus."""
    mask = inputs.loss_mask.to(inputs.logprobs.dtype)
    adv = inputs.advantages.to(inputs.logprobs.dtype)
    ratio = policy_ratio(inputs, config)
    clipped_ratio = ratio.clamp(1.0 - config.eps_clip_low, 1.0 + config.eps_clip_high)
    pg1 = -adv * ratio
    pg2 = -adv * clipped_ratio
    pg = torch.maximum(pg1, pg2)
    sums: dict[str, tuple[float, float]] = {}
    n_tok = float(mask.sum())

    def _add(name: str, per_token: torch.Tensor) -> None:
        sums[name] = (float((per_token.detach().to(torch.float64) * mask).sum()), n_tok)

    _add("clip_frac", (pg2 > pg1).to(mask.dtype))
    _add("clip_frac_low", ((ratio < 1.0 - config.eps_clip_low) & (adv < 0)).to(mask.dtype))
    _add("clip_frac_high", ((ratio > 1.0 + config.eps_clip_high) & (adv > 0)).to(mask.dtype))
    if config.dual_clip_c is not None:
        pg3 = -adv * config.dual_clip_c
        dual = (adv < 0) & (pg3 < pg)
        pg = torch.where(adv < 0, torch.minimum(pg, pg3), pg)
        _add("dual_clip_frac", dual.to(mask.dtype))

    log_ratio = (inputs.logprobs - ratio_reference(inputs, config)).detach()
    _add("approx_kl", torch.exp(log_ratio) - 1 - log_ratio)
    _add("ratio_mean", ratio)

    keep = torch.ones_like(mask)
    if config.seq_mask_log_ratio is not None:
        if inputs.rollout_logprobs is None:
            raise ValueError("seq_mask_log_ratio needs rollout_logprobs")
        seq_log_ratio = inputs.old_logprobs - inputs.rollout_logprobs.to(inputs.old_logprobs.dtype)
        seq_keep = seq_keep_mask(seq_log_ratio, inputs.loss_mask, inputs.seq_index, config.seq_mask_log_ratio)
        _add("seq_masked_token_frac", 1.0 - seq_keep)
        seq_w = _seq_sums(mask, inputs.seq_index) > 0
        kept_seq = _seq_sums(seq_keep.to(mask.dtype) * mask, inputs.seq_index) > 0
        sums["seq_masked_frac"] = (float((seq_w & ~kept_seq).sum()), float(seq_w.sum()))
        pg = pg * seq_keep
    if config.tis_cap is not None or config.icepop is not None:
        if inputs.rollout_logprobs is None:
            raise ValueError("tis_cap / icepop need rollout_logprobs")
        is_ratio = torch.exp((inputs.old_logprobs - inputs.rollout_logprobs).detach())
        if config.icepop is not None:
            low, high = config.icepop
            keep = ((is_ratio >= low) & (is_ratio <= high)).to(mask.dtype)
            _add("icepop_masked_frac", 1.0 - keep)
            pg = pg * keep
        if config.tis_cap is not None:
            weight = is_ratio.clamp(max=config.tis_cap)
            _add("tis_clip_frac", (is_ratio > config.tis_cap).to(mask.dtype))
            _add("tis_weight_mean", weight)
            pg = pg * weight
    if inputs.rollout_logprobs is not None:
        for name, value in logprob_mismatch_sums(
            inputs.old_logprobs.detach(),
            inputs.rollout_logprobs,
            inputs.loss_mask,
            turn_index=inputs.turn_index,
        ).items():
            sums[name] = value

    agg = {"num_tokens": num_tokens, "num_seqs": num_seqs, "norm_length": config.norm_length}
    pg_loss = aggregate(pg, inputs.loss_mask, inputs.seq_index, config.aggregation, **agg)
    loss = pg_loss
    if inputs.ref_logprobs is not None:
        kl = kl_penalty(inputs.logprobs, inputs.ref_logprobs, config.kl_estimator)
        _add("ref_kl", kl)
        if config.kl_coef > 0:
            loss = loss + config.kl_coef * aggregate(
                kl, inputs.loss_mask, inputs.seq_index, config.aggregation, **agg
            )
    elif config.kl_coef > 0:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if inputs.entropy is not None:
        _add("entropy", inputs.entropy)
        if config.entropy_coef != 0:
            loss = loss - config.entropy_coef * aggregate(
                inputs.entropy, inputs.loss_mask, inputs.seq_index, config.aggregation, **agg
            )
    elif config.entropy_coef != 0:
        raise ValueError("entropy_coef != 0 needs entropy")
    return LossOutput(loss=loss, pg_loss=pg_loss.detach(), metric_sums=sums)


def sft_loss(
    logprobs: torch.Tensor, loss_mask: torch.Tensor, *, num_tokens: float | None = None
) -> LossOutput:
    """Cross-entropy on loss-masked tokens, averaged over ``num_tokens`` (default: this micro-batch's)."""
    mask = loss_mask.to(logprobs.dtype)
    n = float(mask.sum()) if num_tokens is None else num_tokens
    loss = -(logprobs * mask).sum() / max(n, 1.0)
    nll = float(-(logprobs.detach().to(torch.float64) * mask).sum())
    return LossOutput(loss=loss, metric_sums={"sft_nll": (nll, float(mask.sum()))})
