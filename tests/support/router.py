"""Engines for the routing tests (no tests here): a black-hole HTTP server and a slowed embedded engine."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from miles.engines import EmbeddedEngine, serve_in_thread
from miles.engines.server import ServerHandle
from miles.tiny import make_tiny_model
from tests.support.sessions import tito


class StubServer:
    """A real HTTP server on loopback that answers `GET` paths from `answers` (JSON bodies; None for an
    empty 200) and `POST /abort_request` at once, and accepts `POST /generate` but never answers it.
    With `upstream`, every other request is passed to that server instead, with its admin token (a wedged
    engine whose control plane still works).

    With `answers={"/health": None, "/health_generate": None}` it is a black hole that health probes cannot
    tell from a healthy engine: only turn timeouts reveal it. `generate_calls` counts the requests it swallowed.
    """

    def __init__(self, answers: dict[str, Any], *, upstream: str | None = None) -> None:
        release = threading.Event()
        self.generate_calls = 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self, status: int, body: Any = None, *, raw: bytes | None = None) -> None:
                data = raw if raw is not None else b"" if body is None else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _forward(self, method: str, body: bytes) -> None:
                headers = {
                    k: v
                    for k, v in (
                        ("Content-Type", "application/json" if body else None),
                        ("Authorization", self.headers.get("Authorization")),
                    )
                    if v
                }
                resp = httpx.request(
                    method,
                    f"{upstream}{self.path}",
                    content=body or None,
                    timeout=120,
                    headers=headers or None,
                )
                self._answer(resp.status_code, raw=resp.content)

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                path = self.path.split("?")[0]
                if path in answers:
                    self._answer(200, answers[path])
                elif upstream is not None:
                    self._forward("GET", b"")
                else:
                    self._answer(404, {"error": {"message": f"no {path}", "type": "not_found"}})

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path == "/generate":
                    stub.generate_calls += 1
                    release.wait()  # accepted, never answered (until the server stops)
                    self.close_connection = True
                    return
                if upstream is not None:
                    self._forward("POST", body)
                else:
                    self._answer(200, None)

            def log_message(self, *args: Any) -> None:
                pass

        self._release = release
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="stub-server", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()


def black_hole() -> StubServer:
    return StubServer({"/health": None, "/health_generate": None})


def slowed(engine: EmbeddedEngine, *, prefill_s_per_token: float, decode_s_per_step: float) -> EmbeddedEngine:
    """Make `engine`'s model work cost real time: `prefill_s_per_token` per uncached prompt token of a prefill,
    `decode_s_per_step` per batched decode step whatever its batch size (a GPU-like engine)."""
    prefill, step = engine._prefill, engine._step

    def slow_prefill(new: list[Any], reused: list[int], first: int) -> Any:
        time.sleep(prefill_s_per_token * sum(len(r.input_ids) - m for r, m in zip(new, reused, strict=True)))
        return prefill(new, reused, first)

    def slow_step() -> None:
        time.sleep(decode_s_per_step)
        step()

    engine._prefill, engine._step = slow_prefill, slow_step
    return engine


def embedded_server(
    engine_id: str, *, max_positions: int = 2048, **slow: float
) -> tuple[EmbeddedEngine, ServerHandle]:
    """A real embedded engine (the 0.1M tiny model, optionally `slowed(**slow)`) behind its HTTP server."""
    model = make_tiny_model("0.1m", vocab_size=len(tito().tokenizer), max_position_embeddings=max_positions)
    engine = EmbeddedEngine(model, engine_id=engine_id)
    if slow:
        slowed(engine, **slow)
    return engine, serve_in_thread(engine)
