"""The endpoint's wire format without a server: request checks, the structural history comparison, OpenAI's
tool-result ordering rule, stop strings, and responses against the `openai` package's types."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from miles.sessions.openai.schema import (
    Completion,
    EndpointError,
    Usage,
    check_tool_results,
    first_difference,
    parse_chat_request,
    parse_reward,
)
from miles.sessions.openai.session import cut_at_stop
from miles.types import Message, ToolCall
from tests.support.openai import tito

texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20)
names = st.sampled_from(["calculate", "lookup", "search"])
arguments = st.dictionaries(
    st.sampled_from(["a", "b", "expression"]),
    st.one_of(st.integers(-99, 99), texts, st.booleans()),
    max_size=3,
)


@st.composite
def conversations(draw) -> list[Message]:
    """Valid OpenAI histories: user turns, assistant turns with tool calls, each call answered right after."""
    out = [Message("system", draw(texts)), Message("user", draw(texts))]
    for turn in range(draw(st.integers(0, 4))):
        calls = [
            ToolCall.from_dict(
                {
                    "id": f"call_{turn}_{k}",
                    "function": {"name": draw(names), "arguments": json.dumps(draw(arguments))},
                }
            )
            for k in range(draw(st.integers(0, 3)))
        ]
        out.append(Message("assistant", draw(texts), calls))
        out += [Message("tool", draw(texts), tool_call_id=c.id) for c in draw(st.permutations(calls))]
        if not calls or draw(st.booleans()):
            out.append(Message("user", draw(texts)))
    return out


def _copy(messages: list[Message]) -> list[Message]:
    return [Message.from_dict(json.loads(json.dumps(m.to_dict()))) for m in messages]


@settings(max_examples=150, deadline=None)
@given(conversations(), st.data())
def test_first_difference_names_the_rewritten_message(history, data):
    request = _copy(history) + [Message("user", "more")]
    assert first_difference(history, request) is None
    i = data.draw(st.integers(0, len(history) - 1))
    m = request[i]
    change = data.draw(st.sampled_from(["content", "role", "args", "drop"]))
    if change == "args" and not m.tool_calls:
        change = "content"
    if change == "content":
        m.content += "!"
    elif change == "role":
        m.role = "user" if m.role != "user" else "system"
    elif change == "args":
        m.tool_calls[0] = ToolCall.from_dict(
            {
                "id": m.tool_calls[0].id,
                "function": {"name": m.tool_calls[0].name, "arguments": json.dumps({"changed": True})},
            }
        )
    else:
        del request[i:]
    found = first_difference(history, request)
    assert found is not None and found[0] == i


@settings(max_examples=100, deadline=None)
@given(conversations())
def test_echoed_history_with_respaced_arguments_and_no_reasoning_is_the_same(history):
    echoed = []
    for m in _copy(history):
        m.tool_calls = [
            ToolCall.from_dict(
                {
                    "id": c.id,
                    "function": {
                        "name": c.name,
                        "arguments": json.dumps(json.loads(c.raw_arguments), indent=1),
                    },
                }
            )
            for c in m.tool_calls
        ]
        echoed.append(m)
    with_reasoning = [
        Message(
            m.role,
            m.content,
            m.tool_calls,
            m.tool_call_id,
            m.name,
            reasoning="thought" if m.role == "assistant" else None,
        )
        for m in history
    ]
    assert first_difference(with_reasoning, echoed) is None


@settings(max_examples=150, deadline=None)
@given(conversations(), st.data())
def test_every_unanswered_or_unknown_tool_call_is_named(history, data):
    check_tool_results(history)
    tool_positions = [i for i, m in enumerate(history) if m.role == "tool"]
    if not tool_positions:
        return
    i = data.draw(st.sampled_from(tool_positions))
    dropped = history[:i] + history[i + 1 :]
    with pytest.raises(EndpointError, match=f"tool call {history[i].tool_call_id!r}") as err:
        check_tool_results(dropped)
    assert err.value.status == 400
    unknown = history[:i] + [Message("tool", "x", tool_call_id="call_unknown")] + history[i + 1 :]
    with pytest.raises(EndpointError, match="'call_unknown' answers no tool call") as err:
        check_tool_results(unknown)
    assert err.value.param == f"messages[{i}].tool_call_id"


def test_requests_are_checked_and_converted():
    req = parse_chat_request(
        {
            "model": "m",
            "messages": [
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
                },
                {"role": "user", "content": "hi", "name": "ann"},
            ],
            "stop": "END",
            "max_completion_tokens": 7,
            "seed": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
            "tool_choice": "none",
            "user": "u",
            "metadata": {"k": "v"},
            "store": False,
            "frequency_penalty": 0,
        }
    )
    assert req.messages[0] == Message("system", "Be brief.") and req.messages[1].name == "ann"
    assert (req.stop, req.max_tokens, req.seed, req.stream, req.include_usage, req.tool_choice) == (
        ("END",),
        7,
        3,
        True,
        True,
        "none",
    )
    for body, field in (
        ({"messages": [{"role": "user", "content": "x"}], "functions": []}, "functions"),
        ({"messages": [{"role": "user", "content": "x", "foo": 1}]}, "messages[0].foo"),
        ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}, "presence_penalty"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}, "stop"),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "max_completion_tokens": 3},
            "max_completion_tokens",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web"}]}, "tools[0]"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({}, "messages"),
    ):
        with pytest.raises(EndpointError) as err:
            parse_chat_request(body)
        assert err.value.status == 400 and err.value.param == field and field in err.value.message


def test_rewards_are_a_scalar_or_components():
    assert parse_reward({"reward": 0.5}).reward == 0.5
    both = parse_reward({"components": {"a": 1.0, "b": 0.25}})
    assert (both.reward, both.components) == (1.25, {"a": 1.0, "b": 0.25})
    for body in ({}, {"reward": "x"}, {"reward": float("nan")}, {"score": 1}, [1]):
        with pytest.raises(EndpointError):
            parse_reward(body)


@settings(max_examples=60, deadline=None)
@given(
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30),
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30),
    st.sampled_from(["END", "\n\n", "Observation:", "停"]),
)
def test_a_stop_string_keeps_the_fewest_tokens_that_hold_it(before, after, stop):
    t = tito("tiny")
    text = before + stop + after
    ids = t.encode(text)
    cut = cut_at_stop(t, ids, (stop,))
    assert cut is not None
    keep, chars = cut
    assert stop in t.decode(ids[:keep]) and stop not in t.decode(ids[: keep - 1])
    assert t.decode(ids)[:chars] + stop == t.decode(ids)[: chars + len(stop)]
    assert stop not in t.decode(ids)[:chars]
    plain = t.encode(before)
    assert (cut_at_stop(t, plain, (stop,)) is None) == (stop not in t.decode(plain))


def test_responses_and_chunks_are_openai_types_and_carry_the_same_message():
    message = Message(
        "assistant",
        "Let me see.",
        [
            ToolCall.from_dict(
                {"id": "call_0_0", "function": {"name": "calculate", "arguments": '{"expression": "1+1"}'}}
            )
        ],
        reasoning="easy",
    )
    done = Completion("chatcmpl-x", 1, "m", message, "tool_calls", Usage(10, 5, 4), 3)
    full = ChatCompletion.model_validate(done.response())
    assert full.choices[0].message.tool_calls[0].function.arguments == '{"expression": "1+1"}'
    assert full.choices[0].message.model_extra["reasoning_content"] == "easy"
    assert full.usage.prompt_tokens_details.cached_tokens == 4 and full.system_fingerprint == "miles-v3"
    chunks = [ChatCompletionChunk.model_validate(c) for c in done.chunks(include_usage=True)]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Let me see."
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "easy"
    assert [tc.function.arguments for d in deltas for tc in d.tool_calls or []] == ['{"expression": "1+1"}']
    assert chunks[-1].usage.total_tokens == 15 and chunks[-2].choices[0].finish_reason == "tool_calls"
