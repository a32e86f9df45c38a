"""Batched next-token sampling with per-row settings and per-row seeded generators.

Which logprob is reported: for a sampled row (temperature > 0) the logprob of the chosen token under
`log_softmax(logits / temperature)`, i.e. the temperature-scaled distribution *before* top-k/top-p
filtering. This is what a trainer reproduces from its own logits with `log_softmax(logits / T)`.
For a greedy row (temperature == 0) it is the raw `log_softmax(logits)` of the argmax token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowSampling:
    """The sampling settings of one batch row."""

    temperature: float
    top_p: float = 1.0
    top_k: int = -1
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def filters(self) -> bool:
        return (self.top_k > 0) or self.top_p < 1.0


def _filter_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p remove, row by row. `top_k <= 0` and `top_p >= 1` keep all."""
    vocab = scaled.shape[-1]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    ranks = torch.arange(vocab, device=scaled.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    remove = ranks >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # probability mass strictly above each token
    remove |= (before >= top_p[:, None]) & (top_p[:, None] < 1.0)  # float rounding must not cut at p=1
    remove[:, 0] = False  # the most likely token always survives
    mask = torch.zeros_like(remove).scatter(-1, order, remove)
    return scaled.masked_fill(mask, float("-inf"))


def sample_rows(logits: torch.Tensor, rows: list[RowSampling],
                default_generator: torch.Generator | None = None) -> tuple[list[int], list[float]]:
    """Pick one token per row of `logits` ([B, V]) and return (token ids, their logprobs).

    Rows with a generator draw from it (reproducible per request); the others share `default_generator`.
    """
    logits = logits.float()
    temps = torch.tensor([r.temperature if not r.greedy else 1.0 for r in rows],
                         dtype=logits.dtype, device=logits.device)
    scaled = logits / temps[:, None]
    logprobs_all = torch.log_softmax(scaled, dim=-1)
    greedy_tokens = torch.argmax(logits, dim=-1)
    sample_idx = [i for i, r in enumerate(rows) if not r.greedy]
    tokens = greedy_tokens.clone()
    if sample_idx:
        sub = scaled[sample_idx]
        if any(rows[i].filters for i in sample_idx):
            top_k = torch.tensor([rows[i].top_k for i in sample_idx], device=logits.device)
            top_p = torch.tensor([rows[i].top_p for i in sample_idx], dtype=logits.dtype, device=logits.device)
            sub = _filter_top_k_top_p(sub, top_k, top_p)
        probs = torch.softmax(sub, dim=-1)
        shared = [j for j, i in enumerate(sample_idx) if rows[i].generator is None]
        if shared:
            drawn = torch.multinomial(probs[shared], 1, generator=default_generator).squeeze(-1)
            tokens[[sample_idx[j] for j in shared]] = drawn
        for j, i in enumerate(sample_idx):
            gen = rows[i].generator
            if gen is not None:
                tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
    chosen = logprobs_all.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens.tolist(), chosen.tolist()
