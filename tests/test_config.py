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


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"name": "n", "inner": {"lrr": 1.0}}, "inner.lrr"),
        ({"name": "n", "inner": {"mode": "c"}}, "inner.mode"),
        ({"steps": 1}, "name"),
        ({"name": "n", "inner": {"tags": [1]}}, "inner.tags[0]"),
        ({"name": "n", "inner": 3}, "inner"),
    ],
)
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


def test_exponent_floats_without_a_dot_are_numbers_in_files_and_overrides(tmp_path):
    """PyYAML reads `1e-5` as a string (YAML 1.1); a config reads it as the number everyone means."""
    path = tmp_path / "c.yaml"
    path.write_text("name: run\ninner: {lr: 1e-5}\n")
    assert load_config(Outer, path).inner.lr == 1e-5
    assert load_config(Outer, path, ["inner.lr=3E+2"]).inner.lr == 300.0
    assert load_config(Outer, path, ["name=1e5x"]).name == "1e5x"


def test_a_yaml_alias_bomb_is_refused_before_it_expands_and_plain_aliases_still_load(tmp_path):
    levels = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]" for i in range(8)]
    path = tmp_path / "bomb.yaml"
    path.write_text("name: run\ninner:\n  tags: []\n" + "\n".join(levels) + "\n")
    with pytest.raises(
        ConfigError, match=r"the YAML expands to more than 100,000 values through its aliases"
    ):
        load_config(Outer, path)
    path.write_text("name: run\nanchors: {t: &t [x, y]}\ninner: {tags: *t}\n")
    with pytest.raises(ConfigError, match="anchors: unknown key"):  # the alias itself loaded
        load_config(Outer, path)
    path.write_text("name: &n run\ninner: {tags: [*n, *n]}\n")
    assert load_config(Outer, path).inner.tags == ["run", "run"]
