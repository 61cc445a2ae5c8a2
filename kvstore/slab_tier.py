"""Memory tiers: one preallocated slab of equal slots with a free-list allocator.

`host_tier` is the DDR tier (a NumPy slab; pinned through torch where a CUDA/NPU device can
DMA from it); `device_tier` is the accelerator tier (a torch buffer on the engine's device;
on the CPU target that is host memory again, kept apart from the DDR tier's budget). A batch is
one gather or scatter over the slab (a single C-level copy), never a copy per block in Python.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from kvstore.block_key import BlockKey
from kvstore.tier import FreeSlots, check_rows


class _NumpySlab:
    def __init__(self, num_slots: int, block_nbytes: int, pin_memory: bool) -> None:
        if pin_memory:
            import torch

            self._array = torch.empty((num_slots, block_nbytes), dtype=torch.uint8, pin_memory=True).numpy()
        else:
            self._array = np.empty((num_slots, block_nbytes), dtype=np.uint8)

    def write(self, slots: list[int], rows: np.ndarray) -> None:
        self._array[slots] = rows

    def read(self, slots: list[int], out: np.ndarray) -> None:
        np.take(self._array, slots, axis=0, out=out, mode="clip")  # "raise" buffers `out`


class _TorchSlab:
    def __init__(self, num_slots: int, block_nbytes: int, device: str) -> None:
        import torch

        self._torch = torch
        self._tensor = torch.empty((num_slots, block_nbytes), dtype=torch.uint8, device=device)

    def write(self, slots: list[int], rows: np.ndarray) -> None:
        index = self._torch.tensor(slots, dtype=self._torch.long, device=self._tensor.device)
        self._tensor.index_copy_(0, index, self._torch.from_numpy(rows).to(self._tensor.device))

    def read(self, slots: list[int], out: np.ndarray) -> None:
        index = self._torch.tensor(slots, dtype=self._torch.long, device=self._tensor.device)
        self._torch.from_numpy(out).copy_(self._tensor.index_select(0, index).cpu())


class SlabTier:
    slow = False

    def __init__(self, name: str, capacity_bytes: int, block_nbytes: int, slab_factory) -> None:
        self.name = name
        self.capacity_blocks = capacity_bytes // block_nbytes
        self._block_nbytes = block_nbytes
        self._slab = slab_factory(self.capacity_blocks, block_nbytes)
        self._free_slots = FreeSlots(name, self.capacity_blocks)

    @property
    def num_free(self) -> int:
        return len(self._free_slots)

    def allocate(self, num_blocks: int) -> list[int]:
        return self._free_slots.take(num_blocks)

    def write_many(self, handles: Sequence[int], keys: Sequence[BlockKey], rows: np.ndarray,
                   checksums: Sequence[int]) -> None:
        check_rows(self.name, rows, len(handles), self._block_nbytes)
        self._slab.write(list(handles), rows)

    def read_many(self, handles: Sequence[int], out: np.ndarray) -> None:
        self._slab.read(list(handles), out)

    def free(self, handle: int) -> None:
        self._free_slots.give_back(handle)

    def recovered(self) -> Iterator[tuple[BlockKey, object, int]]:
        return iter(())


def host_tier(capacity_bytes: int, block_nbytes: int, pin_memory: bool = False) -> SlabTier:
    return SlabTier("dram", capacity_bytes, block_nbytes, lambda n, b: _NumpySlab(n, b, pin_memory))


def device_tier(capacity_bytes: int, block_nbytes: int, device: str = "cpu") -> SlabTier:
    return SlabTier("device", capacity_bytes, block_nbytes, lambda n, b: _TorchSlab(n, b, device))
