"""`Session`: one multi-turn episode of one environment against rollout engines, through a `Router`.

The loop: TITO prompt ids -> `engine.generate` -> append the generation -> parse tool calls -> `env.astep`
-> append the observation -> repeat. A session never raises: every way of ending (including being
cancelled) produces a `SessionRecord` holding a `Trajectory`, partial where it has to be.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol

from miles.engine import BASE_POLICY, EngineError, FinishReason, GenerateResult, RolloutEngine, SamplingParams
from miles.sessions.config import SessionConfig
from miles.sessions.records import (
    AttemptRecord,
    ErrorInfo,
    SessionRecord,
    TurnRecord,
    calls_view,
    jsonable,
    observed_tool_results,
)
from miles.sessions.retry import backoff_delay_s, is_retryable
from miles.sessions.router import Lease, NoHealthyEngineError, Router
from miles.sessions.spec import SessionSpec
from miles.tito.conversation import Conversation
from miles.trajectory import Trajectory, message_from_record, message_record
from miles.types import Message, TerminationReason

_ERROR_ENDS = (
    TerminationReason.ENV_ERROR,
    TerminationReason.ENGINE_ERROR,
    TerminationReason.TIMEOUT,
    TerminationReason.ABORTED,
)


class SessionEnv(Protocol):
    """What a session needs from an environment (`miles.envs.Env` provides it)."""

    env_id: str
    max_turns: int

    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]: ...

    async def astep(self, action: Message) -> tuple[list[Message], float, bool, bool, dict[str, Any]]: ...

    def tool_schemas(self) -> list[dict[str, Any]]: ...


class _End(Exception):
    def __init__(self, reason: TerminationReason, error: ErrorInfo | None = None) -> None:
        super().__init__(reason.value)
        self.reason = reason
        self.error = error


def tool_results_of(observation: list[Message], info: dict[str, Any]) -> list[dict[str, Any]]:
    """The tool results of one step: `info["tool_results"]` when the env gives them, else its tool messages."""
    given = info.get("tool_results")
    if isinstance(given, list):
        return [jsonable(r) for r in given]
    return observed_tool_results([m.to_dict() for m in observation])


class Session:
    """One episode. `run()` returns its `SessionRecord`; `request_abort()` followed by cancelling the task
    running it ends it as `aborted` (the in-flight request is aborted on its engine).

    `tokenizer` is a `miles.tito.TITOTokenizer`; `engines` one engine, several, or a `Router`;
    `parser` a `miles.tools` parser instance (default: `config.parser` by name; None in the config means
    the env's own `parse_action`).
    """

    def __init__(
        self,
        spec: SessionSpec,
        *,
        env: SessionEnv,
        tokenizer: Any,
        engines: Router | RolloutEngine | Sequence[RolloutEngine],
        config: SessionConfig | None = None,
        parser: Any = None,
    ) -> None:
        self.spec = spec
        self.env = env
        self.tokenizer = tokenizer
        self.config = config or SessionConfig()
        self.router = (
            engines
            if isinstance(engines, Router)
            else Router(engines, timeouts=self.config.timeouts, retry=self.config.retry)
        )
        if parser is None and self.config.parser is not None:
            from miles.tools import get_parser

            parser = get_parser(self.config.parser)
        self.parser = parser
        sampling = self.config.sampling
        task = spec.task.options.get("task")
        overrides = (getattr(task, "data", None) or {}).get("sampling") if task is not None else None
        if overrides:  # the task's own budget or temperature (a long task gets more tokens per turn)
            sampling = sampling.updated(overrides)
        if spec.seed is not None and sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=spec.seed)
        if not sampling.stop_token_ids:
            sampling = dataclasses.replace(
                sampling, stop_token_ids=tuple(getattr(tokenizer, "stop_token_ids", ()))
            )
        self.sampling: SamplingParams = sampling
        first = self.router.engines[0]
        self.context_length: int | None = (
            self.config.context_length
            or getattr(first, "context_length", None)
            or getattr(first, "max_context", None)
        )
        self.record: SessionRecord | None = None
        self.conversation: Any = None
        self._abort_requested = False
        self._inflight: tuple[RolloutEngine, str] | None = None
        self._budget_end: float | None = None
        self._reward = 0.0
        self._final_info: dict[str, Any] = {}

    def request_abort(self) -> None:
        """Mark the session as aborted on purpose; cancel its task next."""
        self._abort_requested = True

    # ---- the episode ---------------------------------------------------------------------------------
    async def run(self) -> SessionRecord:
        """Run the episode to its end. Never raises; cancellation ends it as `aborted`."""
        spec, env = self.spec, self.env
        tok = getattr(self.tokenizer, "tokenizer", None)
        rec = self.record = SessionRecord(
            session_id=spec.session_id,
            env_id=str(getattr(env, "env_id", "") or type(env).__name__),
            env_class=f"{type(env).__module__}:{type(env).__qualname__}",
            task=spec.task.to_record(),
            group_id=spec.group_id,
            sample_index=spec.sample_index,
            seed=spec.seed,
            sampling_params=self.sampling.to_dict(),
            tokenizer=f"{getattr(self.tokenizer, 'family', '')}:{getattr(tok, 'name_or_path', '')}",
            tokenizer_spec=getattr(self.tokenizer, "spec", None),
            parser=getattr(self.parser, "name", "") or "env",
            started_at=time.time(),
            policy_id=self.config.policy_id,
        )
        t0 = time.monotonic()
        budget = self.config.timeouts.session_budget_s
        self._budget_end = t0 + budget if budget is not None else None
        try:
            rec.termination = await self._episode(rec)
        except _End as end:
            rec.termination, rec.error = end.reason, end.error
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            await self._abort_inflight()
            rec.termination = TerminationReason.ABORTED
            rec.error = ErrorInfo(
                "session", "Aborted", "aborted by the scheduler" if self._abort_requested else "cancelled"
            )
        except Exception as exc:  # a failure outside env and engine (TITO, parser): keep the record
            rec.termination = TerminationReason.ENV_ERROR
            rec.error = ErrorInfo.from_exception("session", exc)
        rec.duration_s = time.monotonic() - t0
        self._finish(rec)
        return rec

    async def _episode(self, rec: SessionRecord) -> TerminationReason:
        env, cfg = self.env, self.config
        task = self.spec.task
        seed = task.seed if task.seed is not None else self.spec.seed
        obs, info = await self._env_call(
            "reset", env.areset(seed=seed, options=dict(task.options)), cfg.timeouts.env_reset_s
        )
        rec.initial_messages = [message_record(m) for m in obs]
        rec.reset_info = jsonable(info)
        try:
            tools = list(env.tool_schemas())
        except Exception as exc:
            raise _End(TerminationReason.ENV_ERROR, ErrorInfo.from_exception("reset", exc)) from exc
        rec.tools = tools
        conv = self.conversation = Conversation(self.tokenizer, list(obs), tools=tools or None)
        max_turns = cfg.max_turns or int(getattr(env, "max_turns", 0) or 0) or 1
        mnt = self.sampling.max_new_tokens
        seen_errors: dict[str, int] = {}
        for index in range(max_turns):
            prompt = conv.prompt_ids
            if self.context_length is not None and len(prompt) + mnt > self.context_length:
                raise _End(
                    TerminationReason.CONTEXT_FULL,
                    ErrorInfo(
                        "generate",
                        "ContextFull",
                        f"prompt {len(prompt)} + max_new_tokens {mnt} > context {self.context_length}",
                    ),
                )
            turn = TurnRecord(index=index, prompt_tokens=len(prompt))
            rec.turns.append(turn)
            result = await self._generate(prompt, turn)
            turn.output_start = len(conv)
            try:
                text = conv.append_generation(
                    result.output_ids,
                    result.output_logprobs,
                    weight_version=result.weight_version,
                    finish_reason=result.finish_reason,
                    token_versions=result.token_versions,
                    kept_counts=result.kept_counts,
                )
            except Exception as exc:  # output TITO cannot take (ids outside the vocabulary): a model error
                raise _End(
                    TerminationReason.ENGINE_ERROR, ErrorInfo.from_exception("generate", exc, turn.engine_id)
                ) from exc
            turn.output_end = len(conv)
            turn.text = text
            action = self._parse(text)
            turn.assistant = message_record(action)
            turn.tool_calls = calls_view(turn.assistant)
            t_env = time.monotonic()
            try:
                obs, reward, terminated, truncated, info = await self._env_call(
                    "step", env.astep(action), cfg.timeouts.env_step_s
                )
            except _End:
                conv.finish(action)
                raise
            finally:
                turn.env_s = time.monotonic() - t_env
            self._reward += float(reward)
            turn.reward, turn.terminated, turn.truncated = float(reward), bool(terminated), bool(truncated)
            turn.observation = [message_record(m) for m in obs]
            turn.tool_results = tool_results_of(obs, info)
            cumulative = {str(k): int(v) for k, v in dict(info.get("tool_errors") or {}).items()}
            turn.tool_errors = {
                k: v - seen_errors.get(k, 0) for k, v in cumulative.items() if v > seen_errors.get(k, 0)
            }  # info counts per episode; keep this turn's
            seen_errors = cumulative
            self._final_info = info
            if terminated or truncated:
                conv.finish(action)
                return TerminationReason.DONE if terminated else TerminationReason.MAX_TURNS
            conv.append_observation(action, list(obs))
        return TerminationReason.MAX_TURNS

    def _parse(self, text: str) -> Message:
        if self.parser is None:
            return self.env.parse_action(text)  # type: ignore[attr-defined]
        parsed = self.parser.parse(text)
        return parsed.to_message()

    def _limit(self, timeout_s: float, where: str) -> float:
        if self._budget_end is None:
            return timeout_s
        left = self._budget_end - time.monotonic()
        if left <= 0:
            raise _End(
                TerminationReason.TIMEOUT,
                ErrorInfo(
                    where,
                    "SessionBudgetExceeded",
                    f"session budget of {self.config.timeouts.session_budget_s}s used up",
                ),
            )
        return min(timeout_s, left)

    async def _env_call(self, where: str, coro: Awaitable[Any], timeout_s: float) -> Any:
        try:
            limit = self._limit(timeout_s, where)
        except _End:
            coro.close()  # type: ignore[attr-defined]
            raise
        try:
            async with asyncio.timeout(limit) as cm:
                return await coro
        except TimeoutError as exc:
            if cm.expired():
                raise _End(
                    TerminationReason.TIMEOUT,
                    ErrorInfo(where, "EnvTimeout", f"env {where} took longer than {limit:.3g}s"),
                ) from exc
            raise _End(TerminationReason.ENV_ERROR, ErrorInfo.from_exception(where, exc)) from exc
        except Exception as exc:
            raise _End(TerminationReason.ENV_ERROR, ErrorInfo.from_exception(where, exc)) from exc

    async def _generate(self, prompt: list[int], turn: TurnRecord) -> GenerateResult:
        """The turn's generate call through the router. A failed attempt is retried (with backoff, on another
        engine when there is one); a timed-out one is retried at once on another engine when the router
        judged its engine suspect, and otherwise ends the session as `timeout`."""
        retry = self.config.retry
        sid = self.spec.session_id
        mnt = self.sampling.max_new_tokens
        attempt = 0
        timed_out_on: set[int] = set()  # engines this turn timed out on: never again
        failed_on: set[int] = set()  # engines it failed on: only when no other is usable
        while True:
            rid = f"{sid}-t{turn.index}-a{attempt}"
            t_q = time.monotonic()
            try:
                lease = await self.router.acquire(
                    sid,
                    prompt_tokens=len(prompt),
                    max_new_tokens=mnt,
                    exclude=timed_out_on,
                    avoid=failed_on,
                    retry=attempt > 0,
                )
            except NoHealthyEngineError as exc:
                turn.queue_s += time.monotonic() - t_q
                if timed_out_on:
                    last = turn.attempts[-1].error.message
                    raise _End(
                        TerminationReason.TIMEOUT, ErrorInfo("generate", type(exc).__name__, f"{last}; {exc}")
                    ) from exc
                info = ErrorInfo.from_exception("generate", exc)
                turn.attempts.append(AttemptRecord("", "", info, 0.0))
            else:
                turn.queue_s += time.monotonic() - t_q
                outcome = await self._attempt(lease, prompt, rid, turn)
                if isinstance(outcome, GenerateResult):
                    return outcome
                info = outcome
                if info.type == "TurnTimeout":
                    timed_out_on.add(lease.index)
                    attempt += 1
                    continue
                failed_on.add(lease.index)
            if attempt >= retry.max_retries:
                raise _End(
                    TerminationReason.ENGINE_ERROR,
                    ErrorInfo(
                        "generate",
                        info.type,
                        f"gave up after {attempt + 1} attempts; last: {info.message}",
                        info.engine_id,
                    ),
                )
            delay = backoff_delay_s(attempt, retry)
            if self._budget_end is not None:
                delay = min(delay, max(0.0, self._budget_end - time.monotonic()))
            await asyncio.sleep(delay)
            attempt += 1

    async def _attempt(
        self, lease: Lease, prompt: list[int], rid: str, turn: TurnRecord
    ) -> GenerateResult | ErrorInfo:
        """One attempt on `lease`'s engine: its result, or the retryable failure it recorded. Raises `_End`
        when the turn cannot be retried."""
        eid, mnt = lease.engine_id, self.sampling.max_new_tokens
        try:
            cap = self._limit(self.config.timeouts.turn_cap_s, "generate")
        except _End:
            self.router.release(lease)
            raise
        error: BaseException | None = None
        expired = False
        self._inflight = (lease.engine, rid)
        policy = (
            self.config.policy_id
        )  # the base policy's calls carry no adapter (engines of the older contract)
        adapter = {} if policy == BASE_POLICY else {"adapter": policy}
        t0 = time.monotonic()
        try:
            async with lease.timeout(cap) as cm:
                result = await lease.engine.generate(
                    prompt, self.sampling, session_id=self.spec.session_id, rid=rid, **adapter
                )
        except TimeoutError as exc:
            expired, error = cm.expired(), exc
        except asyncio.CancelledError:
            self.router.release(lease)
            raise
        except Exception as exc:
            error = exc
        dt = time.monotonic() - t0
        self._inflight = None
        turn.deadline_s = lease.deadline_s
        if expired:
            await self._abort(lease.engine, rid)
            turn.engine_id, turn.rid, turn.generate_s = eid, rid, dt
            if self._budget_end is not None and time.monotonic() >= self._budget_end:
                self.router.release(lease)
                raise _End(
                    TerminationReason.TIMEOUT,
                    ErrorInfo(
                        "generate",
                        "SessionBudgetExceeded",
                        f"session budget of {self.config.timeouts.session_budget_s}s used up",
                        eid,
                    ),
                )
            suspect = await self.router.timed_out(lease)
            info = ErrorInfo(
                "generate",
                "TurnTimeout",
                f"{eid} gave no reply to {rid} within "
                f"{lease.deadline_s:.3g}s (prompt {len(prompt)}, max_new_tokens {mnt})",
                eid,
            )
            if not suspect or len(turn.attempts) >= self.config.retry.max_retries:
                raise _End(TerminationReason.TIMEOUT, info)
            turn.attempts.append(AttemptRecord(eid, rid, info, dt))
            return info
        aborted = error is None and result.finish_reason == FinishReason.ABORT
        if aborted:
            error = EngineError(f"{eid} aborted {rid} on its own", engine_id=eid, retryable=True)
        if error is None:
            self.router.succeeded(lease, result, dt)
            turn.engine_id = result.engine_id or eid
            turn.rid, turn.weight_version = rid, result.weight_version
            turn.cached_tokens, turn.finish_reason = result.cached_tokens, result.finish_reason.value
            turn.generate_s = dt
            return result
        info = ErrorInfo.from_exception("generate", error, eid)
        turn.attempts.append(AttemptRecord(eid, rid, info, dt))
        retryable = is_retryable(error)
        self.router.failed(lease, error, suspect=retryable and not aborted)
        if not retryable:
            raise _End(TerminationReason.ENGINE_ERROR, info)
        return info

    async def _abort(self, engine: RolloutEngine, rid: str) -> None:
        try:
            async with asyncio.timeout(self.config.timeouts.abort_s):
                await engine.abort(rid)
        except Exception:  # the engine may be gone; the request then died with it
            pass

    async def _abort_inflight(self) -> None:
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            try:
                await self._abort(*inflight)
            except asyncio.CancelledError:
                pass

    def _finish(self, rec: SessionRecord) -> None:
        traj: Trajectory | None = None
        if self.conversation is not None:
            try:
                traj = self.conversation.trajectory
            except Exception as exc:
                if rec.error is None:
                    rec.termination = TerminationReason.ENV_ERROR
                    rec.error = ErrorInfo.from_exception("session", exc)
        if traj is None:
            traj = Trajectory(messages=[message_from_record(m) for m in rec.initial_messages])
        failed = rec.termination in _ERROR_ENDS
        rec.reward = 0.0 if failed else self._reward
        comps = {} if failed else dict(self._final_info.get("reward_components") or {})
        rec.reward_components = {str(k): float(v) for k, v in comps.items()}
        rec.final_info = jsonable(self._final_info)
        traj.reward, traj.reward_components, traj.termination = (
            rec.reward,
            rec.reward_components,
            rec.termination,
        )
        traj.meta = rec.trajectory_meta()
        rec.trajectory = traj
