"""The embedded engine's forward pass: a Llama/Qwen-family HF causal LM run over a `SlotCache`.

The HF model's own forward would rebuild a cache object and masks on every call; this runs the same
computation over the model's weights with the cache read and written in place:

* token-major activations `[tokens, hidden]`; q/k/v (and gate/up) as one fused matmul each;
* RoPE from a table computed once by the model's own rotary module (exactly its cos/sin);
* the new keys/values written at each token's (slot, position) with one `index_copy_` per tensor;
* attention by `scaled_dot_product_attention` over the slot rows `[:length]` with an additive mask
  (causal per position, sliding windows per layer); grouped-query heads are folded into the query
  length, so the cache is never expanded. A decode step whose rows' contexts differ widely in length
  can read each group of rows only up to its own longest context (`attention_groups`), as ragged
  attention kernels do, instead of every row up to the batch's longest;
* norms and activations are the model's own modules, so fp32 results match the HF forward.

A decode step is `forward` with one token per row; a prefill passes several (right-padded) and says which
tokens to write and which to return logits for. Nothing in `forward` synchronises with the host, so a decode
step can be captured in a CUDA graph. Every projection goes through `Decoder.linear`: the one place a
per-row adapter (LoRA) would add its term.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from miles.engines.kv import SlotCache

#: `config.model_type`s whose decoder layers this forward reproduces exactly (pre-norm, RoPE, SwiGLU MLP).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModelError(ValueError):
    """The model's architecture is not one the embedded engine's forward pass implements."""


def check_supported(model: Any) -> None:
    """Raise `UnsupportedModelError` (one line naming what is supported) unless `Decoder` can run `model`."""
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"the embedded engine runs {', '.join(SUPPORTED_MODEL_TYPES)} models; "
            f"got model_type {model_type!r}"
        )
    rope = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rope is None or not hasattr(model, "lm_head"):
        raise UnsupportedModelError(f"{type(model).__name__} has no model.rotary_emb or lm_head")
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        missing = [n for n in ("q_proj", "k_proj", "v_proj", "o_proj") if not hasattr(attn, n)]
        missing += [n for n in ("gate_proj", "up_proj", "down_proj", "act_fn") if not hasattr(mlp, n)]
        norms = [layer.input_layernorm, layer.post_attention_layernorm, model.model.norm]
        missing += [
            f"{type(n).__name__}.variance_epsilon" for n in norms if not hasattr(n, "variance_epsilon")
        ]
        if missing:
            raise UnsupportedModelError(f"{type(layer).__name__} lacks {missing}")


#: what reading keys for one more group of rows costs, in rows x positions of padded attention (a gathered copy,
#: one more attention call per layer; measured on the tiny models on a CPU, `benchmarks/ragged_decode.py`)
GROUP_OVERHEAD = 2048
#: a gathered position costs this much more than a position read in place
GATHER_FACTOR = 1.5


@dataclass(frozen=True)
class AttentionGroups:
    """How a decode step's attention reads the cache: every row reads positions `[0, base)` of its slot in
    place, then the rows of each `gathered` group (row indices, length) read `[0, length)` from a gathered
    copy of their slots, replacing their first result."""

    base: int
    gathered: tuple[tuple[tuple[int, ...], int], ...]


def attention_groups(
    lengths: Sequence[int], *, overhead: int = GROUP_OVERHEAD, gather: float = GATHER_FACTOR
) -> AttentionGroups | None:
    """A grouping of decode rows by context length (`AttentionGroups`) that reads fewer positions than one
    call over every row up to the longest context, or None when there is none.

    Rows are classed by their length's power-of-two ceiling; the classes, longest first, are joined into
    consecutive runs by a dynamic programme over the few classes: the last run is read in place by every row,
    the others from gathered copies (positions read times `gather`, plus `overhead` per run).
    """
    n = len(lengths)
    if n < 2:
        return None
    classes: dict[int, list[int]] = {}
    for row, length in enumerate(lengths):
        classes.setdefault(1 << max(5, (length - 1).bit_length()), []).append(row)
    if len(classes) < 2:
        return None
    ordered = [classes[c] for c in sorted(classes, reverse=True)]
    longest = [max(lengths[r] for r in rows) for rows in ordered]
    k = len(ordered)
    best: list[tuple[float, int]] = [(0.0, 0)] + [(float("inf"), 0)] * k  # gathered runs over classes [0, i)
    for end in range(1, k):
        count = 0
        for start in range(end - 1, -1, -1):
            count += len(ordered[start])
            cost = best[start][0] + overhead + gather * count * longest[start]
            if cost < best[end][0]:
                best[end] = (cost, start)
    last = min(range(1, k), key=lambda start: best[start][0] + n * longest[start])
    if best[last][0] + n * longest[last] >= n * longest[0]:
        return None
    gathered, end = [], last
    while end > 0:
        start = best[end][1]
        gathered.append((tuple(r for rows in ordered[start:end] for r in rows), longest[start]))
        end = start
    return AttentionGroups(base=longest[last], gathered=tuple(gathered))


def _sign_half(sin: torch.Tensor) -> torch.Tensor:
    """`sin` with its first half negated: `x * cos + roll(x, d/2) * _sign_half(sin)` is HF's
    `x * cos + rotate_half(x) * sin`, bit for bit (negation is exact)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def _cat_bias(linears: list[torch.nn.Linear]) -> torch.Tensor | None:
    if all(m.bias is None for m in linears):
        return None
    return torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears])


