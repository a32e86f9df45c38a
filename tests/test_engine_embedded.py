"""The embedded engine in-process: exactness vs transformers, sampling, batching, KV reuse, abort, weights."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles.engine import FinishReason, SamplingParams
from miles.engines import EmbeddedEngine, InvalidRequestError
from miles.engines.testing import small_qwen2


@pytest.fixture
async def engine():
    eng = EmbeddedEngine(small_qwen2(0))
    yield eng
    await eng.close()


def reference_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp.gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


async def test_greedy_matches_hf_generate_in_a_mixed_batch(engine):
    prompts = [list(range(3, 3 + n)) for n in (1, 5, 17, 40)]
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    results = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    for p, r in zip(prompts, results, strict=True):
        ref = engine.model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
        assert r.output_ids == ref
        assert torch.allclose(torch.tensor(r.output_logprobs), reference_logprobs(engine.model, p, ref), atol=1e-4)
        assert r.finish_reason is FinishReason.LENGTH and r.prompt_tokens == len(p)


async def test_sampled_logprobs_are_temperature_scaled_before_filtering(engine):
    prompt = [5, 9, 11, 2]
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=16, seed=1)
    r = await engine.generate(prompt, params)
    ref = reference_logprobs(engine.model, prompt, r.output_ids, temperature=0.7)
    assert torch.allclose(torch.tensor(r.output_logprobs), ref, atol=1e-4)
    raw = reference_logprobs(engine.model, prompt, r.output_ids, temperature=1.0)
    assert not torch.allclose(torch.tensor(r.output_logprobs), raw, atol=1e-3)


async def test_seed_reproducible_regardless_of_batch_company(engine):
    params = SamplingParams(temperature=1.0, max_new_tokens=20, seed=1234)
    alone = await engine.generate([7, 8, 9], params)
    noise = [engine.generate([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=30)) for _ in range(3)]
    together, *_ = await asyncio.gather(engine.generate([7, 8, 9], params), *noise)
    assert together.output_ids == alone.output_ids
    other = await engine.generate([7, 8, 9], SamplingParams(temperature=1.0, max_new_tokens=20, seed=99))
    assert other.output_ids != alone.output_ids


async def test_continuous_batching_shares_decode_steps(engine):
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    before = engine.stats["steps"]
    long_task = asyncio.create_task(engine.generate([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=60)))
    await asyncio.sleep(0.02)  # the long request is decoding when the others join
    await asyncio.gather(*(engine.generate([4 + i, 5, 6], params) for i in range(8)))
    await long_task
    steps = engine.stats["steps"] - before
    assert steps < 60 + 8 * 15  # sequential serving would need every one of these steps
    assert steps <= 62


async def test_kv_reuse_across_turns_is_exact(engine):
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    ctx = [3, 1, 4, 1, 5, 9, 2, 6]
    for turn in range(3):
        cached = await engine.generate(ctx, params, session_id="sess")
        fresh = await engine.generate(ctx, params)
        assert fresh.cached_tokens == 0
        assert cached.cached_tokens == (0 if turn == 0 else len(ctx) - 5)  # all but last output + observation
        assert cached.output_ids == fresh.output_ids
        assert torch.allclose(torch.tensor(cached.output_logprobs), torch.tensor(fresh.output_logprobs), atol=1e-4)
        ctx = ctx + cached.output_ids + [7, 7, 7, 7]


async def test_kv_reuse_with_a_diverging_context_uses_the_common_prefix(engine):
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    first = await engine.generate([10, 11, 12, 13, 14, 15], params, session_id="s")
    edited = [10, 11, 12, 99] + first.output_ids
    r = await engine.generate(edited, params, session_id="s")
    assert r.cached_tokens == 3
    assert r.output_ids == (await engine.generate(edited, params)).output_ids


async def test_stop_token_and_eos():
    eng = EmbeddedEngine(small_qwen2(0))
    try:
        probe = await eng.generate([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=8))
        stop = probe.output_ids[3]
        r = await eng.generate([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop,)))
        assert r.finish_reason is FinishReason.STOP
        assert r.output_ids == probe.output_ids[:probe.output_ids.index(stop) + 1]
    finally:
        await eng.close()
    eos_engine = EmbeddedEngine(small_qwen2(0, eos_token_id=stop))
    try:
        r = await eos_engine.generate([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=8))
        assert r.finish_reason is FinishReason.STOP and r.output_ids[-1] == stop
        ignored = await eos_engine.generate([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=8),
                                            ignore_eos=True)
        assert ignored.output_ids == probe.output_ids
    finally:
        await eos_engine.close()


async def test_abort_running_and_waiting_requests():
    eng = EmbeddedEngine(small_qwen2(0), max_batch_size=1)
    try:
        long = asyncio.create_task(eng.generate([1, 2], SamplingParams(max_new_tokens=1500), rid="long"))
        queued = asyncio.create_task(eng.generate([3, 4], SamplingParams(max_new_tokens=5), rid="queued"))
        await asyncio.sleep(0.3)
        await eng.abort("queued")
        await eng.abort("long")
        r_long, r_queued = await asyncio.wait_for(asyncio.gather(long, queued), 10)
        assert r_long.finish_reason is FinishReason.ABORT and 0 < len(r_long.output_ids) < 1500
        assert r_queued.finish_reason is FinishReason.ABORT and r_queued.output_ids == []
        await eng.abort("unknown-rid")  # a no-op
        ok = await eng.generate([1], SamplingParams(max_new_tokens=3))
        assert ok.finish_reason is FinishReason.LENGTH
    finally:
        await eng.close()


async def test_update_weights_from_state_dict_and_disk(engine, tmp_path):
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = await engine.generate([1, 2, 3], params, session_id="s")
    assert before.weight_version == 0
    other = small_qwen2(7)
    assert await engine.update_weights(state_dict=other.state_dict()) == 1
    after = await engine.generate([1, 2, 3] + before.output_ids, params, session_id="s")
    assert after.weight_version == 1 and after.cached_tokens == 0  # the session cache was flushed
    ref = other.generate(torch.tensor([[1, 2, 3] + before.output_ids]), max_new_tokens=8, do_sample=False)
    assert after.output_ids == ref[0, 3 + len(before.output_ids):].tolist()
    small_qwen2(0).save_pretrained(tmp_path / "ckpt")
    assert await engine.update_weights(path=str(tmp_path / "ckpt")) == 2
    again = await engine.generate([1, 2, 3], params)
    assert again.output_ids == before.output_ids and again.weight_version == 2


async def test_bad_requests_raise_named_errors(engine):
    p = SamplingParams(max_new_tokens=4)
    for ids in ([], [512], [-1], [1, "x"]):
        with pytest.raises(InvalidRequestError):
            await engine.generate(ids, p)
    with pytest.raises(InvalidRequestError):
        await engine.generate([1] * 2048, p)
    with pytest.raises(InvalidRequestError):
        await engine.generate([1], SamplingParams(max_new_tokens=0))
    with pytest.raises(InvalidRequestError):
        await engine.update_weights(state_dict={"no.such.weight": torch.zeros(1)})
    with pytest.raises(InvalidRequestError):
        await engine.update_weights(state_dict={"lm_head.weight": torch.zeros(3, 3)})
    with pytest.raises(InvalidRequestError):
        await engine.update_weights(path="/nonexistent/folder")
    assert engine.weight_version == 0 and await engine.health()
    r = await engine.generate([1] * 2040, SamplingParams(max_new_tokens=100))
    assert r.finish_reason is FinishReason.LENGTH and len(r.output_ids) == 2048 - 2040  # clamped to the context


async def test_from_pretrained_tiny_has_the_tiny_tokenizer_and_stops_at_its_eos():
    eng = EmbeddedEngine.from_pretrained("tiny", max_batch_size=4)
    try:
        ids = eng.tokenizer.encode("hello world")
        eos = eng.tokenizer.eos_token_id
        r = await eng.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=64, stop_token_ids=(eos,)))
        assert r.finish_reason is FinishReason.LENGTH or r.output_ids[-1] == eos
        assert eng.model_path == "tiny" and eng.vocab_size == len(eng.tokenizer)
    finally:
        await eng.close()
    with pytest.raises(InvalidRequestError):
        EmbeddedEngine.from_pretrained("/no/such/model")
