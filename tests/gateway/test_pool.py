import asyncio
import time

import pytest

from gateway.pool import Worker, WorkerPool
from pdmesh.errors import NoWorkerAvailable
from pdmesh.registry import WorkerRecord
from tests.gateway.fake_workers import FakeWorker, info


async def test_a_worker_restarted_on_its_address_is_used_again_within_a_second():
    """A channel that failed to connect for a while backs off its reconnects (gRPC's default grows to
    two minutes): a worker back on its address would be skipped that long, and with its peer gone
    the gateway would have no worker of that role at all. The mesh's channels retry within a second."""
    worker = FakeWorker("decode")
    address = await worker.server.start("127.0.0.1", 0)
    pool = WorkerPool([], [address], cooldown_s=0.1)   # no waiting for a worker to come back: asked again each time
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


async def test_a_request_finding_every_worker_down_waits_for_one_to_come_back():
    """Its peer killed while a restarted worker still cools down (marked down when it died): the
    request gets the restarted worker as soon as it answers, instead of failing at once."""
    worker = FakeWorker("decode")
    address = await worker.server.start("127.0.0.1", 0)
    pool = WorkerPool([], [address], cooldown_s=60, wait_s=10)
    try:
        assert [w.address for w in await pool.candidates("decode")] == [address]
        await worker.server.stop(0)
        pool.mark_down(pool.workers("decode")[0])
        waiting = [asyncio.create_task(pool.candidates("decode")) for _ in range(3)]
        await asyncio.sleep(1.5)
        assert not any(task.done() for task in waiting)
        worker = FakeWorker("decode")
        await worker.server.start("127.0.0.1", int(address.rsplit(":", 1)[1]))
        back_at = time.monotonic()
        found = await asyncio.gather(*waiting)
        assert time.monotonic() - back_at < 1.5
        assert [[w.address for w in workers] for workers in found] == [[address]] * 3
        assert worker.num_info_calls == 1   # one probe shared by the waiting requests
        assert [w.address for w in await pool.candidates("decode")] == [address]   # up again, not cooling down
    finally:
        await pool.close()
        await worker.server.stop(0)


async def test_a_request_fails_unavailable_when_no_worker_comes_back_within_the_wait():
    worker = FakeWorker("prefill")
    address = await worker.server.start("127.0.0.1", 0)
    await worker.server.stop(0)
    pool = WorkerPool([address], [], cooldown_s=60, wait_s=0.5)
    try:
        started = time.monotonic()
        with pytest.raises(NoWorkerAvailable, match="no reachable prefill worker"):
            await pool.candidates("prefill")
        assert 0.5 <= time.monotonic() - started < 1.5
        with pytest.raises(NoWorkerAvailable):   # one the request avoids is asked too: it is not back
            await pool.candidates("prefill", avoid={address})
    finally:
        await pool.close()


def test_pairing_skips_decodes_marked_down_since_they_were_listed():
    """Another request's failed call clears a worker's info (mark_down) while this one awaits."""
    prefill = Worker("p:1", "prefill", channel=None, info=info("prefill"))
    down, up = Worker("d:1", "decode", channel=None), Worker("d:2", "decode", channel=None, info=info("decode"))
    assert WorkerPool.compatible_with(prefill, [down, up]) == [up]
    with pytest.raises(NoWorkerAvailable):
        WorkerPool.compatible_with(prefill, [down])


async def test_the_model_info_of_a_decode_marked_down_while_listed_is_not_read(monkeypatch):
    """A request checks its prompt against a decode's info; another request may mark that decode down
    (its info dropped) between the listing and the read: the request takes another's, or gets
    NoWorkerAvailable (503), never an AttributeError (INTERNAL, 6 times in the fault campaign)."""
    pool = WorkerPool([], [])
    gone = Worker("127.0.0.1:1", "decode", channel=None)
    live = Worker("127.0.0.1:2", "decode", channel=None, info=info("decode"))

    async def listed(role, avoid=frozenset()):
        return [gone, live]

    monkeypatch.setattr(pool, "candidates", listed)
    assert await pool.any_info() is live.info
    live.info = None
    with pytest.raises(NoWorkerAvailable):
        await pool.any_info()


async def test_a_registry_record_brings_its_workers_published_prompt_rate():
    pool = WorkerPool([], [])
    try:
        pool.sync_registry([WorkerRecord(role="prefill", address="127.0.0.1:1", prefill_tokens_per_s=2500.0)])
        (worker,) = pool.workers("prefill")
        assert worker.prefill_tokens_per_s == 2500.0
        pool.sync_registry([WorkerRecord(role="prefill", address="127.0.0.1:1")])   # an older worker's: none
        worker.published_rate(0.0)                                                  # nor in its answers
        assert worker.prefill_tokens_per_s == 2500.0   # the last rate it published stands
    finally:
        await pool.close()


async def test_a_worker_taking_both_roles_is_a_candidate_for_either():
    pool = WorkerPool(["127.0.0.1:1"], ["127.0.0.1:2"], both_addresses=["127.0.0.1:3"])
    try:
        assert [w.address for w in pool.workers("prefill")] == ["127.0.0.1:1", "127.0.0.1:3"]
        assert [w.address for w in pool.workers("decode")] == ["127.0.0.1:2", "127.0.0.1:3"]
    finally:
        await pool.close()
