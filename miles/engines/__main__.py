"""`python -m miles.engines --model PATH|tiny --host 127.0.0.1 --port 30001`: serve the embedded engine."""

from __future__ import annotations

import argparse

from miles.engines.server import run_server


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m miles.engines", description=__doc__)
    ap.add_argument("--model", required=True, help="an HF checkpoint folder, or 'tiny'")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30001)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-batch-size", type=int, default=64)
    args = ap.parse_args(argv)
    run_server(args.model, args.host, args.port, device=args.device, max_batch_size=args.max_batch_size)


if __name__ == "__main__":
    main()
