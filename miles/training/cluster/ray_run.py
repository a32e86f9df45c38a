"""`miles train` with `cluster.kind: ray`: the run's roles as Ray actors placed by placement groups.

This process (the driver) joins or starts the Ray cluster, places the roles, watches them and prints the
result; it trains nothing itself:

1. **Engines.** `cluster.engines.count` `EngineActor` s, each serving one engine on its node. Their URLs
   become the run's `engine.kind: sglang` servers, so the train loop attaches to them and syncs weights over
   SGLang's weight-update group (broadcast from trainer rank 0) exactly as with servers started by hand.
   Ray restarts a dead engine actor (`max_restarts`) on the same port; it rejoins at the next weight sync.
2. **Trainer ranks.** `ranks` (``tp * pp * dp``) `TrainerRankActor` s form the torch process group (gloo on
   CPU, NCCL on GPUs) from the master address and port of rank 0's actor, with torchrun's variables. Rank 0
   runs the train loop, the others serve its collective calls, as under torchrun. A rank that dies ends the
   run with `TrainerRankError`; `--resume` continues from the last checkpoint.
3. **The rollout manager** (`async.enabled`) runs in its own actor (`miles.training.cluster.rollout`).
4. **User code.** The modules of `env.import` travel to every worker in the job's `runtime_env`
   (`py_modules`); an import error on a worker comes back as the one-line `ConfigError` it raised.

`cluster.placement` chooses the bundles: `disaggregated` gives engines and ranks bundles of their own,
`colocated` puts engine *i* in rank *i*'s bundle to share its GPU (`plan_placement`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.envs.recipe import IMPORT_KEY, _is_path
from miles.learner.errors import ConfigError
from miles.training.cluster.actors import (
    EngineActor,
    EngineInfo,
    EngineLaunch,
    TrainerRankActor,
    is_loopback,
    probe_port,
)
from miles.training.cluster.config import ClusterConfig
from miles.training.config import TrainConfig
from miles.training.output_dir import DRIVER_LOCK_NAME, OutputDirLock
from miles.training.placement import world_size_of
from miles.training.rank import TrainerRankError
from miles.training.torchrun import WORKER_ENV
from miles.training.trainer_setup import check_trainer_setup

RAY_INSTALL = "pip install -e '.[ray]'"
NAMESPACE = "miles"
# Ray's switch for single-machine clusters: with it off, Ray's own processes bind and advertise 127.0.0.1.
_LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


# ---- placement ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Slot:
    """Where one actor goes: bundle `bundle` of placement group `group`, taking `cpus` and `gpus` of it."""

    group: str
    bundle: int
    cpus: float
    gpus: float


@dataclass(frozen=True)
class Placement:
    """The placement groups of a run (name -> bundles, each packed onto as few nodes as possible) and the slot
    of every engine and trainer rank."""

    groups: dict[str, tuple[dict[str, float], ...]]
    engines: tuple[Slot, ...]
    ranks: tuple[Slot, ...]


def _bundle(cpus: float, gpus: float, resources: dict[str, float]) -> dict[str, float]:
    out = {"CPU": cpus, **resources}
    if gpus:
        out["GPU"] = gpus
    return {k: v for k, v in out.items() if v}


def plan_placement(cluster: ClusterConfig, ranks: int) -> Placement:
    """The bundles and slots for `cluster`'s engines and `ranks` trainer ranks.

    - disaggregated: group "engines" has one bundle per engine, group "trainer" one per rank;
    - colocated: group "shared" has one bundle per rank; engine *i* sits in bundle *i* and shares its GPU with
      rank *i* (Ray gives each half of it, so both see the same device). Needs ``engines.count <= ranks``.
    """
    e, t = cluster.engines, cluster.trainer
    if cluster.placement == "disaggregated":
        return Placement(
            groups={
                "engines": tuple(_bundle(e.cpus, e.gpus_per_engine, e.resources) for _ in range(e.count)),
                "trainer": tuple(
                    _bundle(t.cpus_per_rank, t.gpus_per_rank, t.resources) for _ in range(ranks)
                ),
            },
            engines=tuple(Slot("engines", i, e.cpus, e.gpus_per_engine) for i in range(e.count)),
            ranks=tuple(Slot("trainer", r, t.cpus_per_rank, t.gpus_per_rank) for r in range(ranks)),
        )
    if e.count > ranks:
        raise ConfigError(
            "cluster.engines.count",
            f"colocated places one engine beside each trainer rank: at most "
            f"{ranks} engines for {ranks} ranks (or use placement: disaggregated)",
        )
    merged = {**t.resources, **{k: v + t.resources.get(k, 0) for k, v in e.resources.items()}}
    bundles = tuple(
        _bundle(
            t.cpus_per_rank + (e.cpus if r < e.count else 0),
            t.gpus_per_rank,
            merged if r < e.count else t.resources,
        )
        for r in range(ranks)
    )
    share = t.gpus_per_rank / 2
    return Placement(
        groups={"shared": bundles},
        engines=tuple(Slot("shared", i, e.cpus, share) for i in range(e.count)),
        ranks=tuple(
            Slot("shared", r, t.cpus_per_rank, share if r < e.count else t.gpus_per_rank)
            for r in range(ranks)
        ),
    )


def trainer_ranks(cfg: TrainConfig) -> int:
    """The number of trainer rank actors: ``tp * pp * dp``, which `cluster.trainer.ranks` must agree with."""
    world = world_size_of(cfg)
    asked = cfg.cluster.trainer.ranks
    if asked is not None and asked != world:
        raise ConfigError(
            "cluster.trainer.ranks",
            f"{asked}, but parallel tp*pp*dp = {world}: set it to {world} (or leave it out)",
        )
    return world


# ---- user code ----------------------------------------------------------------------------------------
def runtime_env_for(imports: tuple[str, ...] | list[str]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The job's `runtime_env` carrying the user modules of `env.import` to every worker, and the names the
    workers import them by.

    A path (a `.py` file or a package folder) is shipped as it is and imported by its module name; a dotted
    name whose top-level module is a local file or folder (not installed in site-packages) is shipped too;
    installed packages are expected on every node. A name that cannot be found is a `ConfigError`.
    """
    shipped: list[str] = []
    names: list[str] = []
    for name in imports:
        if _is_path(name):
            path = Path(name).expanduser()
            if not path.exists():
                raise ConfigError(
                    IMPORT_KEY,
                    f"cannot ship {name!r} to the Ray workers: no such file or folder (from {os.getcwd()})",
                )
            path = path.resolve()
            shipped.append(str(path))
            names.append(path.stem if path.suffix == ".py" else path.name)
            continue
        top = name.split(".")[0]
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # as `import_user_modules` does: the working folder first
        spec = importlib.util.find_spec(top)
        if spec is None:
            raise ConfigError(
                IMPORT_KEY,
                f"cannot ship {name!r} to the Ray workers: no module named {top!r} here; "
                "run from the folder that holds it, or give the path to its .py file",
            )
        origin = Path(
            spec.submodule_search_locations[0] if spec.submodule_search_locations else spec.origin or ""
        )
        if origin.exists() and "site-packages" not in origin.parts and "dist-packages" not in origin.parts:
            shipped.append(str(origin))
        names.append(name)
    env: dict[str, Any] = {"py_modules": sorted(set(shipped))} if shipped else {}
    return env, tuple(names)


