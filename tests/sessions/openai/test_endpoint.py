"""The OpenAI endpoint over real HTTP on loopback, driven by the real `openai` client (sync and async, streaming
and not): multi-turn tool use whose recorded tokens equal a direct TITO session's, history rewrites (409 or a
fork), malformed requests (4xx, the session stays usable), and records that replay."""

from __future__ import annotations

import asyncio
import io
import json
import tempfile
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import AsyncOpenAI, OpenAI
from openai.types import ErrorObject
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from miles.engine import EngineError
from miles.sessions.instant import InstantEngine
from miles.sessions.openai.config import OpenAISessionConfig
from miles.sessions.openai.endpoint import OpenAIEndpoint
from miles.sessions.openai.routes import EndpointServer, create_openai_app
from miles.sessions.recorder import read_sessions
from miles.sessions.replay import check_tito
from miles.sessions.replay_cli import main as replay_main
from miles.types import Message, TerminationReason
from tests.support.openai import (
    TOOLS,
    Script,
    answer,
    calculator_script,
    call,
    direct,
    drive,
    endpoint_for,
    served,
    thinking_script,
    tito,
)


def assert_exact(endpoint: OpenAIEndpoint, session_id: str, expected) -> None:
    """The closed session's single record holds the direct session's tokens, with no special-token or
    non-assistant mismatch."""
    records = endpoint.closed[session_id].result
    assert len(records) == 1
    traj = records[0].trajectory
    assert traj.token_ids == expected.token_ids
    assert traj.loss_mask == expected.loss_mask
    assert traj.rollout_logprobs == expected.rollout_logprobs
    tito_info = records[0].final_info["tito"]
    assert tito_info["special_tokens"] == 0 and tito_info["non_assistant_text"] == 0, tito_info["summary"]


def test_sync_client_multi_turn_tool_use_is_token_exact():
    t, script = tito("tiny"), calculator_script()
    expected, outputs = direct(t, script)
    endpoint = endpoint_for(outputs, t)
    with served(endpoint) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="s1", max_retries=0)
        replies = drive(client, script)
        assert [r.choices[0].finish_reason for r in replies] == ["tool_calls", "tool_calls", "stop"]
        calls = replies[0].choices[0].message.tool_calls
        assert [(c.function.name, c.function.arguments) for c in calls] == [
            ("calculate", '{"expression": "58 * 2"}'),
            ("lookup", '{"key": "x"}'),
        ]
        assert len({c.id for r in replies for c in r.choices[0].message.tool_calls or []}) == 3  # unique ids
        assert replies[1].choices[0].message.content == "Adding now."
        assert replies[-1].choices[0].message.content == "The answer is 153."
        assert replies[-1].usage.completion_tokens == len(outputs[-1])
        assert replies[-1].usage.prompt_tokens == len(expected.token_ids) - len(outputs[-1])
        open_view = httpx.get(f"{url}/sessions/s1/trajectory").json()
        assert not open_view["closed"] and open_view["branches"][0]["tito"]["special_tokens"] == 0
        closed = httpx.post(f"{url}/sessions/s1/close").json()
        assert closed == {"session_id": "s1", "records": 1, "termination": "done", "reward": 0.0}
        view = httpx.get(f"{url}/sessions/s1/trajectory").json()
    assert view["closed"] and view["branches"][0]["trajectory"]["token_ids"] == expected.token_ids
    assert_exact(endpoint, "s1", expected)
    assert endpoint.stats.completions == 3 and endpoint.stats.client_errors == 0


