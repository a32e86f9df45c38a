"""The Ray actors of a `cluster.kind: ray` run, as plain classes (`miles.training.cluster.ray_run` makes them
remote). Each wraps an existing role without changing it:

- `EngineActor`: one rollout engine on its node, reached by URL like any SGLang server. With
  `cluster.engines.server: embedded` the actor holds the embedded engine and its SGLang-API server
  (`miles.engines.server`); with `sglang` it starts an SGLang server through `miles rollout`'s launcher.
- `TrainerRankActor`: one rank of the trainer's process group. Rank 0 runs the `TrainLoop` (as a
  single-process run or torchrun's rank 0 would), the others serve rank 0's collective calls
  (`miles.training.placement.run_worker`), exactly as under torchrun.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from miles.engines.embedded import EmbeddedEngine
from miles.ports import free_port
from miles.training.cluster.config import enter_driver_folder
from miles.training.config import TrainConfig


def node_address() -> tuple[str, str]:
    """This Ray worker's node: (IP address, node id)."""
    import ray

    return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()


def probe_port() -> tuple[str, int]:
    """Where a server of this node can listen: its IP and a free port (run as a task in the server's bundle)."""
    host, _ = node_address()
    return host, free_port(host)


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class EngineInfo:
    """What an engine actor reports: its URL, process and node."""

    index: int
    url: str
    pid: int
    node_id: str


class WeightGatedEngine(EmbeddedEngine):
    """The embedded engine, reporting itself unhealthy until it holds the trainer's weights.

    A fresh engine is at weight version 0, and every weight sync loads version 1 or later. So an engine that
    Ray restarted stays out of the router's rotation (its health probes fail) until the next sync has made it
    rejoin the weight-update group and loaded the current weights: no session is served by stale weights.
    """

    async def health(self) -> bool:
        return self.weight_version > 0 and await super().health()


@dataclass(frozen=True)
class EngineLaunch:
    """What an engine actor starts: engine `index` of the run `cfg` (its `model`, `engine` and `cluster`
    sections), listening on `port` of its node; `folder` is the driver's working folder."""

    cfg: TrainConfig
    index: int
    port: int
    folder: str


def sglang_spec(cfg: TrainConfig, host: str, port: int) -> Any:
    """The launcher's `LaunchSpec` for one SGLang server of the run: the policy's weights (`model.init_from`,
    else `model.name`) on `gpus_per_engine` GPUs (its --tp), at `host:port`, without a router."""
    from miles.engines.auth import admin_token
    from miles.engines.launcher import LaunchSpec

    return LaunchSpec(
        engine="sglang",
        model=cfg.model.init_from or cfg.model.name,
        tp=int(cfg.cluster.engines.gpus_per_engine),
        host=host,
        port=port,
        router=False,
        admin_key=admin_token(create=True),
    )


class EngineActor:
    """One rollout engine on its node (see the module docstring); `info()` says where it answers."""

    def __init__(self, launch: EngineLaunch) -> None:
        enter_driver_folder(launch.folder)
        self.index = launch.index
        host, self.node_id = node_address()
        cfg = launch.cfg
        self._process: Any = None
        self._server: Any = None
        if cfg.cluster.engines.server == "sglang":
            self.url = self._start_sglang(cfg, host, launch.port)
        else:
            self.url = self._start_embedded(cfg, host, launch.port)

    def _start_embedded(self, cfg: TrainConfig, host: str, port: int) -> str:
        import ray

        from miles.engines.auth import admin_token
        from miles.engines.server import serve_in_thread
        from miles.training.models import build_policy, build_tito
        from miles.training.seeding import seed_everything

        seed_everything(cfg.seed)
        tito = build_tito(cfg.model)
        engine = WeightGatedEngine(
            build_policy(cfg.model, tito.tokenizer),
            tokenizer=tito.tokenizer,
            device="cuda" if ray.get_gpu_ids() else cfg.engine.device,
            max_batch_size=cfg.engine.max_batch_size,
            engine_id=f"ray-engine-{self.index}",
            kv_cache_fraction=cfg.engine.kv_cache_fraction,
            model_path=cfg.model.init_from or cfg.model.name,
        )
        self._server = serve_in_thread(engine, host=host, port=port, admin_key=admin_token(create=True))
        return self._server.url

    def _start_sglang(self, cfg: TrainConfig, host: str, port: int) -> str:
        from miles.config import ConfigError
        from miles.engines.launcher import missing_requirement, plan_launch
        from miles.engines.subprocesses import log_tail, spawn

        spec = sglang_spec(cfg, host, port)
        missing = missing_requirement(spec)
        if missing:
            raise ConfigError("cluster.engines.server", f"on node {host}: {missing}")
        plan = plan_launch(spec)
        log = Path(cfg.output_dir) / "engine_logs" / f"engine-{self.index}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        self._process = spawn(list(plan.servers[0].command), log_path=log)
        url = plan.servers[0].url
        deadline = time.monotonic() + cfg.cluster.timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"the SGLang server of engine {self.index} exited with code "
                    f"{self._process.returncode}: {log_tail(log, 5)}"
                )
            try:
                if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(
            f"the SGLang server of engine {self.index} did not answer /health within "
            f"{cfg.cluster.timeout_s:.0f} s (log: {log})"
        )

    def info(self) -> EngineInfo:
        return EngineInfo(index=self.index, url=self.url, pid=os.getpid(), node_id=self.node_id)


class TrainerRankActor:
    """Rank `rank` of `world` trainer ranks: `master()` (rank 0) names the process group's rendezvous,
    `run()` trains (rank 0 returns the `RunSummary`, the others None)."""

    def __init__(self, rank: int, world: int, folder: str) -> None:
        enter_driver_folder(folder)
        self.rank, self.world = rank, world
        self.host, self.node_id = node_address()

    def node(self) -> str:
        return self.node_id

    def master(self) -> tuple[str, int]:
        """This node's address and a free port for the process group's rendezvous (rank 0's)."""
        return self.host, free_port(self.host)

    def run(self, cfg: TrainConfig, env: dict[str, str], resume: bool, extend: bool = False) -> Any:
        """Join the process group described by `env` (torchrun's variables) and run this rank (`run_rank`)."""
        from miles.training.rank import run_rank

        os.environ.update(env)
        if is_loopback(cfg.sync.master_address) and not is_loopback(self.host):
            # The engines join the weight-update group here (rank 0); the default loopback address is this node's.
            cfg = dataclasses.replace(cfg, sync=dataclasses.replace(cfg.sync, master_address=self.host))
        return run_rank(cfg, resume=resume, extend=extend)
