"""TITO tokenizer: family detection, loading, stop-token boundaries, state errors, the mismatch check, `run_check`."""

from __future__ import annotations

import shutil

import pytest

from miles.engine import FinishReason
from miles.tiny import load_tiny_tokenizer
from miles.tito import (
    ConversationStateError,
    DeltaPrefixError,
    InvalidTokenError,
    MismatchKind,
    TITOMismatchError,
    TITOTokenizer,
    TokenizerSpecError,
    UnknownFamilyError,
    detect_family,
    load_tokenizer,
)
from miles.tito.check import format_report, run_check
from miles.tito.conversation import Conversation
from miles.tito.loading import packaged_tokenizer_dir
from miles.tito.report import CUT, GENERATED
from miles.tools import get_parser
from miles.types import Message, ToolCall

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate arithmetic.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
CALL = Message("assistant", "", [ToolCall("calculate", {"expression": "58 * 2"}, id="call_0")])
RESULT = [Message("tool", "116", tool_call_id="call_0", name="calculate")]
START = [Message("system", "Be exact."), Message("user", "What is 37 + 58 * 2?")]


@pytest.fixture(scope="module")
def toks():
    return {
        "tiny": load_tokenizer("tiny"),
        "qwen3": load_tokenizer("qwen3"),
        "llama3": load_tokenizer("llama3"),
    }


@pytest.fixture(scope="module")
def tiny(toks):
    return TITOTokenizer(toks["tiny"])


def _gen(tito, conv, msg, *, cut=None, version=0):
    ids = tito.expected_generation(conv.messages, msg, conv.tools)
    if cut is not None:
        ids = ids[:cut]
    finish = FinishReason.STOP if cut is None else FinishReason.LENGTH
    return ids, conv.append_generation(ids, [-0.25] * len(ids), weight_version=version, finish_reason=finish)


def test_families_are_detected(toks):
    assert TITOTokenizer(toks["tiny"]).family == "tiny"
    assert TITOTokenizer(toks["qwen3"]).family == "qwen3"
    assert TITOTokenizer(toks["llama3"]).family == "llama3"
    assert (
        detect_family(
            toks["qwen3"], chat_template=load_tiny_tokenizer().chat_template.replace("miles-tiny", "x")
        )
        == "chatml"
    )
    assert TITOTokenizer(toks["qwen3"], "chatml").family == "chatml"


def test_stop_token_ids(toks):
    q = TITOTokenizer(toks["qwen3"])
    assert q.stop_token_ids == (151645, 151643)
    lt = TITOTokenizer(toks["llama3"])
    assert lt.stop_token_ids[0] == toks["llama3"].convert_tokens_to_ids("<|eot_id|>")
    assert TITOTokenizer(toks["tiny"]).stop_token_ids[0] == toks["tiny"].eos_token_id


def test_unknown_family_and_missing_template(toks):
    with pytest.raises(UnknownFamilyError, match="unknown template family"):
        TITOTokenizer(toks["tiny"], "gpt2")
    with pytest.raises(UnknownFamilyError, match="cannot tell"):
        TITOTokenizer(toks["tiny"], chat_template="{{ messages[0].content }}")
    bare = load_tiny_tokenizer()
    bare.chat_template = None
    with pytest.raises(UnknownFamilyError, match="no chat template"):
        TITOTokenizer(bare)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(TokenizerSpecError, match="neither"):
        load_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(TokenizerSpecError, match="no tokenizer files"):
        load_tokenizer(tmp_path)


def test_load_tokenizer_from_folder_gets_llama3_template(tmp_path):
    src = packaged_tokenizer_dir("llama3")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    tok = load_tokenizer(tmp_path)
    assert TITOTokenizer(tok).family == "llama3"


def test_chatml_newline_after_stop_token_goes_into_the_delta(tiny, toks):
    conv = Conversation(tiny, START, TOOLS)
    assert conv.prompt_ids == tiny.render_ids(START, TOOLS, add_generation_prompt=True)
    ids, text = _gen(tiny, conv, CALL)
    assert (
        ids[-1] == toks["tiny"].eos_token_id and "<|im_end|>" not in text and text.startswith("<tool_call>")
    )
    delta = conv.append_observation(CALL, RESULT)
    assert tiny.decode(delta).startswith("\n<|im_start|>user\n<tool_response>\n116")
    assert tiny.decode(delta).endswith("<|im_start|>assistant\n")
    assert conv.prompt_ids == tiny.render_ids(START + [CALL] + RESULT, TOOLS, add_generation_prompt=True)
    traj = conv.trajectory
    assert [s.role for s in traj.spans] == ["prompt", "assistant", "observation"]
    assert traj.loss_mask == [0] * traj.spans[1].start + [1] * len(ids) + [0] * len(delta)


