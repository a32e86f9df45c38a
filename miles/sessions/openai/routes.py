"""The HTTP side of the OpenAI-compatible session endpoint: a FastAPI `APIRouter` to mount on any app that
serves a `RolloutEngine` (the embedded engine's SGLang-native server, or an app of its own in front of SGLang
servers), and a uvicorn server that runs on the caller's event loop.

Routes (the session id is a path segment, or the bearer token, so an unmodified OpenAI client needs only
`base_url=http://HOST:PORT/v1` and `api_key=<session id>`; sessions an agent runner opened answer only to their
own token, which the runner gives the agent as `OPENAI_API_KEY`, on every route):

- `POST /v1/chat/completions`, `POST /sessions/{id}/v1/chat/completions`: OpenAI's chat completions, with
  `stream: true` as server-sent events;
- `GET /v1/models`, `GET /sessions/{id}/v1/models`;
- `POST /sessions/{id}/reward` (`{"reward": 1.0}` or `{"components": {...}}`), `POST /sessions/{id}/close`,
  `GET /sessions/{id}/trajectory`;
- `POST /sessions/{id}/tools/{name}` (the arguments as a JSON object): one of the env's tools run in the
  session's own episode (a runner's sessions of stateful envs), answered as the tool message the env would
  show the model.

Errors are OpenAI's `{"error": {...}}` with `x-should-retry: false` on the ones a retry cannot fix, so the
`openai` client does not repeat them.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import fastapi
import uvicorn
from fastapi.responses import JSONResponse, Response, StreamingResponse

from miles.config import ConfigError
from miles.sessions.openai.config import MAX_REQUEST_BYTES, OpenAIEndpointConfig
from miles.sessions.openai.endpoint import OpenAIEndpoint
from miles.sessions.openai.schema import EndpointError, parse_chat_request, parse_reward


def _error(exc: EndpointError) -> JSONResponse:
    headers = {"x-should-retry": "true" if exc.status >= 500 else "false"}
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _body(request: fastapi.Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise EndpointError(
            413, f"the request body has {declared} bytes; the limit is {limit}", code="too_large"
        )
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise EndpointError(413, f"the request body is over the limit of {limit} bytes", code="too_large")
    try:
        return json.loads(raw or b"{}")
    except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested deeper than Python recurses
        raise EndpointError(400, f"the body is not JSON: {str(exc)[:200]}") from None


def _bearer(request: fastapi.Request) -> str | None:
    """The request's bearer token, if it has one."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


async def _sse(chunks: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


def openai_router(
    endpoint: OpenAIEndpoint, *, max_request_bytes: int = MAX_REQUEST_BYTES
) -> fastapi.APIRouter:
    """The endpoint's routes, to `app.include_router(...)` on any FastAPI app.

    An app that already answers `GET /v1/models` (the embedded engine's server does) keeps its own: routes
    match in the order they were added.
    """
    router = fastapi.APIRouter()
    started = int(time.time())

    def guarded(fn: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
        async def run(*args: Any) -> Response:
            endpoint.stats.requests += 1
            try:
                return await fn(*args)
            except EndpointError as exc:
                endpoint.stats.failed(exc)
                return _error(exc)

        return run

    async def chat(session_id: str, request: fastapi.Request) -> Response:
        body = await _body(request, max_request_bytes)
        chat_request = parse_chat_request(body)
        completion = await endpoint.complete(session_id, chat_request)
        if chat_request.stream:
            return StreamingResponse(
                _sse(completion.chunks(include_usage=chat_request.include_usage)),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache"},
            )
        return JSONResponse(completion.response())

    @router.post("/v1/chat/completions")
    async def chat_by_key(request: fastapi.Request) -> Response:
        return await guarded(lambda: chat(endpoint.authorize(_bearer(request)), request))()

    @router.post("/sessions/{session_id}/v1/chat/completions")
    async def chat_by_path(session_id: str, request: fastapi.Request) -> Response:
        return await guarded(lambda: chat(endpoint.authorize(_bearer(request), session_id), request))()

    def models() -> JSONResponse:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": endpoint.model_name,
                        "object": "model",
                        "created": started,
                        "owned_by": "miles",
                        "max_model_len": endpoint.context_length,
                    }
                ],
            }
        )

    router.add_api_route("/v1/models", models, methods=["GET"])
    router.add_api_route("/sessions/{session_id}/v1/models", lambda session_id: models(), methods=["GET"])

    @router.post("/sessions/{session_id}/reward")
    async def reward(session_id: str, request: fastapi.Request) -> Response:
        async def run() -> Response:
            endpoint.authorize(_bearer(request), session_id)
            endpoint.post_reward(session_id, parse_reward(await _body(request, max_request_bytes)))
            return JSONResponse({"session_id": session_id, "ok": True})

        return await guarded(run)()

    @router.post("/sessions/{session_id}/tools/{name}")
    async def tool(session_id: str, name: str, request: fastapi.Request) -> Response:
        async def run() -> Response:
            endpoint.authorize(_bearer(request), session_id)
            return JSONResponse(
                await endpoint.run_tool(session_id, name, await _body(request, max_request_bytes))
            )

        return await guarded(run)()

    @router.post("/sessions/{session_id}/close")
    async def close(session_id: str, request: fastapi.Request) -> Response:
        async def run() -> Response:
            endpoint.authorize(_bearer(request), session_id)
            records = await endpoint.close(session_id)
            return JSONResponse(
                {
                    "session_id": session_id,
                    "records": len(records),
                    "termination": records[0].termination.value,
                    "reward": records[0].reward,
                }
            )

        return await guarded(run)()

    @router.get("/sessions/{session_id}/trajectory")
    async def trajectory(session_id: str, request: fastapi.Request) -> Response:
        async def run() -> Response:
            endpoint.authorize(_bearer(request), session_id)
            return JSONResponse(endpoint.view(session_id))

        return await guarded(run)()

    return router


