"""The worker registry in Redis: workers heartbeat a record with a TTL; gateways watch it.

Reads cost O(workers), whatever else the database holds (the KV store's one-key-per-block index may
share it): the records are found through one set, never by scanning the keyspace (`keys.py`).
Redis is never a reason to fail: a worker retries its record at the next beat, a gateway keeps the
last snapshot while Redis is unreachable."""

from pdmesh.registry.publisher import RegistryPublisher, WorkerLoad
from pdmesh.registry.record import WorkerRecord, decode_record, encode_record
from pdmesh.registry.redis_client import connect
from pdmesh.registry.watcher import RegistryWatcher

__all__ = ["RegistryPublisher", "RegistryWatcher", "WorkerLoad", "WorkerRecord", "connect", "decode_record",
           "encode_record"]
