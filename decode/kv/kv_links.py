"""A consumer's links to producers: one handshake per producer (cached) agrees the transport; the
reader of that transport moves the blocks. A KV store's links (store=True) read other nodes' store
exports instead of their engines' KV caches."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from decode.kv.kv_port_client import KVPortClient
from pdmesh.transport.host_id import host_id
from pdmesh.transport.kv_transport import KVReader, PeerLink


class KVLinks:
    def __init__(self, control: KVPortClient, readers: Sequence[KVReader], store: bool = False) -> None:
        self.control = control
        self._store = store
        self._readers = {reader.transport: reader for reader in readers}
        self._order = [reader.transport for reader in readers]  # this consumer's preference
        self._lock = threading.Lock()
        self._connecting: dict[str, threading.Lock] = {}  # producer address: held while handshaking with it
        self._links: dict[str, PeerLink] = {}

    @property
    def transports(self) -> list[str]:
        return list(self._order)

    def link(self, address: str) -> PeerLink:
        with self._lock:
            link = self._links.get(address)
        if link is not None:
            return link
        # one handshake at a time per producer (they are rare: once per producer); a producer that does
        # not answer holds up the reads from it alone, not the handshakes with the others
        with self._lock:
            connecting = self._connecting.setdefault(address, threading.Lock())
        with connecting:
            with self._lock:
                link = self._links.get(address)
            if link is None:
                link = self.control.handshake(address, self._order, host_id(), store=self._store)
                connect = getattr(self._readers[link.transport], "connect", None)
                if connect is not None:
                    connect(link)
                with self._lock:
                    self._links[address] = link
        return link

    def reader(self, link: PeerLink) -> KVReader:
        return self._readers[link.transport]

    def forget(self, address: str) -> None:
        """Handshake again next time (the producer failed, or restarted on the same address)."""
        with self._lock:
            link = self._links.pop(address, None)
        forget = getattr(self._readers.get(link.transport) if link else None, "forget", None)
        if forget is not None:
            forget(link)

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self.control.close()
