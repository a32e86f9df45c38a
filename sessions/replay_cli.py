"""`miles replay FILE [--session ID] [--check] [--rescore] [--tito]`: inspect a run's sessions.jsonl."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

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
    list_table,
    render_session,
    rescore,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="miles replay", description="List, render and re-check recorded sessions "
                                "(no engine needed).")
    p.add_argument("file", help="a sessions.jsonl written by a run")
    p.add_argument("--session", help="render (or check) only this session id")
    p.add_argument("--env", help="only sessions of this env id")
    p.add_argument("--min-reward", type=float)
    p.add_argument("--max-reward", type=float)
    p.add_argument("--termination", action="append", help="only sessions that ended so (repeatable)")
    p.add_argument("--check", action="store_true", help="re-drive the env with the recorded outputs and "
                   "report the first divergence")
    p.add_argument("--rescore", action="store_true", help="recompute rewards with the current reward functions")
    p.add_argument("--tito", action="store_true", help="verify the token alignment against the tokenizer")
    p.add_argument("--tokenizer", help="tokenizer for --tito and the token view: 'tiny', a path or an HF name "
                   "(default: the recorded one)")
    p.add_argument("--parser", help="re-parse recorded texts with this tool-call parser during --check")
    p.add_argument("--env-factory", help="module:callable that builds the env (default: the registry, then "
                   "the recorded class)")
    return p


def load_tokenizer(name: str) -> Any:
    """'tiny' (or a recorded 'family:miles-tiny') -> the tiny tokenizer; else `AutoTokenizer`."""
    family, _, path = name.rpartition(":") if ":" in name and not name.startswith("/") else ("", "", name)
    if path in ("tiny", "miles-tiny") or (family == "tiny" and not path):
        from miles.tiny import load_tiny_tokenizer

        return load_tiny_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def main(argv: list[str] | None = None, *, stdout: Any = None) -> int:
    """Run the replay command. Exit status: 0 all fine, 1 a check found a divergence or misalignment,
    2 bad input (unreadable file, unknown session, env or tokenizer that cannot be rebuilt)."""
    args = build_parser().parse_args(argv)
    out = console_for(stdout or sys.stdout)
    err = console_for(sys.stderr)
    try:
        result = read_sessions(args.file)
    except OSError as exc:
        err.print(f"cannot read {args.file}: {exc}")
        return 2
    for bad in result.bad_lines:
        what = "torn last line (the writer was killed mid-write)" if bad.torn_tail else "bad line"
        err.print(f"skipped {what} {bad.line_no} at byte {bad.offset}: {bad.reason}")
    try:
        records = filter_records(result.records, env=args.env, min_reward=args.min_reward,
                                 max_reward=args.max_reward, termination=args.termination, session=args.session)
    except ValueError as exc:
        err.print(str(exc))
        return 2
    if args.session and not records:
        err.print(f"no session {args.session!r} in {args.file} (with the given filters)")
        return 2
    try:
        if args.check or args.rescore or args.tito:
            return _run_checks(args, records, out)
        if args.session:
            tok = load_tokenizer(args.tokenizer) if args.tokenizer else None
            for r in records:
                out.print(render_session(r, tok))
            return 0
    except ReplayError as exc:
        err.print(str(exc))
        return 2
    out.print(list_table(records))
    out.print(f"{len(records)} of {len(result.records)} sessions")
    return 0


def _run_checks(args: argparse.Namespace, records: list[SessionRecord], out: Any) -> int:
    factory = env_for
    if args.env_factory:
        try:
            fn = _import_path(args.env_factory)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ReplayError(f"cannot import --env-factory {args.env_factory!r}: {exc}") from exc

        def factory(_: SessionRecord) -> Any:
            return fn()
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
                out.print(f"{r.session_id}: check ok ({res.steps} steps)")
            else:
                status = 1
                out.print(f"{r.session_id}: DIVERGED at {res.divergence.describe() if res.divergence else res.error}")
        if args.rescore:
            rs = asyncio.run(rescore(r, factory))
            mark = "CHANGED" if rs.changed else "same"
            out.print(f"{r.session_id}: reward {rs.recorded_reward:.4g} -> {rs.reward:.4g} ({mark}) "
                      f"{rs.recorded_components} -> {rs.components}")
        if args.tito:
            name = args.tokenizer or r.tokenizer
            if name not in tito_cache:
                from miles.tito import TITOTokenizer

                try:
                    tito_cache[name] = TITOTokenizer(load_tokenizer(name))
                except Exception as exc:
                    raise ReplayError(f"cannot load tokenizer {name!r}: {exc}") from exc
            tc = check_tito(r, tito_cache[name])
            if not tc.ok:
                status = 1
            out.print(f"{r.session_id}: tito {'ok' if tc.ok else 'MISALIGNED'}: {tc.message}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
