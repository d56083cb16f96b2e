"""Where each layer's rows lie in a worker's two byte pools (``PoolLayers``).

A plan's ``KVCacheTensor``s place every layer at a byte offset of ONE pool buffer: source
(sparse) layers in the host pool, every device layer in the device pool. ``PoolLayers``
answers the row size of a layer, the ``RowTable`` pair a transfer between the two pools of
some layers uses, and the uint8 views a model reads and writes.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from hisparse_triton.groups import PlanGroups
from hisparse_triton.layout import device_row_layout, underlying_layer_name
from hisparse_triton.row_table import RowTable
from hisparse_triton.specs import KVCacheConfig
from hisparse_triton.worker.pools import DevicePool, HostPool

__all__ = ["PoolLayers"]


class PoolLayers:
    """The layers of one plan inside a host pool and a device pool (read-only geometry).

    ``num_device_blocks`` / ``num_host_blocks`` blocks of ``groups.block_size`` rows (a device
    group's own block size for its layers); ``bytes_per_block`` bytes per device block.
    """

    def __init__(self, groups: PlanGroups, kv_cache_config: KVCacheConfig,
                 host_pool: HostPool, device_pool: DevicePool,
                 device: torch.device) -> None:
        self.groups, self.kv_cache_config = groups, kv_cache_config
        self.host_pool, self.device_pool, self.device = host_pool, device_pool, device
        self.block_size = groups.block_size
        self.num_device_blocks = kv_cache_config.num_blocks
        self.num_host_blocks = kv_cache_config.hisparse_host_num_blocks
        self.bytes_per_block = kv_cache_config.bytes_per_block

    def row_bytes(self, name: str, *, host: bool) -> int:
        """Bytes of one row of layer ``name`` (a host or a device tensor name);
        ``ValueError`` when its tensor is not whole pages of whole rows."""
        groups = self.groups
        tensor = (groups.host_tensors if host else groups.device_tensors)[name]
        blocks = self.num_host_blocks if host else self.num_device_blocks
        rows = self.block_size if host else groups.groups[groups.layer_group[name]].block_size
        page, rem = divmod(tensor.size, blocks)
        if rem or page % rows:
            raise ValueError(f"layer {name!r}: tensor of {tensor.size} B is not {blocks} pages "
                             f"of {rows} rows.")
        return page // rows

    def row_tables(self, layers: Sequence[str]) -> tuple[RowTable, RowTable, int]:
        """``(device_table, host_table, row_bytes)`` of source layers ``layers`` (all of one
        row size): their resident rows in the device pool and their rows in the host pool."""
        groups, B = self.groups, self.block_size
        sizes = {self.row_bytes(layer, host=True) for layer in layers}
        if len(sizes) != 1:
            raise ValueError(f"layers {layers[0]!r}..{layers[-1]!r} mix row sizes "
                             f"{sorted(sizes)} B.")
        row_bytes = sizes.pop()
        device_names = [groups.resident_layer_name[layer] for layer in layers]
        for layer, name in zip(layers, device_names):
            if self.row_bytes(name, host=False) != row_bytes:
                raise ValueError(f"layer {layer!r} has different host and device rows.")
            if groups.host_tensors[layer].block_stride != B * row_bytes:
                raise ValueError(f"host layer {layer!r} is not contiguous (block stride "
                                 f"{groups.host_tensors[layer].block_stride}).")
        device_table = RowTable.build(
            self.device_pool.tensor, [groups.device_tensors[n].offset for n in device_names],
            row_bytes=row_bytes, block_size=B, block_stride=self.bytes_per_block,
            num_rows=self.num_device_blocks * B, device=self.device)
        host_table = RowTable.build(
            self.host_pool.raw, [groups.host_tensors[layer].offset for layer in layers],
            row_bytes=row_bytes, block_size=B, block_stride=B * row_bytes,
            num_rows=self.num_host_blocks * B, device=self.device)
        return device_table, host_table, row_bytes

    def row_offsets(self, layer_name: str, rows: object, *, host: bool) -> np.ndarray:
        """``[n] int64`` byte offsets of ``rows`` (``[n]`` row ids, as the scheduler names
        them) of a layer from the start of its pool's buffer: the host pool for ``host``
        (a source layer's host rows), else the device pool. ``ValueError`` for a row outside
        the pool, ``KeyError`` for a layer the pool does not hold."""
        if host:
            name = underlying_layer_name(layer_name)
            if name not in self.groups.host_tensors:
                raise KeyError(f"{layer_name!r} is not a source (sparse) layer of this "
                               f"worker.")
            tensor, block_size = self.groups.host_tensors[name], self.block_size
            num_rows, stride = self.num_host_blocks * block_size, tensor.block_stride
        else:
            name = self.groups.device_layer_name(layer_name)
            tensor = self.groups.device_tensors[name]
            block_size = self.groups.groups[self.groups.layer_group[name]].block_size
            num_rows, stride = self.num_device_blocks * block_size, self.bytes_per_block
        rows = np.asarray(rows)
        if rows.ndim != 1 or (rows.size and not np.issubdtype(rows.dtype, np.integer)):
            raise ValueError(f"rows must be a 1-D integer array, got {rows.dtype} of shape "
                             f"{rows.shape}.")
        rows = rows.astype(np.int64)
        bad = (rows < 0) | (rows >= num_rows)
        if bad.any():
            raise ValueError(f"row {int(rows[bad][0])} is outside the {'host' if host else 'device'}"
                             f" pool's {num_rows} rows of layer {layer_name!r}.")
        row_bytes = self.row_bytes(name, host=host)
        return tensor.offset + rows // block_size * stride + rows % block_size * row_bytes

    def device_cache(self, layer_name: str) -> torch.Tensor:
        """``[num_blocks, block_size, row_bytes] uint8`` view of a device layer (any name
        ``PlanGroups.device_layer_name`` accepts)."""
        name = self.groups.device_layer_name(layer_name)
        tensor = self.groups.device_tensors[name]
        group = self.groups.groups[self.groups.layer_group[name]]
        return self.device_pool.view(tensor.offset, group.block_size,
                                     self.row_bytes(name, host=False))

    def device_rows(self, layer_name: str) -> torch.Tensor:
        """``[num_rows, row_bytes] uint8`` flat view of a sparse layer of a row-aligned plan
        (``ValueError`` otherwise)."""
        layout = device_row_layout(self.kv_cache_config, layer_name)
        pool = self.device_pool.tensor
        return pool.as_strided((layout.num_rows, layout.row_bytes), (layout.row_bytes, 1),
                               pool.storage_offset() + layout.offset_bytes)

    def host_cache(self, layer_name: str) -> torch.Tensor:
        """``[host_num_blocks, block_size, row_bytes] uint8`` view of a source layer's host
        rows (``KeyError`` for a layer that has none)."""
        name = underlying_layer_name(layer_name)
        if name not in self.groups.host_tensors:
            raise KeyError(f"{layer_name!r} is not a source (sparse) layer of this worker.")
        tensor = self.groups.host_tensors[name]
        return self.host_pool.view(tensor.offset, self.num_host_blocks, self.block_size,
                                   self.row_bytes(name, host=True), tensor.block_stride)
