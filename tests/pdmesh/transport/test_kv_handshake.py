"""The producer's KV port over real gRPC: which transport a handshake agrees, and mesh credentials."""

import grpc
import numpy as np
import pytest

from decode.kv.kv_port_client import KVPortClient
from kvstore.block_key import BlockKey
from kvstore.block_store import TieredBlockStore
from kvstore.client import GrpcStoreClient
from kvstore.service import SERVICE_NAME, KVStoreServicer
from kvstore.slab_tier import host_tier
from pdmesh.config import TlsSettings
from pdmesh.errors import Incompatible, NoWorkerAvailable, TransferNotFound, Unauthenticated, WorkerFailed
from pdmesh.kv.kv_layout import LayerRegion
from pdmesh.transport.host_id import host_id
from pdmesh.transport.mesh_auth import MeshAuth
from pdmesh.v1 import common_pb2, kv_store_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc
from prefill.kv.grpc_kv_server import ExtraService, GrpcKVServer, KVTransferServicer
from prefill.kv.held_transfers import HeldTransfer, HeldTransfers
from prefill.kv.shm_exporter import ShmKVExporter
from tests.tls_certs import make_certs

COMPAT = common_pb2.CompatInfo(model_fingerprint="fp", dtype="float32", block_size=32, layout="l",
                               num_layers=1, block_nbytes=64)
REGION = LayerRegion(base=64, nbytes=640, block_stride=64, part_stride=0, num_parts=1, part_nbytes=64,
                     shm_path="/dev/shm/x")
TOKEN = "mesh-secret"


def _server(held: HeldTransfers, serve_grpc: bool = True, auth: MeshAuth | None = None) -> GrpcKVServer:
    servicer = KVTransferServicer(COMPAT, held, lambda ids: np.zeros((len(ids), 64), np.uint8), wait_timeout_s=0.2,
                                  exporters=[ShmKVExporter([REGION])], block_checksums=lambda ids: [7] * len(ids),
                                  serve_grpc=serve_grpc)
    store = KVStoreServicer(COMPAT, TieredBlockStore([host_tier(4 * 64, 64)], 64), index=None)
    return GrpcKVServer(servicer, "127.0.0.1", 0, auth=auth,
                        extra_services=[ExtraService(SERVICE_NAME, kv_store_pb2_grpc.add_KVStoreServicer_to_server, store)])


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def held():
    held = HeldTransfers()
    held.hold(HeldTransfer("t1", block_ids=(7, 3), block_hashes=(b"h7", b"h3"), deadline=1e18))
    return held


@pytest.fixture
def served(held, no_thread_leak):
    server = _server(held)
    receiver = KVPortClient(COMPAT, timeout_s=5)
    yield server.address, receiver
    receiver.close()
    server.stop(0)


def test_same_host_agrees_shared_memory_with_the_producers_regions(served):
    address, receiver = served
    link = receiver.handshake(address, ["shm", "mooncake", "grpc"], host_id())
    assert (link.transport, link.regions, link.mooncake_session) == ("shm", (REGION,), "")


def test_another_host_or_a_consumer_without_shm_gets_grpc(served):
    address, receiver = served
    assert receiver.handshake(address, ["shm", "grpc"], "other-host/x/1").transport == "grpc"
    assert receiver.handshake(address, ["mooncake", "grpc"], host_id()).transport == "grpc"


def test_no_transport_in_common_fails_the_handshake_naming_both_sides(held, no_thread_leak):
    server, receiver = _server(held, serve_grpc=False), KVPortClient(COMPAT, timeout_s=5)
    try:
        with pytest.raises(Incompatible, match=r"consumer reads with \['grpc', 'mooncake'\], producer offers \['shm'\]"):
            receiver.handshake(server.address, ["mooncake", "grpc"], host_id())
    finally:
        receiver.close()
        server.stop(0)


def test_open_names_the_producers_blocks_with_checksums_and_hashes(served):
    address, receiver = served
    opened = receiver.open(address, "t1", [1, 0], "shm")
    assert (list(opened.block_ids), list(opened.checksums), list(opened.block_hashes)) == ([3, 7], [7, 7], [b"h3", b"h7"])
    with pytest.raises(TransferNotFound):
        receiver.open(address, "t2", [0], "shm")  # a guessed id


