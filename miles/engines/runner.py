"""The decode batch of the embedded engine: static per-row state, one step function, CUDA graphs on CUDA.

Row `i` of the batch decodes in slot `i` of the `SlotCache` (the engine keeps its rows packed: a leaving
row's place is filled by the last row, see `move`). Each row's next input token, position, sampling
settings, random-stream key and token counter live in fixed device buffers. A step reads them, runs the
model and the sampler, writes the sampled tokens back as the next inputs and advances the positions, all in
place, and returns `[2, rows]` (tokens, logprobs) for one host copy.

On CUDA each (batch bucket, attention-length bucket, `SampleMode`) shape is captured once as a CUDA graph and
replayed; rows past the live ones are inactive padding (position 0 of a free slot). The graphs read the
model's parameters, so weight updates that copy into them keep the graphs valid; a cache that grows
(`SlotCache.ensure`) drops them. On the CPU the same step runs eagerly at the exact batch and length,
its attention grouped by the rows' context lengths (`decoder.attention_groups`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from miles.engines.decoder import AttentionGroups, Decoder, attention_groups
from miles.engines.kv import SlotCache
from miles.engines.sampling import RowSampling, SampleMode, SamplingTensors, sample

#: the smallest attention length a CUDA graph is captured for (lengths round up to powers of two).
MIN_GRAPH_LENGTH = 64
#: torch allows one CUDA-graph capture at a time per process, and `engine.num_engines > 1` runs one decode
#: thread per engine: two captures at once shared torch's capture stream and failed every later step.
_CAPTURE_LOCK = threading.Lock()


def batch_buckets(max_batch: int) -> list[int]:
    """CUDA-graph batch sizes: powers of two below `max_batch`, then `max_batch` itself."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return [*sizes, max_batch]


class DecodeBatch:
    """Static decode state of up to `max_batch` rows over `cache`, stepped eagerly or by CUDA graphs."""

    def __init__(
        self,
        decoder: Decoder,
        cache: SlotCache,
        max_batch: int,
        *,
        cuda_graphs: bool = True,
        padded: bool | None = None,
    ) -> None:
        self.decoder, self.cache, self.max_batch = decoder, cache, max_batch
        device = decoder.device
        self.device = device
        self.graphs_enabled = cuda_graphs and device.type == "cuda"
        #: step at bucketed shapes (what graphs need); by default only with graphs, settable to test it on a CPU
        self.padded = self.graphs_enabled if padded is None else padded
        self.buckets = batch_buckets(max_batch)
        z = {"device": device}
        self.tokens = torch.zeros(max_batch, dtype=torch.int64, **z)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, **z)
        self.active = torch.zeros(max_batch, dtype=torch.int64, **z)
        self.sampling = SamplingTensors(
            temperature=torch.zeros(max_batch, dtype=torch.float32, **z),
            top_k=torch.zeros(max_batch, dtype=torch.int64, **z),
            top_p=torch.ones(max_batch, dtype=torch.float32, **z),
            key=torch.zeros(max_batch, dtype=torch.int64, **z),
            step=torch.zeros(max_batch, dtype=torch.int64, **z),
        )
        self._fields = [
            self.tokens,
            self.positions,
            self.active,
            self.sampling.temperature,
            self.sampling.top_k,
            self.sampling.top_p,
            self.sampling.key,
            self.sampling.step,
        ]
        self.out = torch.zeros((3, max_batch), dtype=torch.float64, **z)
        self._graphs: dict[tuple[int, int, SampleMode], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.graphs_enabled else None

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    # ------------------------------------------------------------------ membership
    def join(
        self,
        first: int,
        tokens: torch.Tensor,
        positions: list[int],
        rows: list[RowSampling],
        steps: list[int],
    ) -> None:
        """Rows `first ..` start decoding: next input `tokens` (device) at `positions`, with these settings."""
        end = first + len(rows)
        new = SamplingTensors.build(rows, steps, self.device)
        self.tokens[first:end] = tokens
        self.positions[first:end] = torch.tensor(positions, dtype=torch.int64, device=self.device)
        self.active[first:end] = 1
        for dst, src in (
            (self.sampling.temperature, new.temperature),
            (self.sampling.top_k, new.top_k),
            (self.sampling.top_p, new.top_p),
            (self.sampling.key, new.key),
            (self.sampling.step, new.step),
        ):
            dst[first:end] = src

    def move(self, src: list[int], dst: list[int], length: int) -> None:
        """Move rows `src` (state and the first `length` cache positions) into rows `dst`."""
        if not src:
            return
        self.cache.move(src, dst, length)
        s = torch.tensor(src, device=self.device)
        d = torch.tensor(dst, device=self.device)
        for field in self._fields:
            field[d] = field[s]

    def release(self, start: int, end: int) -> None:
        """Rows `start .. end-1` stop decoding (they become padding)."""
        if end > start:
            self.active[start:end] = 0
            self.positions[start:end] = 0

    def drop_graphs(self) -> None:
        """Forget the captured CUDA graphs (the forward pass or the cache's buffers changed)."""
        self._graphs.clear()
        if self.graphs_enabled:  # a pool whose graphs are all gone takes no new capture: start another
            self._pool = torch.cuda.graph_pool_handle()

    def grow(self, length: int) -> None:
        """Make the cache hold `length` positions per slot (dropping graphs when its buffers move)."""
        if self.cache.ensure(length):
            self.drop_graphs()

    # ------------------------------------------------------------------ stepping
    def _step(
        self, rows: int, length: int, mode: SampleMode, groups: AttentionGroups | None = None
    ) -> torch.Tensor:
        logits = self.decoder.forward(
            self.cache, self.tokens[:rows, None], self.positions[:rows, None], 0, length, groups=groups
        )
        view = SamplingTensors(
            *(
                t[:rows]
                for t in (
                    self.sampling.temperature,
                    self.sampling.top_k,
                    self.sampling.top_p,
                    self.sampling.key,
                    self.sampling.step,
                )
            )
        )
        tokens, logprobs, kept = sample(logits, view, mode)
        self.out[0, :rows].copy_(tokens)
        self.out[1, :rows].copy_(logprobs)
        self.out[2, :rows].copy_(kept)
        self.tokens[:rows].copy_(tokens)
        self.positions[:rows].add_(self.active[:rows])
        self.sampling.step[:rows].add_(1)
        return self.out[:, :rows]

    def step(
        self, rows: int, length: int, mode: SampleMode, lengths: Sequence[int] | None = None
    ) -> tuple[list[int], list[float], list[int]]:
        """One decode step of rows `0 .. rows-1`, whose caches hold fewer than `length` positions (row `i` reads
        `lengths[i]` of them, when given: an eager step then groups rows of like lengths, `attention_groups`).

        Returns the sampled tokens, their logprobs and the kept counts (`sample`; one host synchronisation).
        """
        if not self.padded:
            out = self._step(rows, length, mode, attention_groups(lengths) if lengths is not None else None)
        else:
            key = self.shape(rows, length, mode)
            graph = self._graphs.get(key)
            if graph is not None:
                graph.replay()
                out = self.out[:, : key[0]]
            else:
                out = self._step(*key)  # the real step; on CUDA also the warm-up before the capture
                if self.graphs_enabled:
                    self._capture(key)
        host = out.cpu()
        return host[0, :rows].long().tolist(), host[1, :rows].tolist(), host[2, :rows].long().tolist()

    def shape(self, rows: int, length: int, mode: SampleMode) -> tuple[int, int, SampleMode]:
        """The bucketed (batch, attention length, mode) a padded step of `rows` rows runs at."""
        batch = next(size for size in self.buckets if size >= rows)
        span = min(max(MIN_GRAPH_LENGTH, 1 << (length - 1).bit_length()), self.cache.capacity)
        return batch, span, mode

    def _capture(self, key: tuple[int, int, SampleMode]) -> None:
        # capture records kernels without running them, so the state the eager step just advanced stays put
        with _CAPTURE_LOCK:
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.current_stream(self.device)
            try:
                with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                    self._step(*key)
            finally:  # a capture that fails to begin leaves its stream current: steps would go on inside it
                torch.cuda.set_stream(stream)
        self._graphs[key] = graph
