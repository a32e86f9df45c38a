"""Prometheus metrics of an embedded engine, served at `/metrics` like SGLang's `--enable-metrics`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class EngineCollector:
    """Reads the engine's live counters at every scrape (nothing is copied between scrapes)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        labels = ["engine_id"]
        values = [self.engine.engine_id]
        stats = self.engine.stats
        for name, key, doc in (("miles_prefill_tokens", "prefill_tokens", "prompt tokens computed by prefill"),
                               ("miles_cached_tokens", "cached_tokens", "prompt tokens served from session caches"),
                               ("miles_decode_tokens", "decode_tokens", "tokens produced by decode steps"),
                               ("miles_decode_steps", "steps", "batched decode steps")):
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric(values, float(stats[key]))
            yield counter
        for name, value, doc in (("miles_num_running_requests", self.engine.num_in_flight, "requests in flight"),
                                 ("miles_weight_version", self.engine.weight_version, "loaded weight version")):
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric(values, float(value))
            yield gauge


def engine_registry(engine: Any) -> CollectorRegistry:
    """A registry holding only this engine's metrics."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    return registry


def render_metrics(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition of `registry`."""
    return generate_latest(registry)
