"""A real Redis (Debian's `redis-server`) on a free local port, in memory only: the external store
Ray's GCS fault tolerance keeps the cluster's tables in."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from common.ports import free_port

READY_TIMEOUT_S = 30


@contextmanager
def running(binary: str, log_dir: Path) -> Iterator[str]:
    """Redis listening on 127.0.0.1 while the block runs; yields its address (host:port)."""
    port = free_port()
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(command, stdout=(log_dir / "redis.log").open("w"), stderr=subprocess.STDOUT)
    try:
        _wait_ready(port, process)
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=30)


def _wait_ready(port: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"redis-server exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as connection:
                connection.sendall(b"PING\r\n")
                if connection.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"redis-server did not answer PING on port {port} in {READY_TIMEOUT_S} s")
