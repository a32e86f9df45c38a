"""Every body the client sends fits SGLang's own request dataclasses (read from the installed sglang sources
with `ast`: importing io_struct pulls torchvision), and responses parse both ways."""

from __future__ import annotations

import ast
import importlib.util
from functools import cache
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.engine import FinishReason, GenerateResult, SamplingParams
from miles.engines import wire
from miles.engines.errors import InvalidRequestError


def _sglang_root() -> Path:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, (
        "sglang sources must be installed (--no-deps)"
    )
    return Path(next(iter(spec.submodule_search_locations)))


@cache
def _classes(relpath: str) -> dict[str, ast.ClassDef]:
    tree = ast.parse((_sglang_root() / relpath).read_text())
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def _required(value: ast.expr | None) -> bool:
    if value is None:
        return True
    if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "field":
        return not any(k.arg in ("default", "default_factory") for k in value.keywords)
    return False


def fields(cls_name: str, relpath: str = "srt/managers/io_struct.py") -> tuple[set[str], set[str]]:
    """(all field names, required field names) of an SGLang dataclass/msgspec struct, bases included."""
    classes = _classes(relpath)
    node = classes[cls_name]
    names: set[str] = set()
    required: set[str] = set()
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            n, r = fields(base.id, relpath)
            names |= n
            required |= r
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
            if _required(stmt.value):
                required.add(stmt.target.id)
            else:
                required.discard(stmt.target.id)
    return names, required


def check(body: dict, cls_name: str) -> None:
    names, required = fields(cls_name)
    assert not set(body) - names, f"unknown {cls_name} fields: {set(body) - names}"
    assert not required - set(body), f"missing {cls_name} fields: {required - set(body)}"


def test_the_ast_reader_finds_sglang_fields():
    names, required = fields("GenerateReqInput")
    assert {"rid", "input_ids", "sampling_params", "return_logprob", "lora_path", "stream"} <= names
    assert len(names) >= 60 and not required
    names, required = fields("UpdateWeightsFromDistributedReqInput")
    assert required == {"names", "dtypes", "shapes"} and "rid" in names  # `rid` comes from BaseReq
    with pytest.raises(AssertionError):
        check({"input_ids": [1], "not_a_field": 1}, "GenerateReqInput")
    with pytest.raises(AssertionError):
        check({"model_path": "x"} | {"rid": None}, "InitWeightsUpdateGroupReqInput")


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.0, top_p=0.5, top_k=7, max_new_tokens=3, stop_token_ids=(1, 2), seed=5),
    ],
)
@pytest.mark.parametrize("lora", [None, "my-adapter"])
def test_generate_body_fits_generate_req_input(params, lora):
    body = wire.generate_body([1, 2, 3], params, rid="r1", lora_path=lora)
    check(body, "GenerateReqInput")
    assert body["return_logprob"] is True and body["rid"] == "r1" and body["input_ids"] == [1, 2, 3]
    assert ("lora_path" in body) == (lora is not None)
    sp_names, _ = fields("SamplingParams", "srt/sampling/sampling_params.py")
    assert set(body["sampling_params"]) <= sp_names
    parsed, _ = wire.parse_sampling_params(body["sampling_params"])
    assert parsed == params


def test_admin_bodies_fit_their_req_inputs():
    check(wire.abort_body("r1"), "AbortReq")
    check(wire.abort_body(abort_all=True), "AbortReq")
    check(wire.update_from_disk_body("/ckpt", weight_version=3), "UpdateWeightFromDiskReqInput")
    check(wire.init_group_body("127.0.0.1", 29500, 1, 2), "InitWeightsUpdateGroupReqInput")
    check(
        wire.update_distributed_body(["w"], ["float32"], [[2, 3]], weight_version=1),
        "UpdateWeightsFromDistributedReqInput",
    )
    check(wire.pause_body("in_place"), "PauseGenerationReqInput")
    check(wire.continue_body(), "ContinueGenerationReqInput")


def test_pause_modes_are_sglangs():
    mode = next(
        s
        for s in _classes("srt/managers/io_struct.py")["PauseGenerationReqInput"].body
        if isinstance(s, ast.AnnAssign) and s.target.id == "mode"
    )
    assert {e.value for e in mode.annotation.slice.elts} == set(wire.PAUSE_MODES)
    with pytest.raises(InvalidRequestError):
        wire.pause_body("freeze")


@pytest.mark.parametrize("reason", list(FinishReason))
def test_response_round_trip(reason):
    result = GenerateResult(
        output_ids=[4, 5, 6],
        output_logprobs=[-0.1, -0.2, -0.3],
        finish_reason=reason,
        weight_version=7,
        prompt_tokens=3,
        cached_tokens=2,
    )
    data = wire.generate_response(result, rid="r", text="abc", return_logprob=True)
    assert data["meta_info"]["output_token_logprobs"] == [[-0.1, 4, None], [-0.2, 5, None], [-0.3, 6, None]]
    assert data["meta_info"]["finish_reason"]["type"] == reason.value
    back = wire.parse_generate_response(data)
    assert (back.output_ids, back.output_logprobs, back.finish_reason) == (
        [4, 5, 6],
        [-0.1, -0.2, -0.3],
        reason,
    )
    assert (back.weight_version, back.prompt_tokens, back.cached_tokens) == (7, 3, 2)


def test_real_sglang_shaped_response_parses():
    data = {
        "text": "hi",
        "output_ids": [11, 12],
        "meta_info": {
            "id": "abc",
            "finish_reason": {"type": "stop", "matched": 12},
            "prompt_tokens": 5,
            "weight_version": "default",
            "completion_tokens": 2,
            "cached_tokens": 0,
            "e2e_latency": 0.1,
            "output_token_logprobs": [[-1.5, 11, None], [-0.25, 12, None]],
        },
    }
    r = wire.parse_generate_response(data, fallback_version=4)
    assert r.output_ids == [11, 12] and r.finish_reason is FinishReason.STOP and r.weight_version == 4


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(
    data=json_values
    | st.fixed_dictionaries(
        {
            "meta_info": st.dictionaries(
                st.sampled_from(
                    ["finish_reason", "output_token_logprobs", "weight_version", "prompt_tokens"]
                ),
                json_values,
            )
        }
    )
)
def test_garbage_responses_raise_wire_format_error_only(data):
    try:
        wire.parse_generate_response(data)
    except wire.WireFormatError:
        pass


@settings(max_examples=200, deadline=None)
@given(
    body=json_values
    | st.dictionaries(
        st.sampled_from(["input_ids", "sampling_params", "rid", "stream", "text", "lora_path", "bogus"]),
        json_values,
    )
)
def test_garbage_generate_requests_raise_invalid_request_only(body):
    try:
        wire.parse_generate_request(body)
    except InvalidRequestError:
        pass
