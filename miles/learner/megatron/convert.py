"""HF <-> Megatron weight conversion, tensor-parallel aware.

Megatron's layouts, per tensor-parallel rank ``r`` of ``tp``:

* ``linear_qkv``: one row block per *local* query group, each ``[q heads of the group; k; v]`` (GQA interleave);
  rank ``r`` holds groups ``[r*G/tp, (r+1)*G/tp)``. The QKV bias follows the same layout.
* ``linear_fc1``: ``[gate_r; up_r]``, the rank's slices of gate_proj and up_proj, stacked.
* ``linear_proj`` / ``linear_fc2``: row-parallel, split along the input dimension.
* word embeddings and the output layer: vocab-parallel over the padded vocabulary (padding rows are zero).

`hf_to_megatron` turns an HF state dict into one rank's Megatron state dict for the layers that rank's pipeline
stage owns; `megatron_to_hf` merges the tensor-parallel shards of one stage back into HF names. Both are pure
functions over tensors; the trainer does the communication.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from miles.learner.megatron.model import ModelLayout


class ConversionError(KeyError):
    """A tensor needed by the conversion is missing, or has an unexpected shape."""


_HF_LAYER = "model.layers.{i}."
_MG_LAYER = "decoder.layers.{i}."

# HF suffix -> Megatron suffix for tensors copied unchanged (replicated across TP ranks).
_NORMS_LOCAL = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
}
# With Transformer Engine the pre-attention / pre-MLP norms are fused into the following linear layer.
_NORMS_TE = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
_QK_NORMS = {
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
}


def _get(sd: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return sd[name]
    except KeyError:
        raise ConversionError(f"missing tensor {name!r}") from None


def _chunk(t: torch.Tensor, tp: int, rank: int, dim: int) -> torch.Tensor:
    if t.size(dim) % tp:
        raise ConversionError(f"dimension {dim} of shape {tuple(t.shape)} is not divisible by tp={tp}")
    return t.chunk(tp, dim=dim)[rank].clone()


def _pad_vocab(t: torch.Tensor, layout: ModelLayout) -> torch.Tensor:
    if t.size(0) != layout.vocab_size:
        raise ConversionError(f"vocab tensor has {t.size(0)} rows, expected {layout.vocab_size}")
    pad = layout.padded_vocab_size - layout.vocab_size
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def qkv_to_megatron(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: ModelLayout, tp: int, rank: int
) -> torch.Tensor:
    """HF q/k/v projections (weights ``[out, h]`` or biases ``[out]``) -> rank's grouped ``linear_qkv`` tensor."""
    g, hpg, d = layout.num_query_groups, layout.heads_per_group, layout.head_dim
    tail = q.shape[1:]
    qg = q.reshape(g, hpg * d, *tail)
    kg = k.reshape(g, d, *tail)
    vg = v.reshape(g, d, *tail)
    fused = torch.cat([qg, kg, vg], dim=1)  # [g, (hpg + 2) * d, ...]
    local = _chunk(fused, tp, rank, 0)
    return local.reshape(-1, *tail)


def qkv_to_hf(
    shards: Sequence[torch.Tensor], layout: ModelLayout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `qkv_to_megatron` over all TP shards: (q, k, v)."""
    g, hpg, d = layout.num_query_groups, layout.heads_per_group, layout.head_dim
    tail = shards[0].shape[1:]
    fused = torch.cat(list(shards), dim=0).reshape(g, (hpg + 2) * d, *tail)
    q, k, v = fused.split([hpg * d, d, d], dim=1)
    return (
        q.reshape(g * hpg * d, *tail).clone(),
        k.reshape(g * d, *tail).clone(),
        v.reshape(g * d, *tail).clone(),
    )


def hf_to_megatron(
    hf: dict[str, torch.Tensor],
    layout: ModelLayout,
    *,
    tp_size: int = 1,
    tp_rank: int = 0,
    layers: Iterable[int] | None = None,
    first_stage: bool = True,
    last_stage: bool = True,
    te_norms: bool = False,
) -> dict[str, torch.Tensor]:
    """One rank's Megatron state dict. `layers` are the *global* layer indices this stage owns, in order;
    they become local indices 0..n-1 as in megatron's per-stage ``GPTModel``."""
    tp, r = tp_size, tp_rank
    layers = list(range(layout.num_layers) if layers is None else layers)
    norms = _NORMS_TE if te_norms else _NORMS_LOCAL
    out: dict[str, torch.Tensor] = {}
    embed = _get(hf, "model.embed_tokens.weight")
    if first_stage:
        out["embedding.word_embeddings.weight"] = _chunk(_pad_vocab(embed, layout), tp, r, 0)
    for local, i in enumerate(layers):
        src, dst = _HF_LAYER.format(i=i), _MG_LAYER.format(i=local)
        for hf_name, mg_name in norms.items():
            out[dst + mg_name] = _get(hf, src + hf_name).clone()
        if layout.qk_norm:
            for hf_name, mg_name in _QK_NORMS.items():
                out[dst + mg_name] = _get(hf, src + hf_name).clone()
        attn = src + "self_attn."
        out[dst + "self_attention.linear_qkv.weight"] = qkv_to_megatron(
            _get(hf, attn + "q_proj.weight"),
            _get(hf, attn + "k_proj.weight"),
            _get(hf, attn + "v_proj.weight"),
            layout,
            tp,
            r,
        )
        if layout.qkv_bias:
            out[dst + "self_attention.linear_qkv.bias"] = qkv_to_megatron(
                _get(hf, attn + "q_proj.bias"),
                _get(hf, attn + "k_proj.bias"),
                _get(hf, attn + "v_proj.bias"),
                layout,
                tp,
                r,
            )
        out[dst + "self_attention.linear_proj.weight"] = _chunk(_get(hf, attn + "o_proj.weight"), tp, r, 1)
        mlp = src + "mlp."
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [
                _chunk(_get(hf, mlp + "gate_proj.weight"), tp, r, 0),
                _chunk(_get(hf, mlp + "up_proj.weight"), tp, r, 0),
            ]
        )
        out[dst + "mlp.linear_fc2.weight"] = _chunk(_get(hf, mlp + "down_proj.weight"), tp, r, 1)
    if last_stage:
        out["decoder.final_layernorm.weight"] = _get(hf, "model.norm.weight").clone()
        if not layout.tied_embeddings:
            out["output_layer.weight"] = _chunk(_pad_vocab(_get(hf, "lm_head.weight"), layout), tp, r, 0)
        elif not first_stage:  # the last stage's copy of the tied embedding
            out["output_layer.weight"] = _chunk(_pad_vocab(embed, layout), tp, r, 0)
    return out


