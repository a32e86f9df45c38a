"""Properties of the batched sampler: top-k/top-p keep exactly the right tokens; logprobs are as documented."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.engines.sampling import RowSampling, _filter_top_k_top_p, sample_rows

logits_st = st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=2, max_size=40)


@settings(max_examples=150, deadline=None)
@given(values=logits_st, top_k=st.integers(-1, 50), top_p=st.floats(0.01, 1.0))
def test_filter_keeps_top_k_then_smallest_nucleus(values, top_k, top_p):
    logits = torch.tensor([values])
    out = _filter_top_k_top_p(logits, torch.tensor([top_k]), torch.tensor([top_p]))[0]
    kept = torch.isfinite(out)
    assert kept.any()
    assert torch.equal(out[kept], logits[0][kept])
    order = torch.argsort(logits[0], descending=True, stable=True)
    k = len(values) if top_k <= 0 else min(top_k, len(values))
    probs = torch.softmax(logits[0][order[:k]], dim=-1)
    need = 1
    top_p = float(torch.tensor(top_p, dtype=torch.float32))  # the filter sees top_p in float32 (0.99..9 -> 1.0)
    while need < k and (top_p >= 1.0 or probs[:need].sum().item() < top_p - 1e-6):
        need += 1
    assert need - 1 <= int(kept.sum()) <= need + 1  # ties in the sort may move the boundary by one
    threshold = logits[0][kept].min()
    assert bool((logits[0][~kept] <= threshold).all())  # nothing dropped beats something kept


@settings(max_examples=60, deadline=None)
@given(values=logits_st, temperature=st.floats(0.05, 3.0), seed=st.integers(0, 2**31 - 1))
def test_sampled_token_and_logprob(values, temperature, seed):
    logits = torch.tensor([values])
    gen = torch.Generator().manual_seed(seed)
    tokens, logprobs = sample_rows(logits, [RowSampling(temperature, 1.0, -1, gen)])
    expected = torch.log_softmax(logits[0] / temperature, dim=-1)[tokens[0]].item()
    assert abs(logprobs[0] - expected) < 1e-5
    again, _ = sample_rows(logits, [RowSampling(temperature, 1.0, -1, torch.Generator().manual_seed(seed))])
    assert again == tokens


def test_greedy_rows_report_raw_logprobs_and_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    tokens, logprobs = sample_rows(logits, [RowSampling(0.0), RowSampling(0.0, top_k=1)])
    assert tokens == [1, 0]
    raw = torch.log_softmax(logits, dim=-1)
    assert abs(logprobs[0] - raw[0, 1].item()) < 1e-6 and abs(logprobs[1] - raw[1, 0].item()) < 1e-6


def test_top_k_one_is_argmax_when_sampling():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    rows = [RowSampling(1.5, 1.0, 1, torch.Generator().manual_seed(i)) for i in range(4)]
    tokens, _ = sample_rows(logits, rows)
    assert tokens == torch.argmax(logits, dim=-1).tolist()
