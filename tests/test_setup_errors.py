"""Every setup mistake of `miles train` / `miles sft` is one line naming the key and the fix, exit status 2,
no traceback, and nothing is trained."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from miles.cli import main

REPO = Path(__file__).resolve().parents[1]
MAIN_JOB = str(REPO / "configs" / "calculator.yaml")


@pytest.mark.parametrize(("args", "expected"), [
    (["--config", "/no/such/config.yaml"], "cannot read the config file '/no/such/config.yaml'"),
    (["--config", MAIN_JOB, "--set", "model.init_from=null", "--set", "model.name=gpt-17"], "model.name: 'gpt-17'"),
    (["--config", MAIN_JOB, "--set", "model.tokenizer=nosuch"], "model.tokenizer: 'nosuch'"),
    (["--config", MAIN_JOB, "--set", "model.init_from=/no/such/folder"], "model.init_from: '/no/such/folder'"),
    (["--config", MAIN_JOB, "--set", "model.chat_template=/no/such.jinja"], "model.chat_template"),
    (["--config", MAIN_JOB, "--set", "env.id=Calculatr-v0"], "env.id"),
])
def test_setup_mistakes_are_one_line(args, expected, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["train", *args, "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err and "Traceback" not in err, err
    assert not (tmp_path / "run" / "sessions.jsonl").exists()


def test_a_yaml_syntax_error_names_the_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 3\nenv: {id: [Calculator-v0\n")
    assert main(["sft", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "is not valid YAML at line 3" in err and err.count("\n") == 1


def test_the_console_script_prints_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "miles.cli", "train", "--config", MAIN_JOB, "--set",
                           "model.init_from=relative/warm-start", "--output-dir", str(tmp_path / "r")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"miles train: config error: model.init_from: 'relative/warm-start' is not a folder (relative paths "
        f"start at the working directory, {tmp_path}); give the warm start's folder"]
