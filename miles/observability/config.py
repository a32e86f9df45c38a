"""`ObservabilityConfig`: the `observability:` section of a `miles train` config."""

from __future__ import annotations

from dataclasses import dataclass

from miles.config import ConfigError


@dataclass
class ObservabilityConfig:
    """Live Prometheus metrics of a run.

    `metrics_port`: serve `/metrics` there for the whole run (None, the default: off; 0: pick a free port and
    print it). `metrics_host`: the address to bind (loopback by default; "0.0.0.0" exposes it).
    `metrics_linger_s`: after the run's last step and evaluation, keep serving `/metrics` this many seconds more,
    so that a scraper collects the final values (a short run can end between two scrapes).
    `run_name`: the `run` label (default: the name of the run's output folder).
    `peak_tflops`: the device's dense peak in TFLOP/s for the MFU gauge; by default it is looked up from the
    CUDA device's name, and without a known peak no MFU is exported.
    """

    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    metrics_linger_s: float = 0.0
    run_name: str | None = None
    peak_tflops: float | None = None

    def __post_init__(self) -> None:
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(
                "metrics_port",
                f"{self.metrics_port} is not a port number (0-65535; 0 picks a "
                "free one; leave it unset to serve no metrics)",
            )
        if self.metrics_linger_s < 0:
            raise ConfigError("metrics_linger_s", f"must be >= 0 seconds, got {self.metrics_linger_s}")
        if not self.metrics_host:
            raise ConfigError("metrics_host", "must be an address such as 127.0.0.1")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError("peak_tflops", "must be > 0 (or unset to look it up from the device)")
