"""Task sources: JSONL, Parquet, iterables, seeded generators, deterministic splits; the shipped data."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.envs import Task, TaskSource, TaskSourceError, UnknownTaskError, datagen
from miles.envs.tasks import select_split

ROWS = [{"id": f"r{i}", "prompt": f"question {i}", "answer": i, "level": i % 3} for i in range(50)]


def gen(rng):
    a, b = (int(x) for x in rng.integers(0, 100, size=2))
    return {"prompt": f"{a} + {b}", "answer": a + b}


def test_jsonl_and_parquet_round_trip(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "tasks.parquet")
    for source in (TaskSource.from_jsonl(path), TaskSource.from_parquet(tmp_path / "tasks.parquet")):
        assert len(source) == 50
        t = source.get("r7")
        assert (t.prompt, t.answer, t.data) == ("question 7", 7, {"level": 1})


def test_bad_rows_raise_named_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(TaskSourceError, match="bad.jsonl:2"):
        TaskSource.from_jsonl(bad)
    with pytest.raises(TaskSourceError, match="no string 'prompt'"):
        TaskSource.from_iterable([{"question": "x"}])
    with pytest.raises(TaskSourceError, match="duplicate task id"):
        TaskSource.from_iterable([{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}])
    with pytest.raises(TaskSourceError, match="empty"):
        TaskSource.from_iterable([])
    with pytest.raises(UnknownTaskError):
        TaskSource.from_iterable(ROWS).get("zzz")


def test_generator_is_a_pure_function_of_seed_and_index():
    a, b = TaskSource.from_generator(gen, seed=3), TaskSource.from_generator(gen, seed=3)
    assert [t.to_row() for t in a.take(20)] == [t.to_row() for t in b.take(20)]
    assert [t.prompt for t in a.take(20)] != [t.prompt for t in TaskSource.from_generator(gen, 4).take(20)]
    t = a.take(6)[5]
    assert a.get(t.id).to_row() == t.to_row()
    import numpy as np

    s1 = a.sample(np.random.default_rng(1))
    assert s1.to_row() == a.sample(np.random.default_rng(1)).to_row()
    with pytest.raises(TypeError, match="no length"):
        len(a)


@settings(max_examples=25, deadline=None)
@given(st.floats(0.05, 0.95), st.text(max_size=5))
def test_split_is_disjoint_complete_and_deterministic(fraction, salt):
    source = TaskSource.from_iterable(ROWS)
    train, held = source.split(fraction, salt=salt)
    ids_train, ids_held = {t.id for t in train}, {t.id for t in held}
    assert not ids_train & ids_held and ids_train | ids_held == {r["id"] for r in ROWS}
    again = source.split(fraction, salt=salt)
    assert [t.id for t in again[1]] == [t.id for t in held]


def test_generated_split_keeps_prompts_apart():
    source = TaskSource.from_generator(gen, seed=0)
    train, held = source.split(0.2)
    train_prompts = {t.prompt for t in train.take(300)}
    held_prompts = {t.prompt for t in held.take(100)}
    assert train_prompts and held_prompts and not train_prompts & held_prompts
    assert select_split(source, "all") is source
    with pytest.raises(TaskSourceError):
        select_split(source, "test")
    with pytest.raises(TaskSourceError):
        source.split(1.5)


def test_task_from_row_keeps_extra_keys_in_data():
    t = Task.from_row({"prompt": "p", "data": {"a": 1}, "b": 2}, default_id="x")
    assert t == Task("x", "p", None, {"a": 1, "b": 2})


def test_shipped_data_files_are_what_datagen_produces():
    for name, text in datagen.generate().items():
        assert (datagen.DATA_DIR / name).read_text(encoding="utf-8") == text, f"{name} is stale"
    assert datagen.main(["--check"]) == 0


def test_a_task_file_from_the_config_trains_any_env_with_its_own_split(tmp_path, capsys, monkeypatch):
    """`env.tasks: FILE.jsonl` replaces the env's tasks: its `split` column decides train / held-out, every
    recorded session names the file's tasks, and a bad row is one line naming the file, line and field."""
    import json

    from miles.cli import main
    from miles.envs import make
    from miles.sessions.recorder import read_sessions

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    rows = [
        {"prompt": f"What is {a} + {b}?", "answer": a + b, "split": "held_out" if a == 7 else "train"}
        for a in range(1, 9)
        for b in range(1, 3)
    ]
    good = tmp_path / "tasks.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert {t.prompt for t in make("Calculator-v0", tasks=str(good), split="held_out").tasks} == {
        "What is 7 + 1?",
        "What is 7 + 2?",
    }
    assert (
        main(
            [
                "train",
                "--config",
                str(repo / "configs" / "calculator.yaml"),
                "--output-dir",
                str(tmp_path / "run"),
                "--set",
                f"env.tasks={good}",
                "--set",
                "steps=2",
                "--set",
                "rollout.tasks_per_step=2",
                "--set",
                "env.num_train_tasks=14",
                "--set",
                "eval.num_tasks=4",
            ]
        )
        == 0
    )
    prompts = {
        r.initial_messages[-1]["content"] for r in read_sessions(tmp_path / "run" / "sessions.jsonl").records
    }
    assert prompts <= {r["prompt"] for r in rows if r["split"] == "train"} and prompts
    evaluated = {
        r.initial_messages[-1]["content"]
        for r in read_sessions(tmp_path / "run" / "eval_sessions.jsonl").records
    }
    assert evaluated == {"What is 7 + 1?", "What is 7 + 2?"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"promt": "typo"}) + "\n")
    capsys.readouterr()
    for path, expected in (
        (bad, f"env.tasks: {bad}:2: task row bad-2 has no string 'prompt'"),
        (tmp_path / "missing.jsonl", "cannot read the task file"),
        (tmp_path / "tasks.csv", "a task file ends in .jsonl or .parquet"),
    ):
        assert (
            main(
                [
                    "train",
                    "--config",
                    str(repo / "configs" / "calculator.yaml"),
                    "--output-dir",
                    str(tmp_path / "r2"),
                    "--set",
                    f"env.tasks={path}",
                ]
            )
            == 2
        )
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected in err, err