def mount_openai(
    app: fastapi.FastAPI, endpoint: OpenAIEndpoint, *, max_request_bytes: int = MAX_REQUEST_BYTES
) -> None:
    """Serve `endpoint` on `app`. Whoever runs the app closes the endpoint (`await endpoint.aclose()`) after it:
    the sessions still open are then recorded as `aborted`."""
    app.include_router(openai_router(endpoint, max_request_bytes=max_request_bytes))


def create_openai_app(
    endpoint: OpenAIEndpoint, *, max_request_bytes: int = MAX_REQUEST_BYTES
) -> fastapi.FastAPI:
    """An app serving only `endpoint` (e.g. in front of SGLang servers, through `SGLangClient` engines)."""
    app = fastapi.FastAPI(title="miles OpenAI session endpoint")
    mount_openai(app, endpoint, max_request_bytes=max_request_bytes)
    return app


class _LoopServer(uvicorn.Server):
    """uvicorn on the caller's event loop, leaving SIGINT/SIGTERM to the caller."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class EndpointServer:
    """Serves an app with uvicorn as a task of the running event loop (the loop the engines live on):
    `await start()` returns the base URL, `await stop()` ends it."""

    app: fastapi.FastAPI
    host: str = "127.0.0.1"
    port: int = 0
    _server: uvicorn.Server | None = field(default=None, init=False)
    _task: Any = field(default=None, init=False)

    async def start(self) -> str:
        import asyncio

        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            log_level="warning",
            access_log=False,
            timeout_keep_alive=60,
            lifespan="off",
        )
        self._server = _LoopServer(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():  # uvicorn logged why (e.g. the port is taken) and exited
                with contextlib.suppress(BaseException):
                    self._task.result()
                raise OSError(f"the OpenAI endpoint could not listen on {self.host}:{self.port}")
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self.url

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await self._task
            self._server = self._task = None


# ---- `python -m miles.sessions.openai.routes`: the embedded engine's server with the endpoint mounted -------
def openai_config(overrides: list[str]) -> OpenAIEndpointConfig:
    """The endpoint config from `KEY=VALUE` overrides (dotted keys, YAML values); `ConfigError` names a bad key."""
    from miles.config import load_config

    return load_config(OpenAIEndpointConfig, None, [o for o in overrides if o])


def endpoint_tokenizer(model: str, config: OpenAIEndpointConfig) -> Any:
    """The TITO tokenizer for the served `model` spec (or `config.tokenizer`), with the template override;
    `ConfigError` (one line) when it cannot be built."""
    from miles.engines.server import tokenizer_spec
    from miles.tito import TITOError, TITOTokenizer, TokenizerSpec

    try:
        return TITOTokenizer.from_spec(
            TokenizerSpec(config.tokenizer or tokenizer_spec(model), config.chat_template)
        )
    except TITOError as exc:
        raise ConfigError("--openai tokenizer", str(exc)) from None


def run_engine_server_with_openai(
    model: str, host: str, port: int, *, overrides: list[str], **engine_kwargs: Any
) -> None:
    """Blocking: `miles.engines.server.run_server`, with the OpenAI endpoint mounted on the same app
    (`overrides` are `OpenAIEndpointConfig` keys as `KEY=VALUE`). Bad settings raise `ConfigError` before the
    model loads."""
    import asyncio

    from miles.engines.auth import admin_token, api_key
    from miles.engines.server import create_app, load_engine

    config = openai_config(overrides)
    tito = endpoint_tokenizer(model, config)
    engine = load_engine(model, **engine_kwargs)
    app = create_app(engine, admin_key=admin_token(create=True), api_key=api_key())
    endpoint = OpenAIEndpoint(
        engine,
        tokenizer=tito,
        config=config.session,
        recorder=config.record,
        model_name=config.model_name or engine.model_path or "miles-embedded",
    )
    mount_openai(app, endpoint, max_request_bytes=config.max_request_bytes)
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=host, port=port, log_level="warning", access_log=False, timeout_keep_alive=60
        )
    )

    async def serve() -> None:
        try:
            await server.serve()
        finally:
            await endpoint.aclose()

    asyncio.run(serve())


def main(argv: list[str] | None = None) -> int:
    """`python -m miles.sessions.openai.routes --model M [engine server flags] --openai [KEY=VALUE ...]`: one
    embedded engine server (the flags of `python -m miles.engines`) with the endpoint mounted; `miles rollout
    --openai` starts these."""
    import sys

    from miles.engines.__main__ import engine_kwargs, server_parser
    from miles.engines.errors import InvalidRequestError

    ap = server_parser("miles rollout --openai")
    ap.add_argument(
        "--openai",
        nargs="?",
        const="",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of the endpoint (OpenAIEndpointConfig), e.g. chat_template=compact or "
        "session.history_mismatch=fork (repeatable)",
    )
    args = ap.parse_args(argv)
    try:
        run_engine_server_with_openai(
            args.model, args.host, args.port, overrides=args.openai, **engine_kwargs(args)
        )
    except (ConfigError, InvalidRequestError) as exc:
        print(f"miles rollout --openai: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
