"""A padding-free attention backend for HF models: causal attention per sequence over one packed row.

Registered with transformers as ``"miles_varlen"``. When the forward call carries ``cu_seq_lens_q``
(sequence boundaries of the packed row), each layer attends within every sequence only: the row's sequences,
grouped by length into a few buckets, are laid out as right-padded rows for one causal SDPA call per bucket
(flash kernels on CPU and CUDA), and the results are packed back. No attention across sequences, no mask, and
only attention sees padding (projections and MLPs run on the real tokens). Without it (generation, padded
batches) the layer is plain SDPA with the mask HF built, exactly as ``attn_implementation="sdpa"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

NAME = "miles_varlen"
BUCKET_RATIO = 0.5
_registered = False


def varlen_sdpa_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface function; ``query`` is ``[1, H, L, D]``, ``key``/``value`` ``[1, Hkv, L, D]``."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    p = dropout if module.training else 0.0
    gqa = query.shape[1] != key.shape[1]
    layout = _row_layout(cu)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, D]
    outs = []
    for bucket in layout.buckets:

        def rows(tokens: torch.Tensor, b: _Bucket = bucket) -> torch.Tensor:  # -> [n, heads, longest, D]
            picked = tokens.index_select(0, b.tokens)
            padded = picked.new_zeros(b.count * b.longest, *picked.shape[1:]).index_copy(0, b.slots, picked)
            return padded.view(b.count, b.longest, *picked.shape[1:]).transpose(1, 2)

        # Causal attention never looks right, so a right-padded row needs no mask: its real queries see only
        # real keys, and the padded queries' outputs are dropped.
        out = F.scaled_dot_product_attention(
            rows(q), rows(k), rows(v), dropout_p=p, is_causal=True, scale=scaling, enable_gqa=gqa
        )
        outs.append(out.transpose(1, 2).reshape(-1, out.size(1), out.size(-1)).index_select(0, bucket.slots))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    if layout.inverse is not None:
        out = out.index_select(0, layout.inverse)
    return out.unsqueeze(0), None


@dataclass(frozen=True)
class _Bucket:
    """Sequences of similar length attended together as right-padded rows of ``longest`` tokens."""

    count: int
    longest: int
    tokens: torch.Tensor  # [t] indices of the bucket's tokens in the packed row
    slots: torch.Tensor  # [t] where each lands in the bucket's [count * longest] rows


@dataclass(frozen=True)
class _RowLayout:
    buckets: list[_Bucket]
    inverse: torch.Tensor | None  # packed position -> position in the buckets' outputs (None: the same)


_last_layout: tuple[torch.Tensor, _RowLayout] | None = None


def _row_layout(cu: torch.Tensor) -> _RowLayout:
    """Buckets of the packed row ``cu`` describes: sequences sorted by length, a new bucket where a length
    falls below `BUCKET_RATIO` of the bucket's longest (so padding costs attention at most 1 / ratio^2).

    Every layer of one forward gets the same ``cu`` tensor, so the layout is computed once per forward.
    """
    global _last_layout
    if _last_layout is not None and _last_layout[0] is cu:
        return _last_layout[1]
    host = cu.cpu()
    lengths = (host[1:] - host[:-1]).tolist()
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if not groups or lengths[i] < BUCKET_RATIO * lengths[groups[-1][0]]:
            groups.append([])
        groups[-1].append(i)
    buckets, placed = [], []
    for group in groups:
        seqs = torch.tensor(group)
        lens = host[seqs + 1] - host[seqs]
        offset = torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
        tokens = torch.repeat_interleave(host[seqs], lens) + offset
        longest = lengths[group[0]]
        slots = torch.repeat_interleave(torch.arange(len(group)) * longest, lens) + offset
        buckets.append(_Bucket(len(group), longest, tokens.to(cu.device), slots.to(cu.device)))
        placed.append(tokens)
    flat = torch.cat(placed)
    inverse = None
    if not torch.equal(flat, torch.arange(flat.numel())):
        inverse = torch.empty_like(flat)
        inverse[flat] = torch.arange(flat.numel())
        inverse = inverse.to(cu.device)
    layout = _RowLayout(buckets, inverse)
    _last_layout = (cu, layout)
    return layout


def register() -> str:
    """Register the attention function (and SDPA's mask builder for it) with transformers; returns its name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(NAME, varlen_sdpa_forward)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True
    return NAME


def no_mask_mapping(model: nn.Module) -> dict[str, None] | None:
    """An ``attention_mask`` mapping that tells HF decoder models to build no mask (we bound sequences ourselves).

    Returns None for models whose forward does not accept a per-layer-type mask mapping.
    """
    layer_types = getattr(getattr(model, "config", None), "layer_types", None)
    if not layer_types:
        return None
    return dict.fromkeys(set(layer_types))
