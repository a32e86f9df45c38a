"""The fused, chunked LM-head logprobs (`token_logprobs_from_hidden`) against the full-logits reference."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.learner.logprobs import shifted_entropy, shifted_token_logprobs, token_logprobs_from_hidden


def _case(n: int, h: int, v: int, seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype)
    weight = torch.randn(v, h, generator=g, dtype=dtype)
    ids = torch.randint(0, v, (n,), generator=g)
    cuts = sorted({0, *torch.randint(1, n, (min(3, n - 1),), generator=g).tolist()}) if n > 1 else [0]
    return hidden, weight, ids, torch.tensor(cuts)


def _reference(hidden, weight, ids, starts, temperature, kept=None):
    logits = hidden @ weight.t()
    return shifted_token_logprobs(logits, ids, starts, temperature, kept), shifted_entropy(
        logits, starts, temperature, kept, ids
    )


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 40),
    h=st.integers(1, 9),
    v=st.integers(2, 30),
    chunk=st.sampled_from([None, 1, 3, 7]),
    temperature=st.sampled_from([1.0, 0.6, 1.7]),
    seed=st.integers(0, 2**16),
)
def test_values_and_gradients_equal_the_full_logits_path(n, h, v, chunk, temperature, seed):
    hidden, weight, ids, starts = _case(n, h, v, seed)
    a = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    b = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 2))
    grads = []
    for fused in (True, False):
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if fused:
            lp, ent = token_logprobs_from_hidden(
                x, w, ids, starts, temperature, entropy=True, chunk_tokens=chunk
            )
        else:
            lp, ent = _reference(x, w, ids, starts, temperature)
            lp, ent = lp.double(), ent.double()
        (lp @ a + ent @ b).backward()
        grads.append((lp.detach(), ent.detach(), x.grad, w.grad))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-5, atol=1e-5)
    assert float(grads[0][0][starts].abs().max()) == 0.0  # sequence starts have no predecessor


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 40),
    h=st.integers(1, 9),
    v=st.integers(2, 30),
    chunk=st.sampled_from([None, 1, 3, 7]),
    temperature=st.sampled_from([1.0, 0.6, 1.7]),
    seed=st.integers(0, 2**16),
)
def test_kept_counts_replay_equals_the_full_logits_path(n, h, v, chunk, temperature, seed):
    """Sampling-mask replay: each position renormalised over its kept set, in the fused forward and backward
    alike; counts of 0 (and of the whole vocabulary) keep everything."""
    hidden, weight, ids, starts = _case(n, h, v, seed)
    kept = torch.randint(0, v + 1, (n,), generator=torch.Generator().manual_seed(seed + 3))
    a = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    b = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 2))
    grads = []
    for fused in (True, False):
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if fused:
            lp, ent = token_logprobs_from_hidden(
                x, w, ids, starts, temperature, entropy=True, chunk_tokens=chunk, kept_counts=kept
            )
        else:
            lp, ent = _reference(x, w, ids, starts, temperature, kept)
            lp, ent = lp.double(), ent.double()
        (lp @ a + ent @ b).backward()
        grads.append((lp.detach(), ent.detach(), x.grad, w.grad))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-5, atol=1e-5)
    full, _ = token_logprobs_from_hidden(hidden, weight, ids, starts, temperature)
    assert bool((grads[0][0] >= full - 1e-9).all())  # a subset's renormalised logprob is never lower
    unfiltered = (kept == 0) | (kept >= v)  # a token's own count: the position before it is renormalised
    torch.testing.assert_close(grads[0][0][unfiltered], full[unfiltered])


def test_float64_gradcheck():
    hidden, weight, ids, starts = _case(9, 4, 6, seed=3)

    def f(x, w):
        return token_logprobs_from_hidden(x, w, ids, starts, 0.8, entropy=True, chunk_tokens=4)

    assert torch.autograd.gradcheck(f, (hidden.requires_grad_(), weight.requires_grad_()))
    kept = torch.tensor([0, 2, 1, 6, 3, 0, 2, 4, 5])

    def g(x, w):
        return token_logprobs_from_hidden(
            x, w, ids, starts, 0.8, entropy=True, chunk_tokens=4, kept_counts=kept
        )

    assert torch.autograd.gradcheck(g, (hidden, weight))


def test_entropy_off_leaves_it_out_and_unused_entropy_adds_no_gradient():
    hidden, weight, ids, starts = _case(12, 5, 11, seed=4)
    lp, ent = token_logprobs_from_hidden(hidden, weight, ids, starts)
    assert ent is None
    x = hidden.clone().requires_grad_()
    lp2, ent2 = token_logprobs_from_hidden(x, weight, ids, starts, entropy=True)
    lp2.sum().backward()
    y = hidden.clone().requires_grad_()
    token_logprobs_from_hidden(y, weight, ids, starts)[0].sum().backward()
    torch.testing.assert_close(x.grad, y.grad)
    torch.testing.assert_close(lp, lp2)


def test_bf16_inputs_reduce_in_float32():
    hidden, weight, ids, starts = _case(30, 16, 50, seed=5, dtype=torch.float32)
    want, _ = _reference(hidden, weight, ids, starts, 1.0)
    x = hidden.bfloat16().requires_grad_()
    w = weight.bfloat16().requires_grad_()
    lp, ent = token_logprobs_from_hidden(x, w, ids, starts, entropy=True, chunk_tokens=8)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    assert float((lp.detach() - want).abs().max()) < 0.3  # bf16 logits, float32 reductions
    lp.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16


def test_padded_vocabulary_rows_get_no_probability():
    hidden, weight, ids, starts = _case(15, 6, 10, seed=6)
    padded = torch.cat([weight, torch.randn(6, 6, dtype=weight.dtype) * 50])  # rows 10..15: padding
    got = token_logprobs_from_hidden(hidden, padded, ids, starts, entropy=True, vocab_size=10)
    want = token_logprobs_from_hidden(hidden, weight, ids, starts, entropy=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    unmasked = token_logprobs_from_hidden(hidden, padded, ids, starts)[0]
    assert not torch.allclose(unmasked, want[0])  # the control: without vocab_size the padding would count


def test_bad_shapes_and_temperature_are_named():
    hidden, weight, ids, starts = _case(5, 4, 6, seed=7)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_from_hidden(hidden, weight, ids, starts, 0.0)
    with pytest.raises(ValueError, match="disagree"):
        token_logprobs_from_hidden(hidden, weight[:, :3], ids, starts)


# ------------------------------------------------------------------ a vocabulary split over two ranks (gloo)


#: kept counts for the 17 tokens of the split-vocabulary case (0: all); rows 2 and 10 of its head are equal, so
#: the two ranks hold tied logits, and a cut among them must break the tie by vocabulary order across ranks
SPLIT_KEPT = torch.tensor([0, 8, 1, 3, 5, 2, 9, 4, 0, 12, 11, 2, 6, 3, 8, 1, 12])


def _split_case():
    hidden, weight, ids, starts = _case(17, 5, 13, seed=8)
    weight[10] = weight[2]
    return hidden, weight, ids, starts


def _vocab_parallel_worker(rank: int, world: int, port: int, out: str, kept: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        hidden, weight, ids, starts = _split_case()
        padded = torch.cat([weight, torch.zeros(3, 5, dtype=weight.dtype)])  # 16 rows, 8 per rank, 13 real
        shard = padded[rank * 8 : (rank + 1) * 8].clone().requires_grad_()
        x = hidden.clone().requires_grad_()
        lp, ent = token_logprobs_from_hidden(
            x,
            shard,
            ids,
            starts,
            0.9,
            entropy=True,
            vocab_start=rank * 8,
            vocab_size=13,
            group=torch.distributed.group.WORLD,
            kept_counts=SPLIT_KEPT if kept else None,
        )
        (lp.sum() + 0.5 * ent.sum()).backward()
        grad_x = x.grad.clone()
        torch.distributed.all_reduce(grad_x)  # a column-parallel head sums its input gradient over ranks
        torch.save({"lp": lp, "ent": ent, "grad_x": grad_x, "grad_w": shard.grad}, f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("kept", [False, True], ids=["full", "kept-counts"])
def test_vocabulary_split_over_ranks_equals_one_rank(tmp_path, kept):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "vp")
    mp.start_processes(
        _vocab_parallel_worker, args=(2, port, out, kept), nprocs=2, join=True, start_method="spawn"
    )
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    hidden, weight, ids, starts = _split_case()
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = _reference(x, w, ids, starts, 0.9, SPLIT_KEPT if kept else None)
    (lp.sum() + 0.5 * ent.sum()).backward()
    for r in ranks:
        torch.testing.assert_close(r["lp"], lp.double(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r["ent"], ent.double(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r["grad_x"], x.grad, rtol=1e-6, atol=1e-6)
    grad_w = torch.cat([ranks[0]["grad_w"], ranks[1]["grad_w"]])
    torch.testing.assert_close(grad_w[:13], w.grad, rtol=1e-6, atol=1e-6)
    assert float(grad_w[13:].abs().max()) == 0.0
