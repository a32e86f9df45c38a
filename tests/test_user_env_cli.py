"""A user's own environment, in a package outside the repository, trained through the `miles` command:
`env.import` in the YAML or `--import` on the command line, and one-line errors when the module or the env
can't be found."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.sessions.recorder import read_sessions
from miles.training.metrics_log import read_metrics

ENV_MODULE = '''
from miles.envs import ToolEnv, register, reward
from miles.envs.tasks import Task, TaskSource
from miles.tools import tool


class CounterEnv(ToolEnv):
    max_turns = 2

    def default_tasks(self):
        return TaskSource.from_generator(lambda rng: Task(id="", prompt=f"Add {int(rng.integers(1000))}."),
                                         name="counter")

    async def on_reset(self, task):
        self.state["total"] = 0

    @tool
    def add(self, n: int) -> int:
        """Add `n` to the total."""
        self.state["total"] += n
        return self.state["total"]

    @reward
    def added(self, state: dict) -> float:
        return float(state["total"] > 0)


register("Counter-v0", CounterEnv)
'''


def _config(tmp_path: Path, **env: object) -> Path:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        json.dumps(
            {
                "output_dir": str(tmp_path / "run"),
                "steps": 1,
                "env": {"id": "Counter-v0", "num_train_tasks": 16, **env},
                "model": {"name": "tiny", "size": "0.1m"},
                "rollout": {
                    "tasks_per_step": 1,
                    "scheduler": {
                        "group_size": 2,
                        "progress": False,
                        "session": {"sampling": {"max_new_tokens": 16}},
                    },
                },
                "eval": {"num_tasks": 2},
            }
        )
    )
    return cfg


def _miles(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-m", "miles.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "OMP_NUM_THREADS": "1"},
    )


@pytest.fixture()
def user_package(tmp_path: Path) -> Path:
    pkg = tmp_path / "work" / "counter_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "envs.py").write_text(ENV_MODULE)
    return tmp_path / "work"


@pytest.mark.slow
def test_env_import_in_the_yaml_trains_the_user_env(user_package: Path, tmp_path: Path):
    proc = _miles(
        user_package, "train", "--config", str(_config(tmp_path, **{"import": ["counter_pkg.envs"]}))
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_sessions(tmp_path / "run" / "sessions.jsonl").records
    assert {r.env_id for r in records} == {"Counter-v0"} and len(records) == 2
    assert [r["kind"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")].count("train") == 1


@pytest.mark.slow
def test_the_import_flag_works_the_same_and_adds_to_the_yaml(user_package: Path, tmp_path: Path):
    proc = _miles(
        user_package, "train", "--config", str(_config(tmp_path)), "--import", "counter_pkg/envs.py"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "sessions.jsonl").is_file()


def test_setup_mistakes_about_the_env_are_one_line(user_package: Path, tmp_path: Path):
    for args, key in (
        (["--import", "no_such_module"], "env.import"),
        (["--set", "env.id=Nope-v0"], "env.id"),
        (["--import", "counter_pkg.envs", "--set", "env.kwargs={colour: red}"], "env.kwargs"),
    ):
        proc = _miles(user_package, "train", "--config", str(_config(tmp_path)), *args)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and key in lines[0] and "Traceback" not in proc.stderr, (args, proc.stderr)
    assert not (tmp_path / "run" / "sessions.jsonl").exists()
