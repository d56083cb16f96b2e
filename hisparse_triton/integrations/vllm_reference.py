"""Torch models of vLLM 0.33's five HiSparse custom ops: the semantics the Triton kernels match.

Each function has the name, argument order and in-place contract of the ``_C_cache_ops`` op
vLLM 0.33.0 calls (``vllm/v1/hisparse/runtime.py``, ``vllm/v1/attention/backends/mla/
index_group.py``, ``vllm/_custom_ops.py``); the rules are written from those call sites and
from what vLLM's CUDA ops compute. Where vLLM leaves a case undefined (a union larger than
the free slots, a corrupted state, overlapping outputs) the rule chosen here is stated and the
kernels follow it. Address arithmetic is int64; ids are stored as int32.

These models read index values on the host: on CUDA tensors they synchronise (they are the
oracle and the CPU backend; the Triton kernels are the CUDA path).

Vocabulary: a *row* is one row of ``global_indices`` (one token of the step: a decode query,
or one of a request's speculative verification rows); ``request_ids[row]`` is its input-batch
row (it indexes the source and hot block tables); ``request_state_indices[request]`` is the
request's persistent state row (it indexes ``device_global_indices``, ``lru_slots`` and the
resident table); -1 marks a CUDA-graph padding row.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from hisparse_triton.integrations.vllm_checks import (
    check_gather_compact,
    check_gather_plan,
    check_invalidate_written_slots,
    check_resolve_residency,
    check_upconvert,
)

__all__ = ["cp_gather_and_upconvert_fp8_kv_cache", "hisparse_gather_compact",
           "hisparse_gather_plan", "hisparse_invalidate_written_slots",
           "hisparse_resolve_residency", "requests_of_rows", "translate_positions",
           "upconvert_fp8_rows"]

_I64 = torch.int64


# ------------------------------------------------------------------------- shared pieces


def requests_of_rows(request_ids: Optional[Tensor], request_state_indices: Optional[Tensor],
                     num_rows: int, num_states: int) -> tuple[Tensor, Tensor, list[list[int]]]:
    """``(request [R] int64, state [R] int64, groups)`` for the rows of one resolve.

    A row's request is ``request_ids[row]`` (its own index without ``request_ids``); its state
    row is ``request_state_indices[request]`` (the request itself without them; -1 when the
    request is outside ``request_state_indices``). ``groups`` lists, in batch order of their
    first row, the rows of every request that resolves: all rows with the same request id
    form ONE request whether or not they are contiguous. A row is padding (in no group) when
    its state row is outside ``[0, num_states)``, and so is every row of a request whose state
    row an earlier request (by first row) already uses.
    """
    if request_ids is not None:
        req = request_ids[:num_rows].to(_I64)
    else:
        req = torch.arange(num_rows, dtype=_I64, device=request_state_indices.device
                           if request_state_indices is not None else "cpu")
    if request_state_indices is not None:
        n = request_state_indices.numel()
        known = (req >= 0) & (req < n)
        state = torch.where(known, request_state_indices.to(_I64)[req.clamp(0, max(n - 1, 0))]
                            if n else req, -1)
    else:
        state = req.clone()
    groups: list[list[int]] = []
    by_request: dict[int, list[int]] = {}
    used_states: dict[int, int] = {}
    for row, (r, s) in enumerate(zip(req.tolist(), state.tolist())):
        if not 0 <= s < num_states:
            continue
        rows = by_request.get(r)
        if rows is not None:
            rows.append(row)
            continue
        if s in used_states:  # another request resolves this state row
            continue
        used_states[s] = r
        by_request[r] = [row]
        groups.append(by_request[r])
    return req, state, groups


def _lookup(table: Tensor, rows: Tensor, cols: Tensor, valid: Tensor) -> Tensor:
    """``table[rows, cols]`` as int64 where ``valid``, 0 elsewhere (never out of bounds)."""
    if table.numel() == 0:
        return torch.zeros_like(cols)
    r = torch.where(valid, rows, 0).clamp(0, table.shape[0] - 1)
    c = torch.where(valid, cols, 0).clamp(0, table.shape[1] - 1)
    return torch.where(valid, table.to(_I64)[r, c], 0)


def translate_positions(positions: Tensor, request: Tensor, state: Tensor, host_rows: int,
                        source_block_table: Optional[Tensor], source_block_size: int,
                        resident_block_table: Optional[Tensor], resident_block_size: int,
                        resident_null_block: int) -> tuple[Tensor, Tensor]:
    """``(host_row, resident_row)``, both ``[R, K] int64``, of request-relative positions.

    With a source table: page ``pos // source_block_size`` of the request's source row gives
    the host block (block 0, a page past the table or a request outside it: no host row, -1);
    a non-null resident block (``!= resident_null_block``, ``>= 0``) of the request's state row
    gives the resident row. Without one, positions are host rows already. A host row at or
    past ``host_rows`` is -1 (vLLM: ``translate_topk_entry``).
    """
    pos = positions.to(_I64)
    if source_block_table is None:
        g = pos
        resident = torch.full_like(pos, -1)
    else:
        page = torch.where(pos >= 0, torch.div(pos, source_block_size, rounding_mode="floor"),
                           -1)
        rows = request[:, None].expand_as(pos)
        ok = (rows >= 0) & (rows < source_block_table.shape[0]) & (page >= 0) \
            & (page < source_block_table.shape[1])
        block = _lookup(source_block_table, rows, page, ok)
        g = torch.where(ok & (block > 0), block * source_block_size + pos % source_block_size,
                        -1)
        resident = torch.full_like(pos, -1)
        if resident_block_table is not None:
            rpage = torch.where(pos >= 0,
                                torch.div(pos, resident_block_size, rounding_mode="floor"), -1)
            srows = state[:, None].expand_as(pos)
            rok = (srows >= 0) & (srows < resident_block_table.shape[0]) & (rpage >= 0) \
                & (rpage < resident_block_table.shape[1])
            rblock = _lookup(resident_block_table, srows, rpage, rok)
            rok &= (rblock != resident_null_block) & (rblock >= 0)
            resident = torch.where(rok, rblock * resident_block_size
                                   + pos % resident_block_size, -1)
    g = torch.where(g >= host_rows, -1, g)
    return g, resident


def _attention(rows: Tensor, hot_block_size: int, attention_block_stride: int) -> Tensor:
    """Attention-cache index of hot-cache rows (-1 stays -1)."""
    return torch.where(rows < 0, -1, torch.div(rows, hot_block_size, rounding_mode="floor")
                       * attention_block_stride + rows % hot_block_size)


def _hot_rows(hot_block_table: Tensor, request: int, slots: Tensor, hot_block_size: int) -> Tensor:
    """Hot-cache rows of a request's slots: ``block * hot_block_size + slot % hot_block_size``."""
    blocks = hot_block_table[request].to(_I64)[torch.div(slots, hot_block_size,
                                                         rounding_mode="floor")]
    return blocks * hot_block_size + slots % hot_block_size


