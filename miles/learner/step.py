"""The prologue every trainer runs before an RL or SFT step: batch validation, the temperature, advantages,
and the mini-batches with their batch-global loss denominators."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from miles.learner.advantages import batch_advantages
from miles.learner.batching import split_even
from miles.learner.config import AlgorithmConfig
from miles.trajectory import TrajectoryBatch


def validate_batch(batch: TrajectoryBatch) -> TrajectoryBatch:
    """`batch` itself when its tensors agree with each other; a `ValueError` naming the disagreement otherwise."""
    t = batch.token_ids.numel()
    if batch.loss_mask.numel() != t or batch.rollout_logprobs.numel() != t:
        raise ValueError(
            f"batch tensors disagree: token_ids={t} loss_mask={batch.loss_mask.numel()} "
            f"rollout_logprobs={batch.rollout_logprobs.numel()}"
        )
    if batch.cu_seqlens.numel() < 1 or int(batch.cu_seqlens[-1]) != t or int(batch.cu_seqlens[0]) != 0:
        raise ValueError(f"cu_seqlens must run from 0 to {t}, got {batch.cu_seqlens.tolist()}")
    if bool((batch.cu_seqlens[1:] <= batch.cu_seqlens[:-1]).any()):
        raise ValueError("every sequence of the batch must have at least one token")
    if batch.rewards.numel() != batch.num_sequences or batch.group_ids.numel() != batch.num_sequences:
        raise ValueError("rewards and group_ids need one entry per sequence")
    return batch


def resolve_temperature(batch: TrajectoryBatch, override: float | None) -> float:
    """The temperature logprobs are recomputed at: `override` (``trainer.temperature``) when set, else the one
    the batch was sampled at (``meta[i]["sampling_params"]["temperature"]``, 1.0 when absent)."""
    if override is not None:
        return float(override)
    temps = {float(m.get("sampling_params", {}).get("temperature", 1.0) or 1.0) for m in batch.meta}
    if len(temps) > 1:
        raise ValueError(f"batch mixes rollout temperatures {sorted(temps)}; set trainer.temperature")
    return temps.pop() if temps else 1.0


def replayed_kept_counts(
    batch: TrajectoryBatch, enabled: bool, lo: int, hi: int, device: torch.device | str
) -> torch.Tensor | None:
    """The sampler's kept counts of tokens ``[lo, hi)`` of `batch`, on `device`, when sampling-mask replay is
    `enabled` (``trainer.sampling_mask``) and the engine recorded any (`TrajectoryBatch.kept_counts`); else
    None: the logprobs are then taken over the whole vocabulary."""
    if not enabled or batch.kept_counts is None:
        return None
    return batch.kept_counts[lo:hi].to(device)


@dataclass(frozen=True)
class MiniBatch:
    """Sequences ``[lo, hi)`` of one optimizer step, with the loss denominators of the whole mini-batch."""

    lo: int
    hi: int
    num_tokens: float  # trained (loss-masked) tokens
    num_seqs: float  # sequences with at least one trained token


@dataclass(frozen=True)
class RLStep:
    """One RL step's inputs, computed once on the whole batch (groups may span ranks)."""

    batch: TrajectoryBatch
    temperature: float
    token_counts: torch.Tensor  # [B] trained tokens per sequence
    adv_seq: torch.Tensor  # [B]
    adv_tok: torch.Tensor  # [T]
    algorithm: AlgorithmConfig

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether the old (proximal) logprobs need a forward-only pass: with more than one optimizer step per
        batch they differ from the current ones, unless the ratio is taken against the rollout policy
        (`LossConfig.ratio_to`)."""
        return (
            self.algorithm.num_mini_batches > 1 or self.algorithm.ppo_epochs > 1
        ) and self.algorithm.loss.ratio_to != "rollout"

    def mini_batches(self) -> Iterator[MiniBatch]:
        """``ppo_epochs`` passes over ``num_mini_batches`` even splits, skipping those with no trained token."""
        b = self.batch
        for _ in range(self.algorithm.ppo_epochs):
            for lo, hi in split_even(b.num_sequences, self.algorithm.num_mini_batches):
                tok_lo, tok_hi = int(b.cu_seqlens[lo]), int(b.cu_seqlens[hi])
                num_tokens = float(b.loss_mask[tok_lo:tok_hi].sum())
                if num_tokens > 0:
                    yield MiniBatch(lo, hi, num_tokens, float((self.token_counts[lo:hi] > 0).sum()))


def prepare_rl_step(batch: TrajectoryBatch, algorithm: AlgorithmConfig, temperature: float | None) -> RLStep:
    """Validate `batch`, resolve its temperature and compute its advantages."""
    batch = validate_batch(batch)
    token_counts, adv_seq, adv_tok = batch_advantages(batch, algorithm.advantage)
    return RLStep(
        batch=batch,
        temperature=resolve_temperature(batch, temperature),
        token_counts=token_counts,
        adv_seq=adv_seq,
        adv_tok=adv_tok,
        algorithm=algorithm,
    )
