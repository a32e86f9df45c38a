"""`miles train` with `cluster.kind: ray` on a two-node Ray cluster that this module starts on loopback: a head
node (custom resource `node_a`, where the trainer ranks go) and a second raylet (`node_b`, engines and the
rollout manager), both bound to 127.0.0.1. Every run goes through the CLI, as a user's would, and joins the
cluster by its address.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
import torch
from safetensors.torch import load_file

from miles.sessions.recorder import read_sessions
from miles.training.metrics_log import read_metrics
from miles.types import TerminationReason

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[3]
SMALL = (
    "max_seconds=null",
    "eval.num_tasks=4",
    "steps=3",
    "rollout.tasks_per_step=4",
    "rollout.scheduler.group_size=4",
)
MB = 1024**2


@pytest.fixture(scope="module")
def cluster():
    """Two raylets on this machine, bound to 127.0.0.1, small (1 logical CPU per role, 80 MB object stores)."""
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"
        )  # Ray's loopback-only switch (see miles.training.cluster.ray_run)
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        head = {
            "num_cpus": 4,
            "resources": {"node_a": 8},
            "include_dashboard": False,
            "node_ip_address": "127.0.0.1",
            "object_store_memory": 80 * MB,
        }
        c = Cluster(initialize_head=True, head_node_args=head)
        c.add_node(
            num_cpus=4, resources={"node_b": 8}, node_ip_address="127.0.0.1", object_store_memory=80 * MB
        )
        ray.init(address=c.address, namespace="miles", logging_level="WARNING", log_to_driver=False)
        try:
            yield c
        finally:
            ray.shutdown()
            c.shutdown()


def placed(c: Any) -> tuple[str, ...]:
    """Join the test's cluster; engines and the manager on node B, the trainer on node A (disaggregated)."""
    return (
        f"cluster.address={c.address}",
        "cluster.kind=ray",
        "cluster.engines.resources={node_b: 1}",
        "cluster.manager.resources={node_b: 1}",
        "cluster.trainer.resources={node_a: 1}",
    )


def _command(out: Path, sets: tuple[str, ...], config: str | Path, extra: tuple[str, ...]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "miles.cli",
        "train",
        "--config",
        str(config),
        "--output-dir",
        str(out),
        *extra,
        *(x for s in sets for x in ("--set", s)),
    ]


def train(
    out: Path,
    *sets: str,
    config: str | Path = "configs/calculator.yaml",
    extra: tuple[str, ...] = (),
    wait: bool = True,
) -> Any:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("RANK", None)
    cmd = _command(out, sets, config, extra)
    if not wait:
        return subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=800, env=env)


def rows(out: Path, kind: str = "train") -> list[dict[str, Any]]:
    return [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == kind]


def node_with(resource: str) -> str:
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"])


