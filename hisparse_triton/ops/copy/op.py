"""``copy_rows`` / ``copy_pages``: backend dispatch and the registered custom ops.

The custom ops ``hisparse_triton::copy_rows`` / ``copy_pages`` take a ``RowTable`` flattened
as ``(pool, offsets, row_bytes, block_size, block_stride, num_rows)`` (``flat_table``; the
offsets are the table's own list of ints, so the op rebuilds the table without reading a
device tensor). CPU kernel: the reference; CUDA kernel: the Triton launcher of the copy's
direction; fake kernel: nothing (the destination pool is declared mutated).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from hisparse_triton.ops import registry
from hisparse_triton.ops.backends import all_on_cpu, choose_backend, is_eager
from hisparse_triton.ops.copy import reference
from hisparse_triton.ops.copy.contract import table_alignment
from hisparse_triton.row_table import RowTable

__all__ = ["FAMILY", "copy_pages", "copy_pages_op", "copy_rows", "copy_rows_op", "flat_table",
           "validate_table"]

#: The family name in ``registry.OP_TABLE``.
FAMILY = "copy"


def validate_table(table: RowTable, device: Optional[torch.device | str] = None) -> int:
    """Check ``table`` for kernels on ``device``: a CPU pool used by a CUDA kernel must be
    pinned (checked once per pool). Returns the power-of-two alignment (<= 16 B) of its layer
    offsets. Raises ``ValueError`` on a bad table (the layers were checked against the pool
    when the table was built)."""
    alignment = table_alignment(table)
    if device is not None and torch.device(device).type == "cuda":
        from hisparse_triton.kernels.gather import validate_pool

        validate_pool(table.pool, torch.device(device))
    return alignment


def flat_table(table: RowTable) -> tuple[Tensor, list[int], int, int, int, int]:
    """``table`` as custom-op arguments: ``(pool, offsets, row_bytes, block_size,
    block_stride, num_rows)``."""
    return (table.pool, list(table.offsets), table.row_bytes, table.block_size,
            table.block_stride, table.num_rows)


def _copy_launcher(pages: bool, dst: RowTable, src: RowTable):
    """The typed Triton launcher of this direction: device -> host (into a CPU pool from a
    device pool) is ``backup``/``spill``, anything else ``gather``/``restore``."""
    backup, gather = _kernel_modules()
    if dst.pool.is_cpu and not src.pool.is_cpu:
        return backup.spill_pages if pages else backup.backup_rows
    return gather.restore_pages if pages else gather.gather_rows


_KERNELS: list = []


def _kernel_modules():
    """``(kernels.backup, kernels.gather)``, imported on first use (Triton is imported lazily:
    the torch backend never needs it)."""
    if not _KERNELS:
        from hisparse_triton.kernels import backup, gather

        _KERNELS.extend((backup, gather))
    return _KERNELS


def _definition(name: str, pages: bool) -> registry.OpDefinition:
    """The custom op ``name`` over flattened tables (CPU: reference, CUDA: Triton)."""
    reference_fn = reference.copy_pages if pages else reference.copy_rows

    def cpu(dst_pool: Tensor, dst_layer_offsets: list[int], dst_row_bytes: int,
            dst_block_size: int, dst_block_stride: int, dst_num_rows: int,
            src_pool: Tensor, src_layer_offsets: list[int], src_row_bytes: int,
            src_block_size: int, src_block_stride: int, src_num_rows: int,
            src_ids: Tensor, dst_ids: Tensor, counts: Optional[Tensor]) -> None:
        dst = RowTable(dst_pool, dst_layer_offsets, dst_row_bytes, dst_block_size,
                       dst_block_stride, dst_num_rows, device=src_ids.device)
        src = RowTable(src_pool, src_layer_offsets, src_row_bytes, src_block_size,
                       src_block_stride, src_num_rows, device=src_ids.device)
        reference_fn(dst, src, src_ids, dst_ids, counts)

    def cuda(dst_pool, dst_layer_offsets, dst_row_bytes, dst_block_size, dst_block_stride,
             dst_num_rows, src_pool, src_layer_offsets, src_row_bytes, src_block_size,
             src_block_stride, src_num_rows, src_ids, dst_ids, counts):
        dst = RowTable(dst_pool, dst_layer_offsets, dst_row_bytes, dst_block_size,
                       dst_block_stride, dst_num_rows, device=src_ids.device)
        src = RowTable(src_pool, src_layer_offsets, src_row_bytes, src_block_size,
                       src_block_stride, src_num_rows, device=src_ids.device)
        _copy_launcher(pages, dst, src)(dst, src, src_ids, dst_ids, counts)

    def fake(*args) -> None:
        return None

    return registry.OpDefinition(name, reference=cpu, triton=cuda, fake=fake,
                                 mutates_args=("dst_pool",))


#: The family's op definitions (``registry.register_family`` registers them).
DEFINITIONS = (_definition("copy_rows", pages=False), _definition("copy_pages", pages=True))
_OPS = registry.register_family(FAMILY, DEFINITIONS)
copy_rows_op = _OPS["copy_rows"]
copy_pages_op = _OPS["copy_pages"]


def _copy(op, pages: bool, dst: RowTable, src: RowTable, src_ids: Tensor, dst_ids: Tensor,
          counts: Optional[Tensor], backend: Optional[str]) -> None:
    choice = choose_backend(backend, src_ids.is_cuda, src_ids.device)
    tensors = (dst.pool, src.pool, src_ids, dst_ids, counts)
    if choice == "torch" and (is_eager(tensors) or not all_on_cpu(tensors)):
        (reference.copy_pages if pages else reference.copy_rows)(dst, src, src_ids, dst_ids,
                                                                 counts)
    elif choice == "triton" and (is_eager(tensors) or not src_ids.is_cuda):
        _copy_launcher(pages, dst, src)(dst, src, src_ids, dst_ids, counts)
    else:  # traced: the registered op (CPU: reference, CUDA: Triton)
        op(*flat_table(dst), *flat_table(src), src_ids, dst_ids, counts)


def copy_rows(dst: RowTable, src: RowTable, src_rows: Tensor, dst_rows: Tensor,
              counts: Optional[Tensor] = None, *, backend: Optional[str] = None) -> None:
    """Copy rows of every layer from ``src`` to ``dst`` (gather H2D, write-through D2H).

    ``src_rows``/``dst_rows``: ``[R, K]`` or ``[L, R, K] int32``; ``counts``: ``[R] int32`` or
    None (all columns). A source row out of range copies zeros, a destination row out of
    range is skipped (``reference.copy_rows``). One launch for all layers on Triton.
    """
    _copy(copy_rows_op, False, dst, src, src_rows, dst_rows, counts, backend)


def copy_pages(dst: RowTable, src: RowTable, src_blocks: Tensor, dst_blocks: Tensor,
               counts: Optional[Tensor] = None, *, backend: Optional[str] = None) -> None:
    """Copy whole blocks of every layer (restore H2D, spill D2H): ``reference.copy_pages``.

    ``src_blocks``/``dst_blocks``: ``[R, K]`` or ``[L, R, K] int32`` block ids; ``counts``:
    ``[R] int32`` or None.
    """
    _copy(copy_pages_op, True, dst, src, src_blocks, dst_blocks, counts, backend)
