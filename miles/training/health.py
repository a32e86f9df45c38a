"""Whether a run is broken or learning: what each step's sessions did, and a one-line verdict when the engines
keep failing, the updates keep coming out NaN, or nothing has trained for `health.no_signal_steps` steps.

A step gives GRPO a signal only through a group whose rewards differ. A run whose groups all score alike (the
model never calls its tools, its calls never parse, the env fails, or the task is out of reach) spends its
whole budget on zero gradients; this module says so, and why, instead of printing a table.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from miles.config import ConfigError
from miles.sessions.records import ErrorInfo, SessionRecord
from miles.types import TerminationReason

#: Sessions that ended for infrastructure reasons say nothing about the policy: recorded, never trained on.
UNTRAINABLE = (TerminationReason.ENGINE_ERROR, TerminationReason.ABORTED, TerminationReason.ENV_ERROR)
SESSIONS = Path("sessions.jsonl")


@dataclass(frozen=True)
class HealthConfig:
    """The `health:` section: when a run that is broken or not learning stops (exit status 3, one line, no score).

    - `no_signal_steps`: after this many steps in a row without one group of differing rewards (nothing to
      learn from), the run prints a diagnosis and stops; 0 never stops. A step in which every session
      succeeded does not count: the policy has solved the task.
    - `on_no_signal`: `stop` (the default), or `continue`: print the diagnosis once and go on.
    - `engine_failure_steps`: after this many steps in a row in which most sessions failed in the engines
      (`engine_error`, `aborted`), none ran, or the weight update did not reach the engines, the run stops:
      the engines are dead or wedged.
    - `nonfinite_steps`: after this many updates in a row whose every optimizer step was skipped for a NaN
      or inf gradient (the weights did not move), the run stops.
    - `grace_s`: `max_seconds` is a hard wall: the step under way when the budget runs out, and the final
      evaluation, may take this much longer; past it, work in flight is aborted (engine calls included) and
      the run ends broken.
    """

    no_signal_steps: int = 20
    on_no_signal: Literal["stop", "continue"] = "stop"
    engine_failure_steps: int = 5
    nonfinite_steps: int = 3
    grace_s: float = 120.0

    def __post_init__(self) -> None:
        if self.no_signal_steps < 0:
            raise ConfigError("no_signal_steps", f"must be >= 0 (0: never stop), got {self.no_signal_steps}")
        for key in ("engine_failure_steps", "nonfinite_steps"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be >= 1, got {getattr(self, key)}")
        if not self.grace_s >= 0:
            raise ConfigError("grace_s", f"must be >= 0, got {self.grace_s}")


@dataclass(frozen=True)
class Verdict:
    """What the run's health says after a step: `reason` (one line), and whether the run must stop."""

    reason: str
    stop: bool


def first_nonfinite(state: Mapping[str, Any]) -> str | None:
    """The name of the first floating-point tensor of `state` holding a NaN or inf, or None."""
    for name, tensor in state.items():
        if (
            isinstance(tensor, torch.Tensor)
            and tensor.is_floating_point()
            and not bool(torch.isfinite(tensor).all())
        ):
            return name
    return None


@dataclass(frozen=True)
class StepActivity:
    """What one step's sessions did: counts by termination, tool calls, unparsable calls, and the groups
    whose rewards differ (the ones GRPO learns from)."""

    sessions: int
    groups: int
    informative_groups: int
    tool_calls: int
    parse_failures: int
    terminations: dict[str, int] = field(default_factory=dict)
    rewards: frozenset[float] = frozenset()
    has_tools: bool = False
    env_errors: tuple[tuple[str, ErrorInfo], ...] = ()  # (session id, error) of each env_error session
    successes: int = 0  # sessions the env judged a success

    @property
    def solved(self) -> bool:
        """Every session succeeded: the groups agree because the policy has the task, not because it is stuck."""
        return bool(self.sessions) and self.successes == self.sessions

    def metrics(self) -> dict[str, float]:
        """The step's row entries: `<termination>_sessions` for every termination, tool calls per session,
        unparsable tool calls and the share of groups with no reward spread."""
        row: dict[str, float] = {
            f"{reason.value}_sessions": float(self.terminations.get(reason.value, 0))
            for reason in TerminationReason
        }
        row["tool_calls_per_session"] = self.tool_calls / self.sessions if self.sessions else 0.0
        row["tool_parse_failures"] = float(self.parse_failures)
        row["informative_groups"] = float(self.informative_groups)
        return row


def step_activity(records: Iterable[SessionRecord]) -> StepActivity:
    """Summarise one step's sessions (the infrastructure failures count as sessions, never as signal)."""
    records = list(records)
    groups: dict[str, set[float]] = {}
    calls = failures = 0
    for r in records:
        if r.termination not in UNTRAINABLE and r.trajectory.num_generated:
            groups.setdefault(r.group_id or r.session_id, set()).add(float(r.reward))
        for turn in r.turns:
            calls += len(turn.tool_calls)
            failures += sum(1 for c in turn.tool_calls if c.get("parse_error"))
    return StepActivity(
        sessions=len(records),
        groups=len(groups),
        informative_groups=sum(len(g) > 1 for g in groups.values()),
        tool_calls=calls,
        parse_failures=failures,
        terminations=dict(Counter(r.termination.value for r in records)),
        rewards=frozenset(float(r.reward) for r in records),
        has_tools=any(r.tools for r in records),
        env_errors=tuple(
            (r.session_id, r.error)
            for r in records
            if r.termination == TerminationReason.ENV_ERROR and r.error is not None
        ),
        successes=sum(bool(r.final_info.get("success")) for r in records),
    )


