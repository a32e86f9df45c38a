"""megatron-core ``GPTModel`` built from a Hugging Face config of the Llama / Qwen2 / Qwen3 families."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from miles.learner.config import AttentionBackend

SUPPORTED_FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral")


class UnsupportedModelError(ValueError):
    """The HF config describes an architecture or option the Megatron backend does not build."""


def te_available() -> bool:
    """True when Transformer Engine imports (it needs CUDA)."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def pad_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary: a multiple of ``divisible_by * tp_size`` (each TP shard equal)."""
    multiple = divisible_by * tp_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


@dataclass(frozen=True)
class ModelLayout:
    """The shape facts that both the model builder and the HF <-> Megatron converter need."""

    family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    initializer_range: float = 0.02

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups


def _rope_theta(hf_config: Any) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported (only 'default' RoPE)")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise UnsupportedModelError("the HF config has no rope_theta")
    return float(theta)


def layout_from_hf(hf_config: Any, *, tp_size: int = 1, vocab_divisible_by: int = 128) -> ModelLayout:
    """Read a Llama / Qwen2 / Qwen3 HF config; raise `UnsupportedModelError` for anything else."""
    family = getattr(hf_config, "model_type", "")
    if family not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(f"model_type {family!r} is not one of {SUPPORTED_FAMILIES}")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {hf_config.hidden_act!r} is not silu (SwiGLU)")
    if getattr(hf_config, "mlp_bias", False):
        raise UnsupportedModelError("mlp_bias=True is not supported")
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    if heads % groups:
        raise UnsupportedModelError(
            f"num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}"
        )
    if groups % tp_size:
        raise UnsupportedModelError(
            f"num_key_value_heads={groups} is not divisible by tensor parallel size {tp_size}"
        )
    qkv_bias = family == "qwen2"  # Qwen2 has q/k/v biases and no o_proj bias
    if family != "qwen2" and getattr(hf_config, "attention_bias", False):
        raise UnsupportedModelError("attention_bias=True (biases on q/k/v *and* o_proj) is not supported")
    if getattr(hf_config, "use_sliding_window", False):
        raise UnsupportedModelError("sliding-window attention is not supported")
    return ModelLayout(
        family=family,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=head_dim,
        vocab_size=hf_config.vocab_size,
        padded_vocab_size=pad_vocab_size(hf_config.vocab_size, tp_size, vocab_divisible_by),
        tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=family == "qwen3",
        rope_theta=_rope_theta(hf_config),
        rms_norm_eps=float(hf_config.rms_norm_eps),
        max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", 4096)),
        initializer_range=float(getattr(hf_config, "initializer_range", 0.02)),
    )


def transformer_config(
    layout: ModelLayout,
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
    **overrides: Any,
):
    """The megatron-core ``TransformerConfig`` for `layout` (no dropout, no fusions that need CUDA kernels)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(
        num_layers=layout.num_layers,
        hidden_size=layout.hidden_size,
        ffn_hidden_size=layout.ffn_hidden_size,
        num_attention_heads=layout.num_attention_heads,
        num_query_groups=layout.num_query_groups,
        kv_channels=layout.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=layout.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=layout.qkv_bias,
        qk_layernorm=layout.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=layout.initializer_range,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        sequence_parallel=False,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        perform_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
        deallocate_pipeline_outputs=False,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def resolve_attention_backend(attention: AttentionBackend) -> str:
    if attention == "auto":
        return "te" if te_available() else "sdpa"
    if attention not in ("sdpa", "local", "te"):
        raise ValueError(f"attention backend must be auto, sdpa, local or te, got {attention!r}")
    if attention == "te" and not te_available():
        raise UnsupportedModelError("attention='te' needs Transformer Engine and a GPU")
    return attention


def layer_spec(layout: ModelLayout, attention: AttentionBackend = "auto"):
    """The transformer-layer ``ModuleSpec``: TE when present, else the local spec with SDPA core attention."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    backend = resolve_attention_backend(attention)
    if backend == "te":
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=layout.qk_norm)
    spec = specs.get_gpt_layer_local_spec(qk_layernorm=layout.qk_norm, normalization="RMSNorm")
    if backend == "sdpa":
        from miles.learner.megatron.attention import SDPAttention

        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def supports_packing(attention: AttentionBackend) -> bool:
    """Whether the attention backend takes several sequences packed into one row (``thd`` format)."""
    return resolve_attention_backend(attention) in ("sdpa", "te")


def build_gpt_model(
    layout: ModelLayout,
    config: Any,
    *,
    attention: AttentionBackend = "auto",
    pre_process: bool | None = None,
    post_process: bool | None = None,
):
    """A ``GPTModel`` for this pipeline stage (stage flags default to ``parallel_state``'s view)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(layout, attention),
        vocab_size=layout.padded_vocab_size,
        max_sequence_length=layout.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=layout.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=int(layout.rope_theta) if float(layout.rope_theta).is_integer() else layout.rope_theta,
        rotary_percent=1.0,
    )
