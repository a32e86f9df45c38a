"""A padding-free attention backend for HF models: per-sequence SDPA over one packed row.

Registered with transformers as ``"miles_varlen"``. When the forward call carries ``cu_seq_lens_q``
(sequence boundaries of the packed row), each layer runs causal SDPA on every sequence separately, so no
``L x L`` block-diagonal mask is materialised and no attention is spent across sequences. Without it
(generation, padded batches, a dummy pass) the layer is plain SDPA with the mask HF built, exactly as
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
    bounds = cu.tolist()
    outs = [F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], dropout_p=p,
                                           is_causal=True, scale=scaling, enable_gqa=gqa)
            for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


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
