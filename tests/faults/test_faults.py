"""How the campaign's faults judge that a victim was in the state they are about, which KV
transport each runs on, and by which addresses a victim's requests are known."""

from types import SimpleNamespace

from bench.fault_campaign.faults import all_faults, kill_store_node
from bench.fault_campaign.mesh import FaultMesh, MeshSpec
from bench.faults import transport_of
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


def test_each_fault_runs_on_the_default_transport_but_those_cutting_kv_chunks_on_the_proxy():
    on_grpc = {fault.name for fault in all_faults() if transport_of(fault, None) == "grpc"}
    assert on_grpc == {"drop_kv_connection", "flip_kv_wire_bit"}
    assert {transport_of(fault, None) for fault in all_faults()} == {"auto", "grpc"}
    assert {transport_of(fault, "shm") for fault in all_faults()} == {"shm"}   # --kv-transport: every fault


def test_a_kv_proxy_fault_is_skipped_on_a_mesh_whose_kv_bytes_do_not_cross_the_proxy(tmp_path):
    flip = next(fault for fault in all_faults() if fault.name == "flip_kv_wire_bit")
    mesh = FaultMesh(MeshSpec(tmp_path / "model", tmp_path / "run"))
    assert mesh.spec.kv_transport == "auto"
    assert flip.unavailable(mesh) == "cuts KV chunks on the KV port's proxy: needs KV over grpc, not auto"
    assert flip.unavailable(FaultMesh(MeshSpec(tmp_path / "model", tmp_path / "run", kv_transport="grpc"))) is None


def test_a_worker_is_known_by_its_api_and_kv_ports_direct_and_proxied(tmp_path):
    mesh = FaultMesh(MeshSpec(tmp_path / "model", tmp_path / "run"))
    mesh.cluster = SimpleNamespace(worker_names={"127.0.0.1:5000": "prefill-0", "127.0.0.1:5001": "prefill-1",
                                                 "127.0.0.1:5002": "decode-0"},
                                   prefill_addresses=["127.0.0.1:5000", "127.0.0.1:5001"],
                                   prefill_addresses_kv=["127.0.0.1:7000", "127.0.0.1:7001"])
    mesh.api_proxies = {"prefill-1": SimpleNamespace(address="127.0.0.1:6001"),
                        "decode-0": SimpleNamespace(address="127.0.0.1:6002")}
    mesh.kv_proxies = {"prefill-1": SimpleNamespace(address="127.0.0.1:7001", target="127.0.0.1:8001")}
    assert mesh.addresses_of("prefill-1") == {"127.0.0.1:5001", "127.0.0.1:6001", "127.0.0.1:7001",
                                              "127.0.0.1:8001"}
    assert mesh.addresses_of("decode-0") == {"127.0.0.1:5002", "127.0.0.1:6002"}
    assert mesh.addresses_of("redis") == frozenset()
