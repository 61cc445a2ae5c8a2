"""Per-block integrity checksum used on every KV hop."""

import xxhash


def block_checksum(payload: bytes | bytearray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)