@pytest.mark.parametrize("family", ["tiny", "qwen3", "llama3"])
def test_max_tokens_without_stop_token_inserts_the_close_token(toks, family):
    tito = TITOTokenizer(toks[family])
    conv = Conversation(tito, START, TOOLS)
    answer = Message("assistant", "The answer is 153 and then a long tail of words.")
    full = tito.expected_generation(conv.messages, answer, TOOLS)
    tail = tito.encode(" and then a long tail of words.")
    ids, text = _gen(tito, conv, answer, cut=len(full) - len(tail) - 1)
    assert text.endswith("The answer is 153")
    assert not conv.last_turn_closed
    more = [Message("user", "Just the number?")]
    delta = conv.append_observation(Message("assistant", text), more)
    assert delta[0] == tito.close_token_id
    traj = conv.trajectory
    close = [s for s in traj.spans if s.role == "close"]
    assert len(close) == 1 and traj.loss_mask[close[0].start] == 0
    expected = tito.render_ids(START + [Message("assistant", text)] + more, TOOLS, add_generation_prompt=True)
    if family == "qwen3":  # the (empty) think block of the cut turn is stripped by the canonical render
        assert conv.prompt_ids != expected and conv.check(strict=True).ok
    else:
        assert conv.prompt_ids == expected
        assert conv.check(strict=True).exact


def test_generation_can_continue_after_max_tokens(tiny):
    conv = Conversation(tiny, START)
    full = tiny.expected_generation(conv.messages, Message("assistant", "It is 153."))
    conv.append_generation(full[:2], [-1.0, -1.0], weight_version=0, finish_reason=FinishReason.LENGTH)
    conv.append_generation(
        full[2:], [-1.0] * (len(full) - 2), weight_version=1, finish_reason=FinishReason.STOP
    )
    conv.finish(Message("assistant", "It is 153."))
    report = conv.check(strict=True)
    assert report.exact
    assert [s.weight_version for s in conv.trajectory.spans if s.role == "assistant"] == [0, 1]


def test_state_errors(tiny):
    conv = Conversation(tiny, START)
    with pytest.raises(ConversationStateError, match="needs a generation"):
        conv.append_observation(CALL, RESULT)
    with pytest.raises(ConversationStateError, match="needs a generation"):
        conv.finish(CALL)
    _gen(tiny, conv, CALL)
    with pytest.raises(ConversationStateError, match="already ended"):
        conv.append_generation([5], [0.0], weight_version=0, finish_reason=FinishReason.STOP)
    conv.finish(CALL)
    with pytest.raises(ConversationStateError, match="finished"):
        conv.append_generation([5], [0.0], weight_version=0, finish_reason=FinishReason.STOP)


def test_invalid_engine_output(tiny):
    conv = Conversation(tiny, START)
    with pytest.raises(InvalidTokenError, match="outside the vocabulary"):
        conv.append_generation([tiny.vocab_size], [0.0], weight_version=0, finish_reason=FinishReason.STOP)
    with pytest.raises(InvalidTokenError, match="logprobs"):
        conv.append_generation([1, 2], [0.0], weight_version=0, finish_reason=FinishReason.STOP)
    assert len(conv) == len(conv.prompt_ids) == conv.trajectory.spans[-1].end  # nothing appended


def test_finish_without_recording_compares_only_the_prefix(tiny):
    conv = Conversation(tiny, START)
    conv.append_generation([100, 101], [-1.0, -2.0], weight_version=0, finish_reason=FinishReason.LENGTH)
    conv.finish()
    assert conv.trajectory.token_ids[-1] == tiny.close_token_id
    report = conv.check(strict=True)
    assert report.exact and report.compared_tokens == conv.trajectory.spans[1].start


