"""External agents as a rollout source: `rollout.agent.command` runs the user's own agent once per session,
against the OpenAI endpoint, and the sessions come back as the same `Group`s of `SessionRecord`s that
`SessionScheduler.run` produces, so the train loop can train on them unchanged.

Per session the runner resets the env for the task (its first messages and tool schemas are what the agent
gets), opens an endpoint session, and runs the command with `{base_url}`, `{api_key}` (the session's own
unguessable token: the endpoint serves the session to it alone),
`{session_id}`, `{task_id}` and `{task_file}` filled in. The agent's environment also holds `OPENAI_BASE_URL`
and `OPENAI_API_KEY` (so an unmodified `openai.OpenAI()` client talks to the session), `MILES_SESSION_ID`,
and `MILES_TASK`: the task as JSON (`task_id`, `prompt`, `messages`, `tools`, `seed`; never the answer).

The reward is the one the agent posts to `/sessions/{id}/reward`, or else the env's reward hooks applied to
the session's final messages (the env is reset for the task and stepped with every assistant message the
model produced): `reward: auto` (the default) takes the first that exists, `env` and `client` only one.
A session ends `done` when the agent exits 0, `timeout` when it runs past `timeout_s` (it is killed, with
everything it started), `env_error` when it exits non-zero; its turns so far are recorded either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import tempfile
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from miles.engine import RolloutEngine
from miles.engines.subprocesses import die_with_parent
from miles.envs.recipe import EnvRecipe
from miles.sessions.metrics import SessionObserver
from miles.sessions.openai.config import AgentConfig, SamplingOverride
from miles.sessions.openai.endpoint import OpenAIEndpoint
from miles.sessions.openai.routes import EndpointServer, create_openai_app
from miles.sessions.openai.session import OpenAISession, Score
from miles.sessions.recorder import Recorder
from miles.sessions.records import ErrorInfo, SessionRecord, jsonable
from miles.sessions.router import Router
from miles.sessions.scheduler import Group
from miles.sessions.spec import SessionSpec, TaskSpec
from miles.types import Message, TerminationReason, ToolCall

log = logging.getLogger(__name__)


def task_payload(
    spec: SessionSpec, messages: Sequence[Message], tools: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """What the agent learns about its task (`MILES_TASK`): never the answer or the task's private data."""
    task = spec.task.options.get("task")
    return {
        "session_id": spec.session_id,
        "task_id": spec.task.task_id or "",
        "prompt": getattr(task, "prompt", None)
        or next((m.content for m in messages if m.role == "user"), ""),
        "messages": [m.to_dict() for m in messages],
        "tools": list(tools),
        "seed": spec.seed,
    }


async def run_env_tool(env: Any, name: str, arguments: dict[str, Any]) -> Message:
    """One call of the env's tool `name` in `env`'s current episode, as the env runs a model's call: its tool
    message (a bad call, an unknown tool: the env's error message). The episode's state moves as it would."""
    call = ToolCall(
        name=name, arguments=dict(arguments), id="agent_call", raw_arguments=json.dumps(arguments)
    )
    observation = await env.react(Message("assistant", tool_calls=[call]))
    return next(
        (m for m in observation if m.role == "tool"),
        Message("tool", f"Error: the env ran no tool {name!r}", tool_call_id=call.id, name=name),
    )


async def score_with_env(env: Any, spec: SessionSpec, session: OpenAISession) -> Score:
    """The env's reward for the session's final messages: reset `env` for the task, then step it with every
    assistant message of the session's last branch until it ends. An episode the env does not see end (the
    agent stopped early) scores 0."""
    await env.areset(
        seed=spec.task.seed if spec.task.seed is not None else spec.seed, options=dict(spec.task.options)
    )
    actions = [m for m in session.branches[-1].history() if m.role == "assistant"] if session.branches else []
    total = 0.0
    for k, action in enumerate(actions):
        _, reward, terminated, truncated, info = await env.astep(action)
        total += float(reward)
        if terminated or truncated:
            components = {str(n): float(v) for n, v in (info.get("reward_components") or {}).items()}
            return Score(total, components, {**jsonable(info), "scored_steps": k + 1})
    return Score(
        0.0, {}, {"success": False, "scored_steps": len(actions), "stop_reason": "agent_stopped_early"}
    )


