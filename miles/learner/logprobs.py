"""Per-token logprobs and entropy of packed sequences, from logits or from the hidden states before the LM head.

Conventions (both paths): token ``t`` gets ``log_softmax(logits[t-1] / T)[token_ids[t]]``; the first token of
each sequence has no predecessor and gets 0; entropy is that of the distribution that predicted the token.
Everything is computed in float32.

`token_logprobs_from_hidden` is the training path: it applies the LM head chunk by chunk over positions with a
fused log-softmax / gather / entropy, so the ``[N, V]`` float32 logits never exist at once, and its backward
recomputes each chunk's logits and forms the exact gradient in closed form. It also serves a vocabulary split
over tensor-parallel ranks (each holds rows ``[vocab_start, vocab_start + V_local)`` of the head).

Sampling-mask replay: with ``kept_counts`` (each token's top-k/top-p kept count as the engine recorded it,
`miles.trajectory.Trajectory.kept_counts`; 0 = the whole vocabulary) a token's logprob, and the entropy of its
position, are those of the distribution renormalised over the ``count`` largest logits of the position (ties at
the cut kept, the token itself always kept), the distribution the engine sampled from. A count, not a logit
threshold, is what travels: the trainer finds its own cut on its own logits, so float differences between engine
and trainer move no token across it unless two logits tie within them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

#: float32 logits per chunk, by device type (a chunk holds this / V positions): on a CPU small enough for the
#: chunk's element-wise passes to stay in cache, on a GPU large enough for full-speed matmuls.
LOGIT_CHUNK_ELEMENTS: dict[str, int] = {"cpu": 1 << 18, "cuda": 1 << 24}
_PAD_LOGIT = -1e30  # padded vocabulary rows: zero probability, and finite so that 0 * logit stays 0


def shifted_token_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    seq_starts: torch.Tensor,
    temperature: float = 1.0,
    kept_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logprob of every packed token under the logits of the position before it.

    ``logits``: ``[N, V]`` for ``N`` packed tokens; ``token_ids``: ``[N]``; ``seq_starts``: indices (into the
    ``N`` tokens) where a sequence begins. Token ``t`` gets ``log_softmax(logits[t-1] / T)[token_ids[t]]``;
    the first token of each sequence has no predecessor and gets 0. Computed in float32. With ``kept_counts``
    (``[N]``, per token) the softmax is renormalised over the kept set (see the module docstring).
    """
    scaled = _scale(logits, temperature)
    if kept_counts is not None:
        scaled = keep_top_counts(scaled, next_tokens(kept_counts), next_tokens(token_ids))
    picked = scaled.gather(-1, next_tokens(token_ids).unsqueeze(-1)).squeeze(-1) - torch.logsumexp(
        scaled, dim=-1
    )
    return shift_to_tokens(picked, seq_starts)


