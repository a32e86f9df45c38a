"""Typed config loading: YAML + dotted overrides, with errors that name the bad key."""

from dataclasses import dataclass, field
from typing import Literal

import pytest

from miles.config import ConfigError, apply_overrides, from_dict, load_config, to_dict


@dataclass
class Inner:
    lr: float = 1e-3
    mode: Literal["a", "b"] = "a"
    tags: list[str] = field(default_factory=list)


@dataclass
class Outer:
    name: str
    steps: int = 10
    inner: Inner = field(default_factory=Inner)
    url: str | None = None


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: run\ninner:\n  lr: 0.5\n  tags: [x]\n")
    cfg = load_config(Outer, path, ["inner.mode=b", "steps=3", "url=http://h:1"])
    assert cfg == Outer(name="run", steps=3, inner=Inner(lr=0.5, mode="b", tags=["x"]), url="http://h:1")
    assert to_dict(cfg)["inner"] == {"lr": 0.5, "mode": "b", "tags": ["x"]}


def test_int_is_accepted_for_float_but_not_the_reverse():
    assert from_dict(Outer, {"name": "n", "inner": {"lr": 1}}).inner.lr == 1.0
    with pytest.raises(ConfigError) as exc:
        from_dict(Outer, {"name": "n", "steps": 1.5})
    assert exc.value.key == "steps"


@pytest.mark.parametrize(("data", "key"), [
    ({"name": "n", "inner": {"lrr": 1.0}}, "inner.lrr"),
    ({"name": "n", "inner": {"mode": "c"}}, "inner.mode"),
    ({"steps": 1}, "name"),
    ({"name": "n", "inner": {"tags": [1]}}, "inner.tags[0]"),
    ({"name": "n", "inner": 3}, "inner"),
])
def test_errors_name_the_bad_key(data, key):
    with pytest.raises(ConfigError) as exc:
        from_dict(Outer, data)
    assert exc.value.key == key
    assert key in str(exc.value)


def test_override_into_a_scalar_is_an_error():
    with pytest.raises(ConfigError) as exc:
        apply_overrides({"name": "x"}, ["name.sub=1"])
    assert exc.value.key == "name"
    with pytest.raises(ConfigError):
        apply_overrides({}, ["no-equals-sign"])
