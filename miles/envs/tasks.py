"""Tasks and task sources: where an environment's episodes come from.

A `TaskSource` is either finite (rows from JSONL, Parquet or any iterable) or generated (a function of a
seeded random generator, so task `i` of seed `s` is always the same task). Both can be split
deterministically into train and held-out parts by hashing each task's prompt, so the same prompt never
lands on both sides.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


class TaskSourceError(ValueError):
    """A task row or a task source is malformed (missing prompt, duplicate id, empty source, ...)."""


class UnknownTaskError(KeyError):
    """`TaskSource.get` was asked for a task id the source does not hold."""


@dataclass
class Task:
    """One episode's problem: the user prompt, the reference answer and any extra data the env needs.

    Splits hash the prompt, or `data["split_key"]` where tasks with different prompts must land on the same
    side (variants of one problem); a `split` field ("train" or "held_out", a task file's column) puts the
    task on that side whatever its hash."""

    id: str
    prompt: str
    answer: Any = None
    data: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_row(cls, row: Mapping[str, Any], *, default_id: str) -> Task:
        """Build a task from a dataset row: `prompt` is required, `id`/`answer`/`data` optional.

        Keys other than those four are merged into `data`.
        """
        if not isinstance(row, Mapping):
            raise TaskSourceError(f"task row {default_id} is a {type(row).__name__}, expected a mapping")
        if "prompt" not in row or not isinstance(row["prompt"], str):
            raise TaskSourceError(f"task row {default_id} has no string 'prompt' (keys: {sorted(row)})")
        data = dict(row.get("data") or {})
        data.update({k: v for k, v in row.items() if k not in ("id", "prompt", "answer", "data")})
        task_id = row.get("id")
        return cls(
            id=str(task_id) if task_id is not None else default_id,
            prompt=row["prompt"],
            answer=row.get("answer"),
            data=data,
        )

    def to_row(self) -> dict[str, Any]:
        """The JSON-friendly row form, inverse of `from_row`."""
        return {"id": self.id, "prompt": self.prompt, "answer": self.answer, "data": dict(self.data)}


def _split_bucket(prompt: str, salt: str) -> float:
    digest = hashlib.sha256(f"{salt}\x00{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


@dataclass(frozen=True)
class _SplitFilter:
    held_out: float
    salt: str
    keep_held_out: bool

    def __call__(self, task: Task) -> bool:
        if "split" in task.data:  # a task file's own split column decides
            return (task.data["split"] == "held_out") == self.keep_held_out
        key = str(task.data.get("split_key", task.prompt))
        return (_split_bucket(key, self.salt) < self.held_out) == self.keep_held_out


class TaskSource:
    """An indexable collection of tasks, finite or generated.

    Build one with `from_jsonl`, `from_parquet`, `from_iterable` or `from_generator`; an env calls
    `sample(rng)` on reset and `get(task_id)` when asked for a specific task.
    """

    def __init__(
        self,
        *,
        tasks: list[Task] | None = None,
        generator: Callable[[np.random.Generator], Task | Mapping[str, Any]] | None = None,
        seed: int = 0,
        name: str = "tasks",
        filters: tuple[Callable[[Task], bool], ...] = (),
    ) -> None:
        if (tasks is None) == (generator is None):
            raise TaskSourceError("a TaskSource needs exactly one of `tasks` or `generator`")
        self.name = name
        self.seed = int(seed)
        self._generator = generator
        self._filters = filters
        self._tasks: list[Task] | None = None
        self._by_id: dict[str, Task] = {}
        if tasks is not None:
            kept = [t for t in tasks if all(f(t) for f in filters)]
            for t in kept:
                if t.id in self._by_id:
                    raise TaskSourceError(f"duplicate task id {t.id!r} in {name}")
                self._by_id[t.id] = t
            self._tasks = kept

    # ---- constructors -------------------------------------------------------------------------------
    @classmethod
    def from_iterable(cls, rows: Iterable[Task | Mapping[str, Any]], *, name: str = "tasks") -> TaskSource:
        """Tasks from `Task` objects or row mappings (`prompt` required; `id` defaults to `name-<index>`)."""
        tasks = [
            r if isinstance(r, Task) else Task.from_row(r, default_id=f"{name}-{i}")
            for i, r in enumerate(rows)
        ]
        if not tasks:
            raise TaskSourceError(f"task source {name!r} is empty")
        return cls(tasks=tasks, name=name)

    @classmethod
    def from_jsonl(cls, path: str | Path) -> TaskSource:
        """One JSON object per line; blank lines are skipped. Bad lines raise `TaskSourceError` with the line."""
        path = Path(path)
        tasks = []
        try:
            with path.open(encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise TaskSourceError(f"{path}:{lineno}: invalid JSON: {exc}") from None
                    tasks.append(
                        _checked(
                            _row_at(row, f"{path.stem}-{lineno}", f"{path}:{lineno}"), f"{path}:{lineno}"
                        )
                    )
        except (OSError, UnicodeDecodeError) as exc:
            raise TaskSourceError(f"cannot read the task file {str(path)!r}: {exc}") from None
        return cls.from_iterable(tasks, name=path.stem)

    @classmethod
    def from_parquet(cls, path: str | Path) -> TaskSource:
        """Rows of a Parquet file (needs `pyarrow`, the `parquet` extra)."""
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:  # pragma: no cover - depends on the installation
            raise TaskSourceError("reading Parquet needs pyarrow: pip install 'miles-rl[parquet]'") from exc
        path = Path(path)
        try:
            rows = pq.read_table(path).to_pylist()
        except (OSError, ValueError) as exc:
            raise TaskSourceError(f"cannot read the task file {str(path)!r}: {exc}") from None
        return cls.from_iterable(
            [
                _checked(_row_at(row, f"{path.stem}-{i}", f"{path} row {i}"), f"{path} row {i}")
                for i, row in enumerate(rows)
            ],
            name=path.stem,
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> TaskSource:
        """Tasks from a `.jsonl` or `.parquet` file, checked row by row (errors name the row and the field)."""
        path = Path(path)
        if path.suffix == ".jsonl":
            return cls.from_jsonl(path)
        if path.suffix == ".parquet":
            return cls.from_parquet(path)
        raise TaskSourceError(f"{str(path)!r}: a task file ends in .jsonl or .parquet")

    @classmethod
    def from_generator(
        cls,
        fn: Callable[[np.random.Generator], Task | Mapping[str, Any]],
        seed: int = 0,
        *,
        name: str = "generated",
    ) -> TaskSource:
        """An unbounded source: task `i` is `fn(numpy.random.default_rng([seed, i]))`.

        `fn` returns a `Task` or a row; its id is replaced by `"<name>-<seed>-<i>"` so `get` can rebuild it.
        """
        return cls(generator=fn, seed=seed, name=name)

    # ---- access -------------------------------------------------------------------------------------
    @property
    def is_finite(self) -> bool:
        return self._tasks is not None

    def __len__(self) -> int:
        if self._tasks is None:
            raise TypeError(f"generated task source {self.name!r} has no length; use take(n)")
        return len(self._tasks)

    def _generate(self, index: int) -> Task:
        assert self._generator is not None
        out = self._generator(np.random.default_rng([self.seed, index]))
        task_id = f"{self.name}-{self.seed}-{index}"
        if isinstance(out, Task):
            return Task(id=task_id, prompt=out.prompt, answer=out.answer, data=dict(out.data))
        return Task.from_row({**out, "id": task_id}, default_id=task_id)

    def _accept(self, task: Task) -> bool:
        return all(f(task) for f in self._filters)

    #: A generated source gives up after this many generated tasks in a row fail its filters (an empty split).
    max_misses: int = 10_000

    def __iter__(self) -> Iterator[Task]:
        if self._tasks is not None:
            yield from self._tasks
            return
        index = misses = 0
        while True:
            task = self._generate(index)
            if self._accept(task):
                misses = 0
                yield task
            else:
                misses += 1
                if misses >= self.max_misses:
                    raise TaskSourceError(
                        f"task source {self.name!r} ({self.split_name} split): none of {misses} generated tasks in a "
                        "row passed its filters; the generator makes too few distinct prompts for this split "
                        "(raise held_out_fraction or vary the prompts)"
                    )
            index += 1

    def take(self, n: int) -> list[Task]:
        """The first `n` tasks in order (fewer if a finite source is shorter)."""
        out = []
        for task in self:
            if len(out) >= n:
                break
            out.append(task)
        return out

    def get(self, task_id: str) -> Task:
        """The task with this id; raises `UnknownTaskError`."""
        if self._tasks is not None:
            try:
                return self._by_id[task_id]
            except KeyError:
                raise UnknownTaskError(f"task source {self.name!r} has no task {task_id!r}") from None
        prefix = f"{self.name}-{self.seed}-"
        if task_id.startswith(prefix) and task_id[len(prefix) :].isdigit():
            task = self._generate(int(task_id[len(prefix) :]))
            if self._accept(task):
                return task
        raise UnknownTaskError(f"task source {self.name!r} has no task {task_id!r}")

    def sample(self, rng: np.random.Generator, *, max_tries: int = 10_000) -> Task:
        """One task drawn with `rng` (the env's `np_random`), so seeded resets are reproducible."""
        if self._tasks is not None:
            if not self._tasks:
                raise TaskSourceError(f"task source {self.name!r} is empty")
            return self._tasks[int(rng.integers(len(self._tasks)))]
        for _ in range(max_tries):
            task = self._generate(int(rng.integers(2**62)))
            if self._accept(task):
                return task
        raise TaskSourceError(f"task source {self.name!r}: no task passed its filters in {max_tries} draws")

    # ---- splitting ----------------------------------------------------------------------------------
    def split(self, held_out: float = 0.1, *, salt: str = "") -> tuple[TaskSource, TaskSource]:
        """Deterministic (train, held_out) parts; a task is held out when the hash of its prompt (or split key)
        says so.

        Splitting by prompt keeps identical prompts (which generators produce) on one side only.
        """
        if not 0.0 <= held_out <= 1.0:
            raise TaskSourceError(f"held_out must be in [0, 1], got {held_out}")
        parts = []
        for keep in (False, True):
            filt = _SplitFilter(held_out, salt, keep)
            suffix = "held_out" if keep else "train"
            if self._tasks is not None:
                parts.append(
                    TaskSource(
                        tasks=[t for t in self._tasks if filt(t)], name=f"{self.name}", filters=self._filters
                    )
                )
            else:
                parts.append(
                    TaskSource(
                        generator=self._generator,
                        seed=self.seed,
                        name=self.name,
                        filters=(*self._filters, filt),
                    )
                )
            parts[-1].split_name = suffix
        return parts[0], parts[1]

    split_name: str = "all"

    def __repr__(self) -> str:
        size = len(self._tasks) if self._tasks is not None else "generated"
        return f"TaskSource(name={self.name!r}, split={self.split_name!r}, size={size}, seed={self.seed})"


def as_task_source(
    tasks: TaskSource | Iterable[Task | Mapping[str, Any]] | str | os.PathLike[str] | None,
    *,
    name: str = "tasks",
) -> TaskSource | None:
    """Accept a `TaskSource`, an iterable of tasks/rows, the path of a `.jsonl` / `.parquet` task file, or
    None."""
    if tasks is None or isinstance(tasks, TaskSource):
        return tasks
    if isinstance(tasks, str | os.PathLike):
        return TaskSource.from_file(tasks)
    return TaskSource.from_iterable(tasks, name=name)


def _row_at(row: Any, default_id: str, where: str) -> Task:
    try:
        return Task.from_row(row, default_id=default_id)
    except TaskSourceError as exc:
        raise TaskSourceError(f"{where}: {exc}") from None


def _checked(task: Task, where: str) -> Task:
    """`task` from a row at `where`, once its split field (if any) is one `select_split` knows."""
    split = task.data.get("split")
    if split is not None and split not in ("train", "held_out"):
        raise TaskSourceError(f"{where}: field 'split' is {split!r}; use 'train' or 'held_out'")
    return task


SPLITS = ("all", "train", "held_out")


def select_split(source: TaskSource, split: str, held_out: float = 0.1, *, salt: str = "") -> TaskSource:
    """`source` itself for "all", else its deterministic "train" or "held_out" part."""
    if split not in SPLITS:
        raise TaskSourceError(f"split must be one of {SPLITS}, got {split!r}")
    if split == "all":
        return source
    train, held = source.split(held_out, salt=salt)
    return train if split == "train" else held
