"""OpenAI endpoint overhead per turn: 64 concurrent sessions of a tool-using agent loop through
`POST /v1/chat/completions`, against the very same turns sent straight to `POST /generate` (the prompt ids each
turn had, the number of tokens it generated), on one embedded engine server in the same run.

The server is `python -m miles.engines --model M --openai chat_template=compact`: the endpoint and SGLang's
native `/generate` on one engine. The agent loop answers tool calls with results and other replies with a new
question, so its sessions grow turn by turn; after each repeat its trajectories give the direct phase its
inputs. Both phases use new session ids (cold caches, then per-session KV reuse across their own turns) and
greedy decoding; the direct phase generates exactly as many tokens per turn (`ignore_eos`). Each repeat runs
the endpoint phase, then its direct twin right after; the ratio printed last is the median over repeats of
the two phases' wall times (a shared machine's load changes between repeats more than within one).

    python benchmarks/openai_endpoint.py [--sessions 64] [--turns 4] [--repeats 5] [--model PATH] [--device cuda]

Prints the ratio last: `endpoint/direct per turn: X.XXx`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
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


def question(rng: random.Random) -> tuple[str, int]:
    a, b, op = rng.randint(0, 9), rng.randint(0, 9), rng.choice("+-*")
    return f"What is {a} {op} {b}?", {"+": a + b, "-": a - b, "*": a * b}[op]


async def agent(http: httpx.AsyncClient, url: str, sid: str, turns: int, max_tokens: int, seed: int) -> None:
    """A plain agent loop: tool calls get results, answers get a new question."""
    rng = random.Random(seed)
    text, value = question(rng)
    messages: list[dict] = [{"role": "user", "content": text}]
    for _ in range(turns):
        resp = await http.post(
            f"{url}/v1/chat/completions",
            headers={"authorization": f"Bearer {sid}"},
            json={
                "model": "m",
                "messages": messages,
                "tools": TOOLS,
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        )
        resp.raise_for_status()
        message = resp.json()["choices"][0]["message"]
        messages.append(message)
        if message.get("tool_calls"):
            messages += [
                {"role": "tool", "tool_call_id": c["id"], "content": str(value)}
                for c in message["tool_calls"]
            ]
        else:
            text, value = question(rng)
            messages.append({"role": "user", "content": text})


async def endpoint_phase(
    http: httpx.AsyncClient, url: str, prefix: str, args: argparse.Namespace
) -> tuple[float, list[list[tuple[list[int], int]]]]:
    """Run the agents; returns the wall time of their turns and each session's (prompt ids, generated) turns."""
    sids = [f"{prefix}-{i}" for i in range(args.sessions)]
    t0 = time.perf_counter()
    await asyncio.gather(
        *(agent(http, url, sid, args.turns, args.max_tokens, i) for i, sid in enumerate(sids))
    )
    wall = time.perf_counter() - t0
    sessions = []
    for sid in sids:
        (await http.post(f"{url}/sessions/{sid}/close")).raise_for_status()
        [record] = (await http.get(f"{url}/sessions/{sid}/trajectory")).json()["records"]
        ids = record["trajectory"]["token_ids"]
        sessions.append(
            [(ids[: t["output_start"]], t["output_end"] - t["output_start"]) for t in record["turns"]]
        )
    return wall, sessions


async def direct_phase(
    http: httpx.AsyncClient, url: str, prefix: str, sessions: list[list[tuple[list[int], int]]]
) -> float:
    """The same turns straight to `/generate`, session by session in order, all sessions at once."""

    async def one(i: int, turns: list[tuple[list[int], int]]) -> None:
        for k, (prompt, n) in enumerate(turns):
            resp = await http.post(
                f"{url}/generate",
                headers={"x-miles-session-id": f"{prefix}-{i}"},
                json={
                    "rid": f"{prefix}-{i}-{k}",
                    "input_ids": prompt,
                    "return_logprob": True,
                    "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
                },
            )
            resp.raise_for_status()
            assert len(resp.json()["output_ids"]) == n

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, turns) for i, turns in enumerate(sessions)))
    return time.perf_counter() - t0


def start_server(model: str, port: int, max_batch_size: int, device: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "miles.engines",
            "--model",
            model,
            "--port",
            str(port),
            "--max-batch-size",
            str(max_batch_size),
            "--device",
            device,
            "--openai",
            "chat_template=compact",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


async def main_async(args: argparse.Namespace) -> None:
    from miles.ports import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(args.model, port, args.sessions, args.device)
    try:
        limits = httpx.Limits(max_connections=2 * args.sessions, max_keepalive_connections=2 * args.sessions)
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            for _ in range(600):
                if server.poll() is not None:
                    raise SystemExit(f"the server exited: {server.stderr.read().decode()[-2000:]}")
                try:
                    if (await http.get(f"{url}/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
            await endpoint_phase(http, url, "warmup", argparse.Namespace(**{**vars(args), "sessions": 4}))
            ep_walls, direct_walls = [], []
            for r in range(args.repeats):
                wall, sessions = await endpoint_phase(http, url, f"ep{r}", args)
                ep_walls.append(wall)
                direct_walls.append(await direct_phase(http, url, f"dr{r}", sessions))
                turns = sum(len(s) for s in sessions)
                tokens = sum(n for s in sessions for _, n in s)
                print(
                    f"repeat {r}: endpoint {wall:.2f} s, /generate {direct_walls[-1]:.2f} s "
                    f"({turns} turns, {tokens} generated tokens, "
                    f"{sum(len(p) for s in sessions for p, _ in s) // turns} prompt tokens per turn)",
                    flush=True,
                )
    finally:
        server.terminate()
        server.wait(30)
    n = args.sessions * args.turns
    ratios = sorted(e / d for e, d in zip(ep_walls, direct_walls, strict=True))
    ep, dr = statistics.median(ep_walls), statistics.median(direct_walls)
    print(
        f"\n{args.sessions} concurrent sessions x {args.turns} turns, model {args.model} on {args.device}, "
        f"median of {args.repeats} repeats"
    )
    print(f"{'':24}{'/generate':>12}{'endpoint':>12}")
    print(f"{'wall time (s)':24}{dr:>12.2f}{ep:>12.2f}")
    print(f"{'per turn (ms)':24}{1000 * dr / n:>12.1f}{1000 * ep / n:>12.1f}")
    print(f"{'overhead per turn (ms)':24}{'':>12}{1000 * (ep - dr) / n:>12.1f}")
    print(f"per-repeat ratios: {', '.join(f'{r:.2f}' for r in ratios)}")
    print(f"endpoint/direct per turn: {statistics.median(ratios):.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default=str(ROOT / "checkpoints" / "calculator-sft-1m"))
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
