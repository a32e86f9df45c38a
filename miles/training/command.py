"""`miles train` and `miles sft`: config loading, CLI overrides, and the final table."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import sys
from pathlib import Path

import torch

from miles.config import ConfigError
from miles.learner.errors import CheckpointError
from miles.learner.trainer_process import TrainerProcessError
from miles.training.config import TrainConfig, load_train_config
from miles.training.rollout_process import RolloutManagerError
from miles.training.summary import RunSummary


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The config file plus `--set` overrides, then the dedicated flags.

    `--import M` is turned into an `env.import` override (the config's modules plus M) kept in
    `args.overrides`, so ranks that a launcher re-spawns with the same command line import it too.
    """
    if getattr(args, "imports", None):
        base = load_train_config(args.config, list(args.overrides)).env.imports
        args.overrides = [*args.overrides, f"env.import={json.dumps([*base, *args.imports])}"]
        args.imports = []
    overrides = list(args.overrides)
    if (
        getattr(args, "seed", None) is not None
    ):  # --seed varies the sampling seeds too, not only the task order
        clash = [o for o in overrides if o.split("=", 1)[0].strip() in ("rollout.scheduler.seed", "seed")]
        if clash:
            raise ConfigError(
                "--seed",
                f"sets seed and rollout.scheduler.seed, and --set {clash[0]} sets one of "
                "them too: give --seed alone, or both seeds with --set",
            )
        overrides.append(f"rollout.scheduler.seed={args.seed * 100_003}")
    for flag, key in (
        ("output_dir", "output_dir"),
        ("seed", "seed"),
        ("backend", "backend"),
        ("tp", "parallel.tp"),
        ("pp", "parallel.pp"),
        ("dp", "parallel.dp"),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"{key}={value}")
    return load_train_config(args.config, overrides)


def format_summary(summary: RunSummary, cfg: TrainConfig | None = None) -> str:
    """The final table: held-out success after the warm start (SFT) and after RL, with the gain."""
    warm = cfg is not None and (cfg.sft.enabled or cfg.model.init_from)
    names = {"start": "after SFT" if warm else "before RL", "final": "after RL"}
    width = max([8, *(len(mode) for results in summary.evals.values() for mode in results)]) + 2
    lines = ["", f"{'stage':<14}{'mode':<{width}}{'held-out success':>18}{'mean reward':>14}{'tasks':>8}"]
    for stage, results in summary.evals.items():
        for mode, r in results.items():
            lines.append(
                f"{names.get(stage, stage):<14}{mode:<{width}}{r.success_rate:>18.1%}"
                f"{r.mean_reward:>14.3f}{r.num_tasks:>8}"
            )
    before, after = summary.evals.get("start", {}), summary.evals.get("final", {})
    for mode in sorted(set(before) & set(after)):
        gain = 100 * (after[mode].success_rate - before[mode].success_rate)
        lines.append(f"RL gain ({mode}): {gain:+.1f} points of held-out success")
    secs = ", ".join(f"{k} {v:.0f} s" for k, v in summary.seconds.items())
    lines.append(f"time: {secs}   run dir: {summary.output_dir}")
    return "\n".join(lines)


def run_loop(cfg: TrainConfig, args: argparse.Namespace, *, resume: bool) -> int:
    """Run `cfg` where it is placed (`run_placed`) and print rank 0's table. A torchrun rank ends here
    (`end_rank`)."""
    from miles.learner.collective import end_rank
    from miles.training.torchrun import in_torchrun_worker

    status = _run_loop(cfg, args, resume=resume)
    if in_torchrun_worker():
        end_rank(status)
    return status


def run_placed(cfg: TrainConfig, argv: list[str], *, resume: bool, extend: bool = False) -> RunSummary | int:
    """Run `cfg`'s trainer ranks where the config places them, each one running `run_rank`: in this process
    (one rank), under torchrun (``tp * pp * dp`` local ranks, re-running `argv`), or as Ray actors
    (`cluster.kind: ray`). Returns rank 0's `RunSummary` where this process ran rank 0 or drove the Ray
    actors; else this process's exit status (torchrun's for its launcher, 0 for a worker rank). Setup errors
    are raised before any rank starts."""
    if cfg.cluster.kind == "ray":  # the roles run as Ray actors; this process places and watches them
        from miles.training.cluster.ray_run import run_on_ray

        return run_on_ray(cfg, resume=resume, extend=extend)
    from miles.training.models import check_devices
    from miles.training.placement import world_size_of
    from miles.training.rank import run_rank
    from miles.training.torchrun import relaunch_under_torchrun
    from miles.training.trainer_setup import check_trainer_setup

    check_trainer_setup(cfg)
    check_devices(cfg)
    status = relaunch_under_torchrun(world_size_of(cfg), argv)
    if status is not None:
        return status
    summary = run_rank(cfg, resume=resume, extend=extend)
    return 0 if summary is None else summary


