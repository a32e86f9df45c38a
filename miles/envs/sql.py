"""`SQL-v0`: questions over a real sqlite3 company database, answered with a read-only `query` tool.

The env builds the database from the CSV files shipped in `envs/data/` (departments, employees, sales).
Each episode opens it with a `mode=ro` URI and `PRAGMA query_only`, so writes fail inside sqlite itself.
Answers are computed from the same database when the tasks are built.
"""

from __future__ import annotations

import csv
import functools
import re
import shutil
import sqlite3
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from miles.envs.base import OraclePolicy
from miles.envs.hooks import cleanup, reward
from miles.envs.tasks import Task, TaskSource, select_split
from miles.envs.tool_env import ToolEnv
from miles.tools import tool
from miles.types import Message, ToolCall

DATA_DIR = Path(__file__).parent / "data"
MAX_ROWS = 50
QUERY_TIME_LIMIT_S = 2.0

SCHEMA = {
    "departments": "id INTEGER PRIMARY KEY, name TEXT NOT NULL, location TEXT NOT NULL, budget INTEGER NOT NULL",
    "employees": (
        "id INTEGER PRIMARY KEY, name TEXT NOT NULL, department_id INTEGER NOT NULL REFERENCES "
        "departments(id), title TEXT NOT NULL, salary INTEGER NOT NULL, hire_date TEXT NOT NULL"
    ),
    "sales": (
        "id INTEGER PRIMARY KEY, employee_id INTEGER NOT NULL REFERENCES employees(id), region TEXT NOT "
        "NULL, product TEXT NOT NULL, quantity INTEGER NOT NULL, amount REAL NOT NULL, sale_date TEXT NOT NULL"
    ),
}

SYSTEM_PROMPT = (
    "You answer questions about a company database with the `query` tool (read-only SQLite). Tables: "
    + "; ".join(
        f"{name}({', '.join(col.split()[0] for col in cols.split(', '))})" for name, cols in SCHEMA.items()
    )
    + ". Reply with 'The answer is X.' when you know the answer."
)


def build_database(path: str | Path, data_dir: Path = DATA_DIR) -> Path:
    """Create the sqlite database file at `path` from the shipped CSVs and return its path."""
    path = Path(path)
    conn = sqlite3.connect(path)
    try:
        for table, cols in SCHEMA.items():
            conn.execute(f"CREATE TABLE {table} ({cols})")
            with (data_dir / f"{table}.csv").open(encoding="utf-8", newline="") as fh:
                rows = list(csv.DictReader(fh))
            names = list(rows[0])
            conn.executemany(
                f"INSERT INTO {table} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
                [tuple(r[n] for n in names) for r in rows],
            )
        conn.commit()
    finally:
        conn.close()
    return path


_READ_ACTIONS = {
    sqlite3.SQLITE_SELECT,
    sqlite3.SQLITE_READ,
    sqlite3.SQLITE_FUNCTION,
    sqlite3.SQLITE_RECURSIVE,
}


def _authorize(action: int, *_: object) -> int:
    return sqlite3.SQLITE_OK if action in _READ_ACTIONS else sqlite3.SQLITE_DENY


def open_read_only(path: Path) -> sqlite3.Connection:
    """A read-only connection: `mode=ro` URI, `PRAGMA query_only`, and an authorizer that allows only reads
    (no ATTACH, no PRAGMA); usable from tool threads."""
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False)
    conn.execute("PRAGMA query_only = ON")
    conn.set_authorizer(_authorize)
    return conn


def format_rows(cursor: sqlite3.Cursor, max_rows: int = MAX_ROWS) -> str:
    """Header line, then one line per row, cells joined by " | "."""
    header = " | ".join(d[0] for d in cursor.description or [])
    rows = cursor.fetchmany(max_rows + 1)
    if not rows:
        return f"{header}\n(no rows)"
    lines = [" | ".join("NULL" if v is None else str(v) for v in row) for row in rows[:max_rows]]
    if len(rows) > max_rows:
        lines.append(f"(more than {max_rows} rows; showing the first {max_rows})")
    return "\n".join([header, *lines])


