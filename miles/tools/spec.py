"""`@tool`: turn a typed, documented function or method into a `ToolSpec` with a derived JSON schema."""

from __future__ import annotations

import inspect
import math
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import docstring_parser
from jsonschema import Draft202012Validator

from miles.tools.errors import ToolDefinitionError
from miles.tools.schema import Converter, is_injected, json_default, make_converter, type_schema

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_SELF_NAMES = ("self", "cls")


class ArgumentConversionError(ValueError):
    """Validated JSON arguments could not be turned into the tool's Python types (e.g. __post_init__ failed)."""


@dataclass
class ToolSpec:
    """Everything the executor needs to describe, validate and call one tool.

    `parameters` is the JSON schema (Draft 2020-12) of the arguments the model supplies; `injected`
    names the parameters the executor fills from its context instead. `takes_self` marks methods, which
    must be called bound (see `collect_tools`).
    """

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any]
    is_async: bool
    timeout_s: float | None = None
    max_output_chars: int | None = None
    injected: tuple[str, ...] = ()
    takes_self: bool = False
    positional_only: tuple[str, ...] = field(default=(), repr=False)
    injected_defaults: dict[str, Any] = field(default_factory=dict, repr=False)
    converters: dict[str, Converter] = field(default_factory=dict, repr=False, compare=False)
    validator: Draft202012Validator | None = field(default=None, repr=False, compare=False)

    def openai_schema(self) -> dict[str, Any]:
        """The OpenAI function-tool entry, as chat templates take it in `tools=[...]`."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def validation_errors(self, arguments: Any, limit: int = 5) -> list[str]:
        """Precise messages for every schema violation of `arguments` (empty when valid).

        Non-finite numbers (NaN, ±Infinity), which JSON cannot hold, are violations wherever they are.
        """
        validator = self.validator or Draft202012Validator(self.parameters)
        errors = sorted(validator.iter_errors(arguments), key=lambda e: [str(p) for p in e.absolute_path])
        messages = [(list(err.absolute_path), err.message) for err in errors]
        reported = {tuple(path) for path, _ in messages}
        messages += [
            (path, f"{value!r} is not a finite number")
            for path, value in _non_finite(arguments)
            if tuple(path) not in reported
        ]
        out = []
        for path_parts, message in messages[:limit]:
            path = "/".join(str(p) for p in path_parts)
            out.append(f"at '{path}': {message}" if path else message)
        if len(messages) > limit:
            out.append(f"... and {len(messages) - limit} more")
        return out

    def bind_arguments(
        self, arguments: Mapping[str, Any], context: Mapping[str, Any]
    ) -> tuple[list[Any], dict[str, Any]]:
        """(args, kwargs) for calling the tool: converted model arguments plus injected values.

        Raises `ArgumentConversionError` when conversion fails and `KeyError` for a missing injected value.
        """
        values: dict[str, Any] = {}
        for key, value in arguments.items():
            conv = self.converters.get(key)
            try:
                values[key] = conv(value) if conv else value
            except Exception as exc:
                raise ArgumentConversionError(f"argument '{key}': {type(exc).__name__}: {exc}") from exc
        for key in self.injected:
            if key in context:
                values[key] = context[key]
            elif key in self.injected_defaults:
                values[key] = self.injected_defaults[key]
            else:
                raise KeyError(key)
        args = []
        for key in self.positional_only:
            if key not in values:
                break  # the remaining positional-only parameters keep their defaults
            args.append(values.pop(key))
        return args, values


def _non_finite(value: Any) -> list[tuple[list[Any], float]]:
    """(path, value) of every NaN or infinite float inside a JSON-like value."""
    found: list[tuple[list[Any], float]] = []
    stack: list[tuple[list[Any], Any]] = [([], value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            found.append((path, item))
        elif isinstance(item, dict):
            stack.extend(([*path, k], v) for k, v in item.items())
        elif isinstance(item, list | tuple):
            stack.extend(([*path, i], v) for i, v in enumerate(item))
    return sorted(found, key=lambda hit: [str(p) for p in hit[0]])


def _resolve_hints(fn: Callable[..., Any], name: str) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn, include_extras=True)
    except Exception as exc:
        raise ToolDefinitionError(
            f"tool '{name}': cannot resolve type hints: {type(exc).__name__}: {exc}"
        ) from exc


def _param_docs(doc: docstring_parser.Docstring) -> dict[str, str]:
    out: dict[str, str] = {}
    for p in doc.params:
        for arg in p.arg_name.split(","):
            out[arg.strip().lstrip("*")] = (p.description or "").strip()
    return out


def build_spec(
    fn: Callable[..., Any],
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = None,
    max_output_chars: int | None = None,
) -> ToolSpec:
    """Derive a `ToolSpec` from `fn`'s signature, type hints and Google/NumPy docstring.

    Raises `ToolDefinitionError` when the tool cannot be described.
    """
    target = fn.__func__ if isinstance(fn, types.MethodType) else fn
    if not callable(target) or not hasattr(target, "__name__"):
        raise ToolDefinitionError(f"@tool needs a function or method, got {fn!r}")
    tool_name = name or target.__name__
    if not _NAME_RE.match(tool_name):
        raise ToolDefinitionError(f"tool name {tool_name!r} must match {_NAME_RE.pattern}")
    if inspect.isasyncgenfunction(target) or inspect.isgeneratorfunction(target):
        raise ToolDefinitionError(f"tool '{tool_name}': generator functions cannot be tools")
    if timeout_s is not None and not timeout_s > 0:
        raise ToolDefinitionError(f"tool '{tool_name}': timeout_s must be positive, got {timeout_s!r}")
    if max_output_chars is not None and max_output_chars < 1:
        raise ToolDefinitionError(
            f"tool '{tool_name}': max_output_chars must be >= 1, got {max_output_chars!r}"
        )

    doc = docstring_parser.parse(inspect.getdoc(target) or "")
    text = (
        description
        if description is not None
        else "\n\n".join(p for p in (doc.short_description, doc.long_description) if p)
    )
    if not text.strip():
        raise ToolDefinitionError(f"tool '{tool_name}' has no description: give it a docstring")
    docs = _param_docs(doc)

    hints = _resolve_hints(target, tool_name)
    params = list(inspect.signature(target).parameters.values())
    takes_self = bool(params) and params[0].name in _SELF_NAMES and params[0].name not in hints
    if takes_self or isinstance(fn, types.MethodType):
        params = params[1:]
        takes_self = True

    props: dict[str, Any] = {}
    required: list[str] = []
    injected: list[str] = []
    injected_defaults: dict[str, Any] = {}
    positional_only: list[str] = []
    converters: dict[str, Converter] = {}
    for p in params:
        where = f"tool '{tool_name}', parameter '{p.name}'"
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            star = "*" if p.kind is p.VAR_POSITIONAL else "**"
            raise ToolDefinitionError(f"{where}: {star}{p.name} cannot be described by a JSON schema")
        if p.name not in hints:
            raise ToolDefinitionError(f"{where}: missing type annotation")
        hint = hints[p.name]
        if p.kind is p.POSITIONAL_ONLY:
            positional_only.append(p.name)
        if is_injected(hint):
            injected.append(p.name)
            if p.default is not p.empty:
                injected_defaults[p.name] = p.default
            continue
        prop = dict(type_schema(hint, where))
        if "description" not in prop and docs.get(p.name):
            prop["description"] = docs[p.name]
        if p.default is p.empty:
            required.append(p.name)
        else:
            ok, value = json_default(p.default)
            if ok:
                prop["default"] = value
        props[p.name] = prop
        conv = make_converter(hint)
        if conv is not None:
            converters[p.name] = conv
    known = {p.name for p in params}
    unknown_docs = sorted(set(docs) - known)
    if unknown_docs:
        raise ToolDefinitionError(
            f"tool '{tool_name}': docstring documents unknown parameter(s) {unknown_docs}"
        )

    parameters: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        parameters["required"] = required
    Draft202012Validator.check_schema(parameters)
    return ToolSpec(
        name=tool_name,
        description=text.strip(),
        parameters=parameters,
        fn=target,
        is_async=inspect.iscoroutinefunction(target),
        timeout_s=timeout_s,
        max_output_chars=max_output_chars,
        injected=tuple(injected),
        takes_self=takes_self,
        positional_only=tuple(positional_only),
        injected_defaults=injected_defaults,
        converters=converters,
        validator=Draft202012Validator(parameters, format_checker=Draft202012Validator.FORMAT_CHECKER),
    )


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    timeout_s: float | None = None,
    max_output_chars: int | None = None,
    description: str | None = None,
) -> Any:
    """Decorate a function or method as a tool; usable as `@tool` or `@tool(name=..., timeout_s=...)`.

    The schema comes from the type hints and the Google/NumPy docstring; `self` is skipped and
    `Injected[...]` parameters are hidden. The function is returned unchanged, with the `ToolSpec`
    attached as `fn.__miles_tool__`. Raises `ToolDefinitionError` for tools that cannot be described.
    """

    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        spec = build_spec(
            f, name=name, description=description, timeout_s=timeout_s, max_output_chars=max_output_chars
        )
        f.__miles_tool__ = spec  # type: ignore[attr-defined]
        return f

    return wrap(fn) if fn is not None else wrap


def get_spec(fn: Callable[..., Any]) -> ToolSpec | None:
    """The `ToolSpec` of a decorated function or (bound) method, or None."""
    spec = getattr(fn, "__miles_tool__", None)
    return spec if isinstance(spec, ToolSpec) else None


def collect_tools(obj: Any) -> list[Callable[..., Any]]:
    """The @tool callables of an instance (bound methods) or a module, in definition order.

    For an instance, base-class tools come first; an override keeps its base position, and an override
    that is not a tool removes it.
    """
    if isinstance(obj, types.ModuleType):
        return [v for v in vars(obj).values() if get_spec(v) is not None]
    owners = [obj] if isinstance(obj, type) else [type(obj)]
    order: dict[str, None] = {}
    for cls in reversed(owners[0].__mro__):
        for key, value in vars(cls).items():
            if get_spec(value) is not None:
                order.setdefault(key, None)
    tools = []
    for key in order:
        value = getattr(obj, key, None)
        if value is not None and get_spec(value) is not None:
            tools.append(value)
    return tools
