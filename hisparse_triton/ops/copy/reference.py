"""Pure-torch ``copy_rows`` / ``copy_pages``: the bit-exact definition of the copy kernels.

The specification the gather / backup launchers in ``hisparse_triton.kernels`` must match
byte for byte over the whole destination pool, and the ops' torch backend; works on any
device (pools and plans may be on different devices). Block 0 of every pool is the null
block; nothing here reads or writes outside the pools, whatever the ids say. Argument rules:
``contract``.
"""

from __future__ import annotations

from typing import Optional

import torch

from hisparse_triton.ops.copy.contract import check_copy_args, table_alignment
from hisparse_triton.row_table import RowTable
from hisparse_triton.tuning import pow2_alignment

__all__ = ["copy_pages", "copy_rows"]


def copy_rows(
    dst: RowTable,
    src: RowTable,
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
    counts: Optional[torch.Tensor] = None,
) -> None:
    """Copy rows of every layer from ``src`` to ``dst`` (host -> device gather, or back).

    - ``src_rows``, ``dst_rows``: ``[R, K] int32`` (one plan shared by all layers) or
      ``[L, R, K] int32`` (a plan per layer; an ``expand``-ed stride-0 layer dim is fine).
    - ``counts``: ``[R] int32``: only columns ``j < counts[r]`` are copied; ``None`` = all.
    For every layer ``l``, row ``r``, column ``j < counts[r]``:
    ``dst[l][dst_rows[r, j]] = src[l][src_rows[r, j]]``, where a source row outside
    ``[0, src.num_rows)`` copies zeros and a destination row outside ``[0, dst.num_rows)`` is
    skipped. ``dst.num_layers == src.num_layers`` and ``dst.row_bytes == src.row_bytes``.
    If one destination row is named twice, which source lands there is unspecified; so is
    the result for a row that one call both reads and writes (same pool for src and dst).
    """
    check_copy_args(dst, src, src_rows, dst_rows, counts, pages=False)
    _copy_spans(dst, src, src_rows, dst_rows, counts, pages=False)


def copy_pages(
    dst: RowTable,
    src: RowTable,
    src_blocks: torch.Tensor,
    dst_blocks: torch.Tensor,
    counts: Optional[torch.Tensor] = None,
) -> None:
    """Copy whole blocks (``block_size`` rows) of every layer (restore H2D, spill D2H).

    Same plan shapes and bounds rules as ``copy_rows``, with block ids in place of row ids
    (valid blocks ``[0, num_blocks)``; an invalid source block copies zeros, an invalid
    destination block is skipped). ``dst.block_size == src.block_size``.
    """
    check_copy_args(dst, src, src_blocks, dst_blocks, counts, pages=True)
    _copy_spans(dst, src, src_blocks, dst_blocks, counts, pages=True)


_WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _span_windows(pool: torch.Tensor, span_bytes: int, word: int) -> torch.Tensor:
    """``[n - span/word + 1, span/word]`` overlapping view of ``pool`` as ``word``-byte words:
    window ``a`` is the span starting at word ``a`` (any aligned byte address, one index)."""
    n = pool.numel() // word
    words = pool[: n * word].view(_WORD_DTYPES[word])
    span_words = span_bytes // word
    return words.as_strided((n - span_words + 1, span_words), (1, 1))


def _span_addresses(table: RowTable, layer: torch.Tensor, ids: torch.Tensor,
                    pages: bool) -> torch.Tensor:
    """Byte address (int64) of row / block ``ids`` of ``layer`` inside ``table.pool``."""
    base = table.device_offsets(ids.device)[layer]
    if pages:
        return base + ids * table.block_stride
    return base + (ids // table.block_size) * table.block_stride \
        + (ids % table.block_size) * table.row_bytes


def _copy_spans(dst: RowTable, src: RowTable, src_ids: torch.Tensor, dst_ids: torch.Tensor,
                counts: Optional[torch.Tensor], *, pages: bool) -> None:
    """``copy_rows`` (``pages=False``) / ``copy_pages`` (``pages=True``) after the checks.

    Vectorised over every (layer, row, column): the kept entries are picked with two masks
    (counted columns, then valid destinations), their byte addresses computed as int64
    tensors, and the bytes moved with one ``index_select`` on an overlapping word view of the
    source pool and one ``index_copy_`` into the same kind of view of the destination pool
    (torch writes element by element there; the destination spans of distinct ids are
    disjoint, and the tests pin this down against a per-row loop).
    """
    num_layers = dst.num_layers
    rows, cols = src_ids.shape[-2:]
    if rows == 0 or cols == 0:
        return
    device = src_ids.device
    span = dst.row_bytes * (dst.block_size if pages else 1)
    src_limit = src.num_blocks if pages else src.num_rows
    dst_limit = dst.num_blocks if pages else dst.num_rows
    word = pow2_alignment(span, src.block_stride, dst.block_stride, table_alignment(src),
                          table_alignment(dst), src.pool.storage_offset(),
                          dst.pool.storage_offset(), cap=8)

    # Counted columns first (a miss plan is mostly padding), then valid destinations per layer.
    if counts is None:
        row = torch.arange(rows, device=device).repeat_interleave(cols)
        col = torch.arange(cols, device=device).repeat(rows)
    else:
        counted = torch.arange(cols, device=device) < counts.unsqueeze(1)
        row, col = counted.nonzero(as_tuple=True)
    s = src_ids[..., row, col].expand(num_layers, row.numel())
    d = dst_ids[..., row, col].expand(num_layers, row.numel())
    layer, entry = ((d >= 0) & (d < dst_limit)).nonzero(as_tuple=True)
    s = s[layer, entry].long()
    d = d[layer, entry].long()
    src_ok = (s >= 0) & (s < src_limit)
    s = torch.where(src_ok, s, 0)

    src_words = (_span_addresses(src, layer, s, pages) // word).to(src.pool.device)
    dst_words = (_span_addresses(dst, layer, d, pages) // word).to(dst.pool.device)
    data = _span_windows(src.pool, span, word).index_select(0, src_words)
    data.masked_fill_(~src_ok.to(data.device).unsqueeze(1), 0)
    _span_windows(dst.pool, span, word).index_copy_(0, dst_words, data.to(dst.pool.device))
