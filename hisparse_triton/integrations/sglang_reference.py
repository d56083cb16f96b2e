"""Torch models of SGLang 0.5.23's HiSparse swap-in and plan replay: the semantics the Triton
kernels (``hisparse_triton.kernels.sglang_swap_in``) match bit for bit.

``load_cache_to_device_buffer_mla`` and ``copy_cache_planned_mla`` have the names, argument
order, defaults and in-place contract of SGLang's functions in
``sglang.kernels.ops.kvcache.hisparse``; the rules are written from SGLang's CUDA kernel
(``kernels/jit/csrc/kvcacheio/hisparse.cuh``: ``load_cache_to_device_buffer_kernel`` and
``copy_cache_planned_kernel``) and its caller ``HiSparseCoordinator``. The swap-in is split in
two steps, as the Triton backend runs it: ``resolve_swap_in`` (state, outputs, miss plan) and
``copy_planned_rows`` (the plan's host rows into the device buffer).

State of one request (row ``rid = req_pool_indices[b]`` of every table):

- ``device_buffer_tokens[rid, s]``: the position held by slot ``s`` (-1: none), for the
  ``hot_buffer_size`` (H) LRU slots; slot ``H`` is reserved for the newest token;
- ``device_buffer_locs[rid, s]``: the device-pool row of slot ``s``;
- ``lru_slots[rid, :H]``: the LRU slots as a permutation, least recently used first;
- ``host_cache_locs[rid, p]``: the host-pool row of position ``p``.

Row ``b`` of a call (``seq_len = seq_lens[b]``, ``K = num_top_k``, ``t_i = top_k_tokens[b, i]``):

1. ``b >= num_real_reqs[0]`` (CUDA-graph padding): ``top_k_device_locs[b, :K] = -1``; nothing
   else (not even the miss count).
2. ``seq_len <= H`` (every position is in its own slot): column ``i < min(seq_len, K)`` with
   ``t_i >= 0`` gives ``device_buffer_locs[rid, t_i]``, every other column -1; the LRU and the
   slots are untouched and the row's miss count is 0.
3. Otherwise: a column holding the newest position ``seq_len - 1`` gives the locs of slot H.
   The other columns with a position in ``[0, context)`` are looked up: the first column of
   each position (its *canonical* column) hits when an LRU slot holds that position, and gives
   that slot's locs (the least recently used such slot, should two hold it). Every other of
   these columns is a miss (a column repeating an earlier column's position misses too, as in
   SGLang, whose hash keeps one column per position). Misses, in column order, take the
   evictable slots (not hit this step) in LRU order: the slot gets the position, the column
   the slot's locs, and the miss plan entry ``(host_cache_locs[rid, t_i], locs)``. The new LRU
   order is: unused evictable slots (old order), filled slots (miss order), hit slots (old
   order). The row's miss count is the number of filled slots.

Where SGLang's kernel would read or write outside a tensor, or race, a rule is chosen here
and the kernels follow it: a row whose ``req_pool_indices`` entry is outside the state tables
is handled like a padding row (and its miss count is 0); a column whose position is below -1
or at or past ``host_cache_locs``' columns is left as it was, like -1 (SGLang leaves -1
columns of a long row unwritten); in the fast path a position past the slot columns gives -1;
an LRU entry outside the slot columns holds nothing and its locs are -1; misses beyond the
evictable slots give -1 and are not planned; a plan entry whose host row is outside the host
pool zero-fills its device row, one whose device row is outside the pool is skipped.
Duplicate ``req_pool_indices`` among real rows and LRU rows that are not permutations are
races in SGLang; here they are memory-safe but unspecified.

These models read index values on the host: on CUDA tensors they synchronise (they are the
oracle and the CPU backend; the Triton kernels are the CUDA path).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from hisparse_triton.integrations.sglang_checks import (
    SwapInGeometry,
    check_copy_planned,
    check_swap_in,
)

__all__ = ["copy_cache_planned_mla", "copy_planned_rows", "load_cache_to_device_buffer_mla",
           "resolve_swap_in", "wrap_int32"]


def wrap_int32(value: int) -> int:
    """``value`` as the int32 SGLang's kernel computes it in (two's-complement wrap)."""
    return (value + 2**31) % 2**32 - 2**31


def _real_rows(num_real_reqs: Optional[Tensor], batch: int) -> int:
    return batch if num_real_reqs is None else int(num_real_reqs.reshape(-1)[0])


def resolve_swap_in(top_k_tokens: Tensor, device_buffer_tokens: Tensor,
                    host_cache_locs: Tensor, device_buffer_locs: Tensor,
                    top_k_device_locs: Tensor, req_pool_indices: Tensor, seq_lens: Tensor,
                    lru_slots: Tensor, num_real_reqs: Optional[Tensor], geometry: SwapInGeometry,
                    miss_src: Tensor, miss_dst: Tensor, miss_count: Tensor) -> None:
    """Steps 1-3 of the module docstring for every row: writes ``top_k_device_locs``,
    ``device_buffer_tokens``, ``lru_slots`` and the miss plan (``miss_src [>= bs, >= K] int64``,
    ``miss_dst [>= bs, >= K] int32``, ``miss_count [>= bs] int32``) in place; moves no KV bytes.
    ``geometry``: ``check_swap_in``'s result for these arguments."""
    bs, K, H, states, width, context = geometry[:6]
    real = _real_rows(num_real_reqs, bs)
    for b in range(bs):
        out = top_k_device_locs[b, :K]
        if b >= real:
            out.fill_(-1)
            continue
        rid = int(req_pool_indices[b])
        if not 0 <= rid < states:
            out.fill_(-1)
            miss_count[b] = 0
            continue
        seq_len = int(seq_lens[b])
        locs = device_buffer_locs[rid].tolist()
        tokens = top_k_tokens[b, :K].tolist()
        if seq_len <= H:
            shown = min(seq_len, K)
            out.copy_(torch.tensor(
                [locs[t] if i < shown and 0 <= t < width else -1 for i, t in enumerate(tokens)],
                dtype=torch.int32))
            miss_count[b] = 0
            continue
        row = out.tolist()
        newest = wrap_int32(seq_len - 1)
        canonical: dict[int, int] = {}            # position -> its first column
        for i, t in enumerate(tokens):
            if t == newest:
                row[i] = locs[H]
            elif 0 <= t < context and t not in canonical:
                canonical[t] = i
        order = lru_slots[rid, :H].tolist()
        held = device_buffer_tokens[rid].tolist()
        hit = [False] * H
        served: dict[int, int] = {}               # canonical column -> slot serving it
        for p, s in enumerate(order):
            t = held[s] if 0 <= s < width else -1
            column = canonical.get(t) if t >= 0 else None
            if column is not None:
                hit[p] = True
                served.setdefault(column, s)
        for column, s in served.items():
            row[column] = locs[s]
        evictable = [s for p, s in enumerate(order) if not hit[p]]
        misses = [i for i, t in enumerate(tokens)
                  if t != newest and 0 <= t < context and i not in served]
        filled = min(len(misses), len(evictable))
        for m, i in enumerate(misses):
            if m >= filled:
                row[i] = -1
                continue
            s = evictable[m]
            loc = locs[s] if 0 <= s < width else -1
            row[i] = loc
            if 0 <= s < width:
                device_buffer_tokens[rid, s] = tokens[i]
            miss_src[b, m] = host_cache_locs[rid, tokens[i]]
            miss_dst[b, m] = loc
        miss_count[b] = filled
        out.copy_(torch.tensor(row, dtype=torch.int32))
        hits = [s for p, s in enumerate(order) if hit[p]]
        lru_slots[rid, :H] = torch.tensor(evictable[filled:] + evictable[:filled] + hits,
                                          dtype=torch.int16)


