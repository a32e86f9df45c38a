"""Replay recorded sessions without an engine: list and filter them, render one, re-drive its env with
the recorded model outputs (`check`, `rescore`) and verify its token alignment (`check_tito`)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from miles.config import ConfigError
from miles.engine import FinishReason
from miles.envs.recipe import error_line, import_user_modules
from miles.sessions.records import ErrorInfo, SessionRecord, TurnRecord, jsonable
from miles.sessions.session import tool_results_of
from miles.tito.conversation import Conversation
from miles.tito.spec import TokenizerSpec
from miles.trajectory import message_from_record, message_record
from miles.types import Message, TerminationReason


class ReplayError(RuntimeError):
    """A recorded session cannot be replayed (env or tokenizer cannot be rebuilt, record incomplete)."""


# ---- listing -----------------------------------------------------------------------------------------
def filter_records(
    records: Iterable[SessionRecord],
    *,
    env: str | None = None,
    min_reward: float | None = None,
    max_reward: float | None = None,
    termination: str | Iterable[str] | None = None,
    session: str | None = None,
) -> list[SessionRecord]:
    """Records matching every given filter (`termination` may be one reason or several)."""
    reasons: set[str] | None = None
    if termination is not None:
        reasons = {termination} if isinstance(termination, str) else set(termination)
        bad = reasons - {t.value for t in TerminationReason}
        if bad:
            raise ValueError(
                f"unknown termination reason(s) {sorted(bad)}; known: {[t.value for t in TerminationReason]}"
            )
    out = []
    for r in records:
        if env is not None and r.env_id != env:
            continue
        if min_reward is not None and r.reward < min_reward:
            continue
        if max_reward is not None and r.reward > max_reward:
            continue
        if reasons is not None and r.termination.value not in reasons:
            continue
        if session is not None and r.session_id != session:
            continue
        out.append(r)
    return out


def list_table(records: Iterable[SessionRecord]) -> Table:
    """One row per session."""
    t = Table(show_header=True, header_style="bold")
    for col in ("session", "env", "task", "group", "turns", "tokens", "reward", "termination", "error", "s"):
        t.add_column(col, overflow="fold")
    for r in records:
        err = f"{r.error.where}: {r.error.type}" if r.error else ""
        t.add_row(
            r.session_id,
            r.env_id,
            str(r.task.get("task_id") or ""),
            r.group_id,
            str(len(r.turns)),
            str(len(r.trajectory)),
            f"{r.reward:.3f}",
            r.termination.value,
            err,
            f"{r.duration_s:.2f}",
        )
    return t


# ---- rendering ---------------------------------------------------------------------------------------
def _message_text(m: dict[str, Any]) -> Text:
    out = Text()
    out.append(f"[{m.get('role', '?')}] ", style="bold")
    out.append(str(m.get("content") or ""))
    for c in m.get("tool_calls") or []:
        fn = c.get("function", c)
        out.append(f"\n  -> {fn.get('name')}({jsonable(fn.get('arguments'))})", style="cyan")
        if c.get("parse_error"):
            out.append(f"  [parse error: {c['parse_error']}]", style="red")
    return out


def token_view(record: SessionRecord, tokenizer: Any = None) -> Text:
    """The trajectory's tokens span by span; masked spans (loss mask 0) dim, generated spans green.

    Each span is labelled `[role start:end mask=m v=weight_version]`; with a tokenizer the span's text is
    shown, otherwise its ids.
    """
    traj = record.trajectory
    out = Text()
    spans = traj.spans or []
    for s in spans:
        ids = traj.token_ids[s.start : s.end]
        masked = not any(traj.loss_mask[s.start : s.end])
        label = f"[{s.role} {s.start}:{s.end} mask={0 if masked else 1}"
        label += f" v={s.weight_version}]" if s.weight_version is not None else "]"
        out.append(label, style="dim bold" if masked else "bold green")
        body = (
            tokenizer.decode(ids, skip_special_tokens=False)
            if tokenizer is not None
            else " ".join(map(str, ids))
        )
        out.append(body + "\n", style="dim" if masked else "green")
    if not spans and traj.token_ids:
        out.append(" ".join(map(str, traj.token_ids)))
    return out


def render_session(record: SessionRecord, tokenizer: Any = None) -> Group:
    """A session as readable turns, then its token view."""
    head = Text(
        f"{record.session_id}  env={record.env_id}  task={record.task.get('task_id')}  "
        f"termination={record.termination.value}  reward={record.reward:.4g} "
        f"{record.reward_components}"
    )
    if record.error:
        head.append(
            f"\nerror in {record.error.where}: {record.error.type}: {record.error.message}", style="red"
        )
    parts: list[Any] = [head]
    parts.append(
        Panel(
            Text("\n").join(_message_text(m) for m in record.initial_messages) or Text("(none)"),
            title="reset",
        )
    )
    for t in record.turns:
        body = Text()
        body.append(
            f"engine={t.engine_id} v={t.weight_version} rid={t.rid} prompt={t.prompt_tokens} "
            f"cached={t.cached_tokens} finish={t.finish_reason} deadline={t.deadline_s:.2f}s "
            f"generate={t.generate_s:.3f}s env={t.env_s:.3f}s\n",
            style="dim",
        )
        for a in t.attempts:
            body.append(f"failed attempt on {a.engine_id}: {a.error.type}: {a.error.message}\n", style="red")
        if t.assistant:
            body.append_text(_message_text(t.assistant))
            body.append("\n")
        for m in t.observation:
            body.append_text(_message_text(m))
            body.append("\n")
        if t.tool_errors:
            body.append(f"tool errors: {t.tool_errors}\n", style="red")
        if t.reward is not None:
            body.append(
                f"reward={t.reward:.4g} terminated={t.terminated} truncated={t.truncated}", style="dim"
            )
        parts.append(Panel(body, title=f"turn {t.index}"))
    parts.append(Panel(token_view(record, tokenizer), title="tokens (dim: masked, green: generated)"))
    return Group(*parts)


# ---- re-driving the env ------------------------------------------------------------------------------
@dataclass
class Divergence:
    """The first place where the replayed env disagrees with the recording. `turn` is -1 for reset."""

    turn: int
    field: str
    recorded: Any
    replayed: Any

    def describe(self) -> str:
        where = "reset" if self.turn < 0 else f"turn {self.turn}"
        return f"{where}: {self.field} differs\n  recorded: {self.recorded!r}\n  replayed: {self.replayed!r}"


@dataclass
class RedriveResult:
    """What re-driving one session produced: the first divergence (None when it matches), the new total
    reward and components, and how many steps were replayed."""

    session_id: str
    divergence: Divergence | None = None
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    error: ErrorInfo | None = None

    @property
    def ok(self) -> bool:
        return self.divergence is None and self.error is None


def _import_path(path: str) -> Any:
    module, _, qual = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def env_for(record: SessionRecord) -> Any:
    """A fresh env for `record`, built as the session's was: from its recorded `recipe` (the user modules
    imported, the registered id made with the recorded constructor kwargs). Records without a recipe (a
    scheduler built from an env factory, older records) import the module of their recorded class (from the
    working folder, which registers a user's env), then `miles.envs.make(env_id)` when the id is registered,
    else the class built without arguments. Raises `ReplayError` when the env cannot be rebuilt."""
    if record.recipe is not None:
        return _env_from_recipe(record)
    errors = []
    module = record.env_class.partition(":")[0]
    if module and not module.startswith("miles."):  # a user's env (a scheduler built from a factory): its
        try:  # module, imported from the working folder as `env.import` does, registers its id and tasks
            import_user_modules([module])
        except ConfigError as exc:
            errors.append(exc.message)
    try:
        from miles.envs import make, registry

        if record.env_id in registry():
            return make(record.env_id)
    except Exception as exc:
        errors.append(f"miles.envs.make({record.env_id!r}): {exc}")
    if record.env_class:
        try:
            return _import_path(record.env_class)()
        except Exception as exc:
            errors.append(f"{record.env_class}(): {exc}")
    raise ReplayError(
        f"cannot rebuild env {record.env_id!r} of session {record.session_id}: "
        + ("; ".join(errors) or "no env id or class recorded")
    )


def _env_from_recipe(record: SessionRecord) -> Any:
    from miles.envs import make, registry

    recipe = record.recipe
    assert recipe is not None
    where = f"cannot rebuild env {recipe.id!r} of session {record.session_id}"
    try:
        recipe.import_modules()
    except ConfigError as exc:
        if recipe.id not in registry():  # not registered by an --import module either
            raise ReplayError(
                f"{where}: {exc.message}; or pass --import MODULE (a module name or a .py path)"
            ) from exc
    try:
        return make(recipe.id, **recipe.kwargs)
    except Exception as exc:
        raise ReplayError(f"{where} with kwargs {recipe.kwargs}: {error_line(exc)}") from exc


def _reset_options(record: SessionRecord) -> dict[str, Any]:
    options = dict(record.task.get("options") or {})
    row = options.get("task")
    if isinstance(row, dict):
        from miles.envs import Task

        options["task"] = Task.from_row(row, default_id=str(record.task.get("task_id") or "task"))
    return options


def _results_view(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: r.get(k) for k in ("name", "content", "error") if k in r} for r in results]


def _messages_view(messages: list[Message], record: SessionRecord) -> list[dict[str, Any]]:
    """Messages in the form `record` stores them: lossless since version 2, plain `to_dict` before."""
    return [message_record(m) if record.version >= 2 else m.to_dict() for m in messages]


@functools.cache
def _parser_named(name: str) -> Any:
    from miles.tools import get_parser

    try:
        return get_parser(name)
    except Exception:  # "env" (the env's own parse_action) or a parser this version does not have
        return None


def recorded_action(record: SessionRecord, turn: TurnRecord) -> Message:
    """The assistant message the session's env was given in `turn`.

    Version 2 records store it losslessly. Version 1 records lost the tool calls' parse errors (such as
    "the <tool_call> tag was not closed" on a turn cut by the token limit), so there the recorded text is
    re-parsed with the recorded parser, and used when it gives the recorded message back.
    """
    recorded = message_from_record(turn.assistant)
    if record.version >= 2:
        return recorded
    parser = _parser_named(record.parser)
    if parser is None:
        return recorded
    again = parser.parse(turn.text).to_message()
    return again if again.to_dict() == recorded.to_dict() else recorded


#: Sessions the run ended from outside (an abort, a deadline, a failed engine), possibly in the middle of an
#: env step whose outcome was therefore never recorded.
_CUT_SHORT = (TerminationReason.ABORTED, TerminationReason.TIMEOUT, TerminationReason.ENGINE_ERROR)


#: The class an external agent's sessions record (`rollout.agent`, the OpenAI endpoint).
AGENT_SESSION_CLASS = "miles.sessions.openai.session:OpenAISession"


def is_agent_record(record: SessionRecord) -> bool:
    """Whether `record` is a session an external agent drove through the OpenAI endpoint."""
    return record.env_class == AGENT_SESSION_CLASS


async def _redrive_agent(record: SessionRecord, env: Any, out: RedriveResult) -> RedriveResult:
    """What an agent's session can promise: the env stepped with the recorded assistant messages gives, for
    every tool result the env ran for the agent (`env: true`), the same name and content, and ends with the
    recorded reward when the env scored the session. The agent's own tool results, its end of the session and
    the turns it never answered are its business, not the env's."""
    total, components = 0.0, {}
    for turn in record.turns:
        if not turn.assistant:
            break
        try:
            obs, reward, terminated, truncated, info = await env.astep(recorded_action(record, turn))
        except Exception as exc:
            out.error = ErrorInfo.from_exception("step", exc)
            out.divergence = Divergence(turn.index, "step", "returned", f"raised {type(exc).__name__}: {exc}")
            return out
        out.steps += 1
        replayed = {r.get("call_id"): r for r in tool_results_of(obs, info)}
        for r in turn.tool_results:
            if r.get("env"):
                new = replayed.get(r.get("call_id"), {})
                if _results_view([r]) != _results_view([{k: new.get(k) for k in ("name", "content")}]):
                    out.divergence = Divergence(turn.index, "env tool result", r, new)
                    return out
        total += float(reward)
        if terminated or truncated:
            components = {str(k): float(v) for k, v in (info.get("reward_components") or {}).items()}
            break
    out.reward, out.reward_components = total, components
    info = record.final_info
    last_branch = info.get("branch", 0) == info.get("branches", 1) - 1
    scored = record.ok and info.get("reward_source") == "env" and last_branch
    if scored and (abs(total - record.reward) > 1e-9 or components != record.reward_components):
        out.divergence = Divergence(
            len(record.turns), "final reward", (record.reward, record.reward_components), (total, components)
        )
    return out


