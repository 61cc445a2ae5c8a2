import asyncio
import time

import pytest

from gateway.pool import Worker, WorkerPool
from pdmesh.errors import NoWorkerAvailable
from tests.gateway.fake_workers import FakeWorker, info


async def test_a_worker_restarted_on_its_address_is_used_again_within_a_second():
    """A channel that failed to connect for a while backs off its reconnects (gRPC's default grows to
    two minutes): a worker back on its address would be skipped that long, and with its peer gone
    the gateway would have no worker of that role at all. The mesh's channels retry within a second."""
    worker = FakeWorker("decode")
    address = await worker.server.start("127.0.0.1", 0)
    pool = WorkerPool([], [address], cooldown_s=0.1)
    try:
        assert [w.address for w in await pool.candidates("decode")] == [address]
        await worker.server.stop(0)
        pool.mark_down(pool.workers("decode")[0])
        down_until = time.monotonic() + 6   # gateways keep asking for workers while it is down
        while time.monotonic() < down_until:
            await asyncio.sleep(0.2)
            with pytest.raises(NoWorkerAvailable):
                await pool.candidates("decode")
        worker = FakeWorker("decode")
        await worker.server.start("127.0.0.1", int(address.rsplit(":", 1)[1]))
        back_at = time.monotonic()
        while True:
            try:
                await pool.candidates("decode")
                break
            except NoWorkerAvailable:
                assert time.monotonic() - back_at < 1.5, "the restarted worker is still skipped"
                await asyncio.sleep(0.05)
    finally:
        await pool.close()
        await worker.server.stop(0)


def test_pairing_skips_decodes_marked_down_since_they_were_listed():
    """Another request's failed call clears a worker's info (mark_down) while this one awaits."""
    prefill = Worker("p:1", "prefill", channel=None, info=info("prefill"))
    down, up = Worker("d:1", "decode", channel=None), Worker("d:2", "decode", channel=None, info=info("decode"))
    assert WorkerPool.compatible_with(prefill, [down, up]) == [up]
    with pytest.raises(NoWorkerAvailable):
        WorkerPool.compatible_with(prefill, [down])
