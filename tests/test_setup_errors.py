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


def train(out: Path, *sets: str) -> int:
    """`miles train` of the calculator example into `out`, in this process, with `--set` overrides."""
    return main(
        ["train", "--config", MAIN_JOB, "--output-dir", str(out), *(x for s in sets for x in ("--set", s))]
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--config", "/no/such/config.yaml"], "cannot read the config file '/no/such/config.yaml'"),
        (
            ["--config", MAIN_JOB, "--set", "model.init_from=null", "--set", "model.name=gpt-17"],
            "model.name: 'gpt-17'",
        ),
        (["--config", MAIN_JOB, "--set", "model.tokenizer=nosuch"], "model.tokenizer: 'nosuch'"),
        (
            ["--config", MAIN_JOB, "--set", "model.init_from=/no/such/folder"],
            "model.init_from: '/no/such/folder'",
        ),
        (["--config", MAIN_JOB, "--set", "model.chat_template=/no/such.jinja"], "model.chat_template"),
        (
            ["--config", MAIN_JOB, "--set", "model.chat_template=llama3-tools"],
            "model.chat_template: the chat template is a llama3 template, but the tokenizer lacks its turn-closing token",
        ),
        (["--config", MAIN_JOB, "--set", "env.id=Calculatr-v0"], "env.id"),
        (
            ["--config", MAIN_JOB, "--set", "engine.kv_cache_fraction=1.5"],
            "engine.kv_cache_fraction: must be in (0, 1]",
        ),
        (["--config", MAIN_JOB, "--set", "engine.device=cuda:99"], "engine.device: 'cuda:99'"),
        (["--config", MAIN_JOB, "--set", "torch.device=cuda:99"], "torch.device: 'cuda:99'"),
        (
            ["--config", MAIN_JOB, "--set", "rollout.scheduler.session.parser=hermess"],
            "unknown tool-call parser 'hermess'; registered: ['hermes'",
        ),
        (
            ["--config", MAIN_JOB, "--set", "max_seconds=-1"],
            "max_seconds: must be > 0 (or null for no budget)",
        ),
        (["--config", MAIN_JOB, "--set", "eval.num_tasks=0"], "eval.num_tasks: must be >= 1, got 0"),
        (["--config", MAIN_JOB, "--seed", str(2**70)], "seed: must be in [0, 2**63)"),
    ],
)
def test_setup_mistakes_are_one_line(args, expected, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["train", *args, "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err and "Traceback" not in err, err
    assert not (tmp_path / "run" / "sessions.jsonl").exists()


@pytest.mark.parametrize("template", ["llama3-tools", "nosuch"])
def test_tito_check_of_a_template_that_does_not_fit_is_one_line(template, capsys):
    assert main(["tito", "check", "--tokenizer", "tiny", "--chat-template", template]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("miles tito: config error: --chat-template: "), err


@pytest.mark.parametrize(
    ("output_dir", "expected"),
    [
        ("", "output_dir: is empty"),
        (".", "a run needs a folder of its own"),
        ("/", "a run needs a folder of its own"),
        ("/dev/null", "is under a system folder"),
        ("/proc/self/run", "is under a system folder"),
    ],
)
def test_output_dirs_that_cannot_hold_a_run_are_one_line(output_dir, expected, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", MAIN_JOB, "--output-dir", output_dir]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_kv_cache_fraction_that_holds_nothing_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert (
        main(
            [
                "train",
                "--config",
                MAIN_JOB,
                "--set",
                "engine.kv_cache_fraction=0.0000000000001",
                "--output-dir",
                str(tmp_path / "run"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err  # after the warm start's loading bar, which transformers prints
    assert "Traceback" not in err
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith("miles train: config error: engine.kv_cache_fraction: 1e-13 of ")
        and "raise it or lower max_batch_size" in err
    )
    assert not (tmp_path / "run" / "sessions.jsonl").exists()


def test_a_yaml_syntax_error_names_the_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 3\nenv: {id: [Calculator-v0\n")
    assert main(["sft", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "is not valid YAML at line 3" in err and err.count("\n") == 1


@pytest.mark.parametrize("ranks", [[], ["--dp", "2"]], ids=["one-process", "dp2"])
def test_the_console_script_prints_no_traceback(ranks, tmp_path):
    """With `--dp 2` too: the mistake is found before torchrun starts any rank."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "miles.cli",
            "train",
            "--config",
            MAIN_JOB,
            "--set",
            "model.init_from=relative/warm-start",
            "--output-dir",
            str(tmp_path / "r"),
            *ranks,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"miles train: config error: model.init_from: 'relative/warm-start' is not a folder (relative paths "
        f"start at the working directory, {tmp_path}); give the warm start's folder"
    ]


def test_the_calculator_example_on_a_kv_cache_sized_from_a_memory_fraction_ends_long_sessions_context_full(
    tmp_path, monkeypatch
):
    """`engine.kv_cache_fraction` bounds the embedded engine's context to what fits: sessions that outgrow it end
    `context_full` (a named reason) instead of failing in the engine, and the run goes on."""
    import json
    import os

    from transformers import AutoConfig

    monkeypatch.chdir(REPO)
    cfg = AutoConfig.from_pretrained(REPO / "checkpoints" / "calculator-sft-1m")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_position = (
        cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 4 * 64
    )  # float32, 64 slots
    fraction = 60.5 * per_position / (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--config",
                MAIN_JOB,
                "--output-dir",
                str(out),
                "--set",
                "steps=2",
                "--set",
                "max_seconds=null",
                "--set",
                "eval.num_tasks=8",
                "--set",
                f"engine.kv_cache_fraction={fraction:.20f}",
            ]
        )
        == 0
    )
    ends = [json.loads(line)["termination"] for line in (out / "sessions.jsonl").read_text().splitlines()]
    assert "context_full" in ends and "engine_error" not in ends, ends


def test_a_rank_that_fails_under_torchrun_is_one_line_after_its_own_output(tmp_path):
    """`miles train --dp/--tp` runs its ranks under `miles.training.torchrun`: torchrun without its traceback."""
    from miles.training.torchrun import torchrun_command

    script = tmp_path / "rank.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1':\n    sys.exit('rank 1: the real error')\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.run(torchrun_command([str(script)], 2), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "rank 1: the real error",
        "miles: rank 1 exited with status 1 (its own output is above)",
    ], proc.stderr


@pytest.mark.parametrize("ranks", [[], ["--dp", "2"]], ids=["one-process", "dp2"])
def test_a_folder_that_holds_a_run_is_one_line_before_any_rank_starts(ranks, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"kind": "train", "step": 0, "time": 0}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "miles.cli", "train", "--config", MAIN_JOB, "--output-dir", str(out), *ranks],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"miles train: config error: output_dir: {str(out)!r} already holds a run (metrics.jsonl); continue it with "
        "--resume, or give another --output-dir (or remove the folder)"
    ], proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "metrics.jsonl"
    ]  # no lock, no config written: no rank ran


def test_a_folder_left_by_a_run_that_stopped_at_setup_is_reused_with_a_word(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("seed: 0\n")
    (out / "metrics.jsonl").write_text("")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "miles.cli",
            "train",
            "--config",
            MAIN_JOB,
            "--output-dir",
            str(out),
            "--set",
            f"model.init_from={tmp_path / 'no-such-checkpoint'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.stdout.splitlines()[0] == (
        f"[train] {out} holds no recorded run, only config.yaml, metrics.jsonl; "
        "the new run starts there and replaces them"
    ), proc.stdout
    assert (
        proc.returncode == 2 and "model.init_from" in proc.stderr
    )  # a later setup error ends it: no training


def test_torchrun_s_agent_is_silent_also_through_loggers_it_creates_later():
    """The launcher mutes torchrun's agent (a failed rank is one line of miles'), including loggers created
    after the muting with levels of their own (the rendezvous backends are imported during the run)."""
    code = (
        "import logging\n"
        "from miles.training.torchrun import mute_launcher_logs\n"
        "mute_launcher_logs()\n"
        "later = logging.getLogger('torch.distributed.elastic.rendezvous.later')\n"
        "later.setLevel(logging.WARNING)\n"
        "later.warning('a notice')\n"
        "logging.getLogger('torch.distributed.run.later').error('a failure')\n"
        "logging.getLogger('miles.x').warning('kept')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "kept\n", proc.stderr


def test_a_binary_config_file_is_one_line(tmp_path, capsys):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    assert main(["train", "--config", str(binary)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a text file" in err


def test_conflicting_seeds_name_each_other(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert (
        main(
            [
                "train",
                "--config",
                MAIN_JOB,
                "--seed",
                "3",
                "--set",
                "rollout.scheduler.seed=7",
                "--output-dir",
                str(tmp_path / "run"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--seed: " in err and "--set rollout.scheduler.seed=7" in err


def test_oversampling_trains_the_first_groups_and_records_the_dropped_ones(tmp_path, monkeypatch):
    """`rollout.scheduler.oversample_groups` in the synchronous loop: each step starts that many extra groups,
    trains the first `tasks_per_step` to finish and aborts (and records) the rest; where every group runs to the
    end anyway (agents, adapters) the key is refused."""
    import json

    from miles.sessions.recorder import read_sessions

    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    sets = (
        "steps=2",
        "rollout.tasks_per_step=2",
        "rollout.scheduler.oversample_groups=2",
        "eval.num_tasks=2",
    )
    assert train(out, *sets) == 0
    records = read_sessions(out / "sessions.jsonl").records
    groups = {r.group_id for r in records}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["sessions"] for r in rows if r["kind"] == "train"] == [16, 16]  # 2 groups of 8 trained per step
    assert len(groups) > 4  # extra groups started, and their sessions are in the file (done or aborted)
    assert train(tmp_path / "r2", "rollout.scheduler.oversample_groups=1", "rollout.agent.command=true") == 2


def test_a_step_that_runs_out_of_memory_is_one_line_naming_the_keys(tmp_path, capsys, monkeypatch):
    """A CUDA out-of-memory in the update (as a too-large micro-batch on a shared GPU gives) ends the run with one
    line naming the keys that make a step smaller, exit 1, not a traceback."""
    import torch

    from miles.learner.torch_backend import TorchTrainer

    def full(self, batch):
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 45.00 GiB. GPU 0 has a total capacity"
        )

    monkeypatch.setattr(TorchTrainer, "train_step", full)
    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    assert train(out, "steps=2", "rollout.tasks_per_step=2", "eval.num_tasks=2") == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith("miles train: out of memory (CUDA out of memory); "), (
        err
    )
    assert "trainer.micro_batch_tokens (65536)" in last and "engine.kv_cache_fraction" in last, err


def test_an_engine_that_fails_every_decode_step_makes_the_start_evaluation_no_score_naming_the_error(
    tmp_path, capsys, monkeypatch
):
    """An engine whose every decode step fails (as a KV cache that cannot grow on a full GPU does) leaves the start
    evaluation without a score: the run ends broken (exit 3) with one line that names the first failure."""
    import torch

    from miles.engines.embedded import EmbeddedEngine

    def full(self):
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 45.00 GiB. GPU 0 has a total capacity"
        )

    monkeypatch.setattr(EmbeddedEngine, "_step", full)
    monkeypatch.chdir(REPO)
    assert train(tmp_path / "run", "steps=2", "rollout.tasks_per_step=2", "eval.num_tasks=2") == 3
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(
        "miles train: the run is broken: the start evaluation (greedy) is no score: 2 of 2 "
    )
    assert (
        "; the first: EngineError: " in last
        and "decode step failed: OutOfMemoryError('CUDA out of memory" in last
    )
