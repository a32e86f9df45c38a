"""bf16 training with float32 master weights: the model computes in bf16, the optimizer steps float32 copies.

`MasterWeights` keeps a float32 copy of every trainable parameter of a module whose parameters are bf16.
After each backward, `accumulate_grads` adds the bf16 gradients into float32 gradients on the copies (so
gradient accumulation over micro-batches happens in float32); the optimizer and gradient clipping work on the
copies; `copy_to_model` rounds the updated copies back into the bf16 parameters.
"""

from __future__ import annotations

import torch
from torch import nn


class MasterWeights:
    """float32 masters of ``params`` (the bf16 trainable parameters of a model, in a fixed order)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.masters = [nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in params]

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """Move the parameters' gradients into the masters' float32 gradients (added to any already there)."""
        fresh, into, add = [], [], []
        for p, m in zip(self.params, self.masters, strict=True):
            if p.grad is None:
                continue
            if m.grad is None:
                fresh.append((p, m))
            else:
                into.append(m.grad)
                add.append(p.grad)
        for p, m in fresh:
            m.grad = p.grad.to(torch.float32)
        if into:
            torch._foreach_add_(into, add)
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the masters into the model's parameters (after an optimizer step or a load)."""
        torch._foreach_copy_(self.params, self.masters)

    @torch.no_grad()
    def load(self, values: list[torch.Tensor]) -> None:
        """Set the masters to ``values`` (float32, one per parameter) and the model's parameters from them."""
        for m, v in zip(self.masters, values, strict=True):
            m.copy_(v)
        self.copy_to_model()
