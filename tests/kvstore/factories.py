"""Small builders shared by the kvstore tests."""

from __future__ import annotations

from kvstore.block_key import BlockKey, block_keys
from kvstore.block_store import TieredBlockStore
from kvstore.disk_tier import DiskTier
from kvstore.slab_tier import device_tier, host_tier

BLOCK_NBYTES = 64
BLOCK_SIZE = 4
SEED = b"fp-test"


def keys(num_blocks: int, first_token: int = 0, extra_key: bytes = b"") -> list[BlockKey]:
    tokens = list(range(first_token, first_token + num_blocks * BLOCK_SIZE))
    return block_keys(SEED, tokens, BLOCK_SIZE, extra_key)


def payload(i: int) -> bytes:
    return bytes([i % 256]) * BLOCK_NBYTES


def three_tier_store(disk_dir, device_blocks=2, dram_blocks=2, nvme_blocks=2, listener=None) -> TieredBlockStore:
    return TieredBlockStore([device_tier(device_blocks * BLOCK_NBYTES, BLOCK_NBYTES),
                             host_tier(dram_blocks * BLOCK_NBYTES, BLOCK_NBYTES),
                             DiskTier(disk_dir, nvme_blocks * BLOCK_NBYTES, BLOCK_NBYTES)],
                            BLOCK_NBYTES, listener)


def flip_bit(path, offset: int, mask: int = 0x10) -> None:
    """Corrupts one byte of a file in place (a bit rotted on disk)."""
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)[0]
        file.seek(offset)
        file.write(bytes([byte ^ mask]))