async def redrive(record: SessionRecord, env: Any, *, parser: Any = None) -> RedriveResult:
    """Reset `env` as the session did and feed it the recorded assistant messages, comparing the
    observations, tool results, rewards and end flags turn by turn. With `parser`, the recorded text is
    re-parsed and the parsed message compared too (and used as the action). An external agent's session is
    checked for what it can promise (`_redrive_agent`)."""
    out = RedriveResult(record.session_id)
    rec_task_seed = record.task.get("seed")
    seed = rec_task_seed if rec_task_seed is not None else record.seed
    try:
        obs, _ = await env.areset(seed=seed, options=_reset_options(record))
    except Exception as exc:
        if record.error is not None and record.error.where == "reset":
            return out
        out.error = ErrorInfo.from_exception("reset", exc)
        out.divergence = Divergence(-1, "reset", "succeeded", f"raised {type(exc).__name__}: {exc}")
        return out
    if is_agent_record(record):  # its first messages are the agent's own request
        return await _redrive_agent(record, env, out)
    replayed = _messages_view(obs, record)
    if record.error is not None and record.error.where == "reset":
        out.divergence = Divergence(-1, "reset", f"raised {record.error.type}", "succeeded")
        return out
    if replayed != record.initial_messages:
        out.divergence = Divergence(-1, "observation", record.initial_messages, replayed)
        return out
    total = 0.0
    for turn in record.turns:
        if not turn.assistant:
            break  # the turn never got a model output (engine error, timeout, abort)
        action = recorded_action(record, turn)
        if parser is not None:
            action = parser.parse(turn.text).to_message()
            reparsed = _messages_view([action], record)[0]
            if reparsed != turn.assistant:
                out.divergence = Divergence(turn.index, "parsed assistant message", turn.assistant, reparsed)
                return out
        stepped = turn.reward is not None
        try:
            obs, reward, terminated, truncated, info = await env.astep(action)
        except Exception as exc:
            if not stepped and record.error is not None and record.error.where == "step":
                return out
            out.error = ErrorInfo.from_exception("step", exc)
            out.divergence = Divergence(turn.index, "step", "returned", f"raised {type(exc).__name__}: {exc}")
            return out
        out.steps += 1
        if not stepped and record.termination in _CUT_SHORT:
            return out  # the run ended the session during this env step: there is nothing recorded to compare
        if not stepped:
            recorded = f"raised {record.error.type}" if record.error else "not stepped"
            out.divergence = Divergence(turn.index, "step", recorded, "returned")
            return out
        new_obs = _messages_view(obs, record)
        results = tool_results_of(obs, info)
        checks = [
            ("tool results", _results_view(turn.tool_results), _results_view(results)),
            ("observation", turn.observation, new_obs),
            ("reward", turn.reward, float(reward)),
            ("terminated", turn.terminated, bool(terminated)),
            ("truncated", turn.truncated, bool(truncated)),
        ]
        total += float(reward)
        out.reward = total
        out.reward_components = {str(k): float(v) for k, v in (info.get("reward_components") or {}).items()}
        for name, rec_v, new_v in checks:
            if rec_v != new_v:
                out.divergence = Divergence(turn.index, name, rec_v, new_v)
                return out
        if terminated or truncated:
            break
    if record.ok and (abs(total - record.reward) > 1e-9 or out.reward_components != record.reward_components):
        out.divergence = Divergence(
            len(record.turns),
            "final reward",
            (record.reward, record.reward_components),
            (total, out.reward_components),
        )
    return out


