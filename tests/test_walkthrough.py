"""The README's walk-throughs, run as written: "Train your own environment" and "A stateful env, from SFT to an
external agent". Their files are copied into an empty folder outside the repository, then their commands run
there through the console script (`miles sft`, `miles train`, `miles replay --check`, an external agent)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from miles.sessions.recorder import read_sessions
from miles.sessions.replay import is_agent_record

REPO = Path(__file__).resolve().parents[1]
WALKTHROUGH = REPO / "docs" / "walkthrough"


def _section(heading: str = "## Train your own environment") -> str:
    readme = (REPO / "README.md").read_text()
    start = readme.index(heading)
    return readme[start : readme.index("\n## ", start + 1)]


def _commands(section: str) -> list[str]:
    """The lines of the section's (first) bash block."""
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1).strip().splitlines()


def _run_commands(commands: list[str], files: list[str], folder: Path) -> list[str]:
    """Copy `files` from docs/walkthrough into `folder`, run each command there as a shell would (no PYTHONPATH,
    one torch thread), assert each exits 0, and return their outputs."""
    for name in files:
        shutil.copy(WALKTHROUGH / name, folder / name)
    assert shutil.which("miles") is not None, "the `miles` console script is not installed"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    outputs = []
    for command in commands:
        proc = subprocess.run(
            command, shell=True, cwd=folder, capture_output=True, text=True, timeout=600, env=env
        )
        failures = [line for line in proc.stdout.splitlines() if "DIVERGED" in line or "MISALIGNED" in line]
        assert proc.returncode == 0, (command, failures[:5], proc.stdout[-2000:], proc.stderr[-2000:])
        outputs.append(proc.stdout)
    return outputs


def _checked(output: str, what: str) -> list[str]:
    """The session ids a `miles replay` output reports as passing `what` ("check" or "tito"), sorted."""
    return sorted(re.findall(rf"^(\S+): {what} ok", output, re.M))


def test_the_readme_shows_both_files_verbatim():
    section = _section()
    assert "```python\n" + (WALKTHROUGH / "bank_env.py").read_text() + "```" in section
    assert "```yaml\n" + (WALKTHROUGH / "bank.yaml").read_text() + "```" in section


@pytest.mark.slow
def test_the_walkthrough_commands_train_then_replay_with_every_session_checked(tmp_path):
    commands = _commands(_section())
    assert [c.split()[:2] for c in commands] == [["miles", "train"], ["miles", "replay"]]
    outputs = _run_commands(commands, ["bank_env.py", "bank.yaml"], tmp_path)
    records = read_sessions(tmp_path / "runs" / "bank" / "sessions.jsonl").records
    assert records and {r.env_id for r in records} == {"Bank-v0"}
    assert _checked(outputs[1], "check") == sorted(r.session_id for r in records)


AIRLINE = "## A stateful env, from SFT to an external agent"
AIRLINE_FILES = ["airline_env.py", "airline.yaml", "airline_agent.py"]


