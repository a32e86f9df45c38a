"""JSON schema derivation from Python type hints, and conversion of validated JSON back to those types.

Supported: str, int, float, bool, None, Any, Literal, Enum, Optional/Union, list/tuple/set/frozenset,
dict[str, X], dataclasses, TypedDict and `Annotated[T, "description"]`. Anything else is a
`ToolDefinitionError`, raised when the tool is defined.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal, Union

import docstring_parser

from miles.tools.errors import ToolDefinitionError

Converter = Callable[[Any], Any]

_PRIMITIVES: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


class _InjectedMarker:
    """Metadata marker inside `Annotated` for parameters the executor supplies from its context."""

    def __repr__(self) -> str:
        return "Injected"


INJECTED = _InjectedMarker()


class Injected:
    """`Injected[T]`: the parameter is hidden from the schema and filled by the executor from its context.

    The executor looks the value up by parameter name in `ToolBox(context=...)`.
    """

    def __class_getitem__(cls, item: Any) -> Any:
        return Annotated[item, INJECTED]


def is_injected(annotation: Any) -> bool:
    """True when `annotation` is `Injected[...]` (possibly nested in further `Annotated`)."""
    return typing.get_origin(annotation) is Annotated and any(m is INJECTED for m in annotation.__metadata__)


def _is_typeddict(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, dict) and hasattr(tp, "__required_keys__")


def _strip_required(tp: Any) -> Any:
    """Drop TypedDict's Required[...]/NotRequired[...] wrappers; requiredness comes from the class."""
    while typing.get_origin(tp) in (typing.Required, typing.NotRequired):
        tp = typing.get_args(tp)[0]
    return tp


def _is_union(origin: Any) -> bool:
    return origin is Union or origin is types.UnionType


def _json_default(value: Any) -> Any:
    """A JSON-compatible form of a default value, or raise ValueError when there is none."""
    if isinstance(value, enum.Enum):
        return _json_default(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _json_default(dataclasses.asdict(value))
    if isinstance(value, tuple | set | frozenset):
        value = list(value)
    json.dumps(value, allow_nan=False)  # raises TypeError/ValueError when not representable
    return value


def json_default(value: Any) -> tuple[bool, Any]:
    """(True, json_value) when `value` can be shown in a schema as a default, else (False, None)."""
    try:
        return True, _json_default(value)
    except (TypeError, ValueError):
        return False, None


def _field_docs(cls: type) -> dict[str, str]:
    """Per-field descriptions from an `Attributes:` (or `Args:`) section of a class docstring."""
    doc = docstring_parser.parse(cls.__doc__ or "")
    return {p.arg_name: p.description or "" for p in doc.params if p.description}


def _class_description(cls: type) -> str:
    # dataclasses synthesise a signature docstring such as "Point(x: int, y: int)"; do not show it.
    raw = cls.__doc__ or ""
    if dataclasses.is_dataclass(cls) and raw.startswith(f"{cls.__name__}("):
        return ""
    doc = docstring_parser.parse(raw)
    return "\n\n".join(p for p in (doc.short_description, doc.long_description) if p)


def type_schema(tp: Any, where: str, _seen: tuple[Any, ...] = ()) -> dict[str, Any]:
    """The JSON schema of Python type `tp`; `where` names the parameter in error messages."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        schema = dict(type_schema(tp.__origin__, where, _seen))
        descriptions = [m for m in tp.__metadata__ if isinstance(m, str)]
        if descriptions:
            schema["description"] = " ".join(descriptions)
        return schema
    if tp is Any:
        return {}
    if tp is None or tp is type(None):
        return {"type": "null"}
    if tp in _PRIMITIVES:
        return {"type": _PRIMITIVES[tp]}
    if origin is Literal:
        values = list(typing.get_args(tp))
        for v in values:
            if not isinstance(v, str | int | float | bool | type(None)) or isinstance(v, enum.Enum):
                raise ToolDefinitionError(f"{where}: Literal value {v!r} is not a JSON scalar")
        kinds = {type(v) for v in values}
        schema: dict[str, Any] = {"enum": values}
        if len(kinds) == 1 and next(iter(kinds)) in _PRIMITIVES:
            schema = {"type": _PRIMITIVES[next(iter(kinds))], "enum": values}
        return schema
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        values = [m.value for m in tp]
        bad = [v for v in values if not isinstance(v, str | int | float | bool)]
        if bad:
            raise ToolDefinitionError(f"{where}: Enum {tp.__name__} has non-JSON values {bad!r}")
        kinds = {type(v) for v in values}
        schema = {"enum": values}
        if len(kinds) == 1:
            schema = {"type": _PRIMITIVES[next(iter(kinds))], "enum": values}
        return schema
    if _is_union(origin):
        members = [type_schema(a, where, _seen) for a in typing.get_args(tp)]
        return {"anyOf": members}
    if tp in (list, set, frozenset, tuple) or origin in (list, set, frozenset, tuple):
        return _sequence_schema(tp, origin or tp, where, _seen)
    if tp is dict or origin is dict:
        args = typing.get_args(tp)
        if args and args[0] is not str:
            raise ToolDefinitionError(f"{where}: dict keys must be str for JSON objects, got {args[0]!r}")
        schema = {"type": "object"}
        if args:
            schema["additionalProperties"] = type_schema(args[1], where, _seen)
        return schema
    if isinstance(tp, type) and (dataclasses.is_dataclass(tp) or _is_typeddict(tp)):
        if tp in _seen:
            raise ToolDefinitionError(f"{where}: recursive type {tp.__name__} cannot be described")
        return _object_schema(tp, where, (*_seen, tp))
    raise ToolDefinitionError(
        f"{where}: cannot derive a JSON schema for type {tp!r}; use str, int, float, bool, Literal, Enum, "
        "Optional, list[...], dict[str, ...], a dataclass or a TypedDict"
    )


def _sequence_schema(tp: Any, origin: Any, where: str, seen: tuple[Any, ...]) -> dict[str, Any]:
    args = typing.get_args(tp)
    schema: dict[str, Any] = {"type": "array"}
    if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        if args == ((),):
            return {"type": "array", "maxItems": 0}
        schema["prefixItems"] = [type_schema(a, where, seen) for a in args]
        schema["minItems"] = schema["maxItems"] = len(args)
        return schema
    if args:
        schema["items"] = type_schema(args[0], where, seen)
    if origin in (set, frozenset):
        schema["uniqueItems"] = True
    return schema


def _object_schema(tp: type, where: str, seen: tuple[Any, ...]) -> dict[str, Any]:
    try:
        hints = typing.get_type_hints(tp, include_extras=True)
    except Exception as exc:  # unresolvable forward references
        raise ToolDefinitionError(f"{where}: cannot resolve the type hints of {tp.__name__}: {exc}") from exc
    docs = _field_docs(tp)
    props: dict[str, Any] = {}
    required: list[str] = []
    if dataclasses.is_dataclass(tp):
        for f in dataclasses.fields(tp):
            if not f.init:
                continue
            prop = dict(type_schema(hints[f.name], f"{where}.{f.name}", seen))
            if f.name in docs and "description" not in prop:
                prop["description"] = docs[f.name]
            if f.default is not dataclasses.MISSING:
                ok, value = json_default(f.default)
                if ok:
                    prop["default"] = value
            elif f.default_factory is dataclasses.MISSING:
                required.append(f.name)
            props[f.name] = prop
    else:
        for key, hint in hints.items():
            prop = dict(type_schema(_strip_required(hint), f"{where}.{key}", seen))
            if key in docs and "description" not in prop:
                prop["description"] = docs[key]
            props[key] = prop
        required = [k for k in hints if k in tp.__required_keys__]
    schema: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        schema["required"] = required
    description = _class_description(tp)
    if description:
        schema["title"] = tp.__name__
        schema["description"] = description
    return schema


def _to_int(value: Any) -> Any:
    """An integral float (which JSON schema counts as an integer, e.g. `3.0`) as the int it stands for."""
    return int(value) if isinstance(value, float) else value


def _to_float(value: Any) -> Any:
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _literal_converter(values: tuple[Any, ...]) -> Converter | None:
    """Map a number to the numeric literal it equals (`1.0` to `Literal[1]`'s `1`); None without numbers."""
    numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool | enum.Enum)]
    if not numbers:
        return None

    def convert(value: Any) -> Any:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return next((n for n in numbers if n == value), value)
        return value

    return convert


