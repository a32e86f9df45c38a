"""Core attention for megatron-core layer specs that calls ``torch.nn.functional.scaled_dot_product_attention``.

The local spec's ``DotProductAttention`` materialises the full score matrix and rejects packed sequences;
`SDPAttention` takes the same constructor arguments, dispatches to SDPA's flash / memory-efficient kernels
on GPU, and supports the ``thd`` packed format (one causal attention per packed sequence, following
``PackedSeqParams.cu_seqlens_q``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


class SDPAttention(MegatronModule):
    """Drop-in replacement for megatron's ``DotProductAttention`` (causal self-attention, GQA, no dropout)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism")
        tp = (
            pg_collection.tp.size()
            if pg_collection is not None
            else parallel_state.get_tensor_model_parallel_world_size()
        )
        self.attn_mask_type = attn_mask_type
        self.heads_per_partition = divide(config.num_attention_heads, tp)
        self.groups_per_partition = divide(config.num_query_groups, tp)
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def _sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        # q: [b, np, s, hn]; k, v: [b, ng, s, hn]
        causal = mask is None and self.attn_mask_type == AttnMaskType.causal
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=causal,
            scale=self.softmax_scale,
            enable_gqa=self.heads_per_partition != self.groups_per_partition,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """sbhd: [s, b, n, d] -> [s, b, n*d]; thd (packed): [t, n, d] -> [t, n*d]."""
        if attention_bias is not None:
            raise ValueError("SDPAttention does not take an attention bias")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            # the trainer attaches the bounds as a Python list, sparing a device sync per layer
            cu = (
                getattr(packed_seq_params, "host_cu_seqlens", None) or packed_seq_params.cu_seqlens_q.tolist()
            )
            outs = []
            for start, end in zip(cu[:-1], cu[1:], strict=True):
                q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
                outs.append(self._sdpa(q, k, v, None).squeeze(0).transpose(0, 1))
            out = torch.cat(outs, dim=0)
            return out.reshape(out.size(0), -1)
        mask = None
        if attention_mask is not None:
            mask = ~attention_mask.bool()  # megatron masks are True where attention is forbidden
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = self._sdpa(q, k, v, mask)  # [b, np, s, hn]
        s, b = out.size(2), out.size(0)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)
