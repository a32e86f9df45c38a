"""LoraBank: rows of different adapters in one forward give what peft gives for each (peft's own mixed-adapter
batch inference is the reference), and the bank refuses adapters that do not fit."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles.engines.lora import AdapterError, AdapterWeights
from miles.engines.lora_bank import LoraBank
from miles.tiny import make_tiny_model

VOCAB = 64
RANKS = {"terse": 4, "verbose": 8, "qv": 2}
TARGETS = {"terse": None, "verbose": None, "qv": ["q_proj", "v_proj"]}


def _peft_model():
    """A peft model with three adapters of different ranks and targets, all with non-zero B."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = make_tiny_model("0.1m", vocab_size=VOCAB, seed=1)
    model = None
    for name, r in RANKS.items():
        cfg = LoraConfig(r=r, lora_alpha=3.0 * r, target_modules=TARGETS[name] or
                         ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        if model is None:
            model = get_peft_model(copy.deepcopy(base), cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    return base, model.eval()


def _weights(model, name: str) -> AdapterWeights:
    from peft import get_peft_model_state_dict

    cfg = model.peft_config[name]
    return AdapterWeights(rank=cfg.r, alpha=cfg.lora_alpha, target_modules=tuple(cfg.target_modules),
                          tensors=get_peft_model_state_dict(model, adapter_name=name))


@pytest.fixture(scope="module")
def models():
    base, peft_model = _peft_model()
    served = copy.deepcopy(base).eval()
    bank = LoraBank(served, max_adapters=4, max_rank=8)
    for version, name in enumerate(RANKS):
        bank.load(name, _weights(peft_model, name), version)
    return peft_model, served, bank


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.sampled_from(["__base__", *RANKS]), min_size=1, max_size=5), seed=st.integers(0, 99))
def test_mixed_rows_in_one_forward_match_peft(models, rows, seed):
    peft_model, served, bank = models
    ids = torch.randint(0, VOCAB, (len(rows), 7), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        expect = peft_model(input_ids=ids, adapter_names=rows).logits  # peft's mixed-adapter batch inference
        bank.select([bank.slot_of(None if r == "__base__" else r) for r in rows])
        got = served(input_ids=ids).logits
        bank.select(None)
    assert torch.allclose(got, expect, atol=1e-5), float((got - expect).abs().max())


def test_all_base_rows_skip_the_adapters(models):
    peft_model, served, bank = models
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), peft_model.disable_adapter():
        expect = peft_model(input_ids=ids).logits
    bank.select([0, 0])
    assert bank._rows is None
    with torch.no_grad():
        assert torch.allclose(served(input_ids=ids).logits, expect, atol=1e-6)


def test_a_new_version_replaces_the_old_in_its_slot_and_unload_frees_it():
    base, peft_model = _peft_model()
    bank = LoraBank(copy.deepcopy(base).eval(), max_adapters=1, max_rank=8)
    first = bank.load("terse", _weights(peft_model, "terse"), 0)
    again = bank.load("terse", _weights(peft_model, "verbose"), 1)  # another rank and targets, same slot
    assert (first.slot, again.slot, again.version) == (1, 1, 1)
    with pytest.raises(AdapterError, match="already serves 1 adapters"):
        bank.load("qv", _weights(peft_model, "qv"), 0)
    bank.unload("terse")
    assert bank.load("qv", _weights(peft_model, "qv"), 0).slot == 1
    with pytest.raises(AdapterError, match=r"no LoRA adapter 'terse' is loaded \(loaded: \['qv'\]\)"):
        bank.slot_of("terse")


def test_adapters_that_do_not_fit_are_refused_by_name():
    base, peft_model = _peft_model()
    bank = LoraBank(copy.deepcopy(base).eval(), max_adapters=4, max_rank=4)
    with pytest.raises(AdapterError, match="rank 8, above"):
        bank.load("verbose", _weights(peft_model, "verbose"), 0)
    other = make_tiny_model("1m", vocab_size=VOCAB)
    with pytest.raises(AdapterError, match="q_proj is 128 -> 128"):
        LoraBank(other).load("terse", _weights(peft_model, "terse"), 0)