# -------------------------------------------------------------------------------- resolve


def hisparse_resolve_residency(
        host_cache: Tensor, hot_cache: Tensor, hot_block_table: Tensor, global_indices: Tensor,
        hot_indices: Tensor, device_global_indices: Tensor, lru_slots: Tensor,
        request_state_indices: Optional[Tensor], region_stride: int, max_union_rows: int,
        miss_mask: Optional[Tensor] = None, stats: Optional[Tensor] = None,
        attention_indices: Optional[Tensor] = None, attention_block_stride: int = 0,
        request_ids: Optional[Tensor] = None, source_block_table: Optional[Tensor] = None,
        source_block_size: int = 0, resolved_global_indices: Optional[Tensor] = None,
        valid_counts: Optional[Tensor] = None,
        swap_host_physical_rows: Optional[Tensor] = None,
        swap_device_physical_rows: Optional[Tensor] = None,
        swap_counts: Optional[Tensor] = None, resident_block_table: Optional[Tensor] = None,
        resident_block_size: int = 0, resident_null_block: int = 0) -> None:
    """Resolve top-k positions into hot-cache rows, plan the misses, update the hot LRU.

    For every non-padding row (see ``requests_of_rows``) and column: the position is
    translated (``translate_positions``); ``resolved_global_indices`` gets the host row,
    ``valid_counts`` counts columns with a host or resident row, ``miss_mask`` is cleared. A
    resident column reads its resident row; a column with neither reads -1. The other columns
    (host rows) of ALL rows of a request form one union, resolved against the request's hot
    slots (``device_global_indices[state]``: the host row a slot holds, -1 empty;
    ``lru_slots[state]``: slots oldest first):

    - an LRU position whose slot (in ``[0, region_stride)``) holds a host row of the union is a
      hit; an entry with several such positions is served by the oldest;
    - the other positions are evictable, in LRU order; entries without a hit are misses,
      numbered in (row, column) order of their first reference (rows in batch order); miss
      ``m`` takes the ``m``-th evictable slot: ``device_global_indices[state, slot] = g``,
      ``miss_mask`` = 1 at its first reference, and its plan entry
      ``(swap_host, swap_device) = (g, hot row of the slot)`` goes to column ``m % K`` of the
      request's ``m // K``-th row (vLLM's compact layout); ``swap_counts[row i of the
      request] = clamp(M - i * K, 0, K)`` for M misses;
    - a miss whose slot is outside ``[0, region_stride)`` (corrupted LRU) or that finds no
      evictable slot left is unserved: its references read -1, its plan entry is
      ``(g, -1)``, no state changes for it;
    - every reference of an entry reads the entry's hot row
      (``hot_block_table[request, slot // hbs] * hbs + slot % hbs``);
    - new LRU order: the evictable positions not taken (old order), the taken ones (miss
      order), then the hit positions (old order);
    - ``stats += (references to served entries other than a miss's first reference, served
      misses)`` (uint64 hits, misses).

    A request none of whose columns has a host row leaves its LRU untouched and plans
    nothing. ``hot_indices`` / ``attention_indices`` (``(row // hbs) * attention_block_stride
    + row % hbs``) are written for every column of every row; padding rows get -1 there and
    in ``resolved_global_indices``, 0 in ``valid_counts`` / ``swap_counts``. Plan entries past
    a request's misses are left as they were. ``hot_cache`` only gives the hot geometry.
    """
    R, K, H, S, hbs, host_rows = check_resolve_residency(
        host_cache, hot_cache, hot_block_table, global_indices, hot_indices,
        device_global_indices, lru_slots, request_state_indices, region_stride, max_union_rows,
        miss_mask, stats, attention_indices, attention_block_stride, request_ids,
        source_block_table, source_block_size, resolved_global_indices, valid_counts,
        swap_host_physical_rows, swap_device_physical_rows, swap_counts, resident_block_table,
        resident_block_size, resident_null_block)
    if R == 0 or K == 0:
        return
    request, state, groups = requests_of_rows(request_ids, request_state_indices, R, S)
    g, resident = translate_positions(global_indices[:R], request, state, host_rows,
                                      source_block_table, source_block_size,
                                      resident_block_table, resident_block_size,
                                      resident_null_block)
    hot = torch.where(resident >= 0, resident, -1)
    resolving = torch.zeros(R, dtype=torch.bool, device=g.device)
    for rows in groups:
        resolving[rows] = True
    # Per-row outputs of the translation (padding rows are overwritten below).
    if resolved_global_indices is not None:
        resolved_global_indices.copy_(torch.where(resolving[:, None], g, -1).to(torch.int32))
    if valid_counts is not None:
        counts = ((resident >= 0) | (g >= 0)).sum(1)
        valid_counts.copy_(torch.where(resolving, counts, 0).to(torch.int32))
    if miss_mask is not None:
        miss_mask[resolving] = 0
    if swap_counts is not None:
        swap_counts[:R] = 0
    hits_total = misses_total = 0
    host_path = (resident < 0) & (g >= 0)
    for rows in groups:
        st = int(state[rows[0]])
        req = int(request[rows[0]])
        idx = torch.tensor(rows, dtype=_I64, device=g.device)
        gq = g[idx].reshape(-1)
        on_host = host_path[idx].reshape(-1)
        if not bool(on_host.any()):
            continue
        positions = torch.nonzero(on_host).flatten()          # u = row rank * K + column
        entries, inverse = torch.unique(gq[positions], return_inverse=True)
        n_entries = entries.numel()
        first_u = torch.full((n_entries,), len(rows) * K, dtype=_I64, device=g.device)
        first_u.scatter_reduce_(0, inverse, positions, reduce="amin")
        # Hot slots in LRU order: which hold an entry of the union.
        slots = lru_slots[st].to(_I64)
        slot_ok = (slots >= 0) & (slots < region_stride)
        held = torch.where(slot_ok, device_global_indices[st].to(_I64)[slots.clamp(0, H - 1)],
                           -1)
        at = torch.searchsorted(entries, held).clamp(max=n_entries - 1)
        is_hit = (held >= 0) & (entries[at] == held)
        hit_pos = torch.full((n_entries,), H, dtype=_I64, device=g.device)
        lru_pos = torch.arange(H, dtype=_I64, device=g.device)
        hit_pos.scatter_reduce_(0, at[is_hit], lru_pos[is_hit], reduce="amin")
        served_by_hit = hit_pos < H
        value = torch.full((n_entries,), -1, dtype=_I64, device=g.device)
        if bool(served_by_hit.any()):
            value[served_by_hit] = _hot_rows(hot_block_table, req,
                                             slots[hit_pos[served_by_hit]], hbs)
        # Misses in order of first reference take the evictable slots, oldest first.
        evictable = slots[~is_hit]
        miss_entries = torch.nonzero(~served_by_hit).flatten()
        miss_entries = miss_entries[torch.argsort(first_u[miss_entries])]
        M = miss_entries.numel()
        n_take = min(M, evictable.numel())
        miss_slot = torch.full((M,), -1, dtype=_I64, device=g.device)
        miss_slot[:n_take] = evictable[:n_take]
        served = (miss_slot >= 0) & (miss_slot < region_stride)
        miss_g = entries[miss_entries]
        miss_rows = torch.full((M,), -1, dtype=_I64, device=g.device)
        if bool(served.any()):
            miss_rows[served] = _hot_rows(hot_block_table, req, miss_slot[served], hbs)
            dgi_row = device_global_indices[st]
            for slot, host_row in zip(miss_slot[served].tolist(), miss_g[served].tolist()):
                dgi_row[slot] = host_row  # in miss order: a slot named twice keeps the last
        value[miss_entries] = miss_rows
        # Every reference reads its entry; the first reference of a served miss loads it.
        ref_rows = value[inverse]
        flat_hot = hot[idx].reshape(-1)
        flat_hot[positions] = ref_rows
        hot[idx] = flat_hot.view(len(rows), K)
        first_of_miss = first_u[miss_entries[served]]
        if miss_mask is not None and first_of_miss.numel():
            miss_mask[idx[first_of_miss // K], first_of_miss % K] = 1
        entry_served = served_by_hit.clone()
        entry_served[miss_entries] = served
        misses_total += int(served.sum())
        hits_total += int(entry_served[inverse].sum()) - int(served.sum())
        # vLLM's compact plan: miss m in column m % K of the request's (m // K)-th row.
        m = torch.arange(M, dtype=_I64, device=g.device)
        if swap_counts is not None and M:
            plan_rows = idx[m // K]
            swap_host_physical_rows[plan_rows, m % K] = miss_g.to(torch.int32)
            swap_device_physical_rows[plan_rows, m % K] = miss_rows.to(torch.int32)
            seg = torch.arange(len(rows), dtype=_I64, device=g.device) * K
            swap_counts[idx] = (M - seg).clamp(0, K).to(torch.int32)
        new_order = torch.cat((evictable[n_take:], evictable[:n_take], slots[is_hit]))
        lru_slots[st] = new_order.to(torch.int16)
    hot = torch.where(resolving[:, None], hot, -1).to(torch.int32)  # int32 rows, as vLLM's
    hot_indices.copy_(hot)
    if attention_indices is not None:
        attention_indices.copy_(_attention(hot.to(_I64), hbs, attention_block_stride)
                                .to(torch.int32))
    if stats is not None and (hits_total or misses_total):
        stats.view(_I64).add_(torch.tensor([hits_total, misses_total], dtype=_I64,
                                           device=stats.device))


# --------------------------------------------------------------------------------- gathers


def _paged_rows(cache: Tensor, rows: Tensor, hot_block_size: int) -> tuple[Tensor, ...]:
    """Index tuple addressing ``rows`` of a paged ``[blocks, block_size, w]`` or staging
    ``[rows, w]`` cache."""
    if cache.dim() == 2:
        return (rows,)
    return (torch.div(rows, hot_block_size, rounding_mode="floor"), rows % hot_block_size)


def _copy_host_rows(host_cache: Tensor, hot_cache: Tensor, src: Tensor, dst: Tensor,
                    host_rows: int, hot_block_size: int) -> None:
    """``hot[dst] = host[src]``, zeros where ``src >= host_rows`` (bytes; rows in range)."""
    if src.numel() == 0:
        return
    host_bytes = host_cache.view(torch.uint8)
    have = src < host_rows
    data = torch.zeros((src.numel(), host_bytes.shape[1]), dtype=torch.uint8,
                       device=hot_cache.device)
    if bool(have.any()):
        data[have] = host_bytes[src[have].to(host_bytes.device)].to(hot_cache.device)
    hot_bytes = hot_cache.view(torch.uint8)
    hot_bytes[_paged_rows(hot_bytes, dst, hot_block_size)] = data


def hisparse_gather_plan(host_cache: Tensor, hot_cache: Tensor, global_indices: Tensor,
                         hot_indices: Tensor, miss_mask: Tensor,
                         request_state_indices: Optional[Tensor],
                         attention_indices: Optional[Tensor] = None,
                         attention_block_stride: int = 0) -> None:
    """Replay a miss plan for one layer: copy host row ``global_indices[r, c]`` into hot row
    ``hot_indices[r, c]`` where ``miss_mask[r, c] != 0``.

    Skipped: padding rows (``request_state_indices[r] < 0``, indexed by row), ``g < 0``, a
    destination outside ``[0, hot rows)``. A source at or past the host rows zero-fills the
    destination. ``attention_indices`` (when given) gets every column's attention index of
    ``hot_indices`` (-1 for padding rows and negative rows). ``hot_cache`` is paged
    ``[blocks, block_size, w]`` or a ``[rows, w]`` staging buffer. Two entries naming one
    destination leave one of the two rows there (unspecified which).
    """
    R, K, hbs, hot_rows, host_rows, _ = check_gather_plan(
        host_cache, hot_cache, global_indices, hot_indices, miss_mask, request_state_indices,
        attention_indices, attention_block_stride)
    if R == 0 or K == 0:
        return
    padding = torch.zeros(R, dtype=torch.bool, device=global_indices.device)
    if request_state_indices is not None:
        padding = request_state_indices.reshape(-1)[:R] < 0
    dst = hot_indices.to(_I64)
    if attention_indices is not None:
        attention = torch.where(padding[:, None], -1, _attention(dst, hbs,
                                                                 attention_block_stride))
        attention_indices.copy_(attention.to(torch.int32))
    src = global_indices.to(_I64)
    copy = (~padding)[:, None] & (miss_mask != 0) & (src >= 0) & (dst >= 0) & (dst < hot_rows)
    _copy_host_rows(host_cache, hot_cache, src[copy], dst[copy], host_rows, hbs)


def hisparse_gather_compact(host_cache: Tensor, hot_cache: Tensor, miss_global_indices: Tensor,
                            miss_hot_indices: Tensor, miss_counts: Tensor) -> None:
    """Copy the compact miss plan of ``hisparse_resolve_residency``: for row ``r`` and column
    ``c < clamp(miss_counts[r], 0, K)``, host row ``miss_global_indices[r, c]`` -> hot row
    ``miss_hot_indices[r, c]``. Skipped: ``g < 0``, a destination outside ``[0, hot rows)``;
    a source at or past the host rows zero-fills the destination."""
    R, K, hbs, hot_rows, host_rows, _ = check_gather_compact(
        host_cache, hot_cache, miss_global_indices, miss_hot_indices, miss_counts)
    if R == 0 or K == 0:
        return
    counts = miss_counts.reshape(-1)[:R].to(_I64).clamp(0, K)
    cols = torch.arange(K, dtype=_I64, device=counts.device)
    src = miss_global_indices.to(_I64)
    dst = miss_hot_indices.to(_I64)
    copy = (cols[None, :] < counts[:, None]) & (src >= 0) & (dst >= 0) & (dst < hot_rows)
    _copy_host_rows(host_cache, hot_cache, src[copy], dst[copy], host_rows, hbs)


# ----------------------------------------------------------------------------- invalidate


def hisparse_invalidate_written_slots(device_global_indices: Tensor,
                                      request_state_indices: Tensor, req_id_per_token: Tensor,
                                      written_slots: Tensor) -> None:
    """Drop hot copies of host rows written this step: for token ``t`` with request
    ``req = req_id_per_token[t]`` in ``[0, len(request_state_indices))``, state row
    ``st = request_state_indices[req]`` in ``[0, state rows)`` and ``written_slots[t] >= 0``,
    every entry of ``device_global_indices[st]`` equal to ``written_slots[t]`` becomes -1.
    The LRU order is untouched."""
    T = check_invalidate_written_slots(device_global_indices, request_state_indices,
                                       req_id_per_token, written_slots)
    S, W = device_global_indices.shape
    if T == 0 or S == 0 or W == 0:
        return
    n = request_state_indices.numel()
    req = req_id_per_token.to(_I64)
    known = (req >= 0) & (req < n)
    st = torch.where(known, request_state_indices.to(_I64)[req.clamp(0, max(n - 1, 0))]
                     if n else req, -1)
    slot = written_slots
    ok = known & (st >= 0) & (st < S) & (slot >= 0)
    st, slot = st[ok], slot[ok]
    for start in range(0, st.numel(), 256):  # bounded [chunk, W] comparisons
        rows = st[start:start + 256]
        match = device_global_indices[rows].to(_I64) == slot[start:start + 256, None]
        hit = torch.zeros((S, W), dtype=torch.int32, device=match.device)
        hit.index_add_(0, rows, match.to(torch.int32))
        device_global_indices.masked_fill_(hit > 0, -1)


# ------------------------------------------------------------------------ FP8 up-convert


def _bf16_bits(values: Tensor) -> Tensor:
    """Round fp32 to bf16 (nearest even) as int16 bits; every NaN becomes 0x7FFF."""
    bits = values.contiguous().view(torch.int32).to(_I64) & 0xFFFFFFFF
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    out = torch.where(nan, 0x7FFF, rounded & 0xFFFF)
    return torch.where(out >= 0x8000, out - 0x10000, out).to(torch.int16)


def upconvert_fp8_rows(rows: Tensor) -> Tensor:
    """``[N, 656] uint8`` fp8_ds_mla rows -> ``[N, 576] int16`` bf16 bits: value ``i < 512`` is
    ``bf16(float(e4m3 byte i) * scale[i // 128])`` (fp32 scales at bytes 512..527), values
    512..575 are the bf16 rope values at bytes 528..655, copied."""
    n = rows.shape[0]
    nope = rows[:, :512].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    scales = rows[:, 512:528].contiguous().view(torch.float32)
    values = nope.view(n, 4, 128) * scales[:, :, None]
    rope = rows[:, 528:656].contiguous().view(torch.int16)
    return torch.cat((_bf16_bits(values.reshape(n, 512)), rope), dim=1)


def cp_gather_and_upconvert_fp8_kv_cache(src_cache: Tensor, dst: Tensor, block_table: Tensor,
                                         workspace_starts: Tensor, batch_size: int,
                                         seq_starts: Optional[Tensor] = None,
                                         host_cache: Optional[Tensor] = None,
                                         host_row_ids: Optional[Tensor] = None,
                                         device_row_ids: Optional[Tensor] = None) -> None:
    """Gather requests' fp8_ds_mla rows into a bf16 workspace, up-converting them.

    Request ``q < batch_size`` owns workspace rows ``[min(ws[q], T), min(ws[q + 1] or T,
    T))`` (``ws`` = ``workspace_starts``, T = ``dst`` rows); its row ``t`` is the request's
    source position ``s = (seq_starts[q] or 0) + t - ws[q]``, in block
    ``b = block_table[q, s // B]`` at offset ``s % B`` (B = ``src_cache``'s block size). A row
    covered by two requests gets the later request's. Without host rows the source is
    ``src_cache[b, s % B]``. With them (the prefill staging path) ``b`` is a staged block and
    ``i = b * B + s % B`` indexes ``device_row_ids`` / ``host_row_ids``: a device row in
    range is read from ``src_cache`` (flat rows ``[blocks * B]``), else the host row from
    ``host_cache``. A position, block or row out of range writes zeros (never another row's
    bytes). Rows outside every request are left as they were.
    """
    T, batch, B, cache_rows, host_rows, num_mapped = check_upconvert(
        src_cache, dst, block_table, workspace_starts, batch_size, seq_starts, host_cache,
        host_row_ids, device_row_ids)
    if T == 0 or batch == 0:
        return
    device = dst.device
    starts = workspace_starts.reshape(-1)[:batch].to(_I64).clamp(max=T).tolist()
    owner = torch.full((T,), -1, dtype=_I64, device=device)
    for q in range(batch):  # request q: rows [ws[q], ws[q + 1]) clipped to [0, T)
        lo, hi = max(starts[q], 0), starts[q + 1] if q + 1 < batch else T
        if hi > lo:
            owner[lo:hi] = q
    t = torch.nonzero(owner >= 0).flatten()
    if t.numel() == 0:
        return
    q = owner[t]
    first = torch.tensor(starts, dtype=_I64, device=device)[q]
    base = seq_starts.reshape(-1)[:batch].to(_I64)[q] if seq_starts is not None else 0
    s = base + t - first
    page = torch.where(s >= 0, torch.div(s, B, rounding_mode="floor"), -1)
    ok = (s >= 0) & (page < block_table.shape[1])
    block = _lookup(block_table, q, page, ok)
    offset = s % B
    src = src_cache.view(torch.uint8)
    rows = torch.zeros((t.numel(), 656), dtype=torch.uint8, device=device)
    if host_row_ids is None:
        dev_row = torch.where(ok & (block >= 0) & (block * B < cache_rows), block * B + offset,
                              -1)
        host_row = torch.full_like(dev_row, -1)
    else:
        mapped = torch.where(ok & (block >= 0), block * B + offset, -1)
        have = (mapped >= 0) & (mapped < num_mapped)
        at = torch.where(have, mapped, 0)
        flat_host = host_row_ids.reshape(-1).to(_I64)
        host_row = torch.where(have, flat_host[at] if num_mapped else at, -1)
        dev_row = torch.full_like(host_row, -1)
        if device_row_ids is not None:
            dev_row = torch.where(have, device_row_ids.reshape(-1).to(_I64)[at]
                                  if num_mapped else at, -1)
        dev_row = torch.where((dev_row >= 0) & (dev_row < cache_rows), dev_row, -1)
        host_row = torch.where((dev_row < 0) & (host_row >= 0) & (host_row < host_rows),
                               host_row, -1)
    on_dev = dev_row >= 0
    if bool(on_dev.any()):
        d = dev_row[on_dev]
        rows[on_dev] = src[torch.div(d, B, rounding_mode="floor"), d % B]
    on_host = host_row >= 0
    if bool(on_host.any()):
        host_bytes = host_cache.view(torch.uint8)
        rows[on_host] = host_bytes[host_row[on_host].to(host_bytes.device)].to(device)
    out = upconvert_fp8_rows(rows)
    out[~(on_dev | on_host)] = 0
    dst.view(torch.int16)[t] = out
