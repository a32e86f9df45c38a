"""Trainer/engine parity on every token, not on a mean: the logprob the engine reported for each generated token
of a recorded multi-turn session is the one the trainer computes for it under the same weights (fp32, the tiny
model on the CPU), before any update and again after one update and a sync. So the importance ratio is 1 (no
token outside [0.9, 1.1]) wherever the weights agree. Checked for the embedded engine, an HTTP engine (`miles
rollout`'s server, weights by broadcast) and the asynchronous rollout process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles.engines.testing import ServerProcess
from miles.learner.checkpoint import load_checkpoint
from miles.learner.torch_backend import TorchTrainer, TorchTrainerConfig
from miles.sessions.recorder import read_sessions
from miles.tiny import make_tiny_model
from miles.trajectory import TrajectoryBatch

REPO = Path(__file__).resolve().parents[2]
WARM = REPO / "checkpoints" / "calculator-sft-1m"
TOLERANCE = 1e-5


def _run(out: Path, *sets: str) -> None:
    args = [
        sys.executable,
        "-m",
        "miles.cli",
        "train",
        "--config",
        str(REPO / "configs" / "calculator.yaml"),
        "--output-dir",
        str(out),
        "--set",
        "steps=2",
        "--set",
        "rollout.tasks_per_step=2",
        "--set",
        "rollout.scheduler.group_size=4",
        "--set",
        "eval.num_tasks=2",
        "--set",
        "checkpoint.every=1",
        "--set",
        "checkpoint.keep=5",
        "--set",
        "max_seconds=null",
        *(x for s in sets for x in ("--set", s)),
    ]
    proc = subprocess.run(
        args,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def _weights_by_version(out: Path) -> dict[int, dict[str, torch.Tensor]]:
    """The policy's weights as each weight version the engines held: the warm start, then every checkpoint's."""
    from safetensors.torch import load_file

    weights = {}
    for step in sorted((out / "checkpoints").glob("step_*")):
        ckpt = load_checkpoint(step)
        weights[int(ckpt.extra["weight_version"])] = ckpt.model
    first = min(weights) - 1
    weights[first] = load_file(str(WARM / "model.safetensors"))
    return weights


def _check(out: Path) -> tuple[int, float, int]:
    """(tokens compared, the largest |logp_trainer - logp_engine|, tokens outside [0.9, 1.1]) over the run's
    trained sessions, each under the weights of the version that generated it."""
    weights = _weights_by_version(out)
    trainer = TorchTrainer(make_tiny_model("1m"), TorchTrainerConfig(lr=1e-3))
    records = [
        r
        for r in read_sessions(out / "sessions.jsonl").records
        if r.termination.value in ("done", "max_turns") and r.trajectory.num_generated
    ]
    by_version: dict[int, list] = {}
    for r in records:
        versions = {v for v in r.weight_versions if v is not None}
        assert len(versions) == 1, f"{r.session_id} spans versions {versions}"
        by_version.setdefault(versions.pop(), []).append(r)
    assert len(by_version) >= 2, f"sessions of one weight version only: {sorted(by_version)}"
    compared, worst, outside = 0, 0.0, 0
    for version, recs in by_version.items():
        trainer.model.load_state_dict(weights[version], strict=False)
        trajs = [r.trajectory for r in recs]
        batch = TrajectoryBatch.from_trajectories(trajs)
        lp = trainer.compute_logprobs(batch)
        mask = batch.loss_mask > 0
        diff = (lp - batch.rollout_logprobs)[mask].abs().double()
        compared += int(mask.sum())
        worst = max(worst, float(diff.max()))
        ratio = torch.exp(lp - batch.rollout_logprobs)[mask]
        outside += int(((ratio < 0.9) | (ratio > 1.1)).sum())
    return compared, worst, outside


@pytest.mark.slow
@pytest.mark.parametrize("path", ["embedded", "http", "async"])
def test_every_trained_token_has_the_engines_logprob_before_and_after_an_update(path, tmp_path):
    out = tmp_path / "run"
    if path == "embedded":
        _run(out)
    elif path == "async":
        _run(out, "async.enabled=true", "async.max_staleness=0")
    else:
        server = ServerProcess(WARM)
        try:
            _run(out, "engine.kind=sglang", f"engine.urls=[{server.url}]")
        finally:
            server.kill()
    compared, worst, outside = _check(out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tails = [r["ratio_outside_10pct"] for r in rows if r["kind"] == "train" and "ratio_outside_10pct" in r]
    assert compared > 100 and worst <= TOLERANCE and outside == 0, (compared, worst, outside)
    assert tails and all(t == 0.0 for t in tails)  # the trainer's own tail metric agrees
