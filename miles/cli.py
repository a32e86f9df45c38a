"""The `miles` command line. It wires every floor together, so it imports them lazily inside each command."""

from __future__ import annotations

import argparse
import sys


def _cmd_envs(args: argparse.Namespace) -> int:
    from miles.envs import registry

    for env_id, spec in sorted(registry().items()):
        print(f"{env_id:24s} {spec.entry_point if isinstance(spec.entry_point, str) else spec.entry_point.__name__}")
    return 0


def _cmd_rollout(args: argparse.Namespace) -> int:
    from miles.engines.server import run_server

    run_server(args.model, host=args.host, port=args.port, device=args.device)
    return 0


def _cmd_replay(args: argparse.Namespace, rest: list[str]) -> int:
    from miles.sessions.replay_cli import main as replay_main

    return replay_main(rest)


def _cmd_tito(args: argparse.Namespace) -> int:
    from miles.tito.check import format_report, run_check

    report = run_check(args.tokenizer)
    print(format_report(report))
    return 0 if report.ok else 1


def _cmd_train(args: argparse.Namespace) -> int:
    from miles.trainers.run import run_from_cli

    return run_from_cli(args)


def _cmd_sft(args: argparse.Namespace) -> int:
    from miles.trainers.run import sft_from_cli

    return sft_from_cli(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every `miles` subcommand."""
    parser = argparse.ArgumentParser(prog="miles", description="RL post-training of multi-turn tool-using agents")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("envs", help="list the registered environments")

    p = sub.add_parser("rollout", help="serve a model over SGLang's native HTTP API")
    p.add_argument("--model", default="tiny", help="an HF checkpoint folder, or 'tiny'")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30001)
    p.add_argument("--device", default="cpu")

    sub.add_parser("replay", help="inspect, check or rescore recorded sessions (see `miles replay --help`)",
                   add_help=False)

    p = sub.add_parser("tito", help="token-in/token-out tools")
    tito_sub = p.add_subparsers(dest="tito_command", required=True)
    c = tito_sub.add_parser("check", help="check a tokenizer's chat template for append-only rendering")
    c.add_argument("--tokenizer", required=True, help="'tiny', 'qwen3', 'llama3' or a tokenizer folder")

    for name, help_text in (("train", "run an agent-RL experiment from a YAML config"),
                            ("sft", "supervised warm-start on an environment's oracle demonstrations")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--config", required=True, help="a YAML config file")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="dotted override, e.g. --set trainer.lr=1e-5 (repeatable)")
        p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the run dir")
        p.add_argument("--output-dir", default=None, help="overrides the config's output_dir")
        p.add_argument("--seed", type=int, default=None, help="overrides the config's seed")
        p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                       help="a module (or .py path) that registers your env; adds to env.import (repeatable)")
        if name == "train":
            p.add_argument("--backend", choices=["torch", "megatron"], default=None)
            p.add_argument("--tp", type=int, default=None)
            p.add_argument("--pp", type=int, default=None)
            p.add_argument("--dp", type=int, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `miles` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "replay":
        return _cmd_replay(argparse.Namespace(), argv[1:])
    args = build_parser().parse_args(argv)
    handlers = {"envs": _cmd_envs, "rollout": _cmd_rollout, "tito": _cmd_tito, "train": _cmd_train,
                "sft": _cmd_sft}
    from miles.config import ConfigError

    try:
        return handlers[args.command](args)
    except ConfigError as exc:  # a bad config key or value: name it, no traceback
        print(f"miles {args.command}: config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