async def test_async_streaming_qwen3_reasoning_is_token_exact():
    t, script = tito("qwen3"), thinking_script()
    expected, outputs = direct(t, script)
    endpoint = endpoint_for(outputs, t)
    server = EndpointServer(create_openai_app(endpoint))
    await server.start()
    try:
        client = AsyncOpenAI(base_url=f"{server.url}/sessions/q1/v1", api_key="unused", max_retries=0)
        messages = [m.to_dict() for m in script.messages]
        for assistant, observation in script.turns:
            stream = await client.chat.completions.create(
                model="m",
                messages=messages,
                tools=script.tools,
                stream=True,
                stream_options={"include_usage": True},
            )
            content, reasoning, calls, finish, usage = "", "", {}, None, None
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    delta = choice.delta
                    content += delta.content or ""
                    reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
                    for tc in delta.tool_calls or []:
                        calls[tc.index] = tc
                    finish = choice.finish_reason or finish
            assert reasoning == assistant.reasoning and content == assistant.content
            assert [(c.function.name, c.function.arguments) for c in calls.values()] == [
                (c.name, c.raw_arguments) for c in assistant.tool_calls
            ]
            assert (
                finish == ("tool_calls" if assistant.tool_calls else "stop") and usage.completion_tokens > 0
            )
            # echo the reply without its reasoning, as most clients do: still the session's history
            messages.append(
                {
                    "role": "assistant",
                    "content": content or None,
                    "tool_calls": [
                        {
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.function.name, "arguments": c.function.arguments},
                        }
                        for c in calls.values()
                    ]
                    or None,
                }
            )
            if observation is None:
                break
            messages += answer(observation, [c.id for c in calls.values()])
        await endpoint.close("q1")
    finally:
        await server.stop()
        await endpoint.aclose()
    assert_exact(endpoint, "q1", expected)
    explained = endpoint.closed["q1"].result[0].final_info["tito"]
    assert explained[
        "ok"
    ]  # Qwen3 drops earlier <think> blocks from its canonical render: explained, not wrong


def test_sync_streaming_and_async_plain_give_the_same_tokens():
    t, script = tito("tiny"), calculator_script("What is 1 + 2 * 3?")
    expected, outputs = direct(t, script)
    endpoint = endpoint_for(outputs, t)
    with served(endpoint) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="stream-1", max_retries=0)
        messages = [m.to_dict() for m in script.messages]
        for assistant, observation in script.turns:
            stream = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True)
            chunks = list(stream)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
            assert text == assistant.content and len(calls) == len(assistant.tool_calls)
            messages.append(
                {
                    "role": "assistant",
                    "content": text,
                    "tool_calls": [
                        {
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.function.name, "arguments": c.function.arguments},
                        }
                        for c in calls
                    ],
                }
            )
            if observation is None:
                break
            messages += answer(observation, [c.id for c in calls])
        httpx.post(f"{url}/sessions/stream-1/close")

        async def plain() -> None:
            client = AsyncOpenAI(base_url=f"{url}/v1", api_key="plain-1", max_retries=0)
            msgs = [m.to_dict() for m in script.messages]
            for _, observation in script.turns:
                reply = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
                msgs.append(reply.choices[0].message)  # the pydantic object itself, as many agents append it
                if observation is None:
                    break
                msgs += answer(observation, [c.id for c in reply.choices[0].message.tool_calls or []])

        asyncio.run(plain())
        httpx.post(f"{url}/sessions/plain-1/close")
    assert_exact(endpoint, "stream-1", expected)
    assert_exact(endpoint, "plain-1", expected)


