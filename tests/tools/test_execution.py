"""ToolBox execution: every error path, concurrency, timeouts, truncation, injection, conversion."""

import asyncio
import enum
import json
import os
import threading
from dataclasses import dataclass
from typing import Literal, Optional, TypedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.tools import Injected, ToolBox, ToolDefinitionError, collect_tools, count_errors, tool
from miles.tools.parsers import get_parser
from miles.tools.threads import DaemonThreadPool
from miles.types import ToolCall, ToolErrorType


def call(name, args, id_="c0"):
    return ToolCall(name=name, arguments=args, id=id_, raw_arguments=json.dumps(args))


class Unit(enum.Enum):
    CM = "cm"
    INCH = "inch"


@dataclass
class Box:
    width: float
    height: float
    unit: Unit = Unit.CM

    def __post_init__(self):
        if self.width > 1000:
            raise ValueError("width too large")


@tool
def area(box: Box, scale: float = 1.0) -> dict:
    """Area of a box.

    Args:
        box: The box.
        scale: Multiplier.
    """
    assert isinstance(box, Box) and isinstance(box.unit, Unit) and isinstance(scale, float)
    return {"area": box.width * box.height * scale, "unit": box.unit}


@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: First.
        b: Second.
    """
    return a + b


@tool
def boom(message: str) -> str:
    """Always fails.

    Args:
        message: The error message.
    """
    raise RuntimeError(message)


@tool(max_output_chars=10)
def shout(n: int) -> str:
    """Return n letters.

    Args:
        n: How many.
    """
    return "a" * n


@tool
async def aecho(text: str) -> str:
    """Echo asynchronously.

    Args:
        text: What to echo.
    """
    await asyncio.sleep(0)
    return text


def make_box(*extra, **kw):
    return ToolBox([area, add, boom, shout, aecho, *extra], **kw)


async def test_success_and_order_and_conversion():
    box = make_box()
    calls = [
        call("add", {"a": 2, "b": 3}, "x1"),
        call("aecho", {"text": "hi"}, "x2"),
        call("area", {"box": {"width": 2, "height": 3, "unit": "inch"}, "scale": 2}, "x3"),
    ]
    results = await box.execute(calls)
    assert [r.call_id for r in results] == ["x1", "x2", "x3"]
    assert [r.content for r in results] == ["5", "hi", json.dumps({"area": 12.0, "unit": "inch"})]
    assert all(r.error is None for r in results)
    assert all(r.duration_s >= 0 for r in results)
    assert box.names == ["area", "add", "boom", "shout", "aecho"]
    assert [s["function"]["name"] for s in box.schemas()] == box.names
    assert count_errors(results) == {t.value: 0 for t in ToolErrorType}


async def test_invalid_json_from_parser_garbage():
    parsed = get_parser("hermes").parse('<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>')
    [result] = await make_box().execute(parsed.calls)
    assert result.error is ToolErrorType.INVALID_JSON
    assert result.name == "add" and result.call_id == "call_0"
    assert result.content.startswith("Error: could not parse the tool call 'add': invalid JSON")


async def test_invalid_json_arguments_not_object():
    bad = ToolCall.from_dict({"id": "q", "function": {"name": "add", "arguments": "[1, 2]"}})
    [result] = await make_box().execute([bad])
    assert result.error is ToolErrorType.INVALID_JSON
    assert "arguments are not a JSON object" in result.content and "[1, 2]" in result.content


async def test_unknown_tool():
    [result] = await make_box().execute([call("subtract", {"a": 1})])
    assert result.error is ToolErrorType.UNKNOWN_TOOL
    assert result.content == (
        "Error: unknown tool 'subtract'. Available tools: area, add, boom, shout, aecho."
    )


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        ({"a": 1}, ["'b' is a required property"]),
        ({"a": "1", "b": 2}, ["at 'a': '1' is not of type 'integer'"]),
        ({"a": True, "b": 2}, ["at 'a': True is not of type 'integer'"]),
        ({"a": 1, "b": 2, "c": 3}, ["Additional properties are not allowed ('c' was unexpected)"]),
        (
            {"a": 1.5, "b": [1]},
            ["at 'a': 1.5 is not of type 'integer'", "at 'b': [1] is not of type 'integer'"],
        ),
    ],
)
async def test_schema_violation(args, needles):
    [result] = await make_box().execute([call("add", args)])
    assert result.error is ToolErrorType.SCHEMA_VIOLATION
    assert result.content.startswith("Error: invalid arguments for tool 'add': ")
    for needle in needles:
        assert needle in result.content


async def test_schema_violation_nested_enum_and_conversion_failure():
    box = make_box()
    r1, r2 = await box.execute(
        [
            call("area", {"box": {"width": 1, "height": 1, "unit": "mile"}}, "a"),
            call("area", {"box": {"width": 5000, "height": 1}}, "b"),
        ]
    )
    assert r1.error is ToolErrorType.SCHEMA_VIOLATION and "at 'box/unit': 'mile' is not one of" in r1.content
    assert r2.error is ToolErrorType.SCHEMA_VIOLATION
    assert "argument 'box': ValueError: width too large" in r2.content


async def test_exception_in_sync_and_async_tool():
    @tool
    async def afail(x: int) -> int:
        """Fail asynchronously.

        Args:
            x: Unused.
        """
        raise KeyError("missing-key")

    r1, r2 = await make_box(afail).execute(
        [call("boom", {"message": "disk on fire"}), call("afail", {"x": 1})]
    )
    assert r1.error is ToolErrorType.TOOL_EXCEPTION
    assert r1.content == "Error: tool 'boom' raised RuntimeError: disk on fire"
    assert r2.error is ToolErrorType.TOOL_EXCEPTION and "raised KeyError: 'missing-key'" in r2.content


async def test_timeout_sync_tool_returns_while_thread_still_runs():
    release = threading.Event()
    finished = threading.Event()

    @tool(timeout_s=0.2)
    def hang() -> str:
        """Block until released."""
        release.wait(30)
        finished.set()
        return "late"

    box = make_box(hang)
    r_hang, r_add = await box.execute([call("hang", {}), call("add", {"a": 1, "b": 1})])
    assert r_hang.error is ToolErrorType.TIMEOUT
    assert r_hang.content == "Error: tool 'hang' timed out after 0.2 s"
    assert r_add.content == "2" and r_add.error is None
    assert not finished.is_set()  # the result came back while the tool's thread was still blocked
    release.set()
    assert finished.wait(5)


async def test_timeout_async_tool_is_cancelled():
    cancelled = asyncio.Event()

    @tool
    async def slow() -> str:
        """Sleep long."""
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    [result] = await make_box(slow, default_timeout_s=0.1).execute([call("slow", {})])
    assert result.error is ToolErrorType.TIMEOUT and "timed out after 0.1 s" in result.content
    await asyncio.wait_for(cancelled.wait(), 5)


async def test_output_truncation_per_tool_and_default():
    box = make_box(max_output_chars=50)
    r1, r2, r3 = await box.execute(
        [call("shout", {"n": 25}, "1"), call("shout", {"n": 10}, "2"), call("aecho", {"text": "b" * 80}, "3")]
    )
    assert r1.error is ToolErrorType.OUTPUT_TRUNCATED
    assert r1.content == "a" * 10 + "\n[output truncated: 25 characters, limit 10]"
    assert r2.error is None and r2.content == "a" * 10
    assert r3.error is ToolErrorType.OUTPUT_TRUNCATED and r3.content.startswith(
        "b" * 50 + "\n[output truncated"
    )
    assert count_errors([r1, r2, r3])["output_truncated"] == 2


async def test_parallel_calls_run_concurrently():
    # Each call waits for the other one: sequential execution would time out, concurrent execution passes.
    barrier = threading.Barrier(2, timeout=5)
    a_started, b_started = asyncio.Event(), asyncio.Event()

    @tool
    def left() -> str:
        """Sync side."""
        barrier.wait()
        return "left"

    @tool
    def right() -> str:
        """Sync side."""
        barrier.wait()
        return "right"

    @tool
    async def ping() -> str:
        """Async side."""
        a_started.set()
        await b_started.wait()
        return "ping"

    @tool
    async def pong() -> str:
        """Async side."""
        b_started.set()
        await a_started.wait()
        return "pong"

    box = make_box(left, right, ping, pong, default_timeout_s=5)
    results = await box.execute([call(n, {}, n) for n in ("left", "ping", "right", "pong")])
    assert [r.content for r in results] == ["left", "ping", "right", "pong"]
    assert all(r.error is None for r in results)


class Store:
    def __init__(self):
        self.log = []

    @tool
    def put(self, key: str, value: int, db: Injected[dict], audit: Injected[list] = None) -> str:
        """Store a value.

        Args:
            key: Key.
            value: Value.
        """
        db[key] = value
        if audit is not None:
            audit.append(key)
        self.log.append(key)
        return f"stored {key}"


async def test_injected_context_and_methods():
    store = Store()
    db, audit = {}, []
    box = ToolBox(collect_tools(store), context={"db": db, "audit": audit})
    assert box.schemas()[0]["function"]["parameters"]["properties"].keys() == {"key", "value"}
    [r] = await box.execute([call("put", {"key": "k", "value": 7})])
    assert r.content == "stored k" and db == {"k": 7} and audit == ["k"] and store.log == ["k"]
    # the model cannot override an injected value
    [r] = await box.execute([call("put", {"key": "k", "value": 1, "db": {}})])
    assert r.error is ToolErrorType.SCHEMA_VIOLATION and "'db' was unexpected" in r.content
    # a missing injected value (environment bug) is reported, not raised; defaults apply
    box.context = {"audit": audit}
    [r] = await box.execute([call("put", {"key": "k", "value": 1})])
    assert r.error is ToolErrorType.TOOL_EXCEPTION and "injected value 'db'" in r.content
    box.context = {"db": db}
    [r] = await box.execute([call("put", {"key": "z", "value": 2})])
    assert r.error is None and db["z"] == 2 and audit == ["k"]


def test_toolbox_definition_errors_and_plain_functions():
    with pytest.raises(ToolDefinitionError, match="pass it bound"):
        ToolBox([Store.put])
    with pytest.raises(ToolDefinitionError, match="duplicate tool name 'add'"):
        ToolBox([add, add])

    def mul(a: int, b: int) -> int:
        """Multiply.

        Args:
            a: First.
            b: Second.
        """
        return a * b

    box = ToolBox([mul])  # undecorated functions are described on the fly
    [r] = box.execute_sync([call("mul", {"a": 3, "b": 4})])
    assert r.content == "12"


async def test_execute_sync_inside_running_loop_and_empty():
    box = make_box()
    assert await box.execute([]) == []
    [r] = box.execute_sync([call("aecho", {"text": "x"})])
    assert r.content == "x"


async def test_count_errors_over_every_type():
    parsed = get_parser("hermes").parse("<tool_call>not json</tool_call>")

    @tool(timeout_s=0.05)
    async def stall() -> str:
        """Stall."""
        await asyncio.sleep(5)
        return ""

    box = make_box(stall)
    results = await box.execute(
        [
            *parsed.calls,
            call("nope", {}),
            call("add", {}),
            call("boom", {"message": "m"}),
            call("stall", {}),
            call("shout", {"n": 11}),
            call("add", {"a": 1, "b": 2}),
        ]
    )
    assert [r.error for r in results] == [
        ToolErrorType.INVALID_JSON,
        ToolErrorType.UNKNOWN_TOOL,
        ToolErrorType.SCHEMA_VIOLATION,
        ToolErrorType.TOOL_EXCEPTION,
        ToolErrorType.TIMEOUT,
        ToolErrorType.OUTPUT_TRUNCATED,
        None,
    ]
    assert count_errors(results) == {t.value: 1 for t in ToolErrorType}
    assert results[-1].to_message().content == "3"


@tool
def pack(
    boxes: list[Box],
    units: dict[str, Unit],
    corner: tuple[int, float],
    spare: Box | None = None,
    tags: frozenset[str] = frozenset(),
) -> str:
    """Pack boxes.

    Args:
        boxes: Boxes.
        units: Units by label.
        corner: Corner position.
        spare: Optional spare box.
        tags: Labels.
    """
    assert all(isinstance(b, Box) for b in boxes)
    assert all(isinstance(u, Unit) for u in units.values())
    assert isinstance(corner, tuple) and isinstance(corner[1], float)
    assert spare is None or isinstance(spare, Box)
    assert isinstance(tags, frozenset)
    return (
        f"{len(boxes)} {sorted(u.value for u in units.values())} {corner} {spare is not None} {sorted(tags)}"
    )


async def test_nested_conversion_into_python_types():
    box = ToolBox([pack])
    r1, r2, r3 = await box.execute(
        [
            call(
                "pack",
                {
                    "boxes": [{"width": 1, "height": 2}],
                    "units": {"a": "cm", "b": "inch"},
                    "corner": [1, 2],
                    "spare": {"width": 3, "height": 4},
                    "tags": ["x", "y"],
                },
                "1",
            ),
            call("pack", {"boxes": [], "units": {}, "corner": [0, 0.5], "spare": None}, "2"),
            call("pack", {"boxes": [], "units": {}, "corner": [0, 0.5, 9]}, "3"),
        ]
    )
    assert r1.content == "1 ['cm', 'inch'] (1, 2.0) True ['x', 'y']" and r1.error is None
    assert r2.content == "0 [] (0, 0.5) False []" and r2.error is None
    assert r3.error is ToolErrorType.SCHEMA_VIOLATION and "at 'corner'" in r3.content


def test_daemon_thread_pool_grows_bounded_and_shrinks():
    pool = DaemonThreadPool(max_workers=4, idle_timeout_s=0.05)
    futures = [pool.submit(lambda i=i: i * i) for i in range(200)]
    assert [f.result(timeout=10) for f in futures] == [i * i for i in range(200)]
    assert 1 <= pool.workers <= 4
    gate = threading.Event()
    blocked = [pool.submit(gate.wait, 10) for _ in range(4)]
    queued = pool.submit(lambda: "queued")  # all four workers are busy: it waits, it is not lost
    assert not queued.done()
    gate.set()
    assert queued.result(timeout=10) == "queued" and all(f.result(timeout=10) for f in blocked)
    for _ in range(200):
        if pool.workers == 0:
            break
        threading.Event().wait(0.01)
    assert pool.workers == 0
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(timeout=10)


def test_tool_boxes_share_one_pool_so_sessions_do_not_leave_a_thread_each():
    """One env (and ToolBox) per session: a pool per box started a thread per session that idled 30 s
    (2,400 live threads in a calculator-example process). All boxes share the process's pool."""

    @tool
    def square(x: int) -> int:
        """Square x.

        Args:
            x: a number.
        """
        return x * x

    async def sessions() -> None:
        for i in range(60):
            (result,) = await ToolBox([square]).execute([call("square", {"x": i})])
            assert result.content == str(i * i)

    asyncio.run(sessions())  # warms the pool up
    before = threading.active_count()
    asyncio.run(sessions())
    assert threading.active_count() - before <= 2


