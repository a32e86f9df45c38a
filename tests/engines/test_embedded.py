"""The embedded engine in-process: exactness vs transformers, sampling, batching, KV reuse, abort, weights."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp.gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


async def assert_greedy_like_hf(
    eng: EmbeddedEngine, model, prompts: list[list[int]], max_new_tokens: int
) -> None:
    """The prompts' greedy outputs on `eng`, generated concurrently, are `model.generate`'s (logprobs within 1e-4)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    results = await asyncio.gather(*(eng.generate(p, params) for p in prompts))
    for p, r in zip(prompts, results, strict=True):
        ref = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False)[
            0, len(p) :
        ].tolist()
        assert r.output_ids == ref
        assert torch.allclose(torch.tensor(r.output_logprobs), reference_logprobs(model, p, ref), atol=1e-4)


async def test_greedy_matches_hf_generate_in_a_mixed_batch(engine):
    prompts = [list(range(3, 3 + n)) for n in (1, 5, 17, 40)]
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    results = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    for p, r in zip(prompts, results, strict=True):
        ref = engine.model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[
            0, len(p) :
        ].tolist()
        assert r.output_ids == ref
        assert torch.allclose(
            torch.tensor(r.output_logprobs), reference_logprobs(engine.model, p, ref), atol=1e-4
        )
        assert r.finish_reason is FinishReason.LENGTH and r.prompt_tokens == len(p)


async def test_sampled_logprobs_are_those_of_the_temperature_scaled_filtered_distribution(engine):
    prompt = [5, 9, 11, 2]
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=16, seed=1)
    r = await engine.generate(prompt, params)
    assert r.kept_counts is not None and all(1 <= k <= 20 for k in r.kept_counts)
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + r.output_ids])).logits[0, len(prompt) - 1 : -1].float()
    scaled = logits / 0.7
    expected = []
    for row, tok, k in zip(scaled, r.output_ids, r.kept_counts, strict=True):
        kept = row >= row.topk(k).values[-1]  # what top-k/top-p kept: the k largest
        expected.append(float(torch.log_softmax(row.masked_fill(~kept, float("-inf")), -1)[tok]))
    assert torch.allclose(torch.tensor(r.output_logprobs), torch.tensor(expected), atol=1e-4)
    full = reference_logprobs(engine.model, prompt, r.output_ids, temperature=0.7)
    assert bool((torch.tensor(r.output_logprobs) >= full - 1e-5).all())  # renormalised: never below the full
    unfiltered = await engine.generate(prompt, SamplingParams(temperature=0.7, max_new_tokens=16, seed=1))
    assert unfiltered.kept_counts is None
    ref = reference_logprobs(engine.model, prompt, unfiltered.output_ids, temperature=0.7)
    assert torch.allclose(torch.tensor(unfiltered.output_logprobs), ref, atol=1e-4)


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
    long_task = asyncio.create_task(
        engine.generate([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=400), ignore_eos=True)
    )
    while not engine.stats["decode_tokens"]:  # the long request is decoding when the others join (400 steps
        await asyncio.sleep(0.001)  # leave them time to, however loaded the machine)
    await asyncio.gather(*(engine.generate([4 + i, 5, 6], params) for i in range(8)))
    assert not long_task.done()
    await long_task
    steps = engine.stats["steps"] - before
    assert steps <= 402  # sequential serving would need up to 8 * 16 more


async def test_kv_reuse_across_turns_is_exact(engine):
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    ctx = [3, 1, 4, 1, 5, 9, 2, 6]
    for turn in range(3):
        cached = await engine.generate(ctx, params, session_id="sess")
        fresh = await engine.generate(ctx, params)
        assert fresh.cached_tokens == 0
        assert cached.cached_tokens == (0 if turn == 0 else len(ctx) - 5)  # all but last output + observation
        assert cached.output_ids == fresh.output_ids
        assert torch.allclose(
            torch.tensor(cached.output_logprobs), torch.tensor(fresh.output_logprobs), atol=1e-4
        )
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
        r = await eng.generate(
            [1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop,))
        )
        assert r.finish_reason is FinishReason.STOP
        assert r.output_ids == probe.output_ids[: probe.output_ids.index(stop) + 1]
    finally:
        await eng.close()
    eos_engine = EmbeddedEngine(small_qwen2(0, eos_token_id=stop))
    try:
        r = await eos_engine.generate([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=8))
        assert r.finish_reason is FinishReason.STOP and r.output_ids[-1] == stop
        ignored = await eos_engine.generate(
            [1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=8), ignore_eos=True
        )
        assert ignored.output_ids == probe.output_ids
    finally:
        await eos_engine.close()