def _tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])[-1500:]


class AgentRunner:
    """Runs `config.command` once per session and returns the sessions in `Group`s: a `GroupRunner`, like
    `SessionScheduler`.

    A group holds its samples' records in sample order; a sample whose client forked its history has one
    record per branch, all with the sample's reward.
    """

    def __init__(
        self,
        service: AgentRollout,
        *,
        recipe: EnvRecipe | None = None,
        env_factory: Callable[[], Any] | None = None,
        group_size: int = 1,
        seed: int = 0,
        recorder: Recorder | None = None,
        run_id: str = "agent",
        override: SamplingOverride | None = None,
        observer: SessionObserver | None = None,
    ) -> None:
        if group_size < 1:
            raise ValueError("group_size must be >= 1")
        if env_factory is None:
            if recipe is None:
                raise ValueError("AgentRunner needs recipe= or env_factory=")
            env_factory = recipe.make
        self.service = service
        self.env_factory = env_factory
        self.recipe = recipe
        self.group_size = group_size
        self.seed = seed
        self.recorder = recorder
        self.observer = observer
        self.run_id = run_id
        self.override = override if override is not None else service.config.sampling
        self._count = 0
        self._groups = 0
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def router(self) -> Router:
        """The endpoint's router (per-engine stats, as `SessionScheduler.router`)."""
        return self.service.endpoint.router

    async def run_groups(
        self, tasks: Iterable[Any], *, num_groups: int | None = None
    ) -> AsyncIterator[Group]:
        """One group of `group_size` sessions per task (the first `num_groups` tasks when given), yielded as
        each completes. Closing the iterator early stops the sessions still running (recorded as aborted)."""
        loop = asyncio.get_running_loop()
        groups: list[asyncio.Task[Group]] = []
        for count, item in enumerate(tasks):
            if num_groups is not None and count >= num_groups:
                break
            task = loop.create_task(self._group(TaskSpec.of(item)))
            groups.append(task)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        try:
            for done in asyncio.as_completed(groups):
                yield await done
        finally:
            for task in groups:
                task.cancel()
            await asyncio.gather(*groups, return_exceptions=True)

    async def run(self, tasks: Iterable[Any], *, num_groups: int | None = None) -> list[Group]:
        """`run_groups` collected into a list, in the order the groups complete."""
        gen = self.run_groups(tasks, num_groups=num_groups)
        try:
            return [group async for group in gen]
        finally:
            await gen.aclose()

    async def _group(self, task: TaskSpec) -> Group:
        index = self._groups
        self._groups += 1
        group = Group(f"{self.run_id}-g{index}", index, task)
        specs = []
        for i in range(self.group_size):
            k = self._count
            self._count += 1
            specs.append(
                SessionSpec(
                    session_id=f"{self.run_id}-s{k}",
                    task=task,
                    group_id=group.group_id,
                    sample_index=i,
                    seed=self.seed + k,
                )
            )
        for records in await asyncio.gather(*(self._sample(s) for s in specs)):
            group.records.extend(records)
        return group

    async def _sample(self, spec: SessionSpec) -> list[SessionRecord]:
        async with self.service.slots:
            return await self._episode(spec)

    async def _episode(self, spec: SessionSpec) -> list[SessionRecord]:
        service, endpoint, cfg = self.service, self.service.endpoint, self.service.config
        sid = spec.session_id
        env = None
        try:
            env = self.env_factory()
            seed = spec.task.seed if spec.task.seed is not None else spec.seed
            messages, _ = await env.areset(seed=seed, options=dict(spec.task.options))
            tools = list(env.tool_schemas())
        except Exception as exc:
            endpoint.open(
                sid, spec=spec, recipe=self.recipe, env_id=str(getattr(env, "env_id", "") or "openai")
            )
            return await self._end(sid, TerminationReason.ENV_ERROR, ErrorInfo.from_exception("reset", exc))
        try:
            scorer = None if cfg.reward == "client" else (lambda s: score_with_env(env, spec, s))
            session = endpoint.open(
                sid,
                spec=spec,
                recipe=self.recipe,
                env_id=env.env_id,
                override=self.override,
                scorer=scorer,
                accept_client_reward=cfg.reward != "env",
            )
            session.tools = functools.partial(run_env_tool, env)
            try:
                termination, error = await service.run_agent(
                    spec, task_payload(spec, messages, tools), token=session.token
                )
            except asyncio.CancelledError:
                await self._end(
                    sid, TerminationReason.ABORTED, ErrorInfo("agent", "Aborted", "the run was stopped")
                )
                raise
            if termination is TerminationReason.DONE and session.turns == 0:
                termination, error = (
                    TerminationReason.ENV_ERROR,
                    ErrorInfo("agent", "NoRequests", "the agent exited without asking the model anything"),
                )
            return await self._end(sid, termination, error)
        finally:
            with contextlib.suppress(Exception):
                await env.aclose()

    async def _end(
        self, sid: str, termination: TerminationReason, error: ErrorInfo | None
    ) -> list[SessionRecord]:
        """Close the session and record it; shielded, so a stopped run still records its sessions."""

        async def finish() -> list[SessionRecord]:
            records = await self.service.endpoint.close(sid, termination=termination, error=error)
            for rec in records:
                if self.recorder is not None:
                    try:
                        await self.recorder.append(rec)
                    except Exception as exc:
                        log.error("recording session %s failed: %s", rec.session_id, exc)
                if self.observer is not None:
                    try:
                        self.observer.observe(rec)
                    except Exception as exc:  # metrics must never cost a session
                        log.error("observing session %s failed: %r", rec.session_id, exc)
            return records

        return await asyncio.shield(finish())

    async def aclose(self) -> None:
        """Stop the sessions still running (their agents are killed; the sessions are recorded as aborted)."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


class AgentRollout:
    """The endpoint and its HTTP server, started once per run and shared by the train and eval runners.

    `await AgentRollout.start(engines, tokenizer=tito, config=agent_config)`, then `runner(...)` for
    `SessionScheduler`-like runners and `evaluate(...)` for held-out records; `aclose()` at the end.
    """

    def __init__(
        self,
        endpoint: OpenAIEndpoint,
        server: EndpointServer,
        config: AgentConfig,
        log_dir: Path,
        owns_log_dir: bool,
    ) -> None:
        self.endpoint = endpoint
        self.server = server
        self.config = config
        self.log_dir = log_dir
        self._owns_log_dir = owns_log_dir
        self.slots = asyncio.Semaphore(config.max_concurrent)

    @classmethod
    async def start(
        cls,
        engines: RolloutEngine | Sequence[RolloutEngine] | Router,
        *,
        tokenizer: Any,
        config: AgentConfig,
        context_length: int | None = None,
        log_dir: str | os.PathLike[str] | None = None,
    ) -> AgentRollout:
        """Serve an endpoint over `engines` (with the TITO `tokenizer` of the trained model) on this event
        loop. `context_length` bounds sessions when the engines do not report it."""
        session = config.session
        if context_length is not None and session.context_length is None:
            session = replace(session, context_length=context_length)
        endpoint = OpenAIEndpoint(
            engines,
            tokenizer=tokenizer,
            config=session,
            open_sessions=False,
            max_inflight_per_engine=max(64, config.max_concurrent),
        )
        server = EndpointServer(create_openai_app(endpoint), host=config.host, port=config.port)
        await server.start()
        folder = log_dir or config.log_dir
        owns = folder is None
        path = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="miles-agents-"))
        path.mkdir(parents=True, exist_ok=True)
        return cls(endpoint, server, config, path, owns)

    @property
    def base_url(self) -> str:
        """What the agents get as `{base_url}`: the OpenAI API root."""
        return f"{self.server.url}/v1"

    def runner(
        self,
        *,
        recipe: EnvRecipe | None = None,
        env_factory: Callable[[], Any] | None = None,
        group_size: int = 1,
        seed: int = 0,
        recorder: Recorder | None = None,
        run_id: str = "agent",
        override: SamplingOverride | None = None,
        observer: SessionObserver | None = None,
    ) -> AgentRunner:
        """A runner of sessions of `recipe`'s envs (or `env_factory()`'s; see `AgentRunner`); `observer` (e.g.
        `SessionMetrics`) is told about every recorded session, as the scheduler's is."""
        return AgentRunner(
            self,
            recipe=recipe,
            env_factory=env_factory,
            group_size=group_size,
            seed=seed,
            recorder=recorder,
            run_id=run_id,
            override=override,
            observer=observer,
        )

    async def evaluate(
        self,
        tasks: Sequence[Any],
        *,
        recipe: EnvRecipe | None = None,
        env_factory: Callable[[], Any] | None = None,
        recorder: Recorder | None = None,
        greedy: bool = True,
        max_tokens: int | None = None,
        run_id: str = "eval",
    ) -> list[SessionRecord]:
        """One session per task (greedy: temperature 0 whatever the agent asks); returns each session's last
        record (the one that carries its final messages), in task order of completion."""
        base = self.config.sampling
        override = SamplingOverride(
            temperature=0.0 if greedy else base.temperature,
            top_p=base.top_p,
            max_tokens=max_tokens if max_tokens is not None else base.max_tokens,
        )
        runner = self.runner(
            recipe=recipe, env_factory=env_factory, recorder=recorder, run_id=run_id, override=override
        )
        try:
            groups = await runner.run(tasks)
        finally:
            await runner.aclose()
        return [g.records[-1] for g in groups if g.records]

    async def run_agent(
        self, spec: SessionSpec, payload: dict[str, Any], *, token: str
    ) -> tuple[TerminationReason, ErrorInfo | None]:
        """Run the agent command for one session until it exits or times out (then it is killed); `token` is the
        session's credential, the agent's API key."""
        cfg, sid = self.config, spec.session_id
        task_file = self.log_dir / f"{sid}.task.json"
        log_file = self.log_dir / f"{sid}.log"
        task_json = json.dumps(payload, ensure_ascii=False)
        task_file.write_text(task_json, encoding="utf-8")
        argv = cfg.argv(
            base_url=self.base_url,
            api_key=token,
            session_id=sid,
            task_id=payload["task_id"],
            task_file=str(task_file),
        )
        no_proxy = ",".join(p for p in (os.environ.get("NO_PROXY", ""), "127.0.0.1,localhost,::1") if p)
        env = {
            **os.environ,
            "OPENAI_BASE_URL": self.base_url,
            "OPENAI_API_KEY": token,
            "MILES_SESSION_ID": sid,
            "MILES_TASK": task_json,
            "MILES_TASK_FILE": str(task_file),
            "NO_PROXY": no_proxy,
            "no_proxy": no_proxy,
            **cfg.env,
        }
        with open(log_file, "wb") as log:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    env=env,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=die_with_parent,
                )
            except OSError as exc:
                return TerminationReason.ENV_ERROR, ErrorInfo("agent", "AgentNotStarted", f"{argv[0]}: {exc}")
            try:
                code = await asyncio.wait_for(proc.wait(), cfg.timeout_s)
            except TimeoutError:
                await _kill(proc)
                return TerminationReason.TIMEOUT, ErrorInfo(
                    "agent",
                    "AgentTimeout",
                    f"the agent ran past timeout_s={cfg.timeout_s:g}s and was killed; "
                    f"its last output ({log_file}): {_tail(log_file)}",
                )
            except asyncio.CancelledError:
                await _kill(proc)
                raise
        if code != 0:
            return TerminationReason.ENV_ERROR, ErrorInfo(
                "agent",
                "AgentCrashed",
                f"the agent exited with code {code}; its last output ({log_file}): {_tail(log_file)}",
            )
        if not cfg.keep_logs:
            for path in (task_file, log_file):
                path.unlink(missing_ok=True)
        return TerminationReason.DONE, None

    async def aclose(self) -> None:
        """Stop the server and close the sessions still open (as aborted)."""
        await self.server.stop()
        await self.endpoint.aclose()
        if self._owns_log_dir and not any(self.log_dir.iterdir()):
            self.log_dir.rmdir()


async def _kill(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the agent's whole process group (it may have started others), then reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        await proc.wait()
