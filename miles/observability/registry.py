"""One Prometheus registry per process, holding every family of `miles.observability.families`.

`process_metrics()` is the process's `Metrics`: its registry carries the process collector (CPU seconds,
resident memory, open files), and, once asked, the embedded engines' collector and the GPU memory
collector. Everything a process exports goes through it, so one `/metrics` endpoint shows it all: the one
`miles train` serves (`miles.observability.serve_metrics`) and the embedded engine server's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from miles.observability.families import FAMILIES, POLICY_LABELS, RUN_LABELS

C = TypeVar("C")
# Families produced by collectors at scrape time rather than by observations.
_COLLECTED = ("engine", "gpu")


@dataclass(frozen=True)
class RunLabels:
    """The label values shared by everything one run reports (see the cardinality rule in `families`)."""

    run: str
    env: str = ""
    model: str = ""
    adapter: str = "base"

    def values(self) -> tuple[str, ...]:
        """In `RUN_LABELS` order."""
        return tuple(getattr(self, name) for name in RUN_LABELS)

    def policy(self) -> tuple[str, ...]:
        """In `POLICY_LABELS` order."""
        return tuple(getattr(self, name) for name in POLICY_LABELS)


class Metrics:
    """The prometheus-client objects of every observed family, on `registry`.

    `child(name, *label_values)` returns the labelled series, cached, so that observing costs one dict
    lookup plus the client's own update.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._families: dict[str, Any] = {}
        for f in FAMILIES:
            if f.source in _COLLECTED:
                continue
            if f.kind == "counter":
                metric: Any = Counter(f.name, f.help, f.labels, registry=self.registry)
            elif f.kind == "gauge":
                metric = Gauge(f.name, f.help, f.labels, registry=self.registry)
            else:
                metric = Histogram(f.name, f.help, f.labels, registry=self.registry, buckets=f.buckets)
            self._families[f.name] = metric
        self._children: dict[tuple[str, tuple[str, ...]], Any] = {}
        self._lock = threading.Lock()
        self._collectors: dict[str, Any] = {}

    def child(self, name: str, *values: str) -> Any:
        """The series of family `name` with these label values (in the family's label order)."""
        key = (name, values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = self._families[name].labels(*values)
        return found

    def collector(self, key: str, factory: Callable[[], C]) -> C:
        """The collector registered under `key`, registering `factory()` the first time."""
        with self._lock:
            found = self._collectors.get(key)
            if found is None:
                found = self._collectors[key] = factory()
                self.registry.register(found)
            return found

    def render(self) -> bytes:
        """The Prometheus text exposition of the whole registry."""
        return generate_latest(self.registry)


_process: Metrics | None = None
_process_lock = threading.Lock()


def process_metrics() -> Metrics:
    """This process's `Metrics` (created on first use, with the process collector)."""
    global _process
    with _process_lock:
        if _process is None:
            registry = CollectorRegistry()
            ProcessCollector(registry=registry)
            _process = Metrics(registry)
        return _process


def sample_value(metrics: Metrics, name: str, labels: Mapping[str, str]) -> float | None:
    """The value of the first sample `name` whose labels include `labels` (None when there is none)."""
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None
