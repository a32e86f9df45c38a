"""`OpenAIEndpoint`: the sessions of the OpenAI-compatible endpoint, over any rollout engines.

It owns the open `OpenAISession`s, routes their generate calls through a `Router` (a session's turns stay on
the engine that holds its KV cache; failed calls are retried elsewhere), closes sessions into `SessionRecord`s
(scored by the client's `/reward` or by the session's scorer), records them, and counts what happened.
The HTTP side is `miles.sessions.openai.routes`; this module has no FastAPI in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles.engine import EngineError, FinishReason, GenerateResult, RolloutEngine
from miles.envs.recipe import EnvRecipe
from miles.sessions.openai.config import OpenAISessionConfig, SamplingOverride
from miles.sessions.openai.schema import ChatRequest, ClientReward, Completion, EndpointError, Usage
from miles.sessions.openai.session import OpenAISession, Plan, Score
from miles.sessions.recorder import Recorder
from miles.sessions.records import ErrorInfo, SessionRecord
from miles.sessions.retry import backoff_delay_s, is_retryable
from miles.sessions.router import NoHealthyEngineError, Router
from miles.sessions.spec import SessionSpec
from miles.types import TerminationReason

log = logging.getLogger(__name__)

#: What a session id may look like (it travels as a URL path segment and as a bearer token).
SESSION_ID = re.compile(r"[A-Za-z0-9._:~-]{1,200}")

Scorer = Callable[[OpenAISession], Awaitable[Score | None]]


@dataclass
class EndpointStats:
    """Counters of one endpoint; `mismatch_tokens` adds up TITO's classification of every closed branch."""

    requests: int = 0
    completions: int = 0
    streamed: int = 0
    client_errors: int = 0
    history_conflicts: int = 0
    forks: int = 0
    engine_errors: int = 0
    sessions_opened: int = 0
    sessions_closed: int = 0
    record_failures: int = 0
    mismatch_tokens: dict[str, int] = field(default_factory=dict)

    def failed(self, error: EndpointError) -> None:
        """Count a request answered with `error`."""
        if error.code == "history_mismatch":
            self.history_conflicts += 1
        elif error.status < 500:
            self.client_errors += 1
        else:
            self.engine_errors += 1

    def to_metrics(self, prefix: str = "openai/") -> dict[str, float]:
        """Flat metrics (e.g. for `metrics.jsonl`)."""
        out = {f"{prefix}{k}": float(v) for k, v in vars(self).items() if isinstance(v, int)}
        out.update({f"{prefix}mismatch_tokens_{k}": float(v) for k, v in self.mismatch_tokens.items()})
        return out


