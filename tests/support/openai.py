"""Scripted conversations, direct TITO sessions and loopback servers shared by the OpenAI endpoint tests
(no tests here)."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import fastapi
import uvicorn

from miles.engine import FinishReason
from miles.sessions.instant import InstantEngine
from miles.sessions.openai.config import OpenAISessionConfig
from miles.sessions.openai.endpoint import OpenAIEndpoint
from miles.sessions.openai.routes import EndpointServer, create_openai_app
from miles.tito import TITOTokenizer, TokenizerSpec
from miles.tito.conversation import Conversation
from miles.trajectory import Trajectory
from miles.types import Message, ToolCall

CALC = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression exactly.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up a record by key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}
TOOLS = [CALC, LOOKUP]

_TITOS: dict[str, TITOTokenizer] = {}


def tito(name: str = "tiny") -> TITOTokenizer:
    """The tiny tokenizer with its compact template, or the real Qwen3 one (cached)."""
    if name not in _TITOS:
        _TITOS[name] = (
            TITOTokenizer.from_spec(TokenizerSpec("tiny", "compact"))
            if name == "tiny"
            else TITOTokenizer.from_spec(TokenizerSpec(name))
        )
    return _TITOS[name]


def call(name: str, arguments: str, i: int = 0) -> ToolCall:
    return ToolCall.from_dict({"id": f"call_{i}", "function": {"name": name, "arguments": arguments}})


@dataclass
class Script:
    """A scripted conversation: the first messages, then per turn the assistant message a template-faithful
    model produces and the client's next messages (None after the last turn)."""

    messages: list[Message]
    turns: list[tuple[Message, list[Message] | None]]
    tools: list[dict[str, Any]] | None = None


def direct(t: TITOTokenizer, script: Script) -> tuple[Trajectory, list[list[int]]]:
    """The direct TITO session of `script` (no endpoint): its trajectory, and each turn's output ids."""
    conv = Conversation(t, script.messages, tools=script.tools)
    outputs = []
    for assistant, observation in script.turns:
        ids = t.expected_generation(conv.messages, assistant, script.tools)
        outputs.append(ids)
        conv.append_generation(ids, [-0.5] * len(ids), weight_version=0, finish_reason=FinishReason.STOP)
        if observation is None:
            conv.finish(assistant)
            break
        conv.append_observation(assistant, observation)
    return conv.trajectory, outputs


def calculator_script(question: str = "What is 37 + 58 * 2?") -> Script:
    """Two calls in one message, their results, a second call, then the answer."""
    return Script(
        [Message("system", "You are careful."), Message("user", question)],
        [
            (
                Message(
                    "assistant",
                    "",
                    [call("calculate", '{"expression": "58 * 2"}', 0), call("lookup", '{"key": "x"}', 1)],
                ),
                [Message("tool", "116"), Message("tool", "none")],
            ),
            (
                Message("assistant", "Adding now.", [call("calculate", '{"expression": "37 + 116"}')]),
                [Message("tool", "153")],
            ),
            (Message("assistant", "The answer is 153."), None),
        ],
        tools=TOOLS,
    )


def thinking_script() -> Script:
    """Qwen3: reasoning before a tool call and before the answer, then a follow-up user question."""
    return Script(
        [Message("user", "What is 37 + 58 * 2?")],
        [
            (
                Message(
                    "assistant",
                    "",
                    [call("calculate", '{"expression": "37 + 58 * 2"}')],
                    reasoning="Multiplication first; the tool can do it.",
                ),
                [Message("tool", "153")],
            ),
            (
                Message("assistant", "The answer is 153.", reasoning="The tool says 153."),
                [Message("user", "And doubled?")],
            ),
            (Message("assistant", "306.", reasoning="153 * 2 = 306."), None),
        ],
        tools=TOOLS,
    )


def endpoint_for(outputs: Sequence[Sequence[int]], t: TITOTokenizer, **config: Any) -> OpenAIEndpoint:
    """An endpoint whose model (a scripted `InstantEngine`) replies `outputs[k]` to a session's k-th call."""
    parser = "qwen3" if t.family == "qwen3" else "hermes"
    return OpenAIEndpoint(
        InstantEngine([list(o) for o in outputs]),
        tokenizer=t,
        config=OpenAISessionConfig(**{"parser": parser, **config}),
    )


@contextlib.contextmanager
def serving(app: fastapi.FastAPI) -> Iterator[str]:
    """`app` on a loopback port, served by uvicorn in a thread; yields its URL."""
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def served(endpoint: OpenAIEndpoint) -> Iterator[str]:
    """`endpoint` on a loopback port, on an event loop of its own in a thread (the loop its sessions, router
    and recorder live on); leaving closes the endpoint there. Yields the URL."""
    ready: queue.Queue[str | BaseException] = queue.Queue()
    stop: list[Any] = []

    async def main() -> None:
        server = EndpointServer(create_openai_app(endpoint))
        try:
            await server.start()
        except BaseException as exc:
            ready.put(exc)
            raise
        done = asyncio.Event()
        stop.append((asyncio.get_running_loop(), done))
        ready.put(server.url)
        await done.wait()
        await server.stop()
        await endpoint.aclose()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    url = ready.get(timeout=30)
    if isinstance(url, BaseException):
        raise url
    try:
        yield url
    finally:
        loop, done = stop[0]
        loop.call_soon_threadsafe(done.set)
        thread.join(30)


def answer(observation: list[Message], call_ids: list[str]) -> list[dict[str, Any]]:
    """The client's next messages as OpenAI dicts: tool messages answer `call_ids` in order."""
    ids = list(call_ids)
    out = []
    for m in observation:
        d = m.to_dict()
        if m.role == "tool":
            d["tool_call_id"] = ids.pop(0)
        out.append(d)
    return out


def drive(client: Any, script: Script, **kwargs: Any) -> list[Any]:
    """Play `script` as a plain agent loop with a sync `openai` client; returns the replies."""
    messages = [m.to_dict() for m in script.messages]
    replies = []
    for _, observation in script.turns:
        reply = client.chat.completions.create(model="m", messages=messages, tools=script.tools, **kwargs)
        replies.append(reply)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if observation is None:
            break
        messages += answer(observation, [c.id for c in message.tool_calls or []])
    return replies
