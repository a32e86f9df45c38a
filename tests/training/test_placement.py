"""`RunPlacement`: the one line a run prints about where each of its roles runs, for every placement a config
can ask for."""

from __future__ import annotations

import pytest

from miles.training.config import load_train_config
from miles.training.placement import RunPlacement

SERVERS = 'engine.urls=["http://10.0.0.1:30000", "http://10.0.0.2:30000"]'


@pytest.mark.parametrize(
    ("overrides", "trainer", "ranks", "rollout", "engines"),
    [
        ([], "torch", "in this process", "the trainer's process (synchronous)", "1 embedded engine on cpu"),
        (
            ["async.enabled=true", "async.max_staleness=4", "engine.num_engines=2"],
            "torch",
            "in this process",
            "a child process (async, max_staleness 4)",
            "2 embedded engines on cpu",
        ),
        (
            ["backend=megatron", "parallel.tp=2", "parallel.dp=2", "engine.kind=router", SERVERS],
            "megatron (tp 2, pp 1, dp 2)",
            "on 4 torchrun ranks",
            "rank 0's process (synchronous)",
            "sglang-router over 2 servers",
        ),
        (
            ["rollout.agent.command=python agent.py", "engine.kind=sglang", SERVERS],
            "torch",
            "in this process",
            "the user's agents (a subprocess per session), through the endpoint in the trainer's process",
            "2 SGLang servers",
        ),
        (
            [
                "cluster.kind=ray",
                "parallel.dp=2",
                "async.enabled=true",
                "async.max_staleness=2",
                "engine.kind=sglang",
                SERVERS,
            ],
            "torch (tp 1, pp 1, dp 2)",
            "on 2 Ray actors",
            "a Ray actor (async, max_staleness 2)",
            "2 Ray engine actors",
        ),
        (
            ["adapters=[{name: add}, {name: mul}]"],
            "torch, 2 LoRA adapters in a trainer process of their own",
            "in this process",
            "the trainer's process (synchronous)",
            "1 embedded engine on cpu",
        ),
    ],
)
def test_the_placement_names_each_role_where_the_config_puts_it(overrides, trainer, ranks, rollout, engines):
    placement = RunPlacement.of(load_train_config(None, overrides))
    assert placement == RunPlacement(trainer=trainer, ranks=ranks, rollout=rollout, engines=engines)
    assert placement.line() == (
        f"[placement] trainer: {trainer} {ranks} · rollout: {rollout} · engines: {engines}"
    )
