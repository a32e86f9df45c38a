"""The recorded form of a session: one JSON object per session, one line in `sessions.jsonl`.

Version 2 stores every message once: the reset messages in `initial_messages`, then each turn's assistant
message and observation (lossless: tool calls keep their raw arguments and parse errors). What can be
derived from them is left out of the JSON and rebuilt on reading: a turn's `tool_calls` and `tool_results`,
and the trajectory's `messages`, `meta`, `reward`, `reward_components` and `termination` (each is written
only when it differs from its derivation). Version 1 records, which repeat all of these, still load.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from miles.engine import BASE_POLICY
from miles.envs.recipe import EnvRecipe
from miles.tito.spec import TokenizerSpec
from miles.trajectory import Trajectory, TrajectoryMeta
from miles.types import TerminationReason

RECORD_VERSION = 2


def jsonable(value: Any, _depth: int = 0) -> Any:
    """A JSON-safe copy of `value`: dataclasses and objects with `to_dict` become dicts, enums their
    values, non-finite floats strings, and anything else unknown its `repr`."""
    if _depth > 32:
        return repr(value)
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, enum.Enum):
        return jsonable(value.value, _depth + 1)
    if isinstance(value, dict):
        return {str(k): jsonable(v, _depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v, _depth + 1) for v in value]
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        try:
            return jsonable(to_dict(), _depth + 1)
        except Exception:  # a broken to_dict must not lose the record
            return repr(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return jsonable({f.name: getattr(value, f.name) for f in dataclasses.fields(value)}, _depth + 1)
    return repr(value)


def calls_view(assistant: dict[str, Any]) -> list[dict[str, Any]]:
    """A recorded assistant message's tool calls as a turn lists them: the OpenAI-style entries, with
    `parse_error` on calls that could not be parsed."""
    out = []
    for entry in assistant.get("tool_calls") or []:
        call = {k: v for k, v in entry.items() if k not in ("raw_arguments", "parse_error")}
        if entry.get("parse_error"):
            call["parse_error"] = entry["parse_error"]
        out.append(call)
    return out


def observed_tool_results(observation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tool results an observation shows: one `{call_id, name, content}` per tool message."""
    return [
        {
            "call_id": m.get("tool_call_id") or "",
            "name": m.get("name") or "",
            "content": m.get("content") or "",
        }
        for m in observation
        if m.get("role") == "tool"
    ]


@dataclass
class ErrorInfo:
    """A failure that ended a session or an attempt. `where` is one of reset, step, generate, session."""

    where: str
    type: str
    message: str
    engine_id: str = ""

    @classmethod
    def from_exception(cls, where: str, exc: BaseException, engine_id: str = "") -> ErrorInfo:
        return cls(where=where, type=type(exc).__name__, message=str(exc)[:2000], engine_id=engine_id)


@dataclass
class AttemptRecord:
    """One generate attempt of a turn that failed and was (or could have been) retried."""

    engine_id: str
    rid: str
    error: ErrorInfo
    duration_s: float


