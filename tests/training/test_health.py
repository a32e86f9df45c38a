"""A run says when it is not learning: every step counts its sessions by termination, tool calls and
unparsable calls, and after `health.no_signal_steps` steps without one group of differing rewards the run
stops with a one-line diagnosis and exit status 3 (or goes on with `health.on_no_signal: continue`)."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from miles.cli import main
from miles.sessions.records import ErrorInfo
from miles.training.health import HealthConfig, RunHealth, StepActivity, diagnose
from miles.training.metrics_log import read_metrics

REPO = Path(__file__).resolve().parents[2]
MAIN_JOB = str(REPO / "configs" / "calculator.yaml")


def _activity(
    sessions: int = 8,
    *,
    informative: int = 0,
    calls: int = 8,
    failures: int = 0,
    ends: dict[str, int] | None = None,
    rewards: tuple[float, ...] = (0.0,),
) -> StepActivity:
    return StepActivity(
        sessions=sessions,
        groups=2,
        informative_groups=informative,
        tool_calls=calls,
        parse_failures=failures,
        terminations=ends or {"done": sessions},
        rewards=frozenset(rewards),
        has_tools=True,
    )


def test_each_cause_of_no_signal_is_named():
    assert "no session finished" in diagnose([_activity(0, ends={})])
    assert "6 of 8 sessions ended engine_error" in diagnose([_activity(ends={"engine_error": 6, "done": 2})])
    assert "8 of 8 sessions ended env_error" in diagnose([_activity(ends={"env_error": 8})])
    assert "no session called a tool" in diagnose([_activity(calls=0)])
    assert "5 of 8 tool calls could not be parsed" in diagnose([_activity(failures=5)])
    text = diagnose([_activity(rewards=(0.0,)), _activity(rewards=(1.0,))])
    assert text.startswith("nothing trained in 2 steps: every group's samples got the same reward (0, 1)")


@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 6))
def test_the_watch_fires_exactly_when_n_steps_in_a_row_had_no_signal(informative, limit):
    health = RunHealth(HealthConfig(no_signal_steps=limit), warn=lambda line: None)
    run = 0
    for n in informative:
        run = 0 if n else run + 1
        verdict = health.observe(_activity(informative=n))
        assert (verdict is not None) == (run == limit), (informative, limit)
        assert verdict is None or verdict.stop


def test_steps_the_policy_solves_are_no_sign_of_a_broken_run():
    """Late in a good run every group may score 1 (all sessions succeed): that is a solved task, not a stuck one,
    and it never stops the run; steps that all fail still do."""
    health = RunHealth(HealthConfig(no_signal_steps=3), warn=lambda line: None)
    solved = StepActivity(
        sessions=8,
        groups=2,
        informative_groups=0,
        tool_calls=8,
        parse_failures=0,
        rewards=frozenset({1.0}),
        has_tools=True,
        successes=8,
    )
    assert [health.observe(solved) for _ in range(10)] == [None] * 10
    failed = _activity(informative=0)
    verdicts = [health.observe(failed) for _ in range(3)]
    assert verdicts[:2] == [None, None] and verdicts[2].stop


def test_the_first_env_error_of_each_kind_is_one_warning():
    lines: list[str] = []
    health = RunHealth(HealthConfig(), warn=lines.append)
    err = ErrorInfo("step", "KeyError", "'flights'\nmore")
    for _ in range(3):
        health.observe(
            StepActivity(
                sessions=1,
                groups=1,
                informative_groups=1,
                tool_calls=0,
                parse_failures=0,
                env_errors=(("train-s7", err),),
            )
        )
    assert lines == [
        "[warn] session train-s7 ended env_error in step: KeyError: 'flights' (later ones are counted "
        "in env_error_sessions)"
    ]


def test_engines_failing_five_steps_in_a_row_stop_the_run_and_a_good_step_resets_the_count():
    health = RunHealth(HealthConfig(), warn=lambda line: None)
    dead = _activity(8, informative=1, ends={"engine_error": 7, "done": 1})
    verdicts = [
        health.observe(a) for a in [dead] * 4 + [_activity(informative=1)] + [dead] * 4 + [_activity(0)]
    ]
    assert verdicts[:-1] == [None] * 9
    assert verdicts[-1].stop and verdicts[-1].reason.startswith(
        "the engines failed 5 steps in a row (last step: 0 of 0 sessions"
    )


def test_updates_skipped_for_a_nonfinite_gradient_three_times_in_a_row_stop_the_run():
    health = RunHealth(HealthConfig(), warn=lambda line: None)
    nan = {"optimizer_steps": 1.0, "nonfinite_steps": 1.0, "loss": float("nan"), "grad_norm": float("nan")}
    ok = {"optimizer_steps": 1.0, "nonfinite_steps": 0.0}
    rows = [nan, nan, ok, nan, nan, nan]
    verdicts = [health.observe(_activity(informative=1), row) for row in rows]
    assert verdicts[:5] == [None] * 5 and verdicts[5].stop
    assert verdicts[5].reason.startswith(
        "the update was NaN or inf in 3 steps in a row (loss nan, grad norm nan)"
    )


def _untrained(tmp_path: Path, *extra: str) -> list[str]:
    """The calculator example on a fresh (untrained) 0.1m model: no session ever earns a reward."""
    return [
        "train",
        "--config",
        MAIN_JOB,
        "--output-dir",
        str(tmp_path / "run"),
        "--set",
        "model.init_from=null",
        "--set",
        "model.size=0.1m",
        "--set",
        "steps=6",
        "--set",
        "rollout.tasks_per_step=2",
        "--set",
        "eval.num_tasks=4",
        "--set",
        "health.no_signal_steps=3",
        *extra,
    ]


def test_a_run_that_never_learns_stops_with_exit_3_and_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(_untrained(tmp_path)) == 3
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith(
        "miles train: the run is broken: nothing trained in 3 steps: "
    )
    assert "held-out success" not in out and "RL gain" not in out  # no score
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps_done"] == 3 and summary["broken"].startswith("nothing trained in 3 steps")
    assert "final" not in summary["evals"]
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["informative_groups"] for r in rows] == [0.0, 0.0, 0.0]
    assert all(r["generated_tokens"] > 0 and r["trained_sessions"] == 0 for r in rows)  # every session counts
    assert all(r["done_sessions"] + r["max_turns_sessions"] == r["sessions"] == 16 for r in rows)


def test_on_no_signal_continue_reports_once_and_runs_every_step(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(_untrained(tmp_path, "--set", "health.on_no_signal=continue")) == 0
    out = capsys.readouterr().out
    assert out.count("[health] nothing trained in 3 steps") == 1 and "Going on" in out
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps_done"] == 6


def test_the_calculator_example_does_not_stop(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert (
        main(
            [
                "train",
                "--config",
                MAIN_JOB,
                "--output-dir",
                str(tmp_path / "run"),
                "--set",
                "steps=4",
                "--set",
                "eval.num_tasks=4",
                "--set",
                "health.no_signal_steps=2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "[health]" not in out and "RL gain (greedy)" in out
    assert "tool calls/session" in out and "trained " in out


def test_sft_shows_progress_and_ends_within_the_runs_budget_with_its_weights_saved(
    tmp_path, capsys, monkeypatch
):
    """`miles sft` prints its steps, loss and ETA as it goes, stops at the run's `max_seconds` (its own
    `sft.max_seconds` unset, 1,000 epochs asked for) and still syncs and saves what it trained."""
    monkeypatch.chdir(REPO)
    save_to = tmp_path / "warm"
    assert (
        main(
            [
                "sft",
                "--config",
                str(REPO / "configs" / "calculator_sft.yaml"),
                "--output-dir",
                str(tmp_path / "run"),
                "--set",
                "max_seconds=6",
                "--set",
                "sft.num_demos=64",
                "--set",
                "sft.epochs=1000",
                "--set",
                "sft.target_success=null",
                "--set",
                f"sft.save_to={save_to}",
                "--set",
                "eval.num_tasks=4",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "[sft] building 64 oracle demonstrations" in out and "steps of 32 within " in out
    progress = [line for line in out.splitlines() if line.startswith("[sft] step ")]
    assert progress and all(" loss " in line and " ETA " in line and "/2000 " in line for line in progress)
    assert "(ended by its budget of " in out and f"saved to {save_to}" in out
    assert (save_to / "config.json").is_file() and any(save_to.glob("*.safetensors"))
    assert "after SFT" in out  # the table of `miles sft`: held-out success of the saved weights


def test_sigterm_checkpoints_and_says_the_run_was_stopped(tmp_path):
    """`miles train` handles SIGTERM like Ctrl-C: the step in flight is abandoned, the last finished step is
    checkpointed, and the run ends with one line (exit 128 + 15), no score; `--resume` goes on from there."""
    import signal
    import subprocess
    import sys

    out = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "miles.cli",
        "train",
        "--config",
        MAIN_JOB,
        "--output-dir",
        str(out),
        "--set",
        "eval.num_tasks=4",
        "--set",
        "steps=1000",
        "--set",
        "rollout.tasks_per_step=2",
    ]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("[step 3/"):
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM
    last = err.strip().splitlines()[-1]
    assert last.startswith("miles train: stopped by SIGTERM after step ") and "continue with --resume" in last
    summary = json.loads((out / "summary.json").read_text())
    step = summary["steps_done"]
    assert summary["stopped"] == "SIGTERM" and step >= 3 and "final" not in summary["evals"]
    assert (out / "checkpoints" / f"step_{step:08d}").is_dir()
