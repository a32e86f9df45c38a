"""Per-turn cost of appending an observation with TITO vs. naively re-rendering the whole conversation.

Plays a 64-turn tool-use conversation (tool call -> tool result) and times, at turns 1, 16 and 64,
`Conversation.append_observation` (a constant-size delta render) against re-rendering and re-tokenizing every
message so far through the chat template, both in this process. Target: TITO's turn-64 cost <= 1.5x its
turn-1 cost, while the naive cost grows with the turn count.

    python benchmarks/tito.py [--tokenizers tiny,qwen3,llama3] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

from miles.engine import FinishReason
from miles.tito import TITOTokenizer, load_tokenizer
from miles.tito.conversation import Conversation
from miles.types import Message, ToolCall

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
START = [
    Message("system", "You are a careful assistant. Use the calculator for every step."),
    Message("user", "Add the numbers 1 to 64, one tool call at a time."),
]
TURNS = 64
MEASURED = (1, 16, 64)


def _turn(t: int) -> tuple[Message, list[Message]]:
    call = Message(
        "assistant",
        f"Step {t}.",
        [ToolCall("calculate", {"expression": f"{t * (t - 1) // 2} + {t}"}, id="call_0")],
    )
    result = [Message("tool", str(t * (t + 1) // 2), tool_call_id="call_0", name="calculate")]
    return call, result


def run_once(tito: TITOTokenizer, outputs: list[list[int]]) -> tuple[dict[int, float], dict[int, float], int]:
    """One 64-turn conversation: seconds per append at the measured turns (TITO, naive) and its final length."""
    conv = Conversation(tito, START, TOOLS)
    history = list(START)
    tito_s, naive_s = {}, {}
    for t in range(1, TURNS + 1):
        call, result = _turn(t)
        ids = outputs[t - 1]
        conv.append_generation(ids, [-0.1] * len(ids), weight_version=0, finish_reason=FinishReason.STOP)
        history += [call, *result]
        t0 = time.perf_counter()
        conv.append_observation(call, result)
        elapsed = time.perf_counter() - t0
        if t in MEASURED:
            tito_s[t] = elapsed
            t0 = time.perf_counter()
            naive = tito.render_ids(history, TOOLS, add_generation_prompt=True)
            naive_s[t] = time.perf_counter() - t0
            assert naive == conv.prompt_ids or tito.family == "qwen3", "TITO ids differ from the re-render"
    assert conv.check().ok, "benchmark conversation is not token-exact"
    return tito_s, naive_s, len(conv)


def bench(spec: str, repeats: int) -> None:
    tito = TITOTokenizer(load_tokenizer(spec))
    outputs = [tito.expected_generation(START, _turn(t)[0], TOOLS) for t in range(1, TURNS + 1)]
    run_once(tito, outputs)  # warm-up: template compilation, caches
    runs = [run_once(tito, outputs) for _ in range(repeats)]
    tito_med = {t: statistics.median(r[0][t] for r in runs) for t in MEASURED}
    naive_med = {t: statistics.median(r[1][t] for r in runs) for t in MEASURED}
    print(
        f"\n[{spec}] family={tito.family}, {TURNS} turns, median of {repeats} runs "
        f"(conversation at turn 64: {runs[0][2]} tokens)"
    )
    print(f"{'turn':>6} {'tito append (us)':>18} {'naive re-render (us)':>22} {'naive / tito':>13}")
    for t in MEASURED:
        print(
            f"{t:>6} {tito_med[t] * 1e6:>18.0f} {naive_med[t] * 1e6:>22.0f} {naive_med[t] / tito_med[t]:>13.1f}"
        )
    tr = tito_med[64] / tito_med[1]
    nr = naive_med[64] / naive_med[1]
    print(
        f"tito turn64/turn1 = {tr:.2f} (target <= 1.5: {'PASS' if tr <= 1.5 else 'FAIL'}); "
        f"naive turn64/turn1 = {nr:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizers", default="tiny,qwen3,llama3")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    for spec in args.tokenizers.split(","):
        bench(spec.strip(), args.repeats)


if __name__ == "__main__":
    main()
