"""Attaching `miles train` to running HTTP engines: context length, tokenizer identity, unreachable servers,
and a context overflow against a real server ending `context_full`."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles.config import ConfigError
from miles.engines.attach import PROBE_TEXT, attach, read_server_facts
from miles.engines.embedded import EmbeddedEngine
from miles.engines.server import serve_in_thread
from miles.engines.testing import ServerProcess, small_qwen2
from miles.ports import free_port
from miles.sessions.recorder import read_sessions
from miles.tiny import load_tiny_tokenizer
from miles.tito import load_tokenizer


@pytest.fixture(scope="module")
def tiny_server():
    tok = load_tiny_tokenizer()
    engine = EmbeddedEngine(small_qwen2(0, vocab_size=len(tok), max_position_embeddings=96), tokenizer=tok)
    handle = serve_in_thread(engine)
    yield handle
    handle.stop()


def test_attach_reads_the_context_length_and_accepts_the_same_tokenizer(tiny_server):
    facts = asyncio.run(attach([tiny_server.url], load_tiny_tokenizer(), "tiny"))
    assert [f.context_length for f in facts] == [96]
    assert facts[0].probe_ids == tuple(load_tiny_tokenizer().encode(PROBE_TEXT, add_special_tokens=False))


def test_attach_refuses_a_server_whose_tokenizer_differs(tiny_server):
    with pytest.raises(ConfigError) as err:
        asyncio.run(attach([tiny_server.url], load_tokenizer("qwen3"), "qwen3"))
    assert err.value.key == "model.tokenizer"
    assert tiny_server.url in str(err.value) and "'qwen3'" in str(err.value)


def test_an_unreachable_server_is_one_config_line():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError) as err:
        asyncio.run(read_server_facts(url, timeout_s=2.0))
    assert err.value.key == "engine.urls" and url in str(err.value) and "\n" not in str(err.value)


@pytest.fixture(scope="module")
def small_context_server(tmp_path_factory):
    """A `python -m miles.engines` server of a tiny-vocabulary model whose context holds 64 tokens."""
    folder = tmp_path_factory.mktemp("model")
    tok = load_tiny_tokenizer()
    small_qwen2(0, vocab_size=len(tok), max_position_embeddings=64).save_pretrained(folder)
    tok.save_pretrained(folder)
    server = ServerProcess(folder)
    yield server
    server.kill()


def _train(tmp_path: Path, url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        json.dumps(
            {
                "output_dir": str(tmp_path / "run"),
                "steps": 1,
                "env": {"id": "Calculator-v0", "num_train_tasks": 8},
                "model": {"name": "tiny", "size": "0.1m"},
                "engine": {"kind": "sglang", "urls": [url]},
                "sync": {"method": "disk"},
                "rollout": {
                    "tasks_per_step": 1,
                    "scheduler": {
                        "group_size": 2,
                        "progress": False,
                        "session": {"sampling": {"max_new_tokens": 16}},
                    },
                },
                "eval": {"num_tasks": 1},
            }
        )
    )
    return subprocess.run(
        [sys.executable, "-m", "miles.cli", "train", "--config", str(cfg), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )


@pytest.mark.slow
def test_a_context_overflow_against_an_http_engine_ends_context_full(small_context_server, tmp_path):
    proc = _train(tmp_path, small_context_server.url)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_sessions(tmp_path / "run" / "sessions.jsonl").records
    assert len(records) == 2
    # The Calculator prompt alone is longer than the server's 64-token context: the session knows that
    # from /server_info and ends before sending, instead of an HTTP 400 turning into engine_error.
    assert {r.termination.value for r in records} == {"context_full"}
    assert all("context 64" in r.error.message for r in records)


@pytest.mark.slow
def test_miles_train_refuses_an_engine_with_another_tokenizer_in_one_line(small_context_server, tmp_path):
    proc = _train(tmp_path, small_context_server.url, "--set", "model.tokenizer=qwen3")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "model.tokenizer" in proc.stderr and small_context_server.url in proc.stderr
