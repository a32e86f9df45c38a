"""Scheduler overhead: 1,000 sessions x 4 turns against an instant in-process engine.

The baseline drives the same sessions (same env, TITO conversation, parser, engine) with a bare
`asyncio.gather` loop: no deadlines, retries, engine pool, groups or recording. The full run uses
`SessionScheduler` with everything on, recording every session to a sessions.jsonl (fsync per batch); the
"+ metrics" run is the same with `SessionMetrics` observing every finished session (Prometheus histograms
and counters, as `miles train` does), so the last ratio is the cost of recording metrics.

    python benchmarks/scheduler.py [--sessions 1000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from miles.engine import SamplingParams
from miles.envs import TaskSource, ToolEnv, reward
from miles.observability import Metrics, RunLabels
from miles.sessions import InstantEngine, SchedulerConfig, SessionConfig, SessionScheduler, read_sessions
from miles.sessions.metrics import SessionMetrics
from miles.tiny import load_tiny_tokenizer
from miles.tito import TITOTokenizer
from miles.tito.conversation import Conversation
from miles.tools import get_parser, tool
from miles.types import Message

TURNS = 4


class BenchEnv(ToolEnv):
    env_id = "Bench-v0"
    max_turns = TURNS

    def default_tasks(self) -> TaskSource:
        return TaskSource.from_iterable(
            [{"id": f"t{i}", "prompt": f"Add {i} three times.", "answer": "9"} for i in range(64)]
        )

    @tool
    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first.
            b: the second.
        """
        return a + b

    @reward
    def correct(self, final: str, answer: str) -> float:
        return float(final.strip() == answer)


def script(tito: TITOTokenizer) -> list[list[int]]:
    stop = [tito.stop_token_ids[0]]
    enc = tito.tokenizer.encode
    call = enc(
        '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 3}}\n</tool_call>', add_special_tokens=False
    )
    return [call + stop] * (TURNS - 1) + [enc("9", add_special_tokens=False) + stop]


SAMPLING = SamplingParams(max_new_tokens=64)


async def bare(n: int, tito: TITOTokenizer, engine: InstantEngine) -> list[float]:
    parser = get_parser("hermes")
    sampling = SamplingParams(max_new_tokens=64, stop_token_ids=tito.stop_token_ids)

    async def one(i: int) -> float:
        env = BenchEnv()
        obs, _ = await env.areset(seed=i, options={"task_id": f"t{i % 64}"})
        conv = Conversation(tito, obs, tools=env.tool_schemas())
        total = 0.0
        for _ in range(TURNS):
            res = await engine.generate(conv.prompt_ids, sampling, session_id=f"b{i}")
            text = conv.append_generation(
                res.output_ids,
                res.output_logprobs,
                weight_version=res.weight_version,
                finish_reason=res.finish_reason,
            )
            parsed = parser.parse(text)
            action = Message(role="assistant", content=parsed.content, tool_calls=parsed.calls)
            obs, r, term, trunc, _ = await env.astep(action)
            total += r
            if term or trunc:
                conv.finish(action)
                break
            conv.append_observation(action, obs)
        _ = conv.trajectory
        await env.aclose()
        return total

    return await asyncio.gather(*(one(i) for i in range(n)))


async def full(
    n: int, tito: TITOTokenizer, engine: InstantEngine, path: Path, *, metrics: bool = False
) -> list[float]:
    cfg = SchedulerConfig(
        session=SessionConfig(sampling=SAMPLING),
        group_size=4,
        max_concurrent_sessions=n,
        max_inflight_per_engine=n,
        progress=False,
    )
    observer = SessionMetrics(RunLabels("bench", "Bench-v0", "instant"), metrics=Metrics(CollectorRegistry()))
    sched = SessionScheduler(
        engine,
        tokenizer=tito,
        env_factory=BenchEnv,
        config=cfg,
        recorder=path,
        observer=observer if metrics else None,
    )
    groups = await sched.run([f"t{i % 64}" for i in range(n // 4)])
    await sched.aclose()
    return [r.reward for g in groups for r in g.records]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    n = args.sessions - args.sessions % 4
    tito = TITOTokenizer(load_tiny_tokenizer())
    replies = script(tito)
    best = {"bare": float("inf"), "full": float("inf"), "metrics": float("inf")}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for name in ("bare", "full", "metrics"):  # alternate, so all see the same machine state
                engine = InstantEngine(replies)
                path = Path(tmp) / f"sessions-{rep}-{name}.jsonl"
                t0 = time.perf_counter()
                rewards = asyncio.run(
                    bare(n, tito, engine)
                    if name == "bare"
                    else full(n, tito, engine, path, metrics=name == "metrics")
                )
                dt = time.perf_counter() - t0
                assert len(rewards) == n and all(r == 1.0 for r in rewards), f"{name}: wrong rewards"
                if name != "bare":
                    assert len(read_sessions(path).records) == n
                best[name] = min(best[name], dt)
    turns = n * TURNS
    b, f, m = best["bare"], best["full"], best["metrics"]
    print(json.dumps({"sessions": n, "turns_per_session": TURNS, "repeats": args.repeats}))
    print(f"{'':28s}{'bare gather':>14s}{'SessionScheduler':>18s}{'+ metrics':>12s}")
    print(f"{'wall time (best), s':28s}{b:14.3f}{f:18.3f}{m:12.3f}")
    print(f"{'sessions/s':28s}{n / b:14.1f}{n / f:18.1f}{n / m:12.1f}")
    print(f"{'time per turn, us':28s}{b / turns * 1e6:14.1f}{f / turns * 1e6:18.1f}{m / turns * 1e6:12.1f}")
    print(f"scheduler overhead per turn (full - bare): {(f - b) / turns * 1e6:.1f} us")
    print(f"metrics overhead per session (+ metrics - full): {(m - f) / n * 1e6:.1f} us")
    print(f"ratio full / bare: {f / b:.3f}x (target <= 1.3x)")
    print(f"ratio with metrics / without: {m / f:.3f}x (target <= 1.03x)")


if __name__ == "__main__":
    main()
