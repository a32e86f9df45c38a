"""`TokenizerSpec` and `resolve_chat_template`: the names that rebuild a TITO tokenizer, as sessions record them."""

from __future__ import annotations

import hashlib

import pytest

from miles.tiny import compact_chat_template
from miles.tito import ChatTemplateError, TITOTokenizer, TokenizerSpec, resolve_chat_template
from miles.types import Message


def test_resolve_chat_template_names_files_and_errors(tmp_path):
    assert resolve_chat_template(None) is None and resolve_chat_template("") is None
    assert resolve_chat_template("compact") == compact_chat_template()
    custom = tmp_path / "mine.jinja"
    custom.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert resolve_chat_template(str(custom)) == custom.read_text()
    assert "<tool_call>" in resolve_chat_template("chatml-tools") and "ipython" in resolve_chat_template(
        "llama3-tools"
    )
    with pytest.raises(
        ChatTemplateError,
        match=r"^'fancy' is neither a template name \(compact, chatml-tools, "
        r"llama3-tools\) nor a \.jinja file$",
    ):
        resolve_chat_template("fancy")


def test_build_records_the_template_it_used():
    tito = TITOTokenizer.from_spec(TokenizerSpec("tiny", "compact"))
    assert tito.chat_template == compact_chat_template()
    assert tito.spec == TokenizerSpec(
        "tiny", "compact", {}, hashlib.sha256(compact_chat_template().encode()).hexdigest()
    )
    assert TokenizerSpec.from_record(tito.spec.to_record()) == tito.spec
    own = TITOTokenizer.from_spec(TokenizerSpec("tiny"))
    assert own.spec is not None and own.spec.template_sha256 != tito.spec.template_sha256
    tools = [{"type": "function", "function": {"name": "calculate", "parameters": {"type": "object"}}}]
    msgs = [Message("user", "What is 2 + 2?")]
    assert len(tito.render_ids(msgs, tools)) < len(own.render_ids(msgs, tools))  # the compact tool prompt


def test_build_tito_keeps_naming_the_config_key():
    from miles.training.config import ModelConfig
    from miles.training.models import ModelSpecError, build_tito

    assert build_tito(ModelConfig(chat_template="compact")).spec.chat_template == "compact"
    with pytest.raises(
        ModelSpecError,
        match=r"model.chat_template.*'nope' is neither a template name .* nor a "
        r"\.jinja file$",
    ):
        build_tito(ModelConfig(chat_template="nope"))