def test_the_calculator_example_on_two_nodes_reaches_the_local_run_s_metrics(cluster, tmp_path):
    """configs/calculator.yaml, 3 steps, same seed: in-process engines (cluster.kind local) against engine actors
    on node B and the trainer on node A. The rollouts are the same tokens (sampling is seeded per request), so
    rewards, sessions and evaluations are equal; the training metrics agree to float tolerance (the engines'
    rollout logprobs differ in the last bits with batch composition, and PPO's ratio sees them)."""
    local = train(tmp_path / "local", *SMALL)
    assert local.returncode == 0, local.stderr[-3000:]
    remote = train(tmp_path / "ray", *SMALL, *placed(cluster))
    assert remote.returncode == 0, remote.stderr[-3000:]

    manifest = json.loads((tmp_path / "ray" / "cluster.json").read_text())
    assert [e["node_id"] for e in manifest["engines"]] == [node_with("node_b")]
    assert [r["node_id"] for r in manifest["ranks"]] == [node_with("node_a")]
    assert [s["method"] for s in rows(tmp_path / "ray", "sync")] == ["broadcast"] * 4  # HTTP engines
    assert [s["method"] for s in rows(tmp_path / "local", "sync")] == ["in_process"] * 4
    placements = [
        json.loads((tmp_path / run / "summary.json").read_text())["placement"] for run in ("local", "ray")
    ]
    assert [(p["ranks"], p["engines"]) for p in placements] == [
        ("in this process", "1 embedded engine on cpu"),
        ("on 1 Ray actor", "1 Ray engine actor"),
    ]

    a, b = rows(tmp_path / "local"), rows(tmp_path / "ray")
    assert len(a) == len(b) == 3
    for x, y in zip(a, b, strict=True):
        for key in (
            "rollout_reward_mean",
            "rollout_success_rate",
            "sessions",
            "trained_sessions",
            "generated_tokens",
        ):
            assert x[key] == y[key], (key, x[key], y[key])
        for key in ("loss", "grad_norm", "entropy", "clip_frac"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), (key, x[key], y[key])
    assert any(r["loss"] != 0 for r in a)
    evals = [(r["stage"], r["success_rate"], r["mean_reward"]) for r in rows(tmp_path / "local", "eval")]
    assert evals == [
        (r["stage"], r["success_rate"], r["mean_reward"]) for r in rows(tmp_path / "ray", "eval")
    ]
    tokens = {
        r.session_id: r.trajectory.token_ids
        for r in read_sessions(tmp_path / "local" / "sessions.jsonl").records
    }
    remote_tokens = {
        r.session_id: r.trajectory.token_ids
        for r in read_sessions(tmp_path / "ray" / "sessions.jsonl").records
    }
    assert tokens == remote_tokens and len(tokens) == 3 * 4 * 4


MEGATRON = {
    "seed": 0,
    "steps": 2,
    "backend": "megatron",
    "env": {"id": "Calculator-v0", "num_train_tasks": 64},
    "model": {"name": "tiny", "size": "0.1m"},
    "rollout": {
        "tasks_per_step": 2,
        "scheduler": {
            "group_size": 4,
            "progress": False,
            "session": {"sampling": {"temperature": 1.0, "max_new_tokens": 40}},
        },
    },
    "algorithm": {"loss": {"entropy_coef": 0.01}},
    "trainer": {"lr": 1e-3, "micro_batch_tokens": 2048},
    "sft": {"enabled": True, "num_demos": 8, "batch_size": 4},
    "eval": {"num_tasks": 4, "max_new_tokens": 40},
    "checkpoint": {"every": 1},
}