def megatron_to_hf(
    shards: Sequence[dict[str, torch.Tensor]],
    layout: ModelLayout,
    *,
    layers: Iterable[int] | None = None,
    te_norms: bool = False,
) -> dict[str, torch.Tensor]:
    """Merge one pipeline stage's TP shards (``shards[r]`` from TP rank r) into HF tensors.

    `layers` maps local layer indices to global ones. Tensors the stage does not hold are simply absent; with
    tied embeddings the output layer is not exported (HF ties ``lm_head`` to ``embed_tokens``)."""
    layers = list(range(layout.num_layers) if layers is None else layers)
    norms = _NORMS_TE if te_norms else _NORMS_LOCAL
    first = shards[0]
    hf: dict[str, torch.Tensor] = {}

    def cat(name: str, dim: int) -> torch.Tensor:
        return torch.cat([_get(s, name) for s in shards], dim=dim)

    if "embedding.word_embeddings.weight" in first:
        hf["model.embed_tokens.weight"] = cat("embedding.word_embeddings.weight", 0)[
            : layout.vocab_size
        ].clone()
    for local, i in enumerate(layers):
        src, dst = _MG_LAYER.format(i=local), _HF_LAYER.format(i=i)
        if src + "self_attention.linear_qkv.weight" not in first:
            continue
        for hf_name, mg_name in norms.items():
            hf[dst + hf_name] = _get(first, src + mg_name).clone()
        if layout.qk_norm:
            for hf_name, mg_name in _QK_NORMS.items():
                hf[dst + hf_name] = _get(first, src + mg_name).clone()
        attn = dst + "self_attn."
        q, k, v = qkv_to_hf([_get(s, src + "self_attention.linear_qkv.weight") for s in shards], layout)
        hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"] = q, k, v
        if layout.qkv_bias:
            q, k, v = qkv_to_hf([_get(s, src + "self_attention.linear_qkv.bias") for s in shards], layout)
            hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"] = q, k, v
        hf[attn + "o_proj.weight"] = cat(src + "self_attention.linear_proj.weight", 1)
        gates, ups = zip(
            *[_get(s, src + "mlp.linear_fc1.weight").chunk(2, dim=0) for s in shards], strict=True
        )
        hf[dst + "mlp.gate_proj.weight"] = torch.cat(gates, dim=0)
        hf[dst + "mlp.up_proj.weight"] = torch.cat(ups, dim=0)
        hf[dst + "mlp.down_proj.weight"] = cat(src + "mlp.linear_fc2.weight", 1)
    if "decoder.final_layernorm.weight" in first:
        hf["model.norm.weight"] = _get(first, "decoder.final_layernorm.weight").clone()
        if not layout.tied_embeddings:
            hf["lm_head.weight"] = cat("output_layer.weight", 0)[: layout.vocab_size].clone()
    return hf


def tp_partition_dim(name: str) -> int | None:
    """The dimension along which Megatron shards tensor `name` across TP ranks (None: replicated)."""
    if name.endswith(
        (
            "linear_qkv.weight",
            "linear_qkv.bias",
            "linear_fc1.weight",
            "word_embeddings.weight",
            "output_layer.weight",
        )
    ):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None