async def check(
    record: SessionRecord, env_factory: Callable[[SessionRecord], Any] = env_for, *, parser: Any = None
) -> RedriveResult:
    """`redrive` on a fresh env; the env is closed afterwards. A factory that fails raises `ReplayError`."""
    try:
        env = env_factory(record)
    except ReplayError:
        raise
    except Exception as exc:
        raise ReplayError(
            f"cannot rebuild the env of session {record.session_id}: {error_line(exc)}"
        ) from exc
    try:
        return await redrive(record, env, parser=parser)
    finally:
        aclose = getattr(env, "aclose", None)
        try:
            if aclose is not None:
                await aclose()
        except Exception:
            pass


@dataclass
class Rescore:
    """A recorded reward next to the one the current reward functions give."""

    session_id: str
    recorded_reward: float
    reward: float
    recorded_components: dict[str, float]
    components: dict[str, float]
    divergence: Divergence | None = None

    @property
    def changed(self) -> bool:
        return abs(self.reward - self.recorded_reward) > 1e-9 or self.components != self.recorded_components


async def rescore(record: SessionRecord, env_factory: Callable[[SessionRecord], Any] = env_for) -> Rescore:
    """Recompute the reward by re-driving a fresh env with the recorded outputs. Sessions that ended in an
    error keep reward 0; a divergence before the end is reported alongside."""
    res = await check(record, env_factory)
    failed = not record.ok
    return Rescore(
        record.session_id,
        record.reward,
        0.0 if failed else res.reward,
        record.reward_components,
        {} if failed else res.reward_components,
        res.divergence if res.divergence is None or res.divergence.field != "final reward" else None,
    )


