"""Weight sync: the trainer's new weights to every rollout engine, timed, with the version bumped.

Methods:
- `in_process`: `engine.update_weights(state_dict=...)`, a tensor copy into the embedded engine's model.
- `disk`: the state dict is written as an HF safetensors folder, then `engine.update_weights(path=...)`
  (SGLang's `/update_weights_from_disk`).
- `broadcast`: SGLang's `/init_weights_update_group` + `/update_weights_from_distributed`, with the
  trainer as rank 0 of a dedicated process group (NCCL on GPU, gloo on CPU).

Policies for generation still in flight when a sync starts:
- `drain`: wait until no engine has a generate call in flight, then load (each turn is then produced by
  exactly one weight version);
- `pause`: load at once; engines swap weights between decode steps and requests in flight continue under
  the new weights. Every `GenerateResult` reports the version it finished under.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file

from miles.engine import RolloutEngine

log = logging.getLogger(__name__)

SyncMethod = Literal["in_process", "disk", "broadcast"]
SyncPolicy = Literal["drain", "pause"]


class WeightSyncError(RuntimeError):
    """A sync could not complete: drain timed out, or the method is not set up."""


@dataclass
class SyncReport:
    """What one sync did and how long it took."""

    version: int
    method: str
    seconds: float
    drain_seconds: float
    num_bytes: int
    num_engines: int

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


class WeightSync:
    """Pushes HF-layout weights to `engines` with one method and one in-flight policy.

    For `broadcast`, pass a connected `miles.engines.weight_broadcast.WeightBroadcaster` whose group the
    engines joined (`init_weight_update_group`).
    """

    def __init__(self, engines: Sequence[RolloutEngine], *, method: SyncMethod = "in_process",
                 policy: SyncPolicy = "drain", staging_dir: str | Path | None = None,
                 broadcaster: Any = None, drain_timeout_s: float = 600.0, poll_s: float = 0.005) -> None:
        if method == "disk" and staging_dir is None:
            raise WeightSyncError("the disk method needs a staging_dir")
        if method == "broadcast" and broadcaster is None:
            raise WeightSyncError("the broadcast method needs a connected WeightBroadcaster")
        self.engines = list(engines)
        self.method, self.policy = method, policy
        self.staging_dir = Path(staging_dir) if staging_dir is not None else None
        self.broadcaster = broadcaster
        self.drain_timeout_s, self.poll_s = drain_timeout_s, poll_s
        self.history: list[SyncReport] = []

    @property
    def version(self) -> int:
        return max(e.weight_version for e in self.engines)

    async def _drain(self) -> float:
        start = time.perf_counter()
        deadline = start + self.drain_timeout_s
        while any(e.num_in_flight for e in self.engines):
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
        if self.method == "in_process":
            sd = dict(state_dict)
            await asyncio.gather(*(e.update_weights(state_dict=sd, version=version) for e in self.engines))
        elif self.method == "disk":
            assert self.staging_dir is not None
            folder = await asyncio.to_thread(save_hf_safetensors, state_dict, self.staging_dir / f"v{version}")
            await asyncio.gather(*(e.update_weights(path=str(folder), version=version) for e in self.engines))
        else:
            from miles.engines.weight_broadcast import broadcast_weights

            await broadcast_weights(self.broadcaster, self.engines, state_dict, version=version)
        report = SyncReport(version=self.version, method=self.method, seconds=time.perf_counter() - start,
                            drain_seconds=drain_s, num_bytes=state_dict_bytes(state_dict),
                            num_engines=len(self.engines))
        self.history.append(report)
        log.info("weight sync v%d (%s): %.3f s for %.1f MB", report.version, self.method, report.seconds,
                 report.num_bytes / 1e6)
        return report
