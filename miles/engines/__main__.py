"""`python -m miles.engines --model tiny|tiny-<size>|smollm2-135m|FOLDER --port 30001`: serve one embedded
engine over SGLang's native HTTP API (`miles rollout` starts these, one per server)."""

from __future__ import annotations

import argparse
import sys

from miles.engines.errors import InvalidRequestError
from miles.engines.server import DTYPES, run_server


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m miles.engines", description=__doc__)
    ap.add_argument("--model", required=True, help="'tiny', 'tiny-<size>', 'smollm2-135m' or an HF checkpoint folder")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30001)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--context-length", type=int, default=None, help="caps the model's maximum positions")
    ap.add_argument("--dtype", choices=list(DTYPES), default="auto")
    ap.add_argument("--engine-id", default="embedded-0")
    ap.add_argument("--openai", nargs="?", const="", action="append", metavar="KEY=VALUE",
                    help="also serve the OpenAI-compatible session endpoint (miles.sessions.openai_routes); repeat "
                         "for its settings, e.g. --openai chat_template=compact --openai session.history_mismatch=fork")
    args = ap.parse_args(argv)
    kwargs = {"device": args.device, "max_batch_size": args.max_batch_size, "context_length": args.context_length,
              "dtype": args.dtype, "engine_id": args.engine_id}
    try:
        if args.openai is not None:  # a higher floor, imported only here (engines never import sessions)
            from miles.config import ConfigError
            from miles.sessions.openai_routes import run_engine_server_with_openai

            try:
                run_engine_server_with_openai(args.model, args.host, args.port, overrides=args.openai, **kwargs)
            except ConfigError as exc:
                print(f"python -m miles.engines: {exc}", file=sys.stderr)
                return 2
        else:
            run_server(args.model, args.host, args.port, **kwargs)
    except InvalidRequestError as exc:
        print(f"python -m miles.engines: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
