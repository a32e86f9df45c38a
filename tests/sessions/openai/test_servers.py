"""The endpoint on real servers: in front of an HTTP engine (`SGLangClient` to the embedded engine's SGLang-native
server, a real model), and mounted on the engine server itself by `miles rollout --openai`."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from miles.engines import EmbeddedEngine, SGLangClient
from miles.engines.server import serve_in_thread
from miles.ports import free_port
from miles.sessions.openai.endpoint import OpenAIEndpoint
from miles.sessions.replay import check_tito
from miles.tito import TITOTokenizer, TokenizerSpec
from miles.trajectory import message_from_record
from tests.support.openai import served

ROOT = Path(__file__).resolve().parents[3]
SFT = str(ROOT / "checkpoints" / "calculator-sft-1m")
CALC = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    pytest.fail(f"{url} did not answer /health within {timeout_s} s")


def agent_loop(client: OpenAI, question: str, turns: int = 3) -> list:
    """A plain agent loop; tool calls get a fixed result."""
    messages: list = [{"role": "user", "content": question}]
    replies = []
    for _ in range(turns):
        reply = client.chat.completions.create(
            model="m", messages=messages, tools=[CALC], max_tokens=40, temperature=0
        )
        replies.append(reply)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            messages.append({"role": "user", "content": "And what is 2 * 3?"})
            continue
        messages += [{"role": "tool", "tool_call_id": c.id, "content": "12"} for c in message.tool_calls]
    return replies


def test_in_front_of_an_http_engine_with_a_real_model():
    tito = TITOTokenizer.from_spec(TokenizerSpec(SFT, "compact"))
    engine = EmbeddedEngine.from_pretrained(SFT, max_batch_size=8)
    handle = serve_in_thread(engine)
    client_engine = SGLangClient(handle.url)
    endpoint = OpenAIEndpoint(client_engine, tokenizer=tito)
    try:
        with served(endpoint) as url:
            replies = agent_loop(
                OpenAI(base_url=f"{url}/v1", api_key="real-1", max_retries=0), "What is 7 + 5?"
            )
            httpx.post(f"{url}/sessions/real-1/close").raise_for_status()
    finally:
        handle.stop()
    [record] = endpoint.closed["real-1"].result
    assert [r.usage.completion_tokens for r in replies] == [
        t.output_end - t.output_start for t in record.turns
    ]
    assert replies[-1].usage.prompt_tokens_details.cached_tokens > 0  # the server kept the session's cache
    assert check_tito(record, tito).ok  # the recording equals TITO rebuilt from its messages and outputs
    info = record.final_info["tito"]
    assert info["special_tokens"] == 0 and info["non_assistant_text"] == 0, info["summary"]
    for reply, turn in zip(replies, record.turns, strict=True):  # what the client saw is what was recorded
        message = message_from_record(turn.assistant)
        assert (reply.choices[0].message.content or "") == message.content
        assert [c.function.arguments for c in reply.choices[0].message.tool_calls or []] == [
            c.raw_arguments for c in message.tool_calls
        ]


@pytest.mark.slow
def test_miles_rollout_openai_serves_the_endpoint_beside_sglangs_api(tmp_path):
    bad = subprocess.run(
        [sys.executable, "-m", "miles.cli", "rollout", "--model", SFT, "--openai", "session.parser=nope"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "session.parser" in bad.stderr and "unknown tool-call parser 'nope'" in bad.stderr
    port = free_port()
    record = tmp_path / "sessions.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "miles.cli",
        "rollout",
        "--model",
        SFT,
        "--port",
        str(port),
        "--openai",
        "chat_template=compact",
        "--openai",
        f"record={record}",
        "--openai",
        "session.history_mismatch=fork",
    ]
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc)
            client = OpenAI(base_url=f"{url}/v1", api_key="cli-1", max_retries=0)
            replies = agent_loop(client, "What is 3 * 4?", turns=2)
            # a rewritten history forks a branch instead of a 409 (session.history_mismatch=fork)
            client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "What is 1 + 1?"}],
                tools=[CALC],
                max_tokens=20,
            )
            assert httpx.post(f"{url}/sessions/cli-1/close").json()["records"] == 2
            native = httpx.post(
                f"{url}/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
            ).json()
            assert len(native["output_ids"]) == 2  # SGLang's API on the same server
            models = httpx.get(f"{url}/v1/models").json()["data"]
            assert models[0]["id"] == SFT
        finally:
            proc.terminate()
            proc.wait(30)
    from miles.sessions.recorder import read_sessions

    records = read_sessions(record).records
    assert [r.session_id for r in records] == ["cli-1", "cli-1.fork1"]
    assert len(records[0].turns) == len(replies) and records[1].final_info["forked_at"] == 0
