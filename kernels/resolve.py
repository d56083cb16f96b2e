"""Residency resolution on the device: ``resolve`` as five short Triton launches, no host sync.

``resolve`` has exactly the signature, return type and semantics of
``hisparse_triton.reference.resolve`` (read that docstring for the rules, including the
corrupted-state rules); this module only says how the device computes it.

How hits are found: sort + binary search, no per-request map.
    For each batch row the ``K`` columns that go to the host path get the int64 key
    ``g * BLOCK_K + column`` (``BLOCK_K`` = ``K`` padded to a power of two; every other column
    gets ``2**62 + column`` so it sorts last and still names its column). One ``tl.sort`` per
    row leaves equal host rows ``g`` in runs, ordered by column, so the first key of a run is
    the first occurrence. Every hot slot then binary-searches its held host row in its row's
    sorted keys (``log2(BLOCK_K)`` gathers: 11 for ``K = 2048``), which is slot-parallel and
    independent of how many slots exist. The alternatives cost more: a dense
    position -> slot map is ~20 MB per request on DeepSeek-V3.2 and must be kept coherent; a
    hash table needs atomics, probing and deletion; a slot-side sort costs ``H log H`` with
    ``H`` up to 32768 per row, against ``K log K + H log K`` here.

Where atomics are used, and why they do not decide hits: in a valid state every host row is
held by at most one slot and every slot appears once in the LRU, so the two ``atomic_min`` below
each see a single writer per address and act as plain stores. They exist so that a corrupted
state (a slot named twice in ``lru``, two slots holding one host row) still resolves
deterministically: the earliest LRU position wins, exactly as the reference says.

Launches (``R`` batch rows, ``NC = cdiv(H, BLOCK_H)`` LRU chunks):
1. ``_resolve_sort_kernel``, grid ``(R, 1 + NC)``: program 0 of a row classifies its columns
   (masked / resident / host row ``g``), writes the outputs of masked and resident columns,
   sorts the keys into scratch and resets the run table; programs ``1..NC`` reset the
   slot-owner table.
2. ``_resolve_search_kernel``, grid ``(R, NC)``, one lane per LRU position: load the slot id,
   ``atomic_min`` its position into ``owner[slot]`` (first occurrence = valid), load the held
   host row, binary-search it; a found position ``atomic_min``s itself into the run's entry.
3. ``_resolve_classify_kernel``, grid ``(R, NC + 1)``: programs ``< NC`` classify each LRU
   position (serving hit / evictable / invalid), count both per chunk and copy the old LRU;
   program ``NC`` walks the sorted keys of its row: hit runs write their columns' device rows,
   miss runs are numbered in column order (scatter flags to column order, ``tl.cumsum``,
   gather back) and write ``miss_src``.
4. ``_resolve_lru_kernel``, grid ``(R, NC)``: prefix over the chunk counts + ``tl.cumsum``
   inside the chunk give every position its evictable / hit / invalid rank, hence its new LRU
   position; the permutation is rewritten with one scatter. The ``m``-th evictable slot takes
   miss ``m``: it writes ``miss_dst[m]`` and its new ``slot_host_rows`` entry.
5. ``_resolve_finalize_kernel``, grid ``(R,)``: miss columns read their slot's device row from
   ``miss_dst``, the plan tails are set to -1, stats and ``miss_count`` are written.
Every phase but the per-row sort and the two per-row column walks is LRU-chunk parallel, so the
grid grows with ``H`` and not only with the batch.

Ordering on a GPU: no program reads what another program of the same launch writes; every
hand-over between programs crosses a launch boundary. The one hand-over between threads of one
program through global memory (phase 3's column-order numbering in ``colbuf``) is fenced with
``tl.debug_barrier()`` = ``bar.sync``, which orders the global stores of all threads of the CTA
before the loads after it (CUDA's ``__syncthreads`` guarantee; writer and reader share an SM,
so cached or vectorised loads see the stores). Triton emits loads as side-effecting inline
PTX ``ld.global`` (never ``ld.global.nc``), so neither LLVM nor ptxas hoists them across it.
The launcher makes the tensors' device the current CUDA device (Triton launches there).

Costs (reasoned, not yet measured on a GPU) at 64 rows x K 2048 x H 4096: the sort is the only
super-linear step (a bitonic sort of 2048 int64 keys per row, 66 compare-exchange stages, 8
warps); the search does 11 dependent loads per slot from a 16 KB row of keys that stays in
L1/L2; everything else streams ``[R, H]`` int32 scratch and ``[R, K]`` outputs (~10 MB in all,
a few microseconds of HBM). Five launches cost ~1 us each when replayed from a CUDA graph.
``BLOCK_K`` is one tile per program, so top-k much beyond 4096 would spill registers.

Safety: every load and store is masked to in-range indices computed in int64 (``state_rows``
outside ``[0, S)`` -> padding; pages ``< P``; slots ``< H``; new LRU positions are a bijection
onto ``[0, H)`` by construction and masked anyway). The launcher validates shapes, dtypes and
devices only; it never reads tensor values, so it is CUDA-graph capturable (all outputs and
scratch have shapes fixed by the inputs' shapes).
"""

