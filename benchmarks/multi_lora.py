"""Several LoRA adapters on one base: equivalence, training throughput, and mixed-adapter decode.

* **equivalence**: 3 adapters trained together for k steps on real Calculator groups end with the same adapter
  weights as each trained alone on its own groups with the same seeds (fp32, CPU): the max |dw| is printed
  (target <= 1e-5; `tests/learner/lora/test_trainer.py` asserts it).
* **throughput**: `miles train` with 4 adapters at once vs 4 runs of one adapter each, same steps, same
  groups per adapter (so the same total samples), from the shipped Calculator warm start; each run in its own
  process, RL time only (evaluation excluded), and its steady state (the steps after the first
  `--warmup-steps`), at each `--threads` count, in `--rounds` rounds one after the other; each side is compared
  at its best count (on the 2-core box the tiny model runs faster on 1 torch thread than on 2, alone and
  together, so 1 is the default). Memory: the base's bytes (held once by the 4-adapter run's trainer process,
  once by its engine) against the adapters', and the peak RSS of the run and of its trainer process.
* **engine**: decode throughput of the embedded engine at batch 32 with every row on one adapter vs rows
  spread over 4 adapters (and the base alone for reference), same prompts, same tokens (EOS ignored).

    python benchmarks/multi_lora.py                                            # all three on the CPU
    python benchmarks/multi_lora.py --only engine --device cuda --model-size 0.5b   # the GPU engine part (< 4 min)
    python benchmarks/multi_lora.py --only throughput --device cuda --threads 4      # training throughput on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

WARM_START = ROOT / "checkpoints" / "calculator-sft-1m"
OPERATORS = ("+", "-", "*", "+-*")  # one Calculator variant per adapter


# ------------------------------------------------------------------------------------------- equivalence
def equivalence(steps: int, groups: int) -> float:
    """Max |dw| between 3 adapters trained together and each alone, on groups rolled out by the warm start."""
    from transformers import AutoModelForCausalLM

    from miles.engine import SamplingParams
    from miles.engines.embedded import EmbeddedEngine
    from miles.envs import EnvRecipe
    from miles.learner.config import TorchOptions, TrainerConfig
    from miles.learner.lora.config import LoraSpec
    from miles.learner.lora.trainer import AdapterSpec, MultiLoraTrainer
    from miles.sessions.config import SchedulerConfig, SessionConfig
    from miles.sessions.scheduler import SessionScheduler
    from miles.tito import TITOTokenizer, TokenizerSpec
    from miles.training.data import load_tasks
    from miles.trajectory import TrajectoryBatch

    names = ("mul", "addsub", "mixed")
    tito = TITOTokenizer.from_spec(TokenizerSpec("tiny", "compact"))
    base = AutoModelForCausalLM.from_pretrained(WARM_START, dtype=torch.float32)

    async def rollouts() -> list[list]:
        engine = EmbeddedEngine(AutoModelForCausalLM.from_pretrained(WARM_START, dtype=torch.float32))
        cfg = SchedulerConfig(
            group_size=8, session=SessionConfig(sampling=SamplingParams(max_new_tokens=40)), progress=False
        )
        out = []
        try:
            for i, ops in enumerate(("*", "+-", "+-*")):
                recipe = EnvRecipe(
                    "Calculator-v0", {"operators": ops, "held_out_fraction": 0.5, "split": "train"}
                )
                tasks = load_tasks(recipe, "train", steps * groups)
                sched = SessionScheduler(engine, tokenizer=tito, config=cfg, recipe=recipe, run_id=names[i])
                done = await sched.run([{"task": t} for t in tasks])
                await sched.aclose()
                trajs = []
                for g in done:
                    for r in g.records:
                        r.trajectory.meta.policy_id = names[i]
                        r.trajectory.reward = r.reward
                        trajs.append(r.trajectory)
                out.append(trajs)
        finally:
            await engine.close()
        return out

    per_adapter = asyncio.run(rollouts())
    specs = [
        AdapterSpec(
            n, LoraSpec(rank=8 * (i + 1), alpha=16.0), TrainerConfig(lr=2e-3, max_grad_norm=1.0), seed=100 + i
        )
        for i, n in enumerate(names)
    ]
    per_step = 8 * groups

    def train(which: list[int]) -> MultiLoraTrainer:
        import copy

        trainer = MultiLoraTrainer(copy.deepcopy(base), [specs[i] for i in which], TorchOptions(device="cpu"))
        for s in range(steps):
            trajs = [
                t for i in which for t in per_adapter[i][s * per_step : (s + 1) * per_step] if t.num_generated
            ]
            trainer.train_step(TrajectoryBatch.from_trajectories(trajs))
        return trainer

    together = train([0, 1, 2])
    worst = 0.0
    for i, name in enumerate(names):
        alone = train([i]).adapter_weights(name).tensors
        mine = together.adapter_weights(name).tensors
        worst = max(worst, max(float((mine[k] - alone[k]).abs().max()) for k in mine))
    return worst


# ------------------------------------------------------------------------------------------- throughput
def run_config(adapters: list[int], steps: int, tasks: int, out: str, device: str, warmup: int) -> dict:
    """One `miles train` run (in this process) with the adapters `adapters` (indices into OPERATORS); the steady
    state is its steps after the first `warmup`."""
    from miles.training.config import load_train_config
    from miles.training.loop import TrainLoop
    from miles.training.metrics_log import read_metrics

    overrides = [
        f"output_dir={out}",
        f"steps={steps}",
        "max_seconds=null",
        "eval.num_tasks=4",
        f"model.init_from={WARM_START}",
        "rollout.drop_zero_std_groups=false",
        "rollout.scheduler.progress=false",
        f"engine.device={device}",
        f"torch.device={device}",
        "adapters="
        + json.dumps(
            [
                {
                    "name": f"a{i}",
                    "tasks_per_step": tasks,
                    "lora": {"rank": 8, "alpha": 16},
                    "env": {
                        "id": "Calculator-v0",
                        "num_train_tasks": 5000,
                        "kwargs": {"operators": OPERATORS[i], "held_out_fraction": 0.5},
                    },
                }
                for i in adapters
            ]
        ),
    ]
    cfg = load_train_config(str(ROOT / "configs" / "multi_lora.yaml"), overrides)
    loop = TrainLoop(cfg, echo=lambda _: None)
    summary = asyncio.run(loop.run())
    base_bytes = sum(t.numel() * t.element_size() for t in loop.parts.model.state_dict().values())
    last = max(Path(out, "checkpoints").glob("step_*"))  # the final checkpoint: every adapter's PEFT folder
    adapter_bytes = sum(f.stat().st_size for f in last.glob("adapters/*/adapter_model.safetensors"))
    sessions = len((Path(out) / "sessions.jsonl").read_text().splitlines())
    steady = [r for r in read_metrics(Path(out) / "metrics.jsonl") if r["kind"] == "train"][warmup:]
    return {
        "rl_s": summary.seconds["rl"],
        "steps": summary.steps_done,
        "sessions": sessions,
        "steady_s": sum(r["step_s"] for r in steady),
        "steady_sessions": sum(r["sessions"] for r in steady),
        "base_mb": base_bytes / 1e6,
        "adapter_mb": adapter_bytes / 1e6,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "trainer_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }


def child(adapters: list[int], steps: int, tasks: int, threads: int, device: str, warmup: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            ",".join(map(str, adapters)),
            "--steps",
            str(steps),
            "--tasks",
            str(tasks),
            "--out",
            tmp,
            "--device",
            device,
            "--warmup-steps",
            str(warmup),
        ]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": str(threads)}
        )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def throughput(
    steps: int, tasks: int, threads: list[int], rounds: int, device: str, warmup: int
) -> dict[int, list[tuple[dict, list[dict]]]]:
    """Per torch thread count, `rounds` rounds of: the 4-adapter run, then the 4 single-adapter runs. On a GPU a
    4-adapter run goes first and is left out (the first process on a fresh machine compiles kernels)."""
    if device != "cpu":
        child([0, 1, 2, 3], steps, tasks, threads[0], device, warmup)
    return {
        t: [
            (
                child([0, 1, 2, 3], steps, tasks, t, device, warmup),
                [child([i], steps, tasks, t, device, warmup) for i in range(4)],
            )
            for _ in range(rounds)
        ]
        for t in threads
    }


def rate(runs: list[dict], *, steady: bool = False) -> float:
    """Samples per second over the runs' RL time (or their steady state)."""
    if steady:
        return sum(r["steady_sessions"] for r in runs) / sum(r["steady_s"] for r in runs)
    return sum(r["sessions"] for r in runs) / sum(r["rl_s"] for r in runs)


