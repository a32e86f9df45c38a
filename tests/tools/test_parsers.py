"""Tool-call parsers: hermes and llama3_json, the registry, and hypothesis properties."""

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from miles.tools import (
    HermesParser,
    ParsedOutput,
    ToolCallParser,
    UnknownParserError,
    available_parsers,
    get_parser,
    register_parser,
)
from miles.types import ToolCall

HERMES = get_parser("hermes")
LLAMA = get_parser("llama3_json")


def test_hermes_several_calls_and_content():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {"tz": "CET", "n": [1, 2]}}</tool_call>'
    )
    out = HERMES.parse(text)
    assert out.content == "Let me check."
    assert [(c.id, c.name, c.arguments, c.parse_error) for c in out.calls] == [
        ("call_0", "get_weather", {"city": "Paris"}, None),
        ("call_1", "get_time", {"tz": "CET", "n": [1, 2]}, None),
    ]
    assert json.loads(out.calls[1].raw_arguments) == {"tz": "CET", "n": [1, 2]}
    msg = out.to_message()
    assert msg.role == "assistant" and msg.tool_calls == out.calls


def test_hermes_no_calls_and_variants():
    assert HERMES.parse("  just text  ") == ParsedOutput("just text", [])
    out = HERMES.parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert out.calls[0].arguments == {"x": 1}  # arguments sent as a JSON string
    out = HERMES.parse('<tool_call>{"name": "f"}</tool_call>')
    assert out.calls[0].arguments == {} and out.calls[0].parse_error is None
    out = HERMES.parse('<tool_call>{"name": "f", "parameters": {"y": 2}}</tool_call>')
    assert out.calls[0].arguments == {"y": 2}


@pytest.mark.parametrize(
    ("text", "name", "needle"),
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>', "add", "invalid JSON"),
        ("<tool_call>hello world</tool_call>", "", "invalid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "", "must be a JSON object, got list"),
        ('<tool_call>{"arguments": {}}</tool_call>', "", 'no "name"'),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "f", "arguments must be a JSON object"),
        ('<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>', "f", "invalid JSON in arguments"),
        ('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', "f", "NaN is not valid JSON"),
        ("<tool_call>" + "[" * 100000 + "</tool_call>", "", "invalid JSON"),
    ],
)
def test_hermes_garbage_becomes_parse_error(text, name, needle):
    [c] = HERMES.parse(text).calls
    assert c.arguments is None and c.name == name and c.id == "call_0"
    assert needle in c.parse_error


def test_hermes_unclosed_tag():
    out = HERMES.parse('Sure <tool_call>\n{"name": "f", "arguments": {"a": 1}}')
    assert out.content == "Sure" and out.calls[0].arguments == {"a": 1} and out.calls[0].parse_error is None
    out = HERMES.parse('<tool_call>{"name": "f"}</tool_call> then <tool_call>{"name": "g", "argu')
    assert [c.name for c in out.calls] == ["f", "g"]
    assert out.calls[1].parse_error.endswith("(the <tool_call> tag was not closed)")
    assert out.content == "then"


def test_llama3_json():
    out = LLAMA.parse(
        '<|python_tag|>{"name": "search", "parameters": {"q": "x"}}; '
        '{"name": "fetch", "arguments": {"id": 3}}<|eom_id|>'
    )
    assert [(c.id, c.name, c.arguments) for c in out.calls] == [
        ("call_0", "search", {"q": "x"}),
        ("call_1", "fetch", {"id": 3}),
    ]
    assert out.content == ""
    out = LLAMA.parse('{"name": "f", "parameters": {}}\nDone.')
    assert out.calls[0].name == "f" and out.content == "Done."
    # plain text and JSON answers that are not calls stay content
    assert LLAMA.parse("The answer is 4.") == ParsedOutput("The answer is 4.", [])
    assert LLAMA.parse('{"answer": 4}') == ParsedOutput('{"answer": 4}', [])
    assert LLAMA.parse('{"name": broken') == ParsedOutput('{"name": broken', [])


def test_llama3_garbage_after_python_tag():
    [c] = LLAMA.parse('<|python_tag|>{"name": "f", "parameters": {').calls
    assert c.name == "f" and c.arguments is None and "invalid JSON" in c.parse_error
    [c] = LLAMA.parse("<|python_tag|>print(1)").calls
    assert c.arguments is None and "expected a JSON object" in c.parse_error
    out = LLAMA.parse('{"name": "f", "parameters": {}}; {"name": "g", "param')
    assert [c.name for c in out.calls] == ["f", "g"] and out.calls[1].parse_error


