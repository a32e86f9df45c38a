"""`miles replay FILE [--session ID] [--check] [--rescore] [--tito]`: inspect a run's sessions.jsonl.

Exit status: 0 all fine; 1 a check found a divergence or a misalignment; 2 bad usage or input (unreadable
file, unknown session, a module that cannot be imported, an env or tokenizer that cannot be rebuilt).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from miles.config import ConfigError
from miles.envs.recipe import error_line
from miles.sessions.recorder import read_sessions
from miles.sessions.records import SessionRecord
from miles.sessions.replay import (
    ReplayError,
    _import_path,
    check,
    check_tito,
    console_for,
    env_for,
    filter_records,
    is_agent_record,
    list_table,
    render_session,
    rescore,
    tokenizer_spec_for,
)
from miles.tito.tokenizer import TITOTokenizer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="miles replay",
        description="List, render and re-check recorded sessions "
        "(no engine needed). Exit status: 0 fine, 1 divergence or misalignment, 2 bad "
        "usage or an env/tokenizer that cannot be rebuilt.",
    )
    p.add_argument("file", help="a sessions.jsonl written by a run")
    p.add_argument("--session", help="render (or check) only this session id")
    p.add_argument("--env", help="only sessions of this env id")
    p.add_argument("--min-reward", type=float)
    p.add_argument("--max-reward", type=float)
    p.add_argument("--termination", action="append", help="only sessions that ended so (repeatable)")
    p.add_argument(
        "--check",
        action="store_true",
        help="re-drive the env with the recorded outputs and report the first divergence",
    )
    p.add_argument(
        "--rescore", action="store_true", help="recompute rewards with the current reward functions"
    )
    p.add_argument("--tito", action="store_true", help="verify the token alignment against the tokenizer")
    p.add_argument(
        "--tokenizer",
        help="tokenizer for --tito and the token view: 'tiny', 'qwen3', 'llama3', "
        "'smollm2-135m' or a folder (default: the recorded one)",
    )
    p.add_argument(
        "--chat-template",
        help="chat-template override for --tito: 'compact' or a .jinja file; "
        "'' for the tokenizer's own (default: the recorded one)",
    )
    p.add_argument("--parser", help="re-parse recorded texts with this tool-call parser during --check")
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import this module (a name or a .py path) first, e.g. the one that registers your "
        "env (repeatable; the recorded modules are imported too)",
    )
    p.add_argument(
        "--env-factory",
        help="module:callable that builds the env (default: the recorded recipe, "
        "then the registry, then the recorded class)",
    )
    return p


def _load_tokenizer(name: str) -> Any:
    from miles.tito import load_tokenizer

    return load_tokenizer(name)


def main(argv: list[str] | None = None, *, stdout: Any = None) -> int:
    """Run the replay command; returns the exit status (see the module docstring)."""
    args = build_parser().parse_args(argv)
    out = console_for(stdout or sys.stdout)
    err = console_for(sys.stderr)
    try:
        result = read_sessions(args.file)
    except OSError as exc:
        err.print(f"cannot read {args.file}: {exc}")
        return 2
    for bad in result.bad_lines[:20]:
        what = "torn last line (the writer was killed mid-write)" if bad.torn_tail else "bad line"
        err.print(f"skipped {what} {bad.line_no} at byte {bad.offset}: {bad.reason}")
    if len(result.bad_lines) > 20:
        err.print(f"... and {len(result.bad_lines) - 20} more bad lines")
    if not result.records and (result.bad_lines or args.check or args.rescore or args.tito):
        err.print(
            f"miles replay: {args.file} holds no session record ({len(result.bad_lines)} bad lines): "
            "give the sessions.jsonl or eval_sessions.jsonl of a run"
        )
        return 2
    try:
        records = filter_records(
            result.records,
            env=args.env,
            min_reward=args.min_reward,
            max_reward=args.max_reward,
            termination=args.termination,
            session=args.session,
        )
    except ValueError as exc:
        err.print(str(exc))
        return 2
    if args.session and not records:
        err.print(f"no session {args.session!r} in {args.file} (with the given filters)")
        return 2
    try:
        if args.imports:
            from miles.envs import import_user_modules

            import_user_modules(args.imports)
        if args.check or args.rescore or args.tito:
            return _run_checks(args, records, out)
        if args.session:
            tok = _load_tokenizer(args.tokenizer) if args.tokenizer else None
            for r in records:
                out.print(render_session(r, tok))
            return 0
    except (ReplayError, ConfigError) as exc:
        err.print(f"miles replay: {exc}")
        return 2
    except Exception as exc:  # e.g. a tokenizer that cannot be loaded for the token view
        err.print(f"miles replay: {error_line(exc)}")
        return 2
    out.print(list_table(records))
    out.print(f"{len(records)} of {len(result.records)} sessions")
    return 0


def _factory(spec: str | None) -> Any:
    if not spec:
        return env_for
    try:
        fn = _import_path(spec)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ReplayError(f"cannot import --env-factory {spec!r}: {error_line(exc)}") from exc

    def factory(_: SessionRecord) -> Any:
        return fn()

    return factory


def _tito_for(args: argparse.Namespace, record: SessionRecord, cache: dict[str, Any]) -> tuple[Any, str]:
    """The TITO tokenizer that renders `record` (cached by spec), and a note when its chat template is not
    the one the session used."""
    spec = tokenizer_spec_for(record, tokenizer=args.tokenizer, chat_template=args.chat_template)
    key = json.dumps([spec.tokenizer, spec.chat_template, dict(spec.chat_template_kwargs)], sort_keys=True)
    if key not in cache:
        try:
            cache[key] = TITOTokenizer.from_spec(spec)
        except Exception as exc:
            raise ReplayError(
                f"cannot load tokenizer {spec.tokenizer!r} (chat template {spec.chat_template!r}) "
                f"for session {record.session_id}: {error_line(exc)}; pass --tokenizer / "
                "--chat-template"
            ) from exc
    tito = cache[key]
    recorded = record.tokenizer_spec.template_sha256 if record.tokenizer_spec else ""
    note = ""
    if recorded and tito.spec.template_sha256 != recorded:
        note = (
            f" (the chat template {tito.spec.chat_template or 'of the tokenizer'} is not the one recorded: "
            f"sha256 {tito.spec.template_sha256[:12]} vs {recorded[:12]})"
        )
    return tito, note


def _run_checks(args: argparse.Namespace, records: list[SessionRecord], out: Any) -> int:
    factory = _factory(args.env_factory)
    parser = None
    if args.parser:
        from miles.tools import get_parser

        parser = get_parser(args.parser)
    status = 0
    tito_cache: dict[str, Any] = {}
    for r in records:
        if args.check:
            res = asyncio.run(check(r, factory, parser=parser))
            if res.ok:
                what = "; an agent's session: the env's tool results and reward" if is_agent_record(r) else ""
                out.print(f"{r.session_id}: check ok ({res.steps} steps{what})")
            else:
                status = 1
                out.print(
                    f"{r.session_id}: DIVERGED at {res.divergence.describe() if res.divergence else res.error}"
                )
        if args.rescore:
            rs = asyncio.run(rescore(r, factory))
            mark = "CHANGED" if rs.changed else "same"
            out.print(
                f"{r.session_id}: reward {rs.recorded_reward:.4g} -> {rs.reward:.4g} ({mark}) "
                f"{rs.recorded_components} -> {rs.components}"
            )
        if args.tito:
            tito, note = _tito_for(args, r, tito_cache)
            tc = check_tito(r, tito)
            if not tc.ok:
                status = 1
            out.print(
                f"{r.session_id}: tito {'ok' if tc.ok else 'MISALIGNED'}: {tc.message}{'' if tc.ok else note}"
            )
    return status


if __name__ == "__main__":
    raise SystemExit(main())
