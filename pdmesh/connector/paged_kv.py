"""Reads and writes whole blocks of vLLM's paged KV cache as flat bytes.

A block's wire bytes are the block's slice of every layer, layers in registration order.
Handles per-layer tensors shaped (num_blocks, ...) and (2, num_blocks, ...) (K/V split).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdmesh.errors import InvalidRequest


@dataclass(frozen=True)
class _LayerView:
    name: str
    tensor: torch.Tensor
    block_dim: int
    block_nbytes: int


class PagedKVCache:
    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        self._layers = [self._layer_view(name, t, num_blocks) for name, t in kv_caches.items()]
        self.num_blocks = num_blocks
        self.block_nbytes = sum(layer.block_nbytes for layer in self._layers)

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
        first = self._layers[0]
        return f"block_dim={first.block_dim};shape={tuple(first.tensor.shape)};device={first.tensor.device.type}"

    def read_block(self, block_id: int) -> memoryview:
        """A fresh contiguous copy of one block across all layers."""
        return memoryview(self.read_blocks([block_id])[0].numpy())

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """One batched copy of many blocks: a (len(block_ids), block_nbytes) uint8 tensor on the host,
        row i the wire bytes of block_ids[i]. One gather per layer (C++, GIL released), not one
        Python-level copy per block and layer."""
        for block_id in block_ids:
            self._check(block_id)
        out = torch.empty((len(block_ids), self.block_nbytes), dtype=torch.uint8)
        if not block_ids:
            return out
        offset = 0
        for layer in self._layers:
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

    def write_blocks(self, block_ids: list[int], rows: torch.Tensor) -> None:
        """The inverse of read_blocks: row i of `rows` ((n, block_nbytes) uint8) into block_ids[i],
        one scatter per layer."""
        for block_id in block_ids:
            self._check(block_id)
        if tuple(rows.shape) != (len(block_ids), self.block_nbytes):
            raise InvalidRequest(f"block rows of shape {tuple(rows.shape)}, expected ({len(block_ids)}, "
                                 f"{self.block_nbytes})")
        if not block_ids:
            return
        offset = 0
        for layer in self._layers:
            index = torch.tensor(block_ids, dtype=torch.long, device=layer.tensor.device)
            block_shape = layer.tensor.select(layer.block_dim, 0).shape
            src = rows[:, offset:offset + layer.block_nbytes].contiguous().view(layer.tensor.dtype)
            src = src.view(len(block_ids), *block_shape).to(layer.tensor.device)
            if layer.block_dim != 0:
                src = src.movedim(0, layer.block_dim)
            layer.tensor.index_copy_(layer.block_dim, index, src)
            offset += layer.block_nbytes

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