# ---- token alignment ---------------------------------------------------------------------------------
@dataclass
class TitoCheck:
    """Whether the recorded ids equal what TITO builds from the recorded messages and outputs."""

    session_id: str
    ok: bool
    message: str
    first_mismatch: int | None = None
    report: Any = None


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def legacy_tokenizer_name(label: str) -> str:
    """The `load_tokenizer` name in a version 1 record's "family:name_or_path" tokenizer label."""
    family, colon, path = label.partition(":")
    if not colon:
        family, path = "", label
    if path in ("tiny", "miles-tiny") or (family == "tiny" and not path):
        return "tiny"
    return path or label


def tokenizer_spec_for(
    record: SessionRecord, *, tokenizer: str | None = None, chat_template: str | None = None
) -> TokenizerSpec:
    """The spec that rebuilds the session's TITO tokenizer: the recorded one (older records: the tokenizer
    named by their label, with no template override), with `tokenizer` / `chat_template` overriding."""
    spec = record.tokenizer_spec or TokenizerSpec(legacy_tokenizer_name(record.tokenizer))
    if tokenizer is not None:
        spec = dataclasses.replace(spec, tokenizer=tokenizer, template_sha256="")
    if chat_template is not None:
        spec = dataclasses.replace(spec, chat_template=chat_template or None, template_sha256="")
    return spec


