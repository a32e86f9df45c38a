"""LoraDecoder: rows of different adapters (and the base) in one prefill and one decode step give the logits
peft gives for each row (peft's own mixed-adapter batch inference is the reference); the bank refuses adapters
that do not fit, and a new version replaces the old in its slot."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles.engines.lora import AdapterError, AdapterWeights
from miles.engines.lora_bank import LoraDecoder
from miles.tiny import make_tiny_model
from tests.support.lora import RANKS, VOCAB, adapter_weights, peft_model_with_adapters

BASE = "__base__"  # peft's name for "no adapter" in adapter_names


@pytest.fixture(scope="module", params=[False, True], ids=["grouped", "gathered"])
def served(request):
    """`static=True` decodes as a captured CUDA graph does (each row gathers its slot's matrices); eager steps
    and every prefill group the rows by adapter."""
    base, peft_model = peft_model_with_adapters()
    decoder = LoraDecoder(copy.deepcopy(base), max_slots=6, max_adapters=4, max_rank=8, static=request.param)
    for version, name in enumerate(RANKS):
        decoder.bank.load(name, adapter_weights(peft_model, name), version)
    return peft_model, decoder


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.sampled_from([BASE, *RANKS]), min_size=1, max_size=6), seed=st.integers(0, 99))
def test_mixed_rows_prefill_and_decode_as_peft(served, rows, seed):
    peft_model, decoder = served
    n, prompt = len(rows), 6
    ids = torch.randint(0, VOCAB, (n, prompt + 1), generator=torch.Generator().manual_seed(seed))
    decoder.bank.select([decoder.bank.slot_of(None if r == BASE else r) for r in rows])
    cache = decoder.new_cache(6, 32)
    with torch.inference_mode():
        expect = peft_model(input_ids=ids, adapter_names=rows).logits  # peft's mixed-adapter batch inference
        positions = torch.arange(prompt).repeat(n, 1)
        last = torch.arange(n) * prompt + prompt - 1
        prefill = decoder.forward(cache, ids[:, :prompt], positions, 0, prompt, last=last)
        step = decoder.forward(cache, ids[:, prompt:], torch.full((n, 1), prompt), 0, prompt + 1)
    assert torch.allclose(prefill, expect[:, prompt - 1], atol=1e-5), float(
        (prefill - expect[:, prompt - 1]).abs().max()
    )
    assert torch.allclose(step, expect[:, prompt], atol=1e-5), float((step - expect[:, prompt]).abs().max())


def test_base_rows_run_the_plain_forward(served):
    peft_model, decoder = served
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    decoder.bank.select([0, 0])
    assert not decoder.bank.any_adapter(0, 2)
    with torch.inference_mode(), peft_model.disable_adapter():
        expect = peft_model(input_ids=ids).logits[:, -1]
    with torch.inference_mode():
        got = decoder.forward(
            decoder.new_cache(2, 8), ids, torch.arange(5).repeat(2, 1), 0, 5, last=torch.tensor([4, 9])
        )
    assert torch.allclose(got, expect, atol=1e-5)


def test_a_new_version_replaces_the_old_in_its_slot_and_unload_frees_it():
    base, peft_model = peft_model_with_adapters()
    bank = LoraDecoder(copy.deepcopy(base), max_slots=2, max_adapters=1, max_rank=8).bank
    first = bank.load("terse", adapter_weights(peft_model, "terse"), 0)
    again = bank.load(
        "terse", adapter_weights(peft_model, "qv"), 1
    )  # another rank and other targets, same slot
    assert (first.slot, again.slot, again.version) == (1, 1, 1)
    qkv = next(p for p in bank.projections.values() if p.parts[0][0].endswith("layers.0.self_attn.q_proj"))
    assert float(qkv.a[1, 8:16].abs().sum()) == 0.0  # the old version's k_proj rows are gone
    with pytest.raises(AdapterError, match="already serves 1 adapters"):
        bank.load("verbose", adapter_weights(peft_model, "verbose"), 0)
    bank.unload("terse")
    assert bank.load("verbose", adapter_weights(peft_model, "verbose"), 0).slot == 1
    with pytest.raises(AdapterError, match=r"no LoRA adapter 'terse' is loaded \(loaded: \['verbose'\]\)"):
        bank.slot_of("terse")


def test_adapters_that_do_not_fit_are_refused_by_name():
    base, peft_model = peft_model_with_adapters()
    bank = LoraDecoder(copy.deepcopy(base), max_slots=2, max_adapters=4, max_rank=4).bank
    with pytest.raises(AdapterError, match="rank 8, above"):
        bank.load("verbose", adapter_weights(peft_model, "verbose"), 0)
    other = LoraDecoder(make_tiny_model("1m", vocab_size=VOCAB), max_slots=2).bank
    with pytest.raises(AdapterError, match="q_proj is 128 -> 128"):
        other.load("terse", adapter_weights(peft_model, "terse"), 0)
    weights = adapter_weights(peft_model, "terse")
    renamed = {k.replace("self_attn.q_proj", "self_attn.rotary"): v for k, v in weights.tensors.items()}
    with pytest.raises(AdapterError, match="cannot adapt"):
        bank.load("terse", AdapterWeights(rank=4, alpha=12.0, target_modules=("rotary",), tensors=renamed), 0)
