"""`ToolEnv`: an `Env` whose `@tool` methods are the agent's tools.

Each step runs the assistant's tool calls through `miles.tools.ToolBox` (validated, concurrent, with
timeouts) and returns the results as tool messages. A bad call becomes an error tool message, is counted
in `info["tool_errors"]` by type, and the episode goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from miles.envs.base import Env
from miles.envs.tasks import Task, TaskSource
from miles.tools import ToolBox, collect_tools, get_parser
from miles.types import Message


class ToolEnv(Env):
    """An environment with tools: its `@tool` methods plus any `tools=` functions passed in.

    Per-episode values for `Injected[...]` tool parameters come from `tool_context()`, which by default
    offers `env` (this env) and `state` (the per-episode `self.state` dict).
    """

    parser: str = "hermes"
    tool_timeout_s: float = 10.0
    max_tool_output_chars: int = 4096

    def __init__(
        self,
        tasks: TaskSource | Iterable[Task | Mapping[str, Any]] | None = None,
        *,
        tools: Iterable[Callable[..., Any]] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(tasks, **kwargs)
        self._tool_fns = [*collect_tools(self), *tools]
        self.toolbox = self._make_toolbox()
        self._parser = get_parser(self.parser)

    def tool_context(self) -> dict[str, Any]:
        """Values injected into `Injected[...]` tool parameters, by parameter name."""
        return {"env": self, "state": self.state}

    def _make_toolbox(self) -> ToolBox:
        return ToolBox(
            self._tool_fns,
            default_timeout_s=self.tool_timeout_s,
            max_output_chars=self.max_tool_output_chars,
            context=self.tool_context(),
        )

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The OpenAI function schemas of this env's tools, derived from their signatures."""
        return self.toolbox.schemas()

    @property
    def tool_names(self) -> list[str]:
        return list(self.toolbox.names)

    def parse_action(self, text: str) -> Message:
        """Raw model text -> assistant message, with tool calls (and reasoning) parsed by `self.parser`."""
        return self._parser.parse(text).to_message()

    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        obs, info = await super().areset(seed=seed, options=options)
        self.toolbox.context = self.tool_context()  # the new episode's state
        return obs, info

    async def react(self, action: Message) -> list[Message]:
        results = await self.toolbox.execute(list(action.tool_calls))
        for r in results:
            if r.error is not None:
                self.tool_errors[r.error.value] = self.tool_errors.get(r.error.value, 0) + 1
        self.state.setdefault("tool_calls", []).extend(
            {"name": r.name, "error": r.error.value if r.error else None, "content": r.content}
            for r in results
        )
        return [r.to_message() for r in results]
