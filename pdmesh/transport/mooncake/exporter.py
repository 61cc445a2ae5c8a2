"""The producer side of the Mooncake transport: its KV cache registered with the engine once, and
offered to any consumer that has an engine too."""

from __future__ import annotations

from collections.abc import Sequence

from pdmesh.transport.kv_layout import LayerRegion
from pdmesh.transport.kv_transport import MOONCAKE
from pdmesh.transport.mooncake.engine import MooncakeEngine


class MooncakeKVExporter:
    transport = MOONCAKE

    def __init__(self, engine: MooncakeEngine, regions: Sequence[LayerRegion]) -> None:
        self._engine = engine
        self._regions = list(regions)
        engine.register(self._regions)

    def accepts(self, consumer_host_id: str) -> bool:
        return True

    def describe(self) -> tuple[list[LayerRegion], str]:
        return self._regions, self._engine.session

    def close(self) -> None:
        self._engine.unregister(self._regions)
