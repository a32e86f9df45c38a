"""`LoraBank`: the LoRA adapters an engine serves, applied to rows of one batched forward.

Every adapted linear layer keeps the adapters stacked in slots: `A [S, r_max, in]` and `B [S, out, r_max]`
(the adapter's scaling folded into `B`, ranks below `r_max` zero-padded, slot 0 all zeros: the base). A forward
hook on the layer adds ``B[s] (A[s] x)`` to each row's output, ``s`` being the row's slot, with two batched
matmuls over gathered slots (the BGMV pattern of punica and SGLang's LoRA backends): rows of different adapters
and of the base decode in one forward, at a cost that does not grow with the number of adapters.

The engine calls `select(slots)` (one slot per row of the next forward; `slot_of(name)` gives them), or
`select(None)` when every row is the base, which skips the adapter math entirely.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import nn

from miles.engines.lora import AdapterError, AdapterWeights

BASE_SLOT = 0


@dataclass(frozen=True)
class ServedAdapter:
    """An adapter in the bank: its slot and its version (the version generate calls report)."""

    slot: int
    version: int


class _Layer:
    """The stacked adapters of one linear layer (allocated when an adapter first targets it)."""

    def __init__(self, module: nn.Linear, slots: int, rank: int) -> None:
        w = module.weight
        self.a = torch.zeros((slots, rank, module.in_features), dtype=w.dtype, device=w.device)
        self.b = torch.zeros((slots, module.out_features, rank), dtype=w.dtype, device=w.device)


class LoraBank:
    """Adapters on `model` (an HF causal LM), at most `max_adapters` at once and of rank at most `max_rank`
    (the capacity is fixed, so the stacked tensors never move: a loaded adapter's version replaces the old in
    place). Loading and selecting are not thread-safe with respect to a running forward: the engine calls them
    between forwards (under its model lock)."""

    def __init__(self, model: nn.Module, *, max_adapters: int = 8, max_rank: int = 64) -> None:
        self.model = model
        self.max_adapters, self.max_rank = max_adapters, max_rank
        self._linear = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        self._layers: dict[str, _Layer] = {}
        self._served: dict[str, ServedAdapter] = {}
        self._rows: torch.Tensor | None = None
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- adapters
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
            raise AdapterError(f"no LoRA adapter {name!r} is loaded (loaded: {sorted(self._served) or 'none'})")
        return served.slot

    def load(self, name: str, weights: AdapterWeights, version: int) -> ServedAdapter:
        """Put `weights` in `name`'s slot (a new slot the first time) as version `version`."""
        pairs = weights.modules()
        unknown = sorted(set(pairs) - set(self._linear))
        if unknown:
            raise AdapterError(f"adapter {name!r} targets layers this model does not have: {unknown[:3]}")
        if weights.rank > self.max_rank:
            raise AdapterError(f"adapter {name!r} has rank {weights.rank}, above this engine's max_lora_rank "
                               f"{self.max_rank}")
        for module, (a, b) in pairs.items():
            lin = self._linear[module]
            if a.shape[1] != lin.in_features or b.shape[0] != lin.out_features:
                raise AdapterError(f"adapter {name!r}: {module} is {lin.in_features} -> {lin.out_features}, the "
                                   f"adapter's lora_A/lora_B are {tuple(a.shape)} / {tuple(b.shape)}")
        with self._lock:
            served = self._served.get(name)
            if served is None:
                used = {s.slot for s in self._served.values()}
                free = [s for s in range(1, self.max_adapters + 1) if s not in used]
                if not free:
                    raise AdapterError(f"this engine already serves {self.max_adapters} adapters "
                                       f"({sorted(self._served)}); unload one or start it with more max_loras")
                slot = free[0]
            else:
                slot = served.slot
            self._clear(slot)
            for module, (a, b) in pairs.items():
                layer = self._layer(module)
                r = weights.rank
                layer.a[slot, :r].copy_(a.to(layer.a.dtype))
                layer.b[slot, :, :r].copy_((b.float() * weights.scaling).to(layer.b.dtype))
            self._served[name] = ServedAdapter(slot, int(version))
            return self._served[name]

    def unload(self, name: str) -> None:
        """Free `name`'s slot. Raises `AdapterError` when it is not loaded."""
        with self._lock:
            served = self._served.pop(name, None)
            if served is None:
                raise AdapterError(f"no LoRA adapter {name!r} is loaded (loaded: {sorted(self._served) or 'none'})")
            self._clear(served.slot)

    def _clear(self, slot: int) -> None:
        for layer in self._layers.values():
            layer.a[slot].zero_()
            layer.b[slot].zero_()

    def _layer(self, module: str) -> _Layer:
        layer = self._layers.get(module)
        if layer is None:
            layer = self._layers[module] = _Layer(self._linear[module], self.max_adapters + 1, self.max_rank)
            self._linear[module].register_forward_hook(self._hook(layer))
        return layer

    # ---------------------------------------------------------------- forward
    def select(self, slots: list[int] | None) -> None:
        """The slot of each row of the following forwards (None, or all `BASE_SLOT`: the base alone)."""
        if not slots or not any(slots) or not self._layers:
            self._rows = None
            return
        device = next(iter(self._layers.values())).a.device
        self._rows = torch.tensor(slots, dtype=torch.long, device=device)

    def _hook(self, layer: _Layer):  # noqa: ANN202 - a forward hook
        def add_lora(_: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor | None:
            rows = self._rows
            if rows is None:
                return None
            x = inputs[0]
            flat = x.reshape(x.shape[0], -1, x.shape[-1])  # [B, T, in]
            if flat.shape[0] != rows.shape[0]:
                raise RuntimeError(f"LoRA rows: {rows.shape[0]} slots for a batch of {flat.shape[0]}")
            h = torch.bmm(flat.to(layer.a.dtype), layer.a.index_select(0, rows).transpose(1, 2))
            delta = torch.bmm(h, layer.b.index_select(0, rows).transpose(1, 2))
            return output + delta.reshape(output.shape).to(output.dtype)

        return add_lora
