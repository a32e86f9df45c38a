"""Per-token logprobs and entropy of packed sequences, from logits or from the hidden states before the LM head.

Conventions (both paths): token ``t`` gets ``log_softmax(logits[t-1] / T)[token_ids[t]]``; the first token of
each sequence has no predecessor and gets 0; entropy is that of the distribution that predicted the token.
Everything is computed in float32.

`token_logprobs_from_hidden` is the training path: it applies the LM head chunk by chunk over positions with a
fused log-softmax / gather / entropy, so the ``[N, V]`` float32 logits never exist at once, and its backward
recomputes each chunk's logits and forms the exact gradient in closed form. It also serves a vocabulary split
over tensor-parallel ranks (each holds rows ``[vocab_start, vocab_start + V_local)`` of the head).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

#: float32 logits per chunk, by device type (a chunk holds this / V positions): on a CPU small enough for the
#: chunk's element-wise passes to stay in cache, on a GPU large enough for full-speed matmuls.
LOGIT_CHUNK_ELEMENTS: dict[str, int] = {"cpu": 1 << 18, "cuda": 1 << 24}
_PAD_LOGIT = -1e30  # padded vocabulary rows: zero probability, and finite so that 0 * logit stays 0


def shifted_token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, seq_starts: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Logprob of every packed token under the logits of the position before it.

    ``logits``: ``[N, V]`` for ``N`` packed tokens; ``token_ids``: ``[N]``; ``seq_starts``: indices (into the
    ``N`` tokens) where a sequence begins. Token ``t`` gets ``log_softmax(logits[t-1] / T)[token_ids[t]]``;
    the first token of each sequence has no predecessor and gets 0. Computed in float32.
    """
    scaled = _scale(logits, temperature)
    picked = scaled.gather(-1, next_tokens(token_ids).unsqueeze(-1)).squeeze(-1) - torch.logsumexp(
        scaled, dim=-1
    )
    return shift_to_tokens(picked, seq_starts)