# ------------------------------------------------------------------------------------------- engine
def random_adapter(model, rank: int, seed: int):
    from miles.engines.lora import DEFAULT_TARGET_MODULES, PEFT_PREFIX, AdapterWeights

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in DEFAULT_TARGET_MODULES:
            tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = (
                torch.randn(rank, module.in_features, generator=gen) * 0.02
            )
            tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = (
                torch.randn(module.out_features, rank, generator=gen) * 0.02
            )
    return AdapterWeights(rank=rank, alpha=2.0 * rank, target_modules=DEFAULT_TARGET_MODULES, tensors=tensors)


def engine(
    size: str, device: str, batch: int, new_tokens: int, prompt_len: int, repeats: int
) -> dict[str, float]:
    """Decode tokens/s at `batch` rows: the base, one adapter on every row, rows spread over 4 adapters."""
    from engine import make_model  # benchmarks/engine.py

    from miles.engine import SamplingParams
    from miles.engines.embedded import EmbeddedEngine

    model = make_model(size, device)
    eng = EmbeddedEngine(model, device=device, max_batch_size=batch)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(1, vocab) for _ in range(prompt_len)] for _ in range(batch)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=i) for i in range(batch)]

    async def run() -> dict[str, float]:
        for k in range(4):
            await eng.update_adapter(f"a{k}", weights=random_adapter(model, 16, k), version=0)
        layouts = {
            "base": [None] * batch,
            "one adapter": ["a0"] * batch,
            "4 adapters mixed": [f"a{i % 4}" for i in range(batch)],
        }
        times: dict[str, list[float]] = {k: [] for k in layouts}
        for _ in range(repeats + 1):  # the first round warms up (and captures CUDA graphs)
            for name, rows in layouts.items():
                t0 = time.perf_counter()
                await asyncio.gather(
                    *(
                        eng.generate(p, sp, adapter=a, ignore_eos=True)
                        for p, sp, a in zip(prompts, params, rows, strict=True)
                    )
                )
                times[name].append(time.perf_counter() - t0)
        await eng.close()
        return {name: batch * new_tokens / statistics.median(ts[1:]) for name, ts in times.items()}

    return asyncio.run(run())