def test_responses_validate_against_the_openai_types():
    t, script = tito("tiny"), calculator_script()
    _, outputs = direct(t, script)
    endpoint = endpoint_for(outputs, t)
    with served(endpoint) as url:
        body = {
            "model": "m",
            "messages": [m.to_dict() for m in script.messages],
            "tools": TOOLS,
            "logprobs": True,
        }
        auth = {"authorization": "Bearer v1"}
        raw = httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth).json()
        completion = ChatCompletion.model_validate(raw)
        assert completion.choices[0].finish_reason == "tool_calls"
        assert len(completion.choices[0].logprobs.content) == len(outputs[0]) - 1  # all but the stop token
        assert all(lp.logprob == -0.5 for lp in completion.choices[0].logprobs.content)
        assert completion.system_fingerprint == "miles-v0"
        body["messages"] += [raw["choices"][0]["message"]] + answer(
            script.turns[0][1], [c["id"] for c in raw["choices"][0]["message"]["tool_calls"]]
        )
        body.update(stream=True, stream_options={"include_usage": True})
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=auth) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            lines = [line[len("data: ") :] for line in resp.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        chunks = [ChatCompletionChunk.model_validate(json.loads(line)) for line in lines[:-1]]
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage is not None
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        models = httpx.get(f"{url}/v1/models").json()
        assert models["object"] == "list" and models["data"][0]["id"] == "miles"
        error = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": []}, headers=auth)
        assert error.status_code == 400 and error.headers["x-should-retry"] == "false"
        assert ErrorObject.model_validate(error.json()["error"]).param == "messages"


def test_a_history_rewrite_is_a_409_naming_the_message_and_the_session_goes_on():
    t, script = tito("tiny"), calculator_script()
    expected, outputs = direct(t, script)
    endpoint = endpoint_for(outputs, t)
    engine = endpoint.router.engines[0]
    with served(endpoint) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="h1", max_retries=2)  # 409s must not be retried
        messages = [m.to_dict() for m in script.messages]
        first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message
        echoed = first.model_dump(exclude_none=True)
        tool_answers = answer(script.turns[0][1], [c.id for c in first.tool_calls])
        rewritten = json.loads(json.dumps(echoed))
        rewritten["tool_calls"][0]["function"]["arguments"] = '{"expression": "2 * 58"}'
        for bad, index in (
            (messages + [rewritten] + tool_answers, 2),
            ([messages[0], {"role": "user", "content": "Hi"}, echoed] + tool_answers, 1),
        ):
            with pytest.raises(openai.ConflictError) as err:
                client.chat.completions.create(model="m", messages=bad, tools=TOOLS)
            assert err.value.response.json()["error"]["param"] == f"messages[{index}]"
            assert f"messages[{index}] differs" in err.value.message
        with pytest.raises(openai.ConflictError, match="tools differ"):
            client.chat.completions.create(
                model="m", messages=messages + [echoed] + tool_answers, tools=TOOLS[:1]
            )
        assert engine.calls == 1 and endpoint.stats.history_conflicts == 3  # not retried, not generated
        # JSON-equal arguments with other spacing are the same history
        respaced = json.loads(json.dumps(echoed))
        respaced["tool_calls"][0]["function"]["arguments"] = '{"expression":"58 * 2"}'
        messages += [respaced] + tool_answers
        for _, observation in script.turns[1:]:
            message = (
                client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message
            )
            messages.append(message.model_dump(exclude_none=True))
            if observation is not None:
                messages += answer(observation, [c.id for c in message.tool_calls or []])
        httpx.post(f"{url}/sessions/h1/close")
    assert_exact(endpoint, "h1", expected)


def test_a_history_rewrite_forks_a_branch_when_configured():
    t = tito("tiny")
    question = Message("user", "What is 37 + 58 * 2?")
    first = Script(
        [question],
        [(Message("assistant", "", [call("calculate", '{"expression": "37 + 58 * 2"}')]), None)],
        TOOLS,
    )
    forked = Script(
        [question, Message("user", "No tools, please.")],
        [(Message("assistant", "The answer is 153."), None)],
        TOOLS,
    )
    (traj0, out0), (traj1, out1) = direct(t, first), direct(t, forked)
    endpoint = endpoint_for(out0 + out1, t, history_mismatch="fork")
    with served(endpoint) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="f1", max_retries=0)
        client.chat.completions.create(model="m", messages=[question.to_dict()], tools=TOOLS)
        reply = client.chat.completions.create(
            model="m", messages=[m.to_dict() for m in forked.messages], tools=TOOLS
        )
        assert reply.choices[0].message.content == "The answer is 153."
        assert (
            httpx.post(f"{url}/sessions/f1/reward", json={"components": {"correct": 1.0}}).status_code == 200
        )
        assert httpx.post(f"{url}/sessions/f1/close").json()["records"] == 2
    records = endpoint.closed["f1"].result
    assert [r.session_id for r in records] == ["f1", "f1.fork1"]
    assert [r.trajectory.token_ids for r in records] == [traj0.token_ids, traj1.token_ids]
    assert [r.reward for r in records] == [1.0, 1.0] and records[1].reward_components == {"correct": 1.0}
    assert records[1].final_info["forked_at"] == 1 and "role 'user'" in records[1].final_info["fork_reason"]
    assert endpoint.stats.forks == 1 and endpoint.stats.history_conflicts == 0


