"""Megatron model building, HF <-> Megatron conversion and the CPU compatibility layer (single process)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import transformers

from miles.learner.megatron import compat
from miles.learner.megatron.convert import ConversionError, hf_to_megatron, megatron_to_hf
from miles.learner.megatron.model import UnsupportedModelError, layout_from_hf, pad_vocab_size

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")


def make_hf(family: str, *, heads: int = 4, kv: int = 2, tied: bool = False, vocab: int = 300):
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        tie_word_embeddings=tied,
        rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
    )
    torch.manual_seed(0)
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()
    if family == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=24)).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()


@pytest.mark.parametrize(
    "family,heads,kv,tp", [("qwen2", 4, 2, 2), ("qwen3", 8, 4, 4), ("llama", 4, 4, 2), ("qwen2", 6, 2, 1)]
)
def test_conversion_round_trip_is_bit_identical(family, heads, kv, tp):
    hf = make_hf(family, heads=heads, kv=kv)
    sd = hf.state_dict()
    layout = layout_from_hf(hf.config, tp_size=tp, vocab_divisible_by=64)
    stages = [[0], [1]]  # two pipeline stages, one layer each
    merged: dict[str, torch.Tensor] = {}
    for p, layers in enumerate(stages):
        shards = [
            hf_to_megatron(
                sd, layout, tp_size=tp, tp_rank=r, layers=layers, first_stage=p == 0, last_stage=p == 1
            )
            for r in range(tp)
        ]
        assert (
            shards[0]["embedding.word_embeddings.weight" if p == 0 else "output_layer.weight"].shape[0]
            == layout.padded_vocab_size // tp
        )
        merged.update(megatron_to_hf(shards, layout, layers=layers))
    assert sorted(merged) == sorted(sd)
    for name, t in sd.items():
        assert torch.equal(merged[name], t), name


def test_qkv_shards_hold_whole_query_groups():
    hf = make_hf("qwen2", heads=4, kv=2)
    sd = hf.state_dict()
    layout = layout_from_hf(hf.config, tp_size=2)
    d = layout.head_dim
    shard1 = hf_to_megatron(sd, layout, tp_size=2, tp_rank=1)[
        "decoder.layers.0.self_attention.linear_qkv.weight"
    ]
    q, k, v = (sd[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    # rank 1 holds query group 1: its two query heads, then its key head, then its value head
    expected = torch.cat([q[2 * d : 4 * d], k[d : 2 * d], v[d : 2 * d]])
    assert torch.equal(shard1, expected)


def test_bad_configs_and_checkpoints_raise_named_errors():
    with pytest.raises(UnsupportedModelError, match="model_type"):
        layout_from_hf(transformers.GPT2Config())
    with pytest.raises(UnsupportedModelError, match="divisible"):
        layout_from_hf(make_hf("llama", heads=4, kv=2).config, tp_size=4)
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        layout_from_hf(transformers.LlamaConfig(attention_bias=True))
    cfg = make_hf("llama").config
    cfg.rope_parameters = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    with pytest.raises(UnsupportedModelError, match="rope_type"):
        layout_from_hf(cfg)
    hf = make_hf("llama")
    sd = dict(hf.state_dict())
    del sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ConversionError, match="up_proj"):
        hf_to_megatron(sd, layout_from_hf(hf.config))
    assert pad_vocab_size(300, 2, 128) == 512 and pad_vocab_size(256, 2, 128) == 256


@pytest.fixture(scope="module")
def megatron_single_process():
    """World size 1 over gloo, with the CPU layer active only for the duration of this module's tests."""
    from megatron.core import parallel_state as ps

    from miles.learner.megatron.parallel import initialize_parallel

    real_cuda = torch.Tensor.cuda
    with compat.cpu_compat() as active:
        assert active and compat.cpu_compat_active()
        assert torch.Tensor.cuda is not real_cuda
        initialize_parallel(1, 1, seed=0)
        yield
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    assert torch.Tensor.cuda is real_cuda and not compat.cpu_compat_active()
    import megatron.core.transformer.utils as mutils

    assert mutils.torch is torch


