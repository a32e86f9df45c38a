"""The tiny model kit: deterministic shipped tokenizer, its chat template, and tiny Qwen2 checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, Qwen2ForCausalLM

from miles.tiny import (
    TINY_SIZES,
    UnknownTinySizeError,
    count_parameters,
    load_tiny_tokenizer,
    make_tiny_model,
    train_tiny_tokenizer,
)
from miles.tiny.corpus import DATA_DIR
from miles.tiny.tokenizer import TOKENIZER_FILES

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def tok():
    return load_tiny_tokenizer()


def test_retraining_reproduces_committed_files_bit_for_bit(tmp_path):
    train_tiny_tokenizer(tmp_path)
    for name in TOKENIZER_FILES:
        assert (tmp_path / name).read_bytes() == (DATA_DIR / name).read_bytes(), name


def test_training_is_identical_across_processes(tmp_path):
    code = "import sys; from miles.tiny import train_tiny_tokenizer; train_tiny_tokenizer(sys.argv[1])"
    subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        check=True,
        env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"},
    )
    assert (tmp_path / "tokenizer.json").read_bytes() == (DATA_DIR / "tokenizer.json").read_bytes()


def test_special_tokens_and_vocab(tok):
    assert 1000 <= len(tok) <= 4096
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    for t in (
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
    ):
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1, (t, ids)
    assert tok.encode("<|im_start|>user", add_special_tokens=False)[0] == tok.convert_tokens_to_ids(
        "<|im_start|>"
    )


@given(st.integers(min_value=0, max_value=10**12))
@settings(max_examples=100, deadline=None)
def test_digits_are_split_individually(n):
    tok = load_tiny_tokenizer()
    text = f"x = {n} + {n * 7}"
    pieces = [tok.decode([i]) for i in tok.encode(text, add_special_tokens=False)]
    digit_pieces = [p for p in pieces if any(c.isdigit() for c in p)]
    assert all(len(p) == 1 for p in digit_pieces), pieces
    assert "".join(digit_pieces) == f"{n}{n * 7}"


@given(st.text(max_size=200))
@settings(max_examples=150, deadline=None)
def test_byte_level_round_trip(text):
    tok = load_tiny_tokenizer()
    import unicodedata

    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == unicodedata.normalize("NFC", text)


def test_loads_as_plain_hf_folder():
    hf = AutoTokenizer.from_pretrained(str(DATA_DIR))
    ours = load_tiny_tokenizer()
    text = "What is 37 + 58 * 2?"
    assert hf.encode(text, add_special_tokens=False) == ours.encode(text, add_special_tokens=False)
    assert hf.chat_template == ours.chat_template


def test_template_renders_tools_calls_and_responses(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3 and 4 * 5?"},
        {
            "role": "assistant",
            "content": "Let me compute.",
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "calculate", "arguments": {"expression": "2 + 3"}},
                },
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "calculate", "arguments": '{"expression": "4 * 5"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "5"},
        {"role": "tool", "tool_call_id": "call_1", "content": "20"},
        {"role": "assistant", "content": "5 and 20."},
    ]
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>" in text
    assert (
        "<|im_start|>assistant\nLet me compute.\n<tool_call>\n"
        '{"name": "calculate", "arguments": {"expression": "2 + 3"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "calculate", "arguments": {"expression": "4 * 5"}}\n</tool_call><|im_end|>\n'
    ) in text
    # consecutive tool results share one user turn
    assert (
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n20\n</tool_response>"
        "<|im_end|>\n"
    ) in text
    assert text.endswith("<|im_start|>assistant\n5 and 20.<|im_end|>\n<|im_start|>assistant\n")


def test_template_without_tools_or_system(tok):
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    call_only = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}],
        },
    ]
    text = tok.apply_chat_template(call_only, tokenize=False)
    assert text.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n'
    )


def test_sizes_span_the_promised_range():
    counts = {size: count_parameters(make_tiny_model(size)) for size in ("0.1m", "1m", "3m")}
    assert 50_000 <= counts["0.1m"] <= 200_000
    assert 0.5e6 <= counts["1m"] <= 2e6
    assert 2e6 <= counts["3m"] <= 4e6
    assert list(TINY_SIZES) == ["0.1m", "1m", "3m", "10m", "25m"]


def test_largest_size_config_without_building():
    from miles.tiny import tiny_config

    cfg = tiny_config("25m")
    emb = cfg.vocab_size * cfg.hidden_size
    head = cfg.hidden_size // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * head
    layer = (
        cfg.hidden_size * cfg.hidden_size * 2
        + cfg.hidden_size * kv * 2
        + cfg.hidden_size
        + 2 * kv
        + 3 * cfg.hidden_size * cfg.intermediate_size
        + 2 * cfg.hidden_size
    )
    total = emb + cfg.num_hidden_layers * layer + cfg.hidden_size
    assert 20e6 <= total <= 30e6


def test_unknown_size_is_a_named_error():
    with pytest.raises(UnknownTinySizeError, match="7b"):
        make_tiny_model("7b")


def test_seed_determinism_and_rng_untouched():
    torch.manual_seed(1)
    before = torch.get_rng_state()
    a, b, c = (
        make_tiny_model("0.1m", seed=3),
        make_tiny_model("0.1m", seed=3),
        make_tiny_model("0.1m", seed=4),
    )
    assert torch.equal(torch.get_rng_state(), before)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_save_pretrained_round_trip(tmp_path, tok):
    model = make_tiny_model("0.1m", seed=5).eval()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = Qwen2ForCausalLM.from_pretrained(tmp_path).eval()
    loaded_tok = AutoTokenizer.from_pretrained(tmp_path)
    ids = torch.tensor(
        [
            tok.apply_chat_template(
                [{"role": "user", "content": "What is 12 + 7?"}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        ]
    )
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert loaded.config.eos_token_id == tok.eos_token_id
    assert loaded_tok.encode("a 12", add_special_tokens=False) == tok.encode("a 12", add_special_tokens=False)
    assert loaded_tok.chat_template == tok.chat_template


def test_model_generates_within_vocab(tok):
    model = make_tiny_model("0.1m").eval()
    assert model.config.vocab_size == len(tok)
    ids = torch.tensor([[tok.convert_tokens_to_ids("<|im_start|>")]])
    out = model.generate(ids, max_new_tokens=6, do_sample=True, attention_mask=torch.ones_like(ids))
    assert out.shape[1] > 1 and int(out.max()) < len(tok)


def test_compact_template_shows_signatures_and_renders_turns_like_the_default():
    from miles.tiny import compact_chat_template
    from miles.tito import TITOTokenizer
    from miles.types import Message, ToolCall

    tools = [
        {
            "type": "function",
            "function": {
                "name": "calculate",
                "description": "d",
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string"}},
                    "required": ["expression"],
                },
            },
        }
    ]
    msgs = [
        Message("user", "What is 1 + 2?"),
        Message("assistant", tool_calls=[ToolCall("calculate", {"expression": "1 + 2"}, id="call_0")]),
        Message("tool", "3", tool_call_id="call_0", name="calculate"),
        Message("assistant", "The answer is 3."),
    ]
    tok = load_tiny_tokenizer()
    compact = TITOTokenizer(tok, chat_template=compact_chat_template())
    default = TITOTokenizer(tok)
    assert compact.family == "tiny"
    text = compact.render_text(msgs, tools)
    assert text.startswith("<|im_start|>system\n<tools>calculate(expression)</tools><|im_end|>\n")
    assert (
        text.split("<|im_end|>\n", 1)[1]
        == default.render_text(msgs, tools).split("</tool_call><|im_end|>\n", 1)[1]
    )
