"""LoRA in the embedded engine, its server and the SGLang client: rows of different adapters decode in the same
steps exactly as peft computes them; each adapter has its own version; caches follow (session, adapter load);
an adapter update drains nothing; /load_lora_adapter and /unload_lora_adapter speak SGLang's bodies; the
weight sync pushes one adapter at a time, in process or from disk."""

from __future__ import annotations

import asyncio
import copy

import httpx
import pytest
import torch

from miles.engine import SamplingParams
from miles.engines import wire
from miles.engines.client import SGLangClient
from miles.engines.embedded import EmbeddedEngine
from miles.engines.errors import InvalidRequestError
from miles.engines.lora import AdapterError
from miles.engines.server import serve_in_thread
from miles.weight_sync import WeightSync
from tests.engines.test_sglang_wire import check, fields
from tests.support.lora import RANKS, VOCAB, adapter_weights, peft_model_with_adapters

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


@pytest.fixture(scope="module")
def models():
    return peft_model_with_adapters()


async def _engine(models, **kwargs) -> EmbeddedEngine:
    base, peft_model = models
    engine = EmbeddedEngine(copy.deepcopy(base), **kwargs)
    for name in RANKS:
        assert await engine.update_adapter(name, weights=adapter_weights(peft_model, name)) == 0
    return engine


