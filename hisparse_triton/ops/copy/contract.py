"""The ``copy_rows`` / ``copy_pages`` contract: their argument rules and table alignment.

Shared by the torch reference and the Triton launchers (``hisparse_triton.kernels.gather``),
so that both refuse exactly the same plans with the same messages. Reads shapes, dtypes and
devices only, never a tensor's values.
"""

from __future__ import annotations

from typing import Optional

import torch

from hisparse_triton.row_table import RowTable

__all__ = ["check_copy_args", "table_alignment"]


def check_copy_args(dst: RowTable, src: RowTable, src_ids: torch.Tensor, dst_ids: torch.Tensor,
                    counts: Optional[torch.Tensor], *, pages: bool) -> None:
    """The argument rules of ``copy_rows`` / ``copy_pages`` (shared with the Triton launchers).

    Raises ``ValueError`` naming the bad value. Reads shapes, dtypes and devices only (never a
    tensor's values), so it costs no device sync.
    """
    # Fast accept (every decode call comes here); anything else is explained below.
    try:
        s_shape, d_shape = src_ids.shape, dst_ids.shape
        layers = len(dst.offsets)
        device = src_ids.device
        if (src_ids.dtype is torch.int32 and dst_ids.dtype is torch.int32
                and len(src.offsets) == layers and dst.row_bytes == src.row_bytes
                and (not pages or dst.block_size == src.block_size)
                and (len(s_shape) == 2 or len(s_shape) == 3 and s_shape[0] == layers)
                and (len(d_shape) == 2 or len(d_shape) == 3 and d_shape[0] == layers)
                and s_shape[-2:] == d_shape[-2:] and dst_ids.device == device
                and (counts is None or counts.dtype is torch.int32
                     and counts.shape == (s_shape[-2],) and counts.device == device)):
            return
    except (AttributeError, TypeError, IndexError):
        pass
    fn = "copy_pages" if pages else "copy_rows"
    names = ("src_blocks", "dst_blocks") if pages else ("src_rows", "dst_rows")
    layers = len(dst.offsets)
    if layers != len(src.offsets):
        raise ValueError(f"{fn}: dst has {dst.num_layers} layers but src has {src.num_layers}.")
    if dst.row_bytes != src.row_bytes:
        raise ValueError(f"{fn}: dst.row_bytes={dst.row_bytes} != src.row_bytes={src.row_bytes}.")
    if pages and dst.block_size != src.block_size:
        raise ValueError(f"{fn}: dst.block_size={dst.block_size} != "
                         f"src.block_size={src.block_size}.")
    shapes = []
    for name, ids in zip(names, (src_ids, dst_ids)):
        shape = ids.shape if isinstance(ids, torch.Tensor) else ()
        if ids.dtype is not torch.int32 if shape else True:
            raise ValueError(f"{fn}: {name} must be an int32 tensor [R, K] or [L, R, K], got "
                             f"{getattr(ids, 'dtype', type(ids).__name__)} with shape "
                             f"{tuple(getattr(ids, 'shape', ()))}.")
        if len(shape) == 3:
            if shape[0] != layers:
                raise ValueError(f"{fn}: {name} has a layer dim of {shape[0]} but the tables "
                                 f"have {layers} layers.")
        elif len(shape) != 2:
            raise ValueError(f"{fn}: {name} must be an int32 tensor [R, K] or [L, R, K], got "
                             f"{ids.dtype} with shape {tuple(shape)}.")
        shapes.append(shape)
    if shapes[0][-2:] != shapes[1][-2:]:
        raise ValueError(f"{fn}: {names[0]} {tuple(shapes[0])} and {names[1]} "
                         f"{tuple(shapes[1])} do not have the same [R, K].")
    device = src_ids.device
    if dst_ids.device != device:
        raise ValueError(f"{fn}: {names[0]} is on {device} but {names[1]} is on "
                         f"{dst_ids.device}.")
    if counts is not None:
        rows = shapes[0][-2]
        if not isinstance(counts, torch.Tensor) or counts.dtype is not torch.int32 \
                or counts.shape != (rows,):
            raise ValueError(f"{fn}: counts must be an int32 tensor [{rows}], got "
                             f"{getattr(counts, 'dtype', type(counts).__name__)} with shape "
                             f"{tuple(getattr(counts, 'shape', ()))}.")
        if counts.device != device:
            raise ValueError(f"{fn}: counts is on {counts.device} but {names[0]} is on "
                             f"{device}.")


def table_alignment(table: RowTable) -> int:
    """The largest power of two (<= 16) dividing every layer offset of ``table``.

    A ``RowTable`` checks its layers against its pool by value when it is built and keeps its
    own copy of the offsets, so nothing here reads a tensor; raises ``ValueError`` if the pool
    was resized in place since.
    """
    table.check_pool()
    return table.alignment
