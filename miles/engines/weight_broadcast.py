"""Weight sync by broadcast over a dedicated torch.distributed process group (SGLang's
`/init_weights_update_group` + `/update_weights_from_distributed` protocol).

The trainer is rank 0; engine `i` joins as rank `rank_offset` (1, 2, ...). The group is standalone: a
`TCPStore` on `master_address:master_port` plus a `ProcessGroupGloo` (or NCCL on GPU) built directly on it,
so it never touches the default process group that a trainer may already use. Tensors are broadcast one by
one, in the order of `names`, with rank 0 as the source.

Trainer side::

    bc = WeightBroadcaster("127.0.0.1", port, world_size=1 + len(clients))
    await init_weight_update_group(bc, clients)        # every engine joins
    await broadcast_weights(bc, clients, model.state_dict(), version=3)
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from miles.engines.errors import InvalidRequestError

DEFAULT_GROUP = "weight_update_group"


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"` (the spelling SGLang expects in `dtypes`)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidRequestError(f"unknown dtype {name!r}")
    return dtype


def make_group(master_address: str, master_port: int, rank: int, world_size: int, *,
               group_name: str = DEFAULT_GROUP, backend: str = "gloo", timeout_s: float = 120.0) -> Any:
    """Create (and rendezvous) a standalone process group; blocks until all `world_size` ranks join."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=(rank == 0),
                          timeout=timeout, wait_for_workers=False)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "nccl" and torch.cuda.is_available():
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size)
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    return _Group(group, store, backend if backend == "nccl" and torch.cuda.is_available() else "gloo")


class _Group:
    def __init__(self, pg: Any, store: Any, backend: str) -> None:
        self.pg, self.store, self.backend = pg, store, backend

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.pg.broadcast([tensor], _root0()).wait()


def _root0() -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return opts


class WeightBroadcaster:
    """Rank 0 (the trainer) of a weight-update group."""

    def __init__(self, master_address: str, master_port: int, world_size: int, *,
                 group_name: str = DEFAULT_GROUP, backend: str = "gloo", timeout_s: float = 120.0) -> None:
        self.master_address, self.master_port, self.world_size = master_address, int(master_port), world_size
        self.group_name, self.backend, self.timeout_s = group_name, backend, timeout_s
        self._group: _Group | None = None

    def connect(self) -> None:
        """Blocks until every engine has joined (call while the engines' init requests are in flight)."""
        self._group = make_group(self.master_address, self.master_port, 0, self.world_size,
                                 group_name=self.group_name, backend=self.backend, timeout_s=self.timeout_s)

    @property
    def connected(self) -> bool:
        return self._group is not None

    def broadcast(self, tensors: Iterable[torch.Tensor]) -> None:
        """Send each tensor to every engine, in order (the engines must expect the same names/shapes)."""
        if self._group is None:
            raise RuntimeError("WeightBroadcaster.connect() was not called")
        device = "cuda" if self._group.backend == "nccl" else "cpu"
        for t in tensors:
            self._group.broadcast(t.detach().to(device).contiguous())

    def close(self) -> None:
        self._group = None


class WeightReceiver:
    """An engine's side of the group: receives the tensors named in one update request."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, *,
                 group_name: str = DEFAULT_GROUP, backend: str = "gloo", timeout_s: float = 120.0) -> None:
        if not 0 < rank < world_size:
            raise InvalidRequestError(f"engine rank {rank} must be in [1, {world_size})")
        self.group_name = group_name
        self._group = make_group(master_address, master_port, rank, world_size, group_name=group_name,
                                 backend=backend, timeout_s=timeout_s)

    @property
    def backend(self) -> str:
        return self._group.backend

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict[str, torch.Tensor]:
        if not len(names) == len(dtypes) == len(shapes):
            raise InvalidRequestError("names, dtypes and shapes differ in length")
        device = "cuda" if self._group.backend == "nccl" else "cpu"
        out: dict[str, torch.Tensor] = {}
        for name, dt, shape in zip(names, dtypes, shapes, strict=True):
            t = torch.empty([int(s) for s in shape], dtype=parse_dtype(dt), device=device)
            self._group.broadcast(t)
            out[name] = t
        return out


async def init_weight_update_group(broadcaster: WeightBroadcaster, clients: list[Any]) -> None:
    """Rendezvous the trainer (rank 0) with every `SGLangClient` in `clients` (ranks 1..n)."""
    calls = [c.init_weights_update_group(broadcaster.master_address, broadcaster.master_port, i + 1,
                                         broadcaster.world_size, group_name=broadcaster.group_name,
                                         backend=broadcaster.backend)
             for i, c in enumerate(clients)]
    await asyncio.gather(asyncio.to_thread(broadcaster.connect), *calls)
    for c in clients:
        c.attach_weight_group(broadcaster)


async def broadcast_weights(broadcaster: WeightBroadcaster, clients: list[Any],
                            state_dict: Mapping[str, torch.Tensor], *, version: int | None = None) -> None:
    """Push `state_dict` to every engine of the group: the HTTP requests and the broadcast run together."""
    names = list(state_dict)
    tensors = [state_dict[n] for n in names]
    dtypes = [dtype_name(t.dtype) for t in tensors]
    shapes = [list(t.shape) for t in tensors]
    calls = [c.update_weights_from_distributed(names, dtypes, shapes, group_name=broadcaster.group_name,
                                               weight_version=version) for c in clients]
    await asyncio.gather(asyncio.to_thread(broadcaster.broadcast, tensors), *calls)
