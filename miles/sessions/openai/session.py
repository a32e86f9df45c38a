"""`OpenAISession`: the token record of one client session of the OpenAI endpoint.

The first request is rendered once with the chat template (`TITOTokenizer.start`). Each later request must
extend the session's history: its messages are compared structurally with what the session holds, and only
the new ones are appended, as TITO's observation delta; the model's earlier output stays the ids it generated,
whatever the client echoes back. A request that rewrites history is refused (409, `history_mismatch: error`)
or opens a new *branch* rendered from its messages (`fork`). Every branch becomes one `SessionRecord` with
its `Trajectory`, exactly as an internal session's.

A request is planned first (checked, prompt ids computed, nothing changed), then generated, then committed:
a request that fails anywhere leaves the session as it was, so a client may retry it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from miles.engine import FinishReason, GenerateResult, SamplingParams
from miles.envs.recipe import EnvRecipe
from miles.sessions.openai.config import OpenAISessionConfig, SamplingOverride
from miles.sessions.openai.schema import (
    ChatRequest,
    ClientReward,
    EndpointError,
    TokenLogprob,
    bad_request,
    first_difference,
)
from miles.sessions.records import ErrorInfo, SessionRecord, TurnRecord, calls_view, observed_tool_results
from miles.sessions.spec import SessionSpec
from miles.tito.conversation import Conversation
from miles.trajectory import message_record
from miles.types import Message, TerminationReason

_ERROR_ENDS = (
    TerminationReason.ENV_ERROR,
    TerminationReason.ENGINE_ERROR,
    TerminationReason.TIMEOUT,
    TerminationReason.ABORTED,
)


@dataclass(frozen=True)
class Score:
    """A session's reward, its named components, and the info to record with it (e.g. `success`)."""

    reward: float
    components: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Branch:
    """One token record of a session: rendered from `initial`, then grown turn by turn. `last` is the
    assistant message of the latest generation (its observation arrives with the next request)."""

    conv: Any
    tools: tuple[dict[str, Any], ...] | None
    initial: list[Message]
    started_at: float
    forked_at: int | None = None
    fork_reason: str = ""
    turns: list[TurnRecord] = field(default_factory=list)
    last: Message | None = None
    sampling: dict[str, Any] = field(default_factory=dict)

    def history(self) -> list[Message]:
        return [*self.conv.messages, *([self.last] if self.last is not None else [])]


@dataclass
class Plan:
    """A checked request: the prompt to generate from, and what committing the generation will append."""

    prompt: list[int]
    params: SamplingParams
    branch: Branch  # the branch to continue, or the new one
    new: bool
    observation: list[Message] = field(default_factory=list)
    appended: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Turn:
    """A committed generation: the parsed assistant message, its finish reason for the client, and logprobs."""

    message: Message
    finish_reason: Literal["stop", "length", "tool_calls"]
    record: TurnRecord
    logprobs: tuple[TokenLogprob, ...]


def _template_error(exc: Exception) -> EndpointError:
    return bad_request(
        f"the chat template cannot render these messages: {type(exc).__name__}: {exc}", "messages"
    )


def cut_at_stop(tito: Any, ids: list[int], stops: tuple[str, ...]) -> tuple[int, int] | None:
    """Where the first stop string ends in the decoded `ids`: (tokens to keep, characters of text before the
    stop string), or None when no stop string occurs."""
    if not stops or not ids:
        return None
    text = tito.decode(ids)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return None
    pos, stop = min(hits)
    lo, hi = 1, len(ids)  # the fewest tokens whose text holds the stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if stop in tito.decode(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo, pos


