"""The KV connectors without Serve: each way moves the bytes intact to one reader, refuses a second
read, a reader it cannot reach, and blocks whose time ran out (KvTransferError: the decode
replica then computes the prompt), and leaves nothing behind. Real files in /dev/shm and real TCP
on this host; the object store's connector is tested through Serve (test_disaggregation.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from common.kv_transfer import KvBlocks, KvLayout, KvTransferError
from deployments.kv_connectors import FileConnector, discard, make_connector

LAYOUT = KvLayout(num_layers=2, block_size=4, num_kv_heads=1, head_dim=8, dtype="float32", dtype_bytes=4)


def _blocks(num_blocks: int, seed: int = 0) -> KvBlocks:
    data = np.random.default_rng(seed).integers(0, 256, num_blocks * LAYOUT.block_bytes, dtype=np.uint8)
    return KvBlocks(LAYOUT, num_blocks, b"h" * 32, data)


@pytest.fixture
def pair(request):
    """A publisher and a reader of one kind, on `node` ids of the test's choosing."""
    made = []

    def make(name: str, same_node: bool = True) -> tuple[FileConnector, FileConnector]:
        publisher = make_connector(name, "node-a", "127.0.0.1")
        reader = make_connector(name, "node-a" if same_node else "node-b", "127.0.0.1")
        made.extend([publisher, reader])
        return publisher, reader

    yield make
    for connector in made:
        connector.close()


@pytest.mark.parametrize(
    ("name", "same_node"), [("shared_memory", True), ("tcp", True), ("auto", True), ("auto", False)]
)
def test_the_bytes_arrive_intact_once_and_nothing_is_left(pair, name, same_node):
    publisher, reader = pair(name, same_node)
    blocks = _blocks(5)
    handle = publisher.publish(blocks)
    assert handle.blocks.data is None  # the handle is small: the bytes stay with the publisher
    fetched = reader.fetch(handle, timeout_s=10)
    assert fetched.num_blocks == 5 and fetched.last_hash == blocks.last_hash
    assert np.array_equal(np.asarray(fetched.data), blocks.data)
    assert publisher.num_held == 0
    with pytest.raises(KvTransferError, match="gone"):
        reader.fetch(handle, timeout_s=10)


def test_shared_memory_cannot_reach_another_node(pair):
    publisher, reader = pair("shared_memory", same_node=False)
    publisher.ttl_s = 0
    handle = publisher.publish(_blocks(2))
    with pytest.raises(KvTransferError, match="another node"):
        reader.fetch(handle, timeout_s=10)
    assert publisher.num_held == 1
    publisher.sweep()  # expired unread: dropped
    assert publisher.num_held == 0


def test_blocks_whose_time_ran_out_or_whose_publisher_stopped_cannot_be_fetched(pair):
    publisher, reader = pair("tcp", same_node=False)
    publisher.ttl_s = 0
    expired = publisher.publish(_blocks(2))
    publisher.sweep()
    with pytest.raises(KvTransferError, match="gone"):
        reader.fetch(expired, timeout_s=10)
    publisher.ttl_s = 60
    orphan = publisher.publish(_blocks(2))
    publisher.close()  # its replica stopped (or its node was lost)
    assert not os.path.exists(publisher.directory)
    with pytest.raises(KvTransferError, match="could not be fetched"):
        reader.fetch(orphan, timeout_s=10)


@pytest.mark.parametrize(("name", "same_node"), [("auto", True), ("auto", False), ("tcp", True)])
def test_blocks_no_reader_will_fetch_are_dropped_at_once(pair, name, same_node):
    """What the Ingress does when a request ends before its decode replica answered: the file
    goes where it is on the caller's node, else the publisher drops it when asked; again is a
    no-op, and a reader then finds them gone (and computes the prompt)."""
    publisher, reader = pair(name, same_node)
    handles = [publisher.publish(_blocks(3, seed)) for seed in range(2)]
    discard(handles[0], reader.node_id)
    assert publisher.num_held == 1
    discard(handles[0], reader.node_id)
    with pytest.raises(KvTransferError, match="gone"):
        reader.fetch(handles[0], timeout_s=10)
    assert np.array_equal(np.asarray(reader.fetch(handles[1], timeout_s=10).data), _blocks(3, 1).data)
    assert publisher.num_held == 0


def test_an_unknown_connector_is_refused_by_name():
    with pytest.raises(ValueError, match="kv_connector"):
        make_connector("nixl", "node-a", "127.0.0.1")


def test_blocks_of_a_killed_publisher_are_removed_by_the_next_connector_on_its_machine(pair, tmp_path):
    import subprocess
    import sys

    from deployments.kv_connectors import _shm_root

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    orphan = os.path.join(_shm_root(), f"stallfree-kv-{gone.stdout.strip()}-test")
    os.makedirs(orphan)
    open(os.path.join(orphan, "blocks"), "wb").close()
    pair("shared_memory")
    assert not os.path.exists(orphan)