def test_a_forked_child_runs_sync_tools_on_a_pool_of_its_own():
    """The parent's pool workers do not exist in a forked child: a pool inherited as it is would queue the
    child's calls for workers it believes idle, and every call would time out."""

    @tool(timeout_s=2.0)
    def double(x: int) -> int:
        """Double x.

        Args:
            x: a number.
        """
        return 2 * x

    box = ToolBox([double])
    (warm,) = box.execute_sync([call("double", {"x": 1})])  # the parent's pool now has an idle worker
    assert warm.content == "2"
    pid = os.fork()
    if pid == 0:
        (result,) = box.execute_sync([call("double", {"x": 21})])
        os._exit(0 if result.content == "42" else 1)
    for _ in range(300):  # the child either answers or hangs: give it 30 s
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        threading.Event().wait(0.1)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's tool call never ran")
    assert os.waitstatus_to_exitcode(status) == 0


# ---- int parameters through the executor (hypothesis) -------------------------------------------------------


@dataclass
class Order:
    sku: str
    qty: int


class Part(TypedDict):
    qty: int


_received: list[dict] = []


@tool
def record_ints(
    n: int,
    counts: list[int],
    by_name: dict[str, int],
    maybe: Optional[int],  # noqa: UP045
    pair: tuple[int, str],
    order: Order,
    part: Part,
    level: Literal[1, 2, 3] = 1,
) -> str:
    """Record what the tool received.

    Args:
        n: A count.
        counts: Counts.
        by_name: Counts by name.
        maybe: An optional count.
        pair: A count and a label.
        order: An order.
        part: A part.
        level: A level.
    """
    _received.append(
        {
            "n": n,
            "counts": counts,
            "by_name": by_name,
            "maybe": maybe,
            "pair": pair,
            "order": order,
            "part": part,
            "level": level,
        }
    )
    return "ok"


