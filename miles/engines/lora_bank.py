"""LoRA adapters in the embedded engine's forward pass: `LoraBank` (the adapters, stacked) and `LoraDecoder`
(the engine's `Decoder` with the bank's term added to every projection).

The decoder fuses q/k/v and gate/up into one matmul each; the bank stacks adapters the same way (as SGLang's
`qkv_proj` / `gate_up_proj` LoRA buffers do): for each projection, `A [S, P*R, in]` holds the `lora_A` of its P
parts side by side and `B [S, out, P*R]` their `lora_B` block-diagonally, with the adapter's scaling folded in,
ranks below R zero-padded and slot 0 (the base) all zeros. A token of slot s then gets ``B[s] (A[s] x)``:

* in a decode step replayed by a CUDA graph, by two batched matmuls over the rows' gathered slots (the BGMV
  pattern of punica and SGLang's LoRA backends): rows of any mix of adapters and the base in one forward,
  with no host-side grouping, so one captured graph is right for any mix;
* otherwise (prefills, eager decode steps) from the loaded adapters packed side by side at their largest
  rank: two matmuls over all of them, each row keeping only its own adapter's block in between (one block
  when every row shares an adapter). A gathered matrix pair per row costs several times the base model's
  step on a CPU.

The engine says which adapter each cache slot decodes (`LoraBank.select`). Capacity is fixed when the bank is
made (`max_adapters` of rank at most `max_rank`); the stacked tensors are allocated when the first adapter
loads and never move afterwards, and a new version of an adapter replaces the old in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from miles.engines.decoder import AttentionGroups, Decoder
from miles.engines.lora import AdapterError, AdapterWeights

BASE_SLOT = 0


@dataclass(frozen=True)
class ServedAdapter:
    """An adapter in the bank: its slot, its version (the version generate calls report) and the bank's load
    count when it was loaded (`epoch`: a KV cache computed under an earlier load is never reused)."""

    slot: int
    version: int
    epoch: int


@dataclass
class Projection:
    """One projection of the forward pass: its input size and the model's linear layers it fuses, in order
    (module path, output size); `a` / `b` are the stacked adapters once the bank is allocated."""

    in_features: int
    parts: tuple[tuple[str, int], ...]
    a: torch.Tensor | None = field(default=None, repr=False)
    b: torch.Tensor | None = field(default=None, repr=False)

    @property
    def out_features(self) -> int:
        return sum(n for _, n in self.parts)


class LoraBank:
    """The adapters of one engine over its projections (keyed as the forward pass names them)."""

    def __init__(
        self,
        projections: dict[int, Projection],
        *,
        max_slots: int,
        max_adapters: int = 8,
        max_rank: int = 64,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.projections = projections
        self.max_adapters, self.max_rank = max_adapters, max_rank
        self.dtype, self.device = dtype, torch.device(device)
        self._module = {
            path: (key, i) for key, p in projections.items() for i, (path, _) in enumerate(p.parts)
        }
        self._served: dict[str, ServedAdapter] = {}
        self._ranks: dict[int, int] = {}  # adapter slot -> its rank
        self._packed: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None  # see `_pack`
        self._order: dict[int, int] = {}  # adapter slot -> its place in the packed matrices
        self._loads = 0
        self.rows = torch.zeros(
            max_slots, dtype=torch.long, device=self.device
        )  # adapter slot per cache slot
        self._host = [BASE_SLOT] * max_slots
        self._mixes: dict[tuple[int, int, int], int | torch.Tensor | None] = {}  # see `_mix`

    # ---------------------------------------------------------------- adapters
    @property
    def enabled(self) -> bool:
        """True once an adapter was loaded (the stacked tensors exist)."""
        return any(p.a is not None for p in self.projections.values())

    @property
    def names(self) -> list[str]:
        return list(self._served)

    def get(self, name: str) -> ServedAdapter | None:
        return self._served.get(name)

    def slot_of(self, name: str | None) -> int:
        """The slot of adapter `name` (the base's for None). Raises `AdapterError` naming the loaded ones."""
        if name is None:
            return BASE_SLOT
        served = self._served.get(name)
        if served is None:
            raise AdapterError(
                f"no LoRA adapter {name!r} is loaded (loaded: {sorted(self._served) or 'none'})"
            )
        return served.slot

    def check(self, name: str, weights: AdapterWeights) -> None:
        """Raise `AdapterError` unless `weights` fits this bank (targets, shapes, rank, a free slot)."""
        unknown = sorted(set(weights.modules()) - set(self._module))
        if unknown:
            raise AdapterError(
                f"adapter {name!r} targets layers the engine cannot adapt: {unknown[:3]} (it adapts "
                "the q/k/v/o and gate/up/down projections of each decoder layer)"
            )
        if weights.rank > self.max_rank:
            raise AdapterError(
                f"adapter {name!r} has rank {weights.rank}, above this engine's max_lora_rank {self.max_rank}"
            )
        for module, (a, b) in weights.modules().items():
            key, part = self._module[module]
            proj = self.projections[key]
            if a.shape[1] != proj.in_features or b.shape[0] != proj.parts[part][1]:
                raise AdapterError(
                    f"adapter {name!r}: {module} is {proj.in_features} -> {proj.parts[part][1]}, the "
                    f"adapter's lora_A/lora_B are {tuple(a.shape)} / {tuple(b.shape)}"
                )
        if name not in self._served and len(self._served) >= self.max_adapters:
            raise AdapterError(
                f"this engine already serves {self.max_adapters} adapters ({sorted(self._served)}); "
                "unload one or give the engine a larger max_loras"
            )

    def load(self, name: str, weights: AdapterWeights, version: int) -> ServedAdapter:
        """Put `weights` in `name`'s slot (a free one the first time) as version `version`."""
        self.check(name, weights)
        served = self._served.get(name)
        if served is None:
            used = {s.slot for s in self._served.values()}
            slot = next(s for s in range(1, self.max_adapters + 1) if s not in used)
        else:
            slot = served.slot
        self._allocate()
        self._clear(slot)
        r, rank = weights.rank, self.max_rank
        for module, (a, b) in weights.modules().items():
            key, part = self._module[module]
            proj = self.projections[key]
            offset = sum(n for _, n in proj.parts[:part])
            rows = slice(part * rank, part * rank + r)
            proj.a[slot, rows].copy_(a.to(self.device, self.dtype))
            proj.b[slot, offset : offset + b.shape[0], rows].copy_(
                (b.float() * weights.scaling).to(self.device, self.dtype)
            )
        self._loads += 1
        self._served[name] = ServedAdapter(slot, int(version), self._loads)
        self._ranks[slot] = r
        self._packed, self._mixes = None, {}
        return self._served[name]

    def unload(self, name: str) -> None:
        """Free `name`'s slot. Raises `AdapterError` when it is not loaded."""
        served = self._served.pop(name, None)
        if served is None:
            raise AdapterError(
                f"no LoRA adapter {name!r} is loaded (loaded: {sorted(self._served) or 'none'})"
            )
        self._clear(served.slot)
        self._ranks.pop(served.slot, None)
        self._packed, self._mixes = None, {}

    def _allocate(self) -> None:
        slots, rank = self.max_adapters + 1, self.max_rank
        for p in self.projections.values():
            if p.a is None:
                p.a = torch.zeros(
                    (slots, len(p.parts) * rank, p.in_features), dtype=self.dtype, device=self.device
                )
                p.b = torch.zeros(
                    (slots, p.out_features, len(p.parts) * rank), dtype=self.dtype, device=self.device
                )

    def _clear(self, slot: int) -> None:
        for p in self.projections.values():
            p.a[slot].zero_()
            p.b[slot].zero_()

    # ---------------------------------------------------------------- forward
    def select(self, slots: Sequence[int]) -> None:
        """The adapter slot of cache slots `0 .. len(slots)-1` (the rest: the base), for the next forwards."""
        host = list(slots) + [BASE_SLOT] * (len(self._host) - len(slots))
        if host != self._host:
            self._host, self._mixes = host, {}
            self.rows.copy_(torch.tensor(host, dtype=torch.long))

    def any_adapter(self, first_slot: int, rows: int) -> bool:
        """True when a row in cache slots `first_slot ..` (`rows` of them) decodes under an adapter."""
        return any(self._host[first_slot : first_slot + rows])

    def delta(
        self, key: int, x: torch.Tensor, first_slot: int, rows: int, seq: int, *, gathered: bool = False
    ) -> torch.Tensor | None:
        """The adapters' term for projection `key` of input `x` (`[rows * seq, in]`, token-major, row r in
        cache slot `first_slot + r`), or None for a projection no adapter targets.

        With `gathered` (decode steps only: one token per row) every row gathers its slot's matrices for two
        batched matmuls, with no host-side work (what a captured CUDA graph needs). Otherwise the loaded
        adapters are packed side by side at their largest rank (`_pack`): rows of one adapter take its block of
        the packed matrices, and a mix of adapters (and the base) takes two matmuls over all of them, each row
        keeping only its own adapter's block in between.
        """
        proj = self.projections.get(key)
        if proj is None or proj.a is None:
            return None
        if gathered and seq == 1:
            idx = self.rows[first_slot : first_slot + rows]
            h = torch.bmm(x.unsqueeze(1), proj.a.index_select(0, idx).transpose(1, 2))
            return torch.bmm(h, proj.b.index_select(0, idx).transpose(1, 2)).squeeze(1)
        mix = self._mix(first_slot, rows, seq)
        if mix is None:
            return None
        a, b = self._packed[key]
        width = a.shape[0] // len(self._order)
        if isinstance(mix, int):  # every row under one adapter: its block only
            return F.linear(
                F.linear(x, a[mix * width : (mix + 1) * width]), b[:, mix * width : (mix + 1) * width]
            )
        h = F.linear(x, a).view(-1, len(self._order), width) * mix[:, :, None]
        return F.linear(h.view(-1, a.shape[0]), b)

    def _mix(self, first_slot: int, rows: int, seq: int) -> int | torch.Tensor | None:
        """How the rows of a forward take the packed adapters, worked out once per forward (not per projection):
        None when no row has an adapter, the packed block of the one adapter all rows share, or else a
        `[rows * seq, n]` mask keeping each token's own adapter's block."""
        call = (first_slot, rows, seq)
        if call in self._mixes:
            return self._mixes[call]
        slots = self._host[first_slot : first_slot + rows]
        present = set(slots)
        mix: int | torch.Tensor | None = None
        if present != {BASE_SLOT} and self._ranks:
            if self._packed is None:
                self._pack()
            if len(present) == 1:
                mix = self._order[slots[0]]
            else:
                place = torch.tensor([self._order.get(slot, -1) for slot in slots])
                mix = (place[:, None] == torch.arange(len(self._order))).to(
                    device=self.device, dtype=self.dtype
                )
                if seq > 1:
                    mix = mix.repeat_interleave(seq, dim=0)
        if len(self._mixes) >= 64:  # prefills of many lengths under one row layout
            self._mixes.clear()
        self._mixes[call] = mix
        return mix

    def _pack(self) -> None:
        """For every projection, the loaded adapters side by side at the largest loaded rank r: ``a [n*P*r, in]``
        (each adapter's P parts' `lora_A`) and ``b [out, n*P*r]`` (their `lora_B`, scaled)."""
        slots = sorted(self._ranks)
        self._order = {slot: j for j, slot in enumerate(slots)}
        r = max(self._ranks.values(), default=1)
        packed = {}
        for key, p in self.projections.items():
            parts, rank = len(p.parts), self.max_rank
            a = p.a[slots].view(len(slots), parts, rank, p.in_features)[:, :, :r]
            b = p.b[slots].view(len(slots), p.out_features, parts, rank)[..., :r]
            packed[key] = (
                a.reshape(-1, p.in_features).contiguous(),
                b.permute(1, 0, 2, 3).reshape(p.out_features, -1).contiguous(),
            )
        self._packed = packed


def decoder_projections(decoder: Decoder, model: Any) -> dict[int, Projection]:
    """The projections of `decoder`'s forward pass, keyed by the id of the weight tensor it passes to
    `Decoder.linear`, with the model's linear layers each one fuses."""
    out: dict[int, Projection] = {}
    for i, (layer, hf) in enumerate(zip(decoder.layers, model.model.layers, strict=True)):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"

        def parts(prefix: str, owner: Any, names: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
            return tuple((f"{prefix}.{n}", getattr(owner, n).out_features) for n in names)

        out[id(layer.qkv_weight)] = Projection(
            hf.self_attn.q_proj.in_features, parts(attn, hf.self_attn, ("q_proj", "k_proj", "v_proj"))
        )
        out[id(layer.o_proj.weight)] = Projection(
            hf.self_attn.o_proj.in_features, parts(attn, hf.self_attn, ("o_proj",))
        )
        out[id(layer.gate_up_weight)] = Projection(
            hf.mlp.gate_proj.in_features, parts(mlp, hf.mlp, ("gate_proj", "up_proj"))
        )
        out[id(layer.down_proj.weight)] = Projection(
            hf.mlp.down_proj.in_features, parts(mlp, hf.mlp, ("down_proj",))
        )
    return out


class LoraDecoder(Decoder):
    """`Decoder` whose projections add each row's adapter term (`bank`). Rows of the base only, or a bank with
    no adapter yet, run the plain forward; with `static` (CUDA graphs) the adapter math runs for every forward
    once an adapter was loaded, so that a captured step is right for any mix of rows."""

    def __init__(
        self, model: Any, *, max_slots: int, max_adapters: int = 8, max_rank: int = 64, static: bool = False
    ) -> None:
        super().__init__(model)
        self.static = static
        self.bank = LoraBank(
            decoder_projections(self, model),
            max_slots=max_slots,
            max_adapters=max_adapters,
            max_rank=max_rank,
            dtype=self.dtype,
            device=self.device,
        )
        self._call: tuple[int, int, int] | None = None

    def forward(
        self,
        cache: Any,
        ids: torch.Tensor,
        positions: torch.Tensor,
        first_slot: int,
        length: int,
        write: torch.Tensor | None = None,
        last: torch.Tensor | None = None,
        groups: AttentionGroups | None = None,
    ) -> torch.Tensor:
        rows, seq = ids.shape
        use = self.bank.enabled and (self.static or self.bank.any_adapter(first_slot, rows))
        self._call = (first_slot, rows, seq) if use else None
        try:
            return super().forward(
                cache, ids, positions, first_slot, length, write=write, last=last, groups=groups
            )
        finally:
            self._call = None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = F.linear(x, weight, bias)
        if self._call is None:
            return out
        delta = self.bank.delta(id(weight), x, *self._call, gathered=self.static)
        return out if delta is None else out + delta
