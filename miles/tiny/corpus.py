"""The text the tiny tokenizer is trained on: shipped English prose plus seeded arithmetic and tool-call text.

`build_corpus()` is a pure function of the shipped `data/english.txt` and a fixed seed, so the corpus (and the
tokenizer trained on it) is the same on every machine.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
CORPUS_SEED = 20240607

_NAMES = [
    "Alice",
    "Bob",
    "Carol",
    "Dave",
    "Erin",
    "Frank",
    "Grace",
    "Heidi",
    "Ivan",
    "Judy",
    "Mallory",
    "Oscar",
]
_CITIES = ["Paris", "Berlin", "Tokyo", "Lima", "Cairo", "Oslo", "Madrid", "Toronto", "Nairobi", "Sydney"]
_STATUSES = ["pending", "shipped", "delivered", "cancelled"]
_ITEMS = ["book", "lamp", "chair", "pen", "mug", "shirt", "phone", "cable", "desk", "bottle"]
_OPS = ["+", "-", "*"]

_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an arithmetic expression and return the result.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {"type": "string", "description": "The expression, for example 3 + 4 * 2."}
                },
                "required": ["expression"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_sql",
            "description": "Run a read-only SQL query against the orders database.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "A SELECT statement."}},
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_order",
            "description": "Look up one order by its id.",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "integer", "description": "The order id."}},
                "required": ["order_id"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city name."},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
]


def _expression(rng: random.Random) -> tuple[str, int]:
    n_ops = rng.randint(1, 2)
    parts = [str(rng.randint(0, 99))]
    for _ in range(n_ops):
        parts += [rng.choice(_OPS), str(rng.randint(0, 99))]
    return " ".join(parts), _evaluate(parts)


def _evaluate(parts: list[str]) -> int:
    """Value of `a op b op c` with * binding tighter than + and -."""
    terms, signs, current = [], [1], int(parts[0])
    for op, num in zip(parts[1::2], parts[2::2], strict=True):
        if op == "*":
            current *= int(num)
        else:
            terms.append(current)
            signs.append(1 if op == "+" else -1)
            current = int(num)
    terms.append(current)
    return sum(s * t for s, t in zip(signs, terms, strict=True))


def _arithmetic(rng: random.Random) -> str:
    expr, value = _expression(rng)
    style = rng.randint(0, 3)
    if style == 0:
        return f"What is {expr}? The answer is {value}."
    if style == 1:
        return f"{expr} = {value}"
    if style == 2:
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        return f"{a} plus {b} is {a + b}, and {a} times {b} is {a * b}."
    return f"Compute {expr}.\nStep 1: evaluate the expression.\nThe answer is {value}."


def _tool_call_block(name: str, arguments: dict) -> str:
    return (
        "<tool_call>\n"
        + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        + "\n</tool_call>"
    )


def _tool_dialogue(rng: random.Random) -> str:
    kind = rng.randint(0, 3)
    if kind == 0:
        expr, value = _expression(rng)
        call = _tool_call_block("calculate", {"expression": expr})
        return (
            f"user\nWhat is {expr}?\nassistant\n{call}\nuser\n<tool_response>\n{value}\n</tool_response>\n"
            f"assistant\nThe answer is {value}."
        )
    if kind == 1:
        oid = rng.randint(1, 500)
        order = {
            "id": oid,
            "customer": rng.choice(_NAMES),
            "status": rng.choice(_STATUSES),
            "items": [
                {"name": rng.choice(_ITEMS), "price": rng.randint(1, 99), "qty": rng.randint(1, 5)}
                for _ in range(rng.randint(1, 3))
            ],
        }
        call = _tool_call_block("get_order", {"order_id": oid})
        return (
            f"user\nWhat is the status of order {oid}?\nassistant\n{call}\nuser\n<tool_response>\n"
            f"{json.dumps(order)}\n</tool_response>\nassistant\nOrder {oid} is {order['status']}."
        )
    if kind == 2:
        name = rng.choice(_NAMES)
        query = (
            f"SELECT id, status FROM orders WHERE customer = '{name}' ORDER BY id LIMIT {rng.randint(1, 9)};"
        )
        rows = [[rng.randint(1, 500), rng.choice(_STATUSES)] for _ in range(rng.randint(0, 3))]
        call = _tool_call_block("run_sql", {"query": query})
        return (
            f"user\nList the orders of {name}.\nassistant\n{call}\nuser\n<tool_response>\n{json.dumps(rows)}\n"
            f"</tool_response>\nassistant\n{name} has {len(rows)} orders."
        )
    city = rng.choice(_CITIES)
    temp = rng.randint(-10, 35)
    call = _tool_call_block("get_weather", {"city": city, "unit": "celsius"})
    return (
        f"user\nHow warm is it in {city}?\nassistant\n{call}\nuser\n<tool_response>\n"
        f'{{"city": "{city}", "temperature": {temp}, "unit": "celsius"}}\n</tool_response>\n'
        f"assistant\nIt is {temp} degrees in {city}."
    )


def build_corpus(seed: int = CORPUS_SEED) -> str:
    """The full training text: English prose, tool schemas, arithmetic and tool-use dialogues (about 90 KB)."""
    rng = random.Random(seed)
    english = (DATA_DIR / "english.txt").read_text(encoding="utf-8")
    chunks = [english]
    chunks += [json.dumps(t, ensure_ascii=False) for t in _TOOLS]
    for i in range(450):
        chunks.append(_arithmetic(rng))
        if i % 2 == 0:
            chunks.append(_tool_dialogue(rng))
        if i % 40 == 0:
            paragraphs = [p for p in english.split("\n\n") if p.strip()]
            chunks.append(rng.choice(paragraphs))
    return "\n\n".join(chunks) + "\n"
