"""User envs everywhere: `split` handled by the base class, `import_user_modules`, `EnvRecipe`."""

from __future__ import annotations

import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from miles.config import ConfigError
from miles.envs import EnvRecipe, ToolEnv, UnknownEnvError, import_user_modules, make, register, reward
from miles.tools import tool


class WeatherEnv(ToolEnv):  # written like the README's: no __init__
    @tool
    def get_temperature(self, city: str) -> int:
        """Current temperature in degrees Celsius in `city`."""
        return {"Paris": 18, "Oslo": 4}[city]

    @reward(weight=1.0)
    def correct(self, final: str, answer: int) -> float:
        return float(final == f"It is {answer} degrees.")


ROWS = [{"id": f"w{i}", "prompt": f"How warm is it in city {i}?", "answer": i} for i in range(200)]


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def test_base_class_takes_the_loop_split():
    env_id = f"{unique('Weather')}-v0"
    register(env_id, WeatherEnv, tasks=ROWS)
    ids = {split: {t.id for t in make(env_id, split=split).tasks} for split in ("all", "train", "held_out")}
    assert ids["all"] == {r["id"] for r in ROWS}
    assert ids["train"] | ids["held_out"] == ids["all"] and not ids["train"] & ids["held_out"]
    assert 0 < len(ids["held_out"]) < 50  # the default 10% share
    assert ids == {split: {t.id for t in make(env_id, split=split).tasks} for split in ids}  # deterministic
    more = {t.id for t in make(env_id, split="held_out", held_out_fraction=0.5).tasks}
    assert len(more) > len(ids["held_out"])
    with pytest.raises(ValueError, match="split must be one of"):
        make(env_id, split="test")


def test_built_in_envs_keep_their_own_split():
    train = make("Calculator-v0", split="train").tasks.take(50)
    held = make("Calculator-v0", split="held_out").tasks.take(50)
    assert not {t.prompt for t in train} & {t.prompt for t in held}
    assert {t.id for t in make("SQL-v0", split="held_out").tasks} < {t.id for t in make("SQL-v0").tasks}


ENV_MODULE = '''
from miles.envs import ToolEnv, register, reward
from miles.tools import tool


class BankEnv(ToolEnv):
    def __init__(self, *, opening: int = 100, **kwargs):
        self.opening = opening
        super().__init__(**kwargs)

    async def on_reset(self, task):
        self.state["balance"] = self.opening

    @tool
    def withdraw(self, amount: int) -> int:
        """Withdraw `amount`; returns the new balance."""
        self.state["balance"] -= amount
        return self.state["balance"]

    @reward
    def correct(self, state: dict, answer: int) -> float:
        return float(state["balance"] == answer)


register("{env_id}", BankEnv, tasks=[{{"prompt": "take out 30", "answer": 70}}])
'''


def write_env_module(folder: Path, env_id: str) -> str:
    """A fresh user module registering `env_id`; returns its module name."""
    name = unique("bank_env")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(ENV_MODULE.format(env_id=env_id))
    return name


def test_import_by_module_name_from_the_working_directory(tmp_path, monkeypatch):
    env_id = f"{unique('Bank')}-v0"
    name = write_env_module(tmp_path, env_id)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    import_user_modules([name])
    env = make(env_id, opening=50)
    assert env.opening == 50


def test_import_by_path_and_recipe_round_trip(tmp_path):
    env_id = f"{unique('Bank')}-v0"
    name = write_env_module(tmp_path / "elsewhere", env_id)
    recipe = EnvRecipe(
        env_id, {"opening": 100, "max_turns": 3}, (str(tmp_path / "elsewhere" / f"{name}.py"),)
    )
    assert EnvRecipe.from_record(recipe.to_record()) == recipe
    env = recipe.make(split="train")
    assert type(env).__module__ == name and env.max_turns == 3
    _, info = env.reset(seed=0)
    _, reward_value, terminated, _, _ = env.step({"role": "assistant", "content": "done"})
    assert terminated and reward_value == 0.0  # the balance was never touched


