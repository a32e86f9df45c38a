"""SGLang's native HTTP wire format, both directions, in one place.

Field names follow SGLang 0.5.x: `GenerateReqInput`, `AbortReq`, `UpdateWeightFromDiskReqInput`,
`InitWeightsUpdateGroupReqInput`, `UpdateWeightsFromDistributedReqInput` (sglang/srt/managers/io_struct.py),
`SamplingParams` (sglang/srt/sampling/sampling_params.py), and the response built in tokenizer_manager.py:
`{"text", "output_ids", "meta_info": {"id", "finish_reason": {"type", ...}, "prompt_tokens",
"completion_tokens", "cached_tokens", "weight_version", "output_token_logprobs": [[logprob, id, text]]}}`.

Sampling-mask replay over the wire: the embedded server adds `meta_info["miles_kept_counts"]` (one top-k/top-p
kept count per output token, `GenerateResult.kept_counts`; its logprobs are then those of the renormalised
distribution) and the client reads it back. SGLang sends no such field: its `output_token_logprobs` are taken
before top-k/top-p, and its own `return_sampling_mask` (support token ids per token) is refused unless
`1 < top_k <= --sampling-mask-max-tokens`, so top-p-only requests cannot ask for it; the client does not, and
tokens from SGLang train over the whole vocabulary (no replay).
"""

from __future__ import annotations

from typing import Any

from miles.engine import FinishReason, GenerateResult, SamplingParams
from miles.engines.errors import InvalidRequestError

TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary" top_k
ROUTING_KEY_HEADER = "x-smg-routing-key"  # sglang-router's header for sticky (manual policy) routing
SESSION_HEADER = "x-miles-session-id"  # lets the embedded server keep a session's KV cache between turns
PAUSE_MODES = ("in_place", "retract", "abort")  # SGLang's PauseGenerationReqInput.mode
KEPT_COUNTS_FIELD = "miles_kept_counts"  # the embedded server's meta_info extra: top-k/top-p kept counts


# ---------------------------------------------------------------------------- requests (client side)
def sampling_params_body(params: SamplingParams) -> dict[str, Any]:
    """`SamplingParams` -> SGLang's `sampling_params` dict."""
    body: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "max_new_tokens": params.max_new_tokens,
    }
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None:
        body["sampling_seed"] = int(params.seed)
    return body


def generate_body(
    input_ids: list[int], params: SamplingParams, *, rid: str, lora_path: str | None = None
) -> dict[str, Any]:
    """The JSON body of `POST /generate` (a `GenerateReqInput`)."""
    body: dict[str, Any] = {
        "rid": rid,
        "input_ids": list(input_ids),
        "sampling_params": sampling_params_body(params),
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "return_text_in_logprobs": False,
        "stream": False,
    }
    if lora_path is not None:
        body["lora_path"] = lora_path
    return body


def load_lora_body(lora_name: str, lora_path: str) -> dict[str, Any]:
    """The JSON body of `POST /load_lora_adapter` (a `LoadLoRAAdapterReqInput`): load the PEFT folder at
    `lora_path` (a path the server can read) under `lora_name`, the name generate calls then pass as `lora_path`."""
    return {"lora_name": lora_name, "lora_path": str(lora_path), "pinned": False}


def unload_lora_body(lora_name: str) -> dict[str, Any]:
    """The JSON body of `POST /unload_lora_adapter` (an `UnloadLoRAAdapterReqInput`)."""
    return {"lora_name": lora_name}


def lora_update_response(
    success: bool, *, error: str | None = None, loaded: dict[str, str] | None = None
) -> dict[str, Any]:
    """SGLang's answer to the LoRA endpoints (a `LoRAUpdateOutput`): 200 on success, 400 otherwise."""
    return {"success": success, "error_message": error, "loaded_adapters": loaded}


def abort_body(rid: str | None = None, *, abort_all: bool = False) -> dict[str, Any]:
    """The JSON body of `POST /abort_request` (an `AbortReq`)."""
    return {"rid": rid or "", "abort_all": abort_all}


def pause_body(mode: str = "in_place") -> dict[str, Any]:
    """The JSON body of `POST /pause_generation` (a `PauseGenerationReqInput`): `in_place` keeps the requests in
    flight, with their KV, until `/continue_generation`; `retract` requeues them; `abort` ends them."""
    if mode not in PAUSE_MODES:
        raise InvalidRequestError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
    return {"mode": mode}


def continue_body() -> dict[str, Any]:
    """The JSON body of `POST /continue_generation` (a `ContinueGenerationReqInput`)."""
    return {"torch_empty_cache": True}


def update_from_disk_body(model_path: str, *, weight_version: int | None = None) -> dict[str, Any]:
    """The JSON body of `POST /update_weights_from_disk`."""
    body: dict[str, Any] = {"model_path": model_path, "flush_cache": True, "abort_all_requests": False}
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    return body


