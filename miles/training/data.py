"""The training data of a run: the tasks of a split, and the seeded, resumable order they are trained in."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from miles.config import ConfigError
from miles.envs import EnvRecipe, Task, TaskSourceError


@dataclass
class TaskCursor:
    """A deterministic, resumable walk over the training tasks: a seeded shuffle per epoch.

    Position `p` is always the same task index (`index_at(p)`), so a run resumed at a position, or a rollout
    process handed positions out of order, trains on exactly the tasks a straight run would.
    """

    num_tasks: int
    seed: int
    position: int = 0

    def index_at(self, position: int) -> int:
        """The task index at `position` of the walk."""
        epoch, offset = divmod(position, self.num_tasks)
        return int(np.random.default_rng([self.seed, epoch]).permutation(self.num_tasks)[offset])

    def next(self, n: int) -> list[int]:
        """The task indices of the next `n` positions."""
        out = [self.index_at(self.position + i) for i in range(n)]
        self.position += n
        return out

    def to_dict(self) -> dict[str, int]:
        return {"num_tasks": self.num_tasks, "seed": self.seed, "position": self.position}


def load_tasks(recipe: EnvRecipe, split: str, n: int, *, distinct: bool = False) -> list[Task]:
    """The first `n` tasks of `split`; with `distinct`, the first `n` different prompts (generated task spaces
    repeat problems), or all of them when the split has fewer. An empty or endless split is a `ConfigError`."""
    env = recipe.with_kwargs(split=split).make()
    try:
        if not distinct:
            tasks = env.tasks.take(n)
        else:
            seen: dict[str, Task] = {}
            for i, task in enumerate(env.tasks):
                seen.setdefault(task.prompt, task)
                if len(seen) >= n or i >= 100 * n:
                    break
            tasks = list(seen.values())
    except TaskSourceError as exc:
        raise ConfigError("env", f"the {split!r} split of {recipe.id}: {exc}") from None
    finally:
        env.close()
    if not tasks:
        raise ConfigError(
            "env",
            f"the {split!r} split of {recipe.id} has no tasks; give the env more tasks or "
            "another split (env.train_split / env.eval_split)",
        )
    return tasks
