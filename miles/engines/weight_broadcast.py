"""Weight sync by broadcast over SGLang's weight-update process group.

The protocol of SGLang 0.5.23 (io_struct `InitWeightsUpdateGroupReqInput`, `UpdateWeightsFromDistributedReqInput`;
`model_runner_components/weight_updater.py`; `scheduler_components/weight_updater.py`):

1. Every engine joins on `POST /init_weights_update_group {master_address, master_port, rank_offset, world_size,
   group_name, backend}`. SGLang's `init_custom_process_group` rendezvous at `tcp://master_address:master_port`
   as rank `rank_offset + tp_rank` (so a server with `tp_size` T holds T ranks). The trainer is rank 0.
2. `POST /begin_weight_update` opens a weight-update session (0.5.23 refuses distributed updates outside one).
3. One `POST /update_weights_from_distributed` per bucket, with `load_format: "flattened_bucket"`: the bucket's
   tensors travel as one uint8 tensor that rank 0 broadcasts (`src=0`) while the request is in flight. Only the
   last bucket carries `flush_cache: true` and the `weight_version`, so the cache flush and the version bump
   happen once every bucket has landed.
4. `POST /end_weight_update`.

The group is made exactly as SGLang makes it (`join_group`): the `tcp://` rendezvous creates a `TCPStore` (rank 0
hosts it), then `PrefixStore(group_name, store)`, and under it the layout of torch's `_new_process_group_helper`
(`"<group_name>/"`, then `"<device>/"`) for a `ProcessGroupGloo` or `ProcessGroupNCCL` of the group's ranks. The
backend object is built directly rather than registered in this process's torch.distributed state, so the group
never touches a default process group the trainer already has (FSDP or Megatron ranks; no NCCL split from it),
and one process may hold several members of one group (a trainer and in-thread test servers).

Trainer side::

    bc = WeightBroadcaster("127.0.0.1", port, world_size=1 + len(clients))
    await init_weight_update_group(bc, clients)        # every engine joins
    await broadcast_weights(bc, clients, model.state_dict(), version=3)
"""

from __future__ import annotations

import asyncio
import datetime
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
import torch.distributed as dist

from miles.engines.errors import InvalidRequestError

DEFAULT_GROUP = "weight_update_group"
DEFAULT_BUCKET_BYTES = 512 * 1024**2
FLATTENED_BUCKET = "flattened_bucket"  # SGLang's `load_format` for one flat uint8 tensor per request
COLLECTIVE_GRACE_S = 10.0  # how long a broadcast may still finish after an engine's request failed

T = TypeVar("T")


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"` (the spelling SGLang expects in `dtypes`)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """`"bfloat16"` (or `"torch.bfloat16"`) -> `torch.bfloat16`; `InvalidRequestError` for anything else."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidRequestError(f"unknown dtype {name!r}")
    return dtype


def tcp_init_method(master_address: str, master_port: int) -> str:
    """The rendezvous URL SGLang builds from a request (`NetworkAddress.to_tcp`: IPv6 hosts in brackets)."""
    host = f"[{master_address}]" if ":" in master_address else master_address
    return f"tcp://{host}:{int(master_port)}"


# ---------------------------------------------------------------------------- the group
class WeightGroup:
    """One rank's membership of a weight-update group (`join_group`). Broadcasts always come from rank 0."""

    def __init__(
        self,
        backend: Any,
        store: Any,
        *,
        rank: int,
        world_size: int,
        group_name: str,
        backend_name: str,
        device: torch.device,
    ) -> None:
        self._backend, self._store = backend, store
        self.rank, self.world_size, self.group_name = rank, world_size, group_name
        self.backend_name, self.device = backend_name, device

    def broadcast(self, tensor: torch.Tensor) -> None:
        """In place: rank 0 sends `tensor`, every other rank receives into it (same shape, dtype and device)."""
        if self._backend is None:
            raise RuntimeError(f"weight-update group {self.group_name!r} is closed")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        self._backend.broadcast([tensor], opts).wait()
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()

    def close(self) -> None:
        self._backend = self._store = None


