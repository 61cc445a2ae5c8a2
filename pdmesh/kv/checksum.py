"""The one checksum of KV bytes, on every transport and every store tier.

A block's bytes are pieces in wire order (a layer's K or V run: pdmesh/kv/kv_layout.py). Its
checksum is the xxh3-64 of its pieces' xxh3-64 digests, in order. Piecewise because a
registered-memory transport lands a block piece by piece and hashes each piece right after its
copy, while it is still in cache; a block held whole (a gRPC message, a store tier) is checksummed
the same way from its bytes, so a block has one checksum whichever way it travels or rests. A
partial block (some layers of it, the layer-wise flow over gRPC) is checksummed the same way over
the pieces it holds. xxh3 checks bytes, it does not name them (pdmesh/kv/block_hash.py does)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

piece_digest = xxhash.xxh3_64_intdigest   # one piece's digest: the readers hash each piece as it lands


def combine(piece_digests: np.ndarray) -> list[int]:
    """Block checksums from their pieces' digests ((blocks, pieces) uint64, pieces in wire order)."""
    return [xxhash.xxh3_64_intdigest(row.tobytes()) for row in piece_digests]


def block_checksum(data: bytes | bytearray | memoryview | np.ndarray, piece_nbytes: Sequence[int] | None = None) -> int:
    """The checksum of one block's bytes whose pieces are `piece_nbytes` long, in order (None: the
    bytes are one piece)."""
    view = memoryview(data).cast("B")
    if piece_nbytes is None:
        piece_nbytes = (view.nbytes,)
    if sum(piece_nbytes) != view.nbytes:
        raise ValueError(f"pieces of {sum(piece_nbytes)} bytes for a block of {view.nbytes}")
    digests = np.empty((1, len(piece_nbytes)), dtype=np.uint64)
    offset = 0
    for column, nbytes in enumerate(piece_nbytes):
        digests[0, column] = piece_digest(view[offset:offset + nbytes])
        offset += nbytes
    return combine(digests)[0]


def pieces_of(layer_pieces: Sequence[Sequence[int]] | None, layers: range | None = None) -> list[int] | None:
    """The piece sizes, in wire order, of the bytes a block sends: every layer's, or `layers`'
    (layer_pieces: each layer's pieces; None: a block is one piece, as is any part of one)."""
    if layer_pieces is None:
        return None
    chosen = layer_pieces if layers is None else layer_pieces[layers.start:layers.stop]
    return [nbytes for layer in chosen for nbytes in layer]
