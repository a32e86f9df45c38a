"""Weight sync to HTTP engines that a supervisor restarts (Ray's engine actors): a restarted engine rejoins.

A weight-update group is formed once, with every engine. An engine that died and came back (Ray restarts
engine actors on the same node and port) is no longer in it, and holds no trainer weights (weight version 0:
the gated engine stays out of rotation meanwhile, see `miles.training.cluster.actors.WeightGatedEngine`).
`RejoiningSync` notices that before a push, by asking each engine which version it holds, builds the group
again with every engine, then pushes: the restarted engine gets the current weights and serves again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from miles.engine import EngineError, RolloutEngine
from miles.weight_sync import SyncConfig, SyncReport, WeightSync, WeightSyncError, build_weight_sync

if TYPE_CHECKING:
    from miles.engines.lora import AdapterWeights


class RejoiningSync:
    """A `WeightSync` whose engines may be restarted between pushes (see the module docstring).

    `build()` makes a fresh, connected `WeightSync` over the same engines; `wait_s` bounds how long a push
    waits for an engine that is down (being restarted) to answer again. Other attributes are the current
    `WeightSync` 's.
    """

    def __init__(
        self,
        sync: WeightSync,
        build: Callable[[], Awaitable[WeightSync]],
        *,
        wait_s: float = 600.0,
        poll_s: float = 0.5,
    ) -> None:
        self.sync = sync
        self._build = build
        self.wait_s, self.poll_s = wait_s, poll_s
        self.pushed: int | None = None  # the version every engine held after the last push
        self.rejoins = 0

    @property
    def version(self) -> int:
        return max(self.sync.version, self.pushed or 0)

    async def _held_version(self, engine: Any) -> int:
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                return int(await engine.refresh_weight_version())
            except EngineError as exc:
                if time.monotonic() > deadline:
                    raise WeightSyncError(
                        f"engine {engine.engine_id} did not answer for {self.wait_s:.0f} s "
                        f"(it died and was not restarted?): {exc}"
                    ) from exc
                await asyncio.sleep(self.poll_s)

    async def lost(self) -> list[str]:
        """The engines that no longer hold the last pushed weights (restarted), waiting for those that are down."""
        if self.pushed is None:
            return []
        held = await asyncio.gather(*(self._held_version(e) for e in self.sync.engines))
        return [e.engine_id for e, v in zip(self.sync.engines, held, strict=True) if v != self.pushed]

    async def push(self, state_dict: Mapping[str, torch.Tensor], *, version: int | None = None) -> SyncReport:
        """`WeightSync.push`, after building the group again when an engine lost its weights."""
        floor = self.version
        if await self.lost():
            await self.sync.close()
            self.sync = await self._build()
            self.rejoins += 1
        report = await self.sync.push(state_dict, version=floor + 1 if version is None else version)
        self.pushed = report.version
        return report

    def adapter_version(self, name: str) -> int | None:
        return self.sync.adapter_version(name)

    async def push_adapter(
        self, name: str, weights: AdapterWeights, *, version: int | None = None
    ) -> SyncReport:
        return await self.sync.push_adapter(name, weights, version=version)

    async def close(self) -> None:
        await self.sync.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["sync"], name)


async def rejoining_weight_sync(
    cfg: SyncConfig,
    engines: Sequence[RolloutEngine],
    *,
    staging_dir: str | Path | None = None,
    drain_engines: Sequence[RolloutEngine] | None = None,
    wait_s: float = 600.0,
) -> RejoiningSync:
    """`build_weight_sync` (same arguments), as a `RejoiningSync`."""

    def build() -> Awaitable[WeightSync]:
        return build_weight_sync(cfg, engines, staging_dir=staging_dir, drain_engines=drain_engines)

    return RejoiningSync(await build(), build, wait_s=wait_s)
