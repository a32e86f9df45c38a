"""`Orders-v0`: tau-bench-style customer service over a per-episode sqlite order database.

Policy (enforced by the tools; each attempt to break it is refused and counted):
  1. Verify the customer with `authenticate(email, zip_code)` before any lookup or change.
  2. Act only on the authenticated customer's orders.
  3. Cancel or change the address only of orders that are "pending" or "processing".
  4. Refund only orders that are "delivered".
The reward compares the final database with the goal state; an episode with a policy violation scores 0.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from miles.envs.base import OraclePolicy
from miles.envs.hooks import cleanup, reward
from miles.envs.tasks import Task, TaskSource
from miles.envs.tool_env import ToolEnv
from miles.tools import Injected, tool
from miles.types import Message, ToolCall

DATA_FILE = Path(__file__).parent / "data" / "orders.json"
MUTABLE = ("pending", "processing")
SYSTEM_PROMPT = (
    "You are a customer-service agent for an online shop. Policy: verify the customer with authenticate "
    "before anything else; act only on their own orders; cancel or change the address only of pending or "
    "processing orders; refund only delivered orders. Refuse requests that break the policy."
)
CancelReason = Literal["no longer needed", "ordered by mistake"]


class PolicyViolation(Exception):
    """A tool call the shop policy forbids; the model sees the reason and the attempt is counted."""


@lru_cache(maxsize=1)
def load_seed_data(path: str = str(DATA_FILE)) -> dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))


class OrdersDB:
    """One episode's order database (sqlite in memory) plus the session's authentication state."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.conn = sqlite3.connect(":memory:", check_same_thread=False)
        self.lock = threading.Lock()
        self.user_id: str | None = None
        self.violations: list[str] = []
        self.conn.executescript(
            "CREATE TABLE users (id TEXT PRIMARY KEY, name TEXT, email TEXT UNIQUE, zip TEXT, address TEXT);"
            "CREATE TABLE orders (id TEXT PRIMARY KEY, user_id TEXT REFERENCES users(id), status TEXT, "
            "items TEXT, total REAL, address TEXT);"
        )
        self.conn.executemany("INSERT INTO users VALUES (:id, :name, :email, :zip, :address)", data["users"])
        self.conn.executemany(
            "INSERT INTO orders VALUES (:id, :user_id, :status, :items, :total, :address)",
            [{**o, "items": json.dumps(o["items"])} for o in data["orders"]],
        )

    def snapshot(self) -> dict[str, tuple[str, str]]:
        """order id -> (status, address): the part of the state that tasks change."""
        with self.lock:
            return {r[0]: (r[1], r[2]) for r in self.conn.execute("SELECT id, status, address FROM orders")}

    def violate(self, reason: str) -> PolicyViolation:
        self.violations.append(reason)
        return PolicyViolation(f"policy violation: {reason}")

    def require_auth(self) -> str:
        if self.user_id is None:
            raise self.violate("the customer has not been authenticated; call authenticate first")
        return self.user_id

    def own_order(self, order_id: str) -> dict[str, Any]:
        user = self.require_auth()
        row = self.conn.execute(
            "SELECT id, user_id, status, items, total, address FROM orders WHERE id = ?", (order_id,)
        ).fetchone()
        if row is None:
            raise KeyError(f"no order {order_id!r}")
        if row[1] != user:
            raise self.violate(f"order {order_id} does not belong to the authenticated customer")
        return {
            "order_id": row[0],
            "status": row[2],
            "items": json.loads(row[3]),
            "total": row[4],
            "address": row[5],
        }

    def close(self) -> None:
        self.conn.close()


# ---- tasks ------------------------------------------------------------------------------------------------
def _request_text(req: dict[str, Any]) -> str:
    if req["action"] == "cancel":
        why = {"no longer needed": "I no longer need it", "ordered by mistake": "I ordered it by mistake"}
        return f"cancel order {req['order_id']} because {why[req['reason']]}"
    if req["action"] == "refund":
        return f"refund order {req['order_id']}"
    return f"ship order {req['order_id']} to {req['address']} instead"


