"""A padding-free attention backend for HF models: causal attention per sequence over one packed row.

Registered with transformers as ``"miles_varlen"``. When the forward call carries ``cu_seq_lens_q``
(sequence boundaries of the packed row), each layer lays the row's sequences out as right-padded rows for
one causal SDPA call (flash kernels on CPU and CUDA) and packs the result back: no attention across
sequences, no mask, and only attention sees padding (projections and MLPs run on the real tokens). Without
it (generation, padded batches) the layer is plain SDPA with the mask HF built, exactly as
``attn_implementation="sdpa"``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

NAME = "miles_varlen"
_registered = False


def varlen_sdpa_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF attention-interface function; ``query`` is ``[1, H, L, D]``, ``key``/``value`` ``[1, Hkv, L, D]``."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    p = dropout if module.training else 0.0
    gqa = query.shape[1] != key.shape[1]
    lengths = cu[1:] - cu[:-1]
    n, longest = lengths.numel(), int(kwargs.get("max_length_q") or int(lengths.max()))
    seq_index = torch.repeat_interleave(torch.arange(n, device=cu.device), lengths)
    slot = seq_index * longest + torch.arange(seq_index.numel(), device=cu.device) - cu[:-1][seq_index]

    def to_rows(x: torch.Tensor) -> torch.Tensor:  # [1, H, T, D] -> [n, H, longest, D], right-padded
        tokens = x[0].transpose(0, 1)
        rows = tokens.new_zeros(n * longest, *tokens.shape[1:]).index_copy(0, slot, tokens)
        return rows.view(n, longest, *tokens.shape[1:]).transpose(1, 2)

    # Causal attention never looks right, so a right-padded row needs no mask: its real queries see only
    # real keys, and the padded queries' outputs are dropped.
    out = F.scaled_dot_product_attention(to_rows(query), to_rows(key), to_rows(value), dropout_p=p, is_causal=True,
                                         scale=scaling, enable_gqa=gqa)
    out = out.transpose(1, 2).reshape(n * longest, out.size(1), out.size(-1)).index_select(0, slot)
    return out.unsqueeze(0), None


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
