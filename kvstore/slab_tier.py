"""Memory tiers: one preallocated slab of equal slots with a free-list allocator.

`host_tier` is the DDR tier (a NumPy slab; pinned through torch where a CUDA/NPU device can
DMA from it); `device_tier` is the accelerator tier (a torch buffer on the engine's device;
on the CPU target that is host memory again, kept apart from the DDR tier's budget).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kvstore.block_key import BlockKey
from kvstore.tier import Payload


class _NumpySlab:
    def __init__(self, num_slots: int, block_nbytes: int, pin_memory: bool) -> None:
        if pin_memory:
            import torch

            self._array = torch.empty((num_slots, block_nbytes), dtype=torch.uint8, pin_memory=True).numpy()
        else:
            self._array = np.empty((num_slots, block_nbytes), dtype=np.uint8)

    def write(self, slot: int, payload: Payload) -> None:
        self._array[slot] = np.frombuffer(payload, dtype=np.uint8)

    def read(self, slot: int) -> memoryview:
        return memoryview(self._array[slot].copy())


class _TorchSlab:
    def __init__(self, num_slots: int, block_nbytes: int, device: str) -> None:
        import torch

        self._torch = torch
        self._tensor = torch.empty((num_slots, block_nbytes), dtype=torch.uint8, device=device)

    def write(self, slot: int, payload: Payload) -> None:
        self._tensor[slot].copy_(self._torch.frombuffer(bytearray(payload), dtype=self._torch.uint8))

    def read(self, slot: int) -> memoryview:
        return memoryview(self._tensor[slot].cpu().numpy().copy())


class SlabTier:
    def __init__(self, name: str, capacity_bytes: int, block_nbytes: int, slab_factory) -> None:
        self.name = name
        self.capacity_blocks = capacity_bytes // block_nbytes
        self._block_nbytes = block_nbytes
        self._slab = slab_factory(self.capacity_blocks, block_nbytes)
        self._free_slots = list(range(self.capacity_blocks - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def num_free(self) -> int:
        return len(self._free_slots)

    def write(self, key: BlockKey, payload: Payload, checksum: int) -> int:
        if len(payload) != self._block_nbytes:
            raise ValueError(f"payload of {len(payload)} bytes, slots hold {self._block_nbytes}")
        slot = self._free_slots.pop()
        self._slab.write(slot, payload)
        return slot

    def read(self, handle: int) -> memoryview:
        return self._slab.read(handle)

    def free(self, handle: int) -> None:
        self._free_slots.append(handle)

    def recovered(self) -> Iterator[tuple[BlockKey, object, int]]:
        return iter(())


def host_tier(capacity_bytes: int, block_nbytes: int, pin_memory: bool = False) -> SlabTier:
    return SlabTier("dram", capacity_bytes, block_nbytes, lambda n, b: _NumpySlab(n, b, pin_memory))


def device_tier(capacity_bytes: int, block_nbytes: int, device: str = "cpu") -> SlabTier:
    return SlabTier("device", capacity_bytes, block_nbytes, lambda n, b: _TorchSlab(n, b, device))
