"""Trainer throughput: miles' TorchTrainer vs TRL's GRPOTrainer loss step (or a plain HF loop), same batch.

Every path runs the same model (same initial weights), the same batch of multi-turn trajectories and the
same loss: on-policy PPO-clip with GRPO advantages, per-sequence token-mean (TRL ``loss_type="grpo"``),
AdamW, grad clipping 1.0, one optimizer step per batch. The paths' steps are interleaved round by round (so
machine load hits them alike) and each path's median step time is reported, with the ratio to the baseline
and the largest weight difference after the first step (a check that the math is the same).

    python benchmarks/trainer.py                       # tiny 3m model, 32 sequences of 64-512 tokens, CPU
    python benchmarks/trainer.py --main-job            # the calculator example's update (see below)
    python benchmarks/trainer.py --main-job --records runs/calculator/sessions.jsonl
    PYTHONPATH=/tmp/trl_pkgs python benchmarks/trainer.py --main-job   # TRL installed with pip --target

``--main-job`` is configs/calculator.yaml's update: the SFT warm start (checkpoints/calculator-sft-1m),
64 sessions in 8 groups of 8 shaped like its rollouts (34-token prompt, ~22 generated, a 14-token tool
result, ~7 generated: 71-87 tokens; ``--long-sessions`` of them run more turns, to ~225 and ~630 tokens, as in
recorded rollouts: about 2% of the sessions), one micro-batch
(``micro_batch_tokens: 65536``), or the first 64 trainable sessions of a recorded ``sessions.jsonl``.

TRL installs next to torch 2.13 with ``pip install --no-deps --target DIR trl==1.16.0 accelerate datasets pandas
dill xxhash multiprocess fsspec``; without it the baseline is a plain HF forward/backward loop written the
way TRL runs it (padded micro-batches of whole sequences, full logits, log_softmax over the vocabulary).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table
from transformers import Qwen2ForCausalLM

from miles.learner.advantages import AdvantageConfig, compute_advantages
from miles.learner.losses import LossConfig
from miles.learner.torch_backend import AlgorithmConfig, TorchTrainer, TorchTrainerConfig
from miles.tiny import load_tiny_tokenizer, make_tiny_model, tiny_config
from miles.trajectory import Trajectory, TrajectoryBatch, TrajectoryMeta


def make_batch(
    num_seqs: int, min_len: int, max_len: int, vocab: int, group_size: int, seed: int
) -> TrajectoryBatch:
    """Multi-turn-shaped trajectories: a prompt, generated turns, a masked tool observation in between."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(num_seqs):
        n = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        prompt, obs = n // 8, n // 6
        gen1 = (n - prompt - obs) // 2
        mask = [0] * prompt + [1] * gen1 + [0] * obs + [1] * (n - prompt - gen1 - obs)
        lps = [(-float(torch.rand((), generator=g)) * 3 if m else 0.0) for m in mask]
        trajs.append(
            Trajectory(
                token_ids=torch.randint(0, vocab, (n,), generator=g).tolist(),
                loss_mask=mask,
                rollout_logprobs=lps,
                reward=float(torch.rand((), generator=g) > 0.5),
                meta=TrajectoryMeta(group_id=f"g{i // group_size}"),
            )
        )
    return TrajectoryBatch.from_trajectories(trajs)