def test_mismatch_kinds_and_strict_mode(tiny, toks):
    # the engine ends its turn on <|endoftext|> (also a stop token) where the template writes <|im_end|>
    conv = Conversation(tiny, START, TOOLS)
    ids = tiny.expected_generation(conv.messages, CALL, TOOLS)
    ids[-1] = toks["tiny"].convert_tokens_to_ids("<|endoftext|>")
    conv.append_generation(ids, [-0.1] * len(ids), weight_version=0, finish_reason=FinishReason.STOP)
    conv.append_observation(CALL, RESULT)
    report = conv.check()
    assert [m.kind for m in report.mismatches] == [MismatchKind.SPECIAL_TOKENS]
    assert report.metrics()["tito/mismatch_tokens_special_tokens"] == 1.0
    assert [m.explanation for m in report.mismatches] == [GENERATED] and report.ok  # trained as generated

    # the model spelled its answer with non-canonical tokens
    conv = Conversation(tiny, START)
    text = "The answer is 153."
    odd = [i for ch in text for i in tiny.encode(ch)]
    assert odd != tiny.encode(text)
    conv.append_generation(
        odd + [tiny.close_token_id],
        [-0.1] * (len(odd) + 1),
        weight_version=0,
        finish_reason=FinishReason.STOP,
    )
    conv.finish(Message("assistant", text))
    report = conv.check()
    assert {m.kind for m in report.mismatches} == {MismatchKind.ASSISTANT_TEXT} and report.ok
    assert {m.explanation for m in report.mismatches} == {GENERATED}

    # a recorded observation differs from what was tokenized: not the model's, so not ok
    conv = Conversation(tiny, START, TOOLS)
    _gen(tiny, conv, CALL)
    conv.append_observation(CALL, RESULT)
    conv.messages[-1].content = "117"
    report = conv.check()
    assert {m.kind for m in report.mismatches} == {MismatchKind.NON_ASSISTANT_TEXT} and not report.ok
    with pytest.raises(TITOMismatchError, match="non_assistant_text"):
        conv.check(strict=True)


# What the tiny model wrote in an Orders-v0 agent session (`data/orders_agent_nested_tool_calls.jsonl`): nested
# <tool_call> tags, two turns cut by max_new_tokens, each answered by the same tool error.
NESTED_OUTPUTS = [
    ('<tool_call>\n<tool_call>\n{"name": "authenticate", "arguments": {"email": "dad', False),
    ('<tool_call>\n<tool_call>\n{"name": "com", "arguments": {"order_id": "W10773"}}\n</tool_call>', True),
    (
        '<tool_call>\n<tool_call>\n{"name": "authenticom", "arguments": {"email": "b_id": "9973 could not',
        False,
    ),
    ('<tool_call>\n<tool_call>\n{"name": "ample W10"}}\n</tool_call>', True),
]
SAME_ERROR = 'Error: {"error":{"message":"the body is not JSON","code":null}}'


def _nested_session(tiny) -> Conversation:
    conv = Conversation(tiny, START, TOOLS)
    parser = get_parser("hermes")
    for k, (text, stop) in enumerate(NESTED_OUTPUTS):
        ids = tiny.encode(text) + ([tiny.close_token_id] if stop else [])
        finish = FinishReason.STOP if stop else FinishReason.LENGTH
        msg = parser.parse(
            conv.append_generation(ids, None, weight_version=0, finish_reason=finish)
        ).to_message()
        if k < len(NESTED_OUTPUTS) - 1:
            conv.append_observation(
                msg, [Message("tool", SAME_ERROR, tool_call_id=c.id, name=c.name) for c in msg.tool_calls]
            )
        else:
            conv.finish(msg)
    return conv


def test_repeated_observations_after_malformed_turns_are_compared_turn_by_turn(tiny):
    # The template re-renders each nested call as a call wrapped around the model's text, and a cut one with the
    # closing it lacked; the identical observations must still be compared with their own re-render, not with
    # a neighbour's (one whole-sequence diff misaligned here and blamed an observation).
    conv = _nested_session(tiny)
    report = conv.check()
    assert report.ok and not report.exact, report.summary()
    assert report.counts()["special_tokens"] == report.counts()["non_assistant_text"] == 0, report.summary()
    assert {m.explanation for m in report.mismatches} == {GENERATED, CUT}
    spans = conv.trajectory.spans
    fixed = [s for s in spans if s.role in ("prompt", "observation")]
    for m in report.mismatches:  # each lies in a model turn (an insertion may sit where the turn ends)
        assert not any(s.start < max(m.acc_end, m.acc_start + 1) and m.acc_start < s.end for s in fixed), m

    # still strict: a re-render that differs in one of the repeated observations is found, in that observation
    conv = _nested_session(tiny)
    conv.messages[5].content = SAME_ERROR.replace("JSON", "YAML")  # the second of three equal tool results
    report = conv.check()
    assert not report.ok and {m.kind for m in report.unexplained} == {MismatchKind.NON_ASSISTANT_TEXT}
    second = [s for s in spans if s.role == "observation"][1]
    assert all(second.start <= m.acc_start < m.acc_end <= second.end for m in report.unexplained)
    assert [(m.accumulated_text.strip(), m.canonical_text.strip()) for m in report.unexplained] == [
        ("JSON", "YAML")
    ], report.summary()
    with pytest.raises(TITOMismatchError, match="non_assistant_text"):
        conv.check(strict=True)


