"""The weight-update group meets SGLang's own, in both directions, each side a real process over gloo.

SGLang 0.5.23's `init_custom_process_group` (srt/utils/common.py), `FlattenedTensorBucket`
(srt/weight_sync/tensor_bucket.py) and its receive path `WeightUpdater.receive_weights_from_distributed`
(srt/model_executor/model_runner_components/weight_updater.py) are read from the installed wheel with `ast` and
run as they are (importing sglang needs its GPU dependencies):

- miles trainer -> SGLang engine: `build_weight_sync` + `push` against a process that joins with SGLang's
  function and receives with SGLang's code, behind SGLang's HTTP endpoints (bodies checked against io_struct);
- SGLang-ecosystem trainer -> miles server: a process that makes the group with SGLang's function as rank 0 and
  broadcasts (per tensor, and as SGLang's flattened bucket) into the embedded engine's server.
"""

from __future__ import annotations
import __future__

import ast
import asyncio
import datetime
import importlib.util
import multiprocessing
import os
import time
import types
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from miles.engine import SamplingParams
from miles.engines.client import SGLangClient
from miles.engines.embedded import EmbeddedEngine
from miles.engines.server import serve_in_thread
from miles.engines.testing import small_qwen2
from miles.ports import free_port
from miles.weight_sync import SyncConfig, build_weight_sync

GROUP = "weight_update_group"


# ---------------------------------------------------------------------------- SGLang's code, from the wheel
def _sglang_file(relpath: str) -> Path:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, (
        "sglang sources must be installed (--no-deps)"
    )
    return Path(next(iter(spec.submodule_search_locations))) / relpath


def _exec_defs(relpath: str, nodes: list[ast.stmt], namespace: dict[str, Any]) -> dict[str, Any]:
    flags = __future__.annotations.compiler_flag  # these modules use postponed annotations
    exec(
        compile(
            ast.Module(body=nodes, type_ignores=[]),
            str(_sglang_file(relpath)),
            "exec",
            flags=flags,
            dont_inherit=True,
        ),
        namespace,
    )
    return namespace


@cache
def sglang_init_custom_process_group() -> Any:
    """SGLang's `init_custom_process_group`, with the one module global it reads (`torch_release`)."""
    rel = "srt/utils/common.py"
    tree = ast.parse(_sglang_file(rel).read_text())
    fn = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "init_custom_process_group"]
    assert len(fn) == 1, "init_custom_process_group moved: update this test"
    release = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return _exec_defs(rel, fn, {"torch_release": release})["init_custom_process_group"]


@cache
def sglang_tensor_bucket() -> Any:
    """SGLang's `FlattenedTensorBucket` (its module imports only torch and the standard library)."""
    rel = "srt/weight_sync/tensor_bucket.py"
    return _exec_defs(rel, ast.parse(_sglang_file(rel).read_text()).body, {})["FlattenedTensorBucket"]


@cache
def sglang_receive() -> Any:
    """`WeightUpdater.receive_weights_from_distributed` (and the bucketed helper it calls), as plain functions
    over any `self` with `device` and `_model_update_group`."""
    rel = "srt/model_executor/model_runner_components/weight_updater.py"
    tree = ast.parse(_sglang_file(rel).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "WeightUpdater")
    wanted = {"receive_weights_from_distributed", "_receive_bucketed_weights_from_distributed"}
    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {m.name for m in methods} == wanted, "SGLang's receive path moved: update this test"
    ns = _exec_defs(rel, methods, {"torch": torch, "FlattenedTensorBucket": sglang_tensor_bucket()})

    class Updater(types.SimpleNamespace):
        receive_weights_from_distributed = ns["receive_weights_from_distributed"]
        _receive_bucketed_weights_from_distributed = ns["_receive_bucketed_weights_from_distributed"]

    return Updater


