"""``RowTable``: how to address rows of several layers inside one pool buffer.

Transfers (gather, backup, page copies) move rows of several layers in one launch. Every
layer of a pool lives inside ONE backing buffer (the shared device pool, or the single host
allocation), so a layer is described by a byte offset into that buffer; the table of offsets
is built once and reused every step (no per-step pointer tables, no int-to-pointer casts).

Row ``r`` of layer ``l`` occupies bytes
``[offset(l, r), offset(l, r) + row_bytes)`` of ``pool`` where
``offset(l, r) = layer_offsets[l] + (r // block_size) * block_stride + (r % block_size) * row_bytes``.
Valid rows are ``0 <= r < num_rows``.

A table owns its offsets: the constructor copies the values in (a tensor argument is read
once, a device sync when it lives on CUDA), checks by value that every layer lies inside the
pool, and keeps the host values plus a private device copy for the kernels. Changing the
caller's tensor afterwards (in place, through an aliasing numpy array, in inference mode) has
no effect on the table, so a check made at construction can never go stale.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Optional, Sequence

import torch

from hisparse_triton.tuning import pow2_alignment

__all__ = ["RowTable"]

_WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Device copies of offset tables, by (values, device): built once, never handed out.
_DEVICE_OFFSETS: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _device_offsets(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    key = (values, device)
    tensor = _DEVICE_OFFSETS.get(key)
    if tensor is None:
        tensor = torch.tensor(values, dtype=torch.int64, device=device)
        _DEVICE_OFFSETS[key] = tensor
    return tensor


class RowTable:
    """Rows of ``num_layers`` layers inside ``pool`` (immutable).

    - ``pool``: ``[pool_bytes] uint8``, contiguous; the backing buffer (device pool, or the
      host pool: pinned CPU memory on CUDA machines).
    - ``layer_offsets``: byte offset of each layer's row 0: a 1-D int64 tensor or a sequence of
      ints; copied in and checked (every layer must fit the pool). Reading the attribute
      returns a fresh copy on ``device``.
    - ``row_bytes``: bytes of one row (one token of one layer).
    - ``block_size``: rows per block.
    - ``block_stride``: bytes from block ``b`` to block ``b + 1`` of the same layer
      (``block_size * row_bytes`` for contiguous host layers; the pool's bytes per block on
      the device).
    - ``num_rows``: rows per layer (``num_blocks * block_size``).
    - ``device``: where the kernels that use the table run (the device of the offsets
      tensor by default, else the pool's).

    ``offsets`` (a tuple of ints) and ``alignment`` (the largest power of two <= 16 dividing
    every offset) are the host-side values. Raises ``ValueError`` naming the bad value.
    """

    __slots__ = ("pool", "row_bytes", "block_size", "block_stride", "num_rows", "device",
                 "offsets", "alignment", "_offsets_dev", "_pool_bytes", "_memo")

    def __init__(self, pool: torch.Tensor, layer_offsets: torch.Tensor | Sequence[int],
                 row_bytes: int, block_size: int, block_stride: int, num_rows: int, *,
                 device: torch.device | str | None = None):
        if not isinstance(pool, torch.Tensor) or pool.dtype != torch.uint8 or pool.dim() != 1 \
                or not pool.is_contiguous():
            raise ValueError(f"RowTable.pool must be a contiguous 1-D uint8 tensor, got "
                             f"{getattr(pool, 'dtype', type(pool).__name__)} with shape "
                             f"{tuple(getattr(pool, 'shape', ()))}.")
        if isinstance(layer_offsets, torch.Tensor):
            if layer_offsets.dtype != torch.int64 or layer_offsets.dim() != 1:
                raise ValueError(f"RowTable.layer_offsets must be 1-D int64, got "
                                 f"{layer_offsets.dtype} with shape "
                                 f"{tuple(layer_offsets.shape)}.")
            values = tuple(int(v) for v in layer_offsets.detach().cpu().tolist())
            where = layer_offsets.device if device is None else device
        else:
            values = tuple(layer_offsets)
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                raise ValueError(f"RowTable.layer_offsets must be ints, got {values!r}.")
            where = pool.device if device is None else device
        for name, value in (("row_bytes", row_bytes), ("block_size", block_size),
                            ("block_stride", block_stride), ("num_rows", num_rows)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"RowTable.{name} must be a positive int, got {value!r}.")
        if num_rows % block_size:
            raise ValueError(f"RowTable.num_rows={num_rows} is not a multiple of "
                             f"block_size={block_size}.")
        if block_stride < block_size * row_bytes:
            raise ValueError(f"RowTable.block_stride={block_stride} is smaller than one "
                             f"page ({block_size} x {row_bytes} B).")
        span = (num_rows // block_size - 1) * block_stride + block_size * row_bytes
        for layer, offset in enumerate(values):
            if offset < 0 or offset + span > pool.numel():
                raise ValueError(f"layer {layer} at byte offset {offset} spans {span} B and "
                                 f"does not fit a pool of {pool.numel()} B.")
        setattr_ = object.__setattr__
        setattr_(self, "pool", pool)
        setattr_(self, "row_bytes", row_bytes)
        setattr_(self, "block_size", block_size)
        setattr_(self, "block_stride", block_stride)
        setattr_(self, "num_rows", num_rows)
        setattr_(self, "device", torch.device(where))
        setattr_(self, "offsets", values)
        setattr_(self, "alignment", pow2_alignment(*values))
        setattr_(self, "_offsets_dev", _device_offsets(values, torch.device(where)))
        setattr_(self, "_pool_bytes", pool.numel())
        setattr_(self, "_memo", {})

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"RowTable is immutable (cannot set {name!r}); build a new one.")

    def __repr__(self) -> str:
        return (f"RowTable(pool={self.pool.numel()} B on {self.pool.device}, "
                f"layers={len(self.offsets)}, row_bytes={self.row_bytes}, "
                f"block_size={self.block_size}, block_stride={self.block_stride}, "
                f"num_rows={self.num_rows}, device={self.device})")

    @classmethod
    def build(cls, pool: torch.Tensor, offsets: Sequence[int], *, row_bytes: int,
              block_size: int, block_stride: int, num_rows: int,
              device: torch.device | str | None = None) -> "RowTable":
        """Build a table, checking that every layer's last row lies inside ``pool``."""
        return cls(pool, list(offsets), row_bytes, block_size, block_stride, num_rows,
                   device=device)

    @property
    def layer_offsets(self) -> torch.Tensor:
        """``[num_layers] int64`` on ``device``: a copy (changing it changes nothing)."""
        return self._offsets_dev.clone()

    def device_offsets(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """The offsets as an int64 tensor on ``device`` (default: the table's) for the
        kernels and the reference. Shared and cached: never modify it."""
        if device is None or device == self.device:
            return self._offsets_dev
        return _device_offsets(self.offsets, device)

    def word_view(self, word: int) -> torch.Tensor:
        """``pool`` reinterpreted as ``word``-byte words (the tail shorter than a word
        dropped); cached per word size."""
        return self.cached(("word_view", word), lambda: self.pool[
            : self.pool.numel() // word * word].view(_WORD_DTYPES[word]))

    def cached(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """``build()``, computed once per ``key`` and kept with the table (for launchers:
        launch shapes, views). The table is immutable, so an entry never goes stale as long
        as ``key`` names everything else it depends on."""
        memo = self._memo
        value = memo.get(key, memo)
        if value is memo:
            value = memo[key] = build()
        return value

    def check_pool(self) -> None:
        """Raise ``ValueError`` if the pool was resized in place since construction."""
        if self.pool.numel() != self._pool_bytes:
            raise ValueError(f"the pool of this RowTable was resized from {self._pool_bytes} "
                             f"to {self.pool.numel()} B after the table was built.")

    @property
    def num_layers(self) -> int:
        return len(self.offsets)

    @property
    def num_blocks(self) -> int:
        return self.num_rows // self.block_size

    def row_view(self, layer: int) -> torch.Tensor:
        """``[num_blocks, block_size, row_bytes] uint8`` view of one layer (a strided view)."""
        offset = self.offsets[layer]
        return self.pool.as_strided((self.num_blocks, self.block_size, self.row_bytes),
                                    (self.block_stride, self.row_bytes, 1),
                                    self.pool.storage_offset() + offset)
