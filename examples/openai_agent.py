"""A plain tool-using agent written only against the `openai` client: it answers arithmetic questions with a
`calculate` tool that it runs itself. Nothing in it knows about miles.

miles trains it as it is: `miles train --config configs/openai_agent.yaml` runs this script once per session,
with `OPENAI_BASE_URL` and `OPENAI_API_KEY` (the session id) set, and the task in `MILES_TASK` (JSON: its
`messages` and `tools`); when it exits, miles closes the session and scores it. Against a server of your own
(`miles rollout --model tiny --openai`), where `curl -X POST .../sessions/my-session/close` records it:

    python examples/openai_agent.py --base-url http://127.0.0.1:30001/v1 --api-key my-session "What is 6 * 7?"
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os

from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an arithmetic expression exactly.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """+ - * over whole numbers, evaluated from the syntax tree (never `eval`)."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not supported: {ast.unparse(node)}")

    return str(value(ast.parse(expression.strip(), mode="eval").body))


def run_tool(name: str, arguments: str) -> str:
    try:
        if name != "calculate":
            raise ValueError(f"unknown tool {name!r}")
        return calculate(json.loads(arguments)["expression"])
    except Exception as exc:  # the model sees the error and may try again
        return f"error: {exc}"


def solve(client: OpenAI, messages: list[dict], tools: list[dict], *, max_turns: int, max_tokens: int) -> str:
    """The agent loop: ask, run the tools the model calls, give back their results, until it answers."""
    for _ in range(max_turns):
        reply = client.chat.completions.create(
            model="miles", messages=messages, tools=tools, max_tokens=max_tokens, temperature=1.0
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "content": run_tool(call.function.name, call.function.arguments),
                }
            )
    return ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("question", nargs="?", help="a question (default: the task in MILES_TASK)")
    p.add_argument("--base-url", default=None, help="the OpenAI API root (default: OPENAI_BASE_URL)")
    p.add_argument("--api-key", default=None, help="the session id (default: OPENAI_API_KEY)")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=40)
    args = p.parse_args()
    if args.question:
        messages, tools = [{"role": "user", "content": args.question}], TOOLS
    else:
        task = json.loads(os.environ["MILES_TASK"])
        messages, tools = task["messages"], task["tools"]
    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=2)
    print(solve(client, messages, tools, max_turns=args.max_turns, max_tokens=args.max_tokens))


if __name__ == "__main__":
    main()
