"""The Mooncake reader's staging slabs: a slab whose read failed, or whose read was given up
because an earlier batch failed, is never read into again (the engine cannot cancel a transfer, so
a late write must land where nothing looks). The real engine moving real blocks between processes
is tested in tests/worker/test_worker_side.py, tests/e2e and bench_kv_transport."""

import ctypes

import numpy as np
import pytest

from decode.kv.mooncake_reader import MooncakeKVReader
from pdmesh.errors import WorkerFailed
from pdmesh.kv.kv_layout import LayerRegion
from pdmesh.transport.kv_transport import PeerLink, ReadOptions

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


class _CopyingEngine(_Engine):
    """Moves bytes as the real engine does, between this process's arrays, and records any read whose
    local bytes do not lie in one registered slab (the real engine would write past it)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.overflows: list[tuple[int, int]] = []

    def register(self, regions):
        super().register(regions)
        self.sizes.update({r.base: r.nbytes for r in regions})

    def start_read(self, session, local_addresses, remote_addresses, lengths):
        for local, remote, nbytes in zip(local_addresses, remote_addresses, lengths):
            if not any(base <= local and local + nbytes <= base + size for base, size in self.sizes.items()):
                self.overflows.append((local, nbytes))
                continue
            ctypes.memmove(local, remote, nbytes)
        return [1]


def _layers(num_layers: int, num_blocks: int, part_nbytes: int, fill: bool) -> tuple[list[np.ndarray], list]:
    """A KV cache of layers keeping K and V apart: its per-layer views and regions."""
    views = [np.random.default_rng(layer).integers(0, 256, 2 * num_blocks * part_nbytes, dtype=np.uint8) if fill
             else np.zeros(2 * num_blocks * part_nbytes, np.uint8) for layer in range(num_layers)]
    regions = [LayerRegion(base=view.ctypes.data, nbytes=view.nbytes, block_stride=part_nbytes,
                           part_stride=num_blocks * part_nbytes, num_parts=2, part_nbytes=part_nbytes)
               for view in views]
    return views, regions


def test_layers_of_many_blocks_land_in_batches_that_fit_the_slab():
    """Layer-wise reads of a long prompt of a wide model (24 MiB here) were sent as one batch into a
    16 MiB slab: the engine wrote past it into decode's memory. Every batch now fits the slab."""
    part_nbytes, num_blocks = 256 << 10, 32
    source, source_regions = _layers(2, num_blocks, part_nbytes, fill=True)
    local, local_regions = _layers(2, num_blocks, part_nbytes, fill=False)
    engine = _CopyingEngine()
    control = _Control()
    control.block_nbytes = 4 * part_nbytes   # 1 MiB blocks: a 16 MiB slab
    reader = MooncakeKVReader(engine, control, local_regions, local)
    link = PeerLink("p:1", "mooncake", tuple(source_regions), "127.0.0.1:2")
    src_ids, dst_ids = list(range(24)), list(range(8, 32))
    digests = reader.digest_matrix(len(src_ids))
    reader.land_layers(link, "t", list(range(24)), src_ids, dst_ids, range(2), digests, ReadOptions())
    assert engine.overflows == []
    for layer in range(2):
        for part in range(2):
            plane = slice(part * num_blocks * part_nbytes, (part + 1) * num_blocks * part_nbytes)
            got = local[layer][plane][8 * part_nbytes:]
            want = source[layer][plane][:24 * part_nbytes]
            assert np.array_equal(got, want)
    assert (digests != 0).all()   # every block's every piece hashed where it landed
    reader.close()


def test_a_batch_larger_than_the_slab_is_refused_before_the_engine_moves_it():
    engine = _CopyingEngine()
    reader = MooncakeKVReader(engine, _Control(), [REGION], [np.zeros(REGION.nbytes, np.uint8)])
    link = PeerLink("p:1", "mooncake", (REGION,), "127.0.0.1:2")
    with pytest.raises(ValueError, match="does not fit"):
        reader._start_pieces(link, [], [(REGION.base, 16 << 20), (REGION.base, 1)])
    assert engine.registered == []   # no slab taken
