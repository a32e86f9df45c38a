"""Attaching to running engines: what each server says about itself, checked against the policy.

At setup `miles train` reads every HTTP engine's `/model_info` and `/server_info` (SGLang 0.5's names; the
older `/get_model_info` and `/get_server_info` are tried next) and tokenizes a probe text with the server's
`/tokenize` endpoint. The facts it learns:

- the context length: `context_length` from `/server_info` when the launcher set one, else SGLang's
  `max_req_input_len + 1` (the longest prompt the scheduler accepts, plus the first generated token), else the
  `max_model_len` of `/v1/models`. Sessions then end `context_full` before the server would answer 400;
- the model and tokenizer paths, for the error message;
- whether the server's tokenizer produces the same ids as the policy's (the probe). A different tokenizer
  means trajectories the trainer cannot score, so attaching refuses with one line naming both sides.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx

from miles.config import ConfigError

#: Text whose token ids tell tokenizers apart: digits, punctuation, markup, whitespace runs and non-ASCII.
PROBE_TEXT = (
    '<tool_call>{"name": "calculate", "arguments": {"expression": "37 + 58 * 2"}}</tool_call>\n'
    "  The answer is 153. Grüße, naïve café — 東京 🙂\t"
)


@dataclass(frozen=True)
class ServerFacts:
    """What one running engine reported about itself at attach time."""

    url: str
    model_path: str
    tokenizer_path: str
    context_length: int | None
    weight_version: str | None
    probe_ids: tuple[int, ...] | None


def _context_length(server_info: dict[str, Any], models: dict[str, Any] | None) -> int | None:
    value = server_info.get("context_length")
    if isinstance(value, int) and value > 0:
        return value
    value = server_info.get("max_req_input_len")
    if isinstance(value, int) and value > 0:
        return value + 1
    for card in (models or {}).get("data") or []:
        value = card.get("max_model_len") if isinstance(card, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


async def _get_first(http: httpx.AsyncClient, paths: tuple[str, ...]) -> dict[str, Any] | None:
    for path in paths:
        resp = await http.get(path)
        if resp.status_code == 200:
            data = resp.json()
            return data if isinstance(data, dict) else None
    return None


async def read_server_facts(url: str, *, timeout_s: float = 30.0) -> ServerFacts:
    """Ask the engine at `url` what it serves. Raises `ConfigError("engine.urls", ...)` when it can't be read."""
    url = url.rstrip("/")
    try:
        async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as http:
            model_info = await _get_first(http, ("/model_info", "/get_model_info"))
            server_info = await _get_first(http, ("/server_info", "/get_server_info"))
            if model_info is None or server_info is None:
                raise ConfigError(
                    "engine.urls",
                    f"{url} answers neither /model_info nor /get_model_info: it is "
                    "not an SGLang server (start one with `miles rollout`)",
                )
            models = await _get_first(http, ("/v1/models",))
            resp = await http.post("/tokenize", json={"prompt": PROBE_TEXT, "add_special_tokens": False})
            probe = None
            if resp.status_code == 200:
                tokens = resp.json().get("tokens")
                if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
                    probe = tuple(tokens)
    except httpx.HTTPError as exc:
        raise ConfigError(
            "engine.urls",
            f"cannot reach {url} ({type(exc).__name__}: {exc}); start the server "
            "first (`miles rollout ...`) or fix the URL",
        ) from None
    return ServerFacts(
        url=url,
        model_path=str(model_info.get("model_path") or ""),
        tokenizer_path=str(model_info.get("tokenizer_path") or server_info.get("tokenizer_path") or ""),
        context_length=_context_length(server_info, models),
        weight_version=(
            None if model_info.get("weight_version") is None else str(model_info["weight_version"])
        ),
        probe_ids=probe,
    )


def check_tokenizer(facts: ServerFacts, tokenizer: Any, tokenizer_name: str) -> None:
    """Refuse a server whose tokenizer gives other ids for the probe text than the policy's `tokenizer`."""
    if facts.probe_ids is None:
        raise ConfigError(
            "engine.urls",
            f"{facts.url} has no working /tokenize endpoint, so its tokenizer can't be "
            "checked against the policy's; use an SGLang >= 0.5 server or `miles rollout`",
        )
    ours = tuple(tokenizer.encode(PROBE_TEXT, add_special_tokens=False))
    if ours != facts.probe_ids:
        first = next(
            (i for i, (a, b) in enumerate(zip(ours, facts.probe_ids, strict=False)) if a != b),
            min(len(ours), len(facts.probe_ids)),
        )
        raise ConfigError(
            "model.tokenizer",
            f"the engine at {facts.url} (model {facts.model_path or '?'}) "
            f"tokenizes differently from the policy's tokenizer {tokenizer_name!r} (first difference "
            f"at token {first}); serve the policy's model, or set model.tokenizer to the server's",
        )


async def attach(urls: list[str], tokenizer: Any, tokenizer_name: str) -> list[ServerFacts]:
    """Read every engine's facts and check its tokenizer; one `ConfigError` line for the first problem."""
    facts = await asyncio.gather(*(read_server_facts(u) for u in urls))
    for f in facts:
        check_tokenizer(f, tokenizer, tokenizer_name)
    return list(facts)