def init_group_body(
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    *,
    group_name: str = "weight_update_group",
    backend: str = "nccl",
) -> dict[str, Any]:
    """The JSON body of `POST /init_weights_update_group`."""
    return {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": int(rank_offset),
        "world_size": int(world_size),
        "group_name": group_name,
        "backend": backend,
    }


def update_distributed_body(
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    *,
    group_name: str = "weight_update_group",
    weight_version: int | None = None,
    flush_cache: bool = True,
    load_format: str | None = None,
) -> dict[str, Any]:
    """The JSON body of `POST /update_weights_from_distributed` (`load_format="flattened_bucket"`: the tensors
    travel as one flat uint8 broadcast)."""
    body: dict[str, Any] = {
        "names": list(names),
        "dtypes": list(dtypes),
        "shapes": [list(s) for s in shapes],
        "group_name": group_name,
        "flush_cache": flush_cache,
    }
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    if load_format is not None:
        body["load_format"] = load_format
    return body


# ---------------------------------------------------------------------------- responses (client side)
_FINISH_TYPES = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def parse_weight_version(value: Any) -> int | None:
    """SGLang reports `weight_version` as a string ("default" until one is set)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def _as_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError(f"expected an integer, got {value!r}")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"expected an integer, got {value!r}")
    return int(value)


class WireFormatError(InvalidRequestError):
    """A response that does not have SGLang's shape."""


def parse_generate_response(data: Any, *, engine_id: str = "", fallback_version: int = 0) -> GenerateResult:
    """A `/generate` response -> `GenerateResult` (tokens and logprobs from `output_token_logprobs`)."""
    if not isinstance(data, dict) or not isinstance(data.get("meta_info"), dict):
        raise WireFormatError(f"not a /generate response: {str(data)[:200]}", engine_id=engine_id)
    meta = data["meta_info"]
    triples = meta.get("output_token_logprobs")
    if not isinstance(triples, list):
        raise WireFormatError(
            "meta_info.output_token_logprobs is missing (was return_logprob sent?)", engine_id=engine_id
        )
    if not all(isinstance(t, list | tuple) and len(t) >= 2 for t in triples):
        raise WireFormatError(
            "output_token_logprobs entries must be [logprob, token_id, text]", engine_id=engine_id
        )
    try:
        ids = [_as_int(t[1]) for t in triples]
        logprobs = [float(t[0]) for t in triples]
        prompt_tokens = _as_int(meta.get("prompt_tokens") or 0)
        cached_tokens = _as_int(meta.get("cached_tokens") or 0)
        latency = float(meta.get("e2e_latency") or 0.0)
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireFormatError(f"bad /generate response field: {exc}", engine_id=engine_id) from exc
    output_ids = data.get("output_ids")
    if isinstance(output_ids, list) and output_ids and output_ids != ids:
        raise WireFormatError("output_ids and output_token_logprobs disagree", engine_id=engine_id)
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if not isinstance(kind, str) or kind not in _FINISH_TYPES:
        raise WireFormatError(f"unknown finish_reason {fr!r}", engine_id=engine_id)
    version = parse_weight_version(meta.get("weight_version"))
    kept = meta.get(KEPT_COUNTS_FIELD)
    if kept is not None:
        if not isinstance(kept, list) or len(kept) != len(ids):
            raise WireFormatError(
                f"meta_info.{KEPT_COUNTS_FIELD} must hold one count per token", engine_id=engine_id
            )
        try:
            kept = [_as_int(k) for k in kept]
        except (TypeError, ValueError, OverflowError) as exc:
            raise WireFormatError(f"bad {KEPT_COUNTS_FIELD}: {exc}", engine_id=engine_id) from exc
    return GenerateResult(
        output_ids=ids,
        output_logprobs=logprobs,
        finish_reason=_FINISH_TYPES[kind],
        weight_version=fallback_version if version is None else version,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        latency_s=latency,
        engine_id=engine_id,
        extra={"rid": meta.get("id"), "finish_reason": fr, "text": data.get("text")},
        kept_counts=kept,
    )


# ---------------------------------------------------------------------------- server side
# GenerateReqInput fields the embedded server understands; everything else must keep SGLang's default.
_IGNORED_GENERATE_FIELDS = {
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "log_metrics",
    "session_params",
    "routing_key",
    "conversation_id",
    "priority",
    "custom_labels",
    "no_logs",
    "received_time",
    "extra_key",
    "return_prompt_token_ids",
    "session_id",
    "model",  # sglang-router adds the served model name
}
_FALSY_DEFAULT_FIELDS = {
    "stream",
    "return_hidden_states",
    "return_routed_experts",
    "return_entropy",
    "return_bytes",
    "input_embeds",
    "image_data",
    "video_data",
    "audio_data",
    "token_ids_logprob",
    "custom_logit_processor",
    "lora_id",
    "return_sampling_mask",
    "background",
}
_SAMPLING_DEFAULTS: dict[str, Any] = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop": None,
    "stop_regex": None,
    "logit_bias": None,
    "beam_width": None,
    "custom_params": None,
}
_SAMPLING_IGNORED = {
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "ignore_eos",
}