def test_a_recipe_imports_its_modules_once_per_working_directory(tmp_path, monkeypatch):
    """`make` runs once per session: the module paths are resolved and imported on the first call only."""
    import miles.envs.recipe as recipe_module

    env_id = f"{unique('Bank')}-v0"
    name = write_env_module(tmp_path / "mods", env_id)
    calls = []
    monkeypatch.setattr(
        recipe_module,
        "import_user_modules",
        lambda names: calls.append(tuple(names)) or import_user_modules(names),
    )
    recipe = EnvRecipe(env_id, {"opening": 5}, (f"mods/{name}.py",))
    monkeypatch.chdir(tmp_path)
    assert [recipe.make().opening for _ in range(3)] == [5, 5, 5]
    assert calls == [(f"mods/{name}.py",)]
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path / "other")  # a relative path means another file here: resolved again
    with pytest.raises(ConfigError, match="no such file"):
        recipe.make()


def test_recipe_kwargs_are_plain_json():
    recipe = EnvRecipe("Calculator-v0", {"num_operators": (1, 2)})
    assert recipe.kwargs == {"num_operators": [1, 2]}
    assert EnvRecipe.from_record(recipe.to_record()) == recipe
    train = recipe.with_kwargs(split="train")
    assert train == EnvRecipe(
        "Calculator-v0", {"num_operators": [1, 2], "split": "train"}
    ) and recipe.kwargs == {"num_operators": [1, 2]}
    assert {t.id for t in train.make().tasks.take(5)} == {
        t.id for t in make("Calculator-v0", split="train", num_operators=(1, 2)).tasks.take(5)
    }
    with pytest.raises(ConfigError, match="env.kwargs") as err:
        EnvRecipe("Calculator-v0", {"tasks": object()})
    assert "plain JSON data" in str(err.value)
    with pytest.raises(ConfigError, match="env.import: must be a list"):
        EnvRecipe("Calculator-v0", imports="bank_env")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("entry", "expect"),
    [
        (
            "no_such_module_xyz",
            "cannot import 'no_such_module_xyz': no module named 'no_such_module_xyz'; run from",
        ),
        ("missing/dir/bank.py", "cannot import 'missing/dir/bank.py': no such file or folder"),
    ],
)
def test_import_failures_are_one_line_config_errors(entry, expect):
    with pytest.raises(ConfigError) as err:
        import_user_modules([entry])
    assert err.value.key == "env.import" and expect in str(err.value) and "\n" not in str(err.value)


def test_a_raising_user_module_is_named(tmp_path):
    name = unique("broken_env")
    (tmp_path / f"{name}.py").write_text("import json\nraise RuntimeError('no database\\nsecond line')\n")
    with pytest.raises(ConfigError) as err:
        import_user_modules([str(tmp_path / f"{name}.py")])
    msg = str(err.value)
    assert msg == (
        f"env.import: cannot import '{tmp_path / name}.py': RuntimeError: no database; "
        f"run `python -c 'import {name}'` to see the traceback"
    )
    dep = unique("needs_dep")
    (tmp_path / f"{dep}.py").write_text("import not_installed_dependency_xyz\n")
    with pytest.raises(
        ConfigError,
        match="No module named 'not_installed_dependency_xyz' \\(a module it imports is missing; install it\\)",
    ):
        import_user_modules([str(tmp_path / f"{dep}.py")])


def test_unknown_id_and_bad_kwargs_are_config_errors():
    with pytest.raises(UnknownEnvError) as err:
        EnvRecipe("Bank-never-registered-v0").make()
    assert isinstance(err.value, ConfigError) and isinstance(err.value, KeyError)
    assert str(err.value).startswith("env.id: no environment registered as 'Bank-never-registered-v0'; ")
    assert "import its module (env.import / --import)" in str(err.value)
    with pytest.raises(ConfigError, match=r"env.kwargs: cannot build 'Calculator-v0' with \['max_operant'\]"):
        EnvRecipe("Calculator-v0", {"max_operant": 3}).make()


def test_readme_env_module_in_a_package_folder(tmp_path):
    pkg = tmp_path / unique("userpkg")
    pkg.mkdir()
    env_id = f"{unique('Weather')}-v0"
    (pkg / "__init__.py").write_text(
        textwrap.dedent(f'''
        from miles.envs import ToolEnv, register
        from miles.tools import tool

        class Weather(ToolEnv):
            @tool
            def temp(self, city: str) -> int:
                """Degrees in `city`."""
                return 4

        register("{env_id}", Weather, tasks=[{{"prompt": "Oslo?", "answer": 4}}] * 1)
    ''')
    )
    env = EnvRecipe(env_id, imports=(str(pkg),)).make(split="all")
    assert env.tool_names == ["temp"]
