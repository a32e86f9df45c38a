"""`cluster.kind: ray` without a Ray cluster: the `cluster:` section's errors, the placement plan, the user
modules shipped to workers, the engine's weight gate, and a restarted engine rejoining the weight-update
group (real embedded servers, broadcast over gloo). The Ray runs themselves are in `test_ray_cluster.py`."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.config import ConfigError
from miles.engines.client import SGLangClient
from miles.engines.server import serve_in_thread
from miles.engines.testing import small_qwen2
from miles.training.cluster.actors import WeightGatedEngine
from miles.training.cluster.config import ClusterConfig, EngineRoleConfig, TrainerRoleConfig
from miles.training.cluster.ray_run import plan_placement, runtime_env_for, trainer_ranks
from miles.training.cluster.sync import rejoining_weight_sync
from miles.training.config import load_train_config
from miles.weight_sync import SyncConfig, WeightSyncError

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("cluster.kind=slurm", "cluster.kind"),
        ("cluster.engines.count=0", "cluster.engines.count"),
        ("cluster.engines.resources={CPU: 1}", "cluster.engines.resources.CPU"),
        ("cluster.trainer.resources={node_a: 0}", "cluster.trainer.resources.node_a"),
        ("cluster.trainer.gpus_per_rank=2", "cluster.trainer.gpus_per_rank"),
        ("cluster.engines.server=sglang", "cluster.engines.gpus_per_engine"),  # SGLang needs whole GPUs
        ("cluster.address=' '", "cluster.address"),
        ("cluster.placement=colocated", None),  # fine: both roles on CPUs
    ],
)
def test_cluster_section_errors_name_the_key(override, key):
    if key is None:
        assert load_train_config(None, [override]).cluster.placement == "colocated"
        return
    with pytest.raises(ConfigError) as e:
        load_train_config(None, [override])
    assert str(e.value).startswith(f"{key}:")


def test_colocated_needs_the_engine_and_its_rank_on_one_gpu_share():
    with pytest.raises(ConfigError, match="cluster.engines.gpus_per_engine"):
        load_train_config(None, ["cluster.placement=colocated", "cluster.trainer.gpus_per_rank=1"])
    cfg = load_train_config(None, ["cluster.placement=colocated", "cluster.engines.count=3"])
    with pytest.raises(ConfigError, match="cluster.engines.count: colocated"):
        plan_placement(cfg.cluster, trainer_ranks(cfg))


def test_trainer_ranks_follow_the_parallel_layout():
    cfg = load_train_config(None, ["backend=megatron", "parallel.tp=2", "parallel.dp=2"])
    assert trainer_ranks(cfg) == 4
    with pytest.raises(ConfigError, match="cluster.trainer.ranks: 2, but parallel tp\\*pp\\*dp = 4"):
        trainer_ranks(
            load_train_config(
                None, ["backend=megatron", "parallel.tp=2", "parallel.dp=2", "cluster.trainer.ranks=2"]
            )
        )


@settings(max_examples=60, deadline=None)
@given(
    count=st.integers(1, 6),
    ranks=st.integers(1, 6),
    gpus=st.sampled_from([0.0, 0.5, 1.0]),
    engine_cpus=st.sampled_from([0.0, 1.0, 2.0]),
    rank_cpus=st.sampled_from([0.0, 1.0]),
    colocated=st.booleans(),
    pin=st.booleans(),
)
def test_every_actor_fits_its_bundle(count, ranks, gpus, engine_cpus, rank_cpus, colocated, pin):
    """Whatever the sizes: each actor sits in an existing bundle, what a bundle's actors take fits in it,
    disaggregated roles never share a bundle, and colocated engine i shares rank i's GPU."""
    if colocated and count > ranks:
        count = ranks
    cluster = ClusterConfig(
        kind="ray",
        placement="colocated" if colocated else "disaggregated",
        engines=EngineRoleConfig(
            count=count, gpus_per_engine=gpus, cpus=engine_cpus, resources={"node_b": 1.0} if pin else {}
        ),
        trainer=TrainerRoleConfig(gpus_per_rank=gpus, cpus_per_rank=rank_cpus),
    )
    plan = plan_placement(cluster, ranks)
    assert len(plan.engines) == count and len(plan.ranks) == ranks
    used: dict[tuple[str, int], list[float]] = {}
    for slot in [*plan.engines, *plan.ranks]:
        bundle = plan.groups[slot.group][slot.bundle]
        assert slot.cpus <= bundle.get("CPU", 0) + 1e-9 and slot.gpus <= bundle.get("GPU", 0) + 1e-9
        cpu, gpu = used.setdefault((slot.group, slot.bundle), [0.0, 0.0])
        used[(slot.group, slot.bundle)] = [cpu + slot.cpus, gpu + slot.gpus]
    for (group, index), (cpu, gpu) in used.items():
        assert cpu <= plan.groups[group][index].get("CPU", 0) + 1e-9
        assert gpu <= plan.groups[group][index].get("GPU", 0) + 1e-9
    if colocated:
        for i, engine in enumerate(plan.engines):
            rank = plan.ranks[i]
            assert (engine.group, engine.bundle) == (rank.group, rank.bundle)
            assert engine.gpus == rank.gpus == gpus / 2  # Ray hands both the same device
            assert plan.groups[engine.group][engine.bundle].get("node_b") == (1.0 if pin else None)
    else:
        assert {s.group for s in plan.engines} == {"engines"} and {s.group for s in plan.ranks} == {"trainer"}
        assert all(b.get("node_b") == (1.0 if pin else None) for b in plan.groups["engines"])
        assert all("node_b" not in b for b in plan.groups["trainer"])