def test_registry():
    assert {"hermes", "qwen", "llama3_json"} <= set(available_parsers())
    assert isinstance(get_parser("qwen"), HermesParser)
    with pytest.raises(UnknownParserError, match="unknown tool-call parser 'nope'"):
        get_parser("nope")
    with pytest.raises(TypeError):
        register_parser("bad", dict)

    class Shouting(ToolCallParser):
        name = "shouting"

        def _parse(self, text):
            if text == "crash":
                raise RuntimeError("bug in a third-party parser")
            return ParsedOutput(text.upper(), [])

        def render(self, content, calls):
            return content

    register_parser("shouting", Shouting)
    assert get_parser("shouting").parse("hi").content == "HI"
    assert get_parser("shouting").parse("crash") == ParsedOutput("crash", [])  # the base never lets it raise
    assert HERMES.parse(None) == ParsedOutput("", [])


# ---- properties -------------------------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.text(max_size=20)
    | st.floats(allow_nan=False, allow_infinity=False)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True)
calls_st = st.lists(
    st.builds(
        lambda n, a: ToolCall(name=n, arguments=a),
        names,
        st.dictionaries(st.text(max_size=8), json_values, max_size=4),
    ),
    max_size=4,
)
content_st = (
    st.text(max_size=60).filter(lambda t: "<tool_call>" not in t and "</tool_call>" not in t).map(str.strip)
)
tokens = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "{",
        "}",
        '"name"',
        ":",
        '"arguments"',
        "[",
        "]",
        ",",
        '"',
        "<|python_tag|>",
        ";",
        "\\",
        "NaN",
        "null",
        " ",
        "\n",
        "x",
    ]
)
chaotic_text = st.lists(tokens | st.text(max_size=5), max_size=40).map("".join)


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=200) | chaotic_text)
def test_parsers_never_raise(text):
    for parser in (HERMES, LLAMA):
        out = parser.parse(text)
        assert isinstance(out, ParsedOutput) and isinstance(out.content, str)
        for i, c in enumerate(out.calls):
            assert c.id == f"call_{i}"
            assert (c.arguments is None) == (c.parse_error is not None)


@settings(max_examples=60, deadline=None)
@given(content=content_st, calls=calls_st)
def test_hermes_round_trip(content, calls):
    out = HERMES.parse(HERMES.render(content, calls))
    assert out.content == content
    assert [(c.name, c.arguments, c.parse_error) for c in out.calls] == [
        (c.name, c.arguments, None) for c in calls
    ]


@settings(max_examples=60, deadline=None)
@given(calls=calls_st.filter(bool), tag=st.booleans())
def test_llama3_round_trip(calls, tag):
    text = LLAMA.render("", calls)
    out = LLAMA.parse(("<|python_tag|>" if tag else "") + text)
    assert out.content == ""
    assert [(c.name, c.arguments, c.parse_error) for c in out.calls] == [
        (c.name, c.arguments, None) for c in calls
    ]


@settings(max_examples=100, deadline=None)
@given(
    prefix=content_st,
    garbage=st.text(max_size=80).filter(lambda t: "</tool_call>" not in t),
    closed=st.booleans(),
)
def test_hermes_garbage_inside_tags_is_a_parse_error_not_a_crash(prefix, garbage, closed):
    body = "{" + garbage  # an object that never validly closes, or trailing junk
    try:
        json.loads(body)
        valid = True
    except ValueError:
        valid = False
    text = f"{prefix}<tool_call>{body}" + ("</tool_call>" if closed else "")
    out = HERMES.parse(text)
    assert len(out.calls) >= 1
    if not valid and "<tool_call>" not in garbage:
        assert out.calls[0].parse_error is not None and out.calls[0].arguments is None


# ---- non-finite numbers are not JSON, wherever they sit ----------------------------------------------------

NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1E+999", "123.25e308", "-0.1e310"]
HOLE = "\x00hole\x00"


@st.composite
def json_with_hole(draw):
    """(JSON object text with one number literal slot `HOLE`, anywhere in a nested structure)."""
    value: object = HOLE
    for _ in range(draw(st.integers(0, 5))):
        if draw(st.booleans()):
            value = [
                *draw(st.lists(json_values, max_size=2)),
                value,
                *draw(st.lists(json_values, max_size=2)),
            ]
        else:
            key = draw(st.text(max_size=6))
            others = {
                k: v
                for k, v in draw(st.dictionaries(st.text(max_size=6), json_values, max_size=2)).items()
                if k != key
            }
            value = {**others, key: value}
    text = json.dumps({draw(st.text(max_size=6)): value}, ensure_ascii=draw(st.booleans()))
    marker = json.dumps(HOLE)
    assume(text.count(marker) == 1)
    return text.replace(marker, "{}")


