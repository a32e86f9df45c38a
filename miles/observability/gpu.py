"""GPU memory and fragmentation, from the CUDA caching allocator.

`gpu_memory` is a pure function of what `torch.cuda.memory_stats(device)` and `torch.cuda.memory_snapshot()`
return (their formats are documented in `torch/cuda/memory.py`: a flat dict of counters such as
`"allocated_bytes.all.current"`, and a list of segments, each a cudaMalloc'd range with its `blocks`, every
block `active_allocated`, `active_awaiting_free` or `inactive`). `GpuCollector` calls it at scrape time for
every device this process has initialised; without CUDA it exports nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from miles.observability.families import family


@dataclass(frozen=True)
class GpuMemory:
    """One device's allocator state in bytes. `largest_free_block` is the biggest inactive block of any
    reserved segment: the largest tensor that fits without a new cudaMalloc."""

    device: int
    allocated: int
    reserved: int
    peak_allocated: int
    largest_free_block: int
    alloc_retries: int

    @property
    def free_reserved(self) -> int:
        """Reserved but unallocated bytes (reserved - allocated)."""
        return max(0, self.reserved - self.allocated)

    @property
    def fragmentation_ratio(self) -> float:
        """1 - largest free block / free reserved bytes: 0 when the free memory is one block (or there is
        none), near 1 when it is scattered over many small blocks."""
        free = self.free_reserved
        return 1.0 - min(self.largest_free_block, free) / free if free else 0.0


def largest_free_block(segments: Iterable[Mapping[str, Any]], device: int | None = None) -> int:
    """The size of the largest `inactive` block among `segments` (those of `device`, when given)."""
    sizes = [
        int(block["size"])
        for seg in segments
        if device is None or seg.get("device", device) == device
        for block in seg.get("blocks", ())
        if block.get("state") == "inactive"
    ]
    return max(sizes, default=0)


def gpu_memory(device: int, stats: Mapping[str, Any], segments: Iterable[Mapping[str, Any]]) -> GpuMemory:
    """`GpuMemory` of `device` from its `memory_stats` dict and a `memory_snapshot` segment list."""
    return GpuMemory(
        device=device,
        allocated=int(stats.get("allocated_bytes.all.current", 0)),
        reserved=int(stats.get("reserved_bytes.all.current", 0)),
        peak_allocated=int(stats.get("allocated_bytes.all.peak", 0)),
        largest_free_block=largest_free_block(segments, device),
        alloc_retries=int(stats.get("num_alloc_retries", 0)),
    )


_GAUGES = (
    ("miles_gpu_memory_allocated_bytes", lambda m: m.allocated),
    ("miles_gpu_memory_reserved_bytes", lambda m: m.reserved),
    ("miles_gpu_memory_peak_allocated_bytes", lambda m: m.peak_allocated),
    ("miles_gpu_memory_fragmentation_bytes", lambda m: m.free_reserved),
    ("miles_gpu_memory_largest_free_block_bytes", lambda m: m.largest_free_block),
    ("miles_gpu_memory_fragmentation_ratio", lambda m: m.fragmentation_ratio),
)


def read_gpu_memory() -> list[GpuMemory]:
    """Every CUDA device's `GpuMemory`; empty without CUDA or before this process initialised it (reading
    would create a CUDA context)."""
    try:
        import torch
    except ImportError:
        return []
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return []
    segments = torch.cuda.memory_snapshot()
    return [gpu_memory(d, torch.cuda.memory_stats(d), segments) for d in range(torch.cuda.device_count())]


class GpuCollector:
    """Exports `read_gpu_memory()` (or `reader()`) at every scrape, labelled with `run` and the device."""

    def __init__(self, run: str, reader: Any = read_gpu_memory) -> None:
        self.run, self.reader = run, reader

    def collect(self) -> Iterator[Any]:
        devices = self.reader()
        if not devices:
            return
        labels = list(family("miles_gpu_memory_allocated_bytes").labels)
        for name, value in _GAUGES:
            g = GaugeMetricFamily(name, family(name).help, labels=labels)
            for m in devices:
                g.add_metric([self.run, str(m.device)], float(value(m)))
            yield g
        name = "miles_gpu_alloc_retries_total"
        c = CounterMetricFamily(name.removesuffix("_total"), family(name).help, labels=labels)
        for m in devices:
            c.add_metric([self.run, str(m.device)], float(m.alloc_retries))
        yield c