INT_BOX = ToolBox([record_ints])
# where an int can sit: (build the arguments around a value, read the delivered value back)
INT_SLOTS = {
    "n": (lambda v: {"n": v}, lambda r: r["n"]),
    "counts": (lambda v: {"counts": [1, v]}, lambda r: r["counts"][1]),
    "by_name": (lambda v: {"by_name": {"k": v}}, lambda r: r["by_name"]["k"]),
    "maybe": (lambda v: {"maybe": v}, lambda r: r["maybe"]),
    "pair": (lambda v: {"pair": [v, "x"]}, lambda r: r["pair"][0]),
    "order": (lambda v: {"order": {"sku": "s", "qty": v}}, lambda r: r["order"].qty),
    "part": (lambda v: {"part": {"qty": v}}, lambda r: r["part"]["qty"]),
}
_BASE = {
    "n": 0,
    "counts": [],
    "by_name": {},
    "maybe": None,
    "pair": [0, "x"],
    "order": {"sku": "s", "qty": 0},
    "part": {"qty": 0},
}
_finite = st.floats(allow_nan=False, allow_infinity=False)


def _run_slot(slot, value):
    build, _ = INT_SLOTS[slot]
    _received.clear()
    [result] = INT_BOX.execute_sync([call("record_ints", {**_BASE, **build(value)})])
    return result


