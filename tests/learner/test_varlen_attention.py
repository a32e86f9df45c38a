"""`varlen_sdpa_forward`: bucketed right-padded SDPA over a packed row equals causal SDPA per sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from miles.learner import varlen_attention


def _per_sequence(q, k, v, lengths, scale):
    outs = []
    for qs, ks, vs in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2), strict=True):
        outs.append(
            F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
            )
        )
    return torch.cat(outs, 2).transpose(1, 2)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=9),
    kv_heads=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_equals_causal_attention_per_sequence_with_gradients(lengths, kv_heads, seed):
    g = torch.Generator().manual_seed(seed)
    total, dim = sum(lengths), 8
    q = torch.randn(1, 4, total, dim, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, kv_heads, total, dim, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, kv_heads, total, dim, generator=g, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    module = nn.Module().eval()
    got, _ = varlen_attention.varlen_sdpa_forward(
        module, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, max_length_q=max(lengths)
    )
    want = _per_sequence(q, k, v, lengths, 0.3)
    assert got.shape == (1, total, 4, dim)
    torch.testing.assert_close(got, want)
    w = torch.randn(want.shape, generator=g, dtype=torch.float64)
    grads = [torch.autograd.grad((out * w).sum(), (q, k, v)) for out in (got, want)]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_lengths_far_apart_go_to_separate_buckets():
    cu = torch.tensor([0, 80, 700, 790, 875])  # lengths 80, 620, 90, 85
    layout = varlen_attention._row_layout(cu)
    assert [(b.count, b.longest) for b in layout.buckets] == [(1, 620), (3, 90)]
    assert varlen_attention._row_layout(cu) is layout  # every layer of a forward reuses it
    assert varlen_attention._row_layout(cu.clone()) is not layout


@pytest.mark.parametrize("packing", ["varlen", "packed"])
def test_without_boundaries_it_is_plain_sdpa(packing):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g) for _ in range(3))
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None].expand(2, 1, 6, 6)
    got, _ = varlen_attention.varlen_sdpa_forward(nn.Module().eval(), q, k, v, mask, scaling=0.5)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5).transpose(1, 2)
    torch.testing.assert_close(got, want)