class OpenAISession:
    """One client session. `plan` checks a request, `commit` records its generation, `records` builds the
    `SessionRecord`s at the end. `spec`, `recipe`, `env_id` say what the session runs (set by the agent runner;
    a session opened by an unknown client has none)."""

    def __init__(
        self,
        session_id: str,
        *,
        tito: Any,
        parser: Any,
        config: OpenAISessionConfig,
        spec: SessionSpec | None = None,
        recipe: EnvRecipe | None = None,
        env_id: str = "openai",
        override: SamplingOverride | None = None,
        context_length: int | None = None,
    ) -> None:
        self.session_id = session_id
        self.token = session_id  # the credential a request must carry (the endpoint sets it when it opens)
        self.tito = tito
        self.parser = parser
        self.config = config
        self.spec = spec or SessionSpec(session_id=session_id)
        self.recipe = recipe
        self.env_id = env_id
        self.override = override or SamplingOverride()
        #: runs one of the env's tools for the agent (`POST /sessions/{id}/tools/{name}`); None: no env tools
        self.tools: Callable[[str, dict[str, Any]], Awaitable[Message]] | None = None
        #: (name, content) of every env tool answer not yet matched to a tool message of the agent's history
        self.env_answers: list[tuple[str, str]] = []
        self.context_length = config.context_length or context_length
        self.branches: list[Branch] = []
        self.lock = asyncio.Lock()
        self.started_at = time.time()
        self._t0 = time.monotonic()
        self.last_active = time.monotonic()
        self.turns = 0  # chat requests answered, over every branch
        self.max_turns_hit = False
        self.client_reward: ClientReward | None = None
        self.accept_client_reward = True
        self.policy = ""  # the `model` the client asked for
        self.inflight: tuple[Any, str] | None = None  # (engine, rid) while a generate call runs
        self.closing = False
        self.closed = asyncio.Event()
        self.result: list[SessionRecord] = []

    # ---- a request ---------------------------------------------------------------------------------------
    def sampling(self, request: ChatRequest) -> SamplingParams:
        """The request's sampling, with the session's overrides and the tokenizer's stop tokens."""
        o = self.override
        max_tokens = request.max_tokens or self.config.max_tokens
        if o.max_tokens is not None:
            max_tokens = min(max_tokens, o.max_tokens)
        stop_ids = list(self.tito.stop_token_ids)
        for s in request.stop:  # a stop string that is one token stops the engine; others are cut afterwards
            ids = self.tito.encode(s)
            if len(ids) == 1 and ids[0] not in stop_ids:
                stop_ids.append(ids[0])
        seed = request.seed if request.seed is not None else self.spec.seed
        return SamplingParams(
            temperature=o.temperature
            if o.temperature is not None
            else (request.temperature if request.temperature is not None else 1.0),
            top_p=o.top_p if o.top_p is not None else (request.top_p if request.top_p is not None else 1.0),
            top_k=request.top_k if request.top_k is not None else -1,
            max_new_tokens=max_tokens,
            stop_token_ids=tuple(stop_ids),
            seed=seed,
        )

    def plan(self, request: ChatRequest) -> Plan:
        """Check `request` against the session and compute its prompt ids. Changes nothing; raises
        `EndpointError` (409 for a history rewrite under `history_mismatch: error`, 400 for the rest)."""
        if self.closing:
            raise EndpointError(409, f"session {self.session_id!r} is closed", code="session_closed")
        if self.config.max_turns is not None and self.turns >= self.config.max_turns:
            self.max_turns_hit = True
            raise bad_request(
                f"session {self.session_id!r} reached max_turns ({self.config.max_turns}); close it",
                code="max_turns",
            )
        params = self.sampling(request)
        plan = self._continue(request, params) if self.branches else None
        if plan is None:
            plan = self._new_branch(request, params, None)
        limit = self.context_length
        if limit is not None and len(plan.prompt) + params.max_new_tokens > limit:
            raise bad_request(
                f"the prompt has {len(plan.prompt)} tokens and max_tokens is {params.max_new_tokens}: "
                f"together more than the context length {limit}; send fewer tokens or lower "
                "max_tokens",
                "messages",
                code="context_length_exceeded",
            )
        return plan

    def _continue(self, request: ChatRequest, params: SamplingParams) -> Plan | None:
        branch = self.branches[-1]
        history = branch.history()
        if request.tools != branch.tools:
            diff: tuple[int, str] | None = (-1, "the request's tools differ from the session's")
        else:
            diff = first_difference(history, request.messages)
        if diff is not None:
            index, why = diff
            where = "tools" if index < 0 else f"messages[{index}]"
            if self.config.history_mismatch == "error":
                raise EndpointError(
                    409,
                    f"{where} differs from session {self.session_id!r}'s history: {why}. "
                    "Send the history the session returned (history_mismatch: error)",
                    param=where,
                    code="history_mismatch",
                )
            return self._new_branch(request, params, (index, why))
        observation = list(request.messages[len(history) :])
        try:
            delta = self.tito.observation_delta(observation)
        except Exception as exc:  # the client's messages: TITOError, a template's raise_exception, ...
            raise _template_error(exc) from None
        close = [] if branch.conv.last_turn_closed else [self.tito.close_token_id]
        return Plan(branch.conv.prompt_ids + close + delta, params, branch, False, observation, close + delta)

    def _new_branch(self, request: ChatRequest, params: SamplingParams, fork: tuple[int, str] | None) -> Plan:
        try:
            conv = Conversation(
                self.tito, list(request.messages), tools=list(request.tools) if request.tools else None
            )
        except Exception as exc:  # the client's messages: TITOError, a template's raise_exception, ...
            raise _template_error(exc) from None
        branch = Branch(
            conv=conv,
            tools=request.tools,
            initial=list(request.messages),
            started_at=time.time(),
            forked_at=None if fork is None else fork[0],
            fork_reason="" if fork is None else fork[1],
            sampling=params.to_dict(),
        )
        return Plan(conv.prompt_ids, params, branch, True)

    def commit(
        self,
        plan: Plan,
        request: ChatRequest,
        result: GenerateResult,
        *,
        rid: str,
        queue_s: float = 0.0,
        generate_s: float = 0.0,
    ) -> Turn:
        """Append `plan`'s observation and `result`'s output to the branch, parse the output and record the
        turn. Returns the assistant message as the client will see it."""
        branch = plan.branch
        if plan.new:
            self.branches.append(branch)
        else:
            appended = branch.conv.append_observation(branch.last, plan.observation)
            if appended != plan.appended:  # the template rendered the same messages differently twice
                raise EndpointError(
                    500,
                    "internal error: the observation rendered differently when appended",
                    kind="server_error",
                )
            prev = branch.turns[-1]
            prev.observation = [message_record(m) for m in plan.observation]
            prev.tool_results = self._tool_results(branch.last, prev.observation)
            prev.reward = 0.0
        ids, lps = list(result.output_ids), list(result.output_logprobs)
        kept = None if result.kept_counts is None else list(result.kept_counts)
        finish = result.finish_reason
        cut = cut_at_stop(self.tito, ids[:-1] if ids and self.tito.is_stop(ids[-1]) else ids, request.stop)
        if cut is not None:
            ids, lps, finish = ids[: cut[0]], lps[: cut[0]], FinishReason.STOP
            kept = None if kept is None else kept[: cut[0]]
        conv = branch.conv
        turn = TurnRecord(
            index=len(branch.turns),
            engine_id=result.engine_id,
            rid=rid,
            weight_version=result.weight_version,
            prompt_tokens=len(plan.prompt),
            cached_tokens=result.cached_tokens,
            output_start=len(conv),
            finish_reason=finish.value,
            queue_s=queue_s,
            generate_s=generate_s,
        )
        text = conv.append_generation(
            ids, lps, weight_version=result.weight_version, finish_reason=finish, kept_counts=kept
        )
        turn.output_end = len(conv)
        turn.text = text
        message = self._parse(text[: cut[1]] if cut is not None else text, request.tool_choice)
        turn.assistant = message_record(message)
        turn.tool_calls = calls_view(turn.assistant)
        branch.turns.append(turn)
        branch.last = message
        self.turns += 1
        self.last_active = time.monotonic()
        self.policy = request.model or self.policy
        reason: Literal["stop", "length", "tool_calls"] = (
            "length" if finish is FinishReason.LENGTH else "tool_calls" if message.tool_calls else "stop"
        )
        shown = ids[:-1] if ids and self.tito.is_stop(ids[-1]) else ids
        logprobs = tuple(TokenLogprob(self.tito.decode([i]), lp) for i, lp in zip(shown, lps, strict=False))
        return Turn(message, reason, turn, logprobs)

    def _parse(self, text: str, tool_choice: str) -> Message:
        parsed = self.parser.parse(text)
        if tool_choice == "none":  # the model's text as it is, tool-call markup included
            content = text.strip() if parsed.reasoning is None else text.rsplit("</think>", 1)[-1].strip()
            return Message("assistant", content, reasoning=parsed.reasoning)
        message = parsed.to_message()
        for k, call in enumerate(
            message.tool_calls
        ):  # unique in the session (parsers number from 0 per message)
            call.id = f"call_{self.turns}_{k}"
        return message

    # ---- the end -----------------------------------------------------------------------------------------
    def branch_id(self, k: int) -> str:
        """The recorded session id of branch `k`: the session's id, then `<id>.fork<k>`."""
        return self.session_id if k == 0 else f"{self.session_id}.fork{k}"

    def _tool_results(
        self, action: Message | None, observation: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """The tool results of an agent's observation: each named after the call it answers, and marked
        `env: true` when its content is an answer of the env's own tool (`POST /sessions/{id}/tools/{name}`),
        so that a replay compares it with what the env answers."""
        names = {c.id: c.name for c in action.tool_calls} if action is not None else {}
        results = observed_tool_results(observation)
        for r in results:
            r["name"] = r["name"] or names.get(r["call_id"], "")
            if (r["name"], r["content"]) in self.env_answers:
                self.env_answers.remove((r["name"], r["content"]))
                r["env"] = True
        return results

    def records(
        self,
        termination: TerminationReason,
        score: Score | None,
        error: ErrorInfo | None = None,
        *,
        reward_source: str = "none",
    ) -> list[SessionRecord]:
        """Finish every branch and build its `SessionRecord` (with the `Trajectory`): every branch gets the
        session's `termination` and `score` (reward 0 when it ended in an error); `final_info` holds the score's
        info, the branch, and TITO's mismatch classification of the branch (`tito`)."""
        failed = termination in _ERROR_ENDS
        reward = 0.0 if failed or score is None else float(score.reward)
        components = (
            {} if failed or score is None else {str(k): float(v) for k, v in score.components.items()}
        )
        base_info: dict[str, Any] = {
            **(score.info if score is not None and not failed else {}),
            "reward_source": reward_source,
            "branches": len(self.branches),
            "policy": self.policy,
        }
        if not self.branches:  # the client never got an answer: a record without tokens
            rec = self._record(self.session_id, None, termination, 0.0, {}, base_info, error)
            rec.trajectory.meta = rec.trajectory_meta()
            rec.trajectory.termination = termination
            return [rec]
        out = []
        for k, branch in enumerate(self.branches):
            conv = branch.conv
            if not conv.finished:
                conv.finish(branch.last)
            report = conv.check()
            last = branch.turns[-1]
            last.terminated = termination is TerminationReason.DONE
            last.truncated = termination is TerminationReason.MAX_TURNS
            last.reward = reward if (last.terminated or last.truncated) else None
            info = {
                **base_info,
                "branch": k,
                "tito": {
                    "exact": report.exact,
                    "ok": report.ok,
                    **report.counts(),
                    "summary": report.summary(),
                },
            }
            if branch.forked_at is not None:
                info["forked_at"], info["fork_reason"] = branch.forked_at, branch.fork_reason
            rec = self._record(self.branch_id(k), branch, termination, reward, components, info, error)
            traj = conv.trajectory
            traj.reward, traj.reward_components, traj.termination = reward, components, termination
            traj.meta = rec.trajectory_meta()
            rec.trajectory = traj
            out.append(rec)
        return out

    def _record(
        self,
        session_id: str,
        branch: Branch | None,
        termination: TerminationReason,
        reward: float,
        components: dict[str, float],
        info: dict[str, Any],
        error: ErrorInfo | None,
    ) -> SessionRecord:
        tok = getattr(self.tito, "tokenizer", None)
        return SessionRecord(
            session_id=session_id,
            env_id=self.env_id,
            env_class=f"{__name__}:{type(self).__qualname__}",
            recipe=self.recipe,
            task=self.spec.task.to_record(),
            group_id=self.spec.group_id,
            sample_index=self.spec.sample_index,
            seed=self.spec.seed,
            sampling_params=branch.sampling if branch is not None else {},
            tokenizer=f"{getattr(self.tito, 'family', '')}:{getattr(tok, 'name_or_path', '')}",
            tokenizer_spec=getattr(self.tito, "spec", None),
            parser=getattr(self.parser, "name", ""),
            tools=list(branch.tools or []) if branch is not None else [],
            initial_messages=[message_record(m) for m in branch.initial] if branch is not None else [],
            turns=branch.turns if branch is not None else [],
            termination=termination,
            reward=reward,
            reward_components=components,
            final_info=info,
            error=error,
            started_at=branch.started_at if branch is not None else self.started_at,
            duration_s=time.monotonic() - self._t0,
        )