def diagnose(window: list[StepActivity]) -> str:
    """Why the steps of `window` gave nothing to learn from, most basic cause first."""
    n = len(window)
    sessions = sum(a.sessions for a in window)
    ends: Counter[str] = Counter()
    for a in window:
        ends.update(a.terminations)
    calls = sum(a.tool_calls for a in window)
    failures = sum(a.parse_failures for a in window)
    head = f"nothing trained in {n} steps"
    if not sessions:
        return f"{head}: no session finished"
    for reason, cause in (
        (TerminationReason.ENGINE_ERROR, "the engines failed them"),
        (TerminationReason.ENV_ERROR, "the env raised (see each record's `error`)"),
        (TerminationReason.TIMEOUT, "they ran out of time"),
        (TerminationReason.ABORTED, "they were aborted"),
    ):
        if ends[reason.value] * 2 > sessions:
            return f"{head}: {ends[reason.value]} of {sessions} sessions ended {reason.value}: {cause}"
    if any(a.has_tools for a in window) and calls == 0:
        return (
            f"{head}: no session called a tool ({sessions} sessions answered without them); the model does "
            "not use the tool format its prompt shows: warm start it with SFT (sft.enabled: true)"
        )
    if calls and failures * 2 > calls:
        return (
            f"{head}: {failures} of {calls} tool calls could not be parsed; the model's tool-call format "
            "does not match the env's parser: warm start it with SFT (sft.enabled: true)"
        )
    rewards = sorted(set().union(*(a.rewards for a in window)))
    seen = ", ".join(f"{r:g}" for r in rewards[:4]) + (", ..." if len(rewards) > 4 else "")
    return (
        f"{head}: every group's samples got the same reward ({seen}), so GRPO has no signal; the task is "
        "out of reach (or solved) for this policy: warm start with SFT, make the task easier, or raise "
        "rollout.scheduler.group_size"
    )


class RunHealth:
    """Watches a run step by step; `observe` returns a `Verdict` when the run is broken or not learning:

    - `health.engine_failure_steps` steps in a row in which most sessions failed in the engines (or none ran);
    - `health.nonfinite_steps` updates in a row that were all skipped for a non-finite gradient;
    - `health.no_signal_steps` steps in a row with no informative group (`diagnose` says why; with
      `on_no_signal: continue` the verdict does not stop the run, and comes again only after a step that
      learned).

    A step whose session records could not all be written to `sessions` stops the run at once, so that no
    session it trains on goes unrecorded. `warn` gets one line the first time each new kind of env error
    appears, naming the session.
    """

    def __init__(
        self, config: HealthConfig, warn: Callable[[str], None] = print, *, sessions: Path = SESSIONS
    ) -> None:
        self.config = config
        self.warn = warn
        self.sessions = sessions
        self.window: list[StepActivity] = []
        self.reported = False
        self.engine_failures = 0
        self.nonfinite = 0
        self._env_errors_seen: set[str] = set()

    def observe(
        self, activity: StepActivity, row: Mapping[str, Any] | None = None, *, unrecorded: int = 0
    ) -> Verdict | None:
        """Take one step (its sessions, its metrics row when it trained, and how many session records of the run
        so far could not be written)."""
        if unrecorded:
            return Verdict(
                f"{unrecorded} session record(s) could not be written to {self.sessions} (the log says why); the "
                "run stops so that no session it trains on goes unrecorded",
                stop=True,
            )
        row = row or {}
        self._warn_env_errors(activity)
        failed = sum(
            activity.terminations.get(t.value, 0)
            for t in (TerminationReason.ENGINE_ERROR, TerminationReason.ABORTED)
        )
        sync_failed = bool(row.get("sync_failed"))
        bad_step = failed * 2 > activity.sessions or not activity.sessions or sync_failed
        self.engine_failures = self.engine_failures + 1 if bad_step else 0
        if self.engine_failures >= self.config.engine_failure_steps:
            n = self.config.engine_failure_steps
            last = "the weight update did not reach them, " if sync_failed else ""
            return Verdict(
                f"the engines failed {n} steps in a row (last step: {last}{failed} of {activity.sessions} "
                "sessions ended engine_error or aborted): they are dead or wedged; check them and "
                "continue with --resume",
                stop=True,
            )
        steps = float(row.get("optimizer_steps", 0.0))
        self.nonfinite = self.nonfinite + 1 if steps and row.get("nonfinite_steps", 0.0) >= steps else 0
        if self.nonfinite >= self.config.nonfinite_steps:
            return Verdict(
                f"the update was NaN or inf in {self.nonfinite} steps in a row (loss {row.get('loss')}, "
                f"grad norm {row.get('grad_norm')}); each was skipped and the weights are unchanged: "
                "lower trainer.lr, or look for extreme rewards or logprobs (miles replay)",
                stop=True,
            )
        return self._signal(activity)

    def _signal(self, activity: StepActivity) -> Verdict | None:
        if activity.informative_groups or activity.solved:  # a solved step is no sign of a broken run
            self.window.clear()
            self.reported = False
            return None
        self.window.append(activity)
        limit = self.config.no_signal_steps
        if not limit or len(self.window) < limit or self.reported:
            return None
        self.reported = True
        return Verdict(diagnose(self.window[-limit:]), stop=self.config.on_no_signal == "stop")

    def _warn_env_errors(self, activity: StepActivity) -> None:
        for session_id, error in activity.env_errors:
            kind = f"{error.where}:{error.type}"
            if kind not in self._env_errors_seen:
                self._env_errors_seen.add(kind)
                first_line = error.message.splitlines()[0][:200] if error.message else ""
                self.warn(
                    f"[warn] session {session_id} ended env_error in {error.where}: {error.type}: "
                    f"{first_line} (later ones are counted in env_error_sessions)"
                )
