"""`miles tito check`: a battery of scripted conversations through one tokenizer, reporting append-only-ness.

Each scenario plays a conversation with a template-faithful "model" (its outputs are the template's own
rendering of the scripted assistant messages) and checks the accumulated ids against the canonical render.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.engine import FinishReason
from miles.tito.conversation import Conversation
from miles.tito.errors import DeltaPrefixError
from miles.tito.loading import load_tokenizer
from miles.tito.report import TITOReport
from miles.tito.spec import resolve_chat_template
from miles.tito.tokenizer import MessageLike, TITOTokenizer
from miles.types import Message, ToolCall

CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up a record by key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}
TOOLS = [CALC_TOOL, LOOKUP_TOOL]


@dataclass
class Turn:
    """One scripted model turn and what the environment answers (None: the conversation ends here).

    `assistant` may be an OpenAI-style dict (arguments as JSON strings), as a client would send it: the model's
    output is the template's rendering of exactly that dict. `truncate_to_text`: the engine stops on max
    tokens right after this prefix of the turn's text.
    """

    assistant: MessageLike
    observation: list[Message] | None = None
    truncate_to_text: str | None = None


@dataclass
class Scenario:
    name: str
    description: str
    messages: list[Message]
    turns: list[Turn]
    tools: list[dict] | None = field(default_factory=lambda: list(TOOLS))


@dataclass
class ScenarioResult:
    """`append_only`: every delta was a prefix extension and the canonical re-render equals the accumulated ids."""

    name: str
    description: str
    append_only: bool
    ok: bool
    num_tokens: int
    mismatch_tokens: dict[str, int]
    explanations: list[str]
    error: str | None = None


@dataclass
class CheckReport:
    tokenizer: str
    family: str
    handler: str
    scenarios: list[ScenarioResult]

    @property
    def append_only(self) -> bool:
        return all(s.append_only for s in self.scenarios)

    @property
    def ok(self) -> bool:
        """Every difference is explained by the family handler, and no delta broke the prefix rule."""
        return all(s.ok for s in self.scenarios)


def _call(i: int, name: str, **args: Any) -> ToolCall:
    return ToolCall(name=name, arguments=args, id=f"call_{i}")


def _tool(i: int, content: str, name: str = "calculate") -> Message:
    return Message(role="tool", content=content, tool_call_id=f"call_{i}", name=name)


def _openai_call(i: int, name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}


def scenarios() -> list[Scenario]:
    """The battery: multi-turn, parallel calls, empty outputs, unicode, long outputs, thinking, truncation."""
    sys_msg = Message(role="system", content="You are a careful assistant. Use tools when they help.")
    q = Message(role="user", content="What is 37 + 58 * 2?")
    long_text = " ".join(
        f"Step {i}: add {i * 7} to the total, which becomes {i * (i + 1) * 7 // 2}." for i in range(1, 120)
    )
    return [
        Scenario(
            "single_turn",
            "one question, one answer, no tools",
            [Message(role="user", content="Say hello.")],
            [Turn(Message("assistant", "Hello!"))],
            tools=None,
        ),
        Scenario(
            "multi_turn_tools",
            "three sequential tool calls, then the answer",
            [sys_msg, q],
            [
                Turn(
                    Message("assistant", "", [_call(0, "calculate", expression="58 * 2")]), [_tool(0, "116")]
                ),
                Turn(
                    Message("assistant", "", [_call(0, "calculate", expression="37 + 116")]),
                    [_tool(0, "153")],
                ),
                Turn(
                    Message("assistant", "Let me double-check.", [_call(0, "lookup", key="153")]),
                    [_tool(0, '{"key": "153", "value": "odd"}', "lookup")],
                ),
                Turn(Message("assistant", "The answer is 153.")),
            ],
        ),
        Scenario(
            "parallel_tool_calls",
            "three calls in one message, three results in one observation",
            [sys_msg, q],
            [
                Turn(
                    Message(
                        "assistant",
                        "",
                        [
                            _call(0, "calculate", expression="58 * 2"),
                            _call(1, "calculate", expression="37 + 116"),
                            _call(2, "lookup", key="x"),
                        ],
                    ),
                    [_tool(0, "116"), _tool(1, "153"), _tool(2, "none", "lookup")],
                ),
                Turn(Message("assistant", "The answer is 153.")),
            ],
        ),
        Scenario(
            "empty_tool_output",
            "a tool returns the empty string",
            [q],
            [
                Turn(Message("assistant", "", [_call(0, "lookup", key="missing")]), [_tool(0, "", "lookup")]),
                Turn(Message("assistant", "Nothing was found.")),
            ],
        ),
        Scenario(
            "unicode",
            "non-ASCII text in every role",
            [
                Message("system", "Réponds en français, s'il te plaît."),
                Message("user", "東京の天気は？ 🌧️ naïve café — Grüße"),
            ],
            [
                Turn(
                    Message("assistant", "Je vérifie… 🔎", [_call(0, "lookup", key="東京")]),
                    [_tool(0, "雨 🌧️, 18°C — «pluie»", "lookup")],
                ),
                Turn(Message("assistant", "À Tokyo il pleut : 18 °C. ☔")),
            ],
        ),
        Scenario(
            "long_output",
            "a final answer of several thousand characters",
            [q],
            [Turn(Message("assistant", long_text))],
        ),
        Scenario(
            "user_follow_up",
            "a second user query after the first answer",
            [sys_msg, q],
            [
                Turn(
                    Message("assistant", "", [_call(0, "calculate", expression="37 + 58 * 2")]),
                    [_tool(0, "153")],
                ),
                Turn(Message("assistant", "The answer is 153."), [Message("user", "And doubled?")]),
                Turn(
                    Message("assistant", "", [_call(0, "calculate", expression="153 * 2")]), [_tool(0, "306")]
                ),
                Turn(Message("assistant", "Doubled, it is 306.")),
            ],
        ),
        Scenario(
            "thinking",
            "assistant turns with reasoning, tool results only in between",
            [q],
            [
                Turn(
                    Message(
                        "assistant",
                        "",
                        [_call(0, "calculate", expression="37 + 58 * 2")],
                        reasoning="Multiplication first: 58 * 2 = 116, then add 37.",
                    ),
                    [_tool(0, "153")],
                ),
                Turn(Message("assistant", "The answer is 153.", reasoning="The tool says 153.")),
            ],
        ),
        Scenario(
            "thinking_follow_up",
            "reasoning turns, then a new user query",
            [q],
            [
                Turn(
                    Message("assistant", "The answer is 153.", reasoning="58 * 2 = 116; 116 + 37 = 153."),
                    [Message("user", "Are you sure?")],
                ),
                Turn(Message("assistant", "Yes, 153.", reasoning="Check: 153 - 37 = 116 = 58 * 2.")),
            ],
        ),
        Scenario(
            "string_arguments",
            "OpenAI-style arguments as JSON strings with their own spacing",
            [q],
            [
                Turn(
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [
                            _openai_call(0, "calculate", '{"expression":"58*2"}'),
                            _openai_call(1, "lookup", '{ "key" :\t"a\\u00e9" }'),
                        ],
                    },
                    [_tool(0, "116"), _tool(1, "x", "lookup")],
                ),
                Turn(Message("assistant", "The answer is 153.")),
            ],
        ),
        Scenario(
            "max_tokens",
            "the engine stops on max tokens inside a turn; the stop token is inserted",
            [q],
            [
                Turn(
                    Message(
                        "assistant", "The answer is 153 and here is a long explanation that gets cut off."
                    ),
                    [Message("user", "You were cut off. Just the number?")],
                    truncate_to_text="The answer is 153",
                ),
                Turn(Message("assistant", "153")),
            ],
        ),
    ]


def play(tito: TITOTokenizer, scenario: Scenario) -> TITOReport:
    """Run one scenario through a `Conversation` with template-faithful outputs and check it."""
    conv = Conversation(tito, scenario.messages, scenario.tools)
    for version, turn in enumerate(scenario.turns):
        ids = tito.expected_generation(conv.messages, turn.assistant, scenario.tools)
        recorded = turn.assistant
        finish = FinishReason.STOP
        if turn.truncate_to_text is not None:
            ids = ids[: len(tito.encode(turn.truncate_to_text))]
            finish = FinishReason.LENGTH
        text = conv.append_generation(ids, [-0.5] * len(ids), weight_version=version, finish_reason=finish)
        if turn.truncate_to_text is not None:
            recorded = Message("assistant", text)
        if turn.observation is None:
            conv.finish(recorded)
            break
        conv.append_observation(recorded, turn.observation)
    return conv.check()


def run_check(
    tokenizer_spec: str | Path | Any,
    family: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    chat_template: str | None = None,
) -> CheckReport:
    """Run the battery through one tokenizer: a spec for `load_tokenizer`, or a loaded HF tokenizer, with an
    optional chat-template override (a `CHAT_TEMPLATES` name or a .jinja path)."""
    tok = load_tokenizer(tokenizer_spec) if isinstance(tokenizer_spec, str | Path) else tokenizer_spec
    tito = TITOTokenizer(
        tok,
        family,
        chat_template=resolve_chat_template(chat_template),
        chat_template_kwargs=chat_template_kwargs,
    )
    results = []
    for sc in scenarios():
        try:
            report = play(tito, sc)
        except DeltaPrefixError as exc:
            results.append(
                ScenarioResult(
                    sc.name,
                    sc.description,
                    append_only=False,
                    ok=False,
                    num_tokens=0,
                    mismatch_tokens={},
                    explanations=[],
                    error=str(exc),
                )
            )
            continue
        explanations = sorted({m.explanation for m in report.mismatches if m.explanation})
        results.append(
            ScenarioResult(
                sc.name,
                sc.description,
                append_only=report.exact,
                ok=report.ok,
                num_tokens=report.num_tokens,
                mismatch_tokens=report.counts(),
                explanations=explanations,
                error=None if report.ok else report.summary(),
            )
        )
    name = str(tokenizer_spec) if isinstance(tokenizer_spec, str | Path) else getattr(tok, "name_or_path", "")
    if chat_template:
        name += f" + {chat_template}"
    return CheckReport(
        tokenizer=name, family=tito.family, handler=tito.handler.description, scenarios=results
    )


def format_report(report: CheckReport, *, width: int = 120) -> str:
    """A human-readable table of a `CheckReport` (rich), ending with one verdict line."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"TITO check: {report.tokenizer} (family {report.family})")
    for col in ("scenario", "tokens", "append-only", "handled", "mismatching tokens", "note"):
        table.add_column(col)
    for s in report.scenarios:
        counts = ", ".join(f"{k}={v}" for k, v in s.mismatch_tokens.items() if v) or "-"
        note = ", ".join(s.explanations) or (s.error.splitlines()[0] if s.error else "")
        table.add_row(
            s.name, str(s.num_tokens), "yes" if s.append_only else "no", "yes" if s.ok else "NO", counts, note
        )
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False, color_system=None)
    console.print(table)
    console.print(f"handler: {report.handler}")
    verdict = (
        "append-only in every scenario"
        if report.append_only
        else "not append-only everywhere; every difference is handled"
        if report.ok
        else "UNHANDLED differences (see notes)"
    )
    console.print(f"verdict: {verdict}")
    return buf.getvalue()
