"""Prefill staging on the device: ``plan_prefill`` as four Triton launches, no host sync.

``plan_prefill`` has the signature, return type and semantics of
``hisparse_triton.ops.prefill.reference.plan_prefill`` (read that docstring for the rules);
this module only says how the device computes it. The bytes then move with the copy
family's gather (``copy_rows`` over the plan: one launch for every layer of the index group).

The chunk's distinct host-only rows are found with one table entry per host-pool row
(``PrefillWorkspace.row_rank``), not by sorting the chunk's ``T * K`` selections:

1. ``_prefill_columns_kernel``, grid ``(T, cdiv(K, BLOCK_K))``: classify every column
   (masked / resident / host row ``g``); write masked (-1) and resident rows to the output
   and host columns as ``-(g + 2)`` (a placeholder); mark ``row_rank[g] = ROW_MARK``. Many
   programs may mark one row: they all store the same value.
2. ``_prefill_count_kernel``, grid ``(cdiv(H, RANK_TILE),)`` over the ``H`` host rows:
   marked rows per tile.
3. ``_prefill_rank_kernel``, same grid: a tile's offset is the sum of the counts of the
   tiles before it; ``tl.cumsum`` ranks the tile's marked rows from there (so ranks follow
   increasing host row, as in the reference); each marked row's entry becomes its rank and
   ranks below the capacity ``C`` write the staging plan (``src_rows[rank] = g``). The last
   tile's program writes ``staged = min(needed, C)`` and ``needed`` and sets the plan's
   tail (``src_rows[staged:]``) to -1.
4. ``_prefill_map_kernel``, grid ``(T, cdiv(K, BLOCK_K))``: each placeholder becomes
   its staging row's device row ``dst_rows[rank]`` (``first_row + rank`` for a region of
   consecutive rows; or -1 when ``rank >= C``).

Every hand-over is a kernel boundary (stream order), so there are no atomics. After a call
no entry of ``row_rank`` holds ``ROW_MARK``; other entries are stale ranks that only a row's
own mark can make current, so the table is never cleared. Work is ``O(T * K + H)`` per
call: the scan reads the whole table (4 bytes per host row), which keeps the per-call cost
independent of how the chunk's selections repeat.

Safety: every access is masked to in-range indices computed in int64 (state rows outside
``[0, S)`` are padding; pages ``< P``; host rows ``< H`` because host blocks are checked
against ``num_host_blocks``; plan entries ``< C``). The launcher validates shapes, dtypes and
devices only and reads no tensor values.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from hisparse_triton.kernels.gather import device_guard
from hisparse_triton.kernels.masks import _lanes
from hisparse_triton.ops.prefill.contract import PrefillPlan, check_prefill_args
from hisparse_triton.ops.prefill.workspace import RANK_TILE, ROW_MARK, PrefillWorkspace

__all__ = ["MAX_BLOCK_K", "plan_prefill"]

#: Most columns of one token one program handles.
MAX_BLOCK_K = 1024
#: Tile sums one step of the rank kernel's offset loop adds.
_SCAN_BLOCK = 1024
#: Warps of the count and rank kernels (a ``RANK_TILE`` tile each: 16 rows per thread). For
#: sm_90 the rank kernel compiles to 80 registers per thread at 8 warps (128 at 4), no spills.
_SCAN_WARPS = 8

_MARK = tl.constexpr(ROW_MARK)


@triton.jit
def _prefill_columns_kernel(
    topk_ptr, state_rows_ptr, seq_lens_ptr, resident_ptr, host_ptr, out_ptr, rank_ptr,
    K, S, P,
    stride_tk_t, stride_tk_k, stride_st, stride_seq,
    stride_res_s, stride_res_p, stride_host_s, stride_host_p,
    stride_out_t, stride_out_k,
    num_device_blocks, num_host_blocks,
    BLOCK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Classify the columns ``BLOCK_K * program_id(1) ...`` of token ``program_id(0)``."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    cm = c < K
    c64 = c.to(tl.int64)
    st = tl.load(state_rows_ptr + t * stride_st).to(tl.int64)
    row_ok = (st >= 0) & (st < S)
    stc = tl.where(row_ok, st, 0)
    seq = tl.load(seq_lens_ptr + stc * stride_seq, mask=row_ok, other=0).to(tl.int64)
    pos = tl.load(topk_ptr + t * stride_tk_t + c64 * stride_tk_k, mask=cm,
                  other=-1).to(tl.int64)
    posc = tl.maximum(pos, 0)
    page = posc // BLOCK_SIZE
    off = posc % BLOCK_SIZE
    inr = cm & _lanes(row_ok, c) & (pos >= 0) & (pos < seq) & (page < P)
    rb = tl.load(resident_ptr + stc * stride_res_s + page * stride_res_p, mask=inr,
                 other=0).to(tl.int64)
    res = inr & (rb >= 1) & (rb < num_device_blocks)
    hb = tl.load(host_ptr + stc * stride_host_s + page * stride_host_p, mask=inr & ~res,
                 other=0).to(tl.int64)
    hok = inr & ~res & (hb >= 1) & (hb < num_host_blocks)
    g = tl.where(hok, hb * BLOCK_SIZE + off, 0)
    value = tl.where(res, rb * BLOCK_SIZE + off, tl.where(hok, -g - 2, -1))
    tl.store(out_ptr + t * stride_out_t + c64 * stride_out_k, value.to(tl.int32), mask=cm)
    tl.store(rank_ptr + g, tl.full([BLOCK_K], _MARK, tl.int32), mask=hok)


@triton.jit
def _prefill_count_kernel(rank_ptr, tile_sums_ptr, num_rows, TILE: tl.constexpr):
    """Marked rows of host-row tile ``program_id(0)``."""
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
    v = tl.load(rank_ptr + i, mask=i < num_rows, other=0)
    tl.store(tile_sums_ptr + pid, tl.sum((v == _MARK).to(tl.int32), axis=0))


@triton.jit
def _prefill_rank_kernel(rank_ptr, tile_sums_ptr, src_ptr, counts_ptr, num_rows, num_tiles,
                         capacity, TILE: tl.constexpr, SCAN: tl.constexpr,
                         FILL: tl.constexpr):
    """Rank the marked rows of tile ``program_id(0)``; write their staging plan entries."""
    pid = tl.program_id(0)
    acc = tl.zeros([SCAN], dtype=tl.int32)
    for s0 in range(0, pid, SCAN):
        j = s0 + tl.arange(0, SCAN)
        acc += tl.load(tile_sums_ptr + j, mask=j < pid, other=0)
    offset = tl.sum(acc, axis=0)
    i = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
    v = tl.load(rank_ptr + i, mask=i < num_rows, other=0)
    marked = (i < num_rows) & (v == _MARK)
    flags = marked.to(tl.int32)
    rank = offset + tl.cumsum(flags, axis=0) - 1
    tl.store(rank_ptr + i, rank, mask=marked)
    tl.store(src_ptr + rank, i.to(tl.int32), mask=marked & (rank < capacity))
    if pid == num_tiles - 1:
        needed = offset + tl.sum(flags, axis=0)
        staged = tl.minimum(needed, capacity)
        tl.store(counts_ptr, staged)
        tl.store(counts_ptr + 1, needed)
        for f0 in range(0, capacity, FILL):
            f = f0 + tl.arange(0, FILL)
            tl.store(src_ptr + f, tl.full([FILL], -1, tl.int32),
                     mask=(f >= staged) & (f < capacity))


@triton.jit
def _prefill_map_kernel(out_ptr, rank_ptr, dst_ptr, K, stride_out_t, stride_out_k, capacity,
                        BLOCK_K: tl.constexpr):
    """Turn the host placeholders of token ``program_id(0)``'s columns into the device rows
    of their staging rows (``dst_ptr``: ``[capacity] int32``)."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    cm = c < K
    ptrs = out_ptr + t * stride_out_t + c.to(tl.int64) * stride_out_k
    value = tl.load(ptrs, mask=cm, other=-1)
    host = cm & (value <= -2)
    g = tl.where(host, -(value.to(tl.int64)) - 2, 0)
    rank = tl.load(rank_ptr + g, mask=host, other=0)
    fits = host & (rank >= 0) & (rank < capacity)
    staged_row = tl.load(dst_ptr + rank.to(tl.int64), mask=fits, other=-1)
    tl.store(ptrs, staged_row, mask=host)


def _check_backend(device: torch.device) -> None:
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"plan_prefill (triton): tensors are on {device}; the Triton kernels need CUDA "
            "tensors, or TRITON_INTERPRET=1 set before import to run on CPU")


def _block_k(K: int) -> int:
    return min(MAX_BLOCK_K, 1 << max(4, (K - 1).bit_length()))


def plan_prefill(
    topk: torch.Tensor,
    state_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    resident_blocks: torch.Tensor,
    host_blocks: torch.Tensor,
    *,
    block_size: int,
    num_device_blocks: int,
    num_host_blocks: int,
    staging_first_row: int,
    staging_rows: int,
    out: Optional[torch.Tensor] = None,
    workspace: Optional[PrefillWorkspace] = None,
) -> PrefillPlan:
    """Triton implementation of ``reference.plan_prefill`` (same contract): four launches
    (see the module docstring), no host synchronisation. Without ``workspace`` a one-off one
    is allocated (``4 * num_host_blocks * block_size`` bytes of scratch)."""
    T, K, S, P = check_prefill_args(
        topk, state_rows, seq_lens, resident_blocks, host_blocks, block_size,
        num_device_blocks, num_host_blocks, staging_first_row, staging_rows, out, workspace)
    if not topk.is_cuda:
        _check_backend(topk.device)
    num_rows = num_host_blocks * block_size
    ws = PrefillWorkspace.for_call(workspace, topk.device, num_host_rows=num_rows,
                                   capacity_rows=staging_rows, first_row=staging_first_row)
    rows = out if out is not None else ws.rows(T, K)
    block_k = _block_k(K)
    token_grid = (T, -(-K // block_k))
    tiles = ws.tile_sums.numel()
    with device_guard(topk):
        try:
            if T:
                _prefill_columns_kernel[token_grid](
                    topk, state_rows, seq_lens, resident_blocks, host_blocks, rows,
                    ws.row_rank, K, S, P, *topk.stride(), state_rows.stride(0),
                    seq_lens.stride(0), *resident_blocks.stride(), *host_blocks.stride(),
                    *rows.stride(), num_device_blocks, num_host_blocks,
                    BLOCK_SIZE=block_size, BLOCK_K=block_k, num_warps=4)
            _prefill_count_kernel[(tiles,)](ws.row_rank, ws.tile_sums, num_rows,
                                            TILE=RANK_TILE, num_warps=_SCAN_WARPS)
            _prefill_rank_kernel[(tiles,)](ws.row_rank, ws.tile_sums, ws.src_rows,
                                           ws.counts, num_rows, tiles, staging_rows,
                                           TILE=RANK_TILE, SCAN=_SCAN_BLOCK, FILL=RANK_TILE,
                                           num_warps=_SCAN_WARPS)
            if T:
                _prefill_map_kernel[token_grid](rows, ws.row_rank, ws.dst_rows, K,
                                                *rows.stride(), staging_rows,
                                                BLOCK_K=block_k, num_warps=4)
        except BaseException:
            ws.clear_marks()
            raise
    return PrefillPlan(rows, ws.src_rows, ws.dst_rows, ws.staged, ws.needed)