def _own_default_group() -> None:
    """A default process group of one rank, as an SGLang server (its TP group) or an FSDP trainer has."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def _child_setup() -> None:
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"


# ---------------------------------------------------------------------------- miles trainer -> SGLang engine
def _sglang_engine_main(port: int, dump_path: str) -> None:
    """A stand-in SGLang server process: SGLang's endpoints, SGLang's group join and receive code."""
    _child_setup()
    import fastapi
    import uvicorn

    from tests.engines.test_sglang_wire import check  # SGLang's io_struct fields, read with ast

    _own_default_group()  # SGLang's WeightUpdater asserts the server's own default group exists
    init_group = sglang_init_custom_process_group()
    updater = sglang_receive()(device="cpu", _model_update_group={})
    received: dict[str, torch.Tensor] = {}
    log: list[dict[str, Any]] = []
    session = {"open": False}
    app = fastapi.FastAPI()

    def answer(ok: bool, message: str) -> fastapi.responses.JSONResponse:
        return fastapi.responses.JSONResponse(
            {"success": ok, "message": message}, status_code=200 if ok else 400
        )

    @app.get("/get_server_info")
    def server_info() -> dict[str, int]:
        return {"tp_size": 1, "dp_size": 1, "pp_size": 1}

    @app.post("/destroy_weights_update_group")
    def destroy(body: dict[str, Any]) -> Any:
        check(body, "DestroyWeightsUpdateGroupReqInput")
        return answer(False, "The group to be destroyed does not exist.")

    @app.post("/init_weights_update_group")
    def init(body: dict[str, Any]) -> Any:
        check(body, "InitWeightsUpdateGroupReqInput")
        rank = body["rank_offset"] + 0  # rank_offset + tp_rank, as SGLang's weight updater computes it
        updater._model_update_group[body["group_name"]] = init_group(
            backend=body["backend"],
            init_method=f"tcp://{body['master_address']}:{body['master_port']}",
            world_size=body["world_size"],
            rank=rank,
            group_name=body["group_name"],
            timeout=datetime.timedelta(seconds=60),
        )
        log.append({"op": "init", "rank": rank, "world_size": body["world_size"], "backend": body["backend"]})
        return answer(True, "Succeeded to initialize custom process group.")

    @app.post("/begin_weight_update")
    def begin(body: dict[str, Any]) -> Any:
        check(body, "BeginWeightUpdateReqInput")
        session["open"] = True
        log.append({"op": "begin"})
        return answer(True, "Success")

    @app.post("/end_weight_update")
    def end(body: dict[str, Any]) -> Any:
        check(body, "EndWeightUpdateReqInput")
        ok, session["open"] = session["open"], False
        log.append({"op": "end"})
        return answer(ok, "Success" if ok else "no weight-update session is open")

    @app.post("/update_weights_from_distributed")
    def update(body: dict[str, Any]) -> Any:
        check(body, "UpdateWeightsFromDistributedReqInput")
        if not session["open"]:  # SGLang 0.5.23's scheduler refuses updates outside a session
            return answer(
                False,
                "update_weights_from_distributed must run between begin_weight_update() and "
                "end_weight_update()",
            )
        weights = updater.receive_weights_from_distributed(
            names=body["names"],
            dtypes=body["dtypes"],
            shapes=body["shapes"],
            group_name=body["group_name"],
            load_format=body.get("load_format"),
        )
        received.update({name: t.clone() for name, t in weights})
        log.append(
            {
                "op": "update",
                "names": body["names"],
                "flush_cache": body.get("flush_cache", True),
                "weight_version": body.get("weight_version"),
                "load_format": body.get("load_format"),
            }
        )
        return answer(True, "Succeeded to update parameter online.")

    @app.post("/dump")
    def dump() -> list[dict[str, Any]]:
        save_file(received, dump_path)
        return log

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def _trainer_state() -> dict[str, torch.Tensor]:
    """A state dict in three dtypes, large enough for several 8 KiB buckets per dtype."""
    gen = torch.Generator().manual_seed(3)
    state: dict[str, torch.Tensor] = {}
    for i in range(6):
        state[f"layers.{i}.w"] = torch.randn(40, 30, generator=gen)
        state[f"layers.{i}.b"] = torch.randn(30, generator=gen).to(torch.bfloat16)
        state[f"layers.{i}.n"] = torch.randn(17, 9, generator=gen).to(torch.float16)
    return state


async def _wait_up(url: str, proc: Any, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as http:
        while True:
            assert proc.is_alive(), f"the engine process exited with {proc.exitcode}"
            try:
                if (await http.get(url + "/get_server_info")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the engine process did not start"
            await asyncio.sleep(0.2)


@pytest.mark.slow
async def test_miles_trainer_to_sglang_engine(tmp_path):
    port = free_port()
    proc = multiprocessing.get_context("spawn").Process(
        target=_sglang_engine_main, args=(port, str(tmp_path / "received.safetensors"))
    )
    proc.start()
    client = SGLangClient(f"http://127.0.0.1:{port}")
    owned = not dist.is_initialized()
    if owned:  # the trainer's own default group (FSDP ranks): the weight group must leave it alone
        _own_default_group()
    groups_before = len(dist.distributed_c10d._world.pg_map)
    sync = None
    try:
        await _wait_up(client.base_url, proc)
        state = _trainer_state()
        sync = await build_weight_sync(
            SyncConfig(bucket_mb=8 / 1024, timeout_s=60), [client], staging_dir=tmp_path / "unused"
        )
        assert sync.method == "broadcast"  # auto, for HTTP engines
        report = await sync.push(state, version=5)
        assert report.num_buckets >= 6 and report.version == 5 == client.weight_version
        log = (await client._http.post("/dump")).json()

        received = load_file(str(tmp_path / "received.safetensors"))
        assert set(received) == set(state)
        for name, sent in state.items():  # bit-exact, in the dtype it was sent in
            assert received[name].dtype == sent.dtype and torch.equal(received[name], sent), name
        ops = [e["op"] for e in log]
        assert ops == ["init", "begin"] + ["update"] * report.num_buckets + ["end"]
        assert (log[0]["rank"], log[0]["world_size"], log[0]["backend"]) == (1, 2, "gloo")
        updates = [e for e in log if e["op"] == "update"]
        assert all(e["load_format"] == "flattened_bucket" for e in updates)
        # the flush and the version travel with the last bucket only, once every bucket has landed
        assert [e["flush_cache"] for e in updates] == [False] * (len(updates) - 1) + [True]
        assert [e["weight_version"] for e in updates] == [None] * (len(updates) - 1) + ["5"]

        # the trainer's default group is untouched: still one rank, still working, the weight group not in it
        assert len(dist.distributed_c10d._world.pg_map) == groups_before
        ones = torch.ones(3)
        dist.all_reduce(ones)
        assert ones.tolist() == [float(dist.get_world_size())] * 3
    finally:
        if sync is not None:  # a weight group left to the interpreter's exit can abort it
            await sync.close()
        if owned:
            dist.destroy_process_group()
        await client.close()
        proc.terminate()
        proc.join(10)


# ---------------------------------------------------------------------------- SGLang-ecosystem trainer -> miles
def _sglang_trainer_main(url: str, master_port: int, sent_path: str) -> None:
    """An SGLang-ecosystem trainer: rank 0 by SGLang's own function, SGLang's HTTP bodies, `broadcast(src=0)`."""
    from concurrent.futures import ThreadPoolExecutor

    _child_setup()
    _own_default_group()
    init_group = sglang_init_custom_process_group()
    bucket_cls = sglang_tensor_bucket()
    gen = torch.Generator().manual_seed(11)
    params = dict(small_qwen2(0).named_parameters())
    names = sorted(params)
    new = {n: (params[n].detach() + 0.1 * torch.randn(params[n].shape, generator=gen)) for n in names}
    half = len(names) // 2
    per_tensor = names[:half]  # float32, one broadcast per tensor (SGLang's default receive path)
    flat_f32 = [n for n in names[half:] if "norm" not in n]
    flat_bf16 = [n for n in names[half:] if "norm" in n]
    # one flattened bucket of mixed dtypes, float32 first so every tensor stays aligned
    bucketed = {**{n: new[n] for n in flat_f32}, **{n: new[n].to(torch.bfloat16) for n in flat_bf16}}
    sent = {n: new[n] for n in per_tensor} | bucketed

    with httpx.Client(base_url=url, timeout=120) as http, ThreadPoolExecutor(1) as pool:

        def post(path: str, body: dict[str, Any]) -> Any:
            return pool.submit(http.post, path, json=body)

        def ok(future: Any) -> None:
            resp = future.result()
            assert resp.status_code == 200 and resp.json()["success"], resp.text

        joining = post(
            "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": master_port,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": GROUP,
                "backend": "gloo",
            },
        )
        group = init_group(
            backend="gloo",
            init_method=f"tcp://127.0.0.1:{master_port}",
            world_size=2,
            rank=0,
            group_name=GROUP,
            timeout=datetime.timedelta(seconds=60),
        )
        ok(joining)
        ok(post("/begin_weight_update", {}))
        call = post(
            "/update_weights_from_distributed",
            {
                "names": per_tensor,
                "dtypes": ["float32"] * len(per_tensor),
                "shapes": [list(new[n].shape) for n in per_tensor],
                "group_name": GROUP,
                "flush_cache": False,
            },
        )
        for n in per_tensor:
            dist.broadcast(new[n], src=0, group=group)
        ok(call)
        bucket = bucket_cls(named_tensors=list(bucketed.items()))
        meta = bucket.get_metadata()
        call = post(
            "/update_weights_from_distributed",
            {
                "names": [m.name for m in meta],
                "dtypes": [str(m.dtype).removeprefix("torch.") for m in meta],
                "shapes": [list(m.shape) for m in meta],
                "group_name": GROUP,
                "load_format": "flattened_bucket",
                "flush_cache": True,
                "weight_version": "7",
            },
        )
        dist.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
        ok(call)
        ok(post("/end_weight_update", {}))
    save_file({n: t.contiguous() for n, t in sent.items()}, sent_path)
    dist.destroy_process_group(group)  # gloo groups left to the interpreter's exit can abort it (SIGABRT)
    dist.destroy_process_group()


@pytest.mark.slow
async def test_sglang_trainer_to_miles_server(tmp_path):
    engine = EmbeddedEngine(small_qwen2(0), model_path="interop")
    handle = serve_in_thread(engine)
    client = SGLangClient(handle.url)
    proc = multiprocessing.get_context("spawn").Process(
        target=_sglang_trainer_main, args=(handle.url, free_port(), str(tmp_path / "sent.safetensors"))
    )
    try:
        before = await client.generate([5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=4))
        proc.start()
        await asyncio.to_thread(proc.join, 180)
        assert proc.exitcode == 0, "the SGLang-side trainer failed (its traceback is above)"

        sent = load_file(str(tmp_path / "sent.safetensors"))
        params = engine.model.state_dict()
        assert set(sent) == set(dict(engine.model.named_parameters()))
        assert {t.dtype for t in sent.values()} == {torch.float32, torch.bfloat16}
        for name, t in sent.items():  # cast to the engine's dtype on the engine side, exactly
            assert params[name].dtype == torch.float32 and torch.equal(params[name], t.float()), name
        assert engine.weight_version == 7
        after = await client.generate([5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=4))
        assert after.weight_version == 7 and after.output_logprobs != before.output_logprobs
    finally:
        if proc.is_alive():
            proc.terminate()
        await client.close()
        handle.stop()
        await engine.close()