def test_malformed_requests_get_a_4xx_naming_the_problem_and_the_session_stays_usable():
    t, script = tito("tiny"), calculator_script()
    expected, outputs = direct(t, script)
    endpoint = endpoint_for(outputs, t, context_length=512)
    engine = endpoint.router.engines[0]
    with served(endpoint) as url:
        chat = f"{url}/sessions/m1/v1/chat/completions"
        base = {"model": "m", "messages": [m.to_dict() for m in script.messages], "tools": TOOLS}
        first = httpx.post(chat, json=base).json()["choices"][0]["message"]
        ids = [c["id"] for c in first["tool_calls"]]
        good = base["messages"] + [first] + answer(script.turns[0][1], ids)
        tool1, tool2 = good[-2], good[-1]
        bad: list[tuple[dict | bytes, int, str]] = [
            ({**base, "messages": good[:-1] + [{"role": "robot", "content": "x"}]}, 400, "messages[4].role"),
            ({**base, "messages": good[:-1]}, 400, f"tool call {ids[1]!r} (lookup) has no tool result"),
            (
                {**base, "messages": good[:-1] + [{**tool2, "tool_call_id": "call_9"}]},
                400,
                "answers no tool call",
            ),
            (
                {**base, "messages": good[:-2] + [{"role": "tool", "content": "116"}, tool2]},
                400,
                "needs tool_call_id",
            ),
            (
                {
                    **base,
                    "messages": good
                    + [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                },
                400,
                "only text parts",
            ),
            ({**base, "messages": good, "logit_bias": {"1": 5}}, 400, "unsupported field 'logit_bias'"),
            ({**base, "messages": good, "n": 2}, 400, "only n=1"),
            ({**base, "messages": good, "tool_choice": "required"}, 400, "tool_choice"),
            ({**base, "messages": good, "max_tokens": 0}, 400, "max_tokens"),
            ({**base, "messages": good, "temperature": "hot"}, 400, "temperature"),
            ({**base, "messages": good, "max_tokens": 4096}, 400, "more than the context length 512"),
            (b"{not json", 400, "not JSON"),
            ({**base, "messages": good[:-1] + [{**tool2, "content": "x" * (9 << 20)}]}, 413, "limit"),
        ]
        for body, status, words in bad:
            resp = (
                httpx.post(chat, content=body, headers={"content-type": "application/json"})
                if isinstance(body, bytes)
                else httpx.post(chat, json=body)
            )
            assert resp.status_code == status, (words, resp.text)
            assert words in resp.json()["error"]["message"], resp.json()
            assert resp.headers["x-should-retry"] == "false"
        no_key = httpx.post(f"{url}/v1/chat/completions", json=base)
        assert no_key.status_code == 401 and "API key" in no_key.json()["error"]["message"]
        assert engine.calls == 1  # none of them reached the model
        assert (tool1["content"], tool2["content"]) == ("116", "none")
        messages = good
        for _, observation in script.turns[1:]:
            message = httpx.post(chat, json={**base, "messages": messages}).json()["choices"][0]["message"]
            messages = messages + [message]
            if observation is not None:
                messages += answer(observation, [c["id"] for c in message.get("tool_calls") or []])
        httpx.post(f"{url}/sessions/m1/close")
    assert_exact(endpoint, "m1", expected)
    assert endpoint.stats.client_errors == len(bad) + 1


def test_an_engine_failure_is_a_503_and_a_retry_continues_the_same_session():
    t, script = tito("tiny"), calculator_script()
    expected, outputs = direct(t, script)
    state = {"fail": False}

    def respond(input_ids, session_id, k):
        if state["fail"]:
            state["fail"] = False
            raise EngineError("the engine fell over", retryable=False)
        return outputs[max(0, k - 1)]  # the failed call counted as the session's second call

    endpoint = OpenAIEndpoint(InstantEngine(respond=respond), tokenizer=t)
    with served(endpoint) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="e1", max_retries=0)
        messages = [m.to_dict() for m in script.messages]
        for turn, (_, observation) in enumerate(script.turns):
            if turn == 1:
                state["fail"] = True
                with pytest.raises(openai.InternalServerError, match="fell over"):
                    client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
            message = (
                client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message
            )
            messages.append(message.model_dump(exclude_none=True))
            if observation is not None:
                messages += answer(observation, [c.id for c in message.tool_calls or []])
        httpx.post(f"{url}/sessions/e1/close")
    assert_exact(endpoint, "e1", expected)
    assert endpoint.stats.engine_errors == 1


