"""The producer side of the shared-memory transport: its KV cache, already moved into /dev/shm,
offered to consumers on the same host."""

from __future__ import annotations

from collections.abc import Sequence

from pdmesh.kv.kv_layout import LayerRegion
from pdmesh.transport.host_id import host_id
from pdmesh.transport.kv_transport import SHM


class ShmKVExporter:
    transport = SHM

    def __init__(self, regions: Sequence[LayerRegion]) -> None:
        self._regions = list(regions)

    def accepts(self, consumer_host_id: str) -> bool:
        return consumer_host_id == host_id()

    def describe(self) -> tuple[list[LayerRegion], str]:
        return self._regions, ""

    def close(self) -> None:
        return None