def _rows(pool: Tensor, item_size_bytes: int, rows: int) -> Tensor:
    """``pool``'s first ``rows`` rows of ``item_size_bytes`` bytes, as a ``[rows, item]``
    uint8 view (the pool is contiguous)."""
    return pool.reshape(-1).view(torch.uint8)[: rows * item_size_bytes].view(rows,
                                                                             item_size_bytes)


def copy_planned_rows(miss_src: Tensor, miss_dst: Tensor, miss_count: Tensor, real: int,
                      host_cache: Tensor, device_buffer: Tensor, item_size_bytes: int,
                      rows: int, columns: int, host_rows: int, device_rows: int) -> None:
    """Copy, for plan rows ``r < min(real, rows)`` and columns ``m < miss_count[r]`` (at most
    ``columns``), host row ``miss_src[r, m]`` into device row ``miss_dst[r, m]`` (rows of
    ``item_size_bytes`` bytes); a host row outside the pool zero-fills, a device row outside
    the pool is skipped."""
    host = _rows(host_cache, item_size_bytes, host_rows)
    device = _rows(device_buffer, item_size_bytes, device_rows)
    for r in range(min(real, rows)):
        count = min(max(int(miss_count[r]), 0), columns)
        for src, dst in zip(miss_src[r, :count].tolist(), miss_dst[r, :count].tolist()):
            if not 0 <= dst < device_rows:
                continue
            if 0 <= src < host_rows:
                device[dst].copy_(host[src].to(device.device))
            else:
                device[dst].zero_()