class OpenAIEndpoint:
    """Endpoint sessions over `engines` (one engine, several, or a `Router`).

    `tokenizer` is the `miles.tito.TITOTokenizer` of the served model. `open_sessions`: a request for an
    unknown session id opens it (a standalone server: the session id is the client's credential, and at most
    `config.max_open_sessions` are open at once); otherwise only sessions `open`ed beforehand are served (the
    agent runner's), each to the holder of its own unguessable `token` (see `authorize`). Closed sessions go to
    `recorder` (a `Recorder` or a path) when given.
    """

    def __init__(
        self,
        engines: RolloutEngine | Sequence[RolloutEngine] | Router,
        *,
        tokenizer: Any,
        config: OpenAISessionConfig | None = None,
        recorder: Recorder | str | None = None,
        open_sessions: bool = True,
        model_name: str = "miles",
        max_inflight_per_engine: int = 64,
        keep_closed: int = 4096,
    ) -> None:
        self.config = config or OpenAISessionConfig()
        self.tito = tokenizer
        self._owns_router = not isinstance(engines, Router)
        self.router = (
            engines
            if isinstance(engines, Router)
            else Router(
                engines,
                timeouts=self.config.timeouts,
                retry=self.config.retry,
                max_inflight_per_engine=max_inflight_per_engine,
            )
        )
        first = self.router.engines[0]
        self.context_length: int | None = (
            self.config.context_length
            or getattr(first, "context_length", None)
            or getattr(first, "max_context", None)
        )
        self._owns_recorder = isinstance(recorder, str)
        self.recorder = Recorder(recorder) if isinstance(recorder, str) else recorder
        self.open_sessions = open_sessions
        self.model_name = model_name
        self.sessions: dict[str, OpenAISession] = {}
        self.closed: OrderedDict[str, OpenAISession] = OrderedDict()
        self.keep_closed = keep_closed
        self.stats = EndpointStats()
        self._scorers: dict[str, Scorer] = {}
        self._owners: dict[str, str] = {}  # token -> session id (sessions opened by a runner)
        self._background: set[asyncio.Task[Any]] = set()
        self._last_sweep = time.monotonic()

    # ---- sessions ----------------------------------------------------------------------------------------
    def open(
        self,
        session_id: str | None = None,
        *,
        spec: SessionSpec | None = None,
        recipe: EnvRecipe | None = None,
        env_id: str = "openai",
        override: SamplingOverride | None = None,
        scorer: Scorer | None = None,
        accept_client_reward: bool = True,
    ) -> OpenAISession:
        """Open a session (a fresh id when none is given). `scorer` computes its reward at close when the client
        posted none (or may not: `accept_client_reward=False`); `override` fixes sampling whatever the client
        asks."""
        from miles.tools import get_parser

        sid = session_id or (spec.session_id if spec is not None else uuid.uuid4().hex)
        if not SESSION_ID.fullmatch(sid):
            raise EndpointError(
                400,
                f"session id {sid!r} must be 1-200 characters of A-Z a-z 0-9 . _ : ~ -",
                param="session_id",
            )
        if sid in self.sessions or sid in self.closed:
            raise EndpointError(409, f"session {sid!r} exists already", code="session_exists")
        if self.open_sessions and len(self.sessions) >= self.config.max_open_sessions:
            raise EndpointError(
                429,
                f"{len(self.sessions)} sessions are open, the most this server takes "
                "(max_open_sessions); close finished ones",
                kind="rate_limit_error",
                code="too_many_sessions",
            )
        session = OpenAISession(
            sid,
            tito=self.tito,
            parser=get_parser(self.config.parser),
            config=self.config,
            spec=spec,
            recipe=recipe,
            env_id=env_id,
            override=override,
            context_length=self.context_length,
        )
        session.accept_client_reward = accept_client_reward
        session.token = sid if self.open_sessions else secrets.token_urlsafe(24)
        if not self.open_sessions:
            self._owners[session.token] = sid
        self.sessions[sid] = session
        if scorer is not None:
            self._scorers[sid] = scorer
        self.stats.sessions_opened += 1
        return session

    def authorize(self, bearer: str | None, session_id: str | None = None) -> str:
        """The session a request may act on: the one its bearer token names (`session_id`, from the URL path,
        must be that one). On a standalone server the token is the session id itself; otherwise it is the
        session's own `token`, so no client can read, extend, score or close another's session."""
        if self.open_sessions:
            if session_id is not None:
                return session_id
            if not bearer:
                raise EndpointError(
                    401,
                    "name the session: use the session id as the API key (Authorization: "
                    "Bearer <session id>) or the base URL /sessions/<session id>/v1",
                    kind="authentication_error",
                    code="no_session",
                )
            return bearer
        owned = self._owners.get(bearer or "")
        if owned is None:
            raise EndpointError(
                401,
                "this server serves only the sessions its runner opened: send the session's "
                "token as the API key (OPENAI_API_KEY)",
                kind="authentication_error",
                code="invalid_api_key",
            )
        if session_id is not None and session_id != owned:
            raise EndpointError(
                403,
                f"the API key is not the token of session {session_id!r}",
                kind="permission_error",
                code="not_your_session",
            )
        return owned

    def get(self, session_id: str) -> OpenAISession:
        """An open or recently closed session; `EndpointError` 404 when there is none."""
        session = self.sessions.get(session_id) or self.closed.get(session_id)
        if session is None:
            raise EndpointError(
                404,
                f"no session {session_id!r}"
                + ("" if self.open_sessions else " (this server serves only the sessions its runner opened)"),
                param="session_id",
                code="session_not_found",
            )
        return session

    def _for_request(self, session_id: str) -> OpenAISession:
        self._sweep()
        if session_id not in self.sessions and session_id not in self.closed and self.open_sessions:
            return self.open(session_id)
        return self.get(session_id)

    # ---- requests ----------------------------------------------------------------------------------------
    async def complete(self, session_id: str, request: ChatRequest) -> Completion:
        """Answer one chat request of `session_id`. Requests of one session run one at a time; a failed one
        changes nothing. Raises `EndpointError` (the HTTP layer counts it in `stats`)."""
        session = self._for_request(session_id)
        async with session.lock:
            plan = session.plan(request)
            result, rid, queue_s, generate_s = await self._generate(session, plan)
            if session.closing:
                raise EndpointError(
                    409, f"session {session_id!r} was closed while generating", code="session_closed"
                )
            forked = plan.new and bool(session.branches)
            turn = session.commit(plan, request, result, rid=rid, queue_s=queue_s, generate_s=generate_s)
        self.stats.completions += 1
        self.stats.streamed += request.stream
        self.stats.forks += forked
        rec = turn.record
        return Completion(
            id=f"chatcmpl-{session_id}-{session.turns}",
            created=int(time.time()),
            model=request.model or self.model_name,
            message=turn.message,
            finish_reason=turn.finish_reason,
            usage=Usage(len(plan.prompt), rec.output_end - rec.output_start, result.cached_tokens),
            weight_version=result.weight_version,
            logprobs=turn.logprobs if request.logprobs else None,
        )

    async def _generate(self, session: OpenAISession, plan: Plan) -> tuple[GenerateResult, str, float, float]:
        """One generate call through the router, retried (with backoff, elsewhere when possible) on retryable
        failures. Returns the result, its rid, and the seconds queued and generating."""
        retry, sid = self.config.retry, session.session_id
        attempt, queue_s = 0, 0.0
        avoid: set[int] = set()
        while True:
            rid = f"{sid}-t{session.turns}-a{attempt}-{uuid.uuid4().hex[:6]}"
            t_q = time.monotonic()
            try:
                lease = await self.router.acquire(
                    sid,
                    prompt_tokens=len(plan.prompt),
                    max_new_tokens=plan.params.max_new_tokens,
                    avoid=avoid,
                    retry=attempt > 0,
                )
            except NoHealthyEngineError as exc:
                raise EndpointError(
                    503, f"no engine can take the request: {exc}", kind="engine_error"
                ) from None
            queue_s += time.monotonic() - t_q
            session.inflight = (lease.engine, rid)
            error: BaseException | None = None
            expired = False
            t0 = time.monotonic()
            try:
                async with lease.timeout(self.config.timeouts.turn_cap_s) as cm:
                    result = await lease.engine.generate(plan.prompt, plan.params, session_id=sid, rid=rid)
            except TimeoutError as exc:
                expired, error = cm.expired(), exc
            except asyncio.CancelledError:
                self.router.release(lease)
                await self._abort(lease.engine, rid)
                raise
            except Exception as exc:
                error = exc
            finally:
                session.inflight = None
            dt = time.monotonic() - t0
            if expired:
                await self._abort(lease.engine, rid)
                await self.router.timed_out(lease)
                raise EndpointError(
                    504,
                    f"{lease.engine_id} gave no reply within {lease.deadline_s:.3g}s; the "
                    "session is unchanged, retry the request",
                    kind="engine_error",
                    code="timeout",
                )
            aborted = error is None and result.finish_reason is FinishReason.ABORT
            if aborted:
                if session.closing:
                    self.router.release(lease)
                    raise EndpointError(
                        409, f"session {sid!r} was closed while generating", code="session_closed"
                    )
                error = EngineError(f"{lease.engine_id} aborted {rid}", engine_id=lease.engine_id)
            if error is None:
                self.router.succeeded(lease, result, dt)
                return result, rid, queue_s, dt
            retryable = is_retryable(error)
            self.router.failed(lease, error, suspect=retryable and not aborted)
            if not retryable or attempt >= retry.max_retries:
                raise EndpointError(
                    503,
                    f"generation failed after {attempt + 1} attempt(s): {type(error).__name__}: {error}",
                    kind="engine_error",
                )
            avoid.add(lease.index)
            await asyncio.sleep(backoff_delay_s(attempt, retry))
            attempt += 1

    async def _abort(self, engine: RolloutEngine, rid: str) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.config.timeouts.abort_s):
                await engine.abort(rid)

    async def run_tool(self, session_id: str, name: str, arguments: Any) -> dict[str, Any]:
        """Run the env's tool `name` for the session's agent (the env of a runner's session, in the episode's own
        state): `{"name", "content"}`, the tool message the env would have shown the model. 404 for a session
        without env tools; a bad call is the env's error message, not an HTTP error. The answer is remembered:
        the agent's tool message that carries it is recorded as the env's (`env: true`), which replay checks."""
        session = self.get(session_id)
        if session.tools is None:
            raise EndpointError(
                404,
                f"session {session_id!r} has no env tools (only the sessions an agent runner "
                "opens for an env do)",
                code="no_env_tools",
            )
        if session.closing:
            raise EndpointError(409, f"session {session_id!r} is closed", code="session_closed")
        if not isinstance(arguments, dict):
            raise EndpointError(
                400, "the body must be the tool's arguments as a JSON object", param="arguments"
            )
        message = await session.tools(name, arguments)
        session.env_answers.append((name, message.content))
        return {"name": name, "content": message.content}

    def post_reward(self, session_id: str, reward: ClientReward) -> None:
        """Set the session's reward (a later post replaces it); 409 once the session is closed."""
        session = self.get(session_id)
        if session.closing:
            raise EndpointError(
                409,
                f"session {session_id!r} is closed; post the reward before closing it",
                code="session_closed",
            )
        if not session.accept_client_reward:
            raise EndpointError(
                409,
                f"session {session_id!r} is scored by its env's reward hooks (rollout.agent.reward: env)",
                code="reward_from_env",
            )
        session.client_reward = reward

    # ---- the end -----------------------------------------------------------------------------------------
    async def close(
        self,
        session_id: str,
        *,
        termination: TerminationReason = TerminationReason.DONE,
        error: ErrorInfo | None = None,
    ) -> list[SessionRecord]:
        """Close a session (idempotent: a closed one returns its records): abort its running generation, score
        it, build one `SessionRecord` per branch and record them. A session that hit `max_turns` ends
        `max_turns` instead of `done`."""
        session = self.get(session_id)
        if session.closing:
            await session.closed.wait()
            return session.result
        session.closing = True
        try:
            records = await self._finish(session, termination, error)
        finally:  # whatever happened, nobody waits on this session for ever
            self.sessions.pop(session_id, None)
            self._scorers.pop(session_id, None)
            self.closed[session_id] = session
            while len(self.closed) > self.keep_closed:
                _, gone = self.closed.popitem(last=False)
                self._owners.pop(gone.token, None)
            self.stats.sessions_closed += 1
            session.closed.set()
        return records

    async def _finish(
        self, session: OpenAISession, termination: TerminationReason, error: ErrorInfo | None
    ) -> list[SessionRecord]:
        if session.inflight is not None:
            await self._abort(*session.inflight)
        async with session.lock:
            if termination is TerminationReason.DONE and session.max_turns_hit:
                termination = TerminationReason.MAX_TURNS
            score, source = None, "none"
            if termination in (TerminationReason.DONE, TerminationReason.MAX_TURNS):
                try:
                    score, source = await self._score(session)
                except (
                    Exception
                ) as exc:  # a reward hook that fails: the episode is an env error, still recorded
                    termination, error = TerminationReason.ENV_ERROR, ErrorInfo.from_exception("score", exc)
            records = session.records(termination, score, error, reward_source=source)
        session.result = records
        for rec in records:
            for kind in ("special_tokens", "assistant_text", "non_assistant_text"):
                n = int(rec.final_info.get("tito", {}).get(kind, 0))
                self.stats.mismatch_tokens[kind] = self.stats.mismatch_tokens.get(kind, 0) + n
            if self.recorder is not None:
                try:
                    await self.recorder.append(rec)
                except Exception as exc:
                    self.stats.record_failures += 1
                    log.error("recording session %s failed: %s", rec.session_id, exc)
        return records

    async def _score(self, session: OpenAISession) -> tuple[Score | None, str]:
        if session.client_reward is not None:
            r = session.client_reward
            return Score(r.reward, dict(r.components)), "client"
        scorer = self._scorers.get(session.session_id)
        if scorer is None:
            return None, "none"
        return await scorer(session), "env"

    def _sweep(self) -> None:
        """Close sessions idle for longer than `idle_timeout_s` (checked at most every few seconds)."""
        now = time.monotonic()
        if now - self._last_sweep < min(5.0, self.config.idle_timeout_s):
            return
        self._last_sweep = now
        for sid, s in list(self.sessions.items()):
            if not s.closing and not s.lock.locked() and now - s.last_active > self.config.idle_timeout_s:
                info = ErrorInfo("session", "IdleTimeout", f"no request for {self.config.idle_timeout_s:g}s")
                task = asyncio.get_running_loop().create_task(
                    self.close(sid, termination=TerminationReason.TIMEOUT, error=info)
                )
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    def view(self, session_id: str) -> dict[str, Any]:
        """The `/sessions/{id}/trajectory` JSON: each branch's trajectory and TITO classification, and, once the
        session is closed, its `SessionRecord`s."""
        session = self.get(session_id)
        out: dict[str, Any] = {
            "session_id": session_id,
            "closed": session.closed.is_set(),
            "turns": session.turns,
        }
        if session.closed.is_set():
            out["branches"] = [
                {
                    "session_id": r.session_id,
                    "trajectory": r.trajectory.to_dict(),
                    "tito": r.final_info.get("tito"),
                }
                for r in session.result
            ]
            out["records"] = [r.to_dict() for r in session.result]
            return out
        branches = []
        for k, b in enumerate(session.branches):
            report = b.conv.check()
            branches.append(
                {
                    "session_id": session.branch_id(k),
                    "trajectory": b.conv.trajectory.to_dict(),
                    "tito": {
                        "exact": report.exact,
                        "ok": report.ok,
                        **report.counts(),
                        "summary": report.summary(),
                    },
                }
            )
        out["branches"] = branches
        return out

    async def aclose(self) -> None:
        """Close every open session as `aborted`, then the owned router and recorder."""
        for sid in list(self.sessions):
            await self.close(
                sid,
                termination=TerminationReason.ABORTED,
                error=ErrorInfo("session", "Aborted", "the endpoint shut down"),
            )
        for task in list(self._background):
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await task
        if self._owns_router:
            await self.router.aclose()
        if self.recorder is not None and self._owns_recorder:
            await self.recorder.aclose()
