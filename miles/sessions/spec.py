"""What one session is asked to run: the task (reset seed and options), its group and its seed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles.sessions.records import jsonable


class InvalidTaskError(TypeError):
    """A task item is none of: `TaskSpec`, `Task`, task id string, int seed, dict of reset options."""


@dataclass
class TaskSpec:
    """How to reset the env for one task: `options` go to `env.areset` (e.g. `{"task": Task}` or
    `{"task_id": "t3"}`); `seed` seeds the reset (and the sampling) when set."""

    task_id: str | None = None
    seed: int | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, item: Any) -> TaskSpec:
        """Normalise a task item: a `TaskSpec`, a `miles.envs.Task` (anything with `id` and `prompt`),
        a task id string, an int seed, or a dict of reset options."""
        if isinstance(item, TaskSpec):
            return item
        if isinstance(item, bool):
            raise InvalidTaskError("a task cannot be a bool")
        if isinstance(item, int):
            return cls(seed=item)
        if isinstance(item, str):
            return cls(task_id=item, options={"task_id": item})
        if isinstance(item, dict):
            tid = item.get("task_id")
            task = item.get("task")
            if tid is None and task is not None:
                tid = getattr(task, "id", None)
            return cls(task_id=str(tid) if tid is not None else None, options=dict(item))
        if hasattr(item, "id") and hasattr(item, "prompt"):
            return cls(task_id=str(item.id), options={"task": item})
        raise InvalidTaskError(
            f"cannot make a task from a {type(item).__name__}; pass a Task, a task id, "
            "a seed or a dict of reset options"
        )

    def to_record(self) -> dict[str, Any]:
        """JSON form; a `Task` object in `options["task"]` is stored as its row (`to_row()`)."""
        options = dict(self.options)
        task = options.get("task")
        if task is not None and hasattr(task, "to_row"):
            options["task"] = task.to_row()
        return {"task_id": self.task_id, "seed": self.seed, "options": jsonable(options)}


@dataclass
class SessionSpec:
    """One session: its id, task, group (GRPO) and sample index within the group, and its seed."""

    session_id: str
    task: TaskSpec = field(default_factory=TaskSpec)
    group_id: str = ""
    sample_index: int = 0
    seed: int | None = None
