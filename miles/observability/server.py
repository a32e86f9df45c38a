"""Serving a registry at `/metrics` over HTTP for the life of a run (prometheus-client's own server)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import start_http_server

from miles.config import ConfigError
from miles.observability.registry import Metrics


@dataclass
class MetricsServer:
    """A running `/metrics` endpoint. `close()` stops it."""

    host: str
    port: int
    _server: Any
    _thread: Any

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)


def serve_metrics(metrics: Metrics, host: str = "127.0.0.1", port: int = 0) -> MetricsServer:
    """Serve `metrics` at `http://host:port/metrics` from a background thread (port 0: a free one).
    A port that cannot be bound is a `ConfigError` on `observability.metrics_port`."""
    try:
        server, thread = start_http_server(port, addr=host, registry=metrics.registry)
    except OSError as exc:
        raise ConfigError(
            "observability.metrics_port",
            f"cannot serve metrics on {host}:{port}: "
            f"{exc.strerror or exc}; choose another port, or 0 for a free one",
        ) from None
    return MetricsServer(host, int(server.server_port), server, thread)
