"""The recorded form of a session: one JSON object per session, one line in `sessions.jsonl`."""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from miles.trajectory import Trajectory
from miles.types import TerminationReason

RECORD_VERSION = 1


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

    `output_start:output_end` indexes the generated tokens in the trajectory's `token_ids`.
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
        out = {name: getattr(self, name) for name in _TURN_FIELDS}
        out["attempts"] = [{"engine_id": a.engine_id, "rid": a.rid, "error": asdict(a.error),
                            "duration_s": a.duration_s} for a in self.attempts]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TurnRecord:
        data = dict(data)
        data["attempts"] = [AttemptRecord(**{**a, "error": ErrorInfo(**a["error"])})
                            for a in data.get("attempts", [])]
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class SessionRecord:
    """Everything about one session: what it was asked to do, every turn, and how it ended."""

    session_id: str
    env_id: str = ""
    env_class: str = ""
    task: dict[str, Any] = field(default_factory=dict)
    group_id: str = ""
    sample_index: int = 0
    seed: int | None = None
    sampling_params: dict[str, Any] = field(default_factory=dict)
    tokenizer: str = ""
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

    @property
    def ok(self) -> bool:
        """True when the episode ended on its own terms (done or max_turns)."""
        return self.termination in (TerminationReason.DONE, TerminationReason.MAX_TURNS)

    @property
    def weight_versions(self) -> list[int | None]:
        return [t.weight_version for t in self.turns]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form. Free-form parts (task, infos, tool results) were made JSON-safe when captured."""
        out = {name: getattr(self, name) for name in _SESSION_FIELDS}
        out["termination"] = self.termination.value
        out["turns"] = [t.to_dict() for t in self.turns]
        out["error"] = asdict(self.error) if self.error else None
        out["trajectory"] = self.trajectory.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SessionRecord:
        """Inverse of `to_dict`; unknown keys (from newer writers) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in data.items() if k in names}
        kw["termination"] = TerminationReason(data.get("termination", "aborted"))
        kw["turns"] = [TurnRecord.from_dict(t) for t in data.get("turns", [])]
        kw["error"] = ErrorInfo(**data["error"]) if data.get("error") else None
        kw["trajectory"] = Trajectory.from_dict(data["trajectory"]) if data.get("trajectory") else Trajectory()
        return cls(**kw)


_TURN_FIELDS = tuple(f.name for f in dataclasses.fields(TurnRecord))
_SESSION_FIELDS = tuple(f.name for f in dataclasses.fields(SessionRecord))
