"""Spawning a trainer's ranks with torchrun (``python -m torch.distributed.run``), for either backend.

``miles train --dp 2`` (torch, FSDP2) or ``--backend megatron --tp 2``: the CLI calls `relaunch_under_torchrun`
first; outside a worker it re-executes the same command line under torchrun with ``--nproc-per-node N`` and
returns torchrun's exit status; inside a worker it returns None and the command goes on to build its trainer
(rank 0 also owns rollout and weight sync). Ranks run with ``OMP_NUM_THREADS=1`` unless the caller set it.

``python -m miles.training.torchrun <torchrun args>`` is torchrun whose report of a failed rank is one line (each
rank prints its own error): what `torchrun_command` runs.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence

from miles.ports import free_port

WORKER_ENV = "MILES_TORCHRUN_WORKER"


def in_torchrun_worker() -> bool:
    """True inside a process that torchrun started (it sets RANK / WORLD_SIZE / LOCAL_RANK)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def torchrun_command(
    target: Sequence[str], nproc_per_node: int, *, master_port: int | None = None, python: str | None = None
) -> list[str]:
    """The argv that runs `target` (``["-m", "miles.cli", "train", ...]`` or ``["script.py", ...]``) on
    ``nproc_per_node`` local ranks."""
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be >= 1, got {nproc_per_node}")
    if not target:
        raise ValueError("torchrun needs a script or '-m module' to run")
    port = master_port or free_port()
    return [
        python or sys.executable,
        "-m",
        "miles.training.torchrun",
        "--standalone" if master_port is None else f"--master-port={port}",
        "--nproc-per-node",
        str(nproc_per_node),
        *target,
    ]


def launch_torchrun(
    target: Sequence[str],
    nproc_per_node: int,
    *,
    env: Mapping[str, str] | None = None,
    master_port: int | None = None,
    timeout_s: float | None = None,
) -> int:
    """Run `target` under torchrun and wait; returns torchrun's exit status (non-zero if any rank failed)."""
    full_env = {**os.environ, **(env or {}), WORKER_ENV: "1"}
    full_env.setdefault("OMP_NUM_THREADS", "1")
    cmd = torchrun_command(target, nproc_per_node, master_port=master_port)
    return subprocess.run(cmd, env=full_env, timeout=timeout_s, check=False).returncode


def relaunch_under_torchrun(
    nproc_per_node: int, argv: Sequence[str] | None = None, *, module: str = "miles.cli"
) -> int | None:
    """From the CLI: re-run ``python -m <module> <argv>`` under torchrun unless this already is a worker.

    Returns torchrun's exit status, or None when the caller is a worker (or one rank suffices) and should
    go on in-process.
    """
    if in_torchrun_worker() or nproc_per_node <= 1:
        return None
    args = list(sys.argv[1:] if argv is None else argv)
    return launch_torchrun(["-m", module, *args], nproc_per_node)


def mute_launcher_logs() -> None:
    """Silence torchrun's agent (its notices and failure log lines), also the loggers it creates later with
    levels of their own: their records stop at the two parents, which keep them (so Python's last-resort
    handler does not print them either)."""
    for name in ("torch.distributed.elastic", "torch.distributed.run"):
        parent = logging.getLogger(name)
        parent.propagate = False
        if not any(isinstance(h, logging.NullHandler) for h in parent.handlers):
            parent.addHandler(logging.NullHandler())


def torchrun_main(argv: Sequence[str]) -> int:
    """torchrun on `argv`; a failed rank is reported in one line, not the launcher's traceback and notices."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    mute_launcher_logs()
    try:
        run(parse_args(list(argv)))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        how = (
            f"was killed by {signal.Signals(-failure.exitcode).name}"
            if failure.exitcode < 0
            else f"exited with status {failure.exitcode}"
        )
        print(f"miles: rank {rank} {how} (its own output is above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(torchrun_main(sys.argv[1:]))
