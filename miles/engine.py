"""The `RolloutEngine` contract: token ids in, token ids and their logprobs out."""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any, Protocol

#: The `policy_id` of the base model (no LoRA adapter); any other policy id names an adapter.
BASE_POLICY = "base"


class LoraAdapter(Protocol):
    """A LoRA adapter as the contract names it: its rank, scaling and size. Engines take
    `miles.engines.lora.AdapterWeights` (PEFT's settings and tensors), the one implementation."""

    @property
    def rank(self) -> int: ...

    @property
    def scaling(self) -> float: ...

    @property
    def num_bytes(self) -> int: ...


#: Below this a temperature is greedy decoding: dividing logits by a denormal overflows them to inf.
MIN_TEMPERATURE = 1e-5
#: No model's context is this long; a larger `max_new_tokens` is a mistake, not a budget.
MAX_NEW_TOKENS = 1 << 24


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings for one generate call, checked when built (a `ValueError` names the bad field, so one
    request's bad settings fail that request alone, never the batch it would have joined).

    `top_k <= 0` and `top_p >= 1` disable those filters; `temperature == 0` is greedy decoding, and so is any
    temperature below `MIN_TEMPERATURE`. Engines cap `max_new_tokens` at what their context leaves.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        def number(name: str, value: Any) -> float:
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or value != value
                or value in (float("inf"), float("-inf"))
            ):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            return float(value)

        temperature = number("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature!r}")
        object.__setattr__(self, "temperature", 0.0 if temperature < MIN_TEMPERATURE else temperature)
        top_p = number("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        for name in ("top_k", "max_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not 0 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ValueError(f"max_new_tokens must be in [0, {MAX_NEW_TOKENS}], got {self.max_new_tokens}")
        if not -1 <= self.top_k < 1 << 31:  # a device tensor holds it; any k above the vocabulary keeps all
            raise ValueError(
                f"top_k must be -1 (all), 0 (all) or a positive count below 2**31, got {self.top_k}"
            )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d

    def updated(self, overrides: Mapping[str, Any]) -> SamplingParams:
        """These params with `overrides` (e.g. a task's own `max_new_tokens`); unknown names raise ValueError."""
        unknown = sorted(set(overrides) - {f.name for f in fields(self)})
        if unknown:
            raise ValueError(
                f"unknown sampling parameters {unknown}; known: {sorted(f.name for f in fields(self))}"
            )
        data = {**self.to_dict(), **dict(overrides)}
        return SamplingParams.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        data = dict(data)
        data["stop_token_ids"] = tuple(data.get("stop_token_ids") or ())
        return cls(**data)


class FinishReason(str, Enum):
    """Why generation stopped: a stop token, the token budget, or an abort."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass
class GenerateResult:
    """What one generate call produced. `output_logprobs[i]` is the logprob of `output_ids[i]`.

    `weight_version` is the version the call finished under; `token_versions[i]`, when the engine reports it,
    the version that produced `output_ids[i]` (a call can span a weight update that lands between decode steps).

    Under top-k/top-p sampling `output_logprobs[i]` is the logprob under the distribution sampled from
    (renormalised over the tokens the filter kept), and `kept_counts[i]`, when the engine reports it, how many
    tokens the filter kept when `output_ids[i]` was drawn (0: the whole vocabulary); a trainer renormalises over
    its own `kept_counts[i]` largest logits to reproduce the logprob (sampling-mask replay). None: the engine
    reports no kept set (no filter, or an engine that cannot tell).
    """

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    latency_s: float = 0.0
    engine_id: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    token_versions: list[int] | None = None
    kept_counts: list[int] | None = None

    def __post_init__(self) -> None:
        if len(self.output_ids) != len(self.output_logprobs):
            raise ValueError(
                f"output_ids ({len(self.output_ids)}) and output_logprobs ({len(self.output_logprobs)}) differ in length"
            )
        if self.token_versions is not None and len(self.token_versions) != len(self.output_ids):
            raise ValueError(
                f"output_ids ({len(self.output_ids)}) and token_versions ({len(self.token_versions)}) "
                "differ in length"
            )
        if self.kept_counts is not None and len(self.kept_counts) != len(self.output_ids):
            raise ValueError(
                f"output_ids ({len(self.output_ids)}) and kept_counts ({len(self.kept_counts)}) differ in length"
            )


class EngineError(RuntimeError):
    """An infrastructure failure (connection refused, 5xx, dead engine). Callers may retry it."""

    def __init__(self, message: str, *, engine_id: str = "", retryable: bool = True) -> None:
        super().__init__(message)
        self.engine_id = engine_id
        self.retryable = retryable


class RolloutEngine(abc.ABC):
    """An async generator of token ids. SGLang servers, the embedded engine and routers implement it."""

    engine_id: str = ""

    @abc.abstractmethod
    async def generate(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams,
        *,
        session_id: str | None = None,
        rid: str | None = None,
        adapter: str | None = None,
    ) -> GenerateResult:
        """Continue `input_ids` under the base model, or under LoRA adapter `adapter` (then the result's
        `weight_version` and `token_versions` are that adapter's versions). Raises `EngineError` on
        infrastructure failure."""

    @abc.abstractmethod
    async def abort(self, rid: str) -> None:
        """Stop the request `rid` if it is still running; its generate call returns with `FinishReason.ABORT`."""

    @abc.abstractmethod
    async def health(self) -> bool:
        """True when the engine can serve a generate call now."""

    @abc.abstractmethod
    async def update_weights(
        self, *, state_dict: dict[str, Any] | None = None, path: str | None = None, version: int | None = None
    ) -> int:
        """Load new weights from an in-memory HF-layout state dict or from an HF checkpoint folder.

        `version` sets the new weight version (default: the current one plus 1). Returns the new version.
        """

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """The version of the weights that the next generate call will use."""

    async def update_adapter(
        self,
        name: str,
        *,
        weights: LoraAdapter | None = None,
        path: str | None = None,
        version: int | None = None,
    ) -> int:
        """Load LoRA adapter `name` (in memory, or a PEFT folder at `path`), replacing the one of that name
        without draining anything: requests in flight finish (or, where the engine swaps between decode steps,
        go on) while the other adapters and the base are untouched. `version` sets the adapter's own version
        (default: its current one plus 1). Returns the new version. Engines without LoRA raise `EngineError`."""
        raise EngineError(
            f"{type(self).__name__} serves no LoRA adapters", engine_id=self.engine_id, retryable=False
        )

    async def pause_generation(self) -> None:
        """Stop decoding until `continue_generation`: requests in flight keep their state (SGLang's
        `in_place` pause), new ones wait, and weights load meanwhile without waiting for them. The default does
        nothing, for engines that swap weights between decode steps on their own."""
        return None

    async def continue_generation(self) -> None:
        """Resume decoding after `pause_generation`; requests in flight go on under the weights loaded since."""
        return None

    @property
    def num_in_flight(self) -> int:
        """Generate calls made through this object that have not returned yet (0 when not tracked)."""
        return 0

    async def close(self) -> None:
        """Release connections, threads or models. Idempotent."""
        return None

    async def __aenter__(self) -> RolloutEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
