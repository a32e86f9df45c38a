"""`python -m miles.engines --model tiny|tiny-<size>|smollm2-135m|FOLDER --port 30001`: serve one embedded
engine over SGLang's native HTTP API (`miles rollout` starts these, one per server)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from miles.engines.errors import InvalidRequestError
from miles.engines.server import DTYPES, run_server


def server_parser(prog: str = "python -m miles.engines") -> argparse.ArgumentParser:
    """The flags of one embedded engine server (shared by the server with the OpenAI endpoint mounted)."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__)
    ap.add_argument(
        "--model", required=True, help="'tiny', 'tiny-<size>', 'smollm2-135m' or an HF checkpoint folder"
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30001)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--context-length", type=int, default=None, help="caps the model's maximum positions")
    ap.add_argument("--dtype", choices=list(DTYPES), default="auto")
    ap.add_argument("--engine-id", default="embedded-0")
    return ap


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`load_engine`'s keywords from the parsed flags."""
    return {
        "device": args.device,
        "max_batch_size": args.max_batch_size,
        "context_length": args.context_length,
        "dtype": args.dtype,
        "engine_id": args.engine_id,
    }


def main(argv: list[str] | None = None) -> int:
    args = server_parser().parse_args(argv)
    try:
        run_server(args.model, args.host, args.port, **engine_kwargs(args))
    except InvalidRequestError as exc:
        print(f"python -m miles.engines: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