@dataclass
class TurnRecord:
    """One model turn: the generate call, the parsed message and the env step that followed.

    `output_start:output_end` indexes the generated tokens in the trajectory's `token_ids`; `finish_reason`
    is the engine's ("stop", "length", ...). `assistant` and `observation` are messages in their lossless
    record form (`miles.trajectory.message_record`); `tool_calls` and `tool_results` are views of them
    (unless the env reported its own tool results in `info["tool_results"]`).
    """

    index: int
    engine_id: str = ""
    rid: str = ""
    weight_version: int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_start: int = 0
    output_end: int = 0
    finish_reason: str = ""
    text: str = ""
    assistant: dict[str, Any] = field(default_factory=dict)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tool_results: list[dict[str, Any]] = field(default_factory=list)
    tool_errors: dict[str, int] = field(default_factory=dict)
    observation: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None
    terminated: bool = False
    truncated: bool = False
    deadline_s: float = 0.0
    queue_s: float = 0.0
    generate_s: float = 0.0
    env_s: float = 0.0
    attempts: list[AttemptRecord] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form; `tool_calls` and `tool_results` only when they differ from their derivation."""
        out = {name: getattr(self, name) for name in _TURN_FIELDS}
        out["attempts"] = [
            {"engine_id": a.engine_id, "rid": a.rid, "error": asdict(a.error), "duration_s": a.duration_s}
            for a in self.attempts
        ]
        if self.tool_calls == calls_view(self.assistant):
            del out["tool_calls"]
        if self.tool_results == observed_tool_results(self.observation):
            del out["tool_results"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TurnRecord:
        """Inverse of `to_dict` (reads version 1 turns too)."""
        data = dict(data)
        data["attempts"] = [
            AttemptRecord(**{**a, "error": ErrorInfo(**a["error"])}) for a in data.get("attempts", [])
        ]
        if "tool_calls" not in data:
            data["tool_calls"] = calls_view(data.get("assistant") or {})
        if "tool_results" not in data:
            data["tool_results"] = observed_tool_results(data.get("observation") or [])
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class SessionRecord:
    """Everything about one session: what it was asked to do, every turn, and how it ended.

    What rebuilds the episode: `recipe` (env id, constructor kwargs, user modules), `task` (reset seed and
    options), `tokenizer_spec` (tokenizer, chat-template override), `parser`, and each turn's output and
    finish reason. `tokenizer` is a readable "family:name" label. `policy_id` is the policy that generated
    it: a LoRA adapter's name, or "base".
    """

    session_id: str
    env_id: str = ""
    env_class: str = ""
    recipe: EnvRecipe | None = None
    task: dict[str, Any] = field(default_factory=dict)
    group_id: str = ""
    sample_index: int = 0
    seed: int | None = None
    sampling_params: dict[str, Any] = field(default_factory=dict)
    tokenizer: str = ""
    tokenizer_spec: TokenizerSpec | None = None
    parser: str = ""
    tools: list[dict[str, Any]] = field(default_factory=list)
    initial_messages: list[dict[str, Any]] = field(default_factory=list)
    reset_info: dict[str, Any] = field(default_factory=dict)
    turns: list[TurnRecord] = field(default_factory=list)
    termination: TerminationReason = TerminationReason.ABORTED
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    final_info: dict[str, Any] = field(default_factory=dict)
    error: ErrorInfo | None = None
    started_at: float = 0.0
    duration_s: float = 0.0
    trajectory: Trajectory = field(default_factory=Trajectory)
    version: int = RECORD_VERSION
    policy_id: str = BASE_POLICY

    @property
    def ok(self) -> bool:
        """True when the episode ended on its own terms (done or max_turns)."""
        return self.termination in (TerminationReason.DONE, TerminationReason.MAX_TURNS)

    @property
    def weight_versions(self) -> list[int | None]:
        return [t.weight_version for t in self.turns]

    def messages(self) -> list[dict[str, Any]]:
        """The conversation in record form: the reset messages, then each turn's assistant message (when the
        model produced one) and observation."""
        out = list(self.initial_messages)
        for t in self.turns:
            if t.assistant:
                out.append(t.assistant)
            out.extend(t.observation)
        return out

    def trajectory_meta(self) -> TrajectoryMeta:
        """The trajectory's provenance, from this record."""
        task_id = self.task.get("task_id") or str(self.reset_info.get("task_id", "") or "")
        return TrajectoryMeta(
            env_id=self.env_id,
            task_id=task_id,
            seed=self.seed,
            group_id=self.group_id,
            sample_index=self.sample_index,
            session_id=self.session_id,
            sampling_params=self.sampling_params,
            policy_id=self.policy_id,
        )

    def _derived_trajectory(self) -> dict[str, Any]:
        return {
            "messages": self.messages(),
            "meta": asdict(self.trajectory_meta()),
            "reward": self.reward,
            "reward_components": self.reward_components,
            "termination": self.termination.value,
        }

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (each message once). Free-form parts (task, infos, tool results) were made JSON-safe
        when captured."""
        out = {name: getattr(self, name) for name in _SESSION_FIELDS}
        out["recipe"] = self.recipe.to_record() if self.recipe else None
        out["tokenizer_spec"] = self.tokenizer_spec.to_record() if self.tokenizer_spec else None
        out["termination"] = self.termination.value
        out["turns"] = [t.to_dict() for t in self.turns]
        out["error"] = asdict(self.error) if self.error else None
        traj = self.trajectory.to_dict()
        for key, value in self._derived_trajectory().items():
            if traj[key] == value:
                del traj[key]
        out["trajectory"] = traj
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SessionRecord:
        """Inverse of `to_dict`; reads version 1 records too. Unknown keys (from newer writers) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in data.items() if k in names and k != "trajectory"}
        kw["recipe"] = EnvRecipe.from_record(data["recipe"]) if data.get("recipe") else None
        kw["tokenizer_spec"] = (
            TokenizerSpec.from_record(data["tokenizer_spec"]) if data.get("tokenizer_spec") else None
        )
        kw["termination"] = TerminationReason(data.get("termination", "aborted"))
        kw["turns"] = [TurnRecord.from_dict(t) for t in data.get("turns", [])]
        kw["error"] = ErrorInfo(**data["error"]) if data.get("error") else None
        kw.setdefault("version", 1)
        rec = cls(**kw)
        if data.get("trajectory"):
            rec.trajectory = Trajectory.from_dict({**rec._derived_trajectory(), **data["trajectory"]})
        return rec


_TURN_FIELDS = tuple(f.name for f in dataclasses.fields(TurnRecord))
_SESSION_FIELDS = tuple(f.name for f in dataclasses.fields(SessionRecord))
