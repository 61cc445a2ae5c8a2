"""The producer side of the Mooncake transport: its KV cache (or its KV store's export slab)
registered with the engine once, and offered to any consumer that has an engine too."""

from __future__ import annotations

from collections.abc import Sequence

from pdmesh.kv.kv_layout import LayerRegion
from pdmesh.transport.kv_transport import MOONCAKE
from pdmesh.transport.mooncake.engine import MooncakeEngine


class MooncakeKVExporter:
    transport = MOONCAKE

    def __init__(self, engine: MooncakeEngine, regions: Sequence[LayerRegion],
                 registered: Sequence[LayerRegion] | None = None) -> None:
        """registered: the memory to register when the regions overlap (a slab of rows: its layers
        interleave), else the regions themselves."""
        self._engine = engine
        self._regions = list(regions)
        self._registered = list(registered if registered is not None else regions)
        engine.register(self._registered)

    def accepts(self, consumer_host_id: str) -> bool:
        return True

    def describe(self) -> tuple[list[LayerRegion], str]:
        return self._regions, self._engine.session

    def close(self) -> None:
        self._engine.unregister(self._registered)
