"""How a prompt's KV blocks move from a prefill replica to a decode replica: one interface
(`KvConnector`: publish on the prefill side, fetch once on the decode side), four ways.

- `shared_memory`: a file in /dev/shm that a reader on the same node maps and unlinks (no copy
  beyond the publisher's one write); a reader on another node fails, and computes the prompt.
- `tcp`: the publisher's server thread sends the bytes to whoever asks by key (any node).
- `auto` (the default): both, the file where the reader shares the publisher's node, else TCP.
- `object_store`: Ray's object store (`ray.put`; Ray moves it between nodes); freed when the last
  handle is dropped, lost with its owner, the prefill replica's process.

Published blocks wait at most `ttl_s` (the app's `disaggregation.kv_ttl_s`) for their reader,
then are dropped; the Ingress drops those of a request that ended before its decode replica
answered at once (`discard`). Every failure to fetch is a
KvTransferError: the decode replica then computes the prompt itself (a colocated prefill), so a
lost prefill replica or node loses no request. Blocking calls: the replica runs them on a worker
thread."""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import shutil
import socket
import struct
import tempfile
import threading
import time
import uuid
from typing import Protocol

import numpy as np

from common.kv_transfer import KvBlocks, KvHandle, KvTransferError

logger = logging.getLogger(__name__)
KV_CONNECTORS = ("auto", "shared_memory", "tcp", "object_store")
DEFAULT_TTL_S = 60.0
SWEEP_EVERY_S = 5.0
_LENGTH = struct.Struct("!q")  # a reply's byte count; -1: no such key
_KEY_BYTES = 32  # keys are uuid4 hex
_FETCH, _DROP = b"f", b"d"  # a TCP request's first byte: send the key's bytes, or drop them


class KvConnector(Protocol):
    name: str

    def publish(self, blocks: KvBlocks) -> KvHandle:
        """Hold the blocks' data for one reader; what it needs to fetch them."""
        ...

    def fetch(self, handle: KvHandle, timeout_s: float) -> KvBlocks:
        """The published blocks, with their data; KvTransferError if they cannot be had."""
        ...

    def close(self) -> None:
        """Drop everything still held."""


def make_connector(name: str, node_id: str, host: str, ttl_s: float = DEFAULT_TTL_S) -> KvConnector:
    """A replica's connector. `node_id`: its node's (Ray's node id); `host`: the address other
    nodes reach it at."""
    if name == "object_store":
        return ObjectStoreConnector(node_id)
    if name not in KV_CONNECTORS:
        raise ValueError(f"kv_connector: {name!r} is not one of {list(KV_CONNECTORS)}")
    return FileConnector(name, node_id, host, ttl_s)


def _shm_root() -> str:
    """/dev/shm where it exists (memory, not disk), else the temp directory."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class FileConnector:
    """`shared_memory`, `tcp` and `auto`: the publisher writes each prompt's blocks to a file of
    its own in a memory-backed directory; a reader on its node maps the file (`shared_memory`,
    `auto`), others ask its TCP server (`tcp`, `auto`). Whoever reads a file removes it."""

    def __init__(self, name: str, node_id: str, host: str, ttl_s: float) -> None:
        self.name = name
        self.node_id = node_id
        self.ttl_s = ttl_s
        _remove_orphans(_shm_root())
        self.directory = tempfile.mkdtemp(prefix=f"stallfree-kv-{os.getpid()}-", dir=_shm_root())
        self._deadlines: dict[str, float] = {}  # key -> when its file is dropped unread
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._server: socket.socket | None = None
        self.address: tuple[str, int] | None = None
        if name != "shared_memory":
            self._server = socket.create_server((host, 0))
            self.address = (host, self._server.getsockname()[1])
            threading.Thread(target=self._serve, name="kv-connector-server", daemon=True).start()
        threading.Thread(target=self._sweep_loop, name="kv-connector-sweep", daemon=True).start()

    # -- the publisher's side ------------------------------------------------------------
    def publish(self, blocks: KvBlocks) -> KvHandle:
        assert blocks.data is not None
        key = uuid.uuid4().hex
        path = os.path.join(self.directory, key)
        with open(path, "wb") as file:
            file.write(memoryview(blocks.data))
        with self._lock:
            self._deadlines[key] = time.monotonic() + self.ttl_s
        return KvHandle(self.name, key, self.node_id, blocks.without_data(), path, self.address)

    def _serve(self) -> None:
        assert self._server is not None
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._send, args=(conn,), daemon=True).start()

    def _send(self, conn: socket.socket) -> None:
        """One request: a key in, its bytes out (then the file is gone), or -1; or, asked to drop
        the key, the file gone and 0 out."""
        with conn:
            try:
                op = _recv_exactly(conn, 1)
                key = _recv_exactly(conn, _KEY_BYTES).decode()
                if op == _DROP:
                    if key.isalnum():
                        _unlink(os.path.join(self.directory, key))
                    conn.sendall(_LENGTH.pack(0))
                    return
                data = self._take(key)
                if data is None:
                    conn.sendall(_LENGTH.pack(-1))
                    return
                conn.sendall(_LENGTH.pack(data.nbytes))
                conn.sendall(memoryview(data))
            except (OSError, UnicodeDecodeError) as error:
                logger.warning("a KV transfer over TCP failed: %s", error)

    def _take(self, key: str) -> np.ndarray | None:
        """The key's bytes, its file removed; None if it is gone (read, expired) or unknown."""
        if not key.isalnum():
            return None
        with self._lock:
            self._deadlines.pop(key, None)
        return _map_and_unlink(os.path.join(self.directory, key))

    def _sweep_loop(self) -> None:
        while not self._closed.wait(SWEEP_EVERY_S):
            self.sweep()

    def sweep(self) -> None:
        """Drop blocks no reader came for within ttl_s."""
        now = time.monotonic()
        with self._lock:
            expired = [key for key, deadline in self._deadlines.items() if deadline <= now]
            for key in expired:
                del self._deadlines[key]
        for key in expired:
            _unlink(os.path.join(self.directory, key))

    @property
    def num_held(self) -> int:
        """Blocks published and not yet read or dropped."""
        return len(os.listdir(self.directory))

    # -- the reader's side ---------------------------------------------------------------
    def fetch(self, handle: KvHandle, timeout_s: float) -> KvBlocks:
        if handle.node_id == self.node_id and handle.path is not None and self.name != "tcp":
            data = _map_and_unlink(handle.path)
            if data is None:
                raise KvTransferError(f"KV blocks {handle.key} are gone (expired, or their replica stopped)")
        elif handle.address is not None and self.name != "shared_memory":
            data = _ask(handle.address, handle.key, timeout_s)
        else:
            raise KvTransferError(
                f"KV blocks {handle.key} are on another node, and {self.name} cannot reach it"
            )
        if data.nbytes != handle.blocks.nbytes:
            raise KvTransferError(
                f"KV blocks {handle.key}: {data.nbytes} bytes, expected {handle.blocks.nbytes}"
            )
        return KvBlocks(handle.blocks.layout, handle.blocks.num_blocks, handle.blocks.last_hash, data)

    def close(self) -> None:
        self._closed.set()
        if self._server is not None:
            with contextlib.suppress(OSError):  # wakes the thread blocked in accept()
                self._server.shutdown(socket.SHUT_RDWR)
            self._server.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def _remove_orphans(root: str) -> None:
    """Remove the directories of publishers on this machine whose process is gone (killed: it
    never closed its connector)."""
    for directory in glob.glob(os.path.join(root, "stallfree-kv-*-*")):
        pid = os.path.basename(directory).split("-")[2]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(directory, ignore_errors=True)
        except PermissionError:  # another user's live process
            continue


