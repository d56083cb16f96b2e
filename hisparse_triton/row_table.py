"""``RowTable``: how to address rows of several layers inside one pool buffer.

Transfers (gather, backup, page copies) move rows of several layers in one launch. Every
layer of a pool lives inside ONE backing buffer (the shared device pool, or the single host
allocation), so a layer is described by a byte offset into that buffer; the table of offsets
is built once and reused every step (no per-step pointer tables, no int-to-pointer casts).

Row ``r`` of layer ``l`` occupies bytes
``[offset(l, r), offset(l, r) + row_bytes)`` of ``pool`` where
``offset(l, r) = layer_offsets[l] + (r // block_size) * block_stride + (r % block_size) * row_bytes``.
Valid rows are ``0 <= r < num_rows``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class RowTable:
    """Rows of ``len(layer_offsets)`` layers inside ``pool``.

    - ``pool``: ``[pool_bytes] uint8``, contiguous; the backing buffer (device pool, or the
      host pool: pinned CPU memory on CUDA machines).
    - ``layer_offsets``: ``[num_layers] int64`` byte offset of each layer's row 0, on the
      device the kernels run on (CUDA, or CPU for the torch backend / interpreter).
    - ``row_bytes``: bytes of one row (one token of one layer).
    - ``block_size``: rows per block.
    - ``block_stride``: bytes from block ``b`` to block ``b + 1`` of the same layer
      (``block_size * row_bytes`` for contiguous host layers; the pool's bytes per block on
      the device).
    - ``num_rows``: rows per layer (``num_blocks * block_size``).
    """

    pool: torch.Tensor
    layer_offsets: torch.Tensor
    row_bytes: int
    block_size: int
    block_stride: int
    num_rows: int

    def __post_init__(self) -> None:
        if self.pool.dtype != torch.uint8 or self.pool.dim() != 1 or not self.pool.is_contiguous():
            raise ValueError(f"RowTable.pool must be a contiguous 1-D uint8 tensor, got "
                             f"{self.pool.dtype} with shape {tuple(self.pool.shape)}.")
        if self.layer_offsets.dtype != torch.int64 or self.layer_offsets.dim() != 1:
            raise ValueError(f"RowTable.layer_offsets must be 1-D int64, got "
                             f"{self.layer_offsets.dtype} with shape "
                             f"{tuple(self.layer_offsets.shape)}.")
        for name in ("row_bytes", "block_size", "block_stride", "num_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"RowTable.{name} must be a positive int, got {value!r}.")
        if self.num_rows % self.block_size:
            raise ValueError(f"RowTable.num_rows={self.num_rows} is not a multiple of "
                             f"block_size={self.block_size}.")
        if self.block_stride < self.block_size * self.row_bytes:
            raise ValueError(f"RowTable.block_stride={self.block_stride} is smaller than one "
                             f"page ({self.block_size} x {self.row_bytes} B).")

    @classmethod
    def build(cls, pool: torch.Tensor, offsets: Sequence[int], *, row_bytes: int,
              block_size: int, block_stride: int, num_rows: int,
              device: torch.device | str | None = None) -> "RowTable":
        """Build a table, checking that every layer's last row lies inside ``pool``."""
        num_blocks = num_rows // block_size if block_size else 0
        last_end = (num_blocks - 1) * block_stride + block_size * row_bytes
        for layer, offset in enumerate(offsets):
            if offset < 0 or offset + last_end > pool.numel():
                raise ValueError(f"layer {layer} at byte offset {offset} spans "
                                 f"{last_end} B and does not fit a pool of {pool.numel()} B.")
        table = torch.tensor(list(offsets), dtype=torch.int64,
                             device=device if device is not None else pool.device)
        return cls(pool=pool, layer_offsets=table, row_bytes=row_bytes, block_size=block_size,
                   block_stride=block_stride, num_rows=num_rows)

    @property
    def num_layers(self) -> int:
        return int(self.layer_offsets.numel())

    @property
    def num_blocks(self) -> int:
        return self.num_rows // self.block_size

    def row_view(self, layer: int) -> torch.Tensor:
        """``[num_blocks, block_size, row_bytes] uint8`` view of one layer (a strided view).

        Reads the layer's offset from ``layer_offsets`` (a device sync on CUDA): not for the
        decode hot path.
        """
        offset = int(self.layer_offsets[layer])
        return self.pool.as_strided((self.num_blocks, self.block_size, self.row_bytes),
                                    (self.block_stride, self.row_bytes, 1),
                                    self.pool.storage_offset() + offset)
