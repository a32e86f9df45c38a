"""WeightSync against real engines: in-process into an EmbeddedEngine, from disk and by gloo broadcast into a
real embedded HTTP server, and the drain / pause policies for generation in flight."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from miles.engine import FinishReason, SamplingParams
from miles.engines.client import SGLangClient
from miles.engines.embedded import EmbeddedEngine
from miles.engines.server import serve_in_thread
from miles.engines.sglang_router import free_port
from miles.engines.testing import small_qwen2
from miles.engines.weight_broadcast import WeightBroadcaster, init_weight_update_group
from miles.trainers.torch_backend import TorchTrainer, TorchTrainerConfig
from miles.weight_sync import WeightSync, WeightSyncError, save_hf_safetensors

PROMPT = [5, 17, 3, 99, 42, 7]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


def trainer_logprobs(trainer: TorchTrainer, prompt: list[int], output: list[int]) -> list[float]:
    """Logprobs of `output` after `prompt` under the trainer's live model (one plain forward)."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = trainer.model(ids).logits[0].float().log_softmax(-1)
    return [float(logp[len(prompt) - 1 + i, tok]) for i, tok in enumerate(output)]


def trainer_greedy(trainer: TorchTrainer, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(trainer.model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture
def trainer() -> TorchTrainer:
    """A trainer whose weights (seed 7, perturbed) differ from every engine's (seed 0)."""
    t = TorchTrainer(small_qwen2(7), TorchTrainerConfig(lr=1e-2))
    with torch.no_grad():
        t.model.lm_head.weight.add_(0.05 * torch.randn_like(t.model.lm_head.weight))
    return t


def assert_matches_trainer(result, trainer: TorchTrainer) -> None:
    assert result.output_ids == trainer_greedy(trainer, PROMPT, len(result.output_ids))
    assert result.output_logprobs == pytest.approx(trainer_logprobs(trainer, PROMPT, result.output_ids),
                                                   abs=1e-4)


async def test_in_process_sync_makes_the_engine_match_the_trainer(trainer):
    engine = EmbeddedEngine(small_qwen2(0))
    try:
        before = await engine.generate(PROMPT, GREEDY)
        assert before.weight_version == 0
        off = trainer_logprobs(trainer, PROMPT, before.output_ids)
        assert max(abs(a - b) for a, b in zip(before.output_logprobs, off, strict=True)) > 1e-3

        sync = WeightSync([engine], method="in_process", policy="drain")
        report = await sync.push(trainer.hf_state_dict())
        assert report.version == 1 == engine.weight_version == sync.version
        assert report.method == "in_process" and report.num_engines == 1
        assert report.seconds > 0 and report.drain_seconds >= 0
        assert report.num_bytes == sum(t.numel() * t.element_size() for t in trainer.hf_state_dict().values())

        after = await engine.generate(PROMPT, GREEDY)
        assert after.weight_version == 1
        assert_matches_trainer(after, trainer)

        # the engine holds a copy: training on moves the trainer away until the next sync
        with torch.no_grad():
            trainer.model.lm_head.weight.mul_(1.5)
        stale = await engine.generate(PROMPT, GREEDY)
        assert stale.output_logprobs == pytest.approx(after.output_logprobs, abs=1e-6)
        report2 = await sync.push(trainer.hf_state_dict())
        assert report2.version == 2 and [r.version for r in sync.history] == [1, 2]
        assert_matches_trainer(await engine.generate(PROMPT, GREEDY), trainer)
    finally:
        await engine.close()


async def test_in_process_sync_reaches_every_engine(trainer):
    engines = [EmbeddedEngine(small_qwen2(0), engine_id=f"e{i}") for i in range(2)]
    try:
        report = await WeightSync(engines).push(trainer.hf_state_dict())
        assert report.num_engines == 2 and [e.weight_version for e in engines] == [1, 1]
        for e in engines:
            assert_matches_trainer(await e.generate(PROMPT, GREEDY), trainer)
    finally:
        await asyncio.gather(*(e.close() for e in engines))


@pytest.fixture
async def served():
    engine = EmbeddedEngine(small_qwen2(0), model_path="sync-test")
    handle = serve_in_thread(engine)
    client = SGLangClient(handle.url)
    yield engine, client
    await client.close()
    handle.stop()
    await engine.close()


async def test_disk_sync_into_a_real_server(served, trainer, tmp_path):
    engine, client = served
    sync = WeightSync([client], method="disk", staging_dir=tmp_path / "weights")
    report = await sync.push(trainer.hf_state_dict())
    assert report.version == 1 and report.method == "disk" and report.seconds > 0
    assert (tmp_path / "weights" / "v1" / "model.safetensors").is_file()
    assert engine.weight_version == 1 and client.weight_version == 1
    after = await client.generate(PROMPT, GREEDY)
    assert after.weight_version == 1
    assert_matches_trainer(after, trainer)
    assert (await client.refresh_weight_version()) == 1

    report2 = await sync.push(small_qwen2(0).state_dict())  # back to the server's original weights
    assert report2.version == 2 and (tmp_path / "weights" / "v2" / "model.safetensors").is_file()
    local = EmbeddedEngine(small_qwen2(0))
    try:
        ref = await local.generate(PROMPT, GREEDY)
    finally:
        await local.close()
    back = await client.generate(PROMPT, GREEDY)
    assert back.weight_version == 2 and back.output_ids == ref.output_ids


async def test_broadcast_sync_over_gloo_into_a_real_server(served, trainer):
    engine, client = served
    bc = WeightBroadcaster("127.0.0.1", free_port(), world_size=2, backend="gloo", timeout_s=60)
    await init_weight_update_group(bc, [client])
    sync = WeightSync([client], method="broadcast", broadcaster=bc)
    report = await sync.push(trainer.hf_state_dict())
    assert report.version == 1 == engine.weight_version and report.method == "broadcast"
    assert report.seconds > 0
    after = await client.generate(PROMPT, GREEDY)
    assert after.weight_version == 1
    assert_matches_trainer(after, trainer)
    with torch.no_grad():
        trainer.model.model.embed_tokens.weight.mul_(-1.0)
    assert (await sync.push(trainer.hf_state_dict())).version == 2
    again = await client.generate(PROMPT, GREEDY)
    assert again.weight_version == 2
    assert_matches_trainer(again, trainer)


async def test_drain_waits_for_the_in_flight_generate(trainer):
    engine = EmbeddedEngine(small_qwen2(0))
    order: list[str] = []
    try:
        long = SamplingParams(temperature=1.0, max_new_tokens=400)

        async def generate():
            r = await engine.generate(PROMPT, long)
            order.append("generate")
            return r

        async def push():
            r = await sync.push(trainer.hf_state_dict())
            order.append("sync")
            return r

        sync = WeightSync([engine], method="in_process", policy="drain", poll_s=0.001)
        gen = asyncio.create_task(generate())
        while engine.num_in_flight == 0:
            await asyncio.sleep(0.001)
        result, report = await asyncio.gather(gen, push())
        assert order == ["generate", "sync"]
        assert result.finish_reason is FinishReason.LENGTH and len(result.output_ids) == 400
        assert result.weight_version == 0 and result.extra["weight_version_start"] == 0  # all old weights
        assert report.version == 1 and report.drain_seconds > 0
        assert (await engine.generate(PROMPT, GREEDY)).weight_version == 1
    finally:
        await engine.close()


async def test_pause_loads_while_a_generate_is_in_flight(trainer):
    engine = EmbeddedEngine(small_qwen2(0))
    try:
        sync = WeightSync([engine], method="in_process", policy="pause")
        gen = asyncio.create_task(engine.generate(PROMPT, SamplingParams(max_new_tokens=1900), rid="long"))
        while engine.num_in_flight == 0:
            await asyncio.sleep(0.001)
        report = await sync.push(trainer.hf_state_dict())
        assert report.drain_seconds == 0.0 and report.version == 1
        still_running = engine.num_in_flight > 0
        await engine.abort("long")
        result = await gen
        assert result.extra["weight_version_start"] == 0
        if still_running:  # it was running when the new weights landed: it finishes under them
            assert result.weight_version == 1
    finally:
        await engine.close()


async def test_misconfigured_syncs_raise_named_errors(tmp_path):
    engine = EmbeddedEngine(small_qwen2(0))
    try:
        with pytest.raises(WeightSyncError, match="staging_dir"):
            WeightSync([engine], method="disk")
        with pytest.raises(WeightSyncError, match="WeightBroadcaster"):
            WeightSync([engine], method="broadcast")
        sync = WeightSync([engine], drain_timeout_s=0.0, poll_s=0.001)
        gen = asyncio.create_task(engine.generate(PROMPT, SamplingParams(max_new_tokens=1900), rid="slow"))
        while engine.num_in_flight == 0:
            await asyncio.sleep(0.001)
        with pytest.raises(WeightSyncError, match="drain"):
            await sync.push(small_qwen2(1).state_dict())
        assert engine.weight_version == 0 and sync.history == []
        await engine.abort("slow")
        await gen
    finally:
        await engine.close()


def test_safetensors_folder_clones_tied_weights(tmp_path):
    model = small_qwen2(0)
    sd = copy.copy(model.state_dict())
    sd["alias.weight"] = sd["lm_head.weight"]  # two names, one storage
    folder = save_hf_safetensors(sd, tmp_path / "w")
    from safetensors.torch import load_file

    back = load_file(str(folder / "model.safetensors"))
    assert torch.equal(back["alias.weight"], sd["lm_head.weight"]) and set(back) == set(sd)