def discard(handle: KvHandle, node_id: str) -> None:
    """Drop published blocks no reader will fetch (their request ended first), from any process
    on node `node_id`: the file where it is on this node, else by asking the publisher. Blocking;
    idempotent; a publisher out of reach leaves them to its TTL."""
    if handle.connector == "object_store":  # freed with the last handle to the object
        return
    if handle.path is not None and handle.node_id == node_id and handle.connector != "tcp":
        _unlink(handle.path)
    elif handle.address is not None:
        with contextlib.suppress(OSError), socket.create_connection(handle.address, timeout=5) as conn:
            conn.sendall(_DROP + handle.key.encode())
            _recv_exactly(conn, _LENGTH.size)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _map_and_unlink(path: str) -> np.ndarray | None:
    """The file's bytes, mapped (the mapping outlives the name), the file removed; None if gone."""
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
        os.unlink(path)
    except (FileNotFoundError, ValueError):  # gone, or emptied by a sweep mid-read
        return None
    return data


def _recv_exactly(conn: socket.socket, num_bytes: int) -> bytes:
    buffer = bytearray(num_bytes)
    _recv_into(conn, memoryview(buffer))
    return bytes(buffer)


def _recv_into(conn: socket.socket, view: memoryview) -> None:
    while view:
        received = conn.recv_into(view)
        if received == 0:
            raise ConnectionError("the peer closed the connection mid-transfer")
        view = view[received:]


def _ask(address: tuple[str, int], key: str, timeout_s: float) -> np.ndarray:
    """A publisher's bytes for `key`, over TCP."""
    try:
        with socket.create_connection(address, timeout=timeout_s) as conn:
            conn.sendall(_FETCH + key.encode())
            (length,) = _LENGTH.unpack(_recv_exactly(conn, _LENGTH.size))
            if length < 0:
                raise KvTransferError(f"KV blocks {key} are gone (expired, or read already)")
            data = np.empty(length, dtype=np.uint8)
            _recv_into(conn, memoryview(data))
            return data
    except OSError as error:
        raise KvTransferError(f"KV blocks {key} could not be fetched from {address}: {error}") from error


class ObjectStoreConnector:
    """Blocks as a Ray object, owned by the publishing process: Ray moves it to the reader's node,
    frees it when the last handle to it is dropped, and loses it with its owner."""

    name = "object_store"

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id

    def publish(self, blocks: KvBlocks) -> KvHandle:
        import ray

        ref = ray.put(blocks.data)
        return KvHandle(self.name, ref.hex(), self.node_id, blocks.without_data(), ref=ref)

    def fetch(self, handle: KvHandle, timeout_s: float) -> KvBlocks:
        import ray

        try:
            data = ray.get(handle.ref, timeout=timeout_s)
        except Exception as error:  # lost with its owner, timed out, ...
            raise KvTransferError(f"KV blocks {handle.key} could not be fetched: {error!r}") from error
        return KvBlocks(handle.blocks.layout, handle.blocks.num_blocks, handle.blocks.last_hash, data)

    def close(self) -> None:
        """Ray frees the objects once their handles are dropped."""