def test_user_modules_travel_in_the_runtime_env(tmp_path, monkeypatch):
    (tmp_path / "single_env.py").write_text("X = 1\n")
    (tmp_path / "pkg_env").mkdir()
    (tmp_path / "pkg_env" / "__init__.py").write_text("")
    (tmp_path / "dotted_env").mkdir()
    (tmp_path / "dotted_env" / "__init__.py").write_text("")
    (tmp_path / "dotted_env" / "envs.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    env, names = runtime_env_for([str(tmp_path / "single_env.py"), "./pkg_env", "dotted_env.envs", "yaml"])
    assert names == ("single_env", "pkg_env", "dotted_env.envs", "yaml")  # how the workers import them
    assert env == {
        "py_modules": sorted(
            [str(tmp_path / "single_env.py"), str(tmp_path / "pkg_env"), str(tmp_path / "dotted_env")]
        )
    }  # an installed package is not shipped
    assert runtime_env_for([]) == ({}, ())
    for bad in ("./missing_env.py", "no_such_module_xyz"):
        with pytest.raises(ConfigError) as e:
            runtime_env_for([bad])
        assert str(e.value).startswith(f"env.import: cannot ship {bad!r} to the Ray workers")


def test_without_ray_the_cli_names_the_extra_in_one_line(tmp_path):
    """An empty `ray` package shadows the installed one: the run stops before anything starts."""
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError('no ray here')\n")
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from miles.cli import main
        sys.exit(main(["train", "--config", "configs/calculator.yaml", "--set", "cluster.kind=ray",
                       "--output-dir", {str(tmp_path / "run")!r}]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "miles train: config error: cluster.kind: ray needs Ray, which is not installed: pip install -e '.[ray]'"
    ]


async def test_a_fresh_engine_is_unhealthy_until_it_holds_trainer_weights():
    engine = WeightGatedEngine(small_qwen2(0))
    try:
        assert engine.weight_version == 0 and not await engine.health()
        await engine.update_weights(state_dict=small_qwen2(1).state_dict(), version=3)
        assert await engine.health()
    finally:
        await engine.close()


def _served(port: int = 0):
    engine = WeightGatedEngine(small_qwen2(0), model_path="rejoin-test")
    return engine, serve_in_thread(engine, port=port)


async def test_a_restarted_engine_rejoins_the_weight_group_and_gets_the_current_weights(tmp_path):
    """Two servers in a broadcast group; one is replaced by a fresh server on the same port (what Ray's restart
    does). The next push builds the group again and both engines end up with the pushed weights."""
    (e0, h0), (e1, h1) = _served(), _served()
    clients = [SGLangClient(h0.url), SGLangClient(h1.url)]
    sync = await rejoining_weight_sync(
        SyncConfig(method="broadcast", timeout_s=60), clients, staging_dir=tmp_path, wait_s=30
    )
    try:
        first = small_qwen2(5).state_dict()
        assert (await sync.push(first)).version == 1 and sync.rejoins == 0
        assert await clients[1].health()

        h1.stop()
        await e1.close()
        e1, h1 = _served(port=h1.port)  # back on its port, with its own initial weights at version 0
        assert not await clients[1].health()  # out of rotation until it holds the trainer's weights

        second = small_qwen2(6).state_dict()
        report = await sync.push(second)
        assert report.version == 2 and sync.rejoins == 1 and sync.version == 2
        for engine in (e0, e1):
            assert engine.weight_version == 2
            got = engine.model.state_dict()
            assert all(torch.equal(got[k], v) for k, v in second.items())
        assert await clients[1].health()
        assert (await sync.push(first)).version == 3 and sync.rejoins == 1  # nobody lost anything: no rebuild
    finally:
        await sync.close()
        for c in clients:
            await c.close()
        for h, e in ((h0, e0), (h1, e1)):
            h.stop()
            await e.close()


async def test_an_engine_that_never_comes_back_is_a_named_sync_error(tmp_path):
    engine, handle = _served()
    client = SGLangClient(handle.url)
    sync = await rejoining_weight_sync(
        SyncConfig(method="broadcast", timeout_s=60), [client], staging_dir=tmp_path, wait_s=1.0
    )
    try:
        await sync.push(small_qwen2(5).state_dict())
        handle.stop()
        await engine.close()
        with pytest.raises(WeightSyncError, match=f"engine {client.engine_id} did not answer for 1 s"):
            await sync.push(small_qwen2(6).state_dict())
    finally:
        await sync.close()
        await client.close()


def test_a_config_error_crosses_a_process_boundary_whole():
    """A `ConfigError` raised on a Ray worker reaches the driver as itself (key, message, subclass), so the
    CLI prints its one line there."""
    import pickle

    from miles.envs.registry import UnknownEnvError
    from miles.sessions.config import SessionConfigError

    for error in (
        ConfigError("env.import", "cannot import 'x'"),
        SessionConfigError("bad"),
        UnknownEnvError("no"),
    ):
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and (back.key, back.message, str(back)) == (
            error.key,
            error.message,
            str(error),
        )
