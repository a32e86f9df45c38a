"""The adapters' trainer in a process of its own (`LoraTrainerProcess` over `TrainerProcess`): an update there is
the update here, errors come back with their type, a setup mistake is one line, a killed trainer process stops
`miles train` with one line and `--resume` loses no step, and the trainer process leaves with its run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from miles.cli import main as cli_main
from miles.config import ConfigError, from_dict
from miles.engines.testing import exits_within, spawned_child
from miles.learner.lora.process import LoraTrainerProcess
from miles.learner.lora.trainer import build_lora_trainer
from miles.learner.trainer_process import TrainerProcessError
from miles.sessions.recorder import read_sessions
from miles.training.config import TrainConfig
from miles.training.metrics_log import read_metrics
from miles.trajectory import TrajectoryBatch
from tests.learner.lora.test_trainer import NAMES, PLAN, _base, _steps

ROOT = Path(__file__).resolve().parents[3]
RANKS = {"calc-terse": 4, "calc-verbose": 8, "orders": 2}


def _config(tmp_path: Path, **adapter: object) -> TrainConfig:
    return from_dict(
        TrainConfig,
        {
            "output_dir": str(tmp_path),
            "model": {"name": "tiny", "size": "0.1m"},
            "trainer": {"lr": 2e-2, "weight_decay": 0.1, "max_grad_norm": 0.05},
            "adapters": [
                {"name": n, "lora": {"rank": RANKS[n], "alpha": 2.0 * RANKS[n]}, "seed": 10 + i, **adapter}
                for i, n in enumerate(NAMES)
            ],
        },
    )


@pytest.fixture
def remote(tmp_path):
    trainer = LoraTrainerProcess(_config(tmp_path), _base())
    yield trainer
    trainer.close()


def test_updates_in_the_trainer_process_equal_updates_here(tmp_path, remote):
    local = build_lora_trainer(_config(tmp_path), _base())
    assert remote.names == local.names == list(NAMES)
    for trajs in _steps(PLAN):
        trained = []
        for name in NAMES:
            mine = [t for t in trajs if t.meta.policy_id == name]
            if mine:
                batch = TrajectoryBatch.from_trajectories(mine)
                there, here = remote.train_adapter(name, batch, threads=1), local.train_adapter(name, batch)
                assert there.keys() == here.keys()
                assert {k: v for k, v in there.items() if not k.endswith("time_s")} == {
                    k: v for k, v in here.items() if not k.endswith("time_s")
                }
                trained.append(name)
        assert remote.end_step(tuple(trained)) == local.end_step(tuple(trained))
    assert remote.step == local.step == len(PLAN)
    for name in NAMES:
        there, here = remote.adapter_weights(name).tensors, local.adapter_weights(name).tensors
        assert there.keys() == here.keys()
        assert all(there[k].equal(here[k]) for k in here)
    remote.step = 0
    assert remote.step == 0


def test_an_error_in_the_trainer_process_comes_back_with_its_type_and_trace(remote):
    with pytest.raises(KeyError, match="no adapter 'nope'") as info:
        remote.adapter_weights("nope")
    assert any(
        "raised in the trainer process" in note and "adapter_weights" in note for note in info.value.__notes__
    )
    with pytest.raises(TypeError, match="pickle"):  # a result that cannot cross the pipe
        remote.process.call("_active", NAMES[0])
    os.kill(remote.process.pid, signal.SIGINT)  # Ctrl-C reaches the process group; the run ends this process
    assert remote.names == list(NAMES) and remote.process.get("names") == list(NAMES)  # it serves on


def test_a_dead_trainer_process_is_a_named_error(remote):
    os.kill(remote.process.pid, signal.SIGKILL)
    with pytest.raises(TrainerProcessError, match=r"exited \(exit code -9\).*--resume"):
        remote.adapter_weights(NAMES[0])
    remote.close()
    remote.close()  # idempotent


def test_a_setup_mistake_in_the_trainer_process_is_one_line(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"adapters\[calc-terse\]\.lora\.target_modules: .*no_such_proj"):
        LoraTrainerProcess(_config(tmp_path, lora={"target_modules": ["no_such_proj"]}), _base())
    data = yaml.safe_load((ROOT / "configs" / "multi_lora.yaml").read_text())
    data["adapters"][0]["lora"]["target_modules"] = ["no_such_proj"]
    data.update(output_dir=str(tmp_path / "run"), steps=1)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    assert cli_main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("miles train:")]
    assert len(lines) == 1 and lines[0].startswith(
        "miles train: config error: adapters[mul].lora.target_modules:"
    ), err
    assert "Traceback" not in err


def test_a_script_that_starts_a_run_when_imported_is_told_to_guard_it(tmp_path):
    """The trainer process imports the user's script again (spawn); a script that calls `miles train` at its
    top level gets one line naming the `__main__` guard, not advice to resume."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import sys\nfrom miles.cli import main\n"
        f"sys.exit(main(['train', '--config', {str(ROOT / 'configs' / 'multi_lora.yaml')!r}, "
        f"'--output-dir', {str(tmp_path / 'run')!r}, '--set', 'steps=1']))\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    lines = [line for line in proc.stderr.splitlines() if line.startswith("miles train: the trainer process")]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    assert (
        "while starting" in lines[0]
        and 'if __name__ == "__main__":' in lines[0]
        and "--resume" not in lines[0]
    )


def _train(out: Path, *sets: str, resume: bool = False) -> subprocess.Popen[str]:
    args = [
        sys.executable,
        "-m",
        "miles.cli",
        "train",
        "--config",
        str(ROOT / "configs" / "multi_lora.yaml"),
        "--output-dir",
        str(out),
        "--set",
        "max_seconds=null",
        "--set",
        "eval.num_tasks=4",
        *(x for s in sets for x in ("--set", s)),
    ]
    return subprocess.Popen(
        [*args, *(["--resume"] if resume else [])],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [r for r in read_metrics(path) if r["kind"] == "train"] if path.exists() else []


def _wait_for(proc: subprocess.Popen[str], ready, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)


@pytest.mark.slow
def test_a_killed_trainer_process_stops_the_run_in_one_line_and_resume_loses_no_step(tmp_path):
    out = tmp_path / "run"
    sets = ("steps=6", "checkpoint.every=1")
    proc = _train(out, *sets)
    try:
        _wait_for(proc, lambda: len(_rows(out)) >= 2)
        os.kill(spawned_child(proc.pid), signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("miles train:")]
    assert (
        len(lines) == 1 and "the trainer process exited (exit code -9)" in lines[0] and "--resume" in lines[0]
    )
    assert "Traceback" not in err
    assert 2 <= len(_rows(out)) < 6

    resumed = _train(out, *sets, resume=True)
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    assert [r["step"] for r in _rows(out)] == list(range(6))  # every step once: none lost, none repeated
    records = read_sessions(out / "sessions.jsonl").records
    assert len({r.session_id for r in records}) == len(records)


@pytest.mark.slow
def test_the_trainer_process_leaves_with_a_killed_run(tmp_path):
    proc = _train(tmp_path / "run", "steps=200")
    try:
        _wait_for(proc, lambda: spawned_child(proc.pid) is not None, 300)
        child = spawned_child(proc.pid)
        proc.kill()  # SIGKILL: no cleanup runs in the parent
        proc.wait()
        assert exits_within(child, 60), "the trainer process outlived its run"
    finally:
        if proc.poll() is None:
            proc.kill()