@dataclass(frozen=True)
class _Norm:
    """An HF RMSNorm's weight and epsilon (its forward, `weight * rms_norm(x.float()).to(x.dtype)`, is `rms`)."""

    weight: torch.Tensor
    eps: float

    @classmethod
    def of(cls, module: torch.nn.Module) -> _Norm:
        return cls(module.weight, float(module.variance_epsilon))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


@dataclass
class _Layer:
    input_norm: _Norm
    post_norm: _Norm
    q_norm: _Norm | None
    k_norm: _Norm | None
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: torch.nn.Linear
    gate_up_weight: torch.Tensor
    down_proj: torch.nn.Linear
    act_fn: Any
    scaling: float
    window: int | None


class Decoder:
    """The forward pass of a supported HF causal LM over a `SlotCache` (see the module docstring).

    Built from the model as it is now (device, dtype); call `refresh_weights` after loading new weights into
    the model's parameters, which keeps every buffer (and so any captured CUDA graph) where it is.
    """

    def __init__(self, model: Any) -> None:
        check_supported(model)
        cfg = model.config
        base = model.model
        self.model = model
        self.embed = base.embed_tokens
        self.norm = _Norm.of(base.norm)
        self.lm_head = model.lm_head
        self.num_heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(base.layers[0].self_attn.head_dim)
        self.max_positions = int(cfg.max_position_embeddings)
        weight = self.embed.weight
        self.dtype, self.device = weight.dtype, weight.device
        self.layers: list[_Layer] = []
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            window = (
                getattr(attn, "sliding_window", None)
                if hasattr(attn, "sliding_window")
                else getattr(cfg, "sliding_window", None)
            )
            qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
            self.layers.append(
                _Layer(
                    input_norm=_Norm.of(layer.input_layernorm),
                    post_norm=_Norm.of(layer.post_attention_layernorm),
                    q_norm=_Norm.of(attn.q_norm) if hasattr(attn, "q_norm") else None,
                    k_norm=_Norm.of(attn.k_norm) if hasattr(attn, "k_norm") else None,
                    qkv_weight=torch.cat([m.weight for m in qkv]),
                    qkv_bias=_cat_bias(qkv),
                    o_proj=attn.o_proj,
                    gate_up_weight=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                    down_proj=mlp.down_proj,
                    act_fn=mlp.act_fn,
                    scaling=float(attn.scaling),
                    window=int(window) if window else None,
                )
            )
        self._rotary = base.rotary_emb
        rope_type = str(getattr(self._rotary, "rope_type", "default"))
        self._rope_per_call = (
            "dynamic" in rope_type or "longrope" in rope_type
        )  # cos/sin depend on the length
        if not self._rope_per_call:
            positions = torch.arange(self.max_positions, device=self.device)[None]
            cos, sin = self._rotary(weight[:1], positions)
            self._cos, self._sin = cos[0], _sign_half(sin[0])

    def refresh_weights(self) -> None:
        """Copy the model's current q/k/v and gate/up weights into the fused buffers (in place)."""
        with torch.inference_mode():
            self._refresh()

    def _refresh(self) -> None:
        for layer, hf in zip(self.layers, self.model.model.layers, strict=True):
            attn, mlp = hf.self_attn, hf.mlp
            qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
            torch.cat([m.weight for m in qkv], out=layer.qkv_weight)
            if layer.qkv_bias is not None:
                layer.qkv_bias.copy_(_cat_bias(qkv))
            torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], out=layer.gate_up_weight)

    def new_cache(self, slots: int, max_len: int, *, initial_len: int | None = None) -> SlotCache:
        """A `SlotCache` shaped for this model (`initial_len` positions allocated now; default: the cache's own)."""
        extra = {} if initial_len is None else {"initial_len": initial_len}
        return SlotCache(
            layers=len(self.layers),
            slots=slots,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            max_len=max_len,
            dtype=self.dtype,
            device=self.device,
            **extra,
        )

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Every projection of the forward pass (the hook for per-row adapters)."""
        return F.linear(x, weight, bias)

    def _rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin (see `_sign_half`) at `positions`, `[tokens, head_dim]`."""
        if self._rope_per_call:
            cos, sin = self._rotary(like, positions[None])
            return cos[0], _sign_half(sin[0])
        return self._cos[positions], self._sin[positions]

    def _mask(self, positions: torch.Tensor, length: int, window: int | None) -> torch.Tensor:
        """Additive attention mask `[rows, 1, S * groups, length]` for queries at `positions` ([rows, S])."""
        keys = torch.arange(length, device=positions.device)
        q = positions[:, :, None]
        allowed = keys <= q
        if window is not None:
            allowed &= keys > q - window
        bias = torch.zeros(allowed.shape, dtype=self.dtype, device=positions.device)
        bias.masked_fill_(~allowed, float("-inf"))
        rows, seq = positions.shape
        groups = self.num_heads // self.kv_heads
        if groups > 1 and seq > 1:  # query s*groups+g is head g of position s
            bias = bias[:, :, None].expand(rows, seq, groups, length).reshape(rows, seq * groups, length)
        return bias[:, None]

    def forward(
        self,
        cache: SlotCache,
        ids: torch.Tensor,
        positions: torch.Tensor,
        first_slot: int,
        length: int,
        write: torch.Tensor | None = None,
        last: torch.Tensor | None = None,
        groups: AttentionGroups | None = None,
    ) -> torch.Tensor:
        """Run `ids` ([rows, S], row `r` in slot `first_slot + r`, at `positions`) and return float32 logits.

        The keys/values of every token (or of the flat token indices `write`) go into the cache; attention
        reads positions `[0, length)` of each row's slot, or as `groups` says (`attention_groups`; one token per
        row). Logits come for every token, or for the flat token indices `last`.
        """
        rows, seq = ids.shape
        tokens = rows * seq
        hq, hkv, d = self.num_heads, self.kv_heads, self.head_dim
        per_kv = hq // hkv
        flat_pos = positions.reshape(tokens)
        h = self.embed(ids.reshape(tokens))
        cos, sin = self._rope(flat_pos, h)
        cos, sin = cos[:, None], sin[:, None]
        # where each written token's keys and values go: (key|value, slot, kv head, position) of the cache
        dev = ids.device
        slot = (
            torch.arange(first_slot, first_slot + rows, device=dev)[:, None].expand(rows, seq).reshape(tokens)
        )
        pos = flat_pos
        if write is not None:
            slot, pos = slot[write], pos[write]
        dest = (
            torch.arange(2, device=dev)[:, None],
            slot[:, None, None],
            torch.arange(hkv, device=dev),
            pos[:, None, None],
        )
        masks: dict[Any, torch.Tensor] = {}
        gathered: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (slots, row indices, length) per group
        if groups is not None:
            length = groups.base
            for members, n in groups.gathered:
                indices = torch.tensor(members, device=dev)
                gathered.append((indices + first_slot, indices, n))
        for index, layer in enumerate(self.layers):
            if layer.window not in masks:
                masks[layer.window] = self._mask(positions, length, layer.window)
                for g, (_, members, n) in enumerate(gathered):
                    masks[g, layer.window] = self._mask(positions[members], n, layer.window)
            qkv = self.linear(layer.input_norm(h), layer.qkv_weight, layer.qkv_bias).view(
                tokens, hq + 2 * hkv, d
            )
            qk = qkv[:, : hq + hkv]
            if layer.q_norm is not None:
                qk = torch.cat([layer.q_norm(qk[:, :hq]), layer.k_norm(qk[:, hq:])], dim=1)
            torch.add(
                qk * cos, torch.roll(qk, d // 2, dims=-1) * sin, out=qkv[:, : hq + hkv]
            )  # RoPE in place
            kv = qkv[:, hq:].view(tokens, 2, hkv, d)
            cache.layer(index).index_put_(dest, kv if write is None else kv[write])
            q = (
                qkv[:, :hq]
                .reshape(rows, seq, hkv, per_kv, d)
                .transpose(1, 2)
                .reshape(rows, hkv, seq * per_kv, d)
            )
            keys, values = cache.layer(index)[:, first_slot : first_slot + rows, :, :length]
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=masks[layer.window], scale=layer.scaling
            )
            for g, (slots, members, n) in enumerate(gathered):
                keys, values = cache.layer(index)[:, slots, :, :n]
                out[members] = F.scaled_dot_product_attention(
                    q[members], keys, values, attn_mask=masks[g, layer.window], scale=layer.scaling
                )
            out = out.reshape(rows, hkv, seq, per_kv * d).transpose(1, 2).reshape(tokens, hq * d)
            h = h + self.linear(out, layer.o_proj.weight, layer.o_proj.bias)
            gate, up = self.linear(layer.post_norm(h), layer.gate_up_weight).chunk(2, dim=-1)
            h = h + self.linear(layer.act_fn(gate) * up, layer.down_proj.weight, layer.down_proj.bias)
        if last is not None:
            h = h[last]
        return self.linear(self.norm(h), self.lm_head.weight, self.lm_head.bias).float()
