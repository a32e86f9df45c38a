"""The `miles` command line. It wires every floor together, so it imports them lazily inside each command."""

from __future__ import annotations

import argparse
import sys


def _cmd_envs(args: argparse.Namespace) -> int:
    from miles.envs import registry

    for env_id, spec in sorted(registry().items()):
        print(
            f"{env_id:24s} {spec.entry_point if isinstance(spec.entry_point, str) else spec.entry_point.__name__}"
        )
    return 0


def _cmd_rollout(args: argparse.Namespace) -> int:
    from miles.engines.launcher import rollout_from_cli

    if args.openai is not None:  # check the endpoint's settings here, in one line, before any server starts
        from miles.sessions.openai.routes import endpoint_tokenizer, openai_config

        endpoint_tokenizer(args.model, openai_config(args.openai))

    return rollout_from_cli(args)


def _cmd_replay(args: argparse.Namespace, rest: list[str]) -> int:
    from miles.sessions.replay_cli import main as replay_main

    return replay_main(rest)


def _cmd_tito(args: argparse.Namespace) -> int:
    from miles.config import ConfigError
    from miles.tito import ChatTemplateError, TemplateTokenizerMismatchError
    from miles.tito.check import format_report, run_check

    try:
        report = run_check(args.tokenizer, chat_template=args.chat_template)
    except (ChatTemplateError, TemplateTokenizerMismatchError) as exc:
        raise ConfigError("--chat-template", str(exc)) from None
    print(format_report(report))
    return 0 if report.ok else 1


def _cmd_top(args: argparse.Namespace) -> int:
    from miles.observability.top import run_top

    return run_top(args.url, once=args.once, interval=args.interval)


def _cmd_train(args: argparse.Namespace) -> int:
    from miles.training.command import run_from_cli

    return run_from_cli(args)


def _cmd_sft(args: argparse.Namespace) -> int:
    from miles.training.command import sft_from_cli

    return sft_from_cli(args)


def _cmd_eval(args: argparse.Namespace) -> int:
    from miles.training.command import eval_from_cli

    return eval_from_cli(args)


