"""SQL-v0: a real read-only sqlite database built from the shipped CSVs; DB-computed answers."""

from __future__ import annotations

import sqlite3

import pytest
from gymnasium.utils.env_checker import check_env

import miles.envs as E
from miles.envs.sql import answers_match, build_database, extract_answer, open_read_only
from miles.types import Message, ToolCall


def q(sql: str, i: int = 0) -> Message:
    return Message("assistant", tool_calls=[ToolCall("query", {"sql": sql}, f"call_{i}")])


@pytest.fixture(scope="module")
def env():
    e = E.make("SQL-v0")
    yield e
    e.close()


def test_database_has_realistic_size(tmp_path):
    conn = sqlite3.connect(build_database(tmp_path / "c.sqlite"))
    counts = {
        t: conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
        for t in ("departments", "employees", "sales")
    }
    assert counts == {"departments": 8, "employees": 240, "sales": 480}
    orphans = conn.execute(
        "SELECT COUNT(*) FROM sales s LEFT JOIN employees e ON s.employee_id = e.id WHERE e.id IS NULL"
    ).fetchone()[0]
    assert orphans == 0


def test_oracle_solves_every_task(env):
    assert len(env.tasks) >= 60
    results = [E.run_episode(env, options={"task": t}) for t in env.tasks]
    assert all(r.success for r in results), [r.info["task_id"] for r in results if not r.success]


def test_answers_are_computed_from_the_db(env):
    env.reset(options={"task_id": "sql-count_dept-engineering"})
    direct = env.conn.execute("SELECT COUNT(*) FROM employees WHERE department_id = 1").fetchone()[0]
    assert env.task.answer == direct
    obs, *_ = env.step(q("SELECT COUNT(*) AS n FROM employees WHERE department_id = 1"))
    assert obs[0].content == f"n\n{direct}"
    _, r, *_ = env.step(f"The answer is {direct}.")
    assert r == 1.0


@pytest.mark.parametrize(
    "sql",
    [
        "DELETE FROM employees",
        "UPDATE employees SET salary = 0",
        "DROP TABLE sales",
        "INSERT INTO departments VALUES (99, 'X', 'Y', 1)",
        "CREATE TABLE t (x)",
        "PRAGMA query_only = OFF",
        "ATTACH DATABASE ':memory:' AS other",
    ],
)
def test_writes_are_rejected_and_the_db_is_unchanged(env, sql):
    env.reset(options={"task_id": "sql-count_dept-sales"})
    obs, *_ = env.step(q(sql))
    if sql.startswith("PRAGMA"):  # even if the pragma is accepted, mode=ro still refuses writes
        obs, *_ = env.step(q("DELETE FROM employees", 1))
    assert obs[0].content.startswith("Error") and env.tool_errors["tool_exception"] >= 1
    check = sqlite3.connect(env.db_path)
    assert check.execute("SELECT COUNT(*) FROM employees").fetchone()[0] == 240
    assert check.execute("SELECT COUNT(*) FROM sqlite_master WHERE type='table'").fetchone()[0] == 3


def test_each_read_only_layer_refuses_writes_on_its_own(env):
    conn = open_read_only(env.db_path)
    with pytest.raises(sqlite3.DatabaseError, match="not authorized"):  # layer 1: the authorizer
        conn.execute("DELETE FROM employees")
    conn.set_authorizer(None)
    with pytest.raises(sqlite3.OperationalError, match="readonly"):  # layer 2: PRAGMA query_only
        conn.execute("DELETE FROM employees")
    conn.execute("PRAGMA query_only = OFF")
    with pytest.raises(sqlite3.OperationalError, match="readonly database"):  # layer 3: mode=ro
        conn.execute("DELETE FROM employees")


def test_bad_sql_and_multiple_statements_are_tool_errors(env):
    env.reset(options={"task_id": "sql-count_dept-sales"})
    obs, _, term, _, info = env.step(
        Message(
            "assistant",
            tool_calls=[
                ToolCall("query", {"sql": "SELEC nonsense"}, "call_0"),
                ToolCall("query", {"sql": "SELECT 1; SELECT 2"}, "call_1"),
                ToolCall("query", {"sql": "SELECT * FROM nope"}, "call_2"),
                ToolCall("query", {"sql": 5}, "call_3"),
            ],
        )
    )
    assert not term and all(m.content.startswith("Error") for m in obs)
    assert info["tool_errors"]["tool_exception"] == 3 and info["tool_errors"]["schema_violation"] == 1


def test_long_running_queries_are_stopped():
    env = E.make("SQL-v0", query_time_limit_s=0.2)
    env.reset(options={"task_id": "sql-count_dept-sales"})
    obs, *_ = env.step(q("SELECT COUNT(*) FROM sales a, sales b, sales c, sales d"))
    assert "stopped after" in obs[0].content


def test_large_results_are_capped(env):
    env.reset(options={"task_id": "sql-count_dept-sales"})
    obs, *_ = env.step(q("SELECT id FROM sales"))
    lines = obs[0].content.splitlines()
    assert len(lines) == 52 and "more than 50 rows" in lines[-1]


@pytest.mark.parametrize(
    "final",
    [
        "",
        "67",
        "The answer is 66.",
        "The answer is sixty-seven.",
        "I think the answer is 67.",
        "The answer is 67. Also 68.",
    ],
)
def test_wrong_or_malformed_answers_score_zero(env, final):
    env.reset(options={"task_id": "sql-count_dept-engineering"})
    assert env.task.answer == 67
    env.step(q("SELECT 1"))
    _, r, term, _, info = env.step(final)
    assert term and r == 0.0 and not info["success"]


def test_answer_matching():
    assert extract_answer("The answer is Berlin.") == "Berlin"
    assert answers_match("12,345.67", 12345.67) and answers_match("berlin", "Berlin")
    assert not answers_match("12345.7", 12345.67) and not answers_match(None, 1)


def test_check_env(env):
    check_env(E.make("SQL-v0"), skip_render_check=True)