def join_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    *,
    group_name: str = DEFAULT_GROUP,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    device: torch.device | str | None = None,
) -> WeightGroup:
    """Join (and, as rank 0, host) the group the way SGLang's `init_custom_process_group` does; blocks until all
    `world_size` ranks arrived or `timeout_s` passed. `backend` is "gloo" (CPU tensors) or "nccl" (CUDA tensors
    on `device`, by default the current CUDA device)."""
    if backend not in ("gloo", "nccl"):
        raise InvalidRequestError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise InvalidRequestError(f"rank {rank} is not in [0, {world_size})")
    if not group_name:
        raise InvalidRequestError("group_name must not be empty")
    if backend == "nccl":
        if not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise InvalidRequestError("backend 'nccl' needs CUDA, and this process has no GPU: use 'gloo'")
        dev = (
            torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        )
    else:
        dev = torch.device("cpu")
    timeout = datetime.timedelta(seconds=timeout_s)
    store, _, _ = next(
        dist.rendezvous(tcp_init_method(master_address, master_port), rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    # SGLang's PrefixStore(group_name), then _new_process_group_helper's "<group_name>/" and "<device>/" layers.
    group_store = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    backend_store = dist.PrefixStore(f"{dev.type}/", group_store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout
        opts.global_ranks_in_group = []
        opts.group_name = group_name
        with torch.cuda.device(dev):
            pg: Any = dist.ProcessGroupNCCL(backend_store, rank, world_size, opts)
    else:
        pg = dist.ProcessGroupGloo(backend_store, rank, world_size, timeout=timeout)
        pg.options.global_ranks_in_group = []
        pg.options.group_name = group_name
    pg._set_sequence_number_for_group()
    return WeightGroup(
        pg, store, rank=rank, world_size=world_size, group_name=group_name, backend_name=backend, device=dev
    )


# ---------------------------------------------------------------------------- buckets
@dataclass(frozen=True)
class Bucket:
    """Tensors of one dtype that travel as one flat byte buffer (one `/update_weights_from_distributed`)."""

    names: tuple[str, ...]
    dtype: torch.dtype
    shapes: tuple[tuple[int, ...], ...]

    @property
    def nbytes(self) -> int:
        return sum(_numel(s) for s in self.shapes) * self.dtype.itemsize

    @property
    def dtypes(self) -> list[str]:
        return [dtype_name(self.dtype)] * len(self.names)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def plan_buckets(state_dict: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[Bucket]:
    """Split `state_dict` into per-dtype buckets of at most `bucket_bytes` each (a larger tensor travels alone),
    keeping the state dict's order within a dtype."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, t in state_dict.items():
        by_dtype.setdefault(t.dtype, []).append(name)
    buckets: list[Bucket] = []
    for dtype, names in by_dtype.items():
        current: list[str] = []
        size = 0
        for name in names:
            nbytes = state_dict[name].numel() * dtype.itemsize
            if current and size + nbytes > bucket_bytes:
                buckets.append(_bucket(current, dtype, state_dict))
                current, size = [], 0
            current.append(name)
            size += nbytes
        if current:
            buckets.append(_bucket(current, dtype, state_dict))
    return buckets


def _bucket(names: list[str], dtype: torch.dtype, state_dict: Mapping[str, torch.Tensor]) -> Bucket:
    return Bucket(tuple(names), dtype, tuple(tuple(int(s) for s in state_dict[n].shape) for n in names))


def flatten_bucket(
    bucket: Bucket, state_dict: Mapping[str, torch.Tensor], device: torch.device
) -> torch.Tensor:
    """The bucket's tensors, concatenated on `device`, as one 1-D uint8 tensor (SGLang's flattened layout)."""
    parts = [state_dict[n].detach().to(device).reshape(-1) for n in bucket.names]
    return torch.cat(parts).view(torch.uint8)


def unflatten(
    flat: torch.Tensor, names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]
) -> dict[str, torch.Tensor]:
    """Views into the uint8 buffer `flat`, one per (name, dtype, shape), packed in order without padding."""
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        size = _numel(shape) * dtype.itemsize
        out[name] = flat[offset : offset + size].view(dtype).reshape(tuple(shape))
        offset += size
    if offset != flat.numel():
        raise InvalidRequestError(f"bucket holds {flat.numel()} bytes, its tensors {offset}")
    return out


def _check_layout(
    names: Any, dtypes: Any, shapes: Any
) -> tuple[list[str], list[torch.dtype], list[list[int]]]:
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise InvalidRequestError("names, dtypes and shapes must be lists")
    if not len(names) == len(dtypes) == len(shapes):
        raise InvalidRequestError("names, dtypes and shapes differ in length")
    if not names:
        raise InvalidRequestError("names is empty")
    parsed = [parse_dtype(d) for d in dtypes]
    dims: list[list[int]] = []
    for name, shape in zip(names, shapes, strict=True):
        if not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
        ):
            raise InvalidRequestError(
                f"shape of {name!r} must be a list of non-negative integers, got {shape!r}"
            )
        dims.append(list(shape))
    return [str(n) for n in names], parsed, dims


# ---------------------------------------------------------------------------- the two sides
class WeightBroadcaster:
    """Rank 0 (the trainer) of a weight-update group. `master_port` 0 picks a free port."""

    def __init__(
        self,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        world_size: int = 2,
        *,
        group_name: str = DEFAULT_GROUP,
        backend: str = "gloo",
        timeout_s: float = 300.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        if world_size < 2:
            raise ValueError(
                f"world_size must be >= 2 (the trainer and at least one engine rank), got {world_size}"
            )
        if not master_port:
            from miles.ports import free_port

            master_port = free_port(master_address)
        self.master_address, self.master_port, self.world_size = master_address, int(master_port), world_size
        self.group_name, self.backend, self.timeout_s = group_name, backend, timeout_s
        self.bucket_bytes = bucket_bytes
        self.broken: str | None = None  # why the group cannot be used any more
        self._group: WeightGroup | None = None

    def connect(self) -> None:
        """Blocks until every engine has joined (call while the engines' init requests are in flight)."""
        self._group = join_group(
            self.master_address,
            self.master_port,
            0,
            self.world_size,
            group_name=self.group_name,
            backend=self.backend,
            timeout_s=self.timeout_s,
        )

    @property
    def connected(self) -> bool:
        return self._group is not None

    @property
    def device(self) -> torch.device:
        """Where broadcast buffers live: the current CUDA device for NCCL, else the CPU."""
        if self._group is not None:
            return self._group.device
        return (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Send one tensor (on `device`) to every engine rank."""
        if self._group is None:
            raise RuntimeError("WeightBroadcaster.connect() was not called")
        self._group.broadcast(tensor)

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group = None


class WeightReceiver:
    """An engine's side of the group: receives what one `/update_weights_from_distributed` request announces."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        *,
        group_name: str = DEFAULT_GROUP,
        backend: str = "nccl",
        timeout_s: float = 300.0,
        device: torch.device | str | None = None,
    ) -> None:
        if not 0 < rank < world_size:
            raise InvalidRequestError(f"engine rank {rank} must be in [1, {world_size})")
        self.group_name = group_name
        self._group = join_group(
            master_address,
            master_port,
            rank,
            world_size,
            group_name=group_name,
            backend=backend,
            timeout_s=timeout_s,
            device=device,
        )

    @property
    def backend(self) -> str:
        return self._group.backend_name

    def receive(
        self, names: Any, dtypes: Any, shapes: Any, load_format: str | None = None
    ) -> dict[str, torch.Tensor]:
        """Receive the announced tensors: one flat uint8 broadcast for `load_format="flattened_bucket"`, else one
        broadcast per tensor, in order (SGLang's two paths). Tensors keep their wire dtype."""
        names, parsed, dims = _check_layout(names, dtypes, shapes)
        if load_format not in (None, FLATTENED_BUCKET):
            raise InvalidRequestError(
                f"load_format {load_format!r} is not supported (None or {FLATTENED_BUCKET!r})"
            )
        device = self._group.device
        if load_format == FLATTENED_BUCKET:
            offset = 0
            for name, dtype, shape in zip(names, parsed, dims, strict=True):
                if offset % dtype.itemsize:
                    raise InvalidRequestError(f"unaligned tensor {name!r} at byte {offset} for {dtype}")
                offset += _numel(shape) * dtype.itemsize
            flat = torch.empty(offset, dtype=torch.uint8, device=device)
            self._group.broadcast(flat)
            return unflatten(flat, names, parsed, dims)
        out: dict[str, torch.Tensor] = {}
        for name, dtype, shape in zip(names, parsed, dims, strict=True):
            t = torch.empty(shape, dtype=dtype, device=device)
            self._group.broadcast(t)
            out[name] = t
        return out

    def close(self) -> None:
        self._group.close()


# ---------------------------------------------------------------------------- trainer-side orchestration
class WeightGroupError(RuntimeError):
    """A collective of the weight-update group did not complete: the group is out of step and unusable."""


def in_daemon_thread(fn: Callable[[], T]) -> asyncio.Future[T]:
    """Run blocking `fn` in a daemon thread and await its result. Unlike `asyncio.to_thread`, a collective that
    will never complete (a peer gave up) does not keep the process from exiting."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if future.done():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def run() -> None:
        try:
            result: tuple[bool, Any] = (True, fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            result = (False, exc)
        try:
            loop.call_soon_threadsafe(settle, *result)
        except RuntimeError:  # the loop is gone
            pass

    threading.Thread(target=run, name="miles-weight-group", daemon=True).start()
    return future


async def _together(blocking: Callable[[], Any], calls: Sequence[Awaitable[Any]]) -> None:
    """Run a blocking collective and the HTTP calls that make the engines take part in it.

    The first failure raises at once. When the collective failed, or has not completed `COLLECTIVE_GRACE_S`
    after an HTTP failure, `WeightGroupError` says the group is out of step (the collective is abandoned in its
    daemon thread).
    """
    collective = in_daemon_thread(blocking)
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        await asyncio.gather(collective, *tasks)
        return
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised below, with the group's state
        for t in tasks:
            t.cancel()
        failure = exc
    if collective.done() and not collective.cancelled() and collective.exception() is failure:
        raise WeightGroupError(f"the weight-update group's collective failed: {failure}") from failure
    try:
        await asyncio.wait_for(asyncio.shield(collective), COLLECTIVE_GRACE_S)
    except Exception as exc:  # noqa: BLE001
        raise WeightGroupError(
            f"the weight-update group's collective did not complete ({type(exc).__name__}: "
            f"{exc}) after an engine failed: {failure}"
        ) from failure
    raise failure


@runtime_checkable
class WeightGroupMember(Protocol):
    """An engine that joins the trainer's weight-update group over SGLang's API (`SGLangClient`)."""

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = ...,
        backend: str = ...,
    ) -> None: ...

    def attach_weight_group(self, broadcaster: Any) -> None: ...

    async def begin_weight_update(self) -> None: ...

    async def end_weight_update(self) -> None: ...

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        *,
        group_name: str = ...,
        weight_version: int | None = ...,
        flush_cache: bool = ...,
        load_format: str | None = ...,
    ) -> None: ...

    async def destroy_weights_update_group(self, group_name: str = ...) -> bool: ...


async def init_weight_update_group(
    broadcaster: WeightBroadcaster,
    clients: Sequence[WeightGroupMember],
    *,
    ranks_per_engine: Sequence[int] | None = None,
) -> None:
    """Rendezvous the trainer (rank 0) with every `SGLangClient` in `clients`. Engine `i` holds
    `ranks_per_engine[i]` ranks (its `tp_size`; 1 each by default) and joins at the next free rank offset."""
    sizes = list(ranks_per_engine) if ranks_per_engine is not None else [1] * len(clients)
    if len(sizes) != len(clients) or 1 + sum(sizes) != broadcaster.world_size:
        raise ValueError(f"world_size {broadcaster.world_size} != 1 + ranks of the engines {sizes}")
    offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
    calls = [
        c.init_weights_update_group(
            broadcaster.master_address,
            broadcaster.master_port,
            off,
            broadcaster.world_size,
            group_name=broadcaster.group_name,
            backend=broadcaster.backend,
        )
        for c, off in zip(clients, offsets, strict=True)
    ]
    await _together(broadcaster.connect, calls)
    for c in clients:
        c.attach_weight_group(broadcaster)


async def broadcast_weights(
    broadcaster: WeightBroadcaster,
    clients: Sequence[WeightGroupMember],
    state_dict: Mapping[str, torch.Tensor],
    *,
    version: int | None = None,
) -> int:
    """Push `state_dict` to every engine of the group, bucket by bucket; returns the number of buckets.

    Engines load each bucket as it lands; the last one carries the cache flush and `version`. Two buckets are in
    memory at a time (the next one is flattened while the current one travels). A collective that did not
    complete leaves the group unusable: `broadcaster.broken` says why and later calls raise at once.
    """
    if broadcaster.broken:
        raise WeightGroupError(
            f"the weight-update group is unusable after an earlier failure "
            f"({broadcaster.broken}); set it up again"
        )
    buckets = plan_buckets(state_dict, broadcaster.bucket_bytes)
    if not buckets:
        raise ValueError("the state dict is empty: nothing to broadcast")
    device = broadcaster.device

    def flatten(i: int) -> asyncio.Future[torch.Tensor]:  # the next bucket flattens while this one travels
        return asyncio.ensure_future(asyncio.to_thread(flatten_bucket, buckets[i], state_dict, device))

    pending = flatten(0)
    try:
        await asyncio.gather(*(c.begin_weight_update() for c in clients))
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            flat = await pending
            if not last:
                pending = flatten(i + 1)
            calls = [
                c.update_weights_from_distributed(
                    list(bucket.names),
                    bucket.dtypes,
                    [list(s) for s in bucket.shapes],
                    group_name=broadcaster.group_name,
                    load_format=FLATTENED_BUCKET,
                    flush_cache=last,
                    weight_version=version if last else None,
                )
                for c in clients
            ]
            await _together(lambda flat=flat: broadcaster.broadcast(flat), calls)
    except WeightGroupError as exc:
        broadcaster.broken = str(exc)
        raise
    finally:
        await asyncio.gather(pending, *(c.end_weight_update() for c in clients), return_exceptions=True)
    return len(buckets)
