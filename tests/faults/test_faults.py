"""How the campaign's faults judge that a victim was in the state they are about."""

from bench.fault_campaign.faults import kill_store_node
from pdmesh.v1.worker_pb2 import WorkerStats

OWN_TIERS = {"device": 0, "dram": 4096, "nvme": 8192}


def _stats(hits: dict[str, int], pinned: int = 0) -> WorkerStats:
    return WorkerStats(kv_store_hit_blocks=hits, kv_store_occupancy_bytes=OWN_TIERS, kv_store_pinned_blocks=pinned)


def test_a_store_node_is_being_read_when_its_own_tiers_served_blocks_since_the_look_before():
    store_being_read = kill_store_node()._busy
    before = _stats({"dram": 4, "remote": 2})
    assert store_being_read(before, _stats({"dram": 4, "nvme": 3, "remote": 2}))  # its engine loaded, or a peer fetched
    assert not store_being_read(before, _stats({"dram": 4, "remote": 9}))  # it fetched other nodes' blocks
    assert not store_being_read(before, _stats({"dram": 4, "remote": 2}, pinned=6))  # pinned by a write to NVMe
    assert not store_being_read(None, _stats({"dram": 9}))  # the first look: nothing to compare
