"""The worker registry against a real redis-server (password required): heartbeats, TTL expiry,
graceful leave, outages and restarts, malformed values."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest

from pdmesh.config import RegistrySettings
from pdmesh.registry import RegistryPublisher, RegistryWatcher, WorkerLoad, WorkerRecord, connect, encode_record
from pdmesh.registry.keys import index_key, record_key

PREFIX = "pdmesh:workers"
SLOW = 30.0  # a heartbeat or poll period that never fires within a test: only explicit reads count


def _settings(server, heartbeat_s=0.1, ttl_s=0.5, poll_s=0.1, password="s3cret") -> RegistrySettings:
    return RegistrySettings(redis_url=server.url, redis_password=password, heartbeat_s=heartbeat_s,
                            ttl_s=ttl_s, poll_s=poll_s, prefix=PREFIX)


def _record(role="prefill", address="10.0.0.1:50051", **overrides) -> WorkerRecord:
    fields = dict(role=role, address=address, kv_address="10.0.0.1:7000" if role == "prefill" else "",
                  model="tiny-llama", model_fingerprint="fp-1234", max_num_seqs=64, num_kv_blocks=512,
                  started_at=1_700_000_000.5)
    return WorkerRecord(**(fields | overrides))


async def _eventually(predicate, timeout_s: float, step_s: float = 0.02) -> float:
    """Waits until predicate() holds; returns the seconds it took. Fails after timeout_s."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"not true within {timeout_s} s"
        await asyncio.sleep(step_s)
    return time.monotonic() - start


async def _assert_released(server) -> None:
    """No registry task left running and no registry connection left open on the server."""
    assert asyncio.all_tasks() == {asyncio.current_task()}
    probe = server.client()
    await _eventually(lambda: _registry_clients(probe) == [], timeout_s=2.0)
    probe.close()


def _registry_clients(client) -> list[str]:
    return [c["name"] for c in client.client_list() if c["name"].startswith("pdmesh-registry")]


def _stored(server, record: WorkerRecord) -> dict | None:
    raw = server.client().get(record_key(PREFIX, record.role, record.address))
    return None if raw is None else json.loads(raw)


async def test_a_published_record_reaches_the_watcher_exactly_within_three_polls(redis_server):
    settings = _settings(redis_server, heartbeat_s=SLOW, ttl_s=5.0, poll_s=0.1)
    watcher = RegistryWatcher(settings)
    await watcher.start()
    assert watcher.snapshot() == []
    publisher = RegistryPublisher(settings, _record())
    before = time.time()
    await publisher.start()
    await _eventually(lambda: watcher.workers, timeout_s=settings.poll_s * 3)
    assert watcher.workers == {"10.0.0.1:50051": publisher.record}
    assert publisher.record == _record(updated_at=publisher.record.updated_at)
    assert redis_server.client().smembers(index_key(PREFIX)) == {publisher.key.encode()}
    assert before <= publisher.record.updated_at <= time.time()
    assert _stored(redis_server, publisher.record) == json.loads(encode_record(publisher.record))
    assert 0 < redis_server.client().pttl(publisher.key) <= 5000
    assert publisher.key == "pdmesh:workers:prefill:10.0.0.1:50051"
    assert (publisher.num_errors, watcher.num_errors, watcher.num_malformed) == (0, 0, 0)
    assert sorted(_registry_clients(redis_server.client())) == ["pdmesh-registry-publisher",
                                                               "pdmesh-registry-watcher"]
    await publisher.stop()
    await watcher.stop()
    await _assert_released(redis_server)


async def test_the_load_callback_is_read_at_every_beat(redis_server):
    load = WorkerLoad(num_running=0, num_waiting=0, kv_cache_usage=0.0)
    publisher = RegistryPublisher(_settings(redis_server, heartbeat_s=0.1, ttl_s=2.0), _record(), lambda: load)
    await publisher.start()
    first = _stored(redis_server, publisher.record)
    assert (first["num_running"], first["num_waiting"], first["kv_cache_usage"]) == (0, 0, 0.0)
    load = WorkerLoad(num_running=7, num_waiting=3, kv_cache_usage=0.625, prefill_tokens_per_s=2500.0, decode_step_s=0.02)
    await _eventually(lambda: _stored(redis_server, publisher.record)["num_running"] == 7, timeout_s=1.0)
    stored = _stored(redis_server, publisher.record)
    assert (stored["num_running"], stored["num_waiting"], stored["kv_cache_usage"]) == (7, 3, 0.625)
    assert (stored["prefill_tokens_per_s"], stored["decode_step_s"]) == (2500.0, 0.02)
    assert stored["updated_at"] > first["updated_at"]
    assert stored["started_at"] == first["started_at"] == 1_700_000_000.5
    await publisher.stop()
    await _assert_released(redis_server)


