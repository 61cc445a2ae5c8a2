"""Mooncake Transfer Engine reader: each batch of merged block runs is one batch read from the
producer's registered KV cache straight into this engine's registered KV cache."""

from __future__ import annotations

from collections.abc import Sequence

from pdmesh.transport.kv_layout import Copy
from pdmesh.transport.kv_transport import MOONCAKE, PeerLink
from pdmesh.transport.mooncake.engine import MooncakeEngine
from pdmesh.transport.registered_reader import RegisteredMemoryReader


class MooncakeKVReader(RegisteredMemoryReader):
    transport = MOONCAKE

    def __init__(self, engine: MooncakeEngine, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._engine = engine
        engine.register(self._local)

    def _move(self, link: PeerLink, copies: Sequence[Copy]) -> None:
        self._engine.read(link.mooncake_session,
                          [self._local[c.layer].base + c.dst for c in copies],
                          [link.regions[c.layer].base + c.src for c in copies],
                          [c.nbytes for c in copies])

    def close(self) -> None:
        self._engine.unregister(self._local)