def parse_sampling_params(raw: Any) -> tuple[SamplingParams, bool]:
    """SGLang `sampling_params` dict -> (`SamplingParams`, ignore_eos). Raises `InvalidRequestError`."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise InvalidRequestError("sampling_params must be an object")
    for key, default in _SAMPLING_DEFAULTS.items():
        if key in raw and raw[key] not in (default, [], {}):
            raise InvalidRequestError(f"sampling param {key!r} is not supported by the embedded engine")
    known = (
        set(_SAMPLING_DEFAULTS)
        | _SAMPLING_IGNORED
        | {"temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "sampling_seed"}
    )
    unknown = sorted(set(raw) - known)
    if unknown:
        raise InvalidRequestError(f"unknown sampling params: {unknown}")
    try:
        top_k = int(raw.get("top_k") if raw.get("top_k") is not None else -1)
        params = SamplingParams(
            temperature=float(raw.get("temperature") if raw.get("temperature") is not None else 1.0),
            top_p=float(raw.get("top_p") if raw.get("top_p") is not None else 1.0),
            top_k=-1 if TOP_K_ALL <= top_k < 1 << 31 else top_k,  # past int32: SamplingParams refuses it
            max_new_tokens=int(raw.get("max_new_tokens") if raw.get("max_new_tokens") is not None else 128),
            stop_token_ids=tuple(int(t) for t in (raw.get("stop_token_ids") or ())),
            seed=None if raw.get("sampling_seed") is None else int(raw["sampling_seed"]),
        )
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"bad sampling_params: {exc}") from exc
    return params, bool(raw.get("ignore_eos", False))


def check_text(text: str, field: str) -> None:
    """`InvalidRequestError` when `text` is not valid Unicode text (a lone surrogate such as `\\ud800`, which
    JSON can carry but no tokenizer can encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{field} holds {text[exc.start : exc.end]!r} at {exc.start}, which is not "
            "text (a lone surrogate)"
        ) from None


def parse_generate_request(body: Any, tokenizer: Any = None) -> dict[str, Any]:
    """Validate a `/generate` body -> {"input_ids", "params", "rid", "return_logprob", "ignore_eos", "lora_path"}."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the /generate body must be a JSON object")
    handled = {"rid", "text", "input_ids", "sampling_params", "return_logprob", "lora_path"}
    unsupported = sorted(k for k in body if k in _FALSY_DEFAULT_FIELDS and body[k])
    if unsupported:
        raise InvalidRequestError(f"/generate fields not supported by the embedded engine: {unsupported}")
    unknown = sorted(set(body) - handled - _IGNORED_GENERATE_FIELDS - _FALSY_DEFAULT_FIELDS)
    if unknown:
        raise InvalidRequestError(f"unknown /generate fields: {unknown}")
    input_ids = body.get("input_ids")
    if input_ids is None:
        text = body.get("text")
        if not isinstance(text, str):
            raise InvalidRequestError("give input_ids (a list of ints) or text (a string)")
        check_text(text, "text")
        if tokenizer is None:
            raise InvalidRequestError("this server has no tokenizer: send input_ids")
        input_ids = tokenizer.encode(text, add_special_tokens=False)
    if not isinstance(input_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in input_ids
    ):
        raise InvalidRequestError(
            "input_ids must be a flat list of ints (batched requests are not supported)"
        )
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise InvalidRequestError("rid must be a string")
    lora_path = body.get("lora_path")
    if lora_path is not None and not isinstance(lora_path, str):
        raise InvalidRequestError("lora_path must be one adapter name (batched requests are not supported)")
    params, ignore_eos = parse_sampling_params(body.get("sampling_params"))
    return {
        "input_ids": input_ids,
        "params": params,
        "rid": rid,
        "ignore_eos": ignore_eos,
        "return_logprob": bool(body.get("return_logprob")),
        "lora_path": lora_path or None,
    }


def finish_reason_json(result: GenerateResult) -> dict[str, Any]:
    """SGLang's finish-reason dicts (`FINISH_MATCHED_TOKEN`, `FINISH_LENGTH`, `FINISH_ABORT`)."""
    if result.finish_reason is FinishReason.STOP:
        return {"type": "stop", "matched": result.output_ids[-1] if result.output_ids else None}
    if result.finish_reason is FinishReason.LENGTH:
        return {"type": "length", "length": len(result.output_ids)}
    return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def generate_response(
    result: GenerateResult, *, rid: str, text: str | None, return_logprob: bool
) -> dict[str, Any]:
    """`GenerateResult` -> SGLang's `/generate` response."""
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason_json(result),
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": len(result.output_ids),
        "cached_tokens": result.cached_tokens,
        "weight_version": str(result.weight_version),
        "e2e_latency": result.latency_s,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tid, None] for lp, tid in zip(result.output_logprobs, result.output_ids, strict=True)
        ]
        if result.kept_counts is not None:
            meta[KEPT_COUNTS_FIELD] = list(result.kept_counts)
    return {"text": text or "", "output_ids": list(result.output_ids), "meta_info": meta}