def _run_loop(cfg: TrainConfig, args: argparse.Namespace, *, resume: bool) -> int:
    from miles.training.output_dir import check_fresh_output_dir, leftovers
    from miles.training.rank import TrainerRankError
    from miles.training.torchrun import in_torchrun_worker

    if not resume and not in_torchrun_worker():  # before any rank, engine or Ray actor starts
        check_fresh_output_dir(Path(cfg.output_dir))
        if left := leftovers(Path(cfg.output_dir)):
            print(
                f"[train] {cfg.output_dir} holds no recorded run, only {', '.join(left)}; the new run starts "
                "there and replaces them"
            )
    try:
        outcome = run_placed(cfg, cli_argv(args), resume=resume, extend=bool(getattr(args, "extend", False)))
    except (RolloutManagerError, TrainerProcessError, TrainerRankError, CheckpointError) as exc:
        print(f"miles {args.command}: {exc}", file=sys.stderr)  # the run stopped; its checkpoints are intact
        return 1
    except (MemoryError, torch.OutOfMemoryError) as exc:  # the accelerator or the host is full
        print(f"miles {args.command}: {out_of_memory_line(exc, cfg)}", file=sys.stderr)
        return 1
    return outcome if isinstance(outcome, int) else report(outcome, cfg, args)


def out_of_memory_line(exc: BaseException, cfg: TrainConfig) -> str:
    """One line for a run that ran out of memory: what ran out, and the keys that make a step smaller."""
    first = str(exc).strip().split(". ")[0] or type(exc).__name__
    return (
        f"out of memory ({first}); lower trainer.micro_batch_tokens ({cfg.trainer.micro_batch_tokens}) or "
        f"engine.max_batch_size ({cfg.engine.max_batch_size}), or size the KV cache once with "
        f"engine.kv_cache_fraction (run dir: {cfg.output_dir})"
    )


def report(summary: RunSummary, cfg: TrainConfig, args: argparse.Namespace) -> int:
    """Print the final table and return 0; a run that stopped broken prints its one line instead, exit 3; one
    stopped by a signal says so, exit 128 + the signal's number."""
    if summary.stopped:
        print(
            f"miles {args.command}: stopped by {summary.stopped} after step {summary.steps_done}; its checkpoint "
            f"is in {summary.output_dir}/checkpoints: continue with --resume",
            file=sys.stderr,
        )
        return 128 + int(getattr(signal, summary.stopped))
    if summary.broken:
        print(
            f"miles {args.command}: the run is broken: {summary.broken} (run dir: {summary.output_dir})",
            file=sys.stderr,
        )
        return 3
    print(format_summary(summary, cfg))
    return 0


def cli_argv(args: argparse.Namespace) -> list[str]:
    """The ``miles train`` / ``miles sft`` command line that `args` (the CLI's namespace) was parsed from."""
    argv = [args.command, "--config", str(args.config)]
    for override in getattr(args, "overrides", None) or []:
        argv += ["--set", override]
    if getattr(args, "resume", False):
        argv.append("--resume")
    if getattr(args, "extend", False):
        argv.append("--extend")
    for flag in ("output_dir", "seed", "backend", "tp", "pp", "dp"):
        value = getattr(args, flag, None)
        if value is not None:
            argv += [f"--{flag.replace('_', '-')}", str(value)]
    return argv


def run_from_cli(args: argparse.Namespace) -> int:
    return run_loop(config_from_args(args), args, resume=args.resume)


def eval_from_cli(args: argparse.Namespace) -> int:
    """`miles eval`: the held-out table of the config's model, or of `--run`'s newest weights; exit 3 when a
    result is no score (its sessions failed in the engines)."""
    import time

    from miles.training.eval_run import format_eval, run_eval

    run_dir = Path(args.run) if args.run else None
    if args.output_dir is None:  # a new folder per evaluation, beside the run (or the config's output_dir)
        base = (
            run_dir
            if run_dir is not None
            else Path(load_train_config(args.config, list(args.overrides)).output_dir)
        )
        args.output_dir = str(base / time.strftime("eval-%Y%m%d-%H%M%S"))
    cfg = config_from_args(args)
    report = asyncio.run(run_eval(cfg, run_dir=run_dir))
    if report.invalid:
        print(
            f"miles eval: no score: {'; '.join(report.invalid)} (sessions in {cfg.output_dir})",
            file=sys.stderr,
        )
        return 3
    print(format_eval(report))
    return 0


def sft_from_cli(args: argparse.Namespace) -> int:
    """SFT only: the config's `sft` stage with RL steps set to zero."""
    cfg = config_from_args(args)
    cfg = dataclasses.replace(cfg, steps=0, sft=dataclasses.replace(cfg.sft, enabled=True))
    return run_loop(cfg, args, resume=False)