@settings(max_examples=150, deadline=None)
@given(
    slot=st.sampled_from(sorted(INT_SLOTS)),
    value=_finite.filter(float.is_integer)
    | st.integers(-(2**53), 2**53).map(float)
    | st.sampled_from([-0.0, 0.0, 1e300, -1e308, 2.0**63, 2.0**64 + 2**12]),
)
def test_integral_floats_reach_int_parameters_as_ints(slot, value):
    result = _run_slot(slot, value)
    assert result.error is None and result.content == "ok", result.content
    got = INT_SLOTS[slot][1](_received[0])
    assert type(got) is int and got == int(value)


@settings(max_examples=100, deadline=None)
@given(
    slot=st.sampled_from(sorted(INT_SLOTS)),
    value=_finite.filter(lambda f: not f.is_integer())
    | st.sampled_from([0.5, -2.5, 1e-300, float("nan"), float("inf"), float("-inf"), True, False, "3", [3]]),
)
def test_non_integral_values_for_int_parameters_are_schema_errors(slot, value):
    result = _run_slot(slot, value)
    assert result.error is ToolErrorType.SCHEMA_VIOLATION
    assert result.content.startswith("Error: invalid arguments for tool 'record_ints': at '")
    assert "is not of type 'integer'" in result.content or "is not valid under any" in result.content
    assert _received == []  # the tool never ran


def test_literal_int_level_and_model_facing_error():
    _received.clear()
    ok, bad = INT_BOX.execute_sync(
        [call("record_ints", {**_BASE, "level": 2.0}, "a"), call("record_ints", {**_BASE, "n": 30.5}, "b")]
    )
    assert ok.error is None and type(_received[0]["level"]) is int and _received[0]["level"] == 2
    assert bad.to_message().content == (
        "Error: invalid arguments for tool 'record_ints': at 'n': 30.5 is not of type 'integer'"
    )