@pytest.mark.parametrize("family,tied", [("qwen2", True), ("qwen3", False), ("llama", False)])
@pytest.mark.parametrize("attention", ["sdpa", "local"])
def test_gpt_model_matches_hf_logits(megatron_single_process, family, tied, attention):
    from megatron.core.packed_seq_params import PackedSeqParams

    from miles.learner.megatron.model import build_gpt_model, transformer_config

    hf = make_hf(family, tied=tied)
    layout = layout_from_hf(hf.config)
    model = build_gpt_model(layout, transformer_config(layout), attention=attention).eval()
    model.load_state_dict(hf_to_megatron(hf.state_dict(), layout), strict=False)
    ids = torch.randint(0, 300, (1, 21), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
        out = model(ids, torch.arange(21).unsqueeze(0), None)
        assert out.shape == (1, 21, layout.padded_vocab_size)
        torch.testing.assert_close(out[..., :300], ref, rtol=1e-5, atol=1e-5)
        if attention == "sdpa":  # two sequences packed into one row restart RoPE and attention
            cu = torch.tensor([0, 13, 21], dtype=torch.int32)
            packed = PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=13, max_seqlen_kv=13
            )
            out = model(ids, None, None, packed_seq_params=packed)[0, :, :300]
            torch.testing.assert_close(out[:13], hf(ids[:, :13]).logits[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out[13:], hf(ids[:, 13:]).logits[0], rtol=1e-5, atol=1e-5)


def test_tp1_in_process_train_step_matches_torch_backend(megatron_single_process):
    from tests.learner.megatron.test_parallel import assert_same_step, megatron_step

    roundtrip, metrics, weights, dp = megatron_step("qwen3", 1, 1, "ppo")
    assert dp == 1
    assert_same_step({"roundtrip": roundtrip, "metrics": metrics}, weights, "qwen3")


@pytest.mark.parametrize("family,tied", [("qwen2", True), ("llama", False)])
def test_fused_head_logprobs_match_the_model_logits(megatron_single_process, family, tied):
    """The output layer bypassed, its weight applied chunk by chunk: same logprobs, entropies and gradients
    as log_softmax over the model's own (padded-vocabulary) logits."""
    from miles.learner.logprobs import shifted_entropy, shifted_token_logprobs
    from miles.learner.megatron.logprobs import final_hidden_states, head_logprobs
    from miles.learner.megatron.model import build_gpt_model, transformer_config

    hf = make_hf(family, tied=tied)
    layout = layout_from_hf(hf.config)
    assert layout.padded_vocab_size > 300  # padded rows exist and must get no probability
    model = build_gpt_model(layout, transformer_config(layout), attention="sdpa")
    model.load_state_dict(hf_to_megatron(hf.state_dict(), layout), strict=False)
    ids = torch.randint(0, 300, (1, 19), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(19).unsqueeze(0)
    starts = torch.tensor([0])
    grads = []
    for fused in (True, False):
        model.zero_grad(set_to_none=True)
        if fused:
            with final_hidden_states(model) as hidden:
                out = model(ids, positions, None)
            assert out.numel() == 0 and len(hidden) == 1  # no logits were formed
            lp, ent = head_logprobs(model, hidden[0], ids[0], starts, 300, 0.7, entropy=True)
        else:
            logits = model(ids, positions, None)[0, :, :300]
            lp, ent = (
                shifted_token_logprobs(logits, ids[0], starts, 0.7),
                shifted_entropy(logits, starts, 0.7),
            )
        (lp.sum() + 0.3 * ent.sum()).backward()
        grads.append((lp.detach(), ent.detach(), *(p.grad.clone() for p in model.parameters())))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not model.output_layer._forward_pre_hooks  # the bypass ends with the forward


def test_cpu_rng_tracker_forks_and_restores():
    tracker = compat.CpuRNGStatesTracker()
    tracker.add("a", 123)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        x = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)
    with tracker.fork("a"):
        y = torch.rand(3)
    assert not torch.equal(x, y)  # the named state advanced
    torch.manual_seed(123)
    assert torch.equal(x, torch.rand(3))
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("b", 123)
    with pytest.raises(ValueError, match="not added"), tracker.fork("missing"):
        pass


def test_torchrun_launch_helpers(monkeypatch):
    from miles.training import torchrun as launch

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert not launch.in_torchrun_worker()
    cmd = launch.torchrun_command(["-m", "miles.cli", "train", "--tp", "2"], 2, master_port=29999)
    assert cmd[1:] == [
        "-m",
        "miles.training.torchrun",
        "--master-port=29999",
        "--nproc-per-node",
        "2",
        "-m",
        "miles.cli",
        "train",
        "--tp",
        "2",
    ]
    assert launch.relaunch_under_torchrun(1, ["train"]) is None  # one rank: stay in-process
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert launch.in_torchrun_worker() and launch.relaunch_under_torchrun(2, ["train"]) is None
    with pytest.raises(ValueError, match="nproc_per_node"):
        launch.torchrun_command(["x.py"], 0)