def test_the_airline_walkthrough_shows_its_config_and_agent_verbatim():
    section = _section(AIRLINE)
    assert "```yaml\n" + (WALKTHROUGH / "airline.yaml").read_text() + "```" in section
    assert "```python\n" + (WALKTHROUGH / "airline_agent.py").read_text() + "```" in section
    for name in AIRLINE_FILES:
        assert f"(docs/walkthrough/{name})" in section


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_airline_walkthrough_runs_env_sft_rl_replay_and_an_agent_on_the_env_tools(tmp_path):
    """Every command of the section, as written: the env through gymnasium with its oracle, SFT on the oracle's
    demonstrations, GRPO from the SFT checkpoint, an external agent on the `openai` client that runs the env's
    tools through the session's route; each run's every session is recorded once and passes `miles replay
    --check --tito`, and the agent's sessions hold tool results that the env's route gave."""
    commands = _commands(_section(AIRLINE))
    assert [c.split()[:2] for c in commands] == [
        ["python", "airline_env.py"],
        ["miles", "sft"],
        ["miles", "train"],
        ["miles", "replay"],
        ["miles", "train"],
        ["miles", "replay"],
    ]
    assert "rollout.agent.command" in commands[4]
    outputs = _run_commands(commands, AIRLINE_FILES, tmp_path)
    reward, rule = outputs[0].splitlines()
    assert reward == "1.0"  # the oracle solves the episode gymnasium.make gave
    assert rule.startswith("Error: tool 'change_flight'") and rule in " ".join(_section(AIRLINE).split())
    assert (tmp_path / "checkpoints" / "airline-sft" / "model.safetensors").is_file()
    assert re.search(r"\[sft\] 256 oracle demos, \d+ steps .*saved to checkpoints/airline-sft", outputs[1])
    for run, replay in (("airline", outputs[3]), ("airline-agent", outputs[5])):
        records = read_sessions(tmp_path / "runs" / run / "sessions.jsonl").records
        ids = [r.session_id for r in records]
        assert len(ids) == 2 * 2 * 4 and len(set(ids)) == len(ids), ids  # steps x tasks x group, each once
        assert {r.env_id for r in records} == {"Airline-v0"}
        assert _checked(replay, "check") == sorted(ids) and _checked(replay, "tito") == sorted(ids), replay
        agents = run == "airline-agent"
        assert all(is_agent_record(r) for r in records) == agents
        assert replay.count("an agent's session: the env's tool results and reward") == (
            len(ids) if agents else 0
        )
    env_results = [x for r in records for t in r.turns for x in t.tool_results if x.get("env")]
    assert env_results, "no agent session ran a tool through POST /sessions/{id}/tools/{name}"
    assert {x["name"] for x in env_results} <= {
        "search_flights",
        "get_booking",
        "change_flight",
        "cancel_booking",
    }


def test_sessions_of_the_python_api_replay_from_the_users_folder(tmp_path):
    """The README's `SessionScheduler` driven from a user's script with an env factory (no recipe), for an env
    whose tasks come with its registration: the records name the env's class, and the `miles replay --check`
    console script, run from the same folder, imports the user's module, finds the registered env with its
    tasks, and re-checks every session."""
    import sys

    (tmp_path / "weather_env.py").write_text(
        textwrap.dedent("""\
        from miles.envs import ToolEnv, register, reward
        from miles.tools import tool


        class WeatherEnv(ToolEnv):
            @tool
            def get_temperature(self, city: str) -> int:
                \"\"\"Current temperature in degrees Celsius in `city`.\"\"\"
                return {"Paris": 18, "Oslo": 4}[city]

            @reward
            def correct(self, final: str, answer: int) -> float:
                return float(final == f"It is {answer} degrees.")


        register("Weather-v0", WeatherEnv, tasks=[{"prompt": "How warm is it in Oslo?", "answer": 4}])
        """)
    )
    (tmp_path / "drive.py").write_text(
        textwrap.dedent("""\
        import asyncio

        import weather_env  # noqa: F401  registers Weather-v0 and its tasks
        from miles.envs import make
        from miles.sessions import SchedulerConfig, SessionScheduler
        from miles.engines import EmbeddedEngine
        from miles.tiny import load_tiny_tokenizer, make_tiny_model
        from miles.tito import TITOTokenizer


        async def main():
            tok = load_tiny_tokenizer()
            engine = EmbeddedEngine(make_tiny_model("0.1m", vocab_size=len(tok)), tokenizer=tok)
            scheduler = SessionScheduler([engine], tokenizer=TITOTokenizer(tok),
                                         env_factory=lambda: make("Weather-v0"),
                                         config=SchedulerConfig(group_size=2, progress=False),
                                         recorder="sessions.jsonl")
            await scheduler.run([{"seed": i} for i in range(2)])
            await scheduler.aclose()
            await engine.close()


        asyncio.run(main())
        """)
    )
    drive = subprocess.run(
        [sys.executable, "drive.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert drive.returncode == 0, drive.stderr[-2000:]
    miles = shutil.which("miles") or pytest.fail("the miles console script is not installed")
    check = subprocess.run(
        [miles, "replay", "sessions.jsonl", "--check"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]
    assert check.stdout.count("check ok") == 4
