import asyncio

import pytest

from bench.fault_campaign.proxy import FaultProxy

PAYLOAD = bytes(range(256)) * 1024   # 256 KiB


async def _serve_payload(reader, writer):
    await reader.readexactly(4)
    writer.write(PAYLOAD)
    await writer.drain()
    writer.close()


async def _fetch(address: str) -> bytes:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"pull")
    await writer.drain()
    data = await reader.read()
    writer.close()
    return data


@pytest.fixture
async def proxied():
    server = await asyncio.start_server(_serve_payload, "127.0.0.1", 0)
    proxy = FaultProxy(f"127.0.0.1:{server.sockets[0].getsockname()[1]}").start()
    yield proxy
    proxy.stop()
    server.close()


async def test_an_unarmed_proxy_passes_every_byte(proxied):
    assert await _fetch(proxied.address) == PAYLOAD


async def test_flip_changes_one_bit_of_the_next_bulk_read_then_passes_bytes_again(proxied):
    fired = proxied.arm("flip")
    data = await _fetch(proxied.address)
    assert fired.is_set() and len(data) == len(PAYLOAD)
    diffs = [(a ^ b) for a, b in zip(data, PAYLOAD) if a != b]
    assert diffs == [0x10]
    assert await _fetch(proxied.address) == PAYLOAD


async def test_drop_resets_the_connection_mid_chunk(proxied):
    fired = proxied.arm("drop")
    with pytest.raises(ConnectionResetError):
        await _fetch(proxied.address)
    assert fired.is_set()
    assert await _fetch(proxied.address) == PAYLOAD
    for _ in range(100):   # the proxy's thread closes its side once it sees ours closed
        if proxied.num_connections == 0:
            break
        await asyncio.sleep(0.02)
    assert proxied.num_connections == 0