def _prompt(seed: int, n: int = 7) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _peft_greedy(peft_model, prompt: list[int], adapter: str | None, n: int) -> list[int]:
    """`n` greedy tokens under `adapter` (None: the base), by peft's forward (EOS is a token like any other)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            x = torch.tensor([ids])
            if adapter is None:
                with peft_model.disable_adapter():
                    logits = peft_model(input_ids=x).logits
            else:
                peft_model.set_adapter(adapter)
                logits = peft_model(input_ids=x).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


async def test_rows_of_different_adapters_decode_in_the_same_steps_as_peft_computes_them(models):
    engine = await _engine(models)
    rows = [None, "terse", "verbose", "qv", "terse", None]
    lengths = [12, 4, 9, 6, 12, 3]  # rows leave mid-batch and the others move into their slots
    try:
        results = await asyncio.gather(
            *(
                engine.generate(
                    _prompt(i), SamplingParams(temperature=0.0, max_new_tokens=n), adapter=a, ignore_eos=True
                )
                for i, (a, n) in enumerate(zip(rows, lengths, strict=True))
            )
        )
    finally:
        await engine.close()
    for i, (adapter, result) in enumerate(zip(rows, results, strict=True)):
        assert result.output_ids == _peft_greedy(models[1], _prompt(i), adapter, lengths[i]), (i, adapter)
    assert len({tuple(r.output_ids) for r in results[1:4]}) == 3  # the adapters do differ
    assert engine.stats["steps"] < 2 * GREEDY.max_new_tokens  # one batch, not a pass per adapter


async def test_each_adapter_has_its_own_version(models):
    engine = await _engine(models)
    try:
        assert await engine.update_adapter("terse", weights=adapter_weights(models[1], "verbose")) == 1
        terse = await engine.generate(_prompt(1), GREEDY, adapter="terse", ignore_eos=True)
        verbose = await engine.generate(_prompt(1), GREEDY, adapter="verbose", ignore_eos=True)
        base = await engine.generate(_prompt(1), GREEDY, ignore_eos=True)
        assert (terse.weight_version, verbose.weight_version, base.weight_version) == (1, 0, 0)
        assert set(terse.token_versions) == {1} and set(verbose.token_versions) == {0}
        assert terse.output_ids == verbose.output_ids  # terse now holds verbose's weights
        assert await engine.update_adapter("qv", weights=adapter_weights(models[1], "qv"), version=7) == 7
        assert engine.adapter_version("qv") == 7 and engine.weight_version == 0
    finally:
        await engine.close()


async def test_a_sessions_cache_is_reused_only_under_the_same_adapter_load(models):
    engine = await _engine(models)
    one = SamplingParams(temperature=0.0, max_new_tokens=3)
    try:

        async def turn(sid: str, adapter: str, history: list[int]) -> tuple[list[int], int]:
            result = await engine.generate(history, one, session_id=sid, adapter=adapter, ignore_eos=True)
            return history + result.output_ids + _prompt(len(history), 2), result.cached_tokens

        terse, _ = await turn("s-terse", "terse", _prompt(1))
        verbose, _ = await turn("s-verbose", "verbose", _prompt(2))
        terse, cached = await turn("s-terse", "terse", terse)
        assert cached > 0
        await engine.update_adapter(
            "terse", weights=adapter_weights(models[1], "terse")
        )  # same weights, new load
        terse, cached = await turn("s-terse", "terse", terse)
        assert cached == 0
        verbose, cached = await turn("s-verbose", "verbose", verbose)  # another adapter's cache is untouched
        assert cached > 0
        _, cached = await turn("s-verbose", "qv", verbose)  # the same session under another adapter: no reuse
        assert cached == 0
    finally:
        await engine.close()


async def test_an_adapter_update_drains_nothing_and_lands_between_decode_steps(models):
    engine = await _engine(models)
    long = SamplingParams(temperature=0.0, max_new_tokens=1500)
    terse, verbose = adapter_weights(models[1], "qv"), adapter_weights(models[1], "verbose")
    try:
        task = asyncio.create_task(engine.generate(_prompt(3), long, adapter="verbose", ignore_eos=True))
        while engine.stats["decode_tokens"] < 10:
            await asyncio.sleep(0.001)
        await engine.update_adapter("terse", weights=terse)
        await engine.update_adapter("verbose", weights=verbose)
        assert not task.done()  # neither update waited for the request in flight
        result = await task
    finally:
        await engine.close()
    versions = result.token_versions
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    assert result.weight_version == 1


async def test_unload_waits_for_the_adapters_requests_and_refuses_new_ones(models):
    engine = await _engine(models)
    try:
        task = asyncio.create_task(
            engine.generate(
                _prompt(4), SamplingParams(temperature=0.0, max_new_tokens=400), adapter="qv", ignore_eos=True
            )
        )
        while engine.stats["decode_tokens"] < 5:
            await asyncio.sleep(0.001)
        unload = asyncio.create_task(engine.unload_adapter("qv"))
        await asyncio.sleep(0)
        with pytest.raises(
            AdapterError, match=r"no LoRA adapter 'qv' is loaded \(loaded: \['terse', 'verbose'\]\)"
        ):
            await engine.generate(_prompt(4), GREEDY, adapter="qv")
        assert len((await task).output_ids) == 400
        await unload
        assert sorted(engine.adapter_sources) == ["terse", "verbose"] and engine.adapter_version("qv") is None
        assert (
            await engine.update_adapter("qv", weights=adapter_weights(models[1], "qv")) == 0
        )  # a free slot again
    finally:
        await engine.close()


async def test_adapters_that_cannot_be_served_are_refused_in_one_line(models, tmp_path):
    base, peft_model = models
    engine = EmbeddedEngine(copy.deepcopy(base), max_loras=1, max_lora_rank=4)
    try:
        with pytest.raises(AdapterError, match="no LoRA adapter 'terse' is loaded \\(loaded: none\\)"):
            await engine.generate(_prompt(0), GREEDY, adapter="terse")
        with pytest.raises(AdapterError, match="rank 8, above this engine's max_lora_rank 4"):
            await engine.update_adapter("verbose", weights=adapter_weights(peft_model, "verbose"))
        await engine.update_adapter("terse", weights=adapter_weights(peft_model, "terse"))
        with pytest.raises(AdapterError, match="already serves 1 adapters"):
            await engine.update_adapter("qv", weights=adapter_weights(peft_model, "qv"))
        with pytest.raises(AdapterError, match="no adapter_config.json"):
            await engine.update_adapter("qv", path=str(tmp_path))
        result = await engine.generate(_prompt(0), GREEDY, adapter="terse")  # the engine still serves
        assert len(result.output_ids) >= 1
    finally:
        await engine.close()


def test_lora_bodies_fit_sglang_io_struct():
    check(wire.load_lora_body("calc@v3", "/runs/x/adapters/calc/v3"), "LoadLoRAAdapterReqInput")
    check(wire.unload_lora_body("calc@v3"), "UnloadLoRAAdapterReqInput")
    names, _ = fields("LoRAUpdateOutput")
    assert set(wire.lora_update_response(True, loaded={"a": "/p"})) <= names
    assert {"lora_name", "lora_path"} <= fields("LoadLoRAAdapterReqInput")[1]


async def test_the_client_loads_versions_through_the_server_and_unloads_old_ones(models, tmp_path):
    base, peft_model = models
    engine = EmbeddedEngine(copy.deepcopy(base))
    server = serve_in_thread(engine)
    client = SGLangClient(server.url)
    folders = {name: adapter_weights(peft_model, name).save(tmp_path / name) for name in RANKS}
    try:
        assert await client.update_adapter("calc", path=str(folders["terse"])) == 0
        first = await client.generate(_prompt(5), GREEDY, adapter="calc")
        assert first.weight_version == 0
        assert first.output_ids == _peft_greedy(peft_model, _prompt(5), "terse", len(first.output_ids))
        assert await client.update_adapter("calc", path=str(folders["verbose"])) == 1
        second = await client.generate(_prompt(5), GREEDY, adapter="calc")
        assert second.weight_version == 1
        assert second.output_ids == _peft_greedy(peft_model, _prompt(5), "verbose", len(second.output_ids))
        with pytest.raises(InvalidRequestError, match="no LoRA adapter 'other'"):
            await client.generate(_prompt(5), GREEDY, adapter="other")
        with pytest.raises(InvalidRequestError, match="PEFT folder"):
            await client.update_adapter("calc", weights=adapter_weights(peft_model, "qv"))
        async with httpx.AsyncClient(base_url=server.url) as raw:
            again = await raw.post(
                "/load_lora_adapter", json=wire.load_lora_body("calc@v1", str(folders["qv"]))
            )
            assert again.status_code == 400 and "already loaded" in again.json()["error_message"]
            gone = await raw.post("/unload_lora_adapter", json=wire.unload_lora_body("nope"))
            assert gone.status_code == 400 and "does not exist" in gone.json()["error_message"]
            bad = await raw.post(
                "/load_lora_adapter", json=wire.load_lora_body("x", str(tmp_path / "missing"))
            )
            assert bad.status_code == 400 and not bad.json()["success"]
    finally:
        await client.close()  # waits for the background unload of calc@v0
        server.stop()
    assert sorted(engine.adapter_sources) == ["calc@v1"]
    await engine.close()


async def test_weight_sync_pushes_one_adapter_in_process_and_from_disk(models, tmp_path):
    base, peft_model = models
    engine = EmbeddedEngine(copy.deepcopy(base))
    server_engine = EmbeddedEngine(copy.deepcopy(base))
    server = serve_in_thread(server_engine)
    client = SGLangClient(server.url)
    try:
        local = WeightSync([engine], method="in_process")
        reports = [
            await local.push_adapter("terse", adapter_weights(peft_model, "terse")),
            await local.push_adapter("verbose", adapter_weights(peft_model, "verbose")),
            await local.push_adapter("terse", adapter_weights(peft_model, "terse")),
        ]
        assert [(r.policy_id, r.version) for r in reports] == [("terse", 0), ("verbose", 0), ("terse", 1)]
        assert engine.adapter_version("terse") == 1 and engine.adapter_version("verbose") == 0
        assert engine.weight_version == 0 and all(r.drain_seconds == 0 for r in reports)
        remote = WeightSync([client], method="disk", staging_dir=tmp_path / "weights", keep_versions=1)
        for _ in range(3):
            report = await remote.push_adapter("qv", adapter_weights(peft_model, "qv"))
        assert report.version == 2 and report.method == "disk"
        assert [p.name for p in (tmp_path / "weights" / "adapters" / "qv").iterdir()] == ["v2"]
        result = await client.generate(_prompt(6), GREEDY, adapter="qv")
        assert result.weight_version == 2
        assert result.output_ids == _peft_greedy(peft_model, _prompt(6), "qv", len(result.output_ids))
    finally:
        await client.close()
        server.stop()
        await engine.close()
        await server_engine.close()


async def test_adapters_through_the_real_sglang_router(models, tmp_path):
    """Two servers behind the real sglang-router: the adapter loads on every worker, and generate calls through
    the router carry `lora_path` to whichever worker serves them."""
    from miles.engines.sglang_router import SGLangRouter

    base, peft_model = models
    engines = [EmbeddedEngine(copy.deepcopy(base), engine_id=f"e{i}") for i in range(2)]
    servers = [serve_in_thread(e) for e in engines]
    router = await SGLangRouter.launch([s.url for s in servers], startup_timeout_s=60)
    try:
        folder = adapter_weights(peft_model, "verbose").save(tmp_path / "verbose")
        assert await router.update_adapter("calc", path=str(folder)) == 0
        assert [sorted(e.adapter_sources) for e in engines] == [["calc@v0"], ["calc@v0"]]
        results = await asyncio.gather(
            *(router.generate(_prompt(i), GREEDY, session_id=f"s{i}", adapter="calc") for i in range(4))
        )
        for i, result in enumerate(results):
            assert result.weight_version == 0
            assert result.output_ids == _peft_greedy(
                peft_model, _prompt(i), "verbose", len(result.output_ids)
            )
        assert await router.update_adapter("calc", path=str(folder)) == 1
        assert (await router.generate(_prompt(0), GREEDY, adapter="calc")).weight_version == 1
    finally:
        await router.close()
        for server, engine in zip(servers, engines, strict=True):
            server.stop()
            await engine.close()
    assert [sorted(e.adapter_sources) for e in engines] == [["calc@v1"], ["calc@v1"]]
