"""Shared by the LoRA tests: a tiny base and a peft model over it with three adapters of different ranks and
targets (non-zero B, so each differs from the base), and their weights as the engines take them."""

from __future__ import annotations

import copy

import torch

from miles.engines.lora import DEFAULT_TARGET_MODULES, AdapterWeights
from miles.tiny import make_tiny_model

VOCAB = 64
RANKS = {"terse": 4, "verbose": 8, "qv": 2}
TARGETS = {
    "terse": list(DEFAULT_TARGET_MODULES),
    "verbose": list(DEFAULT_TARGET_MODULES),
    "qv": ["q_proj", "v_proj"],
}


def peft_model_with_adapters(vocab: int = VOCAB, size: str = "0.1m"):
    """(base, peft model over a copy of it with the adapters of `RANKS`)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = make_tiny_model(size, vocab_size=vocab, seed=1).eval()
    model = None
    for name, r in RANKS.items():
        cfg = LoraConfig(r=r, lora_alpha=3.0 * r, target_modules=TARGETS[name])
        if model is None:
            model = get_peft_model(copy.deepcopy(base), cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    return base, model.eval()


def adapter_weights(model, name: str) -> AdapterWeights:
    """Adapter `name` of peft model `model` as `AdapterWeights`."""
    from peft import get_peft_model_state_dict

    cfg = model.peft_config[name]
    return AdapterWeights(
        rank=cfg.r,
        alpha=cfg.lora_alpha,
        target_modules=tuple(cfg.target_modules),
        tensors={
            k: v.detach().clone() for k, v in get_peft_model_state_dict(model, adapter_name=name).items()
        },
    )
