"""Hook decorators for environments: `@reward`, `@stop_condition`, `@cleanup`.

Hooks are ordinary (sync or async) methods. Each declares the values it wants by parameter name, chosen
from `HOOK_ARGUMENTS`; the env supplies them when it calls the hook:

    @reward(weight=1.0)
    def correct(self, final: str, answer: int) -> float: ...
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

#: Names a hook may ask for. `final` is the content of the last assistant message ("" if none).
HOOK_ARGUMENTS = (
    "task",
    "answer",
    "messages",
    "final",
    "action",
    "turn",
    "tool_errors",
    "state",
    "info",
    "env",
)


class HookDefinitionError(TypeError):
    """A hook asks for an argument the env cannot supply, or a hook decorator is misused."""


@dataclass(frozen=True)
class HookSpec:
    """What a decorator recorded on a method."""

    kind: str  # "reward" | "stop" | "cleanup"
    name: str
    weight: float = 1.0
    params: tuple[str, ...] = ()


def _params(fn: Callable[..., Any], kind: str) -> tuple[str, ...]:
    names = []
    for i, (pname, p) in enumerate(inspect.signature(fn).parameters.items()):
        if i == 0 and pname == "self":
            continue
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise HookDefinitionError(f"@{kind} hook {fn.__qualname__} may not take *args/**kwargs")
        if pname not in HOOK_ARGUMENTS:
            raise HookDefinitionError(
                f"@{kind} hook {fn.__qualname__} asks for {pname!r}; available: {', '.join(HOOK_ARGUMENTS)}"
            )
        names.append(pname)
    return tuple(names)


def reward(fn: Callable[..., Any] | None = None, *, weight: float = 1.0, name: str | None = None) -> Any:
    """Mark a method as a reward component; the episode reward is the weighted sum of all components.

    The component value (unweighted) is kept in `info["reward_components"][name]`.
    """

    def deco(f: Callable[..., Any]) -> Callable[..., Any]:
        f.__miles_hook__ = HookSpec("reward", name or f.__name__, float(weight), _params(f, "reward"))
        return f

    if fn is not None:
        return deco(fn)
    return deco


def stop_condition(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a method that ends the episode (terminated) when it returns True after a step."""
    fn.__miles_hook__ = HookSpec("stop", fn.__name__, params=_params(fn, "stop_condition"))
    return fn


def cleanup(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a method to run once when an episode ends (or is abandoned by reset/close)."""
    fn.__miles_hook__ = HookSpec("cleanup", fn.__name__, params=_params(fn, "cleanup"))
    return fn


@dataclass(frozen=True)
class BoundHook:
    spec: HookSpec
    fn: Callable[..., Any]

    async def __call__(self, values: Mapping[str, Any]) -> Any:
        out = self.fn(**{p: values[p] for p in self.spec.params})
        if inspect.isawaitable(out):
            out = await out
        return out


def collect_hooks(obj: object) -> dict[str, list[BoundHook]]:
    """The bound hooks of an env instance grouped by kind, in definition order (base classes first)."""
    grouped: dict[str, list[BoundHook]] = {"reward": [], "stop": [], "cleanup": []}
    for attr, spec in _class_hooks(type(obj)):
        grouped[spec.kind].append(BoundHook(spec, getattr(obj, attr)))
    names = [h.spec.name for h in grouped["reward"]]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise HookDefinitionError(f"{type(obj).__name__} has several reward components named {sorted(dupes)}")
    return grouped


@functools.cache
def _class_hooks(cls: type) -> tuple[tuple[str, HookSpec], ...]:
    """`cls`'s hook attributes and specs in definition order (scanned once per class)."""
    seen: dict[str, tuple[int, int, HookSpec]] = {}
    for depth, klass in enumerate(reversed(cls.__mro__)):
        for order, (attr, value) in enumerate(vars(klass).items()):
            spec = getattr(value, "__miles_hook__", None)
            if isinstance(spec, HookSpec):
                # An override keeps the position of the first definition.
                prev = seen.get(attr)
                seen[attr] = (prev[0], prev[1], spec) if prev else (depth, order, spec)
            elif attr in seen:
                del seen[attr]  # overridden by a plain method: no longer a hook
    return tuple((attr, spec) for attr, (_, _, spec) in sorted(seen.items(), key=lambda kv: kv[1][:2]))