@settings(max_examples=150, deadline=None)
@given(template=json_with_hole(), literal=st.sampled_from(NON_FINITE))
def test_non_finite_numbers_are_rejected_anywhere(template, literal):
    from miles.tools.parser_base import loads_strict

    assert isinstance(loads_strict(template.replace("{}", "1e300")), dict)  # the same place, a finite number
    text = template.replace("{}", literal)
    with pytest.raises(ValueError, match="not valid JSON|out of range"):
        loads_strict(text)
    for model_text in (
        f'<tool_call>{{"name": "f", "arguments": {text}}}</tool_call>',
        f'<tool_call>{{"name": "f", "arguments": {json.dumps(text)}}}</tool_call>',
    ):
        [c] = HERMES.parse(model_text).calls
        assert (
            c.arguments is None
            and c.name == "f"
            and ("not valid JSON" in c.parse_error or "out of range" in c.parse_error)
        )
    [c] = LLAMA.parse(f'<|python_tag|>{{"name": "f", "parameters": {text}}}').calls
    assert c.arguments is None and c.parse_error
    c = ToolCall.from_dict({"function": {"name": "f", "arguments": text}})
    assert (
        c.arguments is None
        and c.raw_arguments == text
        and ("not valid JSON" in c.parse_error or "out of range" in c.parse_error)
    )


def test_overflowing_literal_error_names_the_number():
    from miles.tools.parser_base import loads_strict

    with pytest.raises(ValueError, match=r"the number 1e400 is out of range"):
        loads_strict('{"x": 1e400}')
    with pytest.raises(ValueError, match="Infinity is not valid JSON"):
        loads_strict('{"x": [1, {"y": -Infinity}]}')
    assert (
        loads_strict('{"x": 1.7976931348623157e308, "y": -0.0, "z": 5e-324}')["x"] == 1.7976931348623157e308
    )


# ---- the arguments' original text is kept and rendered as it came -------------------------------------------

arg_dicts = st.dictionaries(st.text(max_size=8), json_values, max_size=4)
formats = st.fixed_dictionaries(
    {
        "indent": st.sampled_from([None, 0, 2]),
        "ensure_ascii": st.booleans(),
        "separators": st.sampled_from([(",", ":"), (", ", ": "), (" ,", " :  ")]),
    }
)


@settings(max_examples=100, deadline=None)
@given(args=arg_dicts, fmt=formats, pad=st.sampled_from(["", " ", "\n", "\t "]), content=content_st)
def test_argument_text_survives_parse_and_render_byte_exactly(args, fmt, pad, content):
    raw = json.dumps(args, **fmt)
    hermes_text = f'{content}\n<tool_call>\n{{"name": "f",{pad}"arguments":{pad}{raw}{pad}}}\n</tool_call>'
    llama_text = f'{{"name": "f", "parameters":{pad}{raw}}}'
    for parser, text in ((HERMES, hermes_text), (get_parser("qwen3"), hermes_text), (LLAMA, llama_text)):
        [c] = parser.parse(text).calls
        assert c.arguments == args and c.raw_arguments == raw and c.arguments_text == raw
        assert c.to_dict(verbatim=True)["function"]["arguments"] == raw
        assert c.to_dict()["function"]["arguments"] == args
        assert raw in parser.render("", [c])
    # OpenAI style: the arguments are a JSON string, kept as they are
    c = ToolCall.from_dict({"id": "x", "type": "function", "function": {"name": "f", "arguments": raw}})
    assert c.arguments == args and c.to_dict(verbatim=True)["function"]["arguments"] == raw


