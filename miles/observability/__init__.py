"""Observability: one Prometheus registry per process, the families it exports, and their feeders.

- `families`: every metric family (names, labels, buckets) and the cardinality rule;
- `process_metrics()`: the process's registry (with the process collector);
- `start_observability(config, labels, ...)`: a run's `RunMetrics` (step, trainer, sync) and its `/metrics`
  server; sessions are observed by `miles.sessions.SessionMetrics`, engines by `miles.engines.metrics`;
- `gpu`: GPU memory and fragmentation from the CUDA caching allocator;
- `miles top URL` (`miles.observability.top`) and the Grafana dashboard (`miles.observability.dashboard`).
"""

from miles.observability.config import ObservabilityConfig
from miles.observability.families import FAMILIES, Family, family
from miles.observability.gpu import GpuCollector, GpuMemory, gpu_memory, largest_free_block
from miles.observability.registry import Metrics, RunLabels, process_metrics, sample_value
from miles.observability.run import (
    Observability,
    RunMetrics,
    cuda_peak_flops,
    device_peak_flops,
    run_labels,
    start_observability,
)
from miles.observability.server import MetricsServer, serve_metrics

__all__ = [
    "FAMILIES",
    "Family",
    "GpuCollector",
    "GpuMemory",
    "Metrics",
    "MetricsServer",
    "Observability",
    "ObservabilityConfig",
    "RunLabels",
    "RunMetrics",
    "cuda_peak_flops",
    "device_peak_flops",
    "family",
    "gpu_memory",
    "largest_free_block",
    "process_metrics",
    "run_labels",
    "sample_value",
    "serve_metrics",
    "start_observability",
]