def make_converter(tp: Any) -> Converter | None:
    """A function turning already-validated JSON into `tp` (ints, Enum members, dataclasses, tuples...).

    None when the JSON value can be passed through unchanged. An `int` receives an int: the schema admits
    only integral numbers, and an integral float such as `3.0` becomes `3` (also inside containers).
    """
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return make_converter(tp.__origin__)
    if tp is int:
        return _to_int
    if tp is float:
        return _to_float
    if origin is Literal:
        return _literal_converter(typing.get_args(tp))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp
    if _is_union(origin):
        return _union_converter(tp)
    if origin in (list, set, frozenset, tuple) or tp in (set, frozenset, tuple):
        return _sequence_converter(tp, origin or tp)
    if origin is dict:
        args = typing.get_args(tp)
        inner = make_converter(args[1]) if args else None
        if inner is None:
            return None
        return lambda v: {k: inner(x) for k, x in v.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _object_converter(tp, construct=True)
    if _is_typeddict(tp):
        return _object_converter(tp, construct=False)
    return None


def _sequence_converter(tp: Any, origin: Any) -> Converter | None:
    args = typing.get_args(tp)
    build: Callable[[Any], Any] = {list: list, set: set, frozenset: frozenset, tuple: tuple}[origin]
    if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis) and args != ((),):
        convs = [make_converter(a) for a in args]
        return lambda v: tuple(c(x) if c else x for c, x in zip(convs, v, strict=False))
    inner = make_converter(args[0]) if args else None
    if inner is None:
        return None if origin is list else build
    return lambda v: build(inner(x) for x in v)


def _union_converter(tp: Any) -> Converter | None:
    """Convert with the first member whose schema accepts the value."""
    from jsonschema import Draft202012Validator

    members = []
    for arg in typing.get_args(tp):
        conv = make_converter(arg)
        validator = Draft202012Validator(type_schema(arg, "union member"))
        members.append((validator, conv))
    if all(conv is None for _, conv in members):
        return None

    def convert(value: Any) -> Any:
        for validator, conv in members:
            if validator.is_valid(value):
                return conv(value) if conv else value
        return value

    return convert


def _object_converter(tp: type, *, construct: bool) -> Converter:
    hints = typing.get_type_hints(tp, include_extras=True)
    convs = {name: make_converter(_strip_required(h)) for name, h in hints.items()}

    def convert(value: dict[str, Any]) -> Any:
        data = {k: (convs[k](v) if convs.get(k) else v) for k, v in value.items()}
        return tp(**data) if construct else data

    return convert