def test_qwen3_thinking_is_kept_and_explained(toks):
    q = TITOTokenizer(toks["qwen3"])
    conv = Conversation(q, START, TOOLS)
    first = Message("assistant", "The answer is 153.", reasoning="58 * 2 = 116, plus 37.")
    ids, text = _gen(q, conv, first)
    assert text.startswith("<think>\n58 * 2 = 116")
    conv.append_observation(first, [Message("user", "Sure?")])
    second = Message("assistant", "Yes.", reasoning="Checked.")
    _gen(q, conv, second)
    conv.finish(second)
    traj = conv.trajectory
    assert traj.token_ids[traj.spans[1].start : traj.spans[1].end] == ids  # thinking tokens kept verbatim
    report = conv.check(strict=True)  # explained differences do not raise
    assert not report.exact and report.ok
    assert [m.explanation for m in report.mismatches] == ["qwen3_thinking_stripped"]
    assert "<think>" in report.mismatches[0].accumulated_text
    assert report.metrics()["tito/mismatch_tokens_explained"] > 0


def test_qwen3_enable_thinking_false(toks):
    q = TITOTokenizer(toks["qwen3"], chat_template_kwargs={"enable_thinking": False})
    conv = Conversation(q, START, TOOLS)
    assert q.decode(conv.prompt_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    _gen(q, conv, CALL)
    delta = conv.append_observation(CALL, RESULT)
    assert q.decode(delta).endswith("<think>\n\n</think>\n\n")
    assert conv.check().ok


def test_non_append_only_template_raises_delta_prefix_error(toks):
    bad = (
        load_tiny_tokenizer()
        .chat_template.replace("miles-tiny", "counted")
        .replace("{%- if tools %}", "{{- messages | length }}{%- if tools %}", 1)
    )
    tito = TITOTokenizer(toks["tiny"], chat_template=bad)
    assert tito.family == "chatml"
    with pytest.raises(DeltaPrefixError, match="not append-only"):
        tito.observation_delta(RESULT)
    report = run_check(_with_template(bad))
    assert not report.ok and any(s.error and "append-only" in s.error for s in report.scenarios)
    assert "UNHANDLED" in format_report(report)


def _with_template(template):
    tok = load_tiny_tokenizer()
    tok.chat_template = template
    return tok


def test_llama3_template_renders_tools_and_ipython_turns(toks):
    lt = TITOTokenizer(toks["llama3"])
    two = Message(
        "assistant",
        "",
        [
            ToolCall("calculate", {"expression": "1+1"}, id="call_0"),
            ToolCall("calculate", {"expression": "2+2"}, id="call_1"),
        ],
    )
    text = lt.render_text(
        START + [two] + [Message("tool", "2", tool_call_id="call_0")], TOOLS, add_generation_prompt=True
    )
    assert text.startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    )
    assert '"name": "calculate"' in text.split("<|eot_id|>")[0]
    assert (
        '{"name": "calculate", "parameters": {"expression": "1+1"}}\n'
        '{"name": "calculate", "parameters": {"expression": "2+2"}}<|eot_id|>'
    ) in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n2<|eot_id|>" in text
    assert lt.render_ids(START)[0] == toks["llama3"].bos_token_id
    assert lt.render_ids(START).count(toks["llama3"].bos_token_id) == 1


@pytest.mark.parametrize("spec", ["tiny", "llama3"])
def test_run_check_append_only_families(spec):
    report = run_check(spec)
    assert report.append_only and report.ok, format_report(report)
    names = {s.name for s in report.scenarios}
    assert {
        "parallel_tool_calls",
        "empty_tool_output",
        "unicode",
        "long_output",
        "thinking",
        "max_tokens",
    } <= names
    assert "append-only in every scenario" in format_report(report)


def test_run_check_qwen3_reports_the_thinking_handler(toks):
    report = run_check(toks["qwen3"])
    by_name = {s.name: s for s in report.scenarios}
    assert report.ok and not report.append_only
    assert by_name["thinking"].append_only  # reasoning kept while only tool results follow
    assert not by_name["thinking_follow_up"].append_only
    assert by_name["thinking_follow_up"].explanations == ["qwen3_thinking_stripped"]
    assert by_name["single_turn"].append_only
    text = format_report(report)
    assert "qwen3_thinking_stripped" in text and "every difference is handled" in text