def test_without_the_mesh_token_every_kv_and_store_call_is_refused(held, no_thread_leak):
    server = _server(held, auth=MeshAuth(TOKEN))
    outsider, peer = KVPortClient(COMPAT, timeout_s=5), KVPortClient(COMPAT, timeout_s=5, auth=MeshAuth(TOKEN))
    wrong = KVPortClient(COMPAT, timeout_s=5, auth=MeshAuth("guess"))
    store = GrpcStoreClient(COMPAT, timeout_s=5)
    try:
        for client in (outsider, wrong):
            with pytest.raises(Unauthenticated):
                client.handshake(server.address, ["grpc"], host_id())
            with pytest.raises(Unauthenticated):
                client.open(server.address, "t1", [0], "shm")
            with pytest.raises(Unauthenticated):
                list(client.pull(server.address, "t1", [0]))
            with pytest.raises(Unauthenticated):
                client.release(server.address, "t1")
            with pytest.raises(Unauthenticated):
                client.watch(server.address, "t1", 0, 0.1)
            with pytest.raises(Unauthenticated):
                list(client.pull_runs(server.address, "t1", [0], layers=range(0, 1)))
        with pytest.raises(Unauthenticated):
            store.export(server.address, [BlockKey(b"h" * 16, b"", (1,))])
        with pytest.raises(Unauthenticated):
            store.lookup(server.address, [1] * 32)
        assert held.num_held == 1  # nothing was released
        assert peer.handshake(server.address, ["grpc"], host_id()).transport == "grpc"
        assert len(list(peer.pull(server.address, "t1", [0, 1]))) == 2
    finally:
        for client in (outsider, wrong, peer, store):
            client.close()
        server.stop(0)


def test_health_checks_need_no_mesh_token(held, no_thread_leak):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    server = _server(held, auth=MeshAuth(TOKEN))
    try:
        with grpc.insecure_channel(server.address) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert response.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as error:
                kv_transfer_pb2_grpc.KVTransferStub(channel).Release(kv_transfer_pb2.ReleaseRequest(transfer_id="t1"))
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(0)


def test_with_mesh_tls_only_peers_with_a_certificate_of_the_mesh_ca_get_in(held, certs, no_thread_leak):
    server_tls = TlsSettings(cert_file=certs.server_cert, key_file=certs.server_key, ca_file=certs.ca)
    peer_tls = TlsSettings(cert_file=certs.client_cert, key_file=certs.client_key, ca_file=certs.ca)
    foreign_tls = TlsSettings(cert_file=certs.other_client_cert, key_file=certs.other_client_key, ca_file=certs.ca)
    server = _server(held, auth=MeshAuth(TOKEN, server_tls))
    clients = {name: KVPortClient(COMPAT, timeout_s=5, auth=MeshAuth(TOKEN, tls))
               for name, tls in (("plain", TlsSettings()), ("foreign", foreign_tls), ("peer", peer_tls))}
    store = GrpcStoreClient(COMPAT, timeout_s=5, auth=MeshAuth(TOKEN, peer_tls))
    try:
        for name in ("plain", "foreign"):
            with pytest.raises((NoWorkerAvailable, WorkerFailed)):  # the TLS handshake fails: UNAVAILABLE
                clients[name].handshake(server.address, ["grpc"], host_id())
        assert clients["peer"].handshake(server.address, ["grpc"], host_id()).transport == "grpc"
        assert len(list(clients["peer"].pull(server.address, "t1", [0, 1]))) == 2
        assert store.lookup(server.address, [1] * 32) == []
    finally:
        for client in (*clients.values(), store):
            client.close()
        server.stop(0)


def test_with_mesh_tls_a_consumer_refuses_a_producer_whose_certificate_names_another_host(held, certs,
                                                                                         no_thread_leak):
    """Whoever hands decode a KV address (a caller of Decode holding the mesh token), decode's dial
    gets through only to a producer whose mesh-CA certificate names that address: gRPC checks the
    name (no target-name override anywhere). A token alone would not stop this: whoever holds it can
    also sign a registry record naming any address, so a registry check would add no barrier."""
    peer_tls = TlsSettings(cert_file=certs.client_cert, key_file=certs.client_key, ca_file=certs.ca)
    named_elsewhere = TlsSettings(cert_file=certs.elsewhere_cert, key_file=certs.elsewhere_key, ca_file=certs.ca)
    impostor = _server(held, auth=MeshAuth(TOKEN, named_elsewhere))
    control = _server(held, auth=MeshAuth(TOKEN, TlsSettings(cert_file=certs.server_cert, key_file=certs.server_key,
                                                             ca_file=certs.ca)))
    consumer = KVPortClient(COMPAT, timeout_s=5, auth=MeshAuth(TOKEN, peer_tls))
    try:
        assert consumer.handshake(control.address, ["grpc"], host_id()).transport == "grpc"
        with pytest.raises((NoWorkerAvailable, WorkerFailed)):  # the certificate names another host: UNAVAILABLE
            consumer.handshake(impostor.address, ["grpc"], host_id())
    finally:
        consumer.close()
        impostor.stop(0)
        control.stop(0)
