"""The Mooncake reader's staging slabs: a slab whose read failed is never read into again (the
engine cannot cancel a transfer, so a late write must land where nothing looks). The real engine
moving real blocks is tested in tests/pdmesh/connector/test_worker_side.py and tests/e2e."""

import numpy as np
import pytest

from pdmesh.errors import WorkerFailed
from pdmesh.transport.kv_layout import LayerRegion
from pdmesh.transport.kv_transport import PeerLink
from pdmesh.transport.mooncake.reader import MooncakeKVReader

REGION = LayerRegion(base=4096, nbytes=1 << 20, block_stride=1024, part_stride=0, num_parts=1, part_nbytes=1024)


class _Engine:
    def __init__(self) -> None:
        self.fail = False
        self.registered: list[int] = []
        self.reads: list[int] = []  # the local address of each read's first piece

    def register(self, regions):
        self.registered += [r.base for r in regions]

    def unregister(self, regions):
        for region in regions:
            self.registered.remove(region.base)

    def read(self, session, local_addresses, remote_addresses, lengths):
        self.reads.append(local_addresses[0])
        if self.fail:
            raise WorkerFailed("timeout")


class _Control:
    block_nbytes = 1024


def test_a_slab_whose_read_failed_is_set_aside_and_a_fresh_one_is_used():
    engine = _Engine()
    reader = MooncakeKVReader(engine, _Control(), [REGION], lambda ids: [], [np.zeros(REGION.nbytes, np.uint8)])
    link = PeerLink("p:1", "mooncake", (REGION,), "127.0.0.1:2")
    reader.connect(link)
    engine.fail = True
    with pytest.raises(WorkerFailed):
        reader.connect(link)  # tried twice, each on its own slab
    engine.fail = False
    reader.connect(link)
    first, failed, failed_again, fresh = engine.reads
    assert first == failed and len({failed, failed_again, fresh}) == 3
    assert len(engine.registered) == 3  # the quarantined slabs stay registered until their time is up
    reader.close()
    assert engine.registered == []
