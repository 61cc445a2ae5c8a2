"""What a KV producer and consumer do, independent of the mechanism that moves the bytes."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from pdmesh.transport.chunking import AssembledBlock


class KVReceiver(Protocol):
    """Consumer side: pulls blocks a producer holds, then releases them."""

    def pull(self, address: str, transfer_id: str, block_indexes: Sequence[int]) -> Iterator[AssembledBlock]:
        ...

    def release(self, address: str, transfer_id: str) -> None:
        ...

    def close(self) -> None:
        ...


class KVSenderServer(Protocol):
    """Producer side: serves held blocks until stopped."""

    @property
    def address(self) -> str:
        ...

    def stop(self, grace_s: float) -> None:
        ...