def test_closed_sessions_are_recorded_and_replay_with_their_harness_calls(tmp_path):
    t, script = tito("tiny"), calculator_script()
    _, outputs = direct(t, script)
    path = tmp_path / "sessions.jsonl"
    endpoint = OpenAIEndpoint(InstantEngine(outputs), tokenizer=t, recorder=str(path))
    with served(endpoint) as url:
        drive(OpenAI(base_url=f"{url}/v1", api_key="r1", max_retries=0), script)
        for body in (
            {"reward": 1e300},
            {"components": {"a": 6e5, "b": 6e5}},
            {"reward": 2, "components": {"a": 1e7}},
        ):
            refused = httpx.post(f"{url}/sessions/r1/reward", json=body)  # it would overflow a float32 batch
            assert refused.status_code == 400 and "within ±1e+06" in refused.text, refused.text
        assert httpx.post(f"{url}/sessions/r1/reward", json={"reward": 0.5}).status_code == 200
        httpx.post(f"{url}/sessions/r1/close")
        assert httpx.post(f"{url}/sessions/r1/reward", json={"reward": 1}).status_code == 409
        assert httpx.post(f"{url}/sessions/nope/close").status_code == 404
    [record] = read_sessions(path).records
    assert record.reward == 0.5 and record.termination is TerminationReason.DONE and len(record.turns) == 3
    assert record.turns[0].tool_calls[1]["function"]["name"] == "lookup"
    assert record.turns[0].observation[1]["content"] == "none"
    assert check_tito(record, t).ok
    assert replay_main([str(path), "--tito"], stdout=io.StringIO()) == 0
    shown = io.StringIO()
    assert replay_main([str(path), "--session", "r1"], stdout=shown) == 0
    assert "-> calculate" in shown.getvalue() and "-> lookup" in shown.getvalue()


