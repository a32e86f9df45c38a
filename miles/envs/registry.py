"""The environment registry: `register`, `make`, `registry`; every id is also a gymnasium id `miles/<id>`."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gymnasium

from miles.config import ConfigError
from miles.envs.base import Env

NAMESPACE = "miles"


class RegistryError(ValueError):
    """A registration conflicts with an existing one or names an unusable entry point."""


class UnknownEnvError(ConfigError, KeyError):
    """`make` was asked for an id nobody registered. A `ConfigError` on key `env.id`, so the CLI prints its
    one-line message (with the fix) instead of a traceback."""

    def __init__(self, message: str) -> None:
        super().__init__("env.id", message)

    def __str__(self) -> str:  # KeyError would quote the message
        return ConfigError.__str__(self)


@dataclass(frozen=True)
class EnvSpec:
    """One registered environment: `make(id, **kw)` calls `entry_point(**{**kwargs, **kw})`."""

    id: str
    entry_point: str | Callable[..., Env]
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def gym_id(self) -> str:
        return f"{NAMESPACE}/{self.id}"

    def load(self) -> Callable[..., Env]:
        if callable(self.entry_point):
            return self.entry_point
        module, _, attr = self.entry_point.partition(":")
        if not attr:
            raise RegistryError(f"entry point {self.entry_point!r} must look like 'package.module:Name'")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise RegistryError(f"cannot load entry point {self.entry_point!r}: {exc}") from exc


_REGISTRY: dict[str, EnvSpec] = {}


def _make_for_gym(spec_id: str) -> Callable[..., Env]:
    def factory(**kwargs: Any) -> Env:
        return make(spec_id, **kwargs)

    factory.__name__ = f"make_{spec_id.replace('-', '_')}"
    return factory


def register(id: str, entry_point: str | Callable[..., Env], **kwargs: Any) -> EnvSpec:
    """Register an environment under `id` (e.g. "Calculator-v0") and as gymnasium id "miles/<id>".

    Registering the same id again with the same entry point and kwargs is a no-op; anything else raises
    `RegistryError`.
    """
    if not isinstance(id, str) or not id or "/" in id:
        raise RegistryError(f"env id must be a non-empty string without '/', got {id!r}")
    if not (callable(entry_point) or isinstance(entry_point, str)):
        raise RegistryError(f"entry_point must be a callable or 'module:Name', got {entry_point!r}")
    spec = EnvSpec(id, entry_point, dict(kwargs))
    old = _REGISTRY.get(id)
    if old is not None:
        if old == spec:
            return old
        raise RegistryError(f"env id {id!r} is already registered with {old.entry_point!r}")
    try:
        gymnasium.register(id=spec.gym_id, entry_point=_make_for_gym(id))
    except gymnasium.error.Error as exc:
        raise RegistryError(f"gymnasium rejected id {spec.gym_id!r}: {exc}") from exc
    _REGISTRY[id] = spec
    return spec


def make(id: str, **kwargs: Any) -> Env:
    """Build a registered environment; `kwargs` override the registered ones."""
    if id.startswith(f"{NAMESPACE}/"):
        id = id[len(NAMESPACE) + 1 :]
    spec = _REGISTRY.get(id)
    if spec is None:
        close = difflib.get_close_matches(id, list(_REGISTRY), n=3)
        hint = (
            f"did you mean {', '.join(close)}?"
            if close
            else f"registered: {', '.join(sorted(_REGISTRY))}; "
            "an env of your own must be registered first: import its module (env.import / --import)"
        )
        raise UnknownEnvError(f"no environment registered as {id!r}; {hint}")
    env = spec.load()(**{**spec.kwargs, **kwargs})
    if not isinstance(env, Env):
        raise RegistryError(f"entry point of {id!r} returned {type(env).__name__}, not a miles Env")
    env.env_id = id
    return env


def registry() -> dict[str, EnvSpec]:
    """A copy of the registry: id -> `EnvSpec`."""
    return dict(_REGISTRY)