from __future__ import annotations

import math
import os
from contextlib import nullcontext
from typing import Optional

import torch
import triton
import triton.language as tl

from hisparse_triton.reference import ResolveResult, _check_resolve_args

__all__ = ["resolve"]

_SENTINEL = 1 << 62  # key base of columns that do not go to the host path
_I32_MAX = 2**31 - 1
_MAX_BLOCK_H = 1024
# The same constants as seen inside @triton.jit bodies (jit globals must be tl.constexpr).
_SENTINEL_K = tl.constexpr(_SENTINEL)
_I32_MAX_K = tl.constexpr(_I32_MAX)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _slot_device_row(hot_ptr, st64, stride_hot_s, stride_hot_b, slot64, mask, num_device_blocks,
                     BLOCK_SIZE: tl.constexpr):
    """Device row of hot slot ``slot64`` of state row ``st64`` (int64), -1 for a bad hot block."""
    blk = tl.load(hot_ptr + st64 * stride_hot_s + (slot64 // BLOCK_SIZE) * stride_hot_b,
                  mask=mask, other=0).to(tl.int64)
    ok = (blk >= 1) & (blk < num_device_blocks)
    return tl.where(ok, blk * BLOCK_SIZE + slot64 % BLOCK_SIZE, -1)


@triton.jit
def _resolve_sort_kernel(
    topk_ptr, state_rows_ptr, seq_lens_ptr, resident_ptr, host_ptr,
    rows_ptr, keys_ptr, run_pos_ptr, owner_ptr,
    K, S, P, H,
    stride_tk_r, stride_tk_c, stride_sr, stride_seq,
    stride_res_s, stride_res_p, stride_host_s, stride_host_p,
    num_device_blocks, num_host_blocks,
    BLOCK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    r64 = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    if pid == 0:
        st = tl.load(state_rows_ptr + r64 * stride_sr)
        row_ok = (st >= 0) & (st < S)
        st64 = tl.where(row_ok, st, 0).to(tl.int64)
        c = tl.arange(0, BLOCK_K)
        cm = c < K
        pos = tl.load(topk_ptr + r64 * stride_tk_r + c * stride_tk_c, mask=cm, other=-1)
        pos = pos.to(tl.int64)
        seq = tl.load(seq_lens_ptr + st64 * stride_seq, mask=row_ok, other=0).to(tl.int64)
        posc = tl.maximum(pos, 0)
        page = posc // BLOCK_SIZE
        off = posc % BLOCK_SIZE
        inr = cm & row_ok & (pos >= 0) & (pos < seq) & (page < P)
        rb = tl.load(resident_ptr + st64 * stride_res_s + page * stride_res_p, mask=inr,
                     other=0).to(tl.int64)
        res = inr & (rb >= 1) & (rb < num_device_blocks)
        hb = tl.load(host_ptr + st64 * stride_host_s + page * stride_host_p, mask=inr & ~res,
                     other=0).to(tl.int64)
        hok = inr & ~res & (hb >= 1) & (hb < num_host_blocks)
        out = tl.where(res, rb * BLOCK_SIZE + off, -1)
        tl.store(rows_ptr + r64 * K + c, out.to(tl.int32), mask=cm)
        c64 = c.to(tl.int64)
        key = tl.where(hok, (hb * BLOCK_SIZE + off) * BLOCK_K + c64, c64 + _SENTINEL_K)
        if row_ok:  # a padding row's keys (sentinel + column) are already sorted
            key = tl.sort(key)
        tl.store(keys_ptr + r64 * BLOCK_K + c, key)
        tl.store(run_pos_ptr + r64 * BLOCK_K + c, tl.full([BLOCK_K], _I32_MAX_K, tl.int32))
    else:
        p = (pid - 1) * BLOCK_H + tl.arange(0, BLOCK_H)
        tl.store(owner_ptr + r64 * H + p, tl.full([BLOCK_H], _I32_MAX_K, tl.int32), mask=p < H)


@triton.jit
def _resolve_search_kernel(
    state_rows_ptr, slot_rows_ptr, lru_ptr, keys_ptr, run_pos_ptr, owner_ptr, pos_run_ptr,
    S, H,
    stride_sr, stride_shr_s, stride_shr_h, stride_lru_s, stride_lru_h,
    num_host_rows,
    BLOCK_K: tl.constexpr, LOG2_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    r64 = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    st = tl.load(state_rows_ptr + r64 * stride_sr)
    row_ok = (st >= 0) & (st < S)
    st64 = tl.where(row_ok, st, 0).to(tl.int64)
    pm = (p < H) & row_ok
    slot = tl.load(lru_ptr + st64 * stride_lru_s + p.to(tl.int64) * stride_lru_h, mask=pm,
                   other=-1)
    sv = pm & (slot >= 0) & (slot < H)
    slot64 = tl.where(sv, slot, 0).to(tl.int64)
    tl.atomic_min(owner_ptr + r64 * H + slot64, p, mask=sv, sem="relaxed")
    held = tl.load(slot_rows_ptr + st64 * stride_shr_s + slot64 * stride_shr_h, mask=sv,
                   other=-1).to(tl.int64)
    ok = sv & (held >= 0) & (held < num_host_rows)
    target = held * BLOCK_K
    keys = keys_ptr + r64 * BLOCK_K
    lo = tl.zeros([BLOCK_H], dtype=tl.int32)
    for i in tl.static_range(LOG2_K):  # lower bound of target among BLOCK_K sorted keys
        step = (BLOCK_K // 2) >> i
        probe = tl.load(keys + lo + (step - 1), mask=ok, other=0)
        lo = tl.where(probe < target, lo + step, lo)
    hit_key = tl.load(keys + lo, mask=ok, other=-1)
    found = ok & ((hit_key >> LOG2_K) == held)
    tl.atomic_min(run_pos_ptr + r64 * BLOCK_K + lo, p, mask=found, sem="relaxed")
    tl.store(pos_run_ptr + r64 * H + p, tl.where(found, lo, -1), mask=p < H)


@triton.jit
def _resolve_classify_kernel(
    state_rows_ptr, lru_ptr, hot_ptr, keys_ptr, run_pos_ptr, owner_ptr, pos_run_ptr,
    cls_ptr, lru_copy_ptr, counts_ptr, colbuf_ptr, colm_ptr, n_miss_ptr, rows_ptr, miss_src_ptr,
    K, S, H, NC,
    stride_sr, stride_lru_s, stride_lru_h, stride_hot_s, stride_hot_b,
    num_device_blocks,
    BLOCK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, LOG2_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    r64 = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    st = tl.load(state_rows_ptr + r64 * stride_sr)
    row_ok = (st >= 0) & (st < S)
    st64 = tl.where(row_ok, st, 0).to(tl.int64)
    if pid < NC:
        # LRU positions of this chunk: 0 = evictable, 1 = serving hit, 2 = invalid.
        p = pid * BLOCK_H + tl.arange(0, BLOCK_H)
        inb = p < H
        pm = inb & row_ok
        slot = tl.load(lru_ptr + st64 * stride_lru_s + p.to(tl.int64) * stride_lru_h, mask=pm,
                       other=-1)
        sv = pm & (slot >= 0) & (slot < H)
        first = tl.load(owner_ptr + r64 * H + tl.where(sv, slot, 0), mask=sv, other=-1)
        valid = sv & (first == p)
        run = tl.load(pos_run_ptr + r64 * H + p, mask=pm, other=-1)
        winner = tl.load(run_pos_ptr + r64 * BLOCK_K + tl.where(run >= 0, run, 0),
                         mask=pm & (run >= 0), other=-1)
        serving = pm & (run >= 0) & (winner == p)
        evict = valid & ~serving
        cls = tl.where(serving, 1, tl.where(evict, 0, 2))
        tl.store(cls_ptr + r64 * H + p, cls.to(tl.int8), mask=inb)
        tl.store(lru_copy_ptr + r64 * H + p, slot, mask=inb)
        tl.store(counts_ptr + (r64 * NC + pid) * 2, tl.sum(evict.to(tl.int32), axis=0))
        tl.store(counts_ptr + (r64 * NC + pid) * 2 + 1, tl.sum(serving.to(tl.int32), axis=0))
    else:
        # The row's sorted keys: runs of equal host rows, first key = first occurrence.
        j = tl.arange(0, BLOCK_K)
        keys = keys_ptr + r64 * BLOCK_K
        key = tl.load(keys + j)
        host = key < _SENTINEL_K
        g = key >> LOG2_K
        col = (key & (BLOCK_K - 1)).to(tl.int32)
        prev = tl.load(keys + j - 1, mask=j > 0, other=-1)
        start = host & ((j == 0) | ((prev >> LOG2_K) != g))
        run_at = tl.associative_scan(tl.where(start, j, 0), 0, _max_combine)
        srv_pos = tl.load(run_pos_ptr + r64 * BLOCK_K + run_at, mask=host, other=_I32_MAX_K)
        hit = host & (srv_pos != _I32_MAX_K)
        miss = host & ~hit
        first_col = (tl.load(keys + run_at, mask=host, other=0) & (BLOCK_K - 1)).to(tl.int32)
        # Hit columns: the serving slot's device row.
        srv_slot = tl.load(lru_ptr + st64 * stride_lru_s + srv_pos.to(tl.int64) * stride_lru_h,
                           mask=hit, other=-1)
        srv_ok = hit & (srv_slot >= 0) & (srv_slot < H)
        dev = _slot_device_row(hot_ptr, st64, stride_hot_s, stride_hot_b,
                               tl.where(srv_ok, srv_slot, 0).to(tl.int64), srv_ok,
                               num_device_blocks, BLOCK_SIZE)
        tl.store(rows_ptr + r64 * K + col, tl.where(srv_ok, dev, -1).to(tl.int32), mask=hit)
        # Miss runs numbered in column order of their first column.
        cbuf = colbuf_ptr + r64 * BLOCK_K
        tl.store(cbuf + col, (start & miss).to(tl.int32))  # `col` is a permutation of 0..BLOCK_K
        tl.debug_barrier()
        c = tl.arange(0, BLOCK_K)
        flag = tl.load(cbuf + c)
        n_miss = tl.sum(flag, axis=0)
        num = tl.cumsum(flag, axis=0) - 1
        tl.debug_barrier()
        tl.store(cbuf + c, tl.where(flag != 0, num, -1))
        tl.store(n_miss_ptr + r64, n_miss)
        tl.store(miss_src_ptr + r64 * K + c, tl.full([BLOCK_K], -1, tl.int32),
                 mask=(c >= n_miss) & (c < K))
        tl.debug_barrier()
        m = tl.load(cbuf + first_col, mask=miss, other=-1)
        tl.store(miss_src_ptr + r64 * K + m, g.to(tl.int32), mask=miss & start)
        tl.store(colm_ptr + r64 * BLOCK_K + col, tl.where(miss, m, -1))


@triton.jit
def _resolve_lru_kernel(
    state_rows_ptr, lru_ptr, slot_rows_ptr, hot_ptr,
    cls_ptr, lru_copy_ptr, counts_ptr, n_miss_ptr, n_fill_ptr, miss_src_ptr, miss_dst_ptr,
    K, S, H, NC,
    stride_sr, stride_lru_s, stride_lru_h, stride_shr_s, stride_shr_h,
    stride_hot_s, stride_hot_b,
    num_device_blocks,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_NC: tl.constexpr,
):
    r64 = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    st = tl.load(state_rows_ptr + r64 * stride_sr)
    row_ok = (st >= 0) & (st < S)
    st64 = tl.where(row_ok, st, 0).to(tl.int64)
    q = tl.arange(0, BLOCK_NC)
    qm = q < NC
    n_ev = tl.load(counts_ptr + (r64 * NC + q) * 2, mask=qm, other=0)
    n_hit = tl.load(counts_ptr + (r64 * NC + q) * 2 + 1, mask=qm, other=0)
    E = tl.sum(n_ev, axis=0)
    NS = tl.sum(n_hit, axis=0)
    pre_ev = tl.sum(tl.where(q < chunk, n_ev, 0), axis=0)
    pre_hit = tl.sum(tl.where(q < chunk, n_hit, 0), axis=0)
    pre_inv = chunk * BLOCK_H - pre_ev - pre_hit
    n_fill = tl.minimum(tl.load(n_miss_ptr + r64), E)
    n_fill = tl.where(row_ok, n_fill, 0)
    tl.store(n_fill_ptr + r64, n_fill, mask=chunk == 0)
    active = row_ok & (NS + n_fill > 0)

    p = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    pm = (p < H) & active
    cls = tl.load(cls_ptr + r64 * H + p, mask=pm, other=2)
    slot = tl.load(lru_copy_ptr + r64 * H + p, mask=pm, other=0)
    ev = pm & (cls == 0)
    hit = pm & (cls == 1)
    inv = pm & (cls == 2)
    erank = pre_ev + tl.cumsum(ev.to(tl.int32), axis=0) - 1
    hrank = pre_hit + tl.cumsum(hit.to(tl.int32), axis=0) - 1
    irank = pre_inv + tl.cumsum(inv.to(tl.int32), axis=0) - 1
    filled = ev & (erank < n_fill)
    new_pos = tl.where(ev, tl.where(filled, E - n_fill + erank, erank - n_fill),
                       tl.where(hit, E + hrank, E + NS + irank))
    ok = pm & (new_pos >= 0) & (new_pos < H)
    tl.store(lru_ptr + st64 * stride_lru_s + new_pos.to(tl.int64) * stride_lru_h, slot, mask=ok)
    # The erank-th evictable slot takes miss erank.
    fill = filled & (slot >= 0) & (slot < H)
    slot64 = tl.where(fill, slot, 0).to(tl.int64)
    src = tl.load(miss_src_ptr + r64 * K + erank, mask=fill, other=-1)
    dev = _slot_device_row(hot_ptr, st64, stride_hot_s, stride_hot_b, slot64, fill,
                           num_device_blocks, BLOCK_SIZE)
    tl.store(miss_dst_ptr + r64 * K + erank, dev.to(tl.int32), mask=fill)
    tl.store(slot_rows_ptr + st64 * stride_shr_s + slot64 * stride_shr_h, src, mask=fill)


@triton.jit
def _resolve_finalize_kernel(
    state_rows_ptr, rows_ptr, colm_ptr, n_fill_ptr, miss_src_ptr, miss_dst_ptr,
    miss_count_ptr, stats_ptr,
    K, S, stride_sr,
    BLOCK_K: tl.constexpr,
):
    r64 = tl.program_id(0).to(tl.int64)
    st = tl.load(state_rows_ptr + r64 * stride_sr)
    row_ok = (st >= 0) & (st < S)
    n_fill = tl.load(n_fill_ptr + r64)
    c = tl.arange(0, BLOCK_K)
    cm = c < K
    m = tl.load(colm_ptr + r64 * BLOCK_K + c, mask=cm, other=-1)
    is_miss = cm & (m >= 0)
    dst = tl.load(miss_dst_ptr + r64 * K + m, mask=is_miss & (m < n_fill), other=-1)
    out = tl.load(rows_ptr + r64 * K + c, mask=cm & ~is_miss, other=-1)
    out = tl.where(is_miss, dst, out)
    tl.store(rows_ptr + r64 * K + c, out, mask=is_miss)
    masked = tl.sum((cm & (out == -1)).to(tl.int32), axis=0)
    tail = cm & (c >= n_fill)
    tl.store(miss_src_ptr + r64 * K + c, tl.full([BLOCK_K], -1, tl.int32), mask=tail)
    tl.store(miss_dst_ptr + r64 * K + c, tl.full([BLOCK_K], -1, tl.int32), mask=tail)
    planned = tl.load(miss_dst_ptr + r64 * K + c, mask=cm & (c < n_fill), other=-1)
    misses = tl.sum((planned != -1).to(tl.int32), axis=0)
    tl.store(stats_ptr + r64 * 3, tl.where(row_ok, K - masked - misses, 0))
    tl.store(stats_ptr + r64 * 3 + 1, tl.where(row_ok, misses, 0))
    tl.store(stats_ptr + r64 * 3 + 2, tl.where(row_ok, masked, 0))
    tl.store(miss_count_ptr + r64, n_fill)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _carve_int32(device: torch.device, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Contiguous int32 tensors of ``shapes`` as views of one allocation, each starting at a
    multiple of 16 elements (64 B: Triton specialises pointers on 16-byte alignment)."""
    sizes = [math.prod(shape) for shape in shapes]
    padded = [-(-n // 16) * 16 for n in sizes]
    buf = torch.empty(sum(padded), dtype=torch.int32, device=device)
    out, start = [], 0
    for shape, n, step in zip(shapes, sizes, padded):
        out.append(buf[start:start + n].view(shape))
        start += step
    return out


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
) -> ResolveResult:
    """Triton implementation of ``hisparse_triton.reference.resolve`` (same contract).

    ``topk [R, K]``, ``state_rows [R]``, ``seq_lens [S]``, ``resident_blocks / host_blocks
    [S, P]``, ``hot_blocks [S, HB]``, ``slot_host_rows / lru [S, H]``: all int32 on one CUDA
    device (or CPU under ``TRITON_INTERPRET=1``); ``slot_host_rows`` and ``lru`` are updated in
    place. Returns ``ResolveResult`` of int32 tensors. No host synchronisation.
    """
    return _resolve(topk, state_rows, seq_lens, resident_blocks, host_blocks, hot_blocks,
                    slot_host_rows, lru, block_size=block_size,
                    num_device_blocks=num_device_blocks, num_host_blocks=num_host_blocks)


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
    block_h: Optional[int] = None,
    num_warps_k: Optional[int] = None,
) -> ResolveResult:
    """``resolve`` with a tunable LRU chunk width ``block_h`` (a power of two; tests use small
    ones to exercise several chunks per row) and warp count ``num_warps_k`` of the three
    per-row ``BLOCK_K``-wide launches (sort, classify, finalize; default 8 for top-k > 1024,
    else 4): knobs for a GPU benchmark sweep."""
    R, K, S, P, _, H = _check_resolve_args(
        topk, state_rows, seq_lens, resident_blocks, host_blocks, hot_blocks, slot_host_rows,
        lru, block_size, num_device_blocks, num_host_blocks)
    _check_backend(topk.device)
    dev = topk.device
    i32 = torch.int32
    rows = torch.empty((R, K), dtype=i32, device=dev)
    miss_src = torch.empty((R, K), dtype=i32, device=dev)
    miss_dst = torch.empty((R, K), dtype=i32, device=dev)
    miss_count = torch.empty((R,), dtype=i32, device=dev)
    stats = torch.empty((R, 3), dtype=i32, device=dev)
    result = ResolveResult(rows, miss_src, miss_dst, miss_count, stats)
    if R == 0:
        return result
    if S == 0:  # every row is padding; no state tensor has an element to point at
        for t in (rows, miss_src, miss_dst):
            t.fill_(-1)
        miss_count.zero_()
        stats.zero_()
        return result

    BLOCK_K = max(16, _next_pow2(K))
    LOG2_K = BLOCK_K.bit_length() - 1
    if block_h is None:
        BLOCK_H = min(_MAX_BLOCK_H, max(16, _next_pow2(H)))
    else:
        if block_h < 16 or block_h & (block_h - 1):
            raise ValueError(f"resolve: block_h must be a power of two >= 16, got {block_h}")
        BLOCK_H = block_h
    NC = -(-H // BLOCK_H)  # (triton.cdiv is a jit function: slow to call from the host)
    BLOCK_NC = max(2, _next_pow2(NC))

    # Scratch: fixed shapes (graph capturable), every element written before it is read. One
    # int32 allocation carved into 16-element-aligned views (each allocation costs host time
    # on every call; the five outputs stay separate tensors: a custom op's outputs must not
    # alias each other).
    keys = torch.empty((R, BLOCK_K), dtype=torch.int64, device=dev)
    cls = torch.empty((R, H), dtype=torch.int8, device=dev)
    (run_pos, colbuf, colm, owner, pos_run, lru_copy, counts, n_miss, n_fill) = _carve_int32(
        dev, [(R, BLOCK_K)] * 3 + [(R, H)] * 3 + [(R, NC, 2), (R,), (R,)])

    if num_warps_k is not None and num_warps_k not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"resolve: num_warps_k must be a power of two <= 32, got {num_warps_k}")
    warps_k = num_warps_k or (8 if BLOCK_K >= 2048 else 4)
    # Triton launches on the current CUDA device: make it the tensors' device.
    with torch.cuda.device(dev) if dev.type == "cuda" else nullcontext():
        _resolve_sort_kernel[(R, 1 + NC)](
            topk, state_rows, seq_lens, resident_blocks, host_blocks,
            rows, keys, run_pos, owner,
            K, S, P, H,
            topk.stride(0), topk.stride(1), state_rows.stride(0), seq_lens.stride(0),
            resident_blocks.stride(0), resident_blocks.stride(1),
            host_blocks.stride(0), host_blocks.stride(1),
            num_device_blocks, num_host_blocks,
            BLOCK_SIZE=block_size, BLOCK_K=BLOCK_K, BLOCK_H=BLOCK_H, num_warps=warps_k,
        )
        _resolve_search_kernel[(R, NC)](
            state_rows, slot_host_rows, lru, keys, run_pos, owner, pos_run,
            S, H,
            state_rows.stride(0), slot_host_rows.stride(0), slot_host_rows.stride(1),
            lru.stride(0), lru.stride(1),
            num_host_blocks * block_size,
            BLOCK_K=BLOCK_K, LOG2_K=LOG2_K, BLOCK_H=BLOCK_H, num_warps=4,
        )
        _resolve_classify_kernel[(R, NC + 1)](
            state_rows, lru, hot_blocks, keys, run_pos, owner, pos_run,
            cls, lru_copy, counts, colbuf, colm, n_miss, rows, miss_src,
            K, S, H, NC,
            state_rows.stride(0), lru.stride(0), lru.stride(1),
            hot_blocks.stride(0), hot_blocks.stride(1),
            num_device_blocks,
            BLOCK_SIZE=block_size, BLOCK_K=BLOCK_K, LOG2_K=LOG2_K, BLOCK_H=BLOCK_H,
            num_warps=warps_k,
        )
        _resolve_lru_kernel[(R, NC)](
            state_rows, lru, slot_host_rows, hot_blocks,
            cls, lru_copy, counts, n_miss, n_fill, miss_src, miss_dst,
            K, S, H, NC,
            state_rows.stride(0), lru.stride(0), lru.stride(1),
            slot_host_rows.stride(0), slot_host_rows.stride(1),
            hot_blocks.stride(0), hot_blocks.stride(1),
            num_device_blocks,
            BLOCK_SIZE=block_size, BLOCK_H=BLOCK_H, BLOCK_NC=BLOCK_NC, num_warps=4,
        )
        _resolve_finalize_kernel[(R,)](
            state_rows, rows, colm, n_fill, miss_src, miss_dst, miss_count, stats,
            K, S, state_rows.stride(0),
            BLOCK_K=BLOCK_K, num_warps=warps_k,
        )
    return result
