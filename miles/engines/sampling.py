"""Batched next-token sampling on the device: per-row settings, per-request seeds, one tensor op per stage.

Which logprob is reported: for a sampled row (temperature > 0) the logprob of the chosen token under the
distribution it was drawn from: `log_softmax(logits / temperature)`, renormalised over the tokens top-k/top-p
kept when the row filters. With it comes the row's *kept count*, how many tokens survived the filter (0 for a
row that does not filter): a trainer reproduces the logprob from its own logits by keeping its own
`count` largest logits (`miles.learner.logprobs`), which is robust to float differences between the two,
where a logit threshold would not be. For a greedy row (temperature == 0) it is the raw `log_softmax(logits)`
of the argmax token, with count 0.

Randomness is counter-based: the uniform number that picks a request's `i`-th token is a hash of the
request's 32-bit key (derived from its seed) and `i`, inverted through the row's cumulative distribution.
A seeded request therefore draws the same tokens whatever else shares its batch, on any device, and the
whole sampler is a fixed sequence of tensor ops with no host synchronisation (it can live in a CUDA graph).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class RowSampling:
    """The sampling settings of one batch row; `key` selects its random stream (see `seed_key`)."""

    temperature: float
    top_p: float = 1.0
    top_k: int = -1
    key: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def filters(self) -> bool:
        return not self.greedy and ((self.top_k > 0) or self.top_p < 1.0)


@dataclass(frozen=True)
class SampleMode:
    """Which kinds of rows a batch holds, so `sample` skips what none of them needs."""

    greedy: bool  # some row decodes greedily
    sampled: bool  # some row samples
    filters: bool  # some sampled row uses top-k or top-p

    @classmethod
    def of(cls, rows: Iterable[RowSampling]) -> SampleMode:
        greedy = sampled = filters = False
        for r in rows:
            greedy |= r.greedy
            sampled |= not r.greedy
            filters |= r.filters
        return cls(greedy, sampled, filters)


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling settings as device tensors of one batch (`[B]` each)."""

    temperature: torch.Tensor  # float32; <= 0 means greedy
    top_k: torch.Tensor  # int64; <= 0 keeps all
    top_p: torch.Tensor  # float32; >= 1 keeps all
    key: torch.Tensor  # int64 in [0, 2**32)
    step: torch.Tensor  # int64: the index of the token being drawn within its request

    @classmethod
    def build(cls, rows: list[RowSampling], steps: list[int], device: torch.device | str) -> SamplingTensors:
        """Tensors for `rows`, drawing token number `steps[i]` of row `i`."""
        return cls(
            torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=device),
            torch.tensor([r.top_k for r in rows], dtype=torch.int64, device=device),
            torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=device),
            torch.tensor([r.key for r in rows], dtype=torch.int64, device=device),
            torch.tensor(steps, dtype=torch.int64, device=device),
        )


def seed_key(seed: int) -> int:
    """A request's 32-bit random-stream key from its integer seed (splitmix64, stable across runs)."""
    z = (int(seed) + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _M32


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """`(x * c) mod 2**32` for int64 `x` in [0, 2**32), without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser: a bijection on [0, 2**32) that mixes every input bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def uniform(key: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """One float32 in [0, 1) per row, a pure function of (key, step); 24 random bits."""
    x = _fmix32(key ^ _fmix32(step & _M32))
    return (x >> 8).to(torch.float32) * (1.0 / (1 << 24))


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


def sample(
    logits: torch.Tensor, rows: SamplingTensors, mode: SampleMode
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick one token per row of `logits` ([B, V]); returns (token ids int64 [B], their logprobs float32 [B],
    kept counts int64 [B]): the logprob under the distribution sampled from and, for a row that filters, how
    many tokens top-k/top-p kept (0 for the others; see the module docstring).

    `mode` says which kinds of rows the batch holds (`SampleMode.of`); work no row needs is skipped.
    """
    logits = logits.float()
    greedy = rows.temperature <= 0
    scaled = logits
    if mode.sampled:
        scaled = logits / torch.where(greedy, torch.ones_like(rows.temperature), rows.temperature)[:, None]
    logprobs_all = torch.log_softmax(scaled, dim=-1)
    tokens = None
    kept = torch.zeros_like(rows.top_k)
    if mode.sampled:
        if mode.filters:
            scaled = _filter_top_k_top_p(scaled, rows.top_k, rows.top_p)
            filters = ~greedy & ((rows.top_k > 0) | (rows.top_p < 1.0))
            kept = torch.where(filters, torch.isfinite(scaled).sum(-1), kept)
            # a filtering row reports the logprob under the renormalised distribution it draws from
            logprobs_all = torch.where(filters[:, None], torch.log_softmax(scaled, dim=-1), logprobs_all)
        cdf = torch.cumsum(torch.softmax(scaled, dim=-1), dim=-1)
        total = cdf[:, -1]
        # strictly below the total, the first cdf entry above the target is a token of nonzero probability
        target = torch.minimum(
            uniform(rows.key, rows.step) * total, torch.nextafter(total, torch.zeros_like(total))
        )
        tokens = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
    if mode.greedy:
        best = logits.argmax(-1)
        tokens = best if tokens is None else torch.where(greedy, best, tokens)
    return tokens, logprobs_all.gather(-1, tokens[:, None]).squeeze(-1), kept