def main_job_batch(
    seed: int, vocab: int, num_seqs: int = 64, group_size: int = 8, long_sessions: int = 2
) -> TrajectoryBatch:
    """Trajectories shaped like the calculator example's rollouts (see the module doc): one tool call and an
    answer, but the last `long_sessions` (at most 2) run longer (about 225 and 630 tokens); rewards mixed
    within groups."""
    g = torch.Generator().manual_seed(seed)

    def rand(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    trajs = []
    for i in range(num_seqs):
        rounds = (1, 5, 17)[max(0, i - (num_seqs - long_sessions) + 1)] if long_sessions else 1
        mask = [0] * 34
        for _ in range(rounds):
            mask += [1] * rand(18, 24) + [0] * 14
        mask += [1] * rand(5, 9)
        lps = [(-float(torch.rand((), generator=g)) * 2 if m else 0.0) for m in mask]
        trajs.append(
            Trajectory(
                token_ids=torch.randint(3, vocab, (len(mask),), generator=g).tolist(),
                loss_mask=mask,
                rollout_logprobs=lps,
                reward=float(i % 3 == 0),
                meta=TrajectoryMeta(group_id=f"g{i // group_size}"),
            )
        )
    return TrajectoryBatch.from_trajectories(trajs)


def recorded_batch(path: str, num_seqs: int) -> TrajectoryBatch:
    """The first `num_seqs` trainable sessions of a recorded ``sessions.jsonl`` (as the train loop takes them)."""
    from miles.sessions.recorder import read_sessions
    from miles.training.rl_step import trainable

    trajs = trainable(read_sessions(path).records)[:num_seqs]
    if not trajs:
        raise SystemExit(f"{path} holds no trainable session")
    return TrajectoryBatch.from_trajectories(trajs)


def interleaved_medians(steps: dict[str, Callable[[], None]], rounds: int, warmup: int) -> dict[str, float]:
    """Each path's median step time over `rounds` rounds; a round runs one step of every path in turn."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def miles_path(
    model, batch, packing: str, micro_tokens: int, lr: float
) -> tuple[Callable[[], None], TorchTrainer]:
    cfg = TorchTrainerConfig(
        lr=lr, micro_batch_tokens=micro_tokens, packing=packing, max_grad_norm=1.0, temperature=1.0
    )
    alg = AlgorithmConfig(
        advantage=AdvantageConfig("grpo"), loss=LossConfig(aggregation="seq-mean-token-mean")
    )
    trainer = TorchTrainer(model, cfg, alg)
    return (lambda: trainer.train_step(batch)), trainer


def split_prompt_completion(batch: TrajectoryBatch, micro_seqs: int):
    """TRL's input layout: left-padded prompts (before the first trained token), right-padded completions."""
    rows = []
    for i in range(batch.num_sequences):
        s = batch.sequence(i)
        ids, mask = batch.token_ids[s], batch.loss_mask[s]
        first = int(torch.nonzero(mask)[0])
        rows.append((ids[:first], ids[first:], mask[first:]))
    micro = []
    for lo in range(0, len(rows), micro_seqs):
        part = rows[lo : lo + micro_seqs]
        p_len, c_len = max(r[0].numel() for r in part), max(r[1].numel() for r in part)
        b = len(part)
        p_ids = torch.zeros(b, p_len, dtype=torch.long)
        p_mask = torch.zeros(b, p_len, dtype=torch.long)
        c_ids = torch.zeros(b, c_len, dtype=torch.long)
        c_attn = torch.zeros(b, c_len, dtype=torch.long)
        c_mask = torch.zeros(b, c_len, dtype=torch.long)
        for j, (p, c, m) in enumerate(part):
            p_ids[j, p_len - p.numel() :], p_mask[j, p_len - p.numel() :] = p, 1
            c_ids[j, : c.numel()], c_attn[j, : c.numel()], c_mask[j, : c.numel()] = c, 1, m.long()
        micro.append((lo, lo + b, p_ids, p_mask, c_ids, c_attn, c_mask))
    return micro


def trl_path(model, batch, advantages, micro_seqs: int, lr: float):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from datasets import Dataset
            from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        return None, f"TRL not importable ({e})"
    micro = split_prompt_completion(batch, micro_seqs)
    args = GRPOConfig(
        output_dir="/tmp/miles-bench-trl",
        per_device_train_batch_size=micro_seqs,
        num_generations=min(micro_seqs, 2),
        max_completion_length=int(batch.token_ids.numel()),
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        save_strategy="no",
        beta=0.0,
        loss_type="grpo",
        bf16=torch.cuda.is_available(),
        temperature=1.0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["x"] * micro_seqs}),
            processing_class=load_tiny_tokenizer(),
        )
    trainer.current_gradient_accumulation_steps = len(micro)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=torch.cuda.is_available() or None)
    dev = next(model.parameters()).device

    def step() -> None:
        model.train()
        opt.zero_grad(set_to_none=True)
        for lo, hi, p_ids, p_mask, c_ids, c_attn, c_mask in micro:
            inputs = {
                "prompt_ids": p_ids.to(dev),
                "prompt_mask": p_mask.to(dev),
                "completion_ids": c_ids.to(dev),
                "completion_mask": c_attn.to(dev),
                "tool_mask": c_mask.to(dev),
                "advantages": advantages[lo:hi].to(dev),
                "num_items_in_batch": c_mask.sum().to(dev),
            }
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                loss = trainer.compute_loss(model, inputs)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step, "TRL GRPOTrainer.compute_loss"