async def test_abort_running_and_waiting_requests():
    eng = EmbeddedEngine(small_qwen2(0), max_batch_size=1)
    try:
        long = asyncio.create_task(eng.generate([1, 2], SamplingParams(max_new_tokens=1500), rid="long"))
        queued = asyncio.create_task(eng.generate([3, 4], SamplingParams(max_new_tokens=5), rid="queued"))
        async with asyncio.timeout(60):
            while not eng.stats["decode_tokens"]:
                await asyncio.sleep(0.005)
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


def _fraction_for(model, positions: int, slots: int) -> float:
    """The kv_cache_fraction of the host's RAM that holds `positions` positions for `slots` slots."""
    import os

    cfg = model.config
    kv_heads = cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_position = cfg.num_hidden_layers * 2 * kv_heads * head_dim * 4 * slots
    return (positions + 0.5) * per_position / (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


async def test_a_kv_cache_sized_from_a_memory_fraction_is_allocated_once_and_bounds_the_context():
    model = small_qwen2(0)
    eng = EmbeddedEngine(model, max_batch_size=4, kv_cache_fraction=_fraction_for(model, 48, 4))
    try:
        assert eng.max_context == 48
        r = await eng.generate(list(range(3, 13)), SamplingParams(temperature=0.0, max_new_tokens=100))
        assert r.finish_reason is FinishReason.LENGTH and len(r.output_ids) == 48 - 10  # the context is full
        assert eng._batch.cache.capacity == 48  # allocated whole at the first request, never grown
        with pytest.raises(InvalidRequestError, match="does not fit the context of 48"):
            await eng.generate(list(range(3, 53)), SamplingParams(max_new_tokens=2))
    finally:
        await eng.close()


def test_a_kv_cache_fraction_that_holds_nothing_names_the_fix():
    model = small_qwen2(0)
    with pytest.raises(
        ValueError, match="GiB holds 1 positions per slot for 4 slots.*raise it or lower max_batch_size"
    ):
        EmbeddedEngine(model, max_batch_size=4, kv_cache_fraction=_fraction_for(model, 1, 4))
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="must be in"):
            EmbeddedEngine(model, kv_cache_fraction=bad)


async def test_requests_cancelled_then_closed_leave_no_unretrieved_errors():
    """A run that stops cancels its sessions and closes the engine: the requests' 'engine is closed' errors go to
    nobody, and must not be reported as never-retrieved future exceptions."""
    import gc

    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    eng = EmbeddedEngine(small_qwen2(0), max_batch_size=1)
    tasks = [
        asyncio.create_task(eng.generate([1, 2 + i], SamplingParams(max_new_tokens=1500))) for i in range(3)
    ]
    await asyncio.sleep(0.3)
    for t in tasks:
        t.cancel()
    await asyncio.sleep(0)  # the cancelled generate calls run their except branch
    await eng.close()
    for _ in range(5):
        await asyncio.sleep(0.01)  # the decode thread's settle callbacks run here
    del tasks
    gc.collect()
    loop.set_exception_handler(None)
    assert [c["message"] for c in reported] == []


async def test_update_weights_from_state_dict_and_disk(engine, tmp_path):
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = await engine.generate([1, 2, 3], params, session_id="s")
    assert before.weight_version == 0
    other = small_qwen2(7)
    assert await engine.update_weights(state_dict=other.state_dict()) == 1
    after = await engine.generate([1, 2, 3] + before.output_ids, params, session_id="s")
    assert after.weight_version == 1 and after.cached_tokens == 0  # the session cache was flushed
    ref = other.generate(torch.tensor([[1, 2, 3] + before.output_ids]), max_new_tokens=8, do_sample=False)
    assert after.output_ids == ref[0, 3 + len(before.output_ids) :].tolist()
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
    assert (
        r.finish_reason is FinishReason.LENGTH and len(r.output_ids) == 2048 - 2040
    )  # clamped to the context


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


