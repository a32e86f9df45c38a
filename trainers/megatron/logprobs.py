"""Per-token logprobs and entropy from vocab-parallel logits (each TP rank holds a slice of the vocabulary).

Same conventions as `miles.trainers.logprobs`: token ``t`` gets ``log_softmax(logits[t-1] / T)[token_ids[t]]``,
sequence starts get 0, computed in float32. Padded vocabulary entries (ids >= the true vocab size) get
a logit of -1e30, i.e. zero probability. The cross-rank sums use megatron's ``reduce_from_tensor_model_parallel_region``
(all-reduce forward, identity backward), which is exact here because every TP rank computes the same loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_PAD_LOGIT = -1e30  # finite, so that entropy gradients stay 0 (not 0 * inf) on padded vocabulary entries


def _tp_sum(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    if tp_size == 1:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x)


def _tp_group_info() -> tuple[int, int, object]:
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_group())


def _masked_scaled(logits: torch.Tensor, vocab_size: int, vocab_start: int, temperature: float) -> torch.Tensor:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 to recompute logprobs, got {temperature}")
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    local = z.size(-1)
    if vocab_start + local > vocab_size:
        ids = torch.arange(vocab_start, vocab_start + local, device=z.device)
        z = z.masked_fill(ids >= vocab_size, _PAD_LOGIT)
    return z


def _logsumexp(z: torch.Tensor, tp_size: int, group: object) -> torch.Tensor:
    m = z.detach().max(dim=-1).values
    if tp_size > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    s = torch.exp(z - m.unsqueeze(-1)).sum(-1)
    return m + torch.log(_tp_sum(s, tp_size))


def _shift(values: torch.Tensor, seq_starts: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(values)
    out[1:] = values[:-1]
    out[seq_starts] = 0.0
    return out


def vocab_parallel_shifted_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, seq_starts: torch.Tensor,
                                    vocab_size: int, temperature: float = 1.0) -> torch.Tensor:
    """``logits``: ``[N, V_local]`` (this TP rank's vocabulary slice); returns ``[N]`` logprobs (see module doc)."""
    tp_size, tp_rank, group = _tp_group_info()
    local = logits.size(-1)
    start = tp_rank * local
    z = _masked_scaled(logits, vocab_size, start, temperature)
    nxt = torch.zeros_like(token_ids)
    nxt[:-1] = token_ids[1:]
    lse = _logsumexp(z, tp_size, group)
    in_shard = (nxt >= start) & (nxt < start + local)
    picked = z.gather(-1, (nxt - start).clamp(0, local - 1).unsqueeze(-1)).squeeze(-1)
    picked = _tp_sum(torch.where(in_shard, picked, torch.zeros_like(picked)), tp_size)
    return _shift(picked - lse, seq_starts)


def vocab_parallel_shifted_entropy(logits: torch.Tensor, seq_starts: torch.Tensor, vocab_size: int,
                                   temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the distribution that predicted each token (0 at sequence starts), from vocab-parallel logits."""
    tp_size, tp_rank, group = _tp_group_info()
    z = _masked_scaled(logits, vocab_size, tp_rank * logits.size(-1), temperature)
    lse = _logsumexp(z, tp_size, group)
    p = torch.exp(z - lse.unsqueeze(-1))
    pz = (p * z).sum(-1)
    return _shift(lse - _tp_sum(pz, tp_size), seq_starts)