# ---- tasks --------------------------------------------------------------------------------------------
_DEPT_JOIN = "FROM employees e JOIN departments d ON e.department_id = d.id WHERE d.name = '{dept}'"
TEMPLATES: list[tuple[str, str, str]] = [
    ("count_dept", "How many employees work in the {dept} department?", "SELECT COUNT(*) " + _DEPT_JOIN),
    (
        "avg_salary_dept",
        "What is the average salary in the {dept} department, rounded to the nearest whole number?",
        "SELECT CAST(ROUND(AVG(e.salary)) AS INTEGER) " + _DEPT_JOIN,
    ),
    (
        "top_paid_dept",
        "Who is the highest-paid employee in the {dept} department?",
        "SELECT e.name " + _DEPT_JOIN + " ORDER BY e.salary DESC LIMIT 2",
    ),
    (
        "dept_location",
        "In which city is the {dept} department located?",
        "SELECT location FROM departments WHERE name = '{dept}'",
    ),
    (
        "sales_region_year",
        "What was the total sales amount in the {region} region in {year}, rounded to 2 decimal places?",
        "SELECT ROUND(SUM(amount), 2) FROM sales WHERE region = '{region}' AND "
        "substr(sale_date, 1, 4) = '{year}'",
    ),
    (
        "top_product_year",
        "Which product had the highest total sales amount in {year}?",
        "SELECT product FROM sales WHERE substr(sale_date, 1, 4) = '{year}' GROUP BY product "
        "ORDER BY SUM(amount) DESC LIMIT 2",
    ),
    (
        "hired_year",
        "How many employees were hired in {year}?",
        "SELECT COUNT(*) FROM employees WHERE substr(hire_date, 1, 4) = '{year}'",
    ),
    (
        "sales_by_employee",
        "How many sales did {name} make?",
        "SELECT COUNT(*) FROM sales s JOIN employees e ON s.employee_id = e.id WHERE e.name = '{name}'",
    ),
]


def _unique_top(conn: sqlite3.Connection, rank_sql: str) -> bool:
    """Whether the top row of a ranking query is strictly ahead of the second (no ties)."""
    vals = [r[0] for r in conn.execute(rank_sql).fetchall()]
    return len(vals) < 2 or vals[0] != vals[1]


@functools.lru_cache(maxsize=4)
def _task_rows(data_dir: str) -> tuple[tuple[str, str, Any, str], ...]:
    conn = sqlite3.connect(":memory:")
    with tempfile.TemporaryDirectory() as tmp:
        disk = sqlite3.connect(build_database(Path(tmp) / "c.sqlite", Path(data_dir)))
        disk.backup(conn)
        disk.close()
    depts = [r[0] for r in conn.execute("SELECT name FROM departments ORDER BY id")]
    regions = [r[0] for r in conn.execute("SELECT DISTINCT region FROM sales ORDER BY region")]
    sale_years = [r[0] for r in conn.execute("SELECT DISTINCT substr(sale_date,1,4) FROM sales ORDER BY 1")]
    hire_years = [
        r[0] for r in conn.execute("SELECT DISTINCT substr(hire_date,1,4) FROM employees ORDER BY 1")
    ]
    sellers = [
        r[0]
        for r in conn.execute(
            "SELECT e.name FROM sales s JOIN employees e ON s.employee_id = e.id GROUP BY e.id "
            "ORDER BY COUNT(*) DESC, e.id LIMIT 12"
        )
    ]
    params = {
        "count_dept": [{"dept": d} for d in depts],
        "avg_salary_dept": [{"dept": d} for d in depts],
        "top_paid_dept": [{"dept": d} for d in depts],
        "dept_location": [{"dept": d} for d in depts],
        "sales_region_year": [{"region": r, "year": y} for r in regions for y in sale_years],
        "top_product_year": [{"year": y} for y in sale_years],
        "hired_year": [{"year": y} for y in hire_years],
        "sales_by_employee": [{"name": n} for n in sellers],
    }
    rank_sql = {
        "top_paid_dept": "SELECT e.salary " + _DEPT_JOIN + " ORDER BY e.salary DESC LIMIT 2",
        "top_product_year": "SELECT SUM(amount) FROM sales WHERE substr(sale_date, 1, 4) = '{year}' "
        "GROUP BY product ORDER BY SUM(amount) DESC LIMIT 2",
    }
    out = []
    for key, question, sql in TEMPLATES:
        for p in params[key]:
            if key in rank_sql and not _unique_top(conn, rank_sql[key].format(**p)):
                continue
            q_sql = sql.format(**p).replace(" LIMIT 2", " LIMIT 1")
            answer = conn.execute(q_sql).fetchone()[0]
            suffix = "-".join(str(v).lower().replace(" ", "_") for v in p.values())
            out.append((f"sql-{key}-{suffix}", question.format(**p), answer, q_sql))
    conn.close()
    return tuple(out)