async def test_a_failing_load_callback_keeps_the_last_load_and_the_heartbeat(redis_server, caplog):
    loads = iter([WorkerLoad(2, 1, 0.5)])
    publisher = RegistryPublisher(_settings(redis_server, heartbeat_s=0.05, ttl_s=2.0), _record(),
                                  lambda: next(loads))  # StopIteration from the second beat on
    await publisher.start()
    beats = publisher.num_beats
    await _eventually(lambda: publisher.num_beats >= beats + 3, timeout_s=2.0)
    stored = _stored(redis_server, publisher.record)
    assert (stored["num_running"], stored["num_waiting"], stored["kv_cache_usage"]) == (2, 1, 0.5)
    assert publisher.running
    assert sum("load callback" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING) == 1
    await publisher.stop()
    await _assert_released(redis_server)


async def test_the_snapshot_filters_by_role_and_sorts_by_address(redis_server):
    settings = _settings(redis_server, heartbeat_s=SLOW, ttl_s=5.0, poll_s=SLOW)
    prefill_b = RegistryPublisher(settings, _record("prefill", "10.0.0.2:50051"))
    prefill_a = RegistryPublisher(settings, _record("prefill", "10.0.0.1:50051"))
    decode = RegistryPublisher(settings, _record("decode", "10.0.0.3:50052"))
    for publisher in (prefill_b, prefill_a, decode):
        await publisher.start()
    watcher = RegistryWatcher(settings)
    await watcher.start()  # the first read is done when start returns
    assert watcher.snapshot("prefill") == [prefill_a.record, prefill_b.record]
    assert watcher.snapshot("decode") == [decode.record]
    assert watcher.snapshot("decode")[0].kv_address == ""
    assert watcher.snapshot() == [prefill_a.record, prefill_b.record, decode.record]
    for publisher in (prefill_b, prefill_a, decode):
        await publisher.stop()
    await watcher.stop()
    await _assert_released(redis_server)


async def test_a_graceful_stop_deletes_the_record_at_once(redis_server):
    settings = _settings(redis_server, heartbeat_s=0.1, ttl_s=SLOW, poll_s=0.1)
    publisher = RegistryPublisher(settings, _record())
    await publisher.start()
    watcher = RegistryWatcher(settings)
    await watcher.start()
    assert [r.address for r in watcher.snapshot()] == ["10.0.0.1:50051"]
    await publisher.stop(deregister=True)
    assert redis_server.client().exists(publisher.key, index_key(PREFIX)) == 0  # the record and its index entry
    await _eventually(lambda: watcher.snapshot() == [], timeout_s=settings.poll_s * 3)
    await watcher.stop()
    await _assert_released(redis_server)


async def test_a_crashed_worker_stays_until_its_ttl_then_leaves(redis_server):
    settings = _settings(redis_server, heartbeat_s=0.1, ttl_s=0.5, poll_s=0.1)
    publisher = RegistryPublisher(settings, _record())
    await publisher.start()
    watcher = RegistryWatcher(settings)
    await watcher.start()
    await asyncio.sleep(0.25)  # a few beats
    await publisher.stop(deregister=False)
    assert not publisher.running
    last_written_at = _stored(redis_server, publisher.record)["updated_at"]  # the last beat that landed
    assert await watcher.refresh()
    assert [r.address for r in watcher.snapshot()] == ["10.0.0.1:50051"]  # not gone before its TTL
    await _eventually(lambda: watcher.snapshot() == [], timeout_s=settings.ttl_s + settings.poll_s * 3)
    assert time.time() >= last_written_at + settings.ttl_s  # expired by its TTL, not deleted
    assert redis_server.client().exists(publisher.key) == 0
    assert redis_server.client().smembers(index_key(PREFIX)) == set()  # the watcher dropped its index entry
    await watcher.stop()
    await _assert_released(redis_server)


