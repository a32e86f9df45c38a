"""The path an infra engineer takes, on loopback: `miles rollout --dp 2` starts two servers behind the real
sglang-router, `miles train` attaches to them and syncs every update over SGLang's weight-update group
(`sync.method: auto` resolves to broadcast for HTTP engines; gloo on CPU), and afterwards each server's
logprobs on a fixed prompt are the trainer's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from miles.engines.testing import RolloutProcess
from miles.ports import free_ports
from miles.tiny import load_tiny_tokenizer, make_tiny_model
from miles.training.metrics_log import read_metrics

PROMPT = [5, 17, 29, 41, 53, 65, 77]


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    newest = sorted((run / "checkpoints").glob("step_*"))[-1]
    return load_file(str(newest / "model.safetensors"))


def _teacher_forced_logprobs(weights: dict[str, torch.Tensor], output_ids: list[int]) -> list[float]:
    model = make_tiny_model("0.1m", vocab_size=len(load_tiny_tokenizer()))
    model.load_state_dict(weights)
    ids = torch.tensor([PROMPT + output_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double().log_softmax(-1)
    return [float(logits[len(PROMPT) - 1 + i, t]) for i, t in enumerate(output_ids)]


@pytest.mark.slow
def test_miles_train_syncs_two_miles_rollout_servers_behind_the_real_router_by_broadcast(tmp_path):
    launcher = RolloutProcess(
        "--engine",
        "embedded",
        "--dp",
        "2",
        "--model",
        "tiny-0.1m",
        "--port",
        str(free_ports(3)),
        "--log-dir",
        str(tmp_path / "logs"),
    )  # the router on the third
    try:
        engine = launcher.ready()
        assert engine["kind"] == "router" and len(engine["urls"]) == 2 and launcher.router_url
        run = tmp_path / "run"
        config = tmp_path / "c.yaml"
        config.write_text(
            json.dumps(
                {
                    "output_dir": str(run),
                    "steps": 2,
                    "seed": 1,
                    "env": {"id": "Calculator-v0", "num_train_tasks": 16},
                    "model": {"name": "tiny", "size": "0.1m"},
                    "engine": {**engine, "router_url": launcher.router_url},
                    "rollout": {
                        "tasks_per_step": 2,
                        "scheduler": {
                            "group_size": 2,
                            "progress": False,
                            "session": {"sampling": {"max_new_tokens": 24}},
                        },
                    },
                    "trainer": {"lr": 1e-2},
                    "eval": {"num_tasks": 2},
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

        syncs = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "sync"]
        assert [r["method"] for r in syncs] == ["broadcast"] * 3  # the initial push, then one per step
        final_version = syncs[-1]["version"]
        weights = _final_weights(run)
        with httpx.Client(timeout=60) as http:
            for url in engine["urls"]:
                info = http.get(f"{url}/model_info").json()
                assert int(info["weight_version"]) == final_version
                out = http.post(
                    f"{url}/generate",
                    json={
                        "input_ids": PROMPT,
                        "return_logprob": True,
                        "sampling_params": {"temperature": 0.0, "max_new_tokens": 6},
                    },
                ).json()
                served = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
                expected = _teacher_forced_logprobs(weights, out["output_ids"])
                assert max(abs(a - b) for a, b in zip(served, expected, strict=True)) < 1e-4
    finally:
        launcher.finish(signal.SIGTERM)
        launcher.kill()
