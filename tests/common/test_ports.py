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


def test_ports_for_every_address_are_distinct_and_free_on_each(monkeypatch: pytest.MonkeyPatch):
    """A port held on one address (a Ray process on the node's) is not given for a server that
    binds them all; and no port is given twice."""
    with socket.socket() as held:
        held.bind(("127.0.0.2", ports.LOWEST_PORT))
        held.listen()
        monkeypatch.setattr(ports, "_ephemeral_start", lambda: ports.LOWEST_PORT + 3)  # three candidates
        given = ports.free_ports(2, host="")
    assert sorted(given) == [ports.LOWEST_PORT + 1, ports.LOWEST_PORT + 2]
    for port in given:
        with socket.socket() as server:
            server.bind(("", port))
