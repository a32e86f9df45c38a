"""The OpenAI chat-completions wire format of the session endpoint.

Requests are checked (pydantic, plus the rules OpenAI enforces on message order) and turned into a typed
`ChatRequest` whose messages are `miles.types.Message`s; fields the endpoint cannot honour are refused with a
400 that names them. Responses and stream chunks are built here too, in the shapes of the `openai` package's
`ChatCompletion` and `ChatCompletionChunk`; errors have OpenAI's `{"error": {message, type, param, code}}` body.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from miles.types import MAX_ABS_REWARD, Message, ToolCall, loads_strict, reward_problem

#: Roles a request may use; "developer" is OpenAI's newer name for "system" and is rendered as one.
ROLES = ("system", "developer", "user", "assistant", "tool")


class EndpointError(Exception):
    """A request the endpoint refuses or cannot serve; `body()` is OpenAI's error JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> EndpointError:
    """A 400 naming the offending field."""
    return EndpointError(400, message, param=param, code=code)


# ---- request models (pydantic: types and unknown fields) -------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _FunctionIn(_Strict):
    name: str
    arguments: str


class _ToolCallIn(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: _FunctionIn


class _MessageIn(_Strict):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[_ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None
    # what an `openai` client sends when an agent appends the reply object itself: accepted when empty
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None


class _StreamOptionsIn(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class _RequestIn(_Strict):
    messages: list[_MessageIn]
    model: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # SGLang / vLLM extension
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: _StreamOptionsIn | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None


@dataclass(frozen=True)
class ChatRequest:
    """One checked chat-completions request. Sampling fields are None when the client left them out."""

    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...] | None = None
    tool_choice: Literal["auto", "none"] = "auto"
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False


def _where(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _from_validation_error(exc: ValidationError) -> EndpointError:
    err = exc.errors()[0]
    where = _where(err["loc"])
    if err["type"] == "extra_forbidden":
        return bad_request(f"unsupported field {where!r}: this endpoint does not implement it", where)
    if err["type"] == "missing":
        return bad_request(f"missing required field {where!r}", where)
    return bad_request(f"{where}: {err['msg']}", where)


def _text(content: str | list[dict[str, Any]] | None, where: str) -> str:
    """A message's content as text: a string, or text parts joined (other part types are refused)."""
    if content is None or isinstance(content, str):
        return content or ""
    pieces = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise bad_request(
                f"{where}.content[{j}] has type {kind!r}; only text parts are supported",
                f"{where}.content[{j}].type",
            )
        pieces.append(part["text"])
    return "".join(pieces)


def _message(m: _MessageIn, i: int) -> Message:
    where = f"messages[{i}]"
    if m.role not in ROLES:
        raise bad_request(f"{where}.role {m.role!r} is not one of {list(ROLES)}", f"{where}.role")
    if m.tool_calls and m.role != "assistant":
        raise bad_request(
            f"{where}.tool_calls: only assistant messages may have tool calls", f"{where}.tool_calls"
        )
    if m.role == "tool" and not m.tool_call_id:
        raise bad_request(f"{where}.tool_call_id: a tool message needs tool_call_id", f"{where}.tool_call_id")
    if m.role != "tool" and m.tool_call_id is not None:
        raise bad_request(f"{where}.tool_call_id: only tool messages have one", f"{where}.tool_call_id")
    for name in ("refusal", "annotations", "audio", "function_call"):
        if getattr(m, name):
            raise bad_request(f"{where}.{name} is not supported", f"{where}.{name}")
    calls = [
        ToolCall.from_dict(
            {"id": c.id, "function": {"name": c.function.name, "arguments": c.function.arguments}}
        )
        for c in m.tool_calls or []
    ]
    return Message(
        role="system" if m.role == "developer" else m.role,
        content=_text(m.content, where),
        tool_calls=calls,
        tool_call_id=m.tool_call_id,
        name=m.name,
        reasoning=m.reasoning_content if m.role == "assistant" else None,
    )


def check_tool_results(messages: Sequence[Message]) -> None:
    """OpenAI's ordering rule: an assistant message's tool calls are each answered by one tool message right
    after it, and a tool message answers a call of the assistant message before it."""
    pending: dict[str, str] = {}  # call id -> tool name, of the last assistant message
    for i, m in enumerate([*messages, None]):
        if m is not None and m.role == "tool":
            if m.tool_call_id not in pending:
                known = ", ".join(repr(k) for k in pending) or "none"
                raise bad_request(
                    f"messages[{i}].tool_call_id {m.tool_call_id!r} answers no tool call of the "
                    f"assistant message before it (open calls: {known})",
                    f"messages[{i}].tool_call_id",
                )
            del pending[m.tool_call_id]
            continue
        if pending:
            call_id, name = next(iter(pending.items()))
            raise bad_request(
                f"messages[{i}]: tool call {call_id!r} ({name}) has no tool result; answer every tool "
                f"call of an assistant message with a tool message right after it",
                f"messages[{i}]",
            )
        pending = {c.id: c.name for c in m.tool_calls} if m is not None and m.role == "assistant" else {}


def _tools(raw: list[dict[str, Any]] | None) -> tuple[dict[str, Any], ...] | None:
    if not raw:
        return None
    for i, tool in enumerate(raw):
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}', f"tools[{i}]"
            )
    return tuple(raw)


def _refuse_unless(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise bad_request(f"{field}: {message}", field)


def parse_chat_request(body: Any) -> ChatRequest:
    """Check a request body and build the `ChatRequest`; raises `EndpointError` (400) naming the field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        req = _RequestIn.model_validate(body)
    except ValidationError as exc:
        raise _from_validation_error(exc) from None
    if not req.messages:
        raise bad_request("messages must not be empty", "messages")
    messages = tuple(_message(m, i) for i, m in enumerate(req.messages))
    check_tool_results(messages)
    tool_choice = req.tool_choice if req.tool_choice is not None else "auto"
    _refuse_unless(
        tool_choice in ("auto", "none"),
        "tool_choice",
        f"{tool_choice!r} is not supported; use 'auto' or 'none'",
    )
    _refuse_unless(req.n in (None, 1), "n", "only n=1 is supported")
    _refuse_unless(
        req.parallel_tool_calls in (None, True),
        "parallel_tool_calls",
        "the model decides how many calls it makes; only true is supported",
    )
    for name in ("frequency_penalty", "presence_penalty"):
        _refuse_unless(
            getattr(req, name) in (None, 0), name, "penalties are not supported; leave it out or 0"
        )
    _refuse_unless(
        req.top_logprobs in (None, 0), "top_logprobs", "only the chosen tokens' logprobs are available"
    )
    _refuse_unless(
        req.response_format is None or req.response_format.get("type") == "text",
        "response_format",
        "only {'type': 'text'} is supported",
    )
    _refuse_unless(req.temperature is None or 0 <= req.temperature <= 2, "temperature", "must be in [0, 2]")
    _refuse_unless(req.top_p is None or 0 < req.top_p <= 1, "top_p", "must be in (0, 1]")
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise bad_request("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    _refuse_unless(max_tokens is None or max_tokens >= 1, "max_tokens", "must be >= 1")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    _refuse_unless(len(stop) <= 4 and all(stop), "stop", "at most 4 non-empty strings")
    return ChatRequest(
        messages=messages,
        tools=_tools(req.tools),
        tool_choice=tool_choice,
        model=req.model,  # type: ignore[arg-type]
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        max_tokens=max_tokens,
        stop=stop,
        seed=req.seed,
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        logprobs=bool(req.logprobs),
    )


# ---- comparing a client's history with the session's ------------------------------------------------------
#: The arguments a reply shows for a call the model wrote none for (an empty `<tool_call></tool_call>`).
EMPTY_ARGUMENTS = "{}"


def _same_arguments(a: ToolCall, b: ToolCall) -> bool:
    mine, theirs = (
        a.raw_arguments or EMPTY_ARGUMENTS,
        b.raw_arguments or EMPTY_ARGUMENTS,
    )  # as `assistant_json`
    if mine == theirs:
        return True
    try:
        return json.dumps(loads_strict(mine), sort_keys=True) == json.dumps(
            loads_strict(theirs), sort_keys=True
        )
    except ValueError:
        return False


def message_difference(ours: Message, theirs: Message) -> str | None:
    """What in the client's `theirs` differs from the session's `ours` (None: the same message).

    Compared structurally: role, content, tool calls (id, name, arguments as JSON), tool_call_id; `name` and
    an assistant's reasoning only when the client sends them (clients often drop them when echoing).
    """
    if ours.role != theirs.role:
        return f"role {theirs.role!r}, the session has {ours.role!r}"
    if ours.content != theirs.content:
        return f"content {_short(theirs.content)}, the session has {_short(ours.content)}"
    if len(ours.tool_calls) != len(theirs.tool_calls):
        return f"{len(theirs.tool_calls)} tool call(s), the session has {len(ours.tool_calls)}"
    for k, (a, b) in enumerate(zip(ours.tool_calls, theirs.tool_calls, strict=True)):
        if (a.id, a.name) != (b.id, b.name) or not _same_arguments(a, b):
            return (
                f"tool_calls[{k}] {b.id!r} {b.name}({b.raw_arguments}), the session has "
                f"{a.id!r} {a.name}({a.raw_arguments})"
            )
    if ours.tool_call_id != theirs.tool_call_id:
        return f"tool_call_id {theirs.tool_call_id!r}, the session has {ours.tool_call_id!r}"
    if theirs.name is not None and ours.name != theirs.name:
        return f"name {theirs.name!r}, the session has {ours.name!r}"
    if theirs.reasoning is not None and ours.reasoning != theirs.reasoning:
        return f"reasoning_content {_short(theirs.reasoning)}, the session has {_short(ours.reasoning or '')}"
    return None


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def first_difference(history: Sequence[Message], messages: Sequence[Message]) -> tuple[int, str] | None:
    """The first index where `messages` does not extend `history`, and why (None: it extends it)."""
    for i, ours in enumerate(history):
        if i >= len(messages):
            return (
                i,
                f"the request has {len(messages)} message(s) but the session's history has {len(history)}",
            )
        why = message_difference(ours, messages[i])
        if why is not None:
            return i, why
    return None


# ---- responses -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Usage:
    """Token counts of one completion."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's text, bytes and logprob (OpenAI's `ChatCompletionTokenLogprob`)."""

    token: str
    logprob: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "token": self.token,
            "logprob": self.logprob,
            "bytes": list(self.token.encode("utf-8")),
            "top_logprobs": [],
        }


@dataclass(frozen=True)
class Completion:
    """What one chat request produced, ready to be sent as a response or as stream chunks."""

    id: str
    created: int
    model: str
    message: Message
    finish_reason: Literal["stop", "length", "tool_calls"]
    usage: Usage
    weight_version: int
    logprobs: tuple[TokenLogprob, ...] | None = None

    @property
    def system_fingerprint(self) -> str:
        return f"miles-v{self.weight_version}"

    def _logprobs_json(self) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        return {"content": [t.to_dict() for t in self.logprobs], "refusal": None}

    def response(self) -> dict[str, Any]:
        """The `ChatCompletion` JSON."""
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
            "usage": self.usage.to_dict(),
            "choices": [
                {
                    "index": 0,
                    "message": assistant_json(self.message),
                    "logprobs": self._logprobs_json(),
                    "finish_reason": self.finish_reason,
                }
            ],
        }

    def chunks(self, *, include_usage: bool) -> list[dict[str, Any]]:
        """The `ChatCompletionChunk` JSONs of a stream: the role, the reasoning, the content, one chunk per tool
        call, the finish reason, then (with `include_usage`) the usage on a chunk without choices."""
        msg = assistant_json(self.message)
        deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
        if msg.get("reasoning_content"):
            deltas.append({"reasoning_content": msg["reasoning_content"]})
        if msg["content"]:
            deltas.append({"content": msg["content"]})
        deltas += [{"tool_calls": [{"index": k, **call}]} for k, call in enumerate(msg.get("tool_calls", []))]
        head = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
        }
        out = [
            {**head, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": None}]}
            for d in deltas
        ]
        out.append(
            {
                **head,
                "choices": [
                    {
                        "index": 0,
                        "delta": {},
                        "logprobs": self._logprobs_json(),
                        "finish_reason": self.finish_reason,
                    }
                ],
            }
        )
        if include_usage:
            out.append({**head, "choices": [], "usage": self.usage.to_dict()})
        return out


def assistant_json(message: Message) -> dict[str, Any]:
    """An assistant `Message` as OpenAI's `ChatCompletionMessage` JSON (content null when there are only tool
    calls; arguments as the JSON text the model wrote; `reasoning_content` when the parser separated it)."""
    out: dict[str, Any] = {
        "role": "assistant",
        "content": message.content or (None if message.tool_calls else ""),
        "refusal": None,
    }
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.raw_arguments or EMPTY_ARGUMENTS},
            }
            for c in message.tool_calls
        ]
    if message.reasoning is not None:
        out["reasoning_content"] = message.reasoning
    return out


@dataclass(frozen=True)
class ClientReward:
    """A reward posted to `/sessions/{id}/reward`: a scalar, named components (summed when no scalar is given),
    or both."""

    reward: float
    components: dict[str, float]


class _RewardIn(_Strict):
    reward: float | None = None
    components: dict[str, float] | None = None


def parse_reward(body: Any) -> ClientReward:
    """`{"reward": 1.0}`, `{"components": {"correct": 1.0}}` or both; raises `EndpointError` (400)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        req = _RewardIn.model_validate(body)
    except ValidationError as exc:
        raise _from_validation_error(exc) from None
    if req.reward is None and not req.components:
        raise bad_request("give 'reward' (a number) or 'components' (name -> number)", "reward")
    values = [req.reward] if req.reward is not None else []
    values += list((req.components or {}).values())
    components = dict(req.components or {})
    total = req.reward if req.reward is not None else sum(components.values())
    problem = next((p for p in map(reward_problem, [*values, total]) if p is not None), None)
    if problem is not None:
        raise bad_request(f"rewards must be finite numbers within ±{MAX_ABS_REWARD:g}: {problem}", "reward")
    return ClientReward(total, components)