def _allowed(status: str, action: str) -> bool:
    return status in MUTABLE if action in ("cancel", "change_address") else status == "delivered"


@lru_cache(maxsize=1)
def _task_list() -> tuple[Task, ...]:
    data = load_seed_data()
    orders_by_user: dict[str, list[dict[str, Any]]] = {}
    for o in data["orders"]:
        orders_by_user.setdefault(o["user_id"], []).append(o)
    new_addresses = ["12 Harbor St, Salem 97301", "88 Market Sq, Bristol 06010", "5 Mill Rd, Madison 53703"]
    tasks = []
    for i, user in enumerate(data["users"]):
        orders = orders_by_user.get(user["id"], [])
        o = orders[i % len(orders)]
        kind = ("cancel", "refund", "change_address")[i % 3]
        req: dict[str, Any] = {"action": kind, "order_id": o["id"]}
        if kind == "cancel":
            req["reason"] = ("no longer needed", "ordered by mistake")[i % 2]
        if kind == "change_address":
            req["address"] = new_addresses[i % 3]
        requests = [req]
        if len(orders) > 1 and i % 4 == 0:  # a second request in the same conversation
            other = orders[(i + 1) % len(orders)]
            requests.append({"action": "refund", "order_id": other["id"]})
        wrong_zip = i % 10 == 7  # identity cannot be verified: nothing may change
        zip_code = "00000" if wrong_zip else user["zip"]
        asks = " and ".join(_request_text(r) for r in requests)
        prompt = f"Hi, this is {user['name']} ({user['email']}, zip code {zip_code}). Please {asks}."
        goal: dict[str, list[str]] = {}
        if not wrong_zip:
            status = {x["id"]: x["status"] for x in orders}
            for r in requests:
                if _allowed(status[r["order_id"]], r["action"]):
                    new_status = {"cancel": "cancelled", "refund": "refunded"}.get(r["action"])
                    goal[r["order_id"]] = [new_status or status[r["order_id"]], r.get("address", "")]
        tasks.append(
            Task(
                id=f"orders-{i:03d}",
                prompt=prompt,
                answer=goal,
                data={"email": user["email"], "zip": zip_code, "requests": requests},
            )
        )
    return tuple(tasks)


def orders_tasks() -> TaskSource:
    """One task per customer; `answer` maps each order the goal changes to its [status, address]."""
    return TaskSource.from_iterable(_task_list(), name="orders")


def goal_state(initial: dict[str, tuple[str, str]], goal: dict[str, list[str]]) -> dict[str, tuple[str, str]]:
    """The full expected order table: the initial state with the goal's changes applied."""
    out = dict(initial)
    for oid, (status, address) in goal.items():
        out[oid] = (status, address or initial[oid][1])
    return out


# ---- oracle -------------------------------------------------------------------------------------------------
def _results(messages: list[Message], name: str) -> list[tuple[dict[str, Any], str]]:
    """(arguments, tool output) of every call to `name` so far."""
    args_by_id = {
        c.id: c.arguments or {}
        for m in messages
        if m.role == "assistant"
        for c in m.tool_calls
        if c.name == name
    }
    return [
        (args_by_id[m.tool_call_id], m.content)
        for m in messages
        if m.role == "tool" and m.tool_call_id in args_by_id
    ]


