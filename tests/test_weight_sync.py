"""WeightSync against real engines: in-process into an EmbeddedEngine, from disk and by gloo broadcast into a
real embedded HTTP server, and the drain / pause policies for generation in flight."""

from __future__ import annotations

import asyncio
import copy

import httpx
import pytest
import torch

from miles.config import ConfigError
from miles.engine import EngineError, FinishReason, SamplingParams
from miles.engines import weight_broadcast
from miles.engines.client import SGLangClient
from miles.engines.embedded import EmbeddedEngine
from miles.engines.server import serve_in_thread
from miles.engines.testing import small_qwen2
from miles.engines.weight_broadcast import WeightGroupError, plan_buckets
from miles.learner.torch_backend import TorchTrainer, TorchTrainerConfig
from miles.training.config import load_train_config
from miles.weight_sync import (
    SyncConfig,
    WeightSync,
    WeightSyncError,
    build_weight_sync,
    resolve_sync_method,
    save_hf_safetensors,
)

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
    return ids[len(prompt) :]


@pytest.fixture
def trainer() -> TorchTrainer:
    """A trainer whose weights (seed 7, perturbed) differ from every engine's (seed 0)."""
    t = TorchTrainer(small_qwen2(7), TorchTrainerConfig(lr=1e-2))
    with torch.no_grad():
        t.model.lm_head.weight.add_(0.05 * torch.randn_like(t.model.lm_head.weight))
    return t


def assert_matches_trainer(result, trainer: TorchTrainer) -> None:
    assert result.output_ids == trainer_greedy(trainer, PROMPT, len(result.output_ids))
    assert result.output_logprobs == pytest.approx(
        trainer_logprobs(trainer, PROMPT, result.output_ids), abs=1e-4
    )


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


async def test_broadcast_sync_over_gloo_into_a_real_server(served, trainer, tmp_path):
    engine, client = served
    sync = await build_weight_sync(
        SyncConfig(method="broadcast", timeout_s=60), [client], staging_dir=tmp_path
    )
    report = await sync.push(trainer.hf_state_dict())
    assert report.version == 1 == engine.weight_version and report.method == "broadcast"
    assert report.seconds > 0 and report.num_buckets == 1
    after = await client.generate(PROMPT, GREEDY)
    assert after.weight_version == 1
    assert_matches_trainer(after, trainer)
    with torch.no_grad():
        trainer.model.model.embed_tokens.weight.mul_(-1.0)
    assert (await sync.push(trainer.hf_state_dict())).version == 2
    again = await client.generate(PROMPT, GREEDY)
    assert again.weight_version == 2
    assert_matches_trainer(again, trainer)
    await sync.close()


def mixed_dtype_state(seed: int) -> dict[str, torch.Tensor]:
    """New weights for `small_qwen2`: norms in bfloat16, biases in float16, the rest float32 (tied weights get
    one new value)."""
    gen = torch.Generator().manual_seed(seed)
    new: dict[int, torch.Tensor] = {}
    out = {}
    for name, p in small_qwen2(0).state_dict().items():
        t = new.setdefault(p.data_ptr(), p + 0.1 * torch.randn(p.shape, generator=gen))
        out[name] = t.to(
            torch.bfloat16 if "norm" in name else torch.float16 if "bias" in name else torch.float32
        )
    return out


