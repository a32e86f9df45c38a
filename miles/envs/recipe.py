"""`EnvRecipe`: how to build an environment again, anywhere: its registry id, constructor kwargs and the user
modules that register it. The train loop builds its envs from one; every session record stores it, so
`miles replay --check` can rebuild a user's env exactly.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.config import ConfigError
from miles.envs.base import Env
from miles.envs.tasks import TaskSourceError

IMPORT_KEY = "env.import"


def _is_path(name: str) -> bool:
    return name.endswith(".py") or "/" in name or os.sep in name


def error_line(exc: BaseException) -> str:
    """`exc` as one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _put_first_on_path(folder: str) -> None:
    if folder not in sys.path:
        sys.path.insert(0, folder)


def import_user_modules(names: Iterable[str]) -> None:
    """Import the modules that register user environments, in order.

    Each name is a dotted module name ("bank_env", "mypkg.envs") or a path to a `.py` file or a package
    folder ("envs/bank.py", "./mypkg"); a path's folder goes on `sys.path` and the module is imported under
    its own name. The working directory is put on `sys.path` first (the `miles` console script does not add
    it). A failure raises `ConfigError("env.import", ...)`: one line naming the module, the reason and the fix.
    """
    _put_first_on_path(os.getcwd())
    for name in names:
        if _is_path(name):
            path = Path(name).expanduser()
            if not path.exists():
                raise ConfigError(
                    IMPORT_KEY,
                    f"cannot import {name!r}: no such file or folder (from {os.getcwd()}); "
                    "give a path that exists, or a module name on PYTHONPATH",
                )
            path = path.resolve()
            if path.is_dir() and not (path / "__init__.py").is_file():
                raise ConfigError(
                    IMPORT_KEY,
                    f"cannot import {name!r}: the folder has no __init__.py; "
                    "give the .py file that registers the env, or make the folder a package",
                )
            _put_first_on_path(str(path.parent))
            module = path.stem if path.suffix == ".py" else path.name
        else:
            module = name
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name == module or module.startswith(f"{exc.name}."):
                raise ConfigError(
                    IMPORT_KEY,
                    f"cannot import {name!r}: no module named {exc.name!r}; run from "
                    "the folder that holds it, add that folder to PYTHONPATH, or give the path "
                    "to its .py file",
                ) from exc
            raise ConfigError(
                IMPORT_KEY,
                f"cannot import {name!r}: {error_line(exc)} (a module it imports is missing; install it)",
            ) from exc
        except Exception as exc:  # the user's module itself raised
            raise ConfigError(
                IMPORT_KEY,
                f"cannot import {name!r}: {error_line(exc)}; run "
                f"`python -c 'import {module}'` to see the traceback",
            ) from exc


def _plain(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    try:
        return json.loads(json.dumps(dict(kwargs), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            "env.kwargs",
            f"{exc}; a recipe's constructor kwargs must be plain JSON data "
            "(numbers, strings, lists, mappings) so a replay can rebuild the env",
        ) from exc


#: (working directory, imports) of the recipes whose modules this process imported: `make` runs once per
#: session, and resolving the paths again each time cost the async benchmark's rollout process 5% of its time.
_IMPORTED: set[tuple[str, tuple[str, ...]]] = set()


@dataclass(frozen=True)
class EnvRecipe:
    """An env's registry `id`, its constructor `kwargs` (plain JSON data, tuples stored as lists) and the
    user modules (`imports`, see `import_user_modules`) that register it.

    `make(**loop_kwargs)` imports the modules and returns `miles.envs.make(id, **kwargs, **loop_kwargs)`;
    `to_record()` / `from_record()` are its JSON form in session records.
    """

    id: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    imports: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ConfigError("env.id", f"must be a non-empty env id, got {self.id!r}")
        if isinstance(self.imports, str):
            raise ConfigError(IMPORT_KEY, f"must be a list of modules, got the string {self.imports!r}")
        object.__setattr__(self, "kwargs", _plain(self.kwargs))
        object.__setattr__(self, "imports", tuple(str(m) for m in self.imports))

    def import_modules(self) -> None:
        """Import `imports` (see `import_user_modules`), once per process and working directory."""
        key = (os.getcwd(), self.imports)
        if key not in _IMPORTED:
            import_user_modules(self.imports)
            _IMPORTED.add(key)

    def make(self, **loop_kwargs: Any) -> Env:
        """A fresh env: imports, then `miles.envs.make(id, **{**kwargs, **loop_kwargs})`.

        An unknown id raises `miles.envs.UnknownEnvError` (a `ConfigError` on `env.id`); constructor kwargs
        the env does not take raise `ConfigError("env.kwargs", ...)`.
        """
        from miles.envs.registry import make

        self.import_modules()
        kwargs = {**self.kwargs, **loop_kwargs}
        try:
            return make(self.id, **kwargs)
        except TaskSourceError as exc:  # a task file that cannot be read, or a row that is not a task
            raise ConfigError("env.tasks", str(exc)) from None
        except TypeError as exc:
            raise ConfigError(
                "env.kwargs", f"cannot build {self.id!r} with {sorted(kwargs)}: {error_line(exc)}"
            ) from exc

    def to_record(self) -> dict[str, Any]:
        """The JSON form: `{"id", "kwargs", "imports"}`."""
        return {"id": self.id, "kwargs": dict(self.kwargs), "imports": list(self.imports)}

    @classmethod
    def from_record(cls, data: Mapping[str, Any]) -> EnvRecipe:
        """Inverse of `to_record`."""
        return cls(
            id=data["id"], kwargs=dict(data.get("kwargs") or {}), imports=tuple(data.get("imports") or ())
        )

    def with_kwargs(self, **kwargs: Any) -> EnvRecipe:
        """This recipe with `kwargs` added to (or replacing) its constructor kwargs, e.g. the loop's
        `split=`, so that what is recorded is everything the env was built with."""
        return EnvRecipe(self.id, {**self.kwargs, **kwargs}, self.imports)
