"""KV-cache storage for the embedded engine: preallocated per-slot buffers and a per-session store.

`SlotCache` holds every layer's keys and values in one tensor `[layers, 2, slots, kv_heads, capacity,
head_dim]`. A decoding request owns one slot; attention reads the slot rows in place and a step writes one
position per row, so nothing is concatenated or rebuilt per step. The capacity (positions per slot) starts
small and doubles on demand up to the model's context, so a CPU engine serving short contexts stays small.

A finished request of a session leaves a copy of its slot (`SessionStore`), which the session's next
request loads into whichever slot it gets.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


class SlotCache:
    """Per-slot key/value buffers of every layer (see the module docstring)."""

    def __init__(
        self,
        *,
        layers: int,
        slots: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        initial_len: int = 256,
    ) -> None:
        self.slots, self.kv_heads, self.head_dim, self.max_len = slots, kv_heads, head_dim, max_len
        self.data = torch.zeros(
            (layers, 2, slots, kv_heads, min(initial_len, max_len), head_dim), dtype=dtype, device=device
        )

    @property
    def capacity(self) -> int:
        return self.data.shape[4]

    def ensure(self, length: int) -> bool:
        """Make room for `length` positions per slot; True when the buffers moved (views taken earlier are stale)."""
        if length <= self.capacity:
            return False
        if length > self.max_len:
            raise ValueError(f"{length} positions exceed the cache's limit of {self.max_len}")
        cap = self.capacity
        while cap < length:
            cap *= 2
        grown = self.data.new_zeros((*self.data.shape[:4], min(cap, self.max_len), self.head_dim))
        grown[:, :, :, :, : self.capacity].copy_(self.data)
        self.data = grown
        return True

    def layer(self, index: int) -> torch.Tensor:
        """Keys and values of layer `index`: `[2, slots, kv_heads, capacity, head_dim]`."""
        return self.data[index]

    def export(self, slot: int, length: int) -> torch.Tensor:
        """A copy of the first `length` positions of `slot`: `[layers, 2, kv_heads, length, head_dim]`."""
        return self.data[:, :, slot, :, :length].clone()

    def load(self, slot: int, kept: torch.Tensor, length: int) -> None:
        """Put the first `length` positions of an exported copy back, into `slot`."""
        self.data[:, :, slot, :, :length].copy_(kept[:, :, :, :length])

    def move(self, src: list[int], dst: list[int], length: int) -> None:
        """Copy the first `length` positions of slots `src` into slots `dst` (pairwise)."""
        if src:
            s = torch.tensor(src, device=self.data.device)
            d = torch.tensor(dst, device=self.data.device)
            self.data[:, :, d, :, :length] = self.data[:, :, s, :, :length]


@dataclass
class SessionEntry:
    """The cached tokens of a session and the KV that covers exactly them (`SlotCache.export`)."""

    tokens: list[int]
    kv: torch.Tensor
    policy: tuple[str, int] | None = (
        None  # (LoRA adapter, its load epoch) the KV was computed under; None: base
    )


class SessionStore:
    """Least-recently-used map of session id to its cache, for reuse on the next turn."""

    def __init__(self, max_sessions: int = 1024) -> None:
        self.max_sessions = max_sessions
        self._entries: OrderedDict[str, SessionEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self, session_id: str, tokens: list[int], kv: torch.Tensor, policy: tuple[str, int] | None = None
    ) -> None:
        self._entries.pop(session_id, None)
        self._entries[session_id] = SessionEntry(tokens, kv, policy)
        while len(self._entries) > self.max_sessions:
            self._entries.popitem(last=False)

    def take(self, session_id: str) -> SessionEntry | None:
        """Remove and return the session's cache (one live request per session owns it)."""
        return self._entries.pop(session_id, None)

    def clear(self) -> None:
        self._entries.clear()


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