def plain_hf_path(model, batch, advantages, micro_seqs: int, lr: float):
    """What TRL does, written out: padded micro-batches, full logits, log_softmax over the vocabulary."""
    micro = split_prompt_completion(batch, micro_seqs)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=torch.cuda.is_available() or None)
    dev = next(model.parameters()).device

    def step() -> None:
        model.train()
        opt.zero_grad(set_to_none=True)
        for lo, hi, p_ids, p_mask, c_ids, c_attn, c_mask in micro:
            ids = torch.cat([p_ids, c_ids], 1).to(dev)
            attn = torch.cat([p_mask, c_attn], 1).to(dev)
            k = c_ids.size(1)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                logits = model(input_ids=ids, attention_mask=attn).logits[:, -k - 1 : -1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, c_ids.to(dev)[..., None])[..., 0]
            ratio = torch.exp(logp - logp.detach())
            a = advantages[lo:hi].to(dev)[:, None]
            per_tok = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
            m = c_mask.to(dev).float()
            loss = ((per_tok * m).sum(-1) / m.sum(-1).clamp(min=1)).mean() / len(micro)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--main-job", action="store_true", help="the calculator example's model, batch shape and micro-batch"
    )
    ap.add_argument(
        "--records", default=None, help="with --main-job: a recorded sessions.jsonl to take the batch from"
    )
    ap.add_argument(
        "--long-sessions",
        type=int,
        default=2,
        choices=(0, 1, 2),
        help="with --main-job: how many of the 64 sessions run long (the rollouts' tail)",
    )
    ap.add_argument("--size", default="3m")
    ap.add_argument("--hidden", type=int, default=None, help="override the size's hidden width (heads of 64)")
    ap.add_argument("--layers", type=int, default=None, help="override the size's number of layers")
    ap.add_argument("--num-seqs", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--micro-seqs", type=int, default=8, help="sequences per padded micro-batch (baselines)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (one step of every path each)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads for every path")
    ap.add_argument("--all", action="store_true", help="also time miles' packed layout (block-diagonal mask)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    if args.main_job:
        from transformers import AutoModelForCausalLM

        root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
        base = AutoModelForCausalLM.from_pretrained(
            os.path.join(root, "checkpoints", "calculator-sft-1m"), dtype=torch.float32
        )
        label = "calculator-sft-1m"
        num_seqs = 64
        batch = (
            recorded_batch(args.records, num_seqs)
            if args.records
            else main_job_batch(0, base.config.vocab_size, num_seqs, long_sessions=args.long_sessions)
        )
        micro_tokens, micro_seqs = 65536, num_seqs
    else:
        base = make_tiny_model(args.size, seed=0)
        label = args.size
        if args.hidden or args.layers:
            cfg = tiny_config(args.size)
            if args.hidden:
                heads = max(args.hidden // 64, 1)
                cfg.hidden_size, cfg.intermediate_size = args.hidden, args.hidden * 8 // 3
                cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = heads, max(heads // 4, 1), 64
            if args.layers:
                cfg.num_hidden_layers = args.layers
                cfg.layer_types = ["full_attention"] * args.layers
            torch.manual_seed(0)
            base = Qwen2ForCausalLM(cfg)
        batch = make_batch(
            args.num_seqs, args.min_len, args.max_len, base.config.vocab_size, group_size=8, seed=0
        )
        lens = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
        # the packed budget holds as many tokens as one padded baseline micro-batch would on average
        micro_tokens, micro_seqs = int(sum(lens) / len(lens) * args.micro_seqs), args.micro_seqs
    base = base.to(args.device)
    counts = torch.tensor(
        [float(batch.loss_mask[batch.sequence(i)].sum()) for i in range(batch.num_sequences)]
    )
    adv = compute_advantages(batch.rewards, batch.group_ids, AdvantageConfig("grpo"), token_counts=counts)
    total_tokens = int(batch.token_ids.numel())
    lens = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    lr = 1e-4

    steps: dict[str, Callable[[], None]] = {}
    first_step_weights: dict[str, dict[str, torch.Tensor]] = {}

    def add(name: str, make: Callable[[torch.nn.Module], Callable[[], None] | None]) -> None:
        model = copy.deepcopy(base)
        step = make(model)
        if step is None:
            return
        step()  # first step from the shared initial weights, for the equivalence check
        first_step_weights[name] = {
            k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()
        }
        steps[name] = step

    add(
        "miles (auto: varlen)" if args.device == "cpu" else "miles varlen",
        lambda m: miles_path(m, batch, "varlen", micro_tokens, lr)[0],
    )
    add("miles padded", lambda m: miles_path(m, batch, "padded", micro_tokens, lr)[0])
    if args.all:
        add("miles packed", lambda m: miles_path(m, batch, "packed", micro_tokens, lr)[0])
    trl_note = ""

    def make_trl(m):
        nonlocal trl_note
        step, trl_note = trl_path(m, batch, adv, micro_seqs, lr)
        return step

    add("TRL GRPOTrainer", make_trl)
    add("plain HF loop", lambda m: plain_hf_path(m, batch, adv, micro_seqs, lr))
    medians = interleaved_medians(steps, args.rounds, max(args.warmup - 1, 0))

    baseline = "TRL GRPOTrainer" if "TRL GRPOTrainer" in steps else "plain HF loop"
    base_t = medians[baseline]
    ref_w = first_step_weights[baseline]
    params = sum(p.numel() for p in base.parameters())
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    table = Table(
        title=f"train step: {label} ({params / 1e6:.1f}M params), {batch.num_sequences} seqs, "
        f"{total_tokens} tokens (lengths {min(lens)}-{max(lens)}), device {args.device}, "
        f"{args.threads} threads, median of {args.rounds} interleaved rounds, load {load:.1f}"
    )
    for col in ("path", "s/step", "tokens/s", f"x vs {baseline}", "max |dw| vs baseline after step 1"):
        table.add_column(col, justify="right")
    for name, t in medians.items():
        dw = max(float((first_step_weights[name][k] - ref_w[k]).abs().max()) for k in ref_w)
        table.add_row(name, f"{t:.3f}", f"{total_tokens / t:,.0f}", f"{base_t / t:.2f}", f"{dw:.2e}")
    Console().print(table)
    if trl_note and not trl_note.startswith("TRL GRPOTrainer"):
        print(f"note: {trl_note}; the baseline is the plain HF loop")
    print(
        f"torch {torch.__version__}, micro-batch: {micro_tokens} tokens packed vs {micro_seqs} sequences padded"
    )


if __name__ == "__main__":
    main()
