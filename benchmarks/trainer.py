"""Trainer throughput: miles' TorchTrainer vs TRL's GRPOTrainer loss step (or a plain HF loop), same batch.

Every path runs the same model (same initial weights), the same batch of multi-turn trajectories and the
same loss: on-policy PPO-clip with GRPO advantages, per-sequence token-mean (TRL ``loss_type="grpo"``),
AdamW, grad clipping 1.0, one optimizer step per batch. It prints tokens/s of each path, the ratio to the
baseline, and the largest weight difference after the first step (a check that the math is the same).

    python benchmarks/trainer.py                       # tiny 3m model, CPU
    python benchmarks/trainer.py --size 25m --steps 5
    PYTHONPATH=/tmp/trl_pkgs python benchmarks/trainer.py   # TRL installed with pip --target

TRL installs next to torch 2.13 with ``pip install --no-deps --target DIR trl accelerate datasets pandas
dill xxhash multiprocess fsspec``; without it the baseline is a plain HF forward/backward loop written the
way TRL runs it (padded micro-batches of whole sequences, full logits, log_softmax over the vocabulary).
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table
from transformers import Qwen2ForCausalLM

from miles.tiny import load_tiny_tokenizer, make_tiny_model, tiny_config
from miles.trainers.advantages import AdvantageConfig, compute_advantages
from miles.trainers.losses import LossConfig
from miles.trainers.torch_backend import AlgorithmConfig, TorchTrainer, TorchTrainerConfig
from miles.trajectory import Trajectory, TrajectoryBatch, TrajectoryMeta


def make_batch(num_seqs: int, min_len: int, max_len: int, vocab: int, group_size: int, seed: int) -> TrajectoryBatch:
    """Multi-turn-shaped trajectories: a prompt, generated turns, a masked tool observation in between."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(num_seqs):
        n = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        prompt, obs = n // 8, n // 6
        gen1 = (n - prompt - obs) // 2
        mask = [0] * prompt + [1] * gen1 + [0] * obs + [1] * (n - prompt - gen1 - obs)
        lps = [(-float(torch.rand((), generator=g)) * 3 if m else 0.0) for m in mask]
        trajs.append(Trajectory(token_ids=torch.randint(0, vocab, (n,), generator=g).tolist(), loss_mask=mask,
                                rollout_logprobs=lps, reward=float(torch.rand((), generator=g) > 0.5),
                                meta=TrajectoryMeta(group_id=f"g{i // group_size}")))
    return TrajectoryBatch.from_trajectories(trajs)


