"""`miles train` against two HTTP engines, one of them wedged: it answers every control endpoint (health,
model and server info, tokenize, weight loading: they are passed to the healthy server behind it) but never
answers a `/generate`. No session is lost, none ends `timeout` because of it, the turns it swallowed are
retried on the healthy engine, and it is marked suspect within 10 s of receiving a turn."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from miles.engines.testing import ServerProcess, save_tiny_checkpoint
from miles.sessions.recorder import read_sessions
from miles.training.metrics_log import read_metrics
from tests.support.router import StubServer

STEPS, TASKS, GROUP = 2, 2, 2


@pytest.fixture()
def healthy_and_wedged(tmp_path):
    server = ServerProcess(save_tiny_checkpoint(tmp_path / "model"))
    wedged = StubServer({}, upstream=server.url)
    yield server.url, wedged
    wedged.stop()
    server.kill()


@pytest.mark.slow
def test_a_wedged_engine_loses_no_session_and_its_turns_run_elsewhere(healthy_and_wedged, tmp_path):
    healthy, wedged = healthy_and_wedged
    run = tmp_path / "run"
    config = tmp_path / "c.yaml"
    config.write_text(
        json.dumps(
            {
                "output_dir": str(run),
                "steps": STEPS,
                "env": {"id": "Calculator-v0", "num_train_tasks": 16},
                "model": {"name": "tiny", "size": "0.1m"},
                "engine": {"kind": "sglang", "urls": [wedged.url, healthy]},
                "sync": {"method": "disk"},  # both URLs load from disk; only generation is wedged
                "rollout": {
                    "tasks_per_step": TASKS,
                    "scheduler": {
                        "group_size": GROUP,
                        "progress": False,
                        "session": {"sampling": {"max_new_tokens": 16}},
                    },
                },
                "eval": {"num_tasks": 1},
            }
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "miles.cli", "train", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert wedged.generate_calls >= 1  # the wedged engine did get turns

    records = read_sessions(run / "sessions.jsonl").records
    assert len(records) == STEPS * TASKS * GROUP  # scheduled == recorded
    assert not [r.session_id for r in records if r.termination.value in ("timeout", "engine_error")]
    retried = [t for r in records for t in r.turns if t.attempts]
    assert retried, "no turn was retried"
    for turn in retried:
        assert all(a.engine_id == wedged.url and a.error.type == "TurnTimeout" for a in turn.attempts)
        assert turn.engine_id == healthy and turn.finish_reason in ("stop", "length")
    # Marked suspect within 10 s of the first turn it swallowed: that turn's timeout is when it happened.
    assert min(a.duration_s for t in retried for a in t.attempts) <= 10.0
    rows = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]
    assert sum(r["router_suspect_marks"] for r in rows) >= 1
    assert sum(r["router_retries"] for r in rows) == sum(len(t.attempts) for t in retried)
