"""KV-cache plumbing for the embedded engine: a left-padded batch of rows and a per-session store.

A row's cache is a list, one `(keys, values)` pair per layer, each `[1, kv_heads, length, head_dim]`.
The batch keeps all rows left-padded to one length `P` with a `[B, P]` validity mask, so a decode step
is one forward call; rows join and leave between steps.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

RowKV = list[tuple[torch.Tensor, torch.Tensor]]


def _left_pad(t: torch.Tensor, total: int) -> torch.Tensor:
    missing = total - t.shape[2]
    if missing == 0:
        return t
    pad = t.new_zeros((t.shape[0], t.shape[1], missing, t.shape[3]))
    return torch.cat([pad, t], dim=2)


class BatchKV:
    """Left-padded KV of the rows that decode together."""

    def __init__(self) -> None:
        self.layers: RowKV = []
        self.mask: torch.Tensor | None = None  # [B, P], 1 where a cache slot holds a real token
        self.lengths: list[int] = []  # valid tokens per row

    @property
    def size(self) -> int:
        return len(self.lengths)

    @property
    def padded_len(self) -> int:
        return 0 if self.mask is None else self.mask.shape[1]

    def add(self, rows: list[tuple[RowKV, int]]) -> None:
        """Append rows given as (row cache, valid length); the row cache holds exactly that many tokens."""
        if not rows:
            return
        total = max([self.padded_len] + [n for _, n in rows])
        device = rows[0][0][0][0].device
        masks = [] if self.mask is None else [_left_pad_mask(self.mask, total)]
        for _, n in rows:
            masks.append(_left_pad_mask(torch.ones((1, n), dtype=torch.long, device=device), total))
        new_layers = []
        for li in range(len(rows[0][0])):
            ks = [] if not self.layers else [_left_pad(self.layers[li][0], total)]
            vs = [] if not self.layers else [_left_pad(self.layers[li][1], total)]
            for row, _ in rows:
                ks.append(_left_pad(row[li][0], total))
                vs.append(_left_pad(row[li][1], total))
            new_layers.append((torch.cat(ks, dim=0), torch.cat(vs, dim=0)))
        self.layers = new_layers
        self.mask = torch.cat(masks, dim=0)
        self.lengths.extend(n for _, n in rows)

    def row(self, index: int) -> RowKV:
        """The valid part of row `index`'s cache, as a standalone row cache."""
        n = self.lengths[index]
        p = self.padded_len
        return [(k[index:index + 1, :, p - n:].clone(), v[index:index + 1, :, p - n:].clone())
                for k, v in self.layers]

    def keep(self, indices: list[int]) -> None:
        """Drop every row not in `indices` (kept in that order) and trim all-padding columns."""
        if not indices:
            self.layers, self.mask, self.lengths = [], None, []
            return
        if indices == list(range(self.size)):
            return
        self.lengths = [self.lengths[i] for i in indices]
        start = self.padded_len - max(self.lengths)
        idx = torch.tensor(indices, device=self.mask.device)
        self.layers = [(k.index_select(0, idx)[:, :, start:], v.index_select(0, idx)[:, :, start:])
                       for k, v in self.layers]
        self.mask = self.mask.index_select(0, idx)[:, start:]

    def advanced(self, layers: RowKV) -> None:
        """Record the caches after one decode step that appended one token to every row."""
        self.layers = layers
        ones = torch.ones((self.size, 1), dtype=self.mask.dtype, device=self.mask.device)
        self.mask = torch.cat([self.mask, ones], dim=1)
        self.lengths = [n + 1 for n in self.lengths]


def _left_pad_mask(mask: torch.Tensor, total: int) -> torch.Tensor:
    missing = total - mask.shape[1]
    if missing == 0:
        return mask
    return torch.cat([mask.new_zeros((mask.shape[0], missing)), mask], dim=1)


@dataclass
class SessionEntry:
    """The cached tokens of a session and the KV that covers exactly them."""

    tokens: list[int]
    kv: RowKV


class SessionStore:
    """Least-recently-used map of session id to its cache, for reuse on the next turn."""

    def __init__(self, max_sessions: int = 1024) -> None:
        self.max_sessions = max_sessions
        self._entries: OrderedDict[str, SessionEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, session_id: str, tokens: list[int], kv: RowKV) -> None:
        self._entries.pop(session_id, None)
        self._entries[session_id] = SessionEntry(tokens, kv)
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


def crop(kv: RowKV, length: int) -> RowKV:
    return [(k[:, :, :length], v[:, :, :length]) for k, v in kv]
