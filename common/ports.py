"""A free TCP port for a server that is started next (a rendezvous, a test cluster's proxies).

Picked below the kernel's ephemeral range and above Ray's worker ports (10002-19999 by default):
a socket bound to port 0, as Ray's many processes bind theirs, gets a port of the ephemeral
range, so a port found free there could be taken by one of them before our server binds it (CI
saw a node's Serve proxy fail to bind a port that a Ray agent had taken meanwhile)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST_PORT = 20000  # above Ray's default max_worker_port
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_TRIES = 200


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, outside the ephemeral range where there is room for one."""
    below = range(LOWEST_PORT, _ephemeral_start())
    draws = random.SystemRandom().sample(below, min(_TRIES, len(below)))  # not the seeded global RNG
    for port in draws:
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as probe:  # no room below the ephemeral range (or all taken): the kernel's pick
        probe.bind((host, 0))
        return probe.getsockname()[1]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports, each free on `host` now (`""`: on every address, as a server that
    binds 0.0.0.0 needs: a port held on any one of them would fail its bind). Distinct: ports
    drawn one by one could repeat, and two servers would then race for one."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port(host)
        if port not in ports:
            ports.append(port)
    return ports


def _ephemeral_start() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the IANA range starts here
        return 49152