def _arch(kind: str):
    """A tiny random model of another supported architecture (each one exercises a different forward branch)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = {
        "vocab_size": 512,
        "hidden_size": 48,
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "max_position_embeddings": 512,
        "eos_token_id": None,
        "bos_token_id": None,
        "pad_token_id": None,
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        if kind == "llama":  # a scaled RoPE from the model's own rotary module; 2 query heads per KV head
            cfg = LlamaConfig(
                num_attention_heads=4,
                num_key_value_heads=2,
                attention_bias=True,
                rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                **common,
            )
            return LlamaForCausalLM(cfg).eval()
        if kind == "mistral":  # a sliding window shorter than the prompts; 4 query heads per KV head
            cfg = MistralConfig(num_attention_heads=4, num_key_value_heads=1, sliding_window=8, **common)
            return MistralForCausalLM(cfg).eval()
        cfg = Qwen3Config(num_attention_heads=4, num_key_value_heads=4, head_dim=16, **common)  # q/k norms
        return Qwen3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen3"])
async def test_other_architectures_match_hf_generate(kind):
    model = _arch(kind)
    eng = EmbeddedEngine(model)
    try:
        prompts = [list(range(5, 5 + n)) for n in (3, 11, 20)]
        params = SamplingParams(temperature=0.0, max_new_tokens=10)
        results = await asyncio.gather(
            *(eng.generate(p, params, session_id=f"s{i}") for i, p in enumerate(prompts))
        )
        for p, r in zip(prompts, results, strict=True):
            ref = model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)[0, len(p) :].tolist()
            assert r.output_ids == ref
            assert torch.allclose(
                torch.tensor(r.output_logprobs), reference_logprobs(model, p, ref), atol=1e-4
            )
        ctx = prompts[2] + results[2].output_ids + [9, 9]  # the next turn on the reused cache
        again = await eng.generate(ctx, params, session_id="s2")
        assert again.cached_tokens == len(ctx) - 3
        ref = model.generate(torch.tensor([ctx]), max_new_tokens=10, do_sample=False)[0, len(ctx) :].tolist()
        assert again.output_ids == ref
    finally:
        await eng.close()


def test_an_unsupported_architecture_is_refused_in_one_line():
    from transformers import GPT2Config, GPT2LMHeadModel

    from miles.engines.decoder import UnsupportedModelError

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    with pytest.raises(
        UnsupportedModelError, match="runs llama, mistral, qwen2, qwen3 models; got model_type 'gpt2'"
    ):
        EmbeddedEngine(model)


async def test_chunked_prefill_of_long_prompts_and_many_joiners_is_exact():
    model = small_qwen2(0)
    eng = EmbeddedEngine(model, prefill_tokens=16)  # chunks of <= 16 tokens, groups of <= 16 // width rows
    try:
        prompts = [[(7 * i + j) % 500 + 1 for j in range(n)] for i, n in enumerate((70, 3, 33, 16, 1, 17, 5))]
        await assert_greedy_like_hf(eng, model, prompts, 6)
    finally:
        await eng.close()


async def test_rows_leaving_at_different_steps_keep_the_others_exact(engine):
    """Rows finish after 1..12 tokens (some right after their prefill); the rest are packed into the freed
    slots and must decode on as if alone."""
    prompts = [[(11 * i + j) % 500 + 1 for j in range(3 + 4 * i)] for i in range(8)]
    budgets = [1, 12, 3, 7, 1, 12, 5, 9]
    results = await asyncio.gather(
        *(
            engine.generate(p, SamplingParams(temperature=0.0, max_new_tokens=n))
            for p, n in zip(prompts, budgets, strict=True)
        )
    )
    for p, n, r in zip(prompts, budgets, results, strict=True):
        ref = engine.model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[
            0, len(p) :
        ].tolist()
        assert r.output_ids == ref and len(r.output_ids) == n
        assert torch.allclose(
            torch.tensor(r.output_logprobs), reference_logprobs(engine.model, p, ref), atol=1e-4
        )


async def test_sessions_rejoining_together_reuse_their_own_caches():
    """Several sessions return in one admission with different reusable prefixes: each must get its own KV."""
    eng = EmbeddedEngine(small_qwen2(0))
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=5)
        ctxs = [[(13 * i + j) % 500 + 1 for j in range(4 + 9 * i)] for i in range(5)]
        firsts = await asyncio.gather(
            *(eng.generate(c, params, session_id=f"s{i}") for i, c in enumerate(ctxs))
        )
        nexts = [
            c + f.output_ids + [3] * (1 + 6 * i) for i, (c, f) in enumerate(zip(ctxs, firsts, strict=True))
        ]
        nexts[1] = nexts[1][:3] + [77] + nexts[1][4:]  # diverges early: reuses 3 positions
        again = await asyncio.gather(
            *(eng.generate(c, params, session_id=f"s{i}") for i, c in enumerate(nexts))
        )
        fresh = await asyncio.gather(*(eng.generate(c, params) for c in nexts))
        assert [r.cached_tokens for r in again] == [3 if i == 1 else len(ctxs[i]) + 4 for i in range(5)]
        for a, f in zip(again, fresh, strict=True):
            assert a.output_ids == f.output_ids
            assert torch.allclose(torch.tensor(a.output_logprobs), torch.tensor(f.output_logprobs), atol=1e-5)
    finally:
        await eng.close()


async def test_the_cache_grows_while_rows_decode():
    model = small_qwen2(0)
    eng = EmbeddedEngine(model)  # slots start with 256 positions
    try:
        long = [(5 * j) % 500 + 1 for j in range(250)]
        params = SamplingParams(temperature=0.0, max_new_tokens=20)
        short, grown = await asyncio.gather(eng.generate([1, 2, 3], params), eng.generate(long, params))
        assert eng._batch.cache.capacity == 512
        for p, r in ((long, grown), ([1, 2, 3], short)):
            ref = model.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False)[0, len(p) :].tolist()
            assert r.output_ids == ref
            assert torch.allclose(
                torch.tensor(r.output_logprobs), reference_logprobs(model, p, ref), atol=1e-4
            )
    finally:
        await eng.close()


async def test_max_batch_size_queues_the_rest():
    eng = EmbeddedEngine(small_qwen2(0), max_batch_size=2)
    try:
        prompts = [[i + 1, i + 2] for i in range(5)]
        params = SamplingParams(temperature=0.0, max_new_tokens=6)
        results = await asyncio.gather(*(eng.generate(p, params) for p in prompts))
        for p, r in zip(prompts, results, strict=True):
            ref = eng.model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[
                0, len(p) :
            ].tolist()
            assert r.output_ids == ref
        hist = {
            s.labels.get("le"): s.value
            for s in eng.histograms.batch_size.collect()[0].samples
            if s.name.endswith("_bucket")
        }
        assert hist["2.0"] == hist["+Inf"] > 0  # no step ever ran more than 2 rows
    finally:
        await eng.close()


async def test_after_update_weights_mid_generation_results_match_a_fresh_engine():
    eng = EmbeddedEngine(small_qwen2(0), max_batch_size=4)
    fresh = EmbeddedEngine(small_qwen2(7))
    new_weights = small_qwen2(7).state_dict()
    try:
        running = asyncio.create_task(
            eng.generate([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=600), session_id="s")
        )
        while not eng.stats["decode_tokens"]:
            await asyncio.sleep(0.005)
        assert await eng.update_weights(state_dict=new_weights) == 1
        long = await running
        assert long.token_versions[0] == 0 and long.token_versions[-1] == 1
        prompt = [1, 2, 3] + long.output_ids[:5]
        for turn, params in enumerate(
            (
                SamplingParams(temperature=0.0, max_new_tokens=12),
                SamplingParams(temperature=0.9, top_p=0.8, max_new_tokens=12, seed=5),
            )
        ):
            after, ref = await asyncio.gather(
                eng.generate(prompt, params, session_id="s"), fresh.generate(prompt, params)
            )
            # turn 0: the cache the session's running request built across the update is not kept;
            # turn 1 reuses turn 0's, all of it computed by the new weights
            assert after.cached_tokens == (0 if turn == 0 else len(prompt) - 1)
            assert after.output_ids == ref.output_ids
            assert torch.allclose(
                torch.tensor(after.output_logprobs), torch.tensor(ref.output_logprobs), atol=1e-5
            )
    finally:
        await eng.close()
        await fresh.close()


def test_cuda_graph_captures_of_engines_in_one_process_take_turns(monkeypatch):
    """torch allows one CUDA-graph capture at a time per process, and every engine of `engine.num_engines` has
    its own decode thread: two captures at once (measured on an H200) broke both engines' later steps. The
    capture calls are stand-ins here (a CPU has no CUDA); the batches and their steps are real."""
    import threading
    import time

    from miles.engines.decoder import Decoder
    from miles.engines.runner import DecodeBatch
    from miles.engines.sampling import SampleMode

    state = {"capturing": 0, "most": 0, "stream": "default", "fail": False}
    count = threading.Lock()

    class Capture:  # torch.cuda.graph: makes its stream current, then begins the capture
        def __init__(self, graph: object, pool: object = None, capture_error_mode: str = "global") -> None:
            assert capture_error_mode == "thread_local"  # other threads' work goes on meanwhile

        def __enter__(self) -> None:
            state["stream"] = "capture"
            if state["fail"]:
                raise RuntimeError("capture_begin failed")
            with count:
                state["capturing"] += 1
                state["most"] = max(state["most"], state["capturing"])
            time.sleep(0.05)

        def __exit__(self, *exc: object) -> None:
            with count:
                state["capturing"] -= 1
            state["stream"] = "default"

    monkeypatch.setattr(torch.cuda, "graph", Capture)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "default")
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: state.update(stream=stream))
    decoder = Decoder(small_qwen2(0))
    batches = [DecodeBatch(decoder, decoder.new_cache(4, 128), 4, padded=True) for _ in range(3)]
    key = batches[0].shape(3, 20, SampleMode(greedy=True, sampled=False, filters=False))

    def capture(batch: DecodeBatch) -> None:
        with torch.inference_mode():
            batch._capture(key)

    threads = [threading.Thread(target=capture, args=(b,)) for b in batches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert state["most"] == 1 and all(b.num_graphs == 1 for b in batches)

    state["fail"] = True  # a capture that fails to begin leaves no stream current behind it
    with pytest.raises(RuntimeError, match="capture_begin"), torch.inference_mode():
        batches[0]._capture(batches[0].shape(1, 20, SampleMode(greedy=True, sampled=False, filters=False)))
    assert state["stream"] == "default" and batches[0].num_graphs == 1


def test_padded_bucketed_steps_compute_what_exact_steps_do():
    """A CUDA graph replays a step at a bucketed batch and attention length, with inactive padding rows; the
    same padded step runs eagerly here (only the capture needs CUDA) and must match the exact step, also
    after rows leave and the last rows move into their slots."""
    from miles.engines.decoder import Decoder
    from miles.engines.runner import DecodeBatch
    from miles.engines.sampling import RowSampling, SampleMode, SamplingTensors, sample, seed_key

    model = small_qwen2(0)
    prompts = [[(3 * i + j) % 500 + 1 for j in range(4 + 7 * i)] for i in range(5)]
    rows = [RowSampling(0.0 if i == 2 else 0.8, 0.9 if i == 3 else 1.0, -1, seed_key(i)) for i in range(5)]
    mode = SampleMode.of(rows)
    runs = []
    with torch.inference_mode():
        decoder = Decoder(model)
        for padded in (False, True):
            batch = DecodeBatch(decoder, decoder.new_cache(8, 512), 8, padded=padded)
            width = max(map(len, prompts))
            ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
            pos = torch.arange(width).expand(5, width)
            write = torch.tensor([i * width + j for i, p in enumerate(prompts) for j in range(len(p))])
            last = torch.tensor([i * width + len(p) - 1 for i, p in enumerate(prompts)])
            logits = decoder.forward(batch.cache, ids, pos, 0, width, write=write, last=last)
            first, _, _ = sample(logits, SamplingTensors.build(rows, [0] * 5, "cpu"), mode)
            batch.join(0, first, [len(p) for p in prompts], rows, [1] * 5)
            lengths = [len(p) + 1 for p in prompts]
            out = []
            for step in range(6):
                if step == 3:  # rows 0 and 2 leave; row 4 moves into slot 0
                    batch.move([4], [0], lengths[4])
                    batch.release(3, 5)
                    lengths = [lengths[4], lengths[1], lengths[3]]
                out.append(batch.step(len(lengths), max(lengths), SampleMode.of(rows)))
                lengths = [n + 1 for n in lengths]
            runs.append(out)
        assert batch.shape(5, 70, mode) == (8, 128, mode)
    for (tok_a, lp_a, kept_a), (tok_b, lp_b, kept_b) in zip(*runs, strict=True):
        assert tok_a == tok_b and kept_a == kept_b
        assert lp_a == pytest.approx(lp_b, abs=1e-5)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=96), st.integers(0, 4096))
def test_attention_groups_give_every_row_its_whole_context_and_read_less(lengths, overhead):
    from miles.engines.decoder import attention_groups

    plan = attention_groups(lengths, overhead=overhead)
    if plan is None:
        return
    gathered = {row: n for rows, n in plan.gathered for row in rows}
    assert sum(len(rows) for rows, _ in plan.gathered) == len(gathered)  # no row in two groups
    for row, length in enumerate(lengths):
        assert length <= gathered.get(row, plan.base)
    read = len(lengths) * plan.base + sum(len(rows) * n for rows, n in plan.gathered)
    assert read < len(lengths) * max(lengths)


@pytest.mark.parametrize("kind", ["qwen2", "llama", "mistral", "qwen3"])
def test_a_decode_step_grouped_by_context_length_computes_what_one_padded_call_does(kind):
    """Rows of very different context lengths (a sliding window, grouped-query heads, q/k norms): reading each
    group of rows up to its own longest context gives the logits of one call over every row up to the
    longest."""
    from miles.engines.decoder import Decoder, attention_groups

    model = small_qwen2(0) if kind == "qwen2" else _arch(kind)
    lengths = [300, 7, 12, 140, 5, 33, 9, 290, 64, 65, 3]
    plan = attention_groups(lengths, overhead=0)
    assert plan is not None and len(plan.gathered) >= 2
    with torch.inference_mode():
        decoder = Decoder(model)
        cache = decoder.new_cache(16, 512, initial_len=512)
        cache.data.normal_(generator=torch.Generator().manual_seed(0))
        ids = torch.arange(3, 3 + len(lengths))[:, None]
        pos = torch.tensor(lengths)[:, None] - 1
        padded = decoder.forward(cache, ids, pos, 0, max(lengths))
        grouped = decoder.forward(cache, ids, pos, 0, max(lengths), groups=plan)
    assert torch.allclose(grouped, padded, atol=1e-5)


async def test_a_long_context_decoding_beside_short_ones_is_exact_when_grouped(monkeypatch):
    """One 300-token context among short ones: the engine's decode steps read each group up to its own length
    (spied on), and every row's greedy output and logprobs are those of HF generate."""
    from miles.engines import runner

    plans = []
    original = runner.attention_groups

    def spy(lengths):
        plans.append(original(lengths))
        return plans[-1]

    monkeypatch.setattr(runner, "attention_groups", spy)
    model = small_qwen2(0)
    eng = EmbeddedEngine(model)
    try:
        prompts = [[(5 * i + j) % 500 + 1 for j in range(300 if i == 0 else 2 + i)] for i in range(16)]
        await assert_greedy_like_hf(eng, model, prompts, 8)
    finally:
        await eng.close()
    assert any(plan is not None for plan in plans)