def remote_cause(exc: BaseException) -> BaseException:
    """The exception a Ray task or actor raised (a `ConfigError` stays one line), else `exc` itself."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:400] if text else type(exc).__name__


# ---- the run ------------------------------------------------------------------------------------------
def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("cluster.kind", f"ray needs Ray, which is not installed: {RAY_INSTALL}") from None
    return ray


def connect(cluster: ClusterConfig, runtime_env: dict[str, Any], *, num_cpus: float) -> None:
    """Join `cluster.address`, or start a private Ray instance bound to 127.0.0.1 (with at least `num_cpus`
    logical CPUs, so one machine can place every role)."""
    loopback = cluster.address is None or is_loopback(cluster.address.rpartition(":")[0] or cluster.address)
    if (
        loopback
    ):  # a cluster on this machine's loopback: Ray must not swap 127.0.0.1 for the machine's address
        os.environ[_LOOPBACK_SWITCH] = "0"
    ray = _import_ray()
    if ray.is_initialized():
        raise RuntimeError(
            "this process is connected to Ray already; run `miles train` in a process of its own"
        )
    if loopback:
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = (
            False  # read at call time; the variable above reaches Ray's processes
        )
    kwargs: dict[str, Any] = {
        "runtime_env": runtime_env or None,
        "namespace": NAMESPACE,
        "logging_level": "WARNING",
        "log_to_driver": True,
    }
    if cluster.address is None:
        ray.init(
            address="local",
            include_dashboard=False,
            num_cpus=max(os.cpu_count() or 1, int(num_cpus + 0.999)),
            **kwargs,
        )
        return
    try:
        ray.init(address=cluster.address, **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError(
            "cluster.address",
            f"cannot join the Ray cluster at {cluster.address!r} "
            f"({_first_line(exc)}); start it with `ray start --head`, or fix the address",
        ) from None


class RayRun:
    """One `miles train` run on Ray: `run()` places the roles, trains, and returns rank 0's `RunSummary`."""

    def __init__(self, cfg: TrainConfig, *, resume: bool, extend: bool = False) -> None:
        check_trainer_setup(cfg)
        self.cfg, self.resume, self.extend = cfg, resume, extend
        self.world = trainer_ranks(cfg)
        self.placement = plan_placement(cfg.cluster, self.world)
        self.token = uuid.uuid4().hex[:8]
        self.folder = os.getcwd()
        self.groups: dict[str, Any] = {}
        self.engines: list[Any] = []
        self.ranks: list[Any] = []

    def run(self) -> Any:
        lock = OutputDirLock(Path(self.cfg.output_dir), DRIVER_LOCK_NAME)  # before anything starts
        try:
            return self._run()
        finally:
            lock.release()

    def _run(self) -> Any:
        runtime_env, worker_imports = runtime_env_for(self.cfg.env.imports)
        from miles.engines.auth import API_KEY_ENV, TOKEN_ENV, admin_token, api_key

        # every actor (engines, trainer ranks, the rollout manager) guards or calls the engines with one token
        runtime_env["env_vars"] = {
            TOKEN_ENV: admin_token(create=True),
            **({API_KEY_ENV: api_key()} if api_key() else {}),
        }
        demand = sum(b.get("CPU", 0) for bundles in self.placement.groups.values() for b in bundles)
        connect(self.cfg.cluster, runtime_env, num_cpus=demand + self.cfg.cluster.manager.cpus)
        try:
            self._place()
            infos = self._start_engines()
            cfg = dataclasses.replace(
                self.cfg,
                engine=dataclasses.replace(self.cfg.engine, kind="sglang", urls=[i.url for i in infos]),
                env=dataclasses.replace(self.cfg.env, imports=list(worker_imports)),
            )
            self._start_ranks()
            self._write_manifest(infos)
            return self._train(cfg)
        finally:
            self.close()

    # ---- steps ----
    def _strategy(self, slot: Any) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            self.groups[slot.group], placement_group_bundle_index=slot.bundle
        )

    def _place(self) -> None:
        import ray
        from ray.util.placement_group import placement_group

        for name, bundles in self.placement.groups.items():
            self.groups[name] = placement_group(
                list(bundles), strategy="PACK", name=f"miles-{self.token}-{name}"
            )
        try:
            ray.get([g.ready() for g in self.groups.values()], timeout=self.cfg.cluster.timeout_s)
        except ray.exceptions.GetTimeoutError:
            asked = {name: list(b) for name, b in self.placement.groups.items()}
            raise ConfigError(
                "cluster",
                f"Ray could not place {asked} within {self.cfg.cluster.timeout_s:.0f} s; the "
                f"cluster has {ray.cluster_resources()}: add nodes, or lower cluster.engines / "
                "cluster.trainer (resources names custom node resources)",
            ) from None

    def _start_engines(self) -> list[EngineInfo]:
        import ray

        engine_cls = ray.remote(EngineActor)
        port_probe = ray.remote(num_cpus=0)(probe_port)
        ports = ray.get(
            [
                port_probe.options(scheduling_strategy=self._strategy(s)).remote()
                for s in self.placement.engines
            ]
        )
        for i, (slot, (_, port)) in enumerate(zip(self.placement.engines, ports, strict=True)):
            launch = EngineLaunch(cfg=self.cfg, index=i, port=port, folder=self.folder)
            self.engines.append(
                engine_cls.options(
                    name=f"{self.token}-engine-{i}",
                    num_cpus=slot.cpus,
                    num_gpus=slot.gpus,
                    max_restarts=self.cfg.cluster.engines.max_restarts,
                    max_task_retries=-1,
                    scheduling_strategy=self._strategy(slot),
                ).remote(launch)
            )
        try:
            return list(ray.get([e.info.remote() for e in self.engines], timeout=self.cfg.cluster.timeout_s))
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(
                "cluster.timeout_s", f"the engines did not come up within {self.cfg.cluster.timeout_s:.0f} s"
            ) from None
        except ray.exceptions.RayError as exc:
            raise _engine_failure(exc) from None

    def _start_ranks(self) -> None:
        import ray

        rank_cls = ray.remote(TrainerRankActor)
        for r, slot in enumerate(self.placement.ranks):
            self.ranks.append(
                rank_cls.options(
                    name=f"{self.token}-rank-{r}",
                    num_cpus=slot.cpus,
                    num_gpus=slot.gpus,
                    max_restarts=0,
                    scheduling_strategy=self._strategy(slot),
                ).remote(r, self.world, self.folder)
            )

    def _write_manifest(self, infos: list[EngineInfo]) -> None:
        """`cluster.json` in the run folder: where every role runs (actor names in the `miles` namespace)."""
        import ray

        nodes = ray.get([r.node.remote() for r in self.ranks])
        out = Path(self.cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        manifest = {
            "namespace": NAMESPACE,
            "placement": self.cfg.cluster.placement,
            "engines": [
                {"name": f"{self.token}-engine-{i.index}", "url": i.url, "node_id": i.node_id} for i in infos
            ],
            "ranks": [{"name": f"{self.token}-rank-{r}", "node_id": n} for r, n in enumerate(nodes)],
        }
        (out / "cluster.json").write_text(json.dumps(manifest, indent=1))

    def _train(self, cfg: TrainConfig) -> Any:
        import ray

        env: list[dict[str, str]] = [{} for _ in self.ranks]
        if self.world > 1:
            host, port = ray.get(self.ranks[0].master.remote())
            env = [
                {
                    "RANK": str(r),
                    "WORLD_SIZE": str(self.world),
                    "LOCAL_RANK": "0",
                    "LOCAL_WORLD_SIZE": "1",
                    "MASTER_ADDR": host,
                    "MASTER_PORT": str(port),
                    WORKER_ENV: "1",
                }
                for r in range(self.world)
            ]
        refs = {
            rank.run.remote(cfg, env[r], self.resume, self.extend): r for r, rank in enumerate(self.ranks)
        }
        summary = None
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                result = ray.get(done[0])
            except ray.exceptions.RayError as exc:
                raise self._failure(exc, refs) from None
            if refs[done[0]] == 0:
                summary = result
        return summary

    def _failure(self, first: BaseException, refs: dict[Any, int], grace_s: float = 10.0) -> BaseException:
        """What to report when a rank failed: a rank whose actor died (the others then fail in their collectives
        with whatever the backend says) as `TrainerRankError`, else the error the rank raised (a `ConfigError`
        or `RolloutManagerError` stays one line)."""
        import ray

        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=grace_s)
        for ref in sorted(ready, key=refs.__getitem__):
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                return TrainerRankError(
                    f"trainer rank {refs[ref]} died ({_first_line(exc)}); continue the run with --resume"
                )
            except ray.exceptions.RayError:
                continue
        return remote_cause(first)

    def close(self) -> None:
        """Stop every actor, remove the placement groups, and leave (or stop) Ray."""
        import ray

        if not ray.is_initialized():
            return
        for actor in [*self.ranks, *self.engines]:
            ray.kill(actor, no_restart=True)
        for group in self.groups.values():
            ray.util.remove_placement_group(group)
        ray.shutdown()


def _engine_failure(exc: BaseException) -> BaseException:
    cause = remote_cause(exc)
    if isinstance(cause, ConfigError):
        return cause
    return ConfigError("cluster.engines", f"an engine actor failed to start: {_first_line(cause)}")


def run_on_ray(cfg: TrainConfig, *, resume: bool, extend: bool = False) -> Any:
    """Run `cfg` with its roles on Ray (see the module docstring); returns rank 0's `RunSummary`."""
    return RayRun(cfg, resume=resume, extend=extend).run()
