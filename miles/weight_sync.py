"""Weight sync: the trainer's new weights to every rollout engine, timed, with the version bumped.

Methods:
- `in_process`: `engine.update_weights(state_dict=...)`, a tensor copy into the embedded engine's model.
- `disk`: the state dict is written as an HF safetensors folder `v<version>` under the staging folder, then
  `engine.update_weights(path=...)` (SGLang's `/update_weights_from_disk`); only the newest `keep_versions`
  folders stay on disk.
- `broadcast`: SGLang's `/init_weights_update_group` + `/update_weights_from_distributed`, with the
  trainer as rank 0 of a dedicated process group (NCCL on GPU, gloo on CPU), in buckets
  (`miles.engines.weight_broadcast`).
- `auto` (the config default): `in_process` for embedded engines, `broadcast` for HTTP engines.

Policies for generation still in flight when a sync starts:
- `drain`: wait until no engine has a generate call in flight, then load (each turn is then produced by
  exactly one weight version);
- `pause`: every engine pauses decoding (`pause_generation`: SGLang's `/pause_generation` in `in_place` mode,
  whose model-update lock would otherwise wait for the requests in flight), loads, and continues; requests
  in flight go on under the new weights. Every `GenerateResult` reports the version it finished under.

LoRA adapters (`push_adapter`): only the adapter that changed travels, and each adapter has its own version
counter. In process, the engines swap it between decode steps; otherwise it is written as a PEFT folder
`adapters/<name>/v<version>` under the staging folder, which each engine loads with `update_adapter(path=...)`
(SGLang's `/load_lora_adapter`). SGLang 0.5.23 takes LoRA weights only from a path or same-host serialized
tensors, never over the weight-update group, so `broadcast` sends adapters by disk as well. Nothing is
drained: the other adapters' sessions and the base's go on, and an HTTP engine finishes the old version's
requests in flight on it.

Setup from a config: `await build_weight_sync(cfg.sync, workers, staging_dir=..., drain_engines=rollout)`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol
from urllib.parse import urlsplit

import torch
from safetensors.torch import save_file

from miles.config import ConfigError
from miles.engine import BASE_POLICY, RolloutEngine

if TYPE_CHECKING:
    from miles.engines.lora import AdapterWeights

log = logging.getLogger(__name__)

SyncMethod = Literal["in_process", "disk", "broadcast"]
SyncPolicy = Literal["drain", "pause"]


class WeightSyncError(RuntimeError):
    """A sync could not complete: drain timed out, or the method is not set up."""


@dataclass(frozen=True)
class SyncConfig:
    """How the trainer's weights reach the engines (the `sync:` section of a train config).

    `method`: auto | in_process | disk | broadcast. `auto` follows the engines: in-process embedded engines take
    `in_process`, HTTP engines (SGLang or `miles rollout` servers) `broadcast`.
    `policy`: drain (wait for in-flight requests) or pause (swap between decode steps; in-flight requests
    continue under the new weights).
    `bucket_mb`: the largest broadcast bucket (tensors are flattened per dtype into buckets of at most this).
    `keep_versions`: how many synced versions the disk method keeps in its staging folder.
    `master_address` / `master_port`: where the trainer hosts the broadcast group's rendezvous; the engines must
    reach it (port 0 picks a free one). `backend`: auto (nccl when this process has CUDA, else gloo), nccl, gloo.
    `timeout_s`: the group's rendezvous and collective timeout.
    """

    method: Literal["auto", "in_process", "disk", "broadcast"] = "auto"
    policy: Literal["drain", "pause"] = "drain"
    bucket_mb: float = 512.0
    keep_versions: int = 2
    master_address: str = "127.0.0.1"
    master_port: int = 0
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.bucket_mb > 0:
            raise ConfigError("bucket_mb", f"must be > 0, got {self.bucket_mb}")
        if self.keep_versions < 1:
            raise ConfigError(
                "keep_versions",
                f"must be >= 1 (the version the engines just loaded), got {self.keep_versions}",
            )
        if not 0 <= self.master_port < 65536:
            raise ConfigError(
                "master_port", f"must be in [0, 65535] (0 picks a free port), got {self.master_port}"
            )
        if not self.master_address:
            raise ConfigError("master_address", "must not be empty")
        if not self.timeout_s > 0:
            raise ConfigError("timeout_s", f"must be > 0, got {self.timeout_s}")

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 1024**2))


@dataclass
class SyncReport:
    """What one sync did and how long it took (`num_buckets`: broadcast buckets, 0 for other methods);
    `policy_id` is what was synced: "base" (the model's weights) or an adapter's name."""

    version: int
    method: str
    seconds: float
    drain_seconds: float
    num_bytes: int
    num_engines: int
    num_buckets: int = 0
    policy_id: str = BASE_POLICY

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / 1e9 / self.seconds if self.seconds > 0 else 0.0


def state_dict_bytes(state_dict: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state_dict.values())


def save_hf_safetensors(state_dict: Mapping[str, torch.Tensor], folder: str | Path) -> Path:
    """Write `state_dict` as `model.safetensors` in `folder` (shared storage of tied weights is cloned)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    tensors = {}
    for name, t in state_dict.items():
        t = t.detach().cpu().contiguous()
        ptr = t.data_ptr()
        tensors[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _version_folders(staging_dir: Path) -> list[Path]:
    """The `v<int>` folders under `staging_dir`, oldest write first."""
    if not staging_dir.is_dir():
        return []
    found = [p for p in staging_dir.iterdir() if p.is_dir() and p.name[:1] == "v" and p.name[1:].isdigit()]
    return sorted(found, key=lambda p: (p.stat().st_mtime_ns, int(p.name[1:])))


class WeightPusher(Protocol):
    """What a run pushes weights through: `WeightSync`, or `RejoiningSync` on a Ray cluster (engines that
    restart rejoin before the next push)."""

    @property
    def version(self) -> int:
        """The base weights' version the engines were last given."""
        ...

    async def push(self, state_dict: Mapping[str, torch.Tensor], *, version: int | None = None) -> SyncReport:
        """Load `state_dict` into every engine as `version` (default: the next)."""
        ...

    def adapter_version(self, name: str) -> int | None:
        """The version adapter `name` was last pushed as (None: never)."""
        ...

    async def push_adapter(
        self, name: str, weights: AdapterWeights, *, version: int | None = None
    ) -> SyncReport:
        """Load adapter `name` into every engine as its `version` (default: its next)."""
        ...

    async def close(self) -> None:
        """Release the transport."""
        ...


class WeightSync:
    """Pushes HF-layout weights to `engines` with one method and one in-flight policy.

    For `broadcast`, pass a connected `miles.engines.weight_broadcast.WeightBroadcaster` whose group the
    engines joined (`init_weight_update_group`). `drain_engines` are the engines whose in-flight requests the
    drain policy waits for (default `engines`; a router in front of the workers counts them instead).
    """

    def __init__(
        self,
        engines: Sequence[RolloutEngine],
        *,
        method: SyncMethod | Literal["auto"] = "in_process",
        policy: SyncPolicy = "drain",
        staging_dir: str | Path | None = None,
        broadcaster: Any = None,
        keep_versions: int = 2,
        drain_timeout_s: float = 600.0,
        poll_s: float = 0.005,
        drain_engines: Sequence[RolloutEngine] | None = None,
    ) -> None:
        method = resolve_sync_method(method, engines)
        if method == "disk" and staging_dir is None:
            raise WeightSyncError("the disk method needs a staging_dir")
        if method == "broadcast" and broadcaster is None:
            raise WeightSyncError(
                "the broadcast method needs a connected WeightBroadcaster (build_weight_sync makes one)"
            )
        if keep_versions < 1:
            raise WeightSyncError(f"keep_versions must be >= 1, got {keep_versions}")
        self.engines = list(engines)
        self.drain_engines = list(drain_engines) if drain_engines is not None else self.engines
        self.method, self.policy = method, policy
        self.staging_dir = Path(staging_dir) if staging_dir is not None else None
        self.broadcaster = broadcaster
        self.keep_versions = keep_versions
        self.drain_timeout_s, self.poll_s = drain_timeout_s, poll_s
        self.history: list[SyncReport] = []
        self.adapter_versions: dict[str, int] = {}

    @property
    def version(self) -> int:
        return max(e.weight_version for e in self.engines)

    async def _drain(self) -> float:
        start = time.perf_counter()
        deadline = start + self.drain_timeout_s
        while any(e.num_in_flight for e in self.drain_engines):
            if time.perf_counter() > deadline:
                raise WeightSyncError(f"generation did not drain within {self.drain_timeout_s} s")
            await asyncio.sleep(self.poll_s)
        return time.perf_counter() - start

    async def push(self, state_dict: Mapping[str, torch.Tensor], *, version: int | None = None) -> SyncReport:
        """Load `state_dict` into every engine as weight version `version` (default: the newest plus 1).

        Returns the report (also kept in `history`). A resumed run passes the version its checkpoint was
        synced as, so one version number always names one set of weights.
        """
        drain_s = await self._drain() if self.policy == "drain" else 0.0
        version = self.version + 1 if version is None else int(version)
        start = time.perf_counter()
        if (
            self.policy == "pause"
        ):  # SGLang loads at once only while paused, else it waits for requests in flight
            await asyncio.gather(*(e.pause_generation() for e in self.engines))
            try:
                buckets = await self._load(state_dict, version)
            finally:
                await asyncio.gather(*(e.continue_generation() for e in self.engines))
        else:
            buckets = await self._load(state_dict, version)
        report = SyncReport(
            version=self.version,
            method=self.method,
            seconds=time.perf_counter() - start,
            drain_seconds=drain_s,
            num_bytes=state_dict_bytes(state_dict),
            num_engines=len(self.engines),
            num_buckets=buckets,
        )
        self.history.append(report)
        log.info(
            "weight sync v%d (%s): %.3f s for %.1f MB",
            report.version,
            self.method,
            report.seconds,
            report.num_bytes / 1e6,
        )
        return report

    async def _load(self, state_dict: Mapping[str, torch.Tensor], version: int) -> int:
        """Load `state_dict` into every engine by this sync's method; the number of broadcast buckets."""
        buckets = 0
        if self.method == "in_process":
            sd = dict(state_dict)
            await asyncio.gather(*(e.update_weights(state_dict=sd, version=version) for e in self.engines))
        elif self.method == "disk":
            folder = await asyncio.to_thread(self._stage, state_dict, version)
            await asyncio.gather(*(e.update_weights(path=str(folder), version=version) for e in self.engines))
            await asyncio.to_thread(self._prune, folder)
        else:
            from miles.engines.weight_broadcast import WeightGroupMember, broadcast_weights

            members = [e for e in self.engines if isinstance(e, WeightGroupMember)]
            if len(members) != len(self.engines):
                raise WeightSyncError(
                    "the broadcast method needs engines that join a weight-update group (HTTP)"
                )
            buckets = await broadcast_weights(self.broadcaster, members, state_dict, version=version)
        return buckets

    def adapter_version(self, name: str) -> int | None:
        """The version adapter `name` was last pushed as (None: never)."""
        return self.adapter_versions.get(name)

    async def push_adapter(
        self, name: str, weights: AdapterWeights, *, version: int | None = None
    ) -> SyncReport:
        """Load adapter `name` into every engine as its version `version` (default: its last plus 1, or 0 the
        first time), without draining anything (see the module docstring); returns the report."""
        last = self.adapter_versions.get(name)
        version = (0 if last is None else last + 1) if version is None else int(version)
        start = time.perf_counter()
        if self.method == "in_process":
            await asyncio.gather(
                *(e.update_adapter(name, weights=weights, version=version) for e in self.engines)
            )
        else:
            if self.staging_dir is None:
                raise WeightSyncError(
                    f"adapters reach {self.method} engines by disk: give the sync a staging_dir"
                )
            root = self.staging_dir / "adapters" / name
            folder = await asyncio.to_thread(weights.save, root / f"v{version}")
            await asyncio.gather(
                *(e.update_adapter(name, path=str(folder), version=version) for e in self.engines)
            )
            await asyncio.to_thread(self._prune, folder, root)
        self.adapter_versions[name] = version
        report = SyncReport(
            version=version,
            method="in_process" if self.method == "in_process" else "disk",
            seconds=time.perf_counter() - start,
            drain_seconds=0.0,
            num_bytes=weights.num_bytes,
            num_engines=len(self.engines),
            policy_id=name,
        )
        self.history.append(report)
        log.info(
            "adapter sync %s v%d (%s): %.3f s for %.2f MB",
            name,
            version,
            report.method,
            report.seconds,
            report.num_bytes / 1e6,
        )
        return report

    def _stage(self, state_dict: Mapping[str, torch.Tensor], version: int) -> Path:
        assert self.staging_dir is not None
        folder = self.staging_dir / f"v{version}"
        if folder.exists():  # a resumed run writes this version again
            shutil.rmtree(folder)
        return save_hf_safetensors(state_dict, folder)

    def _prune(self, current: Path, root: Path | None = None) -> None:
        """Delete all but the newest `keep_versions` version folders under `root` (default: the staging folder),
        never `current`, which engines just read."""
        assert self.staging_dir is not None
        older = [p for p in _version_folders(root or self.staging_dir) if p != current]
        for folder in older[: max(0, len(older) - (self.keep_versions - 1))]:
            shutil.rmtree(folder, ignore_errors=True)

    async def close(self) -> None:
        """Leave the broadcast group (engines destroy theirs); other methods hold nothing."""
        if self.broadcaster is None:
            return
        from miles.engines.weight_broadcast import WeightGroupMember

        name = self.broadcaster.group_name
        members = [e for e in self.engines if isinstance(e, WeightGroupMember)]
        await asyncio.gather(*(e.destroy_weights_update_group(name) for e in members), return_exceptions=True)
        self.broadcaster.close()


# ---------------------------------------------------------------------------- setup from a config
def _is_http(engine: RolloutEngine) -> bool:
    from miles.engines.client import SGLangClient

    return isinstance(engine, SGLangClient)


def resolve_sync_method(method: str, engines: Sequence[RolloutEngine]) -> SyncMethod:
    """The method `method` (a `SyncConfig.method`) means for these engines; `ConfigError` naming the key and the
    fix when it cannot work with them."""
    if not engines:
        raise ConfigError("engine", "weight sync needs at least one engine")
    http = [_is_http(e) for e in engines]
    if any(http) and not all(http):
        raise ConfigError("engine", "weight sync needs engines of one kind: all embedded or all HTTP servers")
    if method == "auto":
        return "broadcast" if http[0] else "in_process"
    if method == "in_process" and http[0]:
        raise ConfigError(
            "sync.method",
            "in_process needs embedded engines in this process, but the engines are "
            "HTTP servers; use sync.method: broadcast (or auto, or disk)",
        )
    if method == "broadcast" and not http[0]:
        raise ConfigError(
            "sync.method",
            "broadcast sends weights to HTTP engines, but the engines are embedded "
            "in this process; use sync.method: in_process (or auto)",
        )
    if method not in ("in_process", "disk", "broadcast"):
        raise ConfigError("sync.method", f"{method!r} is not one of auto, in_process, disk, broadcast")
    return method  # type: ignore[return-value]


def resolve_backend(cfg: SyncConfig) -> str:
    """`cfg.backend` with `auto` resolved: nccl when this process has CUDA, else gloo."""
    if cfg.backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if cfg.backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError(
            "sync.backend", "nccl needs CUDA in the trainer process, and there is none; use gloo (or auto)"
        )
    return cfg.backend


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _engine_ranks(cfg: SyncConfig, clients: Sequence[Any]) -> list[int]:
    """Ranks each server holds in the group (its `tp_size`), checked against what SGLang can join."""
    sizes = []
    for c in clients:
        host = urlsplit(c.base_url).hostname or ""
        if _is_loopback(cfg.master_address) and not _is_loopback(host):
            raise ConfigError(
                "sync.master_address",
                f"{cfg.master_address} is this machine's loopback, which engine "
                f"{c.base_url} cannot reach; set it to an address of this "
                "machine on the engines' network",
            )
        info = await c.get_server_info()
        tp, dp, pp = (int(info.get(k) or 1) for k in ("tp_size", "dp_size", "pp_size"))
        if dp > 1 or pp > 1:
            raise ConfigError(
                "sync.method",
                f"{c.base_url} runs dp_size {dp}, pp_size {pp}: SGLang joins a weight "
                "group only with dp_size 1 and one pipeline stage; launch one server "
                "per replica (miles rollout --dp N) or use sync.method: disk",
            )
        sizes.append(tp)
    return sizes


async def connect_broadcaster(cfg: SyncConfig, clients: Sequence[Any]) -> Any:
    """Make the weight-update group: the trainer (rank 0) and every rank of every server join it.

    A group of the same name left on a server by an earlier run is destroyed first. Raises `ConfigError` when
    the engines cannot join (one line with the cause).
    """
    from miles.engines.weight_broadcast import DEFAULT_GROUP, WeightBroadcaster, init_weight_update_group

    backend = resolve_backend(cfg)
    sizes = await _engine_ranks(cfg, clients)
    await asyncio.gather(*(c.destroy_weights_update_group(DEFAULT_GROUP) for c in clients))
    broadcaster = WeightBroadcaster(
        cfg.master_address,
        cfg.master_port,
        world_size=1 + sum(sizes),
        backend=backend,
        timeout_s=cfg.timeout_s,
        bucket_bytes=cfg.bucket_bytes,
    )
    try:
        await init_weight_update_group(broadcaster, clients, ranks_per_engine=sizes)
    except Exception as exc:  # noqa: BLE001 - one line for the user, the cause chained
        where = f"tcp://{broadcaster.master_address}:{broadcaster.master_port}"
        raise ConfigError(
            "sync",
            f"the engines could not join the weight-update group at {where} over "
            f"{backend} ({type(exc).__name__}: {str(exc).splitlines()[0][:300]}); check "
            "sync.master_address/master_port are reachable from the engines and "
            "sync.backend suits them",
        ) from exc
    return broadcaster


async def build_weight_sync(
    cfg: SyncConfig,
    engines: Sequence[RolloutEngine],
    *,
    staging_dir: str | Path | None = None,
    drain_engines: Sequence[RolloutEngine] | None = None,
) -> WeightSync:
    """The `WeightSync` a config asks for, checked and (for broadcast) connected at setup.

    `engines` are the per-worker engines that hold weights (one client per SGLang server, never a router);
    `drain_engines` those the scheduler sends requests to, when they differ (a router); `staging_dir` is where
    the disk method writes. Raises `ConfigError` for a method that cannot work with these engines.
    """
    method = resolve_sync_method(cfg.method, engines)
    broadcaster = await connect_broadcaster(cfg, engines) if method == "broadcast" else None
    return WeightSync(
        engines,
        method=method,
        policy=cfg.policy,
        staging_dir=staging_dir,
        broadcaster=broadcaster,
        keep_versions=cfg.keep_versions,
        drain_engines=drain_engines,
    )