async def test_a_wrong_password_is_counted_and_logged_not_raised(redis_server, caplog):
    settings = _settings(redis_server, heartbeat_s=0.05, poll_s=0.05, password="nope")
    watcher = RegistryWatcher(settings)
    await watcher.start()
    assert (watcher.num_errors, watcher.num_polls, watcher.reachable, watcher.snapshot()) == (1, 0, False, [])
    publisher = RegistryPublisher(settings, _record())
    await publisher.start()
    assert (publisher.num_errors, publisher.num_beats) == (1, 0)
    await _eventually(lambda: watcher.num_errors >= 4 and publisher.num_errors >= 4, timeout_s=3.0)
    assert publisher.running
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("registry poll failed" in m for m in warnings) == 1        # once per outage
    assert sum("registry heartbeat of" in m for m in warnings) == 1
    await publisher.stop()  # the DEL fails too: counted, not raised
    await watcher.stop()
    assert redis_server.client().dbsize() == 0
    await _assert_released(redis_server)


async def test_no_password_at_all_is_counted_too(redis_server):
    watcher = RegistryWatcher(_settings(redis_server, poll_s=SLOW, password=None))
    await watcher.start()
    assert (watcher.num_errors, watcher.reachable) == (1, False)
    await watcher.stop()
    await _assert_released(redis_server)


async def test_after_a_redis_restart_the_next_beat_recreates_the_record(redis_server, caplog):
    settings = _settings(redis_server, heartbeat_s=0.1, ttl_s=SLOW, poll_s=0.1)
    publisher = RegistryPublisher(settings, _record())
    await publisher.start()
    watcher = RegistryWatcher(settings)
    await watcher.start()
    known = watcher.snapshot()
    assert [r.address for r in known] == ["10.0.0.1:50051"]

    redis_server.stop()
    await _eventually(lambda: publisher.num_errors >= 2 and watcher.num_errors >= 2, timeout_s=3.0)
    assert (publisher.running, watcher.reachable) == (True, False)
    assert [r.address for r in watcher.snapshot()] == ["10.0.0.1:50051"]  # last known, kept while down

    redis_server.start()  # same port, empty: every key is gone
    await _eventually(lambda: redis_server.client().exists(publisher.key) == 1, timeout_s=settings.heartbeat_s * 10)
    await _eventually(lambda: watcher.reachable, timeout_s=1.0)
    assert _stored(redis_server, publisher.record)["address"] == "10.0.0.1:50051"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("registry poll failed" in m for m in warnings) == 1
    assert sum("registry heartbeat of" in m for m in warnings) == 1
    await publisher.stop()
    await watcher.stop()
    await _assert_released(redis_server)


async def test_malformed_values_under_the_index_are_skipped_and_counted(redis_server, caplog):
    direct = redis_server.client()
    newer = json.loads(encode_record(_record("decode", "10.0.0.3:50052"))) | {"zone": "b", "gpu": {"kind": "H200"}}
    for key, value in [(f"{PREFIX}:decode:bad-json", "{not json"),
                       (f"{PREFIX}:decode:no-address", json.dumps({"role": "decode"})),
                       (f"{PREFIX}:decode:10.0.0.3:50052", json.dumps(newer))]:  # a newer worker's fields: ignored
        direct.set(key, value)
        direct.sadd(index_key(PREFIX), key)
    direct.set(f"{PREFIX}:decode:unindexed", encode_record(_record("decode", "10.0.0.4:1")))  # never read
    watcher = RegistryWatcher(_settings(redis_server, poll_s=SLOW))
    await watcher.start()
    assert watcher.snapshot() == [_record("decode", "10.0.0.3:50052")]
    assert (watcher.num_malformed, watcher.num_errors, watcher.reachable) == (2, 0, True)
    assert await watcher.refresh()
    assert watcher.num_malformed == 4  # counted at every read that meets them
    skipped = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert len(skipped) == 2  # logged once per key and value
    await watcher.stop()
    direct.close()
    await _assert_released(redis_server)


def test_connect_needs_a_url():
    with pytest.raises(ValueError):
        connect(RegistrySettings())