def shifted_entropy(logits: torch.Tensor, seq_starts: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the distribution that predicted each packed token (0 for sequence starts), in float32."""
    logp = torch.log_softmax(_scale(logits, temperature), dim=-1)
    return shift_to_tokens(-(logp.exp() * logp).sum(-1), seq_starts)


def next_tokens(token_ids: torch.Tensor) -> torch.Tensor:
    """The token each position predicts: ``token_ids[t + 1]`` (0 for the last position; it is never used)."""
    nxt = torch.zeros_like(token_ids)
    nxt[:-1] = token_ids[1:]
    return nxt


def shift_to_tokens(per_position: torch.Tensor, seq_starts: torch.Tensor) -> torch.Tensor:
    """Per-position values (about the *next* token) moved onto the tokens they predict; sequence starts get 0."""
    out = torch.zeros_like(per_position)
    out[1:] = per_position[:-1]
    out[seq_starts] = 0.0
    return out


def token_logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    seq_starts: torch.Tensor,
    temperature: float = 1.0,
    *,
    entropy: bool = False,
    chunk_tokens: int | None = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    group: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs ``[N]`` (and entropies ``[N]`` when `entropy`) of packed tokens from the LM head's input.

    ``hidden``: ``[N, H]``, the final hidden states of the ``N`` packed tokens; ``weight``: ``[V_local, H]``, the
    LM head (no bias). The logits ``hidden @ weight.T`` are formed in ``hidden``'s dtype and reduced in float32,
    ``chunk_tokens`` positions at a time (default: `LOGIT_CHUNK_ELEMENTS` / ``V_local``). Gradients flow to
    ``hidden`` and ``weight`` (the entropy's too, when it is used in a loss) and equal those of the full-logits
    `shifted_token_logprobs` / `shifted_entropy`.

    Vocabulary parallelism: ``weight`` holds rows ``[vocab_start, vocab_start + V_local)`` of a vocabulary
    spread over the ranks of `group`; rows at or beyond ``vocab_size`` (padding) get zero probability. The
    returned values are the full-vocabulary ones on every rank; the gradient w.r.t. ``hidden`` is this rank's
    share (sum it over the group, as a column-parallel layer does).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 to recompute logprobs, got {temperature}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.size(1) != weight.size(1):
        raise ValueError(
            f"hidden [N, H] and weight [V, H] disagree: {tuple(hidden.shape)} vs {tuple(weight.shape)}"
        )
    local = weight.size(0)
    budget = LOGIT_CHUNK_ELEMENTS.get(hidden.device.type, LOGIT_CHUNK_ELEMENTS["cuda"])
    chunk = chunk_tokens or max(1, budget // local)
    pad_from = local if vocab_size is None else min(max(vocab_size - vocab_start, 0), local)
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    lp, ent = _FusedHeadLogprobs.apply(
        hidden,
        weight,
        next_tokens(token_ids),
        float(temperature),
        bool(entropy),
        int(chunk),
        int(vocab_start),
        int(pad_from),
        group,
    )
    lp = shift_to_tokens(lp, seq_starts)
    return lp, (shift_to_tokens(ent, seq_starts) if entropy else None)


@contextlib.contextmanager
def lm_head_bypassed(head: nn.Module) -> Iterator[list[torch.Tensor]]:
    """While open, every call of the LM head module `head` appends its input (the final hidden states) to the
    yielded list and runs the head on zero positions instead, so a model's forward ends without forming logits.

    The model's own forward still runs end to end (wrappers such as FSDP2 or a pipeline schedule gather and
    release parameters as usual); pair it with `token_logprobs_from_hidden` on the captured states. Positions
    are the second-to-last dimension of the head's input (HF ``[b, s, h]`` and megatron ``[s, b, h]`` alike
    keep features last, so slicing ``[..., :0, :]`` empties a dimension of either).
    """
    captured: list[torch.Tensor] = []

    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        captured.append(args[0])
        return (args[0][..., :0, :], *args[1:])

    handle = head.register_forward_pre_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


class _FusedHeadLogprobs(torch.autograd.Function):
    """Per-position ``log p(target)`` and entropy of ``softmax(hidden @ weight.T / T)``, chunked over positions."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        entropy: bool,
        chunk: int,
        vocab_start: int,
        pad_from: int,
        group: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, local = hidden.size(0), weight.size(0)
        w = weight.to(hidden.dtype)
        acc = dict(dtype=_acc_dtype(hidden), device=hidden.device)
        lse = torch.empty(n, **acc)
        picked = torch.empty(n, **acc)
        pz = torch.empty(n if entropy else 0, **acc)  # sum_v p_v z_v under this rank's softmax
        local_ids = targets - vocab_start
        gather_ids = local_ids.clamp(0, local - 1).unsqueeze(-1)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            y = _chunk_logits(hidden[s:e], w, temperature, pad_from)
            top = y.amax(dim=-1, keepdim=True)
            y.sub_(top)  # y = z - max, in place
            expd = torch.exp(y)
            total = expd.sum(-1)
            lse[s:e] = top.squeeze(-1) + torch.log(total)
            picked[s:e] = y.gather(-1, gather_ids[s:e]).squeeze(-1) + top.squeeze(-1)
            if entropy:  # sum_v p_v z_v = <exp(y), y> / total + max
                pz[s:e] = torch.linalg.vecdot(expd, y) / total + top.squeeze(-1)
            del y, expd
        picked = torch.where((local_ids >= 0) & (local_ids < local), picked, torch.zeros_like(picked))
        if group is not None:  # merge the ranks' vocabulary slices
            ranks = [torch.empty_like(lse) for _ in range(dist.get_world_size(group))]
            dist.all_gather(ranks, lse, group=group)
            merged = torch.logsumexp(torch.stack(ranks), dim=0)
            dist.all_reduce(picked, group=group)
            if entropy:
                pz = pz * torch.exp(lse - merged)
                dist.all_reduce(pz, group=group)
            lse = merged
        lp = picked - lse
        ent = lse - pz if entropy else torch.empty(0, **acc)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.config = (temperature, entropy, chunk, vocab_start, pad_from)
        if not entropy:
            ctx.mark_non_differentiable(ent)
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx: Any, grad_lp: torch.Tensor | None, grad_ent: torch.Tensor | None) -> tuple[Any, ...]:
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        temperature, entropy, chunk, vocab_start, pad_from = ctx.config
        if not entropy:
            grad_ent = None
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_lp is None and grad_ent is None) or not (want_h or want_w):
            return (None,) * 9
        n, local = hidden.size(0), weight.size(0)
        w = weight.to(hidden.dtype)
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w: torch.Tensor | None = None
        # dL/dz_v = a p_v + b p_v log p_v (+ g_lp / T at the target, on its own shard), per position:
        # d log p(target) / dz = onehot - p; dH/dz = -p (log p + H); the 1/T of z = logits / T folded in.
        zeros = torch.zeros_like(lse)
        g_lp = grad_lp if grad_lp is not None else zeros
        a = -g_lp / temperature
        b = None
        if grad_ent is not None:
            a = a - grad_ent * ent / temperature
            b = (-grad_ent / temperature).unsqueeze(-1)
        a = a.unsqueeze(-1)
        local_ids = targets - vocab_start
        gather_ids = local_ids.clamp(0, local - 1).unsqueeze(-1)
        hit = torch.where((local_ids >= 0) & (local_ids < local), g_lp / temperature, zeros).unsqueeze(-1)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            logp = _chunk_logits(hidden[s:e], w, temperature, pad_from).sub_(lse[s:e].unsqueeze(-1))
            if b is None:
                g = logp.exp_().mul_(a[s:e])
            else:
                g = logp.exp()
                g.mul_(logp.mul_(b[s:e]).add_(a[s:e]))
            del logp
            if grad_lp is not None:
                g.scatter_add_(1, gather_ids[s:e], hit[s:e])
            g = g.to(hidden.dtype)
            if want_h:
                torch.mm(g, w, out=grad_h[s:e])
            if want_w:
                part = g.t() @ hidden[s:e]
                grad_w = part.to(_acc_dtype(hidden)) if grad_w is None else grad_w.add_(part)
        if want_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None, None, None


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs (gradient checks)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, temperature: float, pad_from: int
) -> torch.Tensor:
    z = (hidden @ weight.t()).to(_acc_dtype(hidden))
    if temperature != 1.0:
        z = z / temperature
    if pad_from < z.size(-1):
        z[:, pad_from:] = _PAD_LOGIT
    return z


def _scale(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 to recompute logprobs, got {temperature}")
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature
