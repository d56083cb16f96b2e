"""Pure-torch oracle of every kernel: the bit-exact semantics (DESIGN.md section 7).

This module is the specification the Triton kernels in ``hisparse_triton.kernels`` must match
byte for byte, and the runtime's CPU backend. It works on any device.

Conventions shared by all functions:
- ids (positions, rows, blocks, slots) are int32; address arithmetic is int64;
- block 0 of every pool is the null block ("no page") in block tables;
- nothing here (or in a kernel) reads or writes outside the pools, whatever the ids say.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from hisparse_triton.row_table import RowTable


class ResolveResult(NamedTuple):
    """What ``resolve`` returns for ``R`` batch rows of ``K`` top-k columns.

    - ``rows``: ``[R, K] int32`` device row ids for the attention kernel; -1 = masked.
    - ``miss_src``: ``[R, K] int32`` host rows to gather; the first ``miss_count[r]`` entries of
      row ``r`` are valid (misses in column order of first occurrence), the rest are -1.
    - ``miss_dst``: ``[R, K] int32`` device rows (hot slots) the misses go to; same layout.
    - ``miss_count``: ``[R] int32`` distinct misses per row.
    - ``stats``: ``[R, 3] int32`` per row ``(hits, misses, masked)``;
      ``hits + misses + masked == K`` for non-padding rows (a duplicate of a miss column is a
      hit: it is served from the slot its first occurrence filled); padding rows count zeros.
    """

    rows: torch.Tensor
    miss_src: torch.Tensor
    miss_dst: torch.Tensor
    miss_count: torch.Tensor
    stats: torch.Tensor


def resolve(
    topk: torch.Tensor,
    state_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    resident_blocks: torch.Tensor,
    host_blocks: torch.Tensor,
    hot_blocks: torch.Tensor,
    slot_host_rows: torch.Tensor,
    lru: torch.Tensor,
    *,
    block_size: int,
    num_device_blocks: int,
    num_host_blocks: int,
) -> ResolveResult:
    """Resolve top-k positions of one index group into device rows; update the hot state.

    Shapes (``R`` batch rows, ``K`` columns, ``S`` state rows, ``P`` pages per request,
    ``HB`` hot blocks per request, ``H`` hot slots per request, ``HB * block_size >= H >= K``):
    - ``topk``: ``[R, K] int32`` token positions (any value: invalid ones output -1).
    - ``state_rows``: ``[R] int32`` state row of each batch row; -1 = padding row. Two batch
      rows must not name the same state row.
    - ``seq_lens``: ``[S] int32`` tokens of each request.
    - ``resident_blocks``: ``[S, P] int32`` device block of each page in this index group's
      resident group; 0 = not resident.
    - ``host_blocks``: ``[S, P] int32`` host block of each page; 0 = null (masked).
    - ``hot_blocks``: ``[S, HB] int32`` device blocks of each request's hot region; slot ``s``
      is device row ``hot_blocks[st, s // block_size] * block_size + s % block_size``.
    - ``slot_host_rows``: ``[S, H] int32`` host row held by each slot, -1 = empty. Updated in
      place.
    - ``lru``: ``[S, H] int32`` permutation of slot ids, least recently used first. Updated
      in place.

    Semantics per column (DESIGN.md section 7); see ``ResolveResult`` for the outputs.
    """
    raise NotImplementedError("filled in by the resolve work")


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
    """
    raise NotImplementedError("filled in by the transfer work")


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
    raise NotImplementedError("filled in by the transfer work")
