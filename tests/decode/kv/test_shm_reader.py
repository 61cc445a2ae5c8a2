"""A handshake answer names the shared file decode maps: a peer could name any path (issue 30,
item 3). Decode maps only pdmesh's or torch's shared-memory files directly in /dev/shm, regular
files of its own user: a made-up path, a link or a FIFO is refused before anything is read."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import numpy as np
import pytest

from decode.kv.shm_reader import ShmKVReader
from kvstore.shared_slab import SharedSlab
from pdmesh.errors import WorkerFailed
from pdmesh.kv.kv_layout import LayerRegion
from pdmesh.transport.kv_transport import PeerLink, ReadOptions

PART_NBYTES = 64


class _Control:
    block_nbytes = PART_NBYTES


def _land(path: str) -> np.ndarray:
    """What decode's cache holds after reading block 0 of a producer whose cache is `path`."""
    region = LayerRegion(base=0, nbytes=4 * PART_NBYTES, block_stride=PART_NBYTES, part_stride=0, num_parts=1,
                         part_nbytes=PART_NBYTES, shm_path=path)
    local = np.zeros(4 * PART_NBYTES, np.uint8)
    reader = ShmKVReader(_Control(), [LayerRegion(base=local.ctypes.data, nbytes=local.nbytes,
                                                  block_stride=PART_NBYTES, part_stride=0, num_parts=1,
                                                  part_nbytes=PART_NBYTES)], [local])
    link = PeerLink("p:1", "shm", (region,), "")
    try:
        reader.land_layers(link, "t", [0], [0], [0], range(1), None, ReadOptions())
    finally:
        reader.close()
    return local


@pytest.fixture
def shm_name():
    name = f"pdmesh-test-{secrets.token_hex(4)}"
    yield Path("/dev/shm") / name
    (Path("/dev/shm") / name).unlink(missing_ok=True)


def test_a_path_outside_shared_memory_is_refused():
    with pytest.raises(WorkerFailed, match="not a pdmesh shared-memory file"):
        _land("/etc/passwd")


def test_a_file_in_shared_memory_not_named_as_pdmeshs_is_refused(shm_name):
    other = shm_name.with_name(f"someone-else-{secrets.token_hex(4)}")
    other.write_bytes(b"x" * 4 * PART_NBYTES)
    try:
        with pytest.raises(WorkerFailed, match="not a pdmesh shared-memory file"):
            _land(str(other))
    finally:
        other.unlink()


def test_a_link_named_like_a_pdmesh_file_is_not_followed(shm_name, tmp_path):
    target = tmp_path / "secret"
    target.write_bytes(b"s" * 4 * PART_NBYTES)
    shm_name.symlink_to(target)
    with pytest.raises(WorkerFailed, match="cannot map"):
        _land(str(shm_name))


def test_a_fifo_named_like_a_pdmesh_file_is_refused_without_blocking(shm_name):
    os.mkfifo(shm_name)
    with pytest.raises(WorkerFailed, match="not a regular file"):
        _land(str(shm_name))


def test_a_producers_real_shared_file_is_read():
    slab = SharedSlab(4, PART_NBYTES, prefix="pdmesh-test-slab")
    try:
        slab.rows[0] = np.arange(PART_NBYTES, dtype=np.uint8)
        assert _land(str(slab.path))[:PART_NBYTES].tolist() == list(range(PART_NBYTES))
    finally:
        slab.close()