async def test_bucketed_broadcast_lands_bit_exactly_and_bumps_the_version_once(served, tmp_path, monkeypatch):
    engine, client = served
    loads: list[tuple[int, int | None]] = []  # (tensors, version) of every load the server made
    flushes: list[int] = []
    real_load, real_flush = engine.load_weights_sync, engine.flush_cache

    def load(tensors, version=None):
        loads.append((len(tensors), version))
        return real_load(tensors, version)

    async def flush():
        flushes.append(engine.weight_version)
        await real_flush()

    monkeypatch.setattr(engine, "load_weights_sync", load)
    monkeypatch.setattr(engine, "flush_cache", flush)
    state = mixed_dtype_state(1)
    cfg = SyncConfig(method="broadcast", bucket_mb=16 / 1024, timeout_s=60)  # 16 KiB buckets
    sync = await build_weight_sync(cfg, [client], staging_dir=tmp_path)
    buckets = plan_buckets(state, cfg.bucket_bytes)
    assert len(buckets) >= 4 and {b.dtype for b in buckets} == {torch.float32, torch.bfloat16, torch.float16}
    assert all(b.nbytes <= cfg.bucket_bytes or len(b.names) == 1 for b in buckets)

    report = await sync.push(state, version=9)
    assert report.num_buckets == len(buckets) and report.version == 9
    params = engine.model.state_dict()
    for name, sent in state.items():  # cast to the engine's float32 on the engine side: exact
        assert params[name].dtype == torch.float32 and torch.equal(params[name], sent.float()), name
    # one load per bucket; the version moves with the last one only, and the cache is flushed once, after it
    assert [n for n, _ in loads] == [len(b.names) for b in buckets]
    assert [v for _, v in loads] == [0] * (len(buckets) - 1) + [9]
    assert flushes == [9] and engine.weight_version == 9 == client.weight_version
    await sync.close()


async def test_a_failed_bucket_keeps_the_group_usable_and_a_restarted_trainer_rejoins(served, tmp_path):
    engine, client = served
    cfg = SyncConfig(method="broadcast", timeout_s=60)
    sync = await build_weight_sync(cfg, [client], staging_dir=tmp_path)
    bad = {"model.not_a_layer.weight": torch.zeros(3)}
    with pytest.raises(EngineError, match="not_a_layer"):
        await sync.push(bad)
    assert engine.weight_version == 0 and not sync.broadcaster.broken  # the broadcast itself completed
    async with httpx.AsyncClient(
        base_url=client.base_url
    ) as http:  # SGLang 0.5.23: no update outside a session
        resp = await http.post(
            "/update_weights_from_distributed",
            json={"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1]]},
        )
        assert resp.status_code == 400 and "begin_weight_update" in resp.json()["message"]
    state = mixed_dtype_state(2)
    assert (await sync.push(state)).version == 1

    # a new trainer (a restart) replaces the group the old one left on the server
    sync2 = await build_weight_sync(cfg, [SGLangClient(client.base_url)], staging_dir=tmp_path)
    assert (await sync2.push(mixed_dtype_state(3), version=2)).version == 2
    assert torch.equal(engine.model.state_dict()["lm_head.weight"], mixed_dtype_state(3)["lm_head.weight"])
    await sync2.close()
    sync.broadcaster.close()  # the restarted trainer's predecessor: its own side only


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


async def test_an_engine_leaving_mid_sync_marks_the_group_unusable(served, tmp_path, monkeypatch):
    engine, client = served
    monkeypatch.setattr(weight_broadcast, "COLLECTIVE_GRACE_S", 0.5)
    sync = await build_weight_sync(
        SyncConfig(method="broadcast", timeout_s=60), [client], staging_dir=tmp_path
    )
    async with httpx.AsyncClient(base_url=client.base_url) as http:  # the server drops its side of the group
        assert (await http.post("/destroy_weights_update_group", json={})).json()["success"]
    with pytest.raises(WeightGroupError):  # the engine refuses before the broadcast (and its side closed)
        await sync.push(mixed_dtype_state(1))
    assert sync.broadcaster.broken and engine.weight_version == 0
    with pytest.raises(WeightGroupError, match="unusable"):
        await sync.push(mixed_dtype_state(1))  # at once, not after another timeout
    sync.broadcaster.close()


async def test_misconfigured_syncs_raise_named_errors(tmp_path):
    engine = EmbeddedEngine(small_qwen2(0))
    try:
        with pytest.raises(WeightSyncError, match="staging_dir"):
            WeightSync([engine], method="disk")
        with pytest.raises(WeightSyncError, match="WeightBroadcaster"):
            WeightSync([SGLangClient("http://127.0.0.1:9")], method="broadcast")
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


async def test_auto_follows_the_engine_kind_and_bad_combinations_fail_at_setup(tmp_path):
    embedded = EmbeddedEngine(small_qwen2(0))
    http = SGLangClient("http://127.0.0.1:9")  # nothing listens: every check below happens before any request
    try:
        assert resolve_sync_method("auto", [embedded]) == "in_process"
        assert resolve_sync_method("auto", [http, http]) == "broadcast"
        assert resolve_sync_method("disk", [http]) == "disk" == resolve_sync_method("disk", [embedded])
        assert (
            await build_weight_sync(SyncConfig(), [embedded], staging_dir=tmp_path)
        ).method == "in_process"
        with pytest.raises(ConfigError, match="use sync.method: broadcast") as err:
            await build_weight_sync(SyncConfig(method="in_process"), [http], staging_dir=tmp_path)
        assert err.value.key == "sync.method"
        with pytest.raises(ConfigError, match="use sync.method: in_process") as err:
            await build_weight_sync(SyncConfig(method="broadcast"), [embedded], staging_dir=tmp_path)
        assert err.value.key == "sync.method"
        with pytest.raises(ConfigError, match="one kind"):
            resolve_sync_method("auto", [embedded, http])
        remote = SGLangClient("http://10.11.12.13:30000")
        with pytest.raises(ConfigError, match="cannot reach") as err:
            await build_weight_sync(SyncConfig(), [remote], staging_dir=tmp_path)
        assert err.value.key == "sync.master_address"
        await remote.close()
        if not torch.cuda.is_available():
            with pytest.raises(ConfigError, match="nccl needs CUDA") as err:
                await build_weight_sync(SyncConfig(backend="nccl"), [http], staging_dir=tmp_path)
            assert err.value.key == "sync.backend"
    finally:
        await http.close()
        await embedded.close()


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("sync.method=inprocess", "sync.method"),
        ("sync.bucket_mb=0", "sync.bucket_mb"),
        ("sync.keep_versions=0", "sync.keep_versions"),
        ("sync.master_port=70000", "sync.master_port"),
        ("sync.backend=mpi", "sync.backend"),
        ("sync.timeout_s=-1", "sync.timeout_s"),
    ],
)
def test_sync_config_errors_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_train_config(None, [override])
    assert err.value.key == key
    cfg = load_train_config(None, ["sync.bucket_mb=1.5", "sync.master_port=29555"]).sync
    assert (cfg.method, cfg.bucket_bytes, cfg.master_port, cfg.keep_versions) == ("auto", 1572864, 29555, 2)


