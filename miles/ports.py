"""Free TCP ports on this machine, for servers and process-group rendezvous that are started next.

A port is free when it is asked for; another process can still take it before the server binds it. Asking
for a run of consecutive ports at once (`free_ports`) at least makes every port of the run free together, as
`miles rollout --dp N` needs (its servers take consecutive ports).
"""

from __future__ import annotations

import contextlib
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(count: int, host: str = "127.0.0.1", attempts: int = 100) -> int:
    """The first of `count` consecutive TCP ports that are all free right now; `OSError` if no run is found."""
    for _ in range(attempts):
        first = free_port(host)
        if first + count - 1 > 65535:
            continue
        with contextlib.ExitStack() as held:
            try:
                for port in range(first, first + count):
                    held.enter_context(socket.socket()).bind((host, port))
            except OSError:
                continue
            return first
    raise OSError(f"no {count} consecutive free ports on {host} after {attempts} tries")