# ------------------------------------------------------------------------------------------- main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["equivalence", "throughput", "engine"], default=None)
    p.add_argument("--steps", type=int, default=10, help="equivalence and throughput: RL steps")
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=2,
        help="throughput: steps left out of each run's steady state (one-time costs: the first batches "
        "size the KV cache and the LoRA bank)",
    )
    p.add_argument("--tasks", type=int, default=2, help="throughput: groups (of 8) per adapter and step")
    p.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[1],
        help="throughput: torch thread counts to run both sides at (each side's best is compared)",
    )
    p.add_argument(
        "--rounds", type=int, default=2, help="throughput: rounds of both sides, one after the other"
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--model-size", default="3m", help="engine: a tiny size or 0.5b")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print(
            json.dumps(
                run_config(
                    [int(i) for i in args.child.split(",")],
                    args.steps,
                    args.tasks,
                    args.out,
                    args.device,
                    args.warmup_steps,
                )
            )
        )
        return
    lines = []
    if args.only in (None, "equivalence"):
        worst = equivalence(args.steps, groups=2)
        lines.append(
            f"equivalence: 3 adapters together vs each alone, {args.steps} steps: max |dw| = {worst:.2e} "
            f"(target <= 1e-5)"
        )
    if args.only in (None, "throughput"):
        runs = throughput(args.steps, args.tasks, args.threads, args.rounds, args.device, args.warmup_steps)
        for t, rounds in runs.items():
            for i, (together, alone) in enumerate(rounds):
                lines.append(
                    f"throughput, {t} torch thread(s), round {i + 1}: 4 adapters at once "
                    f"{rate([together]):.1f} samples/s ({together['sessions']} in {together['rl_s']:.1f} s); "
                    f"4 single-adapter runs {rate(alone):.1f} samples/s ({sum(r['sessions'] for r in alone)} "
                    f"in {sum(r['rl_s'] for r in alone):.1f} s): {rate([together]) / rate(alone):.2f}x"
                )
        best_t = max(runs, key=lambda t: rate([r[0] for r in runs[t]]))
        best_a = max(runs, key=lambda t: rate([a for r in runs[t] for a in r[1]]))
        together, alone = runs[best_t][0][0], runs[best_a][0][1]
        lines.append(
            f"memory: base {together['base_mb']:.1f} MB held once by the 4-adapter run's trainer process and "
            f"once by its engine; its 4 adapters {together['adapter_mb']:.2f} MB; peak RSS "
            f"{together['peak_rss_mb']:.0f} MB + trainer process {together['trainer_rss_mb']:.0f} MB (one "
            f"single-adapter run: {alone[0]['peak_rss_mb']:.0f} + {alone[0]['trainer_rss_mb']:.0f} MB)"
        )
        ratio = rate([r[0] for r in runs[best_t]]) / rate([a for r in runs[best_a] for a in r[1]])
        steady = rate([r[0] for r in runs[best_t]], steady=True) / rate(
            [a for r in runs[best_a] for a in r[1]], steady=True
        )
        for t, rounds in runs.items():
            lines.append(
                f"steady state ({t} torch thread(s), first {args.warmup_steps} steps of each run left out), "
                f"per round: "
                + ", ".join(
                    f"{rate([c], steady=True):.1f} vs {rate(a, steady=True):.1f} samples/s "
                    f"({rate([c], steady=True) / rate(a, steady=True):.2f}x)"
                    for c, a in rounds
                )
            )
        lines.append(
            f"concurrent ({best_t} thread(s)) / sequential ({best_a} thread(s)), all rounds: {ratio:.2f}x; "
            f"steady state: {steady:.2f}x"
        )
    if args.only in (None, "engine"):
        rates = engine(args.model_size, args.device, args.batch, args.new_tokens, 32, args.repeats)
        base, one, mixed = rates["base"], rates["one adapter"], rates["4 adapters mixed"]
        lines.append(
            f"engine ({args.model_size}, {args.device}, batch {args.batch}): base {base:.0f} tok/s, one adapter "
            f"{one:.0f} tok/s, 4 adapters mixed {mixed:.0f} tok/s; mixed slowdown vs one adapter "
            f"{one / mixed:.2f}x (target <= 1.3x), one adapter vs base {base / one:.2f}x"
        )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
