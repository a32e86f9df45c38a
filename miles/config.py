"""Typed configs: YAML files and dotted overrides into nested dataclasses, with errors that name the bad key."""

from __future__ import annotations

import dataclasses
import enum
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigLoader(yaml.SafeLoader):
    """YAML for configs: `1e-5` is a number (YAML 1.2; PyYAML's 1.1 rules read it as a string)."""


#: The most values a config may hold once its YAML aliases (`*name`) are expanded: far above any real config,
#: far below an alias bomb ("billion laughs"), which PyYAML loads as shared references in no time.
MAX_CONFIG_VALUES = 100_000


def _count_values(node: Any, budget: int) -> int:
    """How much of `budget` is left after counting the values of `node` as if its aliases were copies."""
    budget -= 1
    children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    for child in children:
        if budget < 0:
            break
        budget = _count_values(child, budget)
    return budget


ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def parse_yaml(text: str) -> Any:
    """`text` as a config value or document (`ConfigLoader`); `ConfigError` when its aliases expand it beyond
    `MAX_CONFIG_VALUES` values."""
    data = yaml.load(text, Loader=ConfigLoader)  # noqa: S506 - a SafeLoader subclass
    if _count_values(data, MAX_CONFIG_VALUES) < 0:
        raise ConfigError(
            "",
            f"the YAML expands to more than {MAX_CONFIG_VALUES:,} values through its aliases "
            "(*name); write the config out without them",
        )
    return data


class ConfigError(ValueError):
    """A config value is unknown, missing or of the wrong type. `key` is its dotted path."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:  # pickles whole (to another process or a Ray actor's caller),
        return _restore_error, (type(self), self.args, self.__dict__)  # whatever a subclass's __init__ takes


def _restore_error(cls: type[ConfigError], args: tuple[Any, ...], state: dict[str, Any]) -> ConfigError:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(key, f"{value!r} matches none of {tp}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(key, f"{value!r} is not one of {list(args)}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping for {tp.__name__}, got {type(value).__name__}")
        return from_dict(tp, value, key)
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(key, f"expected a list, got {type(value).__name__}")
        item = args[0] if args else Any
        items = [_convert(item, v, f"{key}[{_item_label(v, i)}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping, got {type(value).__name__}")
        vt = args[1] if len(args) == 2 else Any
        return {str(k): _convert(vt, v, _join(key, str(k))) for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(key, f"{value!r} is not one of {[m.value for m in tp]}") from None
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(key, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {value!r}")
        return value
    return value


def _item_label(value: Any, index: int) -> str:
    """How an error names a list item: by its `name` when it is a mapping with one (`adapters[calc-terse]`),
    else by its index."""
    name = value.get("name") if isinstance(value, dict) else None
    return name if isinstance(name, str) and name else str(index)


def config_key(f: dataclasses.Field[Any]) -> str:
    """The YAML key of a config field: its name, or `field(metadata={"key": ...})` for names Python
    reserves (e.g. `env.import`)."""
    return str(f.metadata.get("key", f.name))


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass `cls` from a nested mapping, converting and checking every field."""
    hints = typing.get_type_hints(cls)
    fields = {config_key(f): f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(_join(prefix, unknown[0]), f"unknown key (known: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, f in fields.items():
        key = _join(prefix, name)
        if name in data:
            kwargs[f.name] = _convert(hints[f.name], data[name], key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(key, "missing required key")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        key = getattr(exc, "key", None)
        if isinstance(key, str):  # a nested or section-level error that names its own key
            raise ConfigError(_join(prefix, key), getattr(exc, "message", str(exc))) from exc
        raise ConfigError(prefix, str(exc)) from exc


def to_dict(obj: Any) -> Any:
    """The plain-data form of a config dataclass (enums as values), for YAML and run records."""
    if dataclasses.is_dataclass(obj):
        return {config_key(f): to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (values parsed as YAML scalars) to a nested mapping, in place."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "override must look like key.path=value")
        path, raw = item.split("=", 1)
        parts = path.strip().split(".")
        node = data
        for i, part in enumerate(parts[:-1]):
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(".".join(parts[: i + 1]), "is not a section, cannot set a key inside it")
            node = nxt
        try:
            node[parts[-1]] = parse_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(
                path.strip(), f"{raw!r} is not a YAML value: {getattr(exc, 'problem', exc)}"
            ) from None
    return data


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Read YAML at `path` (optional), apply dotted overrides, and validate into `cls`."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = parse_yaml(Path(path).read_text())
        except OSError as exc:
            raise ConfigError("", f"cannot read the config file {str(path)!r}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError("", f"{str(path)!r} is not a text file (a YAML config is UTF-8 text)") from None
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
            raise ConfigError(
                "", f"{str(path)!r} is not valid YAML{at}: {getattr(exc, 'problem', exc)}"
            ) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError("", f"{path} must hold a mapping at the top level")
        data = loaded or {}
    apply_overrides(data, overrides or [])
    return from_dict(cls, data)
