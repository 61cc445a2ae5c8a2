"""The transport seam: how a consumer reads a producer's KV blocks into its own blocks.

The control path (handshake, opening a transfer, release, errors) is gRPC on the producer's KV
port, whatever the transport; the data path is picked per peer at handshake, from what both
ends support, in this order:
  shm       same host: the consumer copies straight out of the producer's KV cache, which lives in
            shared memory (pdmesh/transport/shm/)
  mooncake  Mooncake Transfer Engine reads the producer's registered KV cache into the consumer's
            (TCP here, RDMA / Ascend where the hardware has it; pdmesh/transport/mooncake/)
  grpc      the producer streams the blocks' bytes (prefill/kv/grpc_kv_server.py, decode/kv/grpc_kv_reader.py)
Every reader verifies each block's content hash before it lands and its checksum on the bytes that
landed; a block that fails, and those after it, are reported failed (vLLM recomputes them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdmesh.kv.kv_layout import LayerRegion

GRPC, SHM, MOONCAKE = "grpc", "shm", "mooncake"
TRANSPORTS = (SHM, MOONCAKE, GRPC)  # the order a producer prefers them in


@dataclass(frozen=True)
class PeerLink:
    """What a consumer learned from a producer at handshake."""

    address: str                          # the producer's KV port (control, and gRPC data)
    transport: str
    regions: tuple[LayerRegion, ...] = ()  # shm, mooncake: the producer's KV cache, per layer
    mooncake_session: str = ""


@dataclass(frozen=True)
class ReadOptions:
    """How one read treats its bytes. `tamper` alters blocks between producer and consumer (the
    fault tests' wrong-KV control); `verify=False` skips the checksum, to show what it catches."""

    verify: bool = True
    tamper: Callable[[object], None] | None = field(default=None, compare=False)
    stall_s: float = 0.0  # fault tests: a pause in the middle of the read (a peer is killed meanwhile)


class KVReader(Protocol):
    """The consumer side of one transport."""

    transport: str

    def read_blocks(self, link: PeerLink, transfer_id: str, block_indexes: Sequence[int],
                    local_block_ids: Sequence[int], expected_hashes: Sequence[bytes],
                    options: ReadOptions = ReadOptions()) -> Iterator[int]:
        """Moves the transfer's blocks at `block_indexes` into `local_block_ids`, in order, yielding
        how many have landed verified so far; raises a domain error at the first block that fails
        (the ones before it stay). `expected_hashes` (the content hash of each of the request's
        blocks) may compute itself on first use: readers touch it while their first call travels."""
        ...

    def close(self) -> None:
        ...


class KVExporter(Protocol):
    """The producer side of a registered-memory transport: describes its memory at handshake."""

    transport: str

    def accepts(self, consumer_host_id: str) -> bool:
        ...

    def describe(self) -> tuple[list[LayerRegion], str]:
        """(regions, mooncake session) for the handshake response."""
        ...

    def close(self) -> None:
        ...
