"""Reads and writes whole blocks of vLLM's paged KV cache as flat bytes.

A block's wire bytes are the block's slice of every layer, layers in registration order.
Handles per-layer tensors shaped (num_blocks, ...) and (2, num_blocks, ...) (K/V split).
A cache whose block pieces are head-major ((heads, block_size, ...): the CPU backend's
[num_blocks, num_kv_heads, block_size, 2 * head_size], or HND) can also take the blocks of a
producer with `k` times as many tensor-parallel ranks: rank j's heads land as the j-th of k equal
runs of each piece (`head_slice`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from pdmesh.errors import InvalidRequest
from pdmesh.kv.kv_layout import WHOLE, LayerRegion, block_checksums, row_checksums
from pdmesh.transport.shm import segments


@dataclass(frozen=True)
class _LayerView:
    name: str
    tensor: torch.Tensor
    block_dim: int
    block_nbytes: int




class PagedKVCache:
    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int, num_kv_heads: int = 0,
                 block_size: int = 0) -> None:
        """num_kv_heads, block_size: this rank's KV heads and tokens per block (0: unknown, so no
        head slices)."""
        self._layers = [self._layer_view(name, t, num_blocks) for name, t in kv_caches.items()]
        self.num_blocks = num_blocks
        self.block_nbytes = sum(layer.block_nbytes for layer in self._layers)
        # Reads on an accelerator go on a stream of their own: on the compute stream a read would queue
        # behind the step's later layers and wait for its whole forward (the layer-wise flow reads a
        # layer once its event has completed: prefill/kv/device_progress.py).
        device = self._layers[0].tensor.device
        self._read_stream = torch.Stream(device=device) if device.type != "cpu" else None
        pieces = {_piece_shape(layer) for layer in self._layers}
        self.heads_outer = (len(pieces) == 1 and num_kv_heads > 0 and num_kv_heads != block_size
                            and all(len(p) == 3 and p[0] == num_kv_heads and p[1] == block_size for p in pieces))

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def dtype(self) -> str:
        return str(self._layers[0].tensor.dtype).removeprefix("torch.")

    @property
    def device(self) -> str:
        return str(self._layers[0].tensor.device)

    @property
    def layout(self) -> str:
        """A block's shape (heads named, not counted, where they are outermost: ranks hold shares)."""
        first = self._layers[0]
        block = tuple(first.tensor.select(first.block_dim, 0).shape)
        if self.heads_outer:
            head_dim = 0 if first.block_dim == 0 else 1
            block = block[:head_dim] + ("heads",) + block[head_dim + 1:]
        return f"block_dim={first.block_dim};block={block};device={first.tensor.device.type}"

    def read_block(self, block_id: int) -> memoryview:
        """A fresh contiguous copy of one block across all layers."""
        return memoryview(self.read_blocks([block_id])[0].numpy())

    def read_blocks(self, block_ids: list[int], layers: range | None = None) -> torch.Tensor:
        """One batched copy of many blocks: a (len(block_ids), block_nbytes) uint8 tensor on the host,
        row i the wire bytes of block_ids[i] (of `layers` only, if given). One gather per layer (C++,
        GIL released), not one Python-level copy per block and layer."""
        for block_id in block_ids:
            self._check(block_id)
        if self._read_stream is None:
            return self._gather(block_ids, layers)
        with self._read_stream:
            return self._gather(block_ids, layers)  # the copy to host memory waits for this stream only

    def _gather(self, block_ids: list[int], layers: range | None) -> torch.Tensor:
        chosen = self._chosen(layers)
        out = torch.empty((len(block_ids), sum(layer.block_nbytes for layer in chosen)), dtype=torch.uint8)
        if not block_ids:
            return out
        offset = 0
        for layer in chosen:
            index = torch.tensor(block_ids, dtype=torch.long, device=layer.tensor.device)
            gathered = layer.tensor.index_select(layer.block_dim, index)  # block axis first or second
            if layer.block_dim != 0:
                gathered = gathered.movedim(layer.block_dim, 0)
            rows = gathered.reshape(len(block_ids), -1).view(torch.uint8)
            out[:, offset:offset + layer.block_nbytes].copy_(rows.cpu())
            offset += layer.block_nbytes
        return out

    def write_block(self, block_id: int, payload: bytes | bytearray | memoryview) -> None:
        if len(payload) != self.block_nbytes:
            raise InvalidRequest(f"block payload {len(payload)} bytes, expected {self.block_nbytes}")
        self.write_blocks([block_id], torch.frombuffer(payload, dtype=torch.uint8).view(1, -1))

    def write_blocks(self, block_ids: list[int], rows: torch.Tensor, head_slice: tuple[int, int] = WHOLE,
                     layers: range | None = None) -> None:
        """The inverse of read_blocks: row i of `rows` ((n, block_nbytes) uint8) into block_ids[i],
        one scatter per layer (of `layers` only, if given). With head_slice (j, k) the rows are a
        producer rank's blocks (block_nbytes / k each) and fill the j-th of k head ranges."""
        for block_id in block_ids:
            self._check(block_id)
        part, num_slices = head_slice
        chosen = self._chosen(layers)
        row_nbytes = self._slice_nbytes(num_slices) * sum(layer.block_nbytes for layer in chosen) // self.block_nbytes
        if tuple(rows.shape) != (len(block_ids), row_nbytes):
            raise InvalidRequest(f"block rows of shape {tuple(rows.shape)}, expected ({len(block_ids)}, {row_nbytes})")
        if not block_ids:
            return
        offset = 0
        for layer in chosen:
            index = torch.tensor(block_ids, dtype=torch.long, device=layer.tensor.device)
            target = layer.tensor
            if num_slices > 1:
                head_dim = layer.block_dim + 1  # (blocks, heads, ...) or (2, blocks, heads, ...)
                num_heads = target.shape[head_dim] // num_slices
                target = target.narrow(head_dim, part * num_heads, num_heads)  # a view: writes land in the cache
            block_shape = target.select(layer.block_dim, 0).shape
            nbytes = layer.block_nbytes // num_slices
            src = rows[:, offset:offset + nbytes].contiguous().view(layer.tensor.dtype)
            src = src.view(len(block_ids), *block_shape).to(layer.tensor.device)
            if layer.block_dim != 0:
                src = src.movedim(0, layer.block_dim)
            target.index_copy_(layer.block_dim, index, src)
            offset += nbytes

    def _chosen(self, layers: range | None) -> list[_LayerView]:
        return self._layers if layers is None else self._layers[layers.start:layers.stop]

    def _slice_nbytes(self, num_slices: int) -> int:
        """Bytes of a block from a producer rank holding 1/num_slices of the heads."""
        if num_slices > 1 and not self.heads_outer:
            raise InvalidRequest("this KV cache's blocks are not head-major: it cannot take a share of the heads")
        return self.block_nbytes // num_slices

    # ---- in place, for the registered-memory transports ----
    def regions(self) -> list[LayerRegion]:
        """Where each layer's blocks are, by address (None of this holds on a layout whose block
        pieces are not contiguous: `in_place` is False then)."""
        return [_region_of(layer.tensor, layer.block_dim, self.num_blocks) for layer in self._layers]

    @property
    def in_place(self) -> bool:
        """Blocks can be read and written where they are (host memory, contiguous pieces)."""
        return self.device == "cpu" and all(_pieces_contiguous(layer.tensor, layer.block_dim) for layer in self._layers)

    def views(self, regions: list[LayerRegion] | None = None) -> list[np.ndarray]:
        """Per layer, a flat uint8 view of its region (host memory only): no copy."""
        return [_bytes_at(region.base, region.nbytes) for region in regions or self.regions()]

    def slice_regions(self, head_slice: tuple[int, int]) -> list[LayerRegion]:
        """regions(), narrowed to the j-th of k head ranges of each piece (head_slice (j, k)): where a
        producer rank with 1/k of the heads has its blocks land."""
        part, num_slices = head_slice
        self._slice_nbytes(num_slices)
        regions = []
        for region in self.regions():
            nbytes = region.part_nbytes // num_slices
            regions.append(replace(region, base=region.base + part * nbytes, nbytes=region.nbytes - part * nbytes,
                                   part_nbytes=nbytes))
        return regions

    def read_bytes(self, block_ids: list[int]) -> bytes:
        """read_blocks' rows as one bytes object, joined straight from the cache where it can be (one
        copy, no intermediate tensors)."""
        for block_id in block_ids:
            self._check(block_id)
        if not self.in_place:
            return self.read_blocks(block_ids).numpy().tobytes()
        views = [memoryview(view) for view in self.views()]
        regions = self.regions()
        return b"".join(views[layer][region.offset(block_id, part):region.offset(block_id, part) + region.part_nbytes]
                        for block_id in block_ids for layer, region in enumerate(regions)
                        for part in range(region.num_parts))

    def block_checksums(self, block_ids: list[int]) -> list[int]:
        """Each block's checksum over its wire bytes, read in place where it can be (else gathered)."""
        for block_id in block_ids:
            self._check(block_id)
        if self.in_place:
            return block_checksums(self.views(), self.regions(), block_ids)
        return row_checksums(self.read_blocks(block_ids).numpy(), self.regions())

    def share_memory(self) -> list[LayerRegion]:
        """Moves the cache into shared memory, in place (every tensor and view of it follows), and
        returns its regions by shared file and offset, for a reader on this host. Raises OSError
        when it cannot (no room in /dev/shm)."""
        regions = []
        for layer in self._layers:
            storage = layer.tensor.untyped_storage()
            try:
                _, name, size = storage._share_filename_cpu_()  # torch.multiprocessing's file_system sharing
            except RuntimeError as exc:
                raise OSError(f"cannot move layer {layer.name} to shared memory: {exc}") from exc
            path = Path("/dev/shm") / name.decode().lstrip("/")
            data_offset = path.stat().st_size - size  # torch keeps a refcount header before the data
            region = _region_of(layer.tensor, layer.block_dim, self.num_blocks)
            regions.append(replace(region, base=data_offset + region.base - storage.data_ptr(), shm_path=str(path)))
        segments.record(region.shm_path for region in regions)  # swept if this process dies uncleanly
        return regions

    def _check(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise InvalidRequest(f"block id {block_id} outside [0, {self.num_blocks})")

    @staticmethod
    def _layer_view(name: str, tensor: torch.Tensor, num_blocks: int) -> _LayerView:
        block_dim = 0 if tensor.shape[0] == num_blocks else 1
        if tensor.shape[block_dim] != num_blocks:
            raise ValueError(f"layer {name}: no dimension of {tuple(tensor.shape)} is num_blocks={num_blocks}")
        block = tensor.select(block_dim, 0)
        return _LayerView(name, tensor, block_dim, block.numel() * tensor.element_size())


def _piece_shape(layer: _LayerView) -> tuple[int, ...]:
    """The shape of one block's piece of a layer (K or V when they are apart, else the whole block)."""
    block = tuple(layer.tensor.select(layer.block_dim, 0).shape)
    return block if layer.block_dim == 0 else block[1:]


def _pieces_contiguous(tensor: torch.Tensor, block_dim: int) -> bool:
    block = tensor.select(block_dim, 0)
    return block.is_contiguous() if block_dim == 0 else all(block[part].is_contiguous() for part in range(block.shape[0]))


def _region_of(tensor: torch.Tensor, block_dim: int, num_blocks: int) -> LayerRegion:
    size = tensor.element_size()
    if block_dim == 0:
        num_parts, part_stride, part_nbytes = 1, 0, tensor[0].numel() * size
    else:
        num_parts, part_stride, part_nbytes = tensor.shape[0], tensor.stride(0) * size, tensor[0, 0].numel() * size
    block_stride = tensor.stride(block_dim) * size
    nbytes = (num_parts - 1) * part_stride + (num_blocks - 1) * block_stride + part_nbytes
    return LayerRegion(base=tensor.data_ptr(), nbytes=nbytes, block_stride=block_stride, part_stride=part_stride,
                       num_parts=num_parts, part_nbytes=part_nbytes)


def _bytes_at(address: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))
