"""The embedded engine's Prometheus metrics: the `miles_engine_*` families of `miles.observability.families`.

An engine keeps plain counters (`EmbeddedEngine.stats`) and two histograms (`EngineHistograms`, written by
its decode thread); `EngineCollector` reads them at every scrape, so nothing is copied between scrapes.
Every engine of a process is tracked by the process's one registry (`miles.observability.process_metrics`),
labelled by its `engine` id, so the embedded server's `/metrics` and `miles train`'s show the same names.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from miles.observability.families import family
from miles.observability.registry import Metrics, process_metrics

_COUNTERS = (
    ("miles_engine_prefill_tokens_total", "prefill_tokens"),
    ("miles_engine_cached_tokens_total", "cached_tokens"),
    ("miles_engine_decode_tokens_total", "decode_tokens"),
    ("miles_engine_decode_steps_total", "steps"),
    ("miles_engine_pauses_total", "pauses"),
)


class EngineHistograms:
    """Per-request and per-step distributions an engine observes: time to first token and decode batch size.

    The engines do not stream, so "first token" is the end of a request's prefill, measured from its arrival
    (queueing included). Unregistered client histograms: `EngineCollector` relabels and exports them.
    """

    def __init__(self) -> None:
        self.first_token = Histogram(
            "first_token",
            "",
            registry=None,
            buckets=family("miles_engine_time_to_first_token_seconds").buckets,
        )
        self.batch_size = Histogram(
            "batch_size", "", registry=None, buckets=family("miles_engine_batch_size").buckets
        )


def _histogram_samples(hist: Histogram) -> tuple[list[tuple[str, float]], float]:
    """Cumulative `(le, count)` buckets and the sum of an unlabelled client histogram."""
    buckets, total = [], 0.0
    for s in hist.collect()[0].samples:
        if s.name.endswith("_bucket"):
            buckets.append((s.labels["le"], s.value))
        elif s.name.endswith("_sum"):
            total = s.value
    return buckets, total


class EngineCollector:
    """Exports every tracked engine's families at scrape time. Engines are held weakly: a dropped engine
    disappears from the next scrape. Two live engines with the same labels (run, model, engine id) would be one
    series twice, which Prometheus rejects: the one tracked last is exported."""

    def __init__(self) -> None:
        self._engines: weakref.WeakKeyDictionary[Any, tuple[str, str]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def track(self, engine: Any, *, run: str = "", model: str = "") -> None:
        """Export `engine` (an `EmbeddedEngine`) with these `run` and `model` label values."""
        with self._lock:
            self._engines[engine] = (run, model or getattr(engine, "model_path", "") or "")

    def collect(self) -> Iterator[Any]:
        with self._lock:
            engines = list(self._engines.items())
        labels = list(family("miles_engine_weight_version").labels)
        out: dict[str, Any] = {}

        def fam(name: str, cls: Any) -> Any:
            if name not in out:
                out[name] = cls(
                    name.removesuffix("_total") if cls is CounterMetricFamily else name,
                    family(name).help,
                    labels=labels,
                )
            return out[name]

        latest = {(run, model, engine.engine_id): engine for engine, (run, model) in engines}
        for (run, model, engine_id), engine in latest.items():
            values = [run, model, engine_id]
            stats = engine.stats
            for name, key in _COUNTERS:
                fam(name, CounterMetricFamily).add_metric(values, float(stats[key]))
            load = engine.load_now()
            fam("miles_engine_running_requests", GaugeMetricFamily).add_metric(values, float(load.running))
            fam("miles_engine_waiting_requests", GaugeMetricFamily).add_metric(values, float(load.waiting))
            fam("miles_engine_weight_version", GaugeMetricFamily).add_metric(
                values, float(engine.weight_version)
            )
            hists = engine.histograms
            for name, hist in (
                ("miles_engine_batch_size", hists.batch_size),
                ("miles_engine_time_to_first_token_seconds", hists.first_token),
            ):
                buckets, total = _histogram_samples(hist)
                fam(name, HistogramMetricFamily).add_metric(values, buckets, total)
        yield from out.values()


def engine_collector(metrics: Metrics | None = None) -> EngineCollector:
    """The engine collector of `metrics` (the process's by default), registered on first use."""
    return (metrics or process_metrics()).collector("engines", EngineCollector)


def engine_registry(engine: Any, *, run: str = "") -> CollectorRegistry:
    """The process registry, with `engine` tracked in it (what the embedded server serves at `/metrics`)."""
    metrics = process_metrics()
    engine_collector(metrics).track(engine, run=run)
    return metrics.registry


def render_metrics(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition of `registry`."""
    return generate_latest(registry)
