"""`miles.ports`: free ports for servers started next, and runs of them for `miles rollout --dp N`."""

from __future__ import annotations

import contextlib
import socket

from miles import ports
from miles.ports import free_ports


def test_a_run_of_free_ports_binds_together():
    first = free_ports(4)
    with contextlib.ExitStack() as held:
        for port in range(first, first + 4):
            held.enter_context(socket.socket()).bind(("127.0.0.1", port))


def test_a_run_that_holds_a_taken_port_is_passed_over(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        real = ports.free_port
        offers = iter([busy - 1])  # the first run, busy-1 .. busy+1, holds the taken port; then real offers
        monkeypatch.setattr(ports, "free_port", lambda host="127.0.0.1": next(offers, None) or real(host))
        first = free_ports(3)
    assert first != busy - 1
