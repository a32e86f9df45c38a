"""Training metrics: reward statistics by group, train-vs-rollout logprob mismatch, and their reduction."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from miles.learner.advantages import group_stats


class MetricAccumulator:
    """Sums ``(sum, count)`` pairs over micro-batches and reports ``sum / count`` per name.

    A name ending in ``_max`` holds ``(max, 1)`` pairs instead: it keeps the largest value seen.
    """

    def __init__(self) -> None:
        self._sums: dict[str, float] = defaultdict(float)
        self._counts: dict[str, float] = defaultdict(float)

    def add(self, name: str, total: float, count: float = 1.0) -> None:
        if name.endswith("_max"):
            seen = self._counts[name] > 0
            self._sums[name] = max(self._sums[name], float(total)) if seen else float(total)
            self._counts[name] = 1.0
            return
        self._sums[name] += float(total)
        self._counts[name] += float(count)

    def update(self, sums: dict[str, tuple[float, float]]) -> None:
        for name, (total, count) in sums.items():
            self.add(name, total, count)

    def result(self) -> dict[str, float]:
        return {k: (self._sums[k] / self._counts[k] if self._counts[k] else 0.0) for k in self._sums}

    def sums(self) -> dict[str, tuple[float, float]]:
        """The ``(sum, count)`` pairs accumulated so far, by name."""
        return {k: (self._sums[k], self._counts[k]) for k in self._sums}


def reduce_metrics(acc: MetricAccumulator) -> dict[str, float]:
    """`acc.result()` over every rank of the default process group (a collective when there are several):
    each rank contributes the ``(sum, count)`` pairs of the micro-batches it ran."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return acc.result()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, acc.sums())
    merged = MetricAccumulator()
    for part in gathered:
        merged.update(part)
    return merged.result()


#: Model turns whose mismatch is reported on its own (`mismatch_abs_turnK`); later turns share `..._turn3plus`.
SPLIT_TURNS = 3


def logprob_mismatch_sums(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    turn_index: torch.Tensor | None = None,
) -> dict[str, tuple[float, float]]:
    """Train-vs-rollout logprob mismatch on the same (masked) tokens, as ``(sum, count)`` pairs.

    - ``mismatch_abs``: mean ``|logp_train - logp_rollout|``;
    - ``mismatch_kl``: KL(rollout || train) by the non-negative k3 estimator on rollout samples,
      ``e^d - d - 1`` with ``d = logp_train - logp_rollout``;
    - ``mismatch_k1``: the plain estimator ``logp_rollout - logp_train``;
    - ``mismatch_kl_max``: the largest per-token k3 term (a ``(max, 1)`` pair, see `MetricAccumulator`);
    - the tail of the importance ratio ``exp(logp_train - logp_rollout)``, which a mean hides:
      ``ratio_outside_10pct`` and ``ratio_outside_2x``, the shares of tokens whose ratio lies outside
      [0.9, 1.1] and [0.5, 2], and ``log_ratio_abs_max``, the largest ``|log ratio|``;
    - with ``turn_index`` (each token's model turn), ``mismatch_abs_turnK`` and ``log_ratio_abs_max_turnK``
      for the first `SPLIT_TURNS` turns and ``..._turn3plus`` for the rest: drift shows in later turns first.
    """
    mask = loss_mask.to(torch.float64)
    d = (train_logprobs.detach().to(torch.float64) - rollout_logprobs.to(torch.float64)) * mask
    n = float(mask.sum())
    k3 = (torch.exp(d) - d - 1) * mask
    ratio = torch.exp(d)
    out = {
        "mismatch_abs": (float(d.abs().sum()), n),
        "mismatch_kl": (float(k3.sum()), n),
        "mismatch_k1": (float((-d).sum()), n),
        "ratio_outside_10pct": (float((((ratio < 0.9) | (ratio > 1.1)).to(torch.float64) * mask).sum()), n),
        "ratio_outside_2x": (float((((ratio < 0.5) | (ratio > 2.0)).to(torch.float64) * mask).sum()), n),
    }
    if n:
        out["mismatch_kl_max"] = (float(k3.max()), 1.0)
        out["log_ratio_abs_max"] = (float(d.abs().max()), 1.0)
    if turn_index is not None:
        for k in range(SPLIT_TURNS + 1):
            label = f"turn{k}" if k < SPLIT_TURNS else f"turn{SPLIT_TURNS}plus"
            sel = (turn_index == k) if k < SPLIT_TURNS else (turn_index >= SPLIT_TURNS)
            weight = mask * sel.to(torch.float64)
            count = float(weight.sum())
            if count:
                out[f"mismatch_abs_{label}"] = (float((d.abs() * weight).sum()), count)
                out[f"log_ratio_abs_max_{label}"] = (float((d.abs() * weight).max()), 1.0)
    return out


def logprob_mismatch(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor
) -> dict[str, float]:
    """`logprob_mismatch_sums` reduced to means."""
    acc = MetricAccumulator()
    acc.update(logprob_mismatch_sums(train_logprobs, rollout_logprobs, loss_mask))
    return acc.result()


def reward_metrics(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, zero_std_tol: float = 1e-8
) -> dict[str, float]:
    """Reward mean/std over the batch and by group, and the fraction of groups whose rewards are all equal.

    ``reward_std`` is the batch's sample std; ``group_reward_std`` is the mean of per-group sample stds;
    ``zero_std_group_frac`` counts groups (of any size) with no reward spread, which give GRPO no signal.
    """
    if rewards.numel() == 0:
        return {
            "reward_mean": 0.0,
            "reward_std": 0.0,
            "group_reward_mean": 0.0,
            "group_reward_std": 0.0,
            "zero_std_group_frac": 0.0,
            "num_groups": 0.0,
        }
    stats = group_stats(rewards, group_ids)
    r = rewards.to(torch.float64)
    return {
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std()) if r.numel() > 1 else 0.0,
        "group_reward_mean": float(stats.mean.mean()),
        "group_reward_std": float(stats.std.mean()),
        "zero_std_group_frac": float((stats.std <= zero_std_tol).to(torch.float64).mean()),
        "num_groups": float(stats.count.numel()),
    }


def train_step_metrics(
    batch: Any,
    *,
    adv_seq: torch.Tensor,
    losses: list[float],
    grad_norms: list[float],
    lr: float,
    step: int,
    temperature: float,
    t0: float,
    micro_batches: int,
    nonfinite_steps: int = 0,
) -> dict[str, float]:
    """The per-step scalars both backends report after an RL step (besides the loss metrics).

    ``micro_batches``: forward/backward passes this rank ran for the update (old/reference logprob passes
    not counted). ``nonfinite_steps``: optimizer steps of the update that were skipped because the gradient
    was NaN or inf (the weights did not move)."""
    metrics = reward_metrics(batch.rewards, batch.group_ids)
    metrics.update(
        {
            "loss": sum(losses) / max(len(losses), 1),
            "grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
            "lr": lr,
            "advantage_abs_mean": float(adv_seq.abs().mean()) if adv_seq.numel() else 0.0,
            "num_tokens": float(batch.token_ids.numel()),
            "num_train_tokens": float(batch.loss_mask.sum()),
            "num_sequences": float(batch.num_sequences),
            "optimizer_steps": float(len(grad_norms)),
            "nonfinite_steps": float(nonfinite_steps),
            "micro_batches": float(micro_batches),
            "step": float(step),
            "temperature": temperature,
            "step_time_s": time.perf_counter() - t0,
        }
    )
    return metrics
