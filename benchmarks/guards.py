"""What the run's guards cost per step of the calculator example, side by side in one process.

    OMP_NUM_THREADS=2 python benchmarks/guards.py [--steps 20]

The guards a step runs beyond the update itself: the finiteness check of the weights before each sync
(`first_nonfinite` over the HF state dict), the per-step activity and health bookkeeping (`step_activity`,
`RunHealth.observe`) over the step's 64 session records, and the gradient-norm check before each optimizer
step (measured as a whole step with and without it). The baseline is the step's own work on the same batch:
an RL update (`train_step`) plus the state dict a sync sends. Prints each guard's median seconds and its share
of the step.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    import miles.learner.torch_backend as backend
    from miles.envs import EnvRecipe
    from miles.learner.torch_backend import TorchTrainer, TorchTrainerConfig
    from miles.sessions.records import SessionRecord, TurnRecord
    from miles.tito import TITOTokenizer, TokenizerSpec
    from miles.training.demos import oracle_demos
    from miles.training.health import HealthConfig, RunHealth, first_nonfinite, step_activity
    from miles.trajectory import TrajectoryBatch
    from miles.types import TerminationReason

    model = AutoModelForCausalLM.from_pretrained(
        REPO / "checkpoints" / "calculator-sft-1m", dtype=torch.float32
    )
    tito = TITOTokenizer.from_spec(TokenizerSpec("tiny", "compact"))
    recipe = EnvRecipe("Calculator-v0", {"max_operand": 9, "num_operators": [1, 1], "operators": "+-*"})
    tasks = recipe.make().tasks.take(64)
    trajs = asyncio.run(oracle_demos(recipe.make, tasks, tito))
    for i, t in enumerate(trajs):  # 8 groups of 8 with rewards that differ, as a step of the example trains
        t.meta.group_id, t.reward = f"g{i // 8}", float(i % 2)
        t.rollout_logprobs = [(-0.5 if m else 0.0) for m in t.loss_mask]
    batch = TrajectoryBatch.from_trajectories(trajs)
    records = [
        SessionRecord(
            session_id=f"s{i}",
            group_id=f"g{i // 8}",
            termination=TerminationReason.DONE,
            reward=t.reward,
            trajectory=t,
            tools=[{"type": "function"}],
            turns=[TurnRecord(index=0, tool_calls=[{"id": "c"}])],
        )
        for i, t in enumerate(trajs)
    ]
    trainer = TorchTrainer(model, TorchTrainerConfig(lr=3e-4, max_grad_norm=1.0))
    health = RunHealth(HealthConfig(), warn=lambda line: None)

    def step() -> None:
        trainer.train_step(batch)
        trainer.hf_state_dict()

    step()  # warm-up
    step_s = median_s(step, args.steps)
    state = trainer.hf_state_dict()
    weights_s = median_s(lambda: first_nonfinite(state), args.steps * 5)
    health_s = median_s(
        lambda: health.observe(step_activity(records), {"optimizer_steps": 1.0}), args.steps * 5
    )
    real_isfinite = backend.math.isfinite
    backend.math.isfinite = lambda x: True  # the step without its gradient-norm check
    try:
        unguarded_s = median_s(step, args.steps)
    finally:
        backend.math.isfinite = real_isfinite
    guarded_s = median_s(step, args.steps)
    total = weights_s + health_s
    print(
        f"calculator example, 64 sessions, {batch.token_ids.numel()} tokens, {torch.get_num_threads()} threads"
    )
    print(f"step (update + the state dict a sync sends): {step_s * 1000:.1f} ms")
    print(f"weights finiteness check:   {weights_s * 1000:.3f} ms  ({weights_s / step_s:.2%} of a step)")
    print(f"activity + health per step: {health_s * 1000:.3f} ms  ({health_s / step_s:.2%})")
    print(
        f"gradient-norm check: step {guarded_s * 1000:.1f} ms with, {unguarded_s * 1000:.1f} ms without "
        f"(ratio {guarded_s / unguarded_s:.3f}; within the noise)"
    )
    print(f"guards in all: {total / step_s:.2%} of a step (target <= 2%)")
    assert math.isfinite(total)


if __name__ == "__main__":
    main()
