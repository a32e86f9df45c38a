"""Properties of the batched sampler: top-k/top-p keep exactly the right tokens; logprobs are as documented;
the counter-based random streams are uniform, reproducible and independent of the batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.engines.sampling import (
    RowSampling,
    SampleMode,
    SamplingTensors,
    _filter_top_k_top_p,
    _mul32,
    sample,
    seed_key,
    uniform,
)

logits_st = st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=2, max_size=40)


def draw(logits: torch.Tensor, rows: list[RowSampling], steps: list[int]) -> tuple[list[int], list[float]]:
    tensors = SamplingTensors.build(rows, steps, "cpu")
    tokens, logprobs, _ = sample(logits, tensors, SampleMode.of(rows))
    return tokens.tolist(), logprobs.tolist()


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
    top_p = float(
        torch.tensor(top_p, dtype=torch.float32)
    )  # the filter sees top_p in float32 (0.99..9 -> 1.0)
    while need < k and (top_p >= 1.0 or probs[:need].sum().item() < top_p - 1e-6):
        need += 1
    assert need - 1 <= int(kept.sum()) <= need + 1  # ties in the sort may move the boundary by one
    threshold = logits[0][kept].min()
    assert bool((logits[0][~kept] <= threshold).all())  # nothing dropped beats something kept


@settings(max_examples=60, deadline=None)
@given(
    values=logits_st,
    temperature=st.floats(0.05, 3.0),
    seed=st.integers(0, 2**63 - 1),
    step=st.integers(0, 4096),
)
def test_sampled_token_and_logprob(values, temperature, seed, step):
    logits = torch.tensor([values])
    row = RowSampling(temperature, key=seed_key(seed))
    tokens, logprobs = draw(logits, [row], [step])
    expected = torch.log_softmax(logits[0] / temperature, dim=-1)[tokens[0]].item()
    assert abs(logprobs[0] - expected) < 1e-5
    assert draw(logits, [row], [step])[0] == tokens


@settings(max_examples=80, deadline=None)
@given(
    values=logits_st,
    top_k=st.integers(1, 10),
    top_p=st.floats(0.05, 1.0),
    key=st.integers(0, 2**32 - 1),
    step=st.integers(0, 10_000),
)
def test_a_filtered_out_token_is_never_drawn(values, top_k, top_p, key, step):
    logits = torch.tensor([values])
    kept = torch.isfinite(_filter_top_k_top_p(logits, torch.tensor([top_k]), torch.tensor([top_p])))[0]
    tokens, _ = draw(logits, [RowSampling(1.0, top_p, top_k, key)], [step])
    assert bool(kept[tokens[0]])


def test_a_row_draws_the_same_tokens_whatever_shares_its_batch():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=gen)
    rows = [
        RowSampling(0.8 if i else 0.0, 0.9 if i % 2 else 1.0, 20 if i % 3 == 0 else -1, key=seed_key(i))
        for i in range(6)
    ]
    together, logprobs = draw(logits, rows, [5] * 6)
    alone = [draw(logits[i : i + 1], [rows[i]], [5]) for i in range(6)]
    assert together == [a[0][0] for a in alone]
    assert logprobs == pytest.approx([a[1][0] for a in alone], abs=1e-6)
    assert together[0] == int(logits[0].argmax())  # the greedy row
    later, _ = draw(logits, rows, [6] * 6)
    assert later != together  # another step is another draw


def test_draws_follow_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    probs = torch.softmax(logits[0] / 0.7, dim=-1)
    n = 20_000
    tensors = SamplingTensors(
        temperature=torch.full((n,), 0.7),
        top_k=torch.full((n,), -1, dtype=torch.int64),
        top_p=torch.ones(n),
        key=torch.full((n,), seed_key(3), dtype=torch.int64),
        step=torch.arange(n),
    )
    tokens, _, _ = sample(
        logits.expand(n, -1), tensors, SampleMode(greedy=False, sampled=True, filters=False)
    )
    freq = torch.bincount(tokens, minlength=5).float() / n
    assert torch.allclose(freq, probs, atol=0.012)  # ~4 standard deviations at n=20k


def test_uniform_streams_are_uniform_and_distinct():
    keys = torch.tensor([seed_key(s) for s in range(64)]).repeat_interleave(500)
    steps = torch.arange(500).repeat(64)
    u = uniform(keys, steps)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert bool(((counts - 3200).abs() < 250).all())  # 32k draws, ~4.5 sd per bin
    grid = u.view(64, 500)
    assert abs(float(torch.corrcoef(grid[:2])[0, 1])) < 0.2  # neighbouring seeds are not the same stream
    assert len(set(grid[:, 0].tolist())) == 64


@settings(max_examples=200, deadline=None)
@given(x=st.integers(0, 2**32 - 1), c=st.integers(0, 2**32 - 1))
def test_mul32_is_multiplication_mod_2_32(x, c):
    assert int(_mul32(torch.tensor([x]), c)[0]) == (x * c) % 2**32


def test_seed_keys_are_stable_across_runs():
    # seeded sampling reproduces across processes and versions only while this mapping stays fixed;
    # seed 0 gives the low half of splitmix64's published first output, 0xE220A8397B1DCDAF
    assert [seed_key(s) for s in (0, 1, 1234)] == [0x7B1DCDAF, 0x89025CC1, 0x2F181CDB]
    assert len({seed_key(s) for s in range(10_000)}) == 10_000


def test_greedy_rows_report_raw_logprobs_and_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    tokens, logprobs = draw(logits, [RowSampling(0.0), RowSampling(0.0, top_k=1)], [0, 0])
    assert tokens == [1, 0]
    raw = torch.log_softmax(logits, dim=-1)
    assert abs(logprobs[0] - raw[0, 1].item()) < 1e-6 and abs(logprobs[1] - raw[1, 0].item()) < 1e-6


def test_top_k_one_is_argmax_when_sampling():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    rows = [RowSampling(1.5, 1.0, 1, seed_key(i)) for i in range(4)]
    tokens, _ = draw(logits, rows, [0, 1, 2, 3])
    assert tokens == torch.argmax(logits, dim=-1).tolist()