def test_sessions_of_a_closed_endpoint_are_aborted_and_unknown_ones_refused():
    """A runner's endpoint serves a session only to its token; closing the endpoint aborts what is open."""
    t, script = tito("tiny"), calculator_script()
    _, outputs = direct(t, script)
    endpoint = OpenAIEndpoint(
        InstantEngine(outputs), tokenizer=t, open_sessions=False, config=OpenAISessionConfig(max_turns=1)
    )
    known = endpoint.open("known")
    with served(endpoint) as url:
        for key in (
            "unknown",
            "known",
        ):  # neither a made-up key nor the session's (guessable) id is its token
            client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
            with pytest.raises(
                openai.AuthenticationError, match="serves only the sessions its runner opened"
            ):
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert len(known.token) >= 32 and known.token != "known"
        client = OpenAI(base_url=f"{url}/v1", api_key=known.token, max_retries=0)
        first = (
            client.chat.completions.create(
                model="m", messages=[m.to_dict() for m in script.messages], tools=TOOLS
            )
            .choices[0]
            .message
        )
        with pytest.raises(openai.BadRequestError, match="max_turns"):
            client.chat.completions.create(
                model="m",
                tools=TOOLS,
                messages=[m.to_dict() for m in script.messages]
                + [first.model_dump(exclude_none=True)]
                + answer(script.turns[0][1], [c.id for c in first.tool_calls]),
            )
    [record] = endpoint.closed["known"].result
    assert record.termination is TerminationReason.ABORTED and record.error.type == "Aborted"
    assert len(record.turns) == 1 and record.reward == 0.0


def test_a_standalone_server_caps_its_open_sessions():
    from miles.sessions.openai.schema import EndpointError

    t = tito("tiny")
    endpoint = OpenAIEndpoint(
        InstantEngine([[1]]), tokenizer=t, config=OpenAISessionConfig(max_open_sessions=2)
    )
    endpoint.open("a")
    endpoint.open("b")
    with pytest.raises(EndpointError, match="2 sessions are open, the most this server takes") as caught:
        endpoint.open("c")
    assert caught.value.status == 429
    assert endpoint.authorize("a") == "a" and endpoint.authorize(None, "b") == "b"  # the id is the credential


_CALL_BODIES = [
    "",
    "\n",
    '{"name": "lookup", "arguments": {"key": "a"}}',
    '{"name": "lookup"}',
    '{"arguments": {}}',
    "[1, 2]",
    '{"name": "lookup", "arguments": }',
    '{"name": "", "arguments": {}}',
    "not json at all",
    '{"name": "calculate", "arguments": "{\\"expression\\": \\"1+1\\"}"}',
]


@settings(max_examples=40, deadline=None)
@given(
    content=st.sampled_from(["", "Let me look.", "ok\n"]),
    bodies=st.lists(st.sampled_from(_CALL_BODIES), max_size=3),
)
def test_the_endpoint_takes_back_every_reply_it_gives_as_history(content, bodies):
    """Whatever the model writes (empty, malformed or unknown tool calls among them), a client that echoes the
    reply (`message.model_dump(exclude_none=True)`, as the README's agent loop does) and answers its calls is
    never refused as rewriting history; and the session's recorded `final_info["tito"]` verdict is the one
    `miles replay --tito` reaches (`check_tito`): ok, however malformed the calls."""
    t = tito("tiny")
    text = content + "".join(f"<tool_call>{body}</tool_call>" for body in bodies)
    replies = {"first": t.encode(text) + [t.close_token_id], "next": t.encode("done") + [t.close_token_id]}
    path = Path(tempfile.mkdtemp()) / "sessions.jsonl"
    endpoint = OpenAIEndpoint(
        InstantEngine(respond=lambda ids, sid, k: replies["first" if k == 0 else "next"]),
        tokenizer=t,
        recorder=str(path),
    )
    with served(endpoint) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="echo", max_retries=0)
        messages = [{"role": "user", "content": "What is a?"}]
        message = client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": c.id, "content": "x"} for c in message.tool_calls or []]
        if not message.tool_calls:
            messages.append({"role": "user", "content": "and then?"})
        client.chat.completions.create(model="m", messages=messages, tools=TOOLS)  # a 409 raises here
        assert httpx.post(f"{url}/sessions/echo/close").status_code == 200
    [record] = read_sessions(path).records
    assert record.final_info["tito"]["ok"] is check_tito(record, t).ok is True, record.final_info["tito"]
