"""The engines' control plane answers only to the admin token, as SGLang's `--admin-api-key` does: no other
local process can load or read weights, abort requests, join a weight-update group or load a LoRA adapter.
Generation, health and metrics stay open on loopback, as in SGLang."""

from __future__ import annotations

import json
import os
import stat

import httpx
import pytest

from miles.cli import main
from miles.config import ConfigError
from miles.engines import SGLangClient
from miles.engines.auth import ADMIN_PATHS, TOKEN_ENV, TOKEN_FILE_ENV, admin_token, refusal
from miles.engines.launcher import LaunchSpec, plan_launch
from miles.engines.testing import ServerProcess, save_tiny_checkpoint

CONTROL = {
    "/update_weights_from_disk": {"model_path": "/tmp"},
    "/init_weights_update_group": {
        "master_address": "10.255.255.1",
        "master_port": 1,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "g",
        "backend": "gloo",
    },
    "/abort_request": {"abort_all": True},
    "/get_weights_by_name": {"name": "model.embed_tokens.weight"},
    "/load_lora_adapter": {"lora_name": "x", "lora_path": "/tmp"},
    "/flush_cache": {},
}


@pytest.fixture()
def token_file(tmp_path, monkeypatch):
    path = tmp_path / "config" / "admin_token"
    monkeypatch.setenv(TOKEN_FILE_ENV, str(path))
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    return path


@pytest.fixture()
def server(tmp_path, token_file):
    engine = ServerProcess(
        save_tiny_checkpoint(tmp_path / "model")
    )  # `python -m miles.engines`, as `miles rollout` does
    yield engine
    engine.kill()


def test_the_token_is_made_once_readable_only_by_its_owner(token_file):
    assert admin_token() is None
    token = admin_token(create=True)
    assert len(token) >= 40 and admin_token() == token == token_file.read_text().strip()
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token_file.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by other users; chmod 600"):
        admin_token()
    os.environ[TOKEN_ENV] = "from-the-environment"
    try:
        assert admin_token() == "from-the-environment"
    finally:
        del os.environ[TOKEN_ENV]


@pytest.mark.parametrize("path", sorted(ADMIN_PATHS))
def test_every_control_route_needs_the_admin_key_and_generation_does_not(path):
    assert refusal(path, None, api_key=None, admin_key="k") == 401
    assert refusal(path, "Bearer wrong", api_key=None, admin_key="k") == 401
    assert refusal(path, "Bearer k", api_key=None, admin_key="k") is None
    assert refusal(path, None, api_key=None, admin_key=None) is None  # a server started without keys
    assert refusal("/generate", None, api_key=None, admin_key="k") is None
    assert refusal("/generate", "Bearer k", api_key="a", admin_key="k") == 401  # SGLang: the API key there
    assert refusal("/health_generate", None, api_key="a", admin_key="k") is None


async def test_a_served_engine_refuses_control_calls_without_its_token(server, token_file):
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as raw:
        for path, body in CONTROL.items():
            for headers in ({}, {"authorization": "Bearer guessed"}):
                refused = await raw.post(path, json=body, headers=headers)
                assert refused.status_code == 401 and "admin token" in refused.text, (path, refused.text)
        assert (await raw.get("/health")).status_code == 200
        gen = await raw.post(
            "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
        )
        assert gen.status_code == 200
        before = (
            await raw.post(
                "/get_weights_by_name",
                json={"name": "model.norm.weight"},
                headers={"authorization": f"Bearer {token_file.read_text().strip()}"},
            )
        ).json()
    client = SGLangClient(server.url)  # reads the token as `miles train` does
    try:
        await client.flush_cache()
        assert await client.get_weights_by_name("model.norm.weight") == before
    finally:
        await client.close()
    stranger = SGLangClient(server.url, admin_key="not-the-token")
    try:
        with pytest.raises(
            ConfigError, match=r"/flush_cache refused the admin token: give miles the servers' token"
        ):
            await stranger.flush_cache()
    finally:
        await stranger.close()


def test_miles_train_with_the_wrong_token_is_one_line(server, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "not-the-servers-token")
    config = tmp_path / "c.yaml"
    config.write_text(
        json.dumps(
            {
                "output_dir": str(tmp_path / "run"),
                "steps": 1,
                "env": {"id": "Calculator-v0", "num_train_tasks": 8},
                "model": {"name": "tiny", "size": "0.1m"},
                "engine": {"kind": "sglang", "urls": [server.url]},
                "rollout": {"tasks_per_step": 1, "scheduler": {"group_size": 2}},
                "eval": {"num_tasks": 1},
            }
        )
    )
    assert main(["train", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("miles train: config error: ") and "refused the admin token" in err


def test_sglang_servers_are_launched_with_the_admin_token():
    spec = LaunchSpec(engine="sglang", model="m", dp=2, admin_key="t0k3n")
    for server in plan_launch(spec).servers:
        flags = list(server.command)
        assert flags[flags.index("--admin-api-key") + 1] == "t0k3n"


async def test_an_api_key_closes_generation_too(tmp_path, token_file, monkeypatch):
    """`miles rollout --api-key KEY` (servers read `MILES_API_KEY`): generation and the info routes answer only
    to the key, health stays open; clients send it from the same variable."""
    from miles.engine import SamplingParams
    from miles.engines.auth import API_KEY_ENV

    monkeypatch.setenv(API_KEY_ENV, "generation-key")
    server = ServerProcess(save_tiny_checkpoint(tmp_path / "model"))
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as raw:
            body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
            assert (await raw.post("/generate", json=body)).status_code == 401
            assert (await raw.get("/model_info")).status_code == 401
            assert (await raw.get("/health")).status_code == 200
            ok = await raw.post("/generate", json=body, headers={"authorization": "Bearer generation-key"})
            assert ok.status_code == 200
        client = SGLangClient(server.url)
        try:
            assert (await client.generate([1, 2], SamplingParams(max_new_tokens=2))).output_ids
            await client.flush_cache()  # the admin token still opens the control routes
        finally:
            await client.close()
        monkeypatch.delenv(API_KEY_ENV)
        stranger = SGLangClient(server.url)
        try:
            with pytest.raises(
                ConfigError, match="refused a call without an API key: the servers were started with"
            ):
                await stranger.get_model_info()
        finally:
            await stranger.close()
    finally:
        server.kill()
