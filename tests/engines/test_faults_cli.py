"""`miles train` against an HTTP engine that stops answering (SIGSTOP) or dies (SIGKILL) mid-run: the run
ends on its own, with exit status 3 and one line that says what happened, never with a score. A stalled
engine cannot hold the run past `max_seconds + health.grace_s` (plus a few seconds to abandon what it holds);
a dead one stops it after `health.engine_failure_steps` steps (3 here)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from miles.engines.testing import ServerProcess, save_tiny_checkpoint

GRACE_S = 3.0


@pytest.fixture()
def server(tmp_path):
    engine = ServerProcess(save_tiny_checkpoint(tmp_path / "model"))
    yield engine
    engine.process.send_signal(signal.SIGCONT)
    engine.kill()


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "max_seconds"), [("SIGSTOP", 10.0), ("SIGKILL", 120.0)])
def test_a_stalled_or_dead_engine_ends_the_run_broken_and_on_time(fault, max_seconds, server, tmp_path):
    run = tmp_path / "run"
    config = tmp_path / "c.yaml"
    config.write_text(
        json.dumps(
            {
                "output_dir": str(run),
                "steps": 10_000,
                "max_seconds": max_seconds,
                "env": {"id": "Calculator-v0", "num_train_tasks": 16},
                "model": {"name": "tiny", "size": "0.1m"},
                "engine": {"kind": "sglang", "urls": [server.url]},
                "checkpoint": {"every": 1},
                "rollout": {
                    "tasks_per_step": 2,
                    "scheduler": {
                        "group_size": 2,
                        "progress": False,
                        "session": {"sampling": {"max_new_tokens": 16}},
                    },
                },
                "eval": {"num_tasks": 2},
                "health": {"no_signal_steps": 0, "grace_s": GRACE_S, "engine_failure_steps": 3},
            }
        )
    )
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles.cli", "train", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # the run is training: hit the engine between steps
        if line.startswith("[step 2/"):
            break
    server.process.send_signal(getattr(signal, fault))
    try:
        out, err = proc.communicate(timeout=min(max_seconds, 60) + GRACE_S + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"miles train still ran {time.monotonic() - t0:.0f} s after it started ({fault})")
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 3, err[-3000:]
    assert last.startswith("miles train: the run is broken: "), last
    if fault == "SIGSTOP":
        assert f"still working {GRACE_S:.0f} s after its max_seconds ({max_seconds:.0f} s)" in last
    else:  # found dead long before the budget
        assert "the engines failed 3 steps in a row" in last
    assert "held-out success" not in out  # no score
    summary = json.loads((run / "summary.json").read_text())
    assert summary["broken"] and "final" not in summary["evals"]
    assert any((run / "checkpoints").glob("step_*"))  # --resume can continue
