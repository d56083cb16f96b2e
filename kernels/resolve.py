"""Residency resolution on the device: ``resolve`` as ONE Triton launch, one program per row.

``resolve`` has the signature, return type and semantics of ``hisparse_triton.reference.resolve``
(read that docstring for the rules, the corrupted-state rules and the optional ``counters``,
``out`` and ``workspace`` arguments); this module only says how the device computes it.

Shape of the computation: grid ``(R,)``; the program of batch row ``r`` resolves it from start
to finish (as vLLM and SGLang do: one CTA per request), in phases separated by CTA barriers
(``tl.debug_barrier()`` = ``bar.sync``), with per-row scratch tables in global memory (the
workspace) where one phase hands data to the next. So a resolve is one launch whatever the
top-k width or hot-buffer size, and counters are added by the same launch (three integer
``atomic_add`` per row): resolve + gather + counters is two launches per index group.

How hits are found: sort + binary search, no per-request map.
    Every column that goes to the host path gets the key ``g * W + column`` (``W`` = top-k
    rounded up to a power of two; other columns get ``SENTINEL + column``, so they sort last).
    Sorting a row's keys puts equal host rows ``g`` in runs ordered by column: the first key
    of a run is the first occurrence. Every hot slot binary-searches its held host row among
    the sorted keys (``log2 W`` probes: 11 for top-k 2048). Keys are int32 when
    ``(num_host_blocks * block_size + 1) * W <= 2**31`` (exact: a host key is below
    ``2**31 - W``, the sentinel base) and int64 otherwise, which production host pools need
    (keying by the token position would fit 29 bits, but a slot holds a host row, and a
    position's host row can change under it, so that key would not be exact).
    Up to ``SORT`` keys (``MAX_SORT_WIDTH`` = 2048) are sorted in registers and searched
    there with ``tl.gather`` (``GATHER_SEARCH``); wider rows sort ``SORT``-key tiles in
    registers and merge them in the row's scratch (``log2(W / SORT)`` passes, each key placed
    by a binary search of the partner run), then search the scratch. LRU positions are
    processed ``BLOCK_H`` (up to ``MAX_BLOCK_H`` = 4096) at a time, so neither width spills
    registers or needs more shared memory than one tile. 16 warps for tiles of 2048 and
    more: the compile report measured ~110-130 registers per thread there, against ~200-220
    with 8 warps (one CTA per SM either way; the grid is one program per request).

Phases of one program (state row ``st``; ``p`` = LRU position, ``slot = lru[st, p]``):
0. Repeated state row: a row whose state row an earlier batch row names is padding (scans
   ``state_rows[:r]``); padding rows write -1 / zeros and touch no state.
1. Columns: classify (masked / resident / host row ``g``), write the outputs of masked and
   resident columns, build and sort the keys (merge passes for wide rows); reset run winners.
2. Snapshot the row's ``lru`` and ``slot_host_rows`` into the workspace (what the later
   phases read, and what ``restore_resolve_state`` writes back), reset slot owners;
   ``atomic_min(owner[slot], p)``: the first LRU position naming a slot makes it valid.
3. Per position: valid?, held row, binary search; a found run gets ``atomic_min(run_pos[run],
   p)`` (earliest serving position); class 0 (valid) / 2 (invalid) stored.
4. Walk the sorted keys: a run with a winner is a hit (its columns get the slot's device row,
   its winner's class becomes 1 = serving); the first column of every missed run is flagged in
   column order; ``tl.cumsum`` numbers the misses in column order; a second walk writes
   ``miss_src`` and each miss column's number.
5. Per position (one running ``tl.cumsum`` packs the evictable and serving ranks; invalid
   ranks follow): its new LRU position, written with one scatter; the ``m``-th evictable
   slot takes miss ``m`` (``miss_dst``, ``slot_host_rows``).
6. Miss columns read their slot's device row; plan tails -1; stats, ``miss_count``, counters.

Ordering on a GPU: every hand-over between threads of the program through global memory is
separated by ``bar.sync``, which orders the global accesses of all threads of the CTA before
those after it (CUDA's ``__syncthreads`` guarantee; writer and reader share an SM). Tables
written by atomics (slot owners, run winners) are read with ``.cg`` loads (from L2, where
atomics resolve). Triton emits loads as side-effecting inline PTX, so nothing is hoisted
across a barrier. The two ``atomic_min`` see one writer per address in a valid state; they only
make corrupted states (a slot named twice, two slots holding one row) deterministic.

Safety: every access is masked to in-range indices computed in int64 (state rows outside
``[0, S)`` -> padding; pages ``< P``; slots ``< H``; new LRU positions are a bijection onto
``[0, H)`` and masked anyway). The launcher validates shapes, dtypes and devices only; it
never reads tensor values, so it is CUDA-graph capturable (with a workspace, a repeated call
allocates nothing).
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from hisparse_triton.ops.resolve.contract import (
    ResolveResult,
    check_resolve_args as _check_resolve_args,
)
from hisparse_triton.kernels.gather import _device_guard
from hisparse_triton.ops.resolve.workspace import (
    ResolveWorkspace,
    restore_resolve_state,
    scratch_width,
)
from hisparse_triton.kernels.resolve_sorted import (  # noqa: F401 (jit helpers others reuse)
    _lower_bound,
    _resolve_kernel,
    _sorted_tile,
)
from hisparse_triton.tuning import MAX_RESOLVE_WIDTH  # (torch-free home; see there)

__all__ = ["BoundResolve", "GATHER_SEARCH", "MAX_BLOCK_H", "MAX_RESOLVE_WIDTH", "MAX_SORT_WIDTH",
           "ResolveWorkspace", "resolve", "restore_resolve_state"]

#: Most keys sorted in registers by one program; wider rows are merged in scratch.
MAX_SORT_WIDTH = 2048
#: Most LRU positions one program handles per step.
MAX_BLOCK_H = 4096
#: Search the sorted keys in registers with ``tl.gather`` (when one tile holds them all)
#: instead of in the row's key scratch.
GATHER_SEARCH = True



# --------------------------------------------------------------------------------- launcher


class _Launch(NamedTuple):
    """Constexprs and options of one resolve launch (a function of the shapes only)."""

    block_k: int
    sort: int
    block_h: int
    key64: bool
    in_regs: bool
    num_warps: int
    constexprs: dict  # the launch's keyword arguments


_LAUNCHES: dict[tuple, _Launch] = {}


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _launch(K: int, H: int, block_size: int, num_host_blocks: int, has_counters: bool,
            sort_width: Optional[int] = None, block_h: Optional[int] = None,
            num_warps: Optional[int] = None, gather_search: Optional[bool] = None,
            block_r: int = 256) -> _Launch:
    """The launch of a call shape (memoised: the decode loop repeats a few shapes)."""
    key = (K, H, block_size, num_host_blocks, has_counters, sort_width, block_h, num_warps,
           gather_search, block_r)
    launch = _LAUNCHES.get(key)
    if launch is not None:
        return launch
    for name, value in (("sort_width", sort_width), ("block_h", block_h), ("block_r", block_r)):
        if value is not None and (value < 16 or value & (value - 1)):
            raise ValueError(f"resolve: {name} must be a power of two >= 16, got {value}")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"resolve: num_warps must be a power of two <= 32, got {num_warps}")
    block_k = scratch_width(K)
    sort = min(block_k, sort_width or MAX_SORT_WIDTH)
    bh = min(_pow2(max(H, 16)), block_h or MAX_BLOCK_H)
    key64 = (num_host_blocks * block_size + 1) * block_k > 2**31
    tile = max(sort, bh)
    warps = num_warps or (16 if tile >= 2048 else 8 if tile >= 1024 else 4)
    in_regs = (GATHER_SEARCH if gather_search is None else bool(gather_search)) \
        and sort == block_k
    constexprs = dict(BLOCK_SIZE=block_size, BLOCK_K=block_k, LOG2_K=block_k.bit_length() - 1,
                      SORT=sort, LOG2_SORT=sort.bit_length() - 1, BLOCK_H=bh, BLOCK_R=block_r,
                      KEY64=key64, HAS_COUNTERS=has_counters, IN_REGS=in_regs,
                      num_warps=warps)
    launch = _Launch(block_k, sort, bh, key64, in_regs, warps, constexprs)
    _LAUNCHES[key] = launch
    return launch


class BoundResolve:
    """A resolve whose state tensors never change (a runtime's tables, hot state, counters
    and workspace): what depends only on them and on a call's shape (argument checks, launch
    shape, strides, buffers) is done once per shape and kept, so a call on the decode path
    does a dictionary lookup and the launch.

    ``bound(topk, state_rows, out)`` has the semantics of ``resolve(topk, state_rows,
    seq_lens, ..., counters=counters, out=out, workspace=workspace)``; a call of a new shape
    (or dtype, strides, device, ``out``) runs the full checks first. The state tensors must
    keep their storage and shape (views of a runtime's persistent tables do).
    """

    def __init__(self, seq_lens: torch.Tensor, resident_blocks: torch.Tensor,
                 host_blocks: torch.Tensor, hot_blocks: torch.Tensor,
                 slot_host_rows: torch.Tensor, lru: torch.Tensor, *, block_size: int,
                 num_device_blocks: int, num_host_blocks: int, counters: torch.Tensor,
                 workspace: ResolveWorkspace) -> None:
        self._state = (seq_lens, resident_blocks, host_blocks, hot_blocks, slot_host_rows,
                       lru)
        self._sizes = (block_size, num_device_blocks, num_host_blocks)
        self._counters, self._workspace = counters, workspace
        self._calls: dict[tuple, tuple] = {}

    def _prepare(self, topk: torch.Tensor, state_rows: torch.Tensor,
                 out: torch.Tensor) -> tuple:
        seq_lens, resident, host, hot, slot_rows, lru = self._state
        block_size, num_device_blocks, num_host_blocks = self._sizes
        counters, workspace = self._counters, self._workspace
        R, K, S, P, _, H = _check_resolve_args(
            topk, state_rows, seq_lens, resident, host, hot, slot_rows, lru, block_size,
            num_device_blocks, num_host_blocks, counters, out, workspace)
        if not topk.is_cuda:
            _check_backend(topk.device)
        launch = _launch(K, H, block_size, num_host_blocks, True)
        bufs = workspace.buffers(R, K, H)
        result = ResolveResult(out, *bufs[1:5])
        head = (seq_lens, resident, host, hot, slot_rows, lru, out, *bufs[1:], counters,
                K, S, P, H)
        tail = (state_rows.stride(0), seq_lens.stride(0), *resident.stride(), *host.stride(),
                *hot.stride(), *slot_rows.stride(), *lru.stride(), *out.stride(),
                counters.stride(0), num_device_blocks, num_host_blocks)
        return (R,), head, topk.stride(), tail, launch.constexprs, bufs, result

    def __call__(self, topk: torch.Tensor, state_rows: torch.Tensor,
                 out: torch.Tensor) -> ResolveResult:
        key = (topk.shape, topk.dtype, topk.device, topk.stride(), state_rows.shape,
               state_rows.dtype, state_rows.device, state_rows.stride(), id(out))
        call = self._calls.get(key)
        if call is None or call[-1].rows is not out:
            call = self._calls[key] = self._prepare(topk, state_rows, out)
        grid, head, topk_strides, tail, constexprs, bufs, result = call
        self._workspace.last = bufs
        if grid[0]:
            with _device_guard(topk):
                _resolve_kernel[grid](topk, state_rows, *head, *topk_strides, *tail,
                                      **constexprs)
        return result


def _check_backend(device: torch.device) -> None:
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"resolve (triton): tensors are on {device}; the Triton kernels need CUDA tensors, "
            "or TRITON_INTERPRET=1 set before import to run on CPU")


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
    counters: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    workspace: Optional[ResolveWorkspace] = None,
) -> ResolveResult:
    """Triton implementation of ``hisparse_triton.reference.resolve`` (same contract).

    ``topk [R, K]`` (any integer dtype, any strides), ``state_rows [R]``, ``seq_lens [S]``,
    ``resident_blocks / host_blocks [S, P]``, ``hot_blocks [S, HB]``, ``slot_host_rows / lru
    [S, H]`` (int32) on one CUDA device (or CPU under ``TRITON_INTERPRET=1``);
    ``slot_host_rows`` and ``lru`` are updated in place. ``counters [3] int64``, ``out [R, K]
    int32``, ``workspace``: see the reference. One launch, no host synchronisation.
    """
    return _resolve(topk, state_rows, seq_lens, resident_blocks, host_blocks, hot_blocks,
                    slot_host_rows, lru, block_size=block_size,
                    num_device_blocks=num_device_blocks, num_host_blocks=num_host_blocks,
                    counters=counters, out=out, workspace=workspace)


def _resolve(
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
    counters: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    workspace: Optional[ResolveWorkspace] = None,
    sort_width: Optional[int] = None,
    block_h: Optional[int] = None,
    num_warps: Optional[int] = None,
    gather_search: Optional[bool] = None,
    block_r: int = 256,
) -> ResolveResult:
    """``resolve`` with launch knobs (tests use small ones to exercise the merge passes and
    several LRU steps per row; a GPU sweep can tune them): ``sort_width`` keys sorted in
    registers (a power of two, default ``MAX_SORT_WIDTH``), ``block_h`` LRU positions per
    step (a power of two, default ``min(next_pow2(H), MAX_BLOCK_H)``), ``num_warps`` (default
    16 for tiles of 2048 and more, 8 for 1024, else 4), ``gather_search`` (default
    ``GATHER_SEARCH``), ``block_r`` earlier rows scanned per step for repeated state rows."""
    R, K, S, P, _, H = _check_resolve_args(
        topk, state_rows, seq_lens, resident_blocks, host_blocks, hot_blocks, slot_host_rows,
        lru, block_size, num_device_blocks, num_host_blocks, counters, out, workspace)
    if not topk.is_cuda:
        _check_backend(topk.device)
    has_counters = counters is not None
    launch = _launch(K, H, block_size, num_host_blocks, has_counters, sort_width, block_h,
                     num_warps, gather_search, block_r)
    if workspace is not None:
        bufs = workspace.buffers(R, K, H)
        workspace.last = bufs
    else:
        bufs = ResolveWorkspace.allocate(R, K, H, topk.device)
    rows = out if out is not None else bufs.rows
    result = ResolveResult(rows, *bufs[1:5])
    if R == 0:
        return result
    with _device_guard(topk):
        _resolve_kernel[(R,)](
            topk, state_rows, seq_lens, resident_blocks, host_blocks, hot_blocks,
            slot_host_rows, lru, rows, *bufs[1:], counters if has_counters else bufs.stats,
            K, S, P, H,
            *topk.stride(), state_rows.stride(0), seq_lens.stride(0),
            *resident_blocks.stride(), *host_blocks.stride(), *hot_blocks.stride(),
            *slot_host_rows.stride(), *lru.stride(), *rows.stride(),
            counters.stride(0) if has_counters else 0,
            num_device_blocks, num_host_blocks, **launch.constexprs)
    return result