class OrdersOracle(OraclePolicy):
    """Follows the policy: authenticate, look the orders up, do only what the policy allows, then reply."""

    def _calls(self, name: str, arg_list: list[dict[str, Any]], start: int) -> Message:
        return Message(
            role="assistant",
            content="",
            tool_calls=[
                ToolCall(name=name, arguments=a, id=f"call_{start + k}") for k, a in enumerate(arg_list)
            ],
        )

    def act(self, messages: list[Message]) -> Message:
        data = self.task.data
        n_calls = sum(len(m.tool_calls) for m in messages if m.role == "assistant")
        auth = _results(messages, "authenticate")
        if not auth:
            return self._calls("authenticate", [{"email": data["email"], "zip_code": data["zip"]}], n_calls)
        if auth[-1][1].startswith("Error"):
            return Message(
                role="assistant",
                content="I'm sorry, I could not verify your identity, so I "
                "cannot make changes to your orders.",
            )
        lookups = _results(messages, "get_order")
        if not lookups:
            ids = list(dict.fromkeys(r["order_id"] for r in data["requests"]))
            return self._calls("get_order", [{"order_id": i} for i in ids], n_calls)
        status = {json.loads(out)["order_id"]: json.loads(out)["status"] for _, out in lookups}
        done = {
            name for name in ("cancel_order", "refund_order", "change_address") if _results(messages, name)
        }
        if not done:
            by_tool: dict[str, list[dict[str, Any]]] = {}
            for r in data["requests"]:
                if not _allowed(status[r["order_id"]], r["action"]):
                    continue
                if r["action"] == "cancel":
                    by_tool.setdefault("cancel_order", []).append(
                        {"order_id": r["order_id"], "reason": r["reason"]}
                    )
                elif r["action"] == "refund":
                    by_tool.setdefault("refund_order", []).append({"order_id": r["order_id"]})
                else:
                    by_tool.setdefault("change_address", []).append(
                        {"order_id": r["order_id"], "address": r["address"]}
                    )
            if by_tool:
                msg = Message(role="assistant", content="")
                for name, arg_list in by_tool.items():
                    msg.tool_calls.extend(
                        self._calls(name, arg_list, n_calls + len(msg.tool_calls)).tool_calls
                    )
                return msg
        refused = [
            r["order_id"] for r in data["requests"] if not _allowed(status[r["order_id"]], r["action"])
        ]
        note = (
            f" I could not change {', '.join(refused)} because our policy does not allow it."
            if refused
            else ""
        )
        return Message(role="assistant", content="Your request has been handled." + note)


