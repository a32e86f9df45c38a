"""`Env`: a gymnasium environment for text agents.

The action is one assistant `Message` (text plus parsed tool calls); the observation is the list of new
messages the env adds (tool results, user turns). `areset`/`astep` are the primary implementation so
thousands of episodes can share one event loop; `reset`/`step` run them on a private loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import gymnasium

from miles.envs.hooks import BoundHook, collect_hooks
from miles.envs.spaces import MessageSpace, MessagesSpace
from miles.envs.tasks import Task, TaskSource, as_task_source, select_split
from miles.types import MAX_ABS_REWARD, Message, TerminationReason, ToolErrorType, reward_problem


class EnvError(RuntimeError):
    """Base class for misuse of an environment."""


class ResetNeededError(EnvError):
    """`step` was called before `reset`."""


class EpisodeOverError(EnvError):
    """`step` was called after the episode terminated or was truncated; call `reset`."""


class InvalidActionError(EnvError, TypeError):
    """The action is not an assistant message (or something convertible to one)."""


class HookError(EnvError):
    """A reward, stop or cleanup hook raised or returned something unusable; the hook is named."""


class NoOracleError(EnvError):
    """This environment does not provide a scripted oracle policy."""


class OraclePolicy:
    """A scripted policy: given the whole conversation so far, return the next assistant message.

    Subclasses implement `act`; `bind(env)` is called by `Env.oracle()` so the policy can read the task.
    """

    env: Env | None = None

    def bind(self, env: Env) -> OraclePolicy:
        self.env = env
        return self

    @property
    def task(self) -> Task:
        if self.env is None or self.env.task is None:
            raise EnvError(f"{type(self).__name__} is not bound to a reset env")
        return self.env.task

    def act(self, messages: list[Message]) -> Message:  # pragma: no cover - abstract
        raise NoOracleError(f"{type(self).__name__} does not implement act()")


_TOOL_ERROR_NAMES = tuple(e.value for e in ToolErrorType)


def _empty_tool_errors() -> dict[str, int]:
    return dict.fromkeys(_TOOL_ERROR_NAMES, 0)


class Env(gymnasium.Env):
    """Base class of text-agent environments.

    Override `default_tasks` (or pass `tasks=`), and optionally `on_reset`, `initial_messages`,
    `react` (the observation for one action) and `is_final`. Rewards, stop conditions and cleanup are
    methods decorated with `@reward`, `@stop_condition` and `@cleanup` (see `miles.envs.hooks`).

    `split` ("all", "train" or "held_out"), which the train loop passes, keeps the deterministic part of
    the tasks whose prompt hash (salted with `split_salt`) falls outside (train) or inside (held_out) the
    `held_out_fraction`; a subclass needs no code for it.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"], "render_fps": 1}
    env_id: str = ""
    max_turns: int = 8
    system_prompt: str | None = None
    #: If set, `info["success"]` is `reward_components[success_component] >= 1`; otherwise every
    #: positively weighted component must reach 1.
    success_component: str | None = None
    #: Share of the tasks that `split="held_out"` keeps (and `split="train"` leaves out).
    held_out_fraction: float = 0.1
    #: Salt of the split's prompt hash.
    split_salt: str = ""

    def __init__(
        self,
        tasks: TaskSource | Iterable[Task | Mapping[str, Any]] | None = None,
        *,
        split: str = "all",
        held_out_fraction: float | None = None,
        max_turns: int | None = None,
        reward_weights: Mapping[str, float] | None = None,
        system_prompt: str | None = None,
        render_mode: str | None = None,
    ) -> None:
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode {render_mode!r} not in {self.metadata['render_modes']}")
        self.render_mode = render_mode
        if held_out_fraction is not None:
            self.held_out_fraction = float(held_out_fraction)
        source = as_task_source(tasks, name=type(self).__name__)
        self.tasks: TaskSource = select_split(
            source if source is not None else self.default_tasks(),
            split,
            self.held_out_fraction,
            salt=self.split_salt,
        )
        if max_turns is not None:
            if max_turns < 1:
                raise ValueError(f"max_turns must be >= 1, got {max_turns}")
            self.max_turns = int(max_turns)
        if system_prompt is not None:
            self.system_prompt = system_prompt
        if not self.env_id:
            self.env_id = type(self).__name__
        self.action_space = MessageSpace()
        self.observation_space = MessagesSpace()
        self._hooks = collect_hooks(self)
        self.reward_weights = {h.spec.name: h.spec.weight for h in self._hooks["reward"]}
        for name, w in (reward_weights or {}).items():
            if name not in self.reward_weights:
                raise ValueError(f"unknown reward component {name!r}; known: {sorted(self.reward_weights)}")
            self.reward_weights[name] = float(w)
        self.task: Task | None = None
        self.messages: list[Message] = []
        self.state: dict[str, Any] = {}
        self.turn = 0
        self.tool_errors = _empty_tool_errors()
        self._done = False
        self._in_episode = False
        self._runner: asyncio.Runner | None = None

    # ---- overridable ---------------------------------------------------------------------------------
    def default_tasks(self) -> TaskSource:
        """The tasks used when none are passed to the constructor."""
        raise EnvError(f"{type(self).__name__} has no default tasks; pass tasks=...")

    async def on_reset(self, task: Task) -> None:
        """Prepare per-episode state (`self.state`, databases, sandboxes) for `task`."""

    def initial_messages(self, task: Task) -> list[Message]:
        """The reset observation: the system prompt (if any) and the task prompt as a user message."""
        msgs = [Message(role="system", content=self.system_prompt)] if self.system_prompt else []
        return [*msgs, Message(role="user", content=task.prompt)]

    async def react(self, action: Message) -> list[Message]:
        """The messages the env adds after `action` (tool results, a user turn). Plain envs add none."""
        return []

    def is_final(self, action: Message) -> bool:
        """Whether `action` ends the episode; by default an assistant message without tool calls does."""
        return not action.tool_calls

    def tool_schemas(self) -> list[dict[str, Any]]:
        """OpenAI-style function schemas for the chat template (none for a plain `Env`)."""
        return []

    def oracle(self) -> OraclePolicy:
        """The scripted policy that solves this env's tasks (used by tests, demos and SFT data)."""
        raise NoOracleError(f"{type(self).__name__} provides no oracle policy")

    def parse_action(self, text: str) -> Message:
        """Turn raw model text into an assistant message (plain envs: text only)."""
        return Message(role="assistant", content=text)

    # ---- the gymnasium API, async first ----------------------------------------------------------------
    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        """Start an episode. `options={"task": Task}` or `{"task_id": str}` picks a task; else the seed does."""
        if self._in_episode:
            await self._run_cleanup()
        super().reset(seed=seed)
        options = dict(options or {})
        if "task" in options:
            task = options["task"]
            if not isinstance(task, Task):
                raise EnvError(f"options['task'] must be a Task, got {type(task).__name__}")
        elif "task_id" in options:
            task = self.tasks.get(str(options["task_id"]))
        else:
            task = self.tasks.sample(self.np_random)
        self.task = task
        self.state = {}
        self.turn = 0
        self.tool_errors = _empty_tool_errors()
        self._done = False
        self._in_episode = True
        await self.on_reset(task)
        obs = self.initial_messages(task)
        self.messages = list(obs)
        return list(obs), {
            "task_id": task.id,
            "env_id": self.env_id,
            "turn": 0,
            "tool_errors": dict(self.tool_errors),
        }

    async def astep(
        self, action: Message | str | Mapping[str, Any]
    ) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        """Apply one assistant message; returns (observation, reward, terminated, truncated, info)."""
        if self.task is None:
            raise ResetNeededError(f"{self.env_id}: call reset() before step()")
        if self._done:
            raise EpisodeOverError(f"{self.env_id}: the episode is over; call reset()")
        action = self._coerce_action(action)
        self.turn += 1
        self.messages.append(action)
        final = self.is_final(action)
        obs = [] if final else await self.react(action)
        self.messages.extend(obs)
        info: dict[str, Any] = {"task_id": self.task.id, "env_id": self.env_id, "turn": self.turn}
        stop = None if final else await self._first_stop(action, info)
        terminated = final or stop is not None
        truncated = not terminated and self.turn >= self.max_turns
        info["tool_errors"] = dict(self.tool_errors)
        reward = 0.0
        if terminated or truncated:
            self._done = True
            components = await self._rewards(action, info)
            weights = dict(self.reward_weights)
            reward = float(sum(weights[k] * v for k, v in components.items()))
            problem = reward_problem(reward)
            if problem is not None:
                raise HookError(
                    f"the weighted reward is {problem} (weights {weights}); keep rewards within "
                    f"±{MAX_ABS_REWARD:g}"
                )
            info["reward_components"] = components
            info["reward_weights"] = weights
            info["success"] = self.is_success(components)
            info["termination"] = (
                TerminationReason.DONE if terminated else TerminationReason.MAX_TURNS
            ).value
            info["stop_reason"] = "final_answer" if final else (stop or "max_turns")
            await self._run_cleanup()
        else:
            info["reward_components"] = {}
        return list(obs), reward, terminated, truncated, info

    def is_success(self, components: Mapping[str, float]) -> bool:
        """Whether the episode counts as solved, from its unweighted reward components."""
        if self.success_component is not None:
            return components.get(self.success_component, 0.0) >= 1.0
        positive = [k for k, w in self.reward_weights.items() if w > 0]
        return bool(positive) and all(components.get(k, 0.0) >= 1.0 for k in positive)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        """Sync twin of `areset` (not usable inside a running event loop)."""
        return self._run(self.areset(seed=seed, options=options))

    def step(
        self, action: Message | str | Mapping[str, Any]
    ) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        """Sync twin of `astep` (not usable inside a running event loop)."""
        return self._run(self.astep(action))

    async def aclose(self) -> None:
        """Run pending cleanup hooks and release resources."""
        if self._in_episode:
            await self._run_cleanup()

    def close(self) -> None:
        """Run pending cleanup hooks and release resources; safe to call twice."""
        if self._in_episode:
            self._run(self.aclose())
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        super().close()

    def render(self) -> str | None:
        """`render_mode="ansi"`: the conversation so far as text."""
        if self.render_mode != "ansi":
            return None
        lines = []
        for m in self.messages:
            calls = "".join(f"\n  -> {c.name}({c.raw_arguments or c.arguments})" for c in m.tool_calls)
            lines.append(f"[{m.role}] {m.content}{calls}")
        return "\n".join(lines) + "\n"

    # ---- internals ------------------------------------------------------------------------------------
    def _run(self, coro: Any) -> Any:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            coro.close()
            raise EnvError(
                "sync reset()/step()/close() called inside a running event loop; "
                "use await env.areset()/astep()/aclose()"
            )
        if self._runner is None:
            self._runner = asyncio.Runner()
        return self._runner.run(coro)

    def _coerce_action(self, action: Any) -> Message:
        if isinstance(action, str):
            action = self.parse_action(action)
        elif isinstance(action, Mapping):
            try:
                action = Message.from_dict(dict(action))
            except (KeyError, TypeError, AttributeError) as exc:
                raise InvalidActionError(f"cannot build a Message from {action!r}: {exc}") from exc
        if not isinstance(action, Message):
            raise InvalidActionError(f"action must be a Message, str or dict, got {type(action).__name__}")
        if action.role != "assistant":
            raise InvalidActionError(f"action must be an assistant message, got role {action.role!r}")
        return action

    def _hook_values(self, action: Message, info: dict[str, Any]) -> dict[str, Any]:
        assert self.task is not None
        return {
            "task": self.task,
            "answer": self.task.answer,
            "messages": list(self.messages),
            "final": action.content if not action.tool_calls else "",
            "action": action,
            "turn": self.turn,
            "tool_errors": dict(self.tool_errors),
            "state": self.state,
            "info": info,
            "env": self,
        }

    async def _call(self, hook: BoundHook, values: Mapping[str, Any]) -> Any:
        try:
            return await hook(values)
        except Exception as exc:
            raise HookError(
                f"{type(self).__name__}.{hook.fn.__name__} ({hook.spec.kind} hook) raised "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    async def _first_stop(self, action: Message, info: dict[str, Any]) -> str | None:
        values = self._hook_values(action, info)
        for hook in self._hooks["stop"]:
            if await self._call(hook, values):
                return hook.spec.name
        return None

    async def _rewards(self, action: Message, info: dict[str, Any]) -> dict[str, float]:
        values = self._hook_values(action, info)
        out: dict[str, float] = {}
        for hook in self._hooks["reward"]:
            value = await self._call(hook, values)
            if isinstance(value, bool):
                value = float(value)
            problem = reward_problem(value)
            if problem is not None:
                raise HookError(
                    f"reward {hook.spec.name!r} returned {problem}; a reward must be a finite number "
                    f"within ±{MAX_ABS_REWARD:g}"
                )
            out[hook.spec.name] = float(value)
        return out

    async def _run_cleanup(self) -> None:
        self._in_episode = False
        errors = []
        for hook in self._hooks["cleanup"]:
            try:
                await self._call(
                    hook,
                    {
                        "task": self.task,
                        "answer": getattr(self.task, "answer", None),
                        "messages": list(self.messages),
                        "final": "",
                        "action": None,
                        "turn": self.turn,
                        "tool_errors": dict(self.tool_errors),
                        "state": self.state,
                        "info": {},
                        "env": self,
                    },
                )
            except HookError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
