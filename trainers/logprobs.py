"""Per-token logprobs and entropy from a causal LM's logits over packed sequences."""

from __future__ import annotations

import torch


def shifted_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, seq_starts: torch.Tensor,
                           temperature: float = 1.0) -> torch.Tensor:
    """Logprob of every packed token under the logits of the position before it.

    ``logits``: ``[N, V]`` for ``N`` packed tokens; ``token_ids``: ``[N]``; ``seq_starts``: indices (into the
    ``N`` tokens) where a sequence begins. Token ``t`` gets ``log_softmax(logits[t-1] / T)[token_ids[t]]``;
    the first token of each sequence has no predecessor and gets 0. Computed in float32.
    """
    scaled = _scale(logits, temperature)
    nxt = torch.zeros_like(token_ids)
    nxt[:-1] = token_ids[1:]
    picked = scaled.gather(-1, nxt.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    out = torch.zeros(token_ids.shape, dtype=picked.dtype, device=picked.device)
    out[1:] = picked[:-1]
    out[seq_starts] = 0.0
    return out


def shifted_entropy(logits: torch.Tensor, seq_starts: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the distribution that predicted each packed token (0 for sequence starts), in float32."""
    scaled = _scale(logits, temperature)
    logp = torch.log_softmax(scaled, dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    out = torch.zeros(ent.shape, dtype=ent.dtype, device=ent.device)
    out[1:] = ent[:-1]
    out[seq_starts] = 0.0
    return out


def _scale(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 to recompute logprobs, got {temperature}")
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature
