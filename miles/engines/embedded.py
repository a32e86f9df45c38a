"""The embedded rollout engine: a transformers model served by one continuous-batching decode loop.

Design (see benchmarks/engine.py and docs/benchmarks.md for the measurements):

* One background *thread* owns the model and runs the decode loop, so the asyncio loop (and the HTTP
  server on it) stays responsive while torch computes. `generate` hands a request to the thread and
  awaits a future.
* The KV cache is preallocated per slot (`miles.engines.kv.SlotCache`); a decoding request owns one slot
  and the rows of the batch are kept packed in slots `0 .. n-1`. The forward pass
  (`miles.engines.decoder.Decoder`) runs the model's weights over the slots in place: no cache object is
  rebuilt and nothing is concatenated per step.
* Each loop iteration admits waiting requests (one batched, chunked prefill of all of them on top of any
  reused session cache), then runs **one decode step** for every row (`miles.engines.runner.DecodeBatch`):
  forward, sampling and logprobs on the device, one host copy of the sampled tokens. On CUDA the step is
  replayed from CUDA graphs captured per batch-size and length bucket.
* Why not transformers' own continuous batching (`generate_batch` / `ContinuousBatchingManager`)? On tiny
  models its fixed overhead dominates (32 requests x 32 tokens: 7.5 s vs 1.2 s for 32 sequential
  `model.generate` calls), and it has no notion of a session's cache to keep between turns.
* **KV reuse across turns**: when a request with a `session_id` ends, its slot (prompt + output, minus the
  last sampled token, which was never fed back) is copied into an LRU `SessionStore`. The next request of
  the session reuses the longest common prefix and only prefills the rest. Weight updates flush the store.
* Sampling is seeded per request and reproducible whatever shares the batch; logprobs are those of the
  distribution sampled from (temperature-scaled, renormalised over what top-k/top-p kept), and a request that
  filters reports each token's kept count in `GenerateResult.kept_counts` (see `miles.engines.sampling`).
* Supported architectures: `miles.engines.decoder.SUPPORTED_MODEL_TYPES` (Llama, Mistral, Qwen2, Qwen3).
* **LoRA adapters** (`update_adapter`, `generate(adapter=...)`): rows of different adapters and of the base
  decode in the same step, each under its own adapter (`miles.engines.lora_bank`). An adapter's requests report
  its own version; loading a new version swaps it between decode steps and touches nothing else; a session's
  cache is reused only under the adapter load it was computed with (`SessionEntry.policy`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from miles.engine import EngineError, FinishReason, GenerateResult, RolloutEngine, SamplingParams
from miles.engines.decoder import check_supported
from miles.engines.errors import InvalidRequestError
from miles.engines.kv import SessionEntry, SessionStore, common_prefix_len
from miles.engines.load import EngineLoad
from miles.engines.lora import AdapterError, AdapterWeights
from miles.engines.lora_bank import BASE_SLOT, LoraDecoder
from miles.engines.metrics import EngineHistograms
from miles.engines.runner import DecodeBatch
from miles.engines.sampling import RowSampling, SampleMode, SamplingTensors, sample, seed_key
from miles.engines.step_lock import StepLock

logger = logging.getLogger(__name__)


def kv_positions(model: Any, device: torch.device, fraction: float, slots: int) -> int:
    """Positions per slot that a KV cache of `slots` slots fits in `fraction` of `device`'s memory. Raises
    `ValueError` (one line naming the fix) for a fraction outside (0, 1] or one that leaves under 2 positions."""
    if not 0 < fraction <= 1:
        raise ValueError(f"kv_cache_fraction must be in (0, 1], got {fraction}")
    cfg, layers = model.config, model.model.layers  # the shapes `Decoder.new_cache` gives the cache
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(layers[0].self_attn.head_dim)
    per_position = (
        len(layers) * 2 * kv_heads * head_dim * model.model.embed_tokens.weight.dtype.itemsize * slots
    )
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    positions = int(fraction * total // per_position)
    if positions < 2:
        raise ValueError(
            f"{fraction} of {total / 2**30:.1f} GiB holds {positions} positions per slot for {slots} "
            f"slots ({per_position} bytes per position); raise it or lower max_batch_size"
        )
    return positions


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


@dataclass
class _Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    session_id: str | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[GenerateResult]
    row: RowSampling
    stop_ids: frozenset[int]
    max_new: int
    start: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    kept_counts: list[int] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    weight_version_start: int = 0
    weights_epoch: int = -1  # the engine's weight load count when its prefill ran
    adapter: str | None = None  # the LoRA adapter it decodes under (None: the base)
    adapter_slot: int = BASE_SLOT
    adapter_epoch: int = -1  # the adapter's load (`ServedAdapter.epoch`) when its prefill ran
    finished: bool = False  # set by the decode thread; the future settles later on the caller's loop

    @property
    def cache_len(self) -> int:
        """Positions of this request in its slot: the prompt and every output token but the last."""
        return len(self.input_ids) + len(self.output_ids) - 1


class EmbeddedEngine(RolloutEngine):
    """A `RolloutEngine` over an in-process transformers causal LM (CPU or CUDA).

    Args:
        model: a `transformers` causal LM (e.g. `Qwen2ForCausalLM`).
        tokenizer: optional; only used to return text from the HTTP server.
        device: where the model runs.
        max_batch_size: the most requests decoding at once; more wait their turn.
        engine_id: reported in every `GenerateResult`.
        stop_at_eos: also stop at the model's `eos_token_id` (as SGLang does unless `ignore_eos`).
        max_cached_sessions: how many sessions' caches are kept for reuse.
        model_path: reported by the server's `/model_info`.
        cuda_graphs: replay decode steps from CUDA graphs when the device is CUDA.
        prefill_tokens: the most tokens (rows x chunk) one prefill forward processes; longer prompts and
            larger groups of joining requests are prefilled in chunks.
        max_loras: the most LoRA adapters served at once (SGLang's `--max-loras-per-batch`).
        max_lora_rank: the largest LoRA rank it takes (SGLang's `--max-lora-rank`).
        kv_cache_fraction: size the KV cache once, to this share of the device's memory (the GPU's total, or the
            host's RAM on a CPU), for `max_batch_size` slots: the context length becomes what fits (at most the
            model's), and the cache never grows. None: start small and grow on demand up to the model's context.

    Raises `UnsupportedModelError` for a model outside `miles.engines.decoder.SUPPORTED_MODEL_TYPES`.
    The model may still be moved or cast (`engine.model.to(...)`) until the first request.
    """

    def __init__(
        self,
        model: Any,
        *,
        tokenizer: Any = None,
        device: str = "cpu",
        max_batch_size: int = 64,
        engine_id: str = "embedded-0",
        stop_at_eos: bool = True,
        max_cached_sessions: int = 1024,
        model_path: str = "",
        cuda_graphs: bool = True,
        prefill_tokens: int = 8192,
        max_loras: int = 8,
        max_lora_rank: int = 64,
        kv_cache_fraction: float | None = None,
    ) -> None:
        check_supported(model)
        if max_batch_size < 1 or prefill_tokens < 1:
            raise ValueError(
                f"max_batch_size ({max_batch_size}) and prefill_tokens ({prefill_tokens}) must be >= 1"
            )
        self.engine_id = engine_id
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda": the current device, by index
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.model_path = model_path
        self.cuda_graphs = cuda_graphs
        self.prefill_tokens = prefill_tokens
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.adapter_sources: dict[str, str] = {}  # loaded adapter -> where it came from (a PEFT folder)
        self._unloading: set[str] = set()
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        self.max_context = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
        self._preallocate = kv_cache_fraction is not None
        if kv_cache_fraction is not None:
            self.max_context = min(
                self.max_context, kv_positions(self.model, self.device, kv_cache_fraction, max_batch_size)
            )
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = getattr(cfg, "eos_token_id", None)
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self._eos_ids = frozenset(eos_ids) if stop_at_eos else frozenset()
        self._version = 0
        self._epoch = 0  # weight loads so far: a cache from an older epoch is never kept
        self._sessions = SessionStore(max_cached_sessions)
        self._decoder: LoraDecoder | None = None  # built at the first request (or adapter)
        self._batch: DecodeBatch | None = None
        self._active: list[_Request] = []  # row i decodes in slot i
        self._pending: list[_Request] = []
        self._rids: set[str] = set()
        self._aborts: set[str] = set()
        self._abort_all = False
        self._paused = False
        self._cond = threading.Condition()
        self._model_lock = StepLock()
        self._closed = False
        self._keys = random.Random(os.urandom(8))  # random streams of unseeded requests
        self.stats = {"steps": 0, "prefill_tokens": 0, "cached_tokens": 0, "decode_tokens": 0, "pauses": 0}
        self.histograms = EngineHistograms()
        self._thread = threading.Thread(target=self._run, name=f"{engine_id}-decode", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, path_or_name: str, **kwargs: Any) -> EmbeddedEngine:
        """Load an HF checkpoint folder, or `"tiny"` for the project's tiny model and tokenizer."""
        if path_or_name == "tiny":
            from miles.tiny import load_tiny_tokenizer, make_tiny_model

            tokenizer = load_tiny_tokenizer()
            model = make_tiny_model(vocab_size=len(tokenizer))
            kwargs.setdefault("model_path", "tiny")
            return cls(model, tokenizer=tokenizer, **kwargs)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not Path(path_or_name).is_dir():
            raise InvalidRequestError(f"model path {path_or_name!r} is not a folder (or 'tiny')")
        model = AutoModelForCausalLM.from_pretrained(path_or_name)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path_or_name)
        except (OSError, ValueError):
            tokenizer = None
        kwargs.setdefault("model_path", path_or_name)
        return cls(model, tokenizer=tokenizer, **kwargs)

    # ------------------------------------------------------------------ RolloutEngine
    @property
    def weight_version(self) -> int:
        return self._version

    async def health(self) -> bool:
        return not self._closed and self._thread.is_alive()

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams,
        *,
        session_id: str | None = None,
        rid: str | None = None,
        adapter: str | None = None,
        ignore_eos: bool = False,
    ) -> GenerateResult:
        """Continue `input_ids` (under LoRA adapter `adapter`, which must be loaded); `ignore_eos` disables the
        model's EOS as an implicit stop token."""
        if self._closed:
            raise EngineError("engine is closed", engine_id=self.engine_id)
        if adapter is not None and (adapter not in self.adapter_sources or adapter in self._unloading):
            raise AdapterError(
                f"no LoRA adapter {adapter!r} is loaded (loaded: "
                f"{sorted(set(self.adapter_sources) - self._unloading) or 'none'})",
                engine_id=self.engine_id,
            )
        req = self._make_request(
            list(input_ids), sampling_params, session_id, rid or uuid.uuid4().hex, ignore_eos
        )
        if adapter is not None:
            req.adapter, req.weight_version_start = adapter, self.adapter_version(adapter) or 0
        with self._cond:
            if req.rid in self._rids:
                raise InvalidRequestError(
                    f"request id {req.rid!r} is already running", engine_id=self.engine_id
                )
            self._rids.add(req.rid)
            self._pending.append(req)
            self._cond.notify()
        try:
            return await asyncio.shield(req.future)
        except asyncio.CancelledError:
            req.future.add_done_callback(
                _retrieve
            )  # nobody awaits it now: an abort or close error is expected
            await self.abort(req.rid)
            raise

    async def abort(self, rid: str) -> None:
        with self._cond:
            self._aborts.add(rid)
            self._cond.notify()

    async def abort_all(self) -> None:
        """Abort every waiting and running request."""
        with self._cond:
            self._abort_all = True
            self._cond.notify()

    async def pause_generation(self) -> None:
        """Stop decoding after the step in progress; requests in flight keep their rows and caches, new ones
        wait, aborts still land. Returns once no step runs."""
        with self._cond:
            self._paused = True
            self.stats["pauses"] += 1
        await asyncio.to_thread(self._wait_for_step)

    def _wait_for_step(self) -> None:
        with self._model_lock.exclusive():
            pass

    async def continue_generation(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify()

    @property
    def paused(self) -> bool:
        """Whether decoding is held by `pause_generation`."""
        return self._paused

    async def update_weights(
        self, *, state_dict: dict[str, Any] | None = None, path: str | None = None, version: int | None = None
    ) -> int:
        """Load weights (a subset of the model's parameters is fine) between decode steps.

        `version` sets the new version explicitly; by default it is the old one plus 1.
        Raises `InvalidRequestError` for unknown names, wrong shapes or an unreadable folder.
        """
        if (state_dict is None) == (path is None):
            raise InvalidRequestError("pass exactly one of state_dict= or path=", engine_id=self.engine_id)
        if path is not None:
            state_dict = await asyncio.to_thread(load_state_dict_from_folder, path)
        return await asyncio.to_thread(self._load_weights, state_dict, version)

    def load_weights_sync(self, named_tensors: dict[str, torch.Tensor], version: int | None = None) -> int:
        """Thread-safe synchronous weight load (used by the distributed weight receiver)."""
        return self._load_weights(named_tensors, version)

    async def update_adapter(
        self,
        name: str,
        *,
        weights: AdapterWeights | None = None,
        path: str | None = None,
        version: int | None = None,
    ) -> int:
        """Load LoRA adapter `name` (in memory, or the PEFT folder at `path`) as version `version` (default: its
        current version plus 1, or 0). Between decode steps: requests of `name` in flight go on under the new
        version (their tokens' versions say so); other adapters and the base are untouched. Raises
        `AdapterError` (an `InvalidRequestError`) for an adapter that does not fit."""
        if (weights is None) == (path is None):
            raise InvalidRequestError("pass exactly one of weights= or path=", engine_id=self.engine_id)
        if path is not None:
            weights = await asyncio.to_thread(AdapterWeights.load, path)
        return await asyncio.to_thread(self._load_adapter, name, weights, version, path or "in memory")

    def _load_adapter(self, name: str, weights: AdapterWeights, version: int | None, source: str) -> int:
        with self._model_lock.exclusive(), torch.inference_mode():
            batch = self._ready_batch()
            bank = self._decoder.bank
            enabled, current = bank.enabled, bank.get(name)
            new = (0 if current is None else current.version + 1) if version is None else int(version)
            bank.load(name, weights, new)
            if not enabled:  # steps captured so far never run the adapter math
                batch.drop_graphs()
            self.adapter_sources[name] = source
            return new

    async def unload_adapter(self, name: str) -> None:
        """Stop taking requests for adapter `name`, wait for those in flight, then free its slot."""
        if name not in self.adapter_sources:
            raise AdapterError(f"no LoRA adapter {name!r} is loaded", engine_id=self.engine_id)
        self._unloading.add(name)
        try:
            while self._serving(name):
                await asyncio.sleep(0.005)
            await asyncio.to_thread(self._unload_adapter, name)
        finally:
            self._unloading.discard(name)

    def _serving(self, name: str) -> bool:
        with self._cond:
            return any(r.adapter == name and not r.finished for r in [*self._pending, *self._active])

    def _unload_adapter(self, name: str) -> None:
        with self._model_lock.exclusive(), torch.inference_mode():
            self._decoder.bank.unload(name)
            del self.adapter_sources[name]

    def adapter_version(self, name: str) -> int | None:
        """The version of loaded adapter `name` (None: not loaded)."""
        served = None if self._decoder is None else self._decoder.bank.get(name)
        return None if served is None else served.version

    def _policy_version(self, req: _Request) -> int:
        """The version `req`'s tokens are made under now: its adapter's, or the base's."""
        return self._version if req.adapter is None else self._decoder.bank.get(req.adapter).version

    async def flush_cache(self) -> None:
        """Drop every session's kept cache."""
        with self._model_lock.exclusive():
            self._sessions.clear()

    async def close(self) -> None:
        if self._closed:
            return
        with self._cond:
            self._closed = True
            self._cond.notify()
        await asyncio.to_thread(self._thread.join, 10.0)

    @property
    def num_active(self) -> int:
        return len(self._active) + len(self._pending)

    async def load(self) -> EngineLoad:
        """Requests decoding here, and requests not decoding yet (waiting or in their prefill)."""
        return self.load_now()

    def load_now(self) -> EngineLoad:
        """`load()` for callers without an event loop (metrics read at scrape time)."""
        with self._cond:  # a finished request may linger in `_active` for a moment: count unresolved rids
            rids = set(self._rids)
            active = [r for r in self._active if r.rid in rids]
            running = sum(not r.finished for r in active)
            return EngineLoad(running=running, waiting=len(rids) - len(active))

    @property
    def num_in_flight(self) -> int:
        return self.num_active

    # ------------------------------------------------------------------ request setup
    def _make_request(
        self, input_ids: list[int], params: SamplingParams, session_id: str | None, rid: str, ignore_eos: bool
    ) -> _Request:
        if not input_ids:
            raise InvalidRequestError("input_ids is empty", engine_id=self.engine_id)
        bad = [t for t in input_ids if not isinstance(t, int) or t < 0 or t >= self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}",
                engine_id=self.engine_id,
            )
        if len(input_ids) >= self.max_context:
            raise InvalidRequestError(
                f"prompt of {len(input_ids)} tokens does not fit the context of {self.max_context}",
                engine_id=self.engine_id,
            )
        if params.max_new_tokens < 1:
            raise InvalidRequestError("max_new_tokens must be >= 1", engine_id=self.engine_id)
        if params.temperature < 0 or not 0 < params.top_p <= 1:
            raise InvalidRequestError(
                f"bad temperature/top_p: {params.temperature}, {params.top_p}", engine_id=self.engine_id
            )
        key = seed_key(params.seed) if params.seed is not None else self._keys.getrandbits(32)
        row = RowSampling(params.temperature, params.top_p, params.top_k, key)
        loop = asyncio.get_running_loop()
        return _Request(
            rid=rid,
            input_ids=input_ids,
            params=params,
            session_id=session_id,
            loop=loop,
            future=loop.create_future(),
            row=row,
            stop_ids=frozenset(params.stop_token_ids) | (frozenset() if ignore_eos else self._eos_ids),
            max_new=min(params.max_new_tokens, self.max_context - len(input_ids)),
            weight_version_start=self._version,
        )

    # ------------------------------------------------------------------ weights
    def _load_weights(self, named: dict[str, Any], version: int | None) -> int:
        params = self.model.state_dict(keep_vars=True)  # tied weights appear under every name
        unknown = [n for n in named if n not in params]
        if unknown:
            raise InvalidRequestError(f"unknown parameter names: {unknown[:5]}", engine_id=self.engine_id)
        for name, tensor in named.items():
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise InvalidRequestError(
                    f"shape of {name}: got {tuple(tensor.shape)}, expected {tuple(params[name].shape)}",
                    engine_id=self.engine_id,
                )
        with self._model_lock.exclusive(), torch.no_grad():
            for name, tensor in named.items():
                params[name].copy_(torch.as_tensor(tensor).to(params[name].dtype))
            if self._decoder is not None:
                self._decoder.refresh_weights()
            self._version = self._version + 1 if version is None else int(version)
            self._epoch += 1
            self._sessions.clear()
            return self._version

    # ------------------------------------------------------------------ the decode loop (thread)
    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # graphs capture on the thread's current device
        while True:
            with self._cond:
                while not (
                    self._closed
                    or self._aborts
                    or self._abort_all
                    or (not self._paused and (self._pending or self._active))
                ):
                    self._cond.wait()
                if self._closed:
                    break
                paused = self._paused
                room = 0 if paused else self.max_batch_size - len(self._active)
                new, self._pending = self._pending[: max(room, 0)], self._pending[max(room, 0) :]
                aborts, self._aborts = self._aborts, set()
                abort_all, self._abort_all = self._abort_all, False
            try:
                with self._model_lock.step(), torch.inference_mode():
                    self._handle_aborts(new, aborts, abort_all)
                    self._admit([r for r in new if not r.finished])
                    if self._active and not paused:
                        self._step()
            except Exception as exc:  # never let one bad step kill the loop
                logger.exception("decode step failed")
                self._fail_all(new, EngineError(f"decode step failed: {exc!r}", engine_id=self.engine_id))
        self._fail_all([], EngineError("engine is closed", engine_id=self.engine_id))

    def _handle_aborts(self, new: list[_Request], aborts: set[str], abort_all: bool) -> None:
        if not aborts and not abort_all:
            return
        with self._cond:
            waiting = list(self._pending)
        for req in new + waiting:
            if abort_all or req.rid in aborts:
                self._finish(req, FinishReason.ABORT)
        if waiting:
            with self._cond:
                self._pending = [r for r in self._pending if not r.finished]
        doomed = [i for i, r in enumerate(self._active) if abort_all or r.rid in aborts]
        if doomed:
            self._drop_rows(doomed, FinishReason.ABORT)

    def _ready_batch(self) -> DecodeBatch:
        if self._batch is None:
            static = self.cuda_graphs and self.device.type == "cuda"  # graphs: the adapter math is always in
            self._decoder = LoraDecoder(
                self.model,
                max_slots=self.max_batch_size,
                max_adapters=self.max_loras,
                max_rank=self.max_lora_rank,
                static=static,
            )
            length = min(self.max_context, self._decoder.max_positions)
            cache = self._decoder.new_cache(
                self.max_batch_size, length, initial_len=length if self._preallocate else None
            )
            self._batch = DecodeBatch(self._decoder, cache, self.max_batch_size, cuda_graphs=self.cuda_graphs)
        return self._batch

    def _admit(self, new: list[_Request]) -> None:
        """Prefill `new` into the slots after the active rows and make them decode from the next step."""
        if not new:
            return
        batch = self._ready_batch()
        batch.grow(max(len(r.input_ids) for r in new) + 1)
        first = len(self._active)
        for req in new:
            if req.adapter is not None:
                served = self._decoder.bank.get(req.adapter)
                req.adapter_slot, req.adapter_epoch = served.slot, served.epoch
        kept = [self._reusable(req) for req in new]
        order = sorted(range(len(new)), key=lambda i: len(new[i].input_ids) - kept[i][1], reverse=True)
        new = [
            new[i] for i in order
        ]  # longest suffix first, so the rows of each prefill chunk are a run of slots
        reused = []
        for slot, i in enumerate(order, start=first):
            entry, m = kept[i]
            if m:
                batch.cache.load(slot, entry.kv, m)
            reused.append(m)
        self._decoder.bank.select([r.adapter_slot for r in [*self._active, *new]])
        logits = self._prefill(new, reused, first)
        rows = [r.row for r in new]
        tokens, logprobs, kept = sample(
            logits, SamplingTensors.build(rows, [0] * len(new), self.device), SampleMode.of(rows)
        )
        batch.join(first, tokens, [len(r.input_ids) for r in new], rows, [1] * len(new))
        now = time.perf_counter()
        for req, tok, lp, k in zip(new, tokens.tolist(), logprobs.tolist(), kept.tolist(), strict=True):
            self.histograms.first_token.observe(now - req.start)
            req.output_ids.append(tok)
            req.output_logprobs.append(lp)
            req.kept_counts.append(k)
            req.token_versions.append(self._policy_version(req))
        for req in new:
            req.weights_epoch = self._epoch
        self._active.extend(new)
        done = [first + i for i, req in enumerate(new) if self._check_finished(req)]
        if done:
            self._drop_rows(done, None)

    def _reusable(self, req: _Request) -> tuple[SessionEntry | None, int]:
        """Take `req`'s session cache and say how many of its positions `req` can reuse."""
        m = 0
        entry = self._sessions.take(req.session_id) if req.session_id is not None else None
        if entry is not None and entry.policy == self._cache_policy(req):
            m = min(common_prefix_len(entry.tokens, req.input_ids), len(req.input_ids) - 1)
        req.cached_tokens = m
        self.stats["cached_tokens"] += m
        self.stats["prefill_tokens"] += len(req.input_ids) - m
        return entry, m

    @staticmethod
    def _cache_policy(req: _Request) -> tuple[str, int] | None:
        """What `req`'s KV depends on besides the base weights: its adapter's load (None for the base)."""
        return None if req.adapter is None else (req.adapter, req.adapter_epoch)

    def _prefill(self, new: list[_Request], reused: list[int], first: int) -> torch.Tensor:
        """Run the uncached tokens of `new` (slots `first ..`, longest suffix first) in chunks of at most
        `prefill_tokens` tokens; returns the logits at each request's last prompt token, in order."""
        decoder, cache, device = self._decoder, self._batch.cache, self.device
        suffix = [len(r.input_ids) - m for r, m in zip(new, reused, strict=True)]
        out: list[torch.Tensor | None] = [None] * len(new)
        start = 0
        while start < len(new):  # a group of rows, then its chunks
            width = min(suffix[start], self.prefill_tokens)
            end = min(len(new), start + max(1, self.prefill_tokens // width))
            for offset in range(0, suffix[start], width):
                rows = [i for i in range(start, end) if suffix[i] > offset]  # a prefix: suffixes descend
                seq = min(width, suffix[rows[0]] - offset)
                ids = torch.zeros((len(rows), seq), dtype=torch.int64)
                pos = torch.zeros((len(rows), seq), dtype=torch.int64)
                write, last, length = [], [], 0
                for j, i in enumerate(rows):
                    lo = reused[i] + offset
                    hi = min(len(new[i].input_ids), lo + seq)
                    ids[j, : hi - lo] = torch.tensor(new[i].input_ids[lo:hi])
                    pos[j, : hi - lo] = torch.arange(lo, hi)
                    write.extend(range(j * seq, j * seq + hi - lo))
                    if hi == len(new[i].input_ids):
                        last.append((i, j * seq + hi - lo - 1))
                    length = max(length, hi)
                logits = decoder.forward(
                    cache,
                    ids.to(device),
                    pos.to(device),
                    first + start,
                    length,
                    write=torch.tensor(write, dtype=torch.int64, device=device),
                    last=torch.tensor([t for _, t in last], dtype=torch.int64, device=device),
                )
                for (i, _), row in zip(last, logits, strict=True):
                    out[i] = row
            start = end
        return torch.stack(out)

    def _step(self) -> None:
        batch = self._batch
        active = self._active
        length = max(r.cache_len for r in active) + 1
        batch.grow(length)
        self._decoder.bank.select([r.adapter_slot for r in active])
        tokens, logprobs, kept = batch.step(
            len(active),
            length,
            SampleMode.of(r.row for r in active),
            lengths=[r.cache_len + 1 for r in active],
        )
        self.stats["steps"] += 1
        self.histograms.batch_size.observe(len(tokens))
        self.stats["decode_tokens"] += len(tokens)
        versions = {r.adapter: self._policy_version(r) for r in active}
        done = []
        for i, (req, tok, lp, k) in enumerate(zip(active, tokens, logprobs, kept, strict=True)):
            req.output_ids.append(tok)
            req.output_logprobs.append(lp)
            req.kept_counts.append(k)
            req.token_versions.append(versions[req.adapter])
            if tok in req.stop_ids or len(req.output_ids) >= req.max_new:
                done.append(i)
        if done:
            self._drop_rows(done, None)

    def _check_finished(self, req: _Request) -> bool:
        return req.output_ids[-1] in req.stop_ids or len(req.output_ids) >= req.max_new

    def _finish_reason(self, req: _Request) -> FinishReason:
        return (
            FinishReason.STOP
            if req.output_ids and req.output_ids[-1] in req.stop_ids
            else FinishReason.LENGTH
        )

    def _drop_rows(self, indices: list[int], reason: FinishReason | None) -> None:
        """Finish the rows `indices` and pack the rest into slots `0 .. n-1` (the last rows fill the holes)."""
        batch = self._batch
        for i in indices:
            req = self._active[i]
            if (
                req.session_id is not None
                and not req.finished
                and req.weights_epoch == self._epoch
                and (req.adapter is None or self._decoder.bank.get(req.adapter).epoch == req.adapter_epoch)
            ):
                covered = req.input_ids + req.output_ids[:-1]
                self._sessions.put(
                    req.session_id,
                    covered,
                    batch.cache.export(i, len(covered)),
                    policy=self._cache_policy(req),
                )
            self._finish(req, reason or self._finish_reason(req))
        n = len(self._active)
        gone = set(indices)
        kept = n - len(gone)
        holes = sorted(i for i in gone if i < kept)
        movers = [j for j in range(kept, n) if j not in gone]
        if movers:
            batch.move(movers, holes, max(self._active[j].cache_len for j in movers))
            for hole, mover in zip(holes, movers, strict=True):
                self._active[hole] = self._active[mover]
        del self._active[kept:]
        batch.release(kept, n)

    def _finish(self, req: _Request, reason: FinishReason) -> None:
        if req.finished:
            return
        req.finished = True
        result = GenerateResult(
            output_ids=list(req.output_ids),
            output_logprobs=list(req.output_logprobs),
            finish_reason=reason,
            weight_version=self._policy_version(req),
            prompt_tokens=len(req.input_ids),
            cached_tokens=req.cached_tokens,
            latency_s=time.perf_counter() - req.start,
            engine_id=self.engine_id,
            extra={"rid": req.rid, "weight_version_start": req.weight_version_start},
            token_versions=list(req.token_versions),
            kept_counts=list(req.kept_counts) if req.row.filters else None,
        )
        self._resolve(req, result)

    def _resolve(self, req: _Request, outcome: GenerateResult | BaseException) -> None:
        req.finished = True
        with self._cond:
            self._rids.discard(req.rid)

        def settle() -> None:
            if req.future.done():
                return
            if isinstance(outcome, BaseException):
                req.future.set_exception(outcome)
            else:
                req.future.set_result(outcome)

        with contextlib.suppress(RuntimeError):  # the caller's loop is gone: nobody is waiting
            req.loop.call_soon_threadsafe(settle)

    def _fail_all(self, extra: list[_Request], error: EngineError) -> None:
        with self._cond:
            victims = extra + self._active + self._pending
            self._pending = []
        for req in victims:
            self._resolve(req, error)
        if self._batch is not None:
            with torch.inference_mode():
                self._batch.release(0, self._batch.max_batch)
        self._active = []


def _read_weights(f: Path) -> Any:
    if f.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(f))
    return torch.load(f, map_location="cpu", weights_only=True)  # tensors only: no code runs while it loads


def load_state_dict_from_folder(path: str) -> dict[str, torch.Tensor]:
    """Read the weights of an HF checkpoint folder (`*.safetensors`, else `pytorch_model*.bin`)."""
    folder = Path(path)
    if not folder.is_dir():
        raise InvalidRequestError(f"weights folder {path!r} does not exist")
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        raise InvalidRequestError(f"no *.safetensors or pytorch_model*.bin in {path!r}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors = _read_weights(f)
        except Exception as exc:  # a truncated or forged file, a pickle with more than tensors in it
            raise InvalidRequestError(
                f"cannot read the weights file {f.name}: {type(exc).__name__}: {str(exc).strip()[:200]}"
            ) from None
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise InvalidRequestError(f"{f.name} does not hold a mapping of names to tensors")
        out.update(tensors)
    return out