def test_megatron_tp2_under_ray_matches_torchrun(cluster, tmp_path):
    """The same Megatron TP=2 run (SFT, then 2 RL steps) under torchrun and as two rank actors over gloo."""
    config = tmp_path / "megatron.json"
    config.write_text(json.dumps(MEGATRON))
    torchrun = train(tmp_path / "torchrun", config=config, extra=("--tp", "2"))
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    remote = train(tmp_path / "ray", *placed(cluster), config=config, extra=("--tp", "2"))
    assert remote.returncode == 0, remote.stderr[-3000:]

    manifest = json.loads((tmp_path / "ray" / "cluster.json").read_text())
    assert [r["node_id"] for r in manifest["ranks"]] == [node_with("node_a")] * 2
    a, b = rows(tmp_path / "torchrun"), rows(tmp_path / "ray")
    assert len(a) == len(b) == 2
    for x, y in zip(a, b, strict=True):
        for key in ("rollout_reward_mean", "trained_sessions", "generated_tokens"):
            assert x[key] == y[key], (key, x[key], y[key])
        for key in ("loss", "grad_norm", "entropy"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), (key, x[key], y[key])
        assert y["mismatch_abs"] < 1e-5  # the engine actor was synced to the trainer's weights
    assert [s["version"] for s in rows(tmp_path / "ray", "sync")] == [1, 2, 3]
    wa = load_file(str(tmp_path / "torchrun" / "checkpoints" / "step_00000002" / "model.safetensors"))
    wb = load_file(str(tmp_path / "ray" / "checkpoints" / "step_00000002" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-4
    optimizer = torch.load(
        tmp_path / "ray" / "checkpoints" / "step_00000002" / "optimizer.pt", weights_only=True
    )
    assert len(optimizer["ranks"]) == 2


def _engine_busy(url: str) -> bool:
    try:
        loads = httpx.get(f"{url}/v1/loads", timeout=1.0).json()
    except (httpx.HTTPError, ValueError):
        return False
    return any(int(x.get("num_running_reqs", 0) or 0) > 0 for x in loads.get("loads", [loads]))


def test_an_engine_actor_killed_mid_rollout_is_restarted_and_rejoins(cluster, tmp_path):
    """Two engine actors; one is SIGKILLed while it has requests running. Its turns fail over to the other
    engine, Ray restarts it on its port, the next sync brings it back into the weight group, and it serves
    again. The run ends normally and every scheduled session is recorded, none lost."""
    out = tmp_path / "run"
    steps = (
        10  # the kill comes in step 1 or 2; the restarted engine needs a later sync to take sessions again
    )
    sets = (
        "max_seconds=null",
        "eval.num_tasks=4",
        f"steps={steps}",
        "rollout.tasks_per_step=8",
        "rollout.scheduler.group_size=4",
        "cluster.engines.count=2",
        *placed(cluster),
    )
    proc = train(out, *sets, wait=False)
    try:
        deadline = time.monotonic() + 600
        while not (out / "cluster.json").exists() or not (out / "metrics.jsonl").exists() or not rows(out):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        victim = json.loads((out / "cluster.json").read_text())["engines"][1]
        actor = ray.get_actor(victim["name"], namespace="miles")
        before = ray.get(actor.info.remote())
        while not _engine_busy(victim["url"]):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before the kill"
            time.sleep(0.005)
        held = max(r["version"] for r in rows(out, "sync"))  # the weights it was serving
        os.kill(before.pid, signal.SIGKILL)
        after = ray.get(actor.info.remote(), timeout=300)  # answered by the restarted actor
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert after.pid != before.pid and after.url == before.url  # a new process, on the same port

    assert [r["step"] for r in rows(out)] == list(range(steps))
    records = read_sessions(out / "sessions.jsonl").records
    assert len(records) == len({r.session_id for r in records}) == steps * 8 * 4  # scheduled == recorded
    assert not [
        r.termination
        for r in records
        if r.termination in (TerminationReason.ENGINE_ERROR, TerminationReason.ABORTED)
    ]
    turns = [(r, t) for r in records for t in r.turns]
    failed_over = [t for _, t in turns if any(a.engine_id == victim["url"] for a in t.attempts)]
    assert failed_over, "no turn was running on the killed engine"
    assert all(t.engine_id != victim["url"] for t in failed_over)  # each was retried on the other engine
    served_again = [t for _, t in turns if t.engine_id == victim["url"] and (t.weight_version or 0) > held]
    assert served_again  # after a later sync it held the trainer's weights and took sessions again


USER_ENV = '''
import json
import os
from pathlib import Path

from miles.envs import register
from miles.envs.calculator import CalculatorEnv


class MarkedCalculator(CalculatorEnv):
    """Calculator-v0 that notes which process built it and from which file it was imported."""

    def __init__(self, mark_dir: str = "", **kwargs):
        super().__init__(**kwargs)
        if mark_dir:
            Path(mark_dir, f"{os.getpid()}.json").write_text(json.dumps({"file": __file__}))


register("MarkedCalculator-v0", MarkedCalculator)
'''


def test_a_user_env_from_a_temporary_package_is_imported_on_the_workers(cluster, tmp_path):
    """The package exists only in a temporary folder; `env.import` names it by path. The train loop (rank 0)
    and the rollout manager (async) run on the workers and import the copy Ray shipped to them. The engine
    is colocated with the trainer rank (one bundle, one node)."""
    name = f"userpkg_{uuid.uuid4().hex[:8]}"
    package = tmp_path / "src" / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(USER_ENV)
    marks = tmp_path / "marks"
    marks.mkdir()
    out = tmp_path / "run"
    proc = train(
        out,
        "max_seconds=null",
        "eval.num_tasks=2",
        "steps=2",
        "rollout.tasks_per_step=2",
        "rollout.scheduler.group_size=2",
        f"env.import=[{package}]",
        "env.id=MarkedCalculator-v0",
        f"env.kwargs={{mark_dir: {marks}, max_operand: 9}}",
        "async.enabled=true",
        "async.max_staleness=1",
        "cluster.kind=ray",
        f"cluster.address={cluster.address}",
        "cluster.placement=colocated",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in rows(out)] == [0, 1]
    manifest = json.loads((out / "cluster.json").read_text())
    assert manifest["engines"][0]["node_id"] == manifest["ranks"][0]["node_id"]
    seen = {int(p.stem): json.loads(p.read_text())["file"] for p in marks.glob("*.json")}
    assert len(seen) >= 2  # rank 0 (the loop, evaluation) and the rollout manager actor
    for file in seen.values():
        assert f"/{name}/__init__.py" in file and not file.startswith(str(tmp_path))  # Ray's shipped copy


def test_an_import_error_on_a_worker_is_one_line(cluster, tmp_path):
    package = tmp_path / "brokenpkg"
    package.mkdir()
    (package / "__init__.py").write_text("import a_module_no_worker_has_xyz  # noqa\n")
    proc = train(tmp_path / "run", *SMALL, f"env.import=[{package}]", *placed(cluster))
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("miles train:")]
    assert lines == [
        "miles train: config error: env.import: cannot import 'brokenpkg': ModuleNotFoundError: No "
        "module named 'a_module_no_worker_has_xyz' (a module it imports is missing; install it)"
    ]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_a_dead_trainer_rank_ends_the_run_with_a_named_error_and_resume_continues(cluster, tmp_path):
    """Two FSDP2 ranks (torch backend, gloo); rank 1's actor is killed after a checkpoint."""
    config = tmp_path / "fsdp.json"
    config.write_text(json.dumps({**MEGATRON, "backend": "torch", "steps": 3, "sft": {"enabled": False}}))
    out = tmp_path / "run"
    proc = train(out, *placed(cluster), config=config, extra=("--dp", "2"), wait=False)
    try:
        deadline = time.monotonic() + 600
        while not list((out / "checkpoints").glob("step_*/model.safetensors")):  # a step trained and saved
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        rank1 = ray.get_actor(
            json.loads((out / "cluster.json").read_text())["ranks"][1]["name"], namespace="miles"
        )
        ray.kill(rank1, no_restart=True)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    named = [line for line in err.splitlines() if line.startswith("miles train:")]
    assert len(named) == 1 and named[0].startswith("miles train: trainer rank 1 died ("), named
    assert named[0].endswith("); continue the run with --resume")
    done = len(rows(out))
    assert 1 <= done < 3

    resumed = train(out, *placed(cluster), config=config, extra=("--dp", "2", "--resume"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in rows(out)] == [0, 1, 2]  # none lost, none repeated


def test_many_adapters_train_on_the_cluster_with_adapter_only_syncs_to_the_engine_actor(cluster, tmp_path):
    """configs/multi_lora.yaml with the engine actor on node B: each adapter reaches the engine as PEFT files
    (`/load_lora_adapter`), never the base again, and every step's sessions of an adapter ran on its
    current version."""
    out = tmp_path / "run"
    proc = train(
        out,
        "max_seconds=null",
        "eval.num_tasks=4",
        "steps=2",
        "rollout.scheduler.group_size=4",
        *placed(cluster),
        config="configs/multi_lora.yaml",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["node_id"] for r in json.loads((out / "cluster.json").read_text())["engines"]] == [
        node_with("node_b")
    ]
    syncs = rows(out, "sync")
    assert [s["method"] for s in syncs if "adapter" not in s] == ["broadcast"]  # the base, once
    for name in ("mul", "addsub"):
        mine = [s for s in syncs if s.get("adapter") == name]
        assert {s["method"] for s in mine} == {"disk"} and [s["version"] for s in mine] == list(
            range(len(mine))
        )
        records = [r for r in read_sessions(out / "sessions.jsonl").records if r.policy_id == name]
        assert sorted({v for r in records for v in r.weight_versions}) == [0, 1], name  # step k ran version k
    assert {r["adapter"] for r in rows(out, "eval")} == {"mul", "addsub"}