def test_argument_text_edge_cases():
    [c] = HERMES.parse(
        '<tool_call>{"name": "f", "arguments": {"a": 1}, "arguments": {"b":2}}</tool_call>'
    ).calls
    assert c.arguments == {"b": 2} and c.raw_arguments == '{"b":2}'  # the last key wins, as in json.loads
    [c] = HERMES.parse('<tool_call>{"name": "f", "arguments": "{\\"x\\":1}"}</tool_call>').calls
    assert c.raw_arguments == '{"x":1}' and c.to_dict(verbatim=True)["function"]["arguments"] == '{"x":1}'
    c.arguments["x"] = 2  # the text no longer describes the arguments: render the arguments, not stale text
    assert c.arguments_text is None and c.to_dict(verbatim=True)["function"]["arguments"] == {"x": 2}
    for raw, args in (('{"a": true}', {"a": 1}), ('{"a": 1.0}', {"a": 1}), ("", {}), ("{x", {"x": 1})):
        assert ToolCall("f", args, raw_arguments=raw).arguments_text is None
    bad = ToolCall("f", None, raw_arguments='{"a": 1}', parse_error="no name")
    assert bad.arguments_text is None and bad.to_dict(verbatim=True)["function"]["arguments"] == '{"a": 1}'


# ---- Qwen3: <think> reasoning ------------------------------------------------------------------------------

QWEN3 = get_parser("qwen3")


def test_qwen3_reasoning_and_calls():
    out = QWEN3.parse(
        '<think>\nMultiply first.\n</think>\n\nOK.\n<tool_call>\n{"name": "calc", "arguments": '
        '{"e": "58*2"}}\n</tool_call>'
    )
    assert (out.reasoning, out.content, [c.arguments for c in out.calls]) == (
        "Multiply first.",
        "OK.",
        [{"e": "58*2"}],
    )
    msg = out.to_message()
    assert msg.reasoning == "Multiply first." and msg.content == "OK." and msg.tool_calls == out.calls
    assert msg.to_dict()["reasoning_content"] == "Multiply first."
    assert QWEN3.parse("<think>\n\n</think>\n\nThe answer is 4.") == ParsedOutput("The answer is 4.", [], "")
    assert QWEN3.parse("The answer is 4.") == ParsedOutput("The answer is 4.", [], None)
    # the generation prompt opened the block: only its end is in the output
    assert QWEN3.parse("still thinking\n</think>\n\nDone.") == ParsedOutput("Done.", [], "still thinking")
    # two blocks; a stray closing tag is dropped
    assert QWEN3.parse("<think>a</think>x <think>\nb\n</think>y</think>") == ParsedOutput("x y", [], "a\n\nb")
    # hermes keeps the tags in the content, which is why Qwen3 needs its own parser
    assert HERMES.parse("<think>\nhm\n</think>\n\nThe answer is 4.").content.startswith("<think>")
    assert isinstance(QWEN3, HermesParser) and "qwen3" in available_parsers()


def test_qwen3_unterminated_thought_is_reasoning_and_runs_no_calls():
    out = QWEN3.parse('Let me see. <think>\nI could call <tool_call>{"name": "f"}</tool_call> but the budget')
    assert out.content == "Let me see." and out.calls == []
    assert out.reasoning == 'I could call <tool_call>{"name": "f"}</tool_call> but the budget'


think_free = st.text(max_size=60).filter(lambda t: "<think>" not in t and "</think>" not in t)


@settings(max_examples=150, deadline=None)
@given(
    reasoning=think_free.filter(lambda t: t == t.strip("\n")),
    content=content_st.filter(lambda t: "<think>" not in t and "</think>" not in t),
    calls=calls_st,
)
def test_qwen3_round_trip(reasoning, content, calls):
    out = QWEN3.parse(QWEN3.render(content, calls, reasoning=reasoning))
    assert out.reasoning == reasoning and out.content == content
    assert [(c.name, c.arguments, c.parse_error) for c in out.calls] == [
        (c.name, c.arguments, None) for c in calls
    ]
    assert QWEN3.parse(QWEN3.render(content, calls)) == HERMES.parse(HERMES.render(content, calls))


think_tokens = st.sampled_from(
    [
        "<think>",
        "</think>",
        "<thi",
        "nk>",
        "</",
        "think>",
        "<tool_call>",
        "</tool_call>",
        '{"name": "f", "arguments": {}}',
        "\n",
        " ",
        "x",
    ]
)


@settings(max_examples=200, deadline=None)
@given(text=st.lists(think_tokens | st.text(max_size=6), max_size=30).map("".join))
def test_qwen3_never_leaks_a_think_tag_into_content(text):
    out = QWEN3.parse(text)
    assert "<think>" not in out.content and "</think>" not in out.content
    has_tags = "<think>" in text or "</think>" in text
    assert (out.reasoning is not None) == has_tags
    if not has_tags:
        assert out == HERMES.parse(text)