def _cmd_export(args: argparse.Namespace) -> int:
    from miles.training.export import export_adapter

    out = export_adapter(args.run, args.adapter, args.out, checkpoint=args.checkpoint, merge=args.merge)
    print(f"wrote {'the base merged with ' if args.merge else ''}adapter {args.adapter} to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every `miles` subcommand."""
    parser = argparse.ArgumentParser(
        prog="miles", description="RL post-training of multi-turn tool-using agents"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("envs", help="list the registered environments")

    p = sub.add_parser(
        "rollout",
        help="launch rollout engines (embedded or SGLang), several behind the sglang-router",
        description="Start --dp servers (the embedded engine, or `python -m sglang.launch_server`) on consecutive "
        "ports from --port, front them with the real sglang-router when there are several, print the engine "
        "section for a config, and serve until Ctrl-C or SIGTERM. Other SGLang flags go after `--`, e.g. "
        "`miles rollout --engine sglang --model Qwen/Qwen3-8B --tp 8 -- --attention-backend fa3`.",
    )
    p.add_argument("--engine", choices=["embedded", "sglang"], default="embedded")
    p.add_argument(
        "--model",
        default="tiny",
        help="embedded: 'tiny', 'tiny-<size>', 'smollm2-135m' or an HF folder; sglang: an HF folder or id",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs per server (sglang)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages per server (sglang)")
    p.add_argument("--dp", type=int, default=1, help="number of servers (each on its own tp*pp GPUs)")
    p.add_argument("--context-length", type=int, default=None, help="caps the model's maximum context")
    p.add_argument("--mem-fraction", type=float, default=None, help="SGLang's --mem-fraction-static")
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=None,
        help="requests decoding at once per server (embedded: its max batch size)",
    )
    p.add_argument("--dtype", default=None, help="auto, half, float16, bfloat16, float or float32")
    p.add_argument(
        "--device", default=None, help="embedded: cpu (default), cuda (server i on GPU base+i) or cuda:N"
    )
    p.add_argument("--host", default="127.0.0.1", help="the address servers bind; HOST:PORT also sets --port")
    p.add_argument("--port", type=int, default=None, help="the first server's port (default 30001)")
    p.add_argument("--base-gpu-id", type=int, default=0, help="the first GPU the servers use")
    p.add_argument(
        "--router",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="front the servers with the sglang-router (default: when --dp > 1)",
    )
    p.add_argument("--router-port", type=int, default=None, help="default: the port after the servers'")
    p.add_argument(
        "--router-policy",
        default="manual",
        help="manual (default: a session's routing key picks its worker), cache_aware, round_robin, ...",
    )
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--log-dir", default=None, help="where the servers' logs go (default: a new temp folder)")
    p.add_argument("--dry-run", action="store_true", help="print the command lines and exit")
    p.add_argument(
        "--api-key",
        default=None,
        help="close generation and the info routes to holders of this key (clients read it from "
        "MILES_API_KEY); the control routes always take the admin token",
    )
    p.add_argument(
        "--openai",
        nargs="?",
        const="",
        action="append",
        metavar="KEY=VALUE",
        help="also serve the OpenAI-compatible session endpoint on every embedded server (repeatable "
        "settings, e.g. --openai history_mismatch=fork)",
    )
    p.add_argument("sglang_args", nargs="*", metavar="-- SGLANG_FLAGS", help="passed to every SGLang server")

    sub.add_parser(
        "replay",
        help="inspect, check or rescore recorded sessions (see `miles replay --help`)",
        add_help=False,
    )

    p = sub.add_parser("tito", help="token-in/token-out tools")
    tito_sub = p.add_subparsers(dest="tito_command", required=True)
    c = tito_sub.add_parser("check", help="check a tokenizer's chat template for append-only rendering")
    c.add_argument(
        "--tokenizer", required=True, help="'tiny', 'qwen3', 'llama3', 'smollm2-135m' or a tokenizer folder"
    )
    c.add_argument(
        "--chat-template",
        default=None,
        help="a template override: 'chatml-tools', 'llama3-tools', 'compact' or a .jinja file",
    )

    p = sub.add_parser("top", help="a live terminal view of a /metrics endpoint (miles train, miles rollout)")
    p.add_argument("url", help="host:port or URL of the endpoint, e.g. 127.0.0.1:9400")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between scrapes (default 2)")

    p = sub.add_parser(
        "export", help="write one LoRA adapter of a run as a PEFT folder (or merged into the base)"
    )
    p.add_argument("--run", required=True, help="the run folder (output_dir of a miles train with adapters:)")
    p.add_argument("--adapter", required=True, metavar="NAME", help="the adapter to export")
    p.add_argument("--out", required=True, help="the folder to write")
    p.add_argument(
        "--checkpoint", default=None, help="a step_* checkpoint folder (default: the run's newest)"
    )
    p.add_argument(
        "--merge", action="store_true", help="merge the adapter into the base: an ordinary HF folder"
    )

    for name, help_text in (
        ("train", "run an agent-RL experiment from a YAML config"),
        ("sft", "supervised warm-start on an environment's oracle demonstrations"),
        (
            "eval",
            "held-out success per env (the config's env and eval.envs) of the config's "
            "model or of a run's newest weights",
        ),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--config", required=True, help="a YAML config file")
        p.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="dotted override, e.g. --set trainer.lr=1e-5 (repeatable)",
        )
        if name == "eval":
            p.add_argument(
                "--run", default=None, help="a `miles train` run folder: evaluate its newest checkpoint"
            )
        else:
            p.add_argument(
                "--resume", action="store_true", help="continue from the newest checkpoint in the run dir"
            )
            p.add_argument(
                "--extend",
                action="store_true",
                help="with --resume: a whole new max_seconds (default: what the budget has left)",
            )
        p.add_argument("--output-dir", default=None, help="overrides the config's output_dir")
        p.add_argument("--seed", type=int, default=None, help="overrides the config's seed")
        p.add_argument(
            "--import",
            dest="imports",
            action="append",
            default=[],
            metavar="MODULE",
            help="a module (or .py path) that registers your env; adds to env.import (repeatable)",
        )
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
    handlers = {
        "envs": _cmd_envs,
        "rollout": _cmd_rollout,
        "tito": _cmd_tito,
        "top": _cmd_top,
        "train": _cmd_train,
        "sft": _cmd_sft,
        "eval": _cmd_eval,
        "export": _cmd_export,
    }
    from miles.config import ConfigError

    try:
        return handlers[args.command](args)
    except ConfigError as exc:  # a bad config key or value: name it, no traceback
        print(f"miles {args.command}: config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
