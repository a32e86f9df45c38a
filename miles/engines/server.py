"""The embedded engine's HTTP server, speaking SGLang's native API (FastAPI + uvicorn, like SGLang).

Endpoints: `POST /generate`, `POST /abort_request`, `GET /health`, `GET /health_generate`,
`GET /get_model_info` and `/model_info`, `GET /get_server_info` and `/server_info`, `POST|GET /flush_cache`,
the weight-update endpoints of `weight_routes` (`/update_weights_from_disk`, `/init_weights_update_group`,
`/begin_weight_update`, `/update_weights_from_distributed`, `/end_weight_update`, `/destroy_weights_update_group`),
`POST /update_weight_version`, `GET|POST /get_weights_by_name`, `GET /v1/loads` (SGLang's load report), and
LoRA adapters: `POST /load_lora_adapter`, `POST /unload_lora_adapter`, `lora_path` (an adapter's name) in
`/generate`.
Bad requests answer 400 with `{"error": {"message", "type"}}`; engine failures answer 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fastapi
import uvicorn
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from miles.engine import EngineError
from miles.engines.auth import ADMIN_PATHS, admin_token, api_key, refusal
from miles.engines.embedded import EmbeddedEngine
from miles.engines.errors import InvalidRequestError
from miles.engines.load import LOADS_PATH, loads_body
from miles.engines.metrics import engine_registry, render_metrics
from miles.engines.weight_routes import ModelUpdateLock, add_weight_routes
from miles.engines.wire import (
    ROUTING_KEY_HEADER,
    SESSION_HEADER,
    check_text,
    generate_response,
    lora_update_response,
    parse_generate_request,
    parse_weight_version,
)

SERVER_VERSION = "miles-embedded-0.1"
DEFAULT_TINY_SIZE = "3m"  # what `tiny` means: `make_tiny_model`'s default, the trainer's default size
SMOLLM2 = "smollm2-135m"


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


#: The largest request body the server reads (a 1M-token prompt is about 8 MB of JSON).
MAX_BODY_BYTES = 32 << 20
#: How often a running `/generate` checks whether its client is still there.
DISCONNECT_POLL_S = 0.5
#: Bodies above this are parsed on a worker thread, so a big one never stalls `/health` or the other requests.
_PARSE_INLINE_BYTES = 64 << 10


async def _json_body(request: fastapi.Request) -> dict[str, Any]:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BodyTooLargeError(f"the body has {declared} bytes; the limit is {MAX_BODY_BYTES}")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise BodyTooLargeError(f"the body is over the limit of {MAX_BODY_BYTES} bytes")
    if not raw:
        return {}
    try:
        body = (
            json.loads(raw)
            if len(raw) <= _PARSE_INLINE_BYTES
            else await asyncio.to_thread(json.loads, bytes(raw))
        )
    except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested deeper than Python recurses
        raise InvalidRequestError(f"the body is not JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the body must be a JSON object")
    return body


def _require(body: dict[str, Any], *names: str) -> None:
    missing = [n for n in names if n not in body]
    if missing:
        raise InvalidRequestError(f"missing fields: {missing}")


class KeyCheck:
    """ASGI middleware that refuses requests without the key their route needs (`miles.engines.auth`). Plain
    ASGI, not Starlette's `BaseHTTPMiddleware`, so a route still sees its client hang up."""

    def __init__(self, app: Any, *, api_key: str | None, admin_key: str | None) -> None:
        self.app, self.api_key, self.admin_key = app, api_key, admin_key

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            auth = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
            status = refusal(path, auth, api_key=self.api_key, admin_key=self.admin_key)
            if status is not None:
                what = "admin token" if path in ADMIN_PATHS else "API key"
                await _error(
                    status,
                    f"{path} needs the server's {what} as the bearer (see miles.engines.auth)",
                    "authentication_error",
                )(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyTooLargeError(InvalidRequestError):
    """A request body over `MAX_BODY_BYTES` (413)."""


def create_app(
    engine: EmbeddedEngine, *, api_key: str | None = None, admin_key: str | None = None
) -> fastapi.FastAPI:
    """A FastAPI app that serves `engine` over SGLang's native HTTP API, with SGLang's `--api-key` and
    `--admin-api-key` rules (`miles.engines.auth`)."""
    app = fastapi.FastAPI(title="miles embedded engine")
    started = time.time()

    app.add_middleware(KeyCheck, api_key=api_key, admin_key=admin_key)
    update_lock = ModelUpdateLock()

    @app.exception_handler(InvalidRequestError)
    async def _bad_request(_: fastapi.Request, exc: InvalidRequestError) -> JSONResponse:
        return _error(413 if isinstance(exc, BodyTooLargeError) else 400, str(exc), "invalid_request_error")

    @app.exception_handler(EngineError)
    async def _engine_error(_: fastapi.Request, exc: EngineError) -> JSONResponse:
        return _error(503, str(exc), "engine_error")

    def _decode(ids: list[int]) -> str | None:
        if engine.tokenizer is None:
            return None
        return engine.tokenizer.decode(ids, skip_special_tokens=True)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: fastapi.Request) -> JSONResponse:
        req = parse_generate_request(await _json_body(request), engine.tokenizer)
        rid = req["rid"] or uuid.uuid4().hex
        session_id = request.headers.get(SESSION_HEADER) or request.headers.get(ROUTING_KEY_HEADER)
        async with update_lock.generating():
            work = asyncio.ensure_future(
                engine.generate(
                    req["input_ids"],
                    req["params"],
                    rid=rid,
                    ignore_eos=req["ignore_eos"],
                    session_id=session_id,
                    adapter=req["lora_path"],
                )
            )
            aborted = False
            while not work.done():  # a client that hung up gets its request aborted, not decoded to the end
                await asyncio.wait({work}, timeout=DISCONNECT_POLL_S)
                if not work.done() and not aborted and await request.is_disconnected():
                    aborted = True
                    await engine.abort(rid)
            result = work.result()
        return JSONResponse(
            generate_response(
                result, rid=rid, text=_decode(result.output_ids), return_logprob=req["return_logprob"]
            )
        )

    @app.post("/abort_request")
    async def abort_request(request: fastapi.Request) -> Response:
        body = await _json_body(request)
        if body.get("abort_all"):
            await engine.abort_all()
        elif body.get("rid"):
            await engine.abort(str(body["rid"]))
        return Response(status_code=200)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if await engine.health() else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if not await engine.health():
            return Response(status_code=503)
        from miles.engine import SamplingParams

        await engine.generate(
            [0], SamplingParams(temperature=0.0, max_new_tokens=1), rid=f"HEALTH_CHECK_{uuid.uuid4().hex}"
        )
        return Response(status_code=200)

    # fixed at start, like SGLang's: a weight update moves `model_path`, never the tokenizer
    tokenizer_path = None if engine.tokenizer is None else tokenizer_spec(engine.model_path)

    def model_info() -> dict[str, Any]:
        """SGLang's `/model_info` fields, plus `vocab_size` (the model's embedding rows)."""
        cfg = engine.model.config
        return {
            "model_path": engine.model_path,
            "served_model_name": engine.model_path or "miles-embedded",
            "tokenizer_path": tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": str(engine.weight_version),
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None),
            "vocab_size": engine.vocab_size,
        }

    def server_info() -> dict[str, Any]:
        """SGLang's `/server_info` fields that apply to one embedded engine, plus `vocab_size`."""
        return {
            "model_path": engine.model_path,
            "tokenizer_path": tokenizer_path,
            "served_model_name": engine.model_path or "miles-embedded",
            "device": str(engine.device),
            "tp_size": 1,
            "pp_size": 1,
            "dp_size": 1,
            "dtype": str(next(engine.model.parameters()).dtype).removeprefix("torch."),
            "context_length": engine.max_context,
            "max_req_input_len": engine.max_context - 1,
            "max_running_requests": engine.max_batch_size,
            "max_total_num_tokens": engine.max_context * engine.max_batch_size,
            "weight_version": str(engine.weight_version),
            "internal_states": [{"num_running_requests": engine.num_active}],
            "engine_id": engine.engine_id,
            "startup_time": started,
            "version": SERVER_VERSION,
            "frontend": "python",
            "disaggregation_mode": "null",
            "vocab_size": engine.vocab_size,
        }

    for path in ("/get_model_info", "/model_info"):
        app.add_api_route(path, model_info, methods=["GET"])
    for path in ("/get_server_info", "/server_info"):
        app.add_api_route(path, server_info, methods=["GET"])

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        await engine.flush_cache()
        return PlainTextResponse("Cache flushed.\n")

    add_weight_routes(app, engine, _json_body, update_lock)

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: fastapi.Request) -> JSONResponse:
        """SGLang's `LoadLoRAAdapterReqInput`: the PEFT folder `lora_path` served as `lora_name` (a name that is
        loaded already is refused, as SGLang refuses it)."""
        body = await _json_body(request)
        _require(body, "lora_name", "lora_path")
        name, path = body["lora_name"], body["lora_path"]
        if not isinstance(name, str) or not isinstance(path, str):
            raise InvalidRequestError("lora_name and lora_path must be strings")
        if name in engine.adapter_sources:
            return JSONResponse(
                lora_update_response(
                    False, error=f"Failed to load LoRA adapter {name} because it is already loaded"
                ),
                status_code=400,
            )
        try:
            await engine.update_adapter(name, path=path, version=0)
        except InvalidRequestError as exc:
            return JSONResponse(lora_update_response(False, error=str(exc)), status_code=400)
        return JSONResponse(lora_update_response(True, loaded=dict(engine.adapter_sources)))

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: fastapi.Request) -> JSONResponse:
        """SGLang's `UnloadLoRAAdapterReqInput`: unload `lora_name` once its requests in flight are done."""
        body = await _json_body(request)
        _require(body, "lora_name")
        name = body["lora_name"]
        if name not in engine.adapter_sources:
            return JSONResponse(
                lora_update_response(
                    False,
                    error=f"LoRA with name {name} does not exist. Loaded "
                    f"LoRAs: {sorted(engine.adapter_sources)}",
                ),
                status_code=400,
            )
        await engine.unload_adapter(name)
        return JSONResponse(lora_update_response(True, loaded=dict(engine.adapter_sources)))

    @app.post("/update_weight_version")
    async def update_weight_version(request: fastapi.Request) -> JSONResponse:
        body = await _json_body(request)
        _require(body, "new_version")
        version = parse_weight_version(body["new_version"])
        if version is None:
            raise InvalidRequestError("new_version must be an integer string for the embedded engine")
        if body.get("abort_all_requests", True):
            await engine.abort_all()
        await asyncio.to_thread(engine.load_weights_sync, {}, version)
        return JSONResponse({"success": True, "message": f"version {version}"})

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: fastapi.Request) -> JSONResponse:
        body = await _json_body(request)
        _require(body, "name")
        params = engine.model.state_dict()
        if body["name"] not in params:
            raise InvalidRequestError(f"unknown parameter {body['name']!r}")
        size = body.get("truncate_size", 100)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidRequestError(f"truncate_size must be a non-negative integer, got {size!r}")
        t = params[body["name"]].detach().float().cpu()
        return JSONResponse(t[:size].tolist() if t.dim() else t.item())

    def _tokenizer() -> Any:
        if engine.tokenizer is None:
            raise InvalidRequestError("this server was started without a tokenizer")
        return engine.tokenizer

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(request: fastapi.Request) -> JSONResponse:
        """SGLang's `TokenizeRequest` for a text prompt (or a list of them)."""
        body = await _json_body(request)
        _require(body, "prompt")
        prompt, special = body["prompt"], bool(body.get("add_special_tokens", True))
        texts = prompt if isinstance(prompt, list) else [prompt]
        if not all(isinstance(t, str) for t in texts):
            raise InvalidRequestError("prompt must be a string or a list of strings")
        for t in texts:
            check_text(t, "prompt")
        tokens = [_tokenizer().encode(t, add_special_tokens=special) for t in texts]
        out = (tokens, [len(t) for t in tokens]) if isinstance(prompt, list) else (tokens[0], len(tokens[0]))
        return JSONResponse({"tokens": out[0], "count": out[1], "max_model_len": engine.max_context})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        """SGLang's OpenAI-compatible model list: the served model with its context length."""
        name = engine.model_path or "miles-embedded"
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": int(started),
                        "owned_by": "miles",
                        "root": name,
                        "parent": None,
                        "max_model_len": engine.max_context,
                    }
                ],
            }
        )

    registry = engine_registry(engine)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render_metrics(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get(LOADS_PATH)
    async def loads() -> JSONResponse:
        """SGLang's load report (one rank): requests decoding and waiting here."""
        return JSONResponse(loads_body(await engine.load()))

    return app


class ServerHandle:
    """A uvicorn server running in a background thread (for tests and in-process use)."""

    def __init__(self, server: uvicorn.Server, thread: threading.Thread, host: str, port: int) -> None:
        self.server, self.thread, self.host, self.port = server, thread, host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10.0)