def shifted_entropy(
    logits: torch.Tensor,
    seq_starts: torch.Tensor,
    temperature: float = 1.0,
    kept_counts: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Entropy of the distribution that predicted each packed token (0 for sequence starts), in float32; with
    ``kept_counts`` (and the ``token_ids``, always kept) that of the renormalised kept set."""
    scaled = _scale(logits, temperature)
    if kept_counts is not None:
        if token_ids is None:
            raise ValueError("kept_counts need the token_ids (the sampled token is always kept)")
        scaled = keep_top_counts(scaled, next_tokens(kept_counts), next_tokens(token_ids))
    logp = torch.log_softmax(scaled, dim=-1)
    return shift_to_tokens(-(logp.exp() * logp).sum(-1), seq_starts)


@dataclass(frozen=True)
class KeptCut:
    """Where each row's kept set ends (`kept_cut`): the row keeps its token, every other entry above ``value``,
    and the first ``quota`` of this rank's other entries equal to ``value`` (vocabulary order); ``quota`` -1
    keeps the whole row."""

    value: torch.Tensor  # [n] float
    quota: torch.Tensor  # [n] int64


def kept_cut(
    logits: torch.Tensor,
    counts: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int = 0,
    group: Any = None,
) -> KeptCut:
    """The cut of each row of ``logits`` (``[n, V_local]``, float; the vocabulary spread over `group`'s ranks)
    that keeps exactly ``counts[i]`` tokens: the row's token ``targets[i]`` (a global id) and the
    ``counts[i] - 1`` largest others, ties at the cut broken by vocabulary order. Tied tokens have equal
    probability, so which of them are kept leaves the token's renormalised logprob unchanged; a token that the
    trainer ranks below the engine's cut (float drift) still keeps the set at ``counts[i]`` tokens. A count of 0,
    or one that covers the vocabulary, keeps the whole row."""
    n, local = logits.shape
    world = 1 if group is None else dist.get_world_size(group)
    dev = logits.device
    counts = counts.to(device=dev, dtype=torch.int64)
    active = (counts > 0) & (counts < local * world)
    value = torch.full((n,), float("-inf"), dtype=logits.dtype, device=dev)
    quota = torch.full((n,), -1, dtype=torch.int64, device=dev)
    # every rank holds the same counts, so every rank takes this branch and the same k (collectives match)
    if n == 0 or not bool(active.any()):
        return KeptCut(value, quota)
    is_target = _target_mask(logits, targets, vocab_start)
    others = logits.masked_fill(is_target, float("-inf"))
    rest = torch.where(active, counts - 1, torch.zeros_like(counts))  # how many others each row keeps
    k = int(rest.max())
    if k > 0:
        top = torch.topk(others, min(k, local), dim=-1).values
        if group is not None:
            parts = [torch.empty_like(top) for _ in range(world)]
            dist.all_gather(parts, top.contiguous(), group=group)
            top = torch.topk(torch.cat(parts, dim=-1), k, dim=-1).values
        cut = top.gather(-1, (rest.clamp(1, k) - 1).unsqueeze(-1)).squeeze(-1)
    else:
        cut = torch.full_like(value, float("inf"))
    cut = torch.where(rest > 0, cut, torch.full_like(cut, float("inf")))  # a count of 1: the token alone
    above = (others > cut.unsqueeze(-1)).sum(-1)
    tied = (others == cut.unsqueeze(-1)).sum(-1)
    before = torch.zeros_like(tied)  # tied entries on lower ranks, which come first in vocabulary order
    if group is not None:
        dist.all_reduce(above, group=group)
        ties = [torch.empty_like(tied) for _ in range(world)]
        dist.all_gather(ties, tied, group=group)
        rank = dist.get_rank(group)
        before = sum(ties[:rank], torch.zeros_like(tied))
    share = (rest - above - before).clamp(min=0)
    return KeptCut(torch.where(active, cut, value), torch.where(active, share, quota))


def apply_kept_cut(
    logits: torch.Tensor, cut: KeptCut, targets: torch.Tensor, *, vocab_start: int = 0
) -> torch.Tensor:
    """``logits`` with every entry outside the kept set of `cut` set to a finite, negligible value (zero
    probability, and ``0 * logit`` stays 0)."""
    is_target = _target_mask(logits, targets, vocab_start)
    others = logits.masked_fill(is_target, float("-inf"))
    value = cut.value.unsqueeze(-1)
    tied = others == value
    keep = is_target | (others > value) | (tied & (torch.cumsum(tied, dim=-1) <= cut.quota.unsqueeze(-1)))
    keep |= (cut.quota < 0).unsqueeze(-1)
    return logits.masked_fill(~keep, _PAD_LOGIT)


def keep_top_counts(
    logits: torch.Tensor,
    counts: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int = 0,
    group: Any = None,
) -> torch.Tensor:
    """``logits`` (``[n, V_local]``) reduced to each row's kept set of ``counts[i]`` tokens (`kept_cut`; 0 keeps
    all): the entries outside get a finite, negligible value, so a softmax over the row renormalises over the
    set and the token ``targets[i]`` never gets ``-inf``."""
    cut = kept_cut(logits, counts, targets, vocab_start=vocab_start, group=group)
    return apply_kept_cut(logits, cut, targets, vocab_start=vocab_start)


def _target_mask(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """``[n, V_local]``: True at each row's target token, where this rank holds it."""
    local = logits.size(-1)
    local_ids = targets.to(logits.device) - vocab_start
    own = (local_ids >= 0) & (local_ids < local)
    cols = torch.arange(local, device=logits.device)
    return (cols == local_ids.unsqueeze(-1)) & own.unsqueeze(-1)


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
    kept_counts: torch.Tensor | None = None,
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

    ``kept_counts`` (``[N]``, per token; see the module docstring) renormalise each position over its kept set,
    in the forward and the backward alike.
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
    counts = None if kept_counts is None else next_tokens(kept_counts.to(token_ids.device))
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
        counts,
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
        counts: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, local = hidden.size(0), weight.size(0)
        w = weight.to(hidden.dtype)
        acc = dict(dtype=_acc_dtype(hidden), device=hidden.device)
        lse = torch.empty(n, **acc)
        picked = torch.empty(n, **acc)
        pz = torch.empty(n if entropy else 0, **acc)  # sum_v p_v z_v under this rank's softmax
        # per position the kept set's cut, found once here and reused by the backward (quota -1: all kept)
        cuts = None if counts is None else torch.full((n,), float("-inf"), **acc)
        quotas = None if counts is None else torch.full((n,), -1, dtype=torch.int64, device=hidden.device)
        local_ids = targets - vocab_start
        gather_ids = local_ids.clamp(0, local - 1).unsqueeze(-1)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            y = _chunk_logits(hidden[s:e], w, temperature, pad_from)
            if cuts is not None and quotas is not None:
                cut = kept_cut(y, counts[s:e], targets[s:e], vocab_start=vocab_start, group=group)
                cuts[s:e], quotas[s:e] = cut.value, cut.quota
                y = _keep(y, cuts[s:e], quotas[s:e], targets[s:e], vocab_start)
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
        ctx.save_for_backward(hidden, weight, targets, lse, ent, cuts, quotas)
        ctx.config = (temperature, entropy, chunk, vocab_start, pad_from)
        if not entropy:
            ctx.mark_non_differentiable(ent)
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx: Any, grad_lp: torch.Tensor | None, grad_ent: torch.Tensor | None) -> tuple[Any, ...]:
        hidden, weight, targets, lse, ent, cuts, quotas = ctx.saved_tensors
        temperature, entropy, chunk, vocab_start, pad_from = ctx.config
        if not entropy:
            grad_ent = None
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_lp is None and grad_ent is None) or not (want_h or want_w):
            return (None,) * 10
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
            z = _chunk_logits(hidden[s:e], w, temperature, pad_from)
            if cuts is not None:
                z = _keep(z, cuts[s:e], quotas[s:e], targets[s:e], vocab_start)
            logp = z.sub_(lse[s:e].unsqueeze(-1))
            del z
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
        return grad_h, grad_w, None, None, None, None, None, None, None, None


def _keep(
    z: torch.Tensor, cuts: torch.Tensor, quotas: torch.Tensor, targets: torch.Tensor, vocab_start: int
) -> torch.Tensor:
    """`apply_kept_cut` on one chunk (no collective; a no-op for a chunk whose rows all keep everything)."""
    if not bool((quotas >= 0).any()):
        return z
    return apply_kept_cut(z, KeptCut(cuts, quotas), targets, vocab_start=vocab_start)


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
