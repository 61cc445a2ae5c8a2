"""The Mooncake reader's staging slabs: a slab whose read failed, or whose read was given up
because an earlier batch failed, is never read into again (the engine cannot cancel a transfer, so
a late write must land where nothing looks). The real engine moving real blocks between processes
is tested in tests/pdmesh/connector/test_worker_side.py, tests/e2e and bench_kv_transport."""

import numpy as np
import pytest

from pdmesh.errors import WorkerFailed
from pdmesh.transport.kv_layout import LayerRegion
from pdmesh.transport.kv_transport import PeerLink
from pdmesh.transport.mooncake.reader import MooncakeKVReader

REGION = LayerRegion(base=4096, nbytes=1 << 20, block_stride=1024, part_stride=0, num_parts=1, part_nbytes=1024)


class _Engine:
    timeout_s = 1.0

    def __init__(self) -> None:
        self.fail = False
        self.registered: list[int] = []
        self.reads: list[int] = []  # the local address of each read's first piece

    def register(self, regions):
        self.registered += [r.base for r in regions]

    def unregister(self, regions):
        for region in regions:
            self.registered.remove(region.base)

    def start_read(self, session, local_addresses, remote_addresses, lengths):
        self.reads.append(local_addresses[0])
        return [1]

    def wait(self, session, batch_ids, timeout_s):
        if self.fail:
            raise WorkerFailed("timeout")


class _Control:
    block_nbytes = 1024


def test_a_slab_whose_read_failed_is_set_aside_and_a_fresh_one_is_used():
    engine = _Engine()
    reader = MooncakeKVReader(engine, _Control(), [REGION], [np.zeros(REGION.nbytes, np.uint8)])
    link = PeerLink("p:1", "mooncake", (REGION,), "127.0.0.1:2")
    reader.connect(link)
    reader.connect(link)
    engine.fail = True
    with pytest.raises(WorkerFailed):
        reader.connect(link)
    engine.fail = False
    reader.connect(link)
    first, reused, failed, fresh = engine.reads
    assert first == reused == failed and fresh != failed  # a good slab is reused, a failed one never
    assert len(engine.registered) == 2  # the quarantined slab stays registered until its time is up
    reader.close()
    assert engine.registered == []
