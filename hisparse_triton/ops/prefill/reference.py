"""Pure-torch ``plan_prefill``: the bit-exact definition the Triton kernels must match.

``plan_prefill`` is the specification of ``hisparse_triton.kernels.prefill`` (which must match
it bit for bit: rows, staging plan and counts) and the op's torch backend; it works on any
device. Argument rules and the result type: ``contract``. The bytes move with the copy
family's ``copy_rows`` over the plan (``op.stage_prefill`` does both).
"""

from __future__ import annotations

from typing import Optional

import torch

from hisparse_triton.ops.prefill.contract import PrefillPlan, check_prefill_args
from hisparse_triton.ops.prefill.workspace import PrefillWorkspace
from hisparse_triton.ops.resolve.reference import classify_columns

__all__ = ["emit_plan", "plan_prefill"]


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
    """Map a prefill chunk's top-k positions to device rows, staging host-only rows.

    Shapes (``T`` query tokens, ``K`` selections per token, ``S`` state rows, ``P`` pages
    per request, ``C = staging_rows``):
    - ``topk``: ``[T, K]`` token positions, any integer dtype and strides; any value
      (negative, ``>= seq_len``, beyond int32: masked).
    - ``state_rows``: ``[T] int32`` the state row of each token's request (many tokens
      share one); outside ``[0, S)`` (e.g. -1) = padding: the token's row is all -1.
    - ``seq_lens [S]``, ``resident_blocks [S, P]`` (the index group's resident group; 0 =
      no device copy), ``host_blocks [S, P]`` (0 = null): int32 request tables.
    - ``staging_first_row``, ``staging_rows``: the staging region, device rows
      ``[staging_first_row, staging_first_row + C)``.

    Per column (``B = block_size``, ``st = state_rows[t]``):
    1. padding token, ``pos < 0``, ``pos >= seq_lens[st]`` or ``pos // B >= P`` -> -1;
    2. ``resident_blocks[st, pos // B]`` in ``[1, num_device_blocks)`` -> the row in place,
       ``block * B + pos % B`` (a resident, pinned or unpinned page whose block still holds
       it);
    3. else ``g = host_blocks[st, pos // B] * B + pos % B`` when that block is in
       ``[1, num_host_blocks)`` (else -1): a host-only row. The chunk's distinct host-only
       rows (over all its tokens and requests: a host row shared by two requests is staged
       once) are ranked in increasing ``g``; rank ``r < C`` -> staging row ``r``, device
       row ``dst_rows[0, r]`` (``staging_first_row + r``, or the workspace's map:
       ``PrefillWorkspace.map_staging``); ``r >= C`` -> -1 (the chunk overflows the
       region).
    Outputs: ``PrefillPlan`` (``needed`` = distinct host-only rows; ``staged = min(needed,
    C)``; ``src_rows[0, r]`` = the host row of rank ``r < staged``, -1 after;
    ``dst_rows[0, i]`` the device row of staging row ``i``). With ``out`` the rows are
    written there;
    with ``workspace`` every output lives in it (valid until its next call). No state is
    read or written besides the outputs: hot buffers and LRU are not involved. This torch
    version synchronises with the device (``torch.unique``); the kernels never do.
    """
    T, K, S, P = check_prefill_args(
        topk, state_rows, seq_lens, resident_blocks, host_blocks, block_size,
        num_device_blocks, num_host_blocks, staging_first_row, staging_rows, out, workspace)
    dev = topk.device
    i64, i32 = torch.int64, torch.int32
    B, C = block_size, staging_rows

    st = state_rows.to(i64)
    row_ok = (st >= 0) & (st < S)
    stc = torch.where(row_ok, st, 0)
    res, hok, device_row, g = classify_columns(
        topk, stc, row_ok, seq_lens, resident_blocks, host_blocks, block_size=B,
        num_device_blocks=num_device_blocks, num_host_blocks=num_host_blocks)

    distinct = torch.unique(g[hok])            # sorted ascending
    needed = distinct.numel()
    rank = torch.searchsorted(distinct, torch.where(hok, g, 0).contiguous())
    fits = hok & (rank < C)
    if workspace is not None:                  # staging row i is device row dst_rows[i]
        dst = workspace.dst_rows[0].to(i64)
    else:
        dst = torch.arange(staging_first_row, staging_first_row + C, dtype=i64, device=dev)
    staged_row = dst[torch.where(fits, rank, 0)] if C else torch.full_like(rank, -1)
    rows = torch.where(res, device_row, torch.where(fits, staged_row, -1)).to(i32)
    staged = min(needed, C)
    src_rows = torch.full((1, C), -1, dtype=i32, device=dev)
    src_rows[0, :staged] = distinct[:staged].to(i32)

    counts = torch.tensor([staged, needed], dtype=i32, device=dev)
    return emit_plan(rows, src_rows, counts, staging_first_row, out, workspace)


def emit_plan(rows: torch.Tensor, src_rows: torch.Tensor, counts: torch.Tensor,
              staging_first_row: int, out: Optional[torch.Tensor],
              workspace: Optional[PrefillWorkspace]) -> PrefillPlan:
    """A computed plan (``rows [T, K]``, ``src_rows [1, C]``, ``counts [2] = (staged,
    needed)`` int32) put where the caller asked for it: ``out`` receives the rows, a
    ``workspace`` holds every output; else fresh tensors."""
    T, K = rows.shape
    C = src_rows.shape[1]
    if workspace is None:
        dst_rows = torch.arange(staging_first_row, staging_first_row + C, dtype=torch.int32,
                                device=rows.device).view(1, C)
        if out is not None:
            out.copy_(rows)
            rows = out
        return PrefillPlan(rows, src_rows, dst_rows, counts[0:1], counts[1:2])
    target = out if out is not None else workspace.rows(T, K)
    target.copy_(rows)
    workspace.src_rows.copy_(src_rows)
    workspace.counts.copy_(counts)
    return PrefillPlan(target, workspace.src_rows, workspace.dst_rows, workspace.staged,
                       workspace.needed)