def time_steps(step: Callable[[], None], steps: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


def miles_path(model, batch, packing: str, micro_tokens: int, lr: float) -> tuple[Callable[[], None], TorchTrainer]:
    cfg = TorchTrainerConfig(lr=lr, micro_batch_tokens=micro_tokens, packing=packing, max_grad_norm=1.0,
                             temperature=1.0)
    alg = AlgorithmConfig(advantage=AdvantageConfig("grpo"), loss=LossConfig(aggregation="seq-mean-token-mean"))
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
        part = rows[lo:lo + micro_seqs]
        p_len, c_len = max(r[0].numel() for r in part), max(r[1].numel() for r in part)
        b = len(part)
        p_ids = torch.zeros(b, p_len, dtype=torch.long)
        p_mask = torch.zeros(b, p_len, dtype=torch.long)
        c_ids = torch.zeros(b, c_len, dtype=torch.long)
        c_attn = torch.zeros(b, c_len, dtype=torch.long)
        c_mask = torch.zeros(b, c_len, dtype=torch.long)
        for j, (p, c, m) in enumerate(part):
            p_ids[j, p_len - p.numel():], p_mask[j, p_len - p.numel():] = p, 1
            c_ids[j, :c.numel()], c_attn[j, :c.numel()], c_mask[j, :c.numel()] = c, 1, m.long()
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
    args = GRPOConfig(output_dir="/tmp/miles-bench-trl", per_device_train_batch_size=micro_seqs,
                      num_generations=min(micro_seqs, 2), max_completion_length=int(batch.token_ids.numel()),
                      report_to=[], use_cpu=not torch.cuda.is_available(), save_strategy="no", beta=0.0,
                      loss_type="grpo", bf16=torch.cuda.is_available(), temperature=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                              args=args, train_dataset=Dataset.from_dict({"prompt": ["x"] * micro_seqs}),
                              processing_class=load_tiny_tokenizer())
    trainer.current_gradient_accumulation_steps = len(micro)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=torch.cuda.is_available() or None)
    dev = next(model.parameters()).device

    def step() -> None:
        model.train()
        opt.zero_grad(set_to_none=True)
        for lo, hi, p_ids, p_mask, c_ids, c_attn, c_mask in micro:
            inputs = {"prompt_ids": p_ids.to(dev), "prompt_mask": p_mask.to(dev), "completion_ids": c_ids.to(dev),
                      "completion_mask": c_attn.to(dev), "tool_mask": c_mask.to(dev),
                      "advantages": advantages[lo:hi].to(dev), "num_items_in_batch": c_mask.sum().to(dev)}
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
                logits = model(input_ids=ids, attention_mask=attn).logits[:, -k - 1:-1].float()
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
    ap.add_argument("--size", default="3m")
    ap.add_argument("--hidden", type=int, default=None, help="override the size's hidden width (heads of 64)")
    ap.add_argument("--layers", type=int, default=None, help="override the size's number of layers")
    ap.add_argument("--num-seqs", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--micro-seqs", type=int, default=8, help="sequences per padded micro-batch (baselines)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    base = make_tiny_model(args.size, seed=0)
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
    base = base.to(args.device)
    vocab = base.config.vocab_size
    batch = make_batch(args.num_seqs, args.min_len, args.max_len, vocab, group_size=8, seed=0)
    counts = torch.tensor([float(batch.loss_mask[batch.sequence(i)].sum()) for i in range(batch.num_sequences)])
    adv = compute_advantages(batch.rewards, batch.group_ids, AdvantageConfig("grpo"), token_counts=counts)
    total_tokens = int(batch.token_ids.numel())
    lens = [batch.sequence(i).stop - batch.sequence(i).start for i in range(batch.num_sequences)]
    # the packed micro-batch budget holds as many tokens as one padded baseline micro-batch would on average
    micro_tokens = int(sum(lens) / len(lens) * args.micro_seqs)
    lr = 1e-4

    results: list[tuple[str, float]] = []
    first_step_weights: dict[str, dict[str, torch.Tensor]] = {}

    def run(name: str, make: Callable[[torch.nn.Module], Callable[[], None] | None]) -> None:
        model = copy.deepcopy(base)
        step = make(model)
        if step is None:
            return
        step()  # first step from the shared initial weights, for the equivalence check
        first_step_weights[name] = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
        results.append((name, time_steps(step, args.steps, max(args.warmup - 1, 0))))

    run("miles varlen", lambda m: miles_path(m, batch, "varlen", micro_tokens, lr)[0])
    run("miles packed", lambda m: miles_path(m, batch, "packed", micro_tokens, lr)[0])
    run("miles padded (auto)", lambda m: miles_path(m, batch, "padded", micro_tokens, lr)[0])
    trl_note = ""

    def make_trl(m):
        nonlocal trl_note
        step, trl_note = trl_path(m, batch, adv, args.micro_seqs, lr)
        return step

    run("TRL GRPOTrainer", make_trl)
    run("plain HF loop", lambda m: plain_hf_path(m, batch, adv, args.micro_seqs, lr))

    baseline = "TRL GRPOTrainer" if any(n == "TRL GRPOTrainer" for n, _ in results) else "plain HF loop"
    base_t = dict(results)[baseline]
    ref_w = first_step_weights[baseline]
    params = sum(p.numel() for p in base.parameters())
    table = Table(title=f"train step: {args.size} ({params / 1e6:.1f}M params), {args.num_seqs} seqs, "
                        f"{total_tokens} tokens (lengths {min(lens)}-{max(lens)}), device {args.device}")
    for col in ("path", "s/step", "tokens/s", f"x vs {baseline}", "max |dw| vs baseline after step 1"):
        table.add_column(col, justify="right")
    for name, t in results:
        dw = max(float((first_step_weights[name][k] - ref_w[k]).abs().max()) for k in ref_w)
        table.add_row(name, f"{t:.3f}", f"{total_tokens / t:,.0f}", f"{base_t / t:.2f}", f"{dw:.2e}")
    Console().print(table)
    if trl_note and not trl_note.startswith("TRL GRPOTrainer"):
        print(f"note: {trl_note}; the baseline is the plain HF loop")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, micro-batch: "
          f"{micro_tokens} tokens packed vs {args.micro_seqs} sequences padded")


if __name__ == "__main__":
    main()