async def test_disk_sync_keeps_only_the_last_versions(tmp_path):
    staging = tmp_path / "weights"
    (staging / "v3").mkdir(parents=True)  # left by an earlier run: older than anything this run writes
    (staging / "notes").mkdir()  # not a version folder: never touched
    engine = EmbeddedEngine(small_qwen2(0))
    try:
        sync = WeightSync([engine], method="disk", staging_dir=staging, keep_versions=2)
        kept = []
        for seed in range(1, 5):
            await sync.push(mixed_dtype_state(seed))
            kept.append(sorted(p.name for p in staging.iterdir()))
        assert kept == [
            ["notes", "v1", "v3"],
            ["notes", "v1", "v2"],
            ["notes", "v2", "v3"],
            ["notes", "v3", "v4"],
        ]
        assert engine.weight_version == 4
        assert torch.equal(
            engine.model.state_dict()["lm_head.weight"], mixed_dtype_state(4)["lm_head.weight"]
        )
        one = WeightSync([engine], method="disk", staging_dir=staging, keep_versions=1)
        await one.push(mixed_dtype_state(5), version=3)  # a resumed run writes v3 again: it stays, alone
        assert sorted(p.name for p in staging.iterdir()) == ["notes", "v3"]
        assert engine.weight_version == 3
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