def sql_tasks(data_dir: Path = DATA_DIR) -> TaskSource:
    """All template questions with their DB-computed answers and reference SQL (in `data["sql"]`)."""
    return TaskSource.from_iterable(
        [Task(id=i, prompt=q, answer=a, data={"sql": s}) for i, q, a, s in _task_rows(str(data_dir))],
        name="sql",
    )


# ---- answer checking ------------------------------------------------------------------------------------
_FINAL_RE = re.compile(r"The answer is (.+?)\.?", re.DOTALL)


def extract_answer(final: str) -> str | None:
    """The X of a final message "The answer is X." (None when the message has another shape)."""
    m = _FINAL_RE.fullmatch(final.strip())
    return m.group(1).strip() if m else None


def answers_match(candidate: str | None, expected: Any) -> bool:
    """Numbers match within 0.01; text matches case-insensitively after collapsing whitespace."""
    if candidate is None or not candidate:
        return False
    if isinstance(expected, int | float) and not isinstance(expected, bool):
        try:
            return abs(float(candidate.replace(",", "")) - float(expected)) <= 0.01
        except ValueError:
            return False
    return " ".join(candidate.split()).casefold() == " ".join(str(expected).split()).casefold()


class SQLOracle(OraclePolicy):
    """Runs the task's reference SQL, then answers with the single value it returned."""

    def act(self, messages: list[Message]) -> Message:
        tool_msgs = [m for m in messages if m.role == "tool"]
        if not tool_msgs:
            sql = self.task.data["sql"]
            return Message(
                role="assistant",
                content="",
                tool_calls=[ToolCall(name="query", arguments={"sql": sql}, id="call_0")],
            )
        value = tool_msgs[-1].content.splitlines()[1]
        return Message(role="assistant", content=f"The answer is {value}.")


class SQLEnv(ToolEnv):
    """Questions over the shipped company database.

    Args:
        split: "all", "train" or "held_out".
        held_out_fraction: share of questions held out.
        query_time_limit_s: a query running longer is stopped (a tool error).
    """

    max_turns = 6
    system_prompt = SYSTEM_PROMPT
    success_component = "correct"

    def __init__(
        self,
        *,
        split: str = "all",
        held_out_fraction: float = 0.2,
        query_time_limit_s: float = QUERY_TIME_LIMIT_S,
        **kwargs: Any,
    ) -> None:
        self._split, self._held_out = split, held_out_fraction
        self.query_time_limit_s = query_time_limit_s
        self._tmp = tempfile.mkdtemp(prefix="miles-sql-")
        self.db_path = build_database(Path(self._tmp) / "company.sqlite")
        self.conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()  # parallel calls run on worker threads and share the connection
        super().__init__(**kwargs)

    def default_tasks(self) -> TaskSource:
        return select_split(sql_tasks(), self._split, self._held_out, salt="sql")

    async def on_reset(self, task: Task) -> None:
        self.conn = open_read_only(self.db_path)

    @tool
    def query(self, sql: str) -> str:
        """Run one read-only SQL statement (SQLite dialect) on the company database.

        Args:
            sql: a single SELECT statement, e.g. "SELECT COUNT(*) FROM employees".
        """
        with self._lock:
            return self._query(sql)

    def _query(self, sql: str) -> str:
        if self.conn is None:
            raise RuntimeError("no open database; the episode has ended")
        deadline = time.monotonic() + self.query_time_limit_s
        self.conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
        try:
            return format_rows(self.conn.execute(sql))
        except sqlite3.OperationalError as exc:
            if str(exc) == "interrupted":
                raise TimeoutError(f"query stopped after {self.query_time_limit_s:g} s") from None
            raise
        finally:
            self.conn.set_progress_handler(None, 0)

    def oracle(self) -> SQLOracle:
        return SQLOracle().bind(self)

    @reward(weight=1.0)
    def correct(self, final: str, answer: Any) -> float:
        """1 iff the final message is "The answer is X." with X equal to the DB-computed answer."""
        return float(answers_match(extract_answer(final), answer))

    @reward(weight=0.0)
    def used_tool(self, state: dict[str, Any]) -> float:
        """1 if at least one query ran without error."""
        return float(any(c["name"] == "query" and c["error"] is None for c in state.get("tool_calls", [])))

    @cleanup
    def close_connection(self) -> None:
        with self._lock:
            if self.conn is not None:
                self.conn.close()
                self.conn = None

    def close(self) -> None:
        super().close()
        shutil.rmtree(self._tmp, ignore_errors=True)
