"""A child process of ours (the engine core, a tensor-parallel worker) and the socket it talks
over. Started as `python -m <module> <fd>`, not by multiprocessing's spawn: that re-imports the
caller's main module, which breaks any script that builds an engine at import time."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
from multiprocessing.connection import Connection


class Channel:
    """One end of the socket pair, carrying pickled objects. Plain pickle, not the Connection's own
    (multiprocessing's ForkingPickler, with torch's reducers): that sends a tensor, a seeded
    request's generator state among them, as a shared-memory handle that only a process started
    by multiprocessing may open."""

    def __init__(self, fd: int) -> None:
        self._connection = Connection(fd)

    def send(self, message: object) -> None:
        self._connection.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self) -> object:
        return pickle.loads(self._connection.recv_bytes())

    def poll(self, timeout: float) -> bool:
        return self._connection.poll(timeout)


def start_child(module: str) -> tuple[subprocess.Popen, Channel]:
    """`python -m module <fd>` and our end of its socket; its death reads as end-of-file here."""
    ours, theirs = socket.socketpair()
    # This process's import path: a Ray worker may have the app on it only through its runtime_env.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    process = subprocess.Popen(
        [sys.executable, "-m", module, str(theirs.fileno())], pass_fds=(theirs.fileno(),), env=env
    )
    theirs.close()
    return process, Channel(ours.detach())
