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


def free_run(length: int) -> int:
    """The first of `length` consecutive ports free on every address now: the candidates the tests
    below narrow free_port to (a fixed port could be another process's: make test runs its Ray
    clusters beside these tests)."""
    while True:
        first = ports.free_port(host="")
        if all(bindable(first + i) for i in range(1, length)):
            return first


def bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return False
        return True


def test_a_port_in_use_is_not_given(monkeypatch: pytest.MonkeyPatch):
    lowest = free_run(1)
    with socket.socket() as held:
        held.bind(("127.0.0.1", lowest))
        held.listen()
        monkeypatch.setattr(ports, "LOWEST_PORT", lowest)
        monkeypatch.setattr(ports, "_ephemeral_start", lambda: lowest + 1)  # one candidate
        port = ports.free_port()
    assert port != lowest  # the kernel's pick instead


def test_ports_for_every_address_are_distinct_and_free_on_each(monkeypatch: pytest.MonkeyPatch):
    """A port held on one address (a Ray process on the node's) is not given for a server that
    binds them all; and no port is given twice."""
    lowest = free_run(3)
    with socket.socket() as held:
        held.bind(("127.0.0.2", lowest))
        held.listen()
        monkeypatch.setattr(ports, "LOWEST_PORT", lowest)
        monkeypatch.setattr(ports, "_ephemeral_start", lambda: lowest + 3)  # three candidates
        given = ports.free_ports(2, host="")
    assert sorted(given) == [lowest + 1, lowest + 2]
    for port in given:
        with socket.socket() as server:
            server.bind(("", port))
