"""The README's "Train your own environment" walk-through, run as written: the two files copied into an empty
folder outside the repository, then its commands (`miles train`, `miles replay --check`) through the console
script."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from miles.sessions.recorder import read_sessions

REPO = Path(__file__).resolve().parents[1]
WALKTHROUGH = REPO / "docs" / "walkthrough"


def _section() -> str:
    readme = (REPO / "README.md").read_text()
    start = readme.index("## Train your own environment")
    return readme[start : readme.index("\n## ", start + 1)]


def test_the_readme_shows_both_files_verbatim():
    section = _section()
    assert "```python\n" + (WALKTHROUGH / "bank_env.py").read_text() + "```" in section
    assert "```yaml\n" + (WALKTHROUGH / "bank.yaml").read_text() + "```" in section


@pytest.mark.slow
def test_the_walkthrough_commands_train_then_replay_with_every_session_checked(tmp_path):
    commands = re.search(r"```bash\n(.*?)```", _section(), re.S).group(1).strip().splitlines()
    assert [c.split()[:2] for c in commands] == [["miles", "train"], ["miles", "replay"]]
    for name in ("bank_env.py", "bank.yaml"):
        shutil.copy(WALKTHROUGH / name, tmp_path / name)
    miles = shutil.which("miles")
    assert miles is not None, "the `miles` console script is not installed"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    outputs = []
    for command in commands:
        proc = subprocess.run(
            command, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env
        )
        assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-2000:])
        outputs.append(proc.stdout)
    records = read_sessions(tmp_path / "runs" / "bank" / "sessions.jsonl").records
    assert records and {r.env_id for r in records} == {"Bank-v0"}
    checked = re.findall(r"^(\S+): check ok", outputs[1], re.M)
    assert sorted(checked) == sorted(r.session_id for r in records)


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
