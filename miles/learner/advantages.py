"""Sequence-level advantages from rewards and group ids (GRPO, Dr.GRPO, REINFORCE++ with a baseline).

Groups are identified by `group_ids` (one integer per sequence, as in `TrajectoryBatch.group_ids`), so
groups may have different sizes and filtered samples simply do not appear; group ids need not be contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from miles.learner.errors import ConfigError

Estimator = Literal["grpo", "dr_grpo", "reinforce_pp_baseline", "rloo"]
ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "reinforce_pp_baseline", "rloo")


@dataclass(frozen=True)
class AdvantageConfig:
    """How rewards become advantages.

    - ``grpo``: ``(r - mean_group) / (std_group + eps)``; with ``normalize_std=False`` only the mean is removed.
      ``std`` is the sample (n-1) standard deviation of the group; a group of one has advantage 0.
    - ``dr_grpo``: ``r - mean_group`` (no std division; pair with a constant-length aggregation, see losses).
    - ``reinforce_pp_baseline``: ``r - mean_group``, then whitened over the whole batch
      (token-weighted when token counts are given, as REINFORCE++ whitens per token).
    - ``rloo``: leave-one-out baseline ``r - mean(other samples of the group)``.
    """

    estimator: Estimator = "grpo"
    normalize_std: bool = True
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ConfigError("estimator", f"must be one of {ESTIMATORS}, got {self.estimator!r}")
        if not self.eps > 0:
            raise ConfigError("eps", f"must be > 0, got {self.eps}")


@dataclass(frozen=True)
class GroupStats:
    """Per-sequence statistics of each sequence's group (broadcast to the sequence)."""

    index: torch.Tensor  # int64 [B]: dense group index 0..G-1
    count: torch.Tensor  # float [G]
    mean: torch.Tensor  # float [G]
    std: torch.Tensor  # float [G], sample std (0 for groups of one)


def group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> GroupStats:
    """Mean, sample std and size of every group, with a dense index from sequences to groups."""
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be equal 1-D"
        )
    rewards = rewards.to(torch.float64)
    _, index = torch.unique(group_ids, return_inverse=True)
    num_groups = int(index.max()) + 1 if index.numel() else 0
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, index, torch.ones_like(rewards))
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, index, rewards) / count
    sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, index, (rewards - mean[index]) ** 2)
    std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))
    return GroupStats(index=index, count=count, mean=mean, std=std)


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    config: AdvantageConfig | None = None,
    *,
    token_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """One advantage per sequence (float32, shape of `rewards`).

    `token_counts` (number of trained tokens per sequence) weights the batch whitening of
    ``reinforce_pp_baseline``; other estimators ignore it.
    """
    config = config or AdvantageConfig()
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=torch.float32)
    stats = group_stats(rewards, group_ids)
    r = rewards.to(torch.float64)
    centered = r - stats.mean[stats.index]
    if config.estimator == "grpo":
        adv = centered / (stats.std[stats.index] + config.eps) if config.normalize_std else centered
    elif config.estimator == "dr_grpo":
        adv = centered
    elif config.estimator == "rloo":
        n = stats.count[stats.index]
        adv = torch.where(n > 1, centered * n / (n - 1).clamp(min=1), torch.zeros_like(centered))
    else:  # reinforce_pp_baseline
        w = torch.ones_like(r) if token_counts is None else token_counts.to(torch.float64)
        if w.shape != r.shape:
            raise ValueError(f"token_counts {tuple(w.shape)} must match rewards {tuple(r.shape)}")
        total = w.sum()
        if total <= 0:
            return torch.zeros_like(rewards, dtype=torch.float32)
        mu = (w * centered).sum() / total
        var = (w * (centered - mu) ** 2).sum() / total
        adv = (centered - mu) / (var.sqrt() + config.eps)
    return adv.to(torch.float32)


def expand_to_tokens(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Repeat one value per sequence over that sequence's tokens: [B] -> [T]."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(values.device)
    return torch.repeat_interleave(values, lengths)


def sequence_index(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """For every packed token, the index of its sequence: [T] int64."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)


def batch_advantages(batch: Any, config: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a packed `TrajectoryBatch`: generated tokens per sequence [B], advantages per sequence [B], and
    the advantages expanded to every token [T]."""
    c = torch.zeros(batch.loss_mask.numel() + 1, dtype=torch.float64)
    c[1:] = torch.cumsum(batch.loss_mask.to(torch.float64), 0)
    token_counts = (c[batch.cu_seqlens[1:]] - c[batch.cu_seqlens[:-1]]).to(torch.float32)
    adv_seq = compute_advantages(batch.rewards, batch.group_ids, config, token_counts=token_counts)
    return token_counts, adv_seq, expand_to_tokens(adv_seq, batch.cu_seqlens)
