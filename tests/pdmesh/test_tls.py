"""Mutual TLS between gateway and workers, against a real grpc.aio server's health service."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdmesh.config import TlsSettings
from pdmesh.grpc_server import AioServer
from pdmesh.tls import channel_credentials, open_channel, server_credentials
from tests.tls_certs import CertFiles, make_certs

RPC_TIMEOUT_S = 5.0


@pytest.fixture
def certs(tmp_path) -> CertFiles:
    return make_certs(tmp_path / "pki")


@pytest.fixture
async def tls_address(certs):
    """A TLS server that requires client certificates signed by certs.ca."""
    tls = TlsSettings(cert_file=certs.server_cert, key_file=certs.server_key, ca_file=certs.ca)
    server = AioServer([])
    try:
        yield await server.start("127.0.0.1", 0, credentials=server_credentials(tls))
    finally:
        await server.stop(0)


@pytest.fixture
async def plain_address():
    server = AioServer([])
    try:
        yield await server.start("127.0.0.1", 0)
    finally:
        await server.stop(0)


async def check(channel: grpc.aio.Channel) -> int:
    request = health_pb2.HealthCheckRequest()
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        request, timeout=RPC_TIMEOUT_S, wait_for_ready=False)
    return reply.status


async def assert_rejected(channel: grpc.aio.Channel) -> None:
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await check(channel)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def gateway_tls(certs: CertFiles) -> TlsSettings:
    return TlsSettings(cert_file=certs.client_cert, key_file=certs.client_key, ca_file=certs.ca)


async def test_mutual_tls_serves(certs, tls_address):
    async with open_channel(tls_address, gateway_tls(certs)) as channel:
        assert await check(channel) == health_pb2.HealthCheckResponse.SERVING


async def test_localhost_name_matches_certificate(certs, tls_address):
    port = tls_address.rsplit(":", 1)[1]
    async with open_channel(f"localhost:{port}", gateway_tls(certs)) as channel:
        assert await check(channel) == health_pb2.HealthCheckResponse.SERVING


@contextlib.asynccontextmanager
async def slow_to_answer(address: str, delay_s: float):
    """A TCP forwarder to address that holds the server's first bytes for delay_s: a busy worker's
    TLS handshake (its event loop shares two cores with spinning engines)."""
    host, port = address.rsplit(":", 1)

    async def forward(reader, writer, delay):
        with contextlib.suppress(ConnectionError):
            await asyncio.sleep(delay)
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def accept(client_reader, client_writer):
        server_reader, server_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(forward(client_reader, server_writer, 0), forward(server_reader, client_writer, delay_s))

    forwarder = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{forwarder.sockets[0].getsockname()[1]}"
    finally:
        forwarder.close()


async def test_a_handshake_slower_than_the_reconnect_backoff_still_connects(certs, tls_address):
    """The mesh's channels redial within a second, but a connection attempt keeps gRPC's 20 s connect
    timeout: setting grpc.min_reconnect_backoff_ms low would cut a busy worker's handshake short."""
    async with slow_to_answer(tls_address, delay_s=1.5) as address:
        async with open_channel(address, gateway_tls(certs)) as channel:
            assert await check(channel) == health_pb2.HealthCheckResponse.SERVING


async def test_client_without_certificate_is_rejected(certs, tls_address):
    await assert_rejected(open_channel(tls_address, TlsSettings(ca_file=certs.ca)))


async def test_client_certificate_from_other_ca_is_rejected(certs, tls_address):
    tls = TlsSettings(cert_file=certs.other_client_cert, key_file=certs.other_client_key, ca_file=certs.ca)
    await assert_rejected(open_channel(tls_address, tls))


async def test_server_outside_trusted_ca_is_rejected(certs, tls_address):
    tls = TlsSettings(cert_file=certs.client_cert, key_file=certs.client_key, ca_file=certs.other_ca)
    await assert_rejected(open_channel(tls_address, tls))


async def test_plaintext_client_is_rejected(tls_address):
    await assert_rejected(open_channel(tls_address, TlsSettings()))


async def test_without_tls_everything_is_plaintext(plain_address):
    assert server_credentials(TlsSettings()) is None
    assert channel_credentials(TlsSettings()) is None
    async with open_channel(plain_address, TlsSettings()) as channel:
        assert await check(channel) == health_pb2.HealthCheckResponse.SERVING


def test_cert_without_key_is_refused(certs):
    tls = TlsSettings(cert_file=certs.server_cert, ca_file=certs.ca)
    for make in (server_credentials, channel_credentials):
        with pytest.raises(ValueError, match="key_file"):
            make(tls)


def test_key_without_cert_is_refused(certs):
    tls = TlsSettings(key_file=certs.server_key)
    for make in (server_credentials, channel_credentials):
        with pytest.raises(ValueError, match="cert_file"):
            make(tls)


def test_server_with_only_ca_is_refused(certs):
    with pytest.raises(ValueError, match="cert_file and key_file"):
        server_credentials(TlsSettings(ca_file=certs.ca))


def test_missing_file_is_named(certs, tmp_path):
    missing = tmp_path / "nope.pem"
    server_tls = TlsSettings(cert_file=missing, key_file=certs.server_key)
    with pytest.raises(ValueError, match="nope.pem"):
        server_credentials(server_tls)
    with pytest.raises(ValueError, match="nope.pem"):
        channel_credentials(TlsSettings(ca_file=missing))
