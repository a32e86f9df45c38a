"""Per-token logprobs and entropy of a megatron ``GPTModel`` from its final hidden states (the fused LM head).

The model's output layer is bypassed (`miles.learner.logprobs.lm_head_bypassed`): its input, the final
hidden states, goes with the layer's weight (the shared embedding when tied) to
`miles.learner.logprobs.token_logprobs_from_hidden`, chunked over positions, with the vocabulary spread over
the tensor-parallel ranks. So the ``[T, V]`` logits are never materialised, and no ``[b, s, V]`` transpose copy.
Conventions as in `miles.learner.logprobs`; padded vocabulary rows (ids >= the true vocab size) get zero
probability.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from miles.learner.logprobs import lm_head_bypassed, token_logprobs_from_hidden


def unwrap(model: nn.Module) -> nn.Module:
    """The ``GPTModel`` inside megatron's wrappers (DDP, Float16Module)."""
    while hasattr(model, "module"):
        model = model.module
    return model


@contextlib.contextmanager
def final_hidden_states(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """While open, forwards of `model` skip its output layer and append their final hidden states ``[s, b, h]``
    to the yielded list (nothing on pipeline stages without an output layer)."""
    head = getattr(unwrap(model), "output_layer", None)
    if head is None:
        yield []
        return
    with lm_head_bypassed(head) as captured:
        yield captured


def output_weight(model: nn.Module) -> torch.Tensor:
    """This rank's slice ``[V_padded / tp, h]`` of the output layer's weight (the word embeddings when tied)."""
    gpt = unwrap(model)
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def head_logprobs(
    model: nn.Module,
    hidden: torch.Tensor,
    token_ids: torch.Tensor,
    seq_starts: torch.Tensor,
    vocab_size: int,
    temperature: float = 1.0,
    *,
    entropy: bool = False,
    kept_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs ``[T]`` (and entropies) of the packed tokens from `model`'s final hidden states ``[T, 1, h]``
    (or ``[T, h]``), through its output weight; every TP rank gets the full-vocabulary values. ``kept_counts``
    (``[T]``) replay the sampler's top-k/top-p kept sets, the cut found over the whole vocabulary across TP
    ranks (`miles.learner.logprobs`)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    hidden = hidden.reshape(hidden.size(0), hidden.size(-1))
    weight = output_weight(model)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = None
    if tp > 1:  # as a column-parallel layer: identity forward, the input gradient summed over TP ranks
        hidden = copy_to_tensor_model_parallel_region(hidden)
        group = parallel_state.get_tensor_model_parallel_group()
    start = parallel_state.get_tensor_model_parallel_rank() * weight.size(0)
    return token_logprobs_from_hidden(
        hidden,
        weight,
        token_ids,
        seq_starts,
        temperature,
        entropy=entropy,
        vocab_start=start,
        vocab_size=vocab_size,
        group=group,
        kept_counts=kept_counts,
    )
