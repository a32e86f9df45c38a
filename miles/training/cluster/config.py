"""The `cluster:` section of a train config: where the run's roles (engines, trainer ranks, the rollout
manager) live. `kind: local` (the default) runs them in this process and its torchrun ranks; `kind: ray`
places them as Ray actors on a Ray cluster (`miles.training.cluster.ray_run`). This module imports no Ray.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from miles.learner.errors import ConfigError


def _check_resources(resources: dict[str, float]) -> None:
    for name, amount in resources.items():
        if name in ("CPU", "GPU", "memory"):
            raise ConfigError(
                f"resources.{name}", "set CPUs and GPUs with the role's own keys (cpus, gpus_per_*)"
            )
        if not amount > 0:
            raise ConfigError(f"resources.{name}", f"must be > 0, got {amount}")


@dataclass(frozen=True)
class EngineRoleConfig:
    """The rollout engines as Ray actors (`cluster.engines`).

    - `count` engine actors, each with `gpus_per_engine` GPUs (0 on CPU nodes) and `cpus` CPUs;
    - `server`: what each actor serves on its node: `embedded` (the embedded engine and its SGLang-API server,
      inside the actor) or `sglang` (an SGLang server started through `miles rollout`'s launcher, with
      `--tp gpus_per_engine`);
    - `resources`: Ray custom resources each engine needs (to pin engines to labelled nodes);
    - `max_restarts`: how often Ray restarts an engine actor that died (it then rejoins the run at the next
      weight sync).
    """

    count: int = 1
    gpus_per_engine: float = 0.0
    cpus: float = 1.0
    server: Literal["embedded", "sglang"] = "embedded"
    resources: dict[str, float] = field(default_factory=dict)
    max_restarts: int = 3

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ConfigError("count", f"must be >= 1, got {self.count}")
        if self.gpus_per_engine < 0 or self.cpus < 0:
            raise ConfigError("gpus_per_engine" if self.gpus_per_engine < 0 else "cpus", "must be >= 0")
        if self.server == "sglang" and (
            self.gpus_per_engine < 1 or self.gpus_per_engine != int(self.gpus_per_engine)
        ):
            raise ConfigError(
                "gpus_per_engine", "an SGLang server runs on whole GPUs (its --tp): set 1, 2, 4 or 8"
            )
        if self.max_restarts < 0:
            raise ConfigError("max_restarts", f"must be >= 0, got {self.max_restarts}")
        _check_resources(self.resources)


@dataclass(frozen=True)
class TrainerRoleConfig:
    """The trainer's ranks as Ray actors (`cluster.trainer`): `ranks` (default: ``parallel.tp * pp * dp``) with
    `gpus_per_rank` GPUs (0: CPU and gloo; otherwise NCCL) and `cpus_per_rank` CPUs each, plus Ray custom
    `resources` per rank."""

    ranks: int | None = None
    gpus_per_rank: float = 0.0
    cpus_per_rank: float = 1.0
    resources: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.ranks is not None and self.ranks < 1:
            raise ConfigError("ranks", f"must be >= 1, got {self.ranks}")
        if self.gpus_per_rank not in (0, 1) and not 0 < self.gpus_per_rank < 1:
            raise ConfigError(
                "gpus_per_rank", "a rank drives one device: 0 (CPU), 1, or a fraction of one GPU"
            )
        if self.cpus_per_rank < 0:
            raise ConfigError("cpus_per_rank", "must be >= 0")
        _check_resources(self.resources)


@dataclass(frozen=True)
class ManagerRoleConfig:
    """The rollout manager actor of the asynchronous loop (`cluster.manager`): its CPUs and custom resources."""

    cpus: float = 1.0
    resources: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.cpus < 0:
            raise ConfigError("cpus", "must be >= 0")
        _check_resources(self.resources)


@dataclass(frozen=True)
class ClusterConfig:
    """Where the run's roles live (the `cluster:` section).

    - `kind`: `local` (this process, and torchrun ranks when ``tp * pp * dp > 1``) or `ray`.
    - `address`: the Ray cluster to join: null starts a private Ray instance on this machine bound to 127.0.0.1,
      `auto` joins the one `ray start` runs here, `HOST:PORT` a head node's GCS address.
    - `placement`: `disaggregated` gives engines and trainer ranks bundles of their own (their own GPUs; pin
      them to nodes with `resources`); `colocated` puts engine *i* in trainer rank *i*'s bundle, sharing its GPU.
    - `engines`, `trainer`, `manager`: each role's resources (see their classes).
    - `timeout_s`: how long to wait for the cluster to place the roles and for the engines to come up.
    """

    kind: Literal["local", "ray"] = "local"
    address: str | None = None
    placement: Literal["colocated", "disaggregated"] = "disaggregated"
    engines: EngineRoleConfig = field(default_factory=EngineRoleConfig)
    trainer: TrainerRoleConfig = field(default_factory=TrainerRoleConfig)
    manager: ManagerRoleConfig = field(default_factory=ManagerRoleConfig)
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.address is not None and not self.address.strip():
            raise ConfigError(
                "address", "must not be empty: use null (a private local instance), auto or HOST:PORT"
            )
        if not self.timeout_s > 0:
            raise ConfigError("timeout_s", f"must be > 0, got {self.timeout_s}")
        if self.placement == "colocated" and self.engines.gpus_per_engine != self.trainer.gpus_per_rank:
            raise ConfigError(
                "engines.gpus_per_engine",
                "colocated: an engine shares its trainer rank's GPU; set "
                "it equal to trainer.gpus_per_rank (or use placement: disaggregated)",
            )


def enter_driver_folder(folder: str) -> None:
    """Work from the driver's folder when this node has it (a shared filesystem, or the same machine), so the
    config's relative paths (output_dir, init_from, ...) mean what they mean on the driver."""
    if Path(folder).is_dir():
        os.chdir(folder)