def check_tito(record: SessionRecord, tito: Any) -> TitoCheck:
    """Rebuild the conversation with `tito` (a `miles.tito.TITOTokenizer`) from the recorded reset messages,
    generated ids and observations, and compare ids and loss mask with the recording, then run TITO's own
    canonical re-render check of the rebuilt conversation (`report`: what the session recorded as
    `final_info["tito"]`). It passes when the ids align and the re-render finds no unexplained difference."""
    traj = record.trajectory
    if not traj.token_ids:
        return TitoCheck(record.session_id, True, "no tokens recorded")
    conv = Conversation(
        tito, [message_from_record(m) for m in record.initial_messages], tools=record.tools or None
    )
    for turn in record.turns:
        if turn.output_end <= turn.output_start and not turn.assistant:
            break
        prefix = traj.token_ids[: turn.output_start]
        pos = _first_diff(conv.prompt_ids, prefix)
        if pos is not None:
            return TitoCheck(
                record.session_id,
                False,
                f"turn {turn.index}: prompt ids differ from the recording at token {pos}",
                pos,
            )
        ids = traj.token_ids[turn.output_start : turn.output_end]
        lps = traj.rollout_logprobs[turn.output_start : turn.output_end]
        text = conv.append_generation(
            ids,
            lps,
            weight_version=turn.weight_version or 0,
            finish_reason=FinishReason(turn.finish_reason or "stop"),
        )
        if text != turn.text:
            return TitoCheck(
                record.session_id,
                False,
                f"turn {turn.index}: decoded text {text!r} differs from the recorded {turn.text!r}",
                turn.output_start,
            )
        assistant = (
            message_from_record(turn.assistant) if turn.assistant else Message(role="assistant", content=text)
        )
        if turn.reward is not None and not (turn.terminated or turn.truncated):
            conv.append_observation(assistant, [message_from_record(m) for m in turn.observation])
        else:
            conv.finish(assistant)
            break
    rebuilt = conv.trajectory
    pos = _first_diff(rebuilt.token_ids, traj.token_ids)
    if pos is not None:
        return TitoCheck(
            record.session_id,
            False,
            f"rebuilt ids differ from the recording at token {pos} "
            f"(rebuilt {len(rebuilt.token_ids)}, recorded {len(traj.token_ids)})",
            pos,
        )
    mpos = _first_diff(rebuilt.loss_mask, traj.loss_mask)
    if mpos is not None:
        return TitoCheck(record.session_id, False, f"loss mask differs at token {mpos}", mpos)
    report = conv.check()  # what the session recorded as final_info["tito"], so the two verdicts agree
    if not report.ok:
        return TitoCheck(
            record.session_id,
            False,
            f"{len(traj.token_ids)} tokens aligned, but the re-render differs outside what the model generated: "
            f"{report.summary()}",
            report=report,
        )
    return TitoCheck(
        record.session_id,
        True,
        f"{len(traj.token_ids)} tokens aligned; re-render: {report.summary().splitlines()[0]}",
        report=report,
    )


def console_for(stream: Any = None) -> Console:
    """A console on `stream` (stdout by default); colour only on a terminal, 200 columns off one."""
    probe = Console(file=stream)
    return Console(file=stream, highlight=False, soft_wrap=True, width=None if probe.is_terminal else 200)