# ---- the env ------------------------------------------------------------------------------------------------
class OrdersEnv(ToolEnv):
    """A customer-service agent with stateful order tools and policy rules.

    Args:
        split: "all", "train" or "held_out".
        held_out_fraction: share of tasks held out.
    """

    max_turns = 8
    system_prompt = SYSTEM_PROMPT
    success_component = "goal"

    held_out_fraction = 0.2
    split_salt = "orders"

    def default_tasks(self) -> TaskSource:
        return orders_tasks()

    async def on_reset(self, task: Task) -> None:
        db = OrdersDB(load_seed_data())
        self.state["db"] = db
        self.state["initial"] = db.snapshot()

    def tool_context(self) -> dict[str, Any]:
        return {**super().tool_context(), "db": self.state.get("db")}

    @tool
    def authenticate(self, email: str, zip_code: str, db: Injected[OrdersDB]) -> str:
        """Verify the customer's identity; required before any other tool.

        Args:
            email: the customer's email address.
            zip_code: the zip code of the customer's address.
        """
        with db.lock:
            row = db.conn.execute(
                "SELECT id FROM users WHERE email = ? AND zip = ?", (email.strip().lower(), zip_code.strip())
            ).fetchone()
            if row is None:
                raise LookupError("no customer matches this email and zip code")
            db.user_id = row[0]
            return f"authenticated as customer {row[0]}"

    @tool
    def get_user_details(self, db: Injected[OrdersDB]) -> dict:
        """The authenticated customer's profile and order ids."""
        with db.lock:
            user = db.require_auth()
            row = db.conn.execute(
                "SELECT id, name, email, address FROM users WHERE id = ?", (user,)
            ).fetchone()
            ids = [
                r[0] for r in db.conn.execute("SELECT id FROM orders WHERE user_id = ? ORDER BY id", (user,))
            ]
            return {"user_id": row[0], "name": row[1], "email": row[2], "address": row[3], "orders": ids}

    @tool
    def get_order(self, order_id: str, db: Injected[OrdersDB]) -> dict:
        """Look up one of the authenticated customer's orders.

        Args:
            order_id: the order id, e.g. "W1003".
        """
        with db.lock:
            return db.own_order(order_id)

    @tool
    def cancel_order(self, order_id: str, reason: CancelReason, db: Injected[OrdersDB]) -> str:
        """Cancel a pending or processing order.

        Args:
            order_id: the order id.
            reason: why the customer cancels.
        """
        with db.lock:
            order = db.own_order(order_id)
            if order["status"] not in MUTABLE:
                raise db.violate(
                    f"order {order_id} is {order['status']}; only pending or processing orders "
                    "can be cancelled"
                )
            db.conn.execute("UPDATE orders SET status = 'cancelled' WHERE id = ?", (order_id,))
            return f"order {order_id} cancelled ({reason})"

    @tool
    def refund_order(self, order_id: str, db: Injected[OrdersDB]) -> str:
        """Refund a delivered order.

        Args:
            order_id: the order id.
        """
        with db.lock:
            order = db.own_order(order_id)
            if order["status"] != "delivered":
                raise db.violate(
                    f"order {order_id} is {order['status']}; only delivered orders can be refunded"
                )
            db.conn.execute("UPDATE orders SET status = 'refunded' WHERE id = ?", (order_id,))
            return f"order {order_id} refunded: {order['total']:.2f}"

    @tool
    def change_address(self, order_id: str, address: str, db: Injected[OrdersDB]) -> str:
        """Change the shipping address of a pending or processing order.

        Args:
            order_id: the order id.
            address: the full new shipping address.
        """
        with db.lock:
            order = db.own_order(order_id)
            if order["status"] not in MUTABLE:
                raise db.violate(f"order {order_id} is {order['status']}; its address can no longer change")
            if not address.strip():
                raise ValueError("the address is empty")
            db.conn.execute("UPDATE orders SET address = ? WHERE id = ?", (address.strip(), order_id))
            return f"order {order_id} will ship to {address.strip()}"

    def oracle(self) -> OrdersOracle:
        return OrdersOracle().bind(self)

    def _db_matches(self, answer: dict[str, list[str]], state: dict[str, Any]) -> bool:
        return state["db"].snapshot() == goal_state(state["initial"], answer)

    def _diligent(self, task: Task, state: dict[str, Any]) -> bool:
        """The agent tried to verify the customer and, once verified, looked up every order they asked about.

        Without this, refusing everything by doing nothing would match the goal state of every task whose
        requests the policy forbids.
        """
        calls = state.get("tool_calls", [])
        if not any(c["name"] == "authenticate" for c in calls):
            return False
        if state["db"].user_id is None:
            return True  # identity not verified: the policy forbids every further step
        looked_up = set()
        for c in calls:
            if c["name"] == "get_order" and c["error"] is None:
                try:
                    looked_up.add(json.loads(c["content"]).get("order_id"))
                except (json.JSONDecodeError, AttributeError):
                    continue
        return all(r["order_id"] in looked_up for r in task.data["requests"])

    @reward(weight=1.0)
    def goal(self, task: Task, answer: dict[str, list[str]], state: dict[str, Any]) -> float:
        """1 iff the final order table equals the goal state, no policy rule was broken, and the agent checked
        identity and the orders before deciding."""
        return float(
            self._db_matches(answer, state) and not state["db"].violations and self._diligent(task, state)
        )

    @reward(weight=0.0)
    def diligence(self, task: Task, state: dict[str, Any]) -> float:
        """1 iff the agent authenticated (or tried to) and looked up every order the customer asked about."""
        return float(self._diligent(task, state))

    @reward(weight=0.0)
    def db_match(self, answer: dict[str, list[str]], state: dict[str, Any]) -> float:
        """1 iff the final order table equals the goal state."""
        return float(self._db_matches(answer, state))

    @reward(weight=0.0)
    def no_violations(self, state: dict[str, Any], info: dict[str, Any]) -> float:
        """1 iff no tool call was refused by the policy (the refusals go to `info["policy_violations"]`)."""
        info["policy_violations"] = list(state["db"].violations)
        return float(not state["db"].violations)

    @cleanup
    def close_db(self, state: dict[str, Any]) -> None:
        db = state.pop("db", None)
        if db is not None:
            db.close()