def _config(engine: EmbeddedEngine, host: str, port: int, admin_key: str | None) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(engine, admin_key=admin_key, api_key=api_key()),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=30,
    )


async def serve(
    engine: EmbeddedEngine, host: str = "127.0.0.1", port: int = 30001, *, admin_key: str | None = None
) -> None:
    """Serve `engine` until cancelled (runs on the current event loop); `admin_key` guards its control
    routes."""
    await uvicorn.Server(_config(engine, host, port, admin_key)).serve()


def serve_in_thread(
    engine: EmbeddedEngine,
    host: str = "127.0.0.1",
    port: int = 0,
    startup_timeout_s: float = 30.0,
    *,
    admin_key: str | None = None,
) -> ServerHandle:
    """Start a server in a daemon thread with its own event loop; `port=0` picks a free port; `admin_key`
    guards its control routes."""
    server = uvicorn.Server(_config(engine, host, port, admin_key))
    thread = threading.Thread(target=server.run, name="miles-engine-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise EngineError(f"server on {host}:{port} did not start")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return ServerHandle(server, thread, host, bound)


@dataclass(frozen=True)
class ModelSpec:
    """What `--model` names for the embedded engine: a tiny size, SmolLM2-135M, or an HF checkpoint folder."""

    name: str
    tiny_size: str | None = None
    folder: str | None = None


def parse_model_spec(name: str) -> ModelSpec:
    """Parse `tiny` (the 3m size), `tiny-<size>`, `smollm2-135m` or an HF checkpoint folder.

    Raises `InvalidRequestError` with one line naming the accepted forms.
    """
    from miles.tiny import TINY_SIZES

    if name == "tiny":
        return ModelSpec(name, tiny_size=DEFAULT_TINY_SIZE)
    if name.startswith("tiny-") and name.removeprefix("tiny-") in TINY_SIZES:
        return ModelSpec(name, tiny_size=name.removeprefix("tiny-"))
    if name == SMOLLM2:
        from miles.pretrained import PretrainedNotInstalledError, smollm2_dir

        try:
            smollm2_dir()
        except PretrainedNotInstalledError as exc:
            raise InvalidRequestError(str(exc)) from None
        return ModelSpec(name)
    if Path(name).is_dir() and (Path(name) / "config.json").is_file():
        return ModelSpec(name, folder=name)
    sizes = ", ".join(f"tiny-{s}" for s in TINY_SIZES)
    raise InvalidRequestError(
        f"model {name!r} is not 'tiny' ({sizes}), {SMOLLM2!r} or an HF checkpoint folder "
        "(a folder with config.json)"
    )


def tokenizer_spec(model_path: str) -> str:
    """The tokenizer name `miles.tito.load_tokenizer` accepts for a model spec (`tiny-1m` -> `tiny`)."""
    with contextlib.suppress(InvalidRequestError):
        if parse_model_spec(model_path).tiny_size is not None:
            return "tiny"
    return model_path


#: SGLang's `--dtype` names and the torch dtype each means here (None: keep the checkpoint's).
DTYPES: dict[str, str | None] = {
    "auto": None,
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}


def load_engine(
    model: str,
    *,
    device: str = "cpu",
    max_batch_size: int = 64,
    context_length: int | None = None,
    dtype: str = "auto",
    engine_id: str = "embedded-0",
) -> EmbeddedEngine:
    """An `EmbeddedEngine` for a model spec (see `parse_model_spec`).

    `context_length` caps the model's maximum positions; `dtype` is one of SGLang's names ("auto" keeps the
    checkpoint's, "half"/"float16", "bfloat16", "float"/"float32").
    """
    import torch

    spec = parse_model_spec(model)
    kwargs: dict[str, Any] = {
        "device": device,
        "max_batch_size": max_batch_size,
        "engine_id": engine_id,
        "model_path": spec.name,
    }
    if spec.folder is not None:
        engine = EmbeddedEngine.from_pretrained(spec.folder, **kwargs)
    elif spec.tiny_size is not None:
        from miles.tiny import load_tiny_tokenizer, make_tiny_model

        tokenizer = load_tiny_tokenizer()
        engine = EmbeddedEngine(
            make_tiny_model(spec.tiny_size, vocab_size=len(tokenizer)), tokenizer=tokenizer, **kwargs
        )
    else:
        from miles.pretrained import load_smollm2

        net, tokenizer = load_smollm2()
        engine = EmbeddedEngine(net, tokenizer=tokenizer, **kwargs)
    if DTYPES[dtype] is not None:
        engine.model.to(getattr(torch, DTYPES[dtype]))  # in place, before any request
    if context_length is not None:
        engine.max_context = min(engine.max_context, context_length)
    return engine


def run_server(
    model: str,
    host: str = "127.0.0.1",
    port: int = 30001,
    *,
    device: str = "cpu",
    max_batch_size: int = 64,
    context_length: int | None = None,
    dtype: str = "auto",
    engine_id: str = "embedded-0",
) -> None:
    """Blocking: serve the embedded engine for `model` (see `load_engine`) until SIGINT/SIGTERM; its control
    routes take the admin token (`miles.engines.auth`)."""
    engine = load_engine(
        model,
        device=device,
        max_batch_size=max_batch_size,
        context_length=context_length,
        dtype=dtype,
        engine_id=engine_id,
    )
    asyncio.run(serve(engine, host, port, admin_key=admin_token(create=True)))