def load_cache_to_device_buffer_mla(
        top_k_tokens: Tensor, device_buffer_tokens: Tensor, host_cache_locs: Tensor,
        device_buffer_locs: Tensor, host_cache: Tensor, device_buffer: Tensor,
        top_k_device_locs: Tensor, req_pool_indices: Tensor, seq_lens: Tensor,
        lru_slots: Tensor, item_size_bytes: int, num_top_k: int, hot_buffer_size: int,
        page_size: int = 1, block_size: int = 256, num_real_reqs: Optional[Tensor] = None,
        miss_src: Optional[Tensor] = None, miss_dst: Optional[Tensor] = None,
        miss_count: Optional[Tensor] = None, skip_io: bool = False) -> None:
    """SGLang's MLA swap-in (see the module docstring): resolve every row, record the miss
    plan when ``miss_src`` / ``miss_dst`` / ``miss_count`` are given, and copy the missed rows
    host -> device unless ``skip_io``. ``page_size`` and ``block_size`` (launch parameters of
    SGLang's kernel) do not change the result."""
    g = check_swap_in(top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs,
                      host_cache, device_buffer, top_k_device_locs, req_pool_indices, seq_lens,
                      lru_slots, item_size_bytes, num_top_k, hot_buffer_size, num_real_reqs,
                      miss_src, miss_dst, miss_count)
    if not g.plan:
        device = top_k_tokens.device
        miss_src = torch.zeros(g.batch, g.top_k, dtype=torch.int64, device=device)
        miss_dst = torch.zeros(g.batch, g.top_k, dtype=torch.int32, device=device)
        miss_count = torch.zeros(g.batch, dtype=torch.int32, device=device)
    resolve_swap_in(top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs,
                    top_k_device_locs, req_pool_indices, seq_lens, lru_slots, num_real_reqs, g,
                    miss_src, miss_dst, miss_count)
    if not skip_io:
        copy_planned_rows(miss_src, miss_dst, miss_count, _real_rows(num_real_reqs, g.batch),
                          host_cache, device_buffer, item_size_bytes, g.batch, g.top_k,
                          g.host_rows, g.device_rows)


def copy_cache_planned_mla(*, miss_src: Tensor, miss_dst: Tensor, miss_count: Tensor,
                           num_real_reqs: Tensor, host_cache: Tensor, device_buffer: Tensor,
                           item_size_bytes: int, num_blocks: int = 4, block_size: int = 1024,
                           is_dsv4_layout: bool = False, skip_io: bool = False) -> None:
    """SGLang's plan replay for a follower layer: the rows a leader's swap-in planned, copied
    from this layer's host pool into its device buffer (``copy_planned_rows`` over the real
    rows). ``skip_io`` copies nothing; ``num_blocks`` / ``block_size`` (SGLang's grid) do not
    change the result. DeepSeek-V4's page-padded layout (``is_dsv4_layout``) is not modelled
    here: SGLang keeps it."""
    if is_dsv4_layout:
        raise ValueError("copy_cache_planned_mla: is_dsv4_layout=True (DeepSeek-V4's "
                         "page-padded rows) is SGLang's own kernel; it is not modelled here")
    g = check_copy_planned(miss_src, miss_dst, miss_count, num_real_reqs, host_cache,
                           device_buffer, item_size_bytes)
    if skip_io:
        return
    copy_planned_rows(miss_src, miss_dst, miss_count, _real_rows(num_real_reqs, g.rows),
                      host_cache, device_buffer, item_size_bytes, g.rows, g.columns,
                      g.host_rows, g.device_rows)
