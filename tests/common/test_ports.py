"""common.ports.free_port: a port no socket bound to 0 can be given meanwhile (Ray's processes
bind theirs so), so a server started next can take it."""

from __future__ import annotations

import socket

import pytest

from common import ports


def test_a_free_port_lies_below_the_ephemeral_range_and_can_be_bound():
    port = ports.free_port()
    assert ports.LOWEST_PORT <= port < ports._ephemeral_start()
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))


def test_a_port_in_use_is_not_given(monkeypatch: pytest.MonkeyPatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports.LOWEST_PORT))
        held.listen()
        monkeypatch.setattr(ports, "_ephemeral_start", lambda: ports.LOWEST_PORT + 1)  # one candidate
        port = ports.free_port()
    assert port != ports.LOWEST_PORT  # the kernel's pick instead
