"""Pure-torch ``resolve``: the bit-exact definition the Triton kernel must match.

``resolve`` is the specification of ``hisparse_triton.kernels.resolve`` (which must match it
bit for bit, outputs and state) and the op's torch backend; it works on any device. Ids are
int32, address arithmetic int64; nothing here reads or writes outside the state tensors,
whatever their values say. Argument rules and the result type: ``contract``.
"""

from __future__ import annotations

from typing import Optional

import torch

from hisparse_triton.ops.resolve.contract import ResolveResult, check_resolve_args
from hisparse_triton.ops.resolve.workspace import ResolveWorkspace

__all__ = ["ResolveResult", "classify_columns", "emit_result", "first_occurrences",
           "lru_replacement", "resolve"]

#: Sort key base of columns that do not go to the host path (sorts after every host key).
_RESOLVE_KEY_SENTINEL = 1 << 62


def first_occurrences(state_rows: torch.Tensor, num_states: int) -> torch.Tensor:
    """``[R] bool``: batch rows that resolve. A row is resolved when its state row is in
    ``[0, num_states)`` and no earlier batch row names the same state row (a state row named
    twice is resolved by its first batch row; the later ones are padding)."""
    st = state_rows.to(torch.int64)
    ok = (st >= 0) & (st < num_states)
    R = st.numel()
    if R < 2:
        return ok
    _, inverse = torch.unique(st, return_inverse=True)
    index = torch.arange(R, device=st.device)
    first = torch.full((R,), R, dtype=torch.int64, device=st.device).scatter_reduce(
        0, inverse, index, reduce="amin", include_self=True)
    return ok & (first[inverse] == index)


def classify_columns(topk: torch.Tensor, stc: torch.Tensor, row_ok: torch.Tensor,
                     seq_lens: torch.Tensor, resident_blocks: torch.Tensor,
                     host_blocks: torch.Tensor, *, block_size: int, num_device_blocks: int,
                     num_host_blocks: int) -> tuple[torch.Tensor, ...]:
    """Rules 1-3 of ``resolve`` for every column of ``topk [R, K]`` whose batch row reads
    state row ``stc [R]`` (int64; only rows with ``row_ok [R]`` count): ``(resident,
    host, device_row, host_row)``, ``[R, K]`` each: the columns served from a resident
    block and their device rows, the columns on the host path (a valid host block, no
    resident one) and their host rows (int64; meaningless outside their mask). Every other
    column is masked."""
    i64 = torch.int64
    R, K = topk.shape
    S, P = resident_blocks.shape
    B = block_size
    pos = topk.to(i64)
    posc = pos.clamp(min=0)
    page = posc // B
    off = posc - page * B
    if S > 0 and P > 0:
        seq = seq_lens.to(i64)[stc]
        inr = row_ok[:, None] & (pos >= 0) & (pos < seq[:, None]) & (page < P)
        pagec = torch.where(inr, page, 0)
        srow = stc[:, None].expand(R, K)
        rb = resident_blocks[srow, pagec].to(i64)
        hb = host_blocks[srow, pagec].to(i64)
    else:
        inr = torch.zeros(R, K, dtype=torch.bool, device=topk.device)
        rb = hb = torch.zeros(R, K, dtype=i64, device=topk.device)
    res = inr & (rb >= 1) & (rb < num_device_blocks)
    hok = inr & ~res & (hb >= 1) & (hb < num_host_blocks)
    return res, hok, rb * B + off, hb * B + off


def emit_result(result: ResolveResult, touched: torch.Tensor, slot_host_rows: torch.Tensor,
                lru: torch.Tensor, H: int,
                counters: Optional[torch.Tensor], out: Optional[torch.Tensor],
                workspace: Optional[ResolveWorkspace]) -> ResolveResult:
    """Put a computed result where the caller asked for it (``out``, the workspace) and add its
    totals to ``counters``. ``slot_host_rows`` / ``lru``: the pre-call state rows ``[R, H]`` of
    the batch rows (snapshots for ``restore_resolve_state``)."""
    rows = result.rows
    if workspace is not None:
        R, K = rows.shape
        bufs = workspace.buffers(R, K, H)
        for name in ("miss_src", "miss_dst", "miss_count", "stats"):
            getattr(bufs, name).copy_(getattr(result, name))
        bufs.touched.copy_(touched)
        bufs.old_slot_rows.copy_(slot_host_rows)
        bufs.old_lru.copy_(lru)
        workspace.last = bufs
        if out is None:
            bufs.rows.copy_(rows)
            rows = bufs.rows
        result = ResolveResult(rows, bufs.miss_src, bufs.miss_dst, bufs.miss_count, bufs.stats)
    if out is not None:
        out.copy_(rows)
        result = result._replace(rows=out)
    if counters is not None:
        counters += result.stats.sum(0)
    return result


def _padding_resolve_result(R: int, K: int, device: torch.device) -> ResolveResult:
    """The outputs of ``R`` padding rows: -1 everywhere, zero counts."""
    i32 = torch.int32
    return ResolveResult(
        torch.full((R, K), -1, dtype=i32, device=device),
        torch.full((R, K), -1, dtype=i32, device=device),
        torch.full((R, K), -1, dtype=i32, device=device),
        torch.zeros(R, dtype=i32, device=device),
        torch.zeros(R, 3, dtype=i32, device=device),
    )


def lru_replacement(evict: torch.Tensor, serving: torch.Tensor, n_fill: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The replacement policy (LRU), the torch twin of ``kernels/resolve_policy.py``'s
    ``_lru_replacement``. Per row, in old LRU order: ``evict [R, H] bool`` (valid positions
    serving no hit), ``serving [R, H] bool`` (positions serving a hit; the rest are invalid
    entries), ``n_fill [R, 1]`` (misses that get a slot, ``<= evict.sum(1)``). Returns
    ``(new_pos, filled, erank)`` ``[R, H]``: each position's new LRU index (unused evictable
    slots in old order, then filled slots in miss order, serving slots in old order, invalid
    entries in old order), whether it takes a miss (the ``n_fill`` oldest evictable ones) and
    its evictable rank (the miss number it takes)."""
    invalid = ~(evict | serving)
    n_evict = evict.sum(1, keepdim=True)
    n_serving = serving.sum(1, keepdim=True)
    erank = evict.cumsum(1) - 1
    filled = evict & (erank < n_fill)
    new_pos = torch.where(
        evict, torch.where(filled, n_evict - n_fill + erank, erank - n_fill),
        torch.where(serving, n_evict + serving.cumsum(1) - 1,
                    n_evict + n_serving + invalid.cumsum(1) - 1))
    return new_pos, filled, erank


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
    """Resolve top-k positions of one index group into device rows; update the hot state.

    Shapes (``R`` batch rows, ``K`` columns, ``S`` state rows, ``P`` pages per request,
    ``HB`` hot blocks per request, ``H`` hot slots per request, ``HB * block_size >= H >= K``,
    ``K <= MAX_RESOLVE_WIDTH`` = 32768):
    - ``topk``: ``[R, K]`` token positions, any integer dtype (``TOPK_DTYPES``) and strides;
      any value: invalid ones (negative, ``>= seq_len``, beyond int32) output -1.
    - ``state_rows``: ``[R] int32`` state row of each batch row; -1 = padding row. A state
      row named by several batch rows is resolved by the first of them only; the later ones
      are padding rows.
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

    Optional (keyword) arguments, identical on every backend:
    - ``counters``: ``[3] int64`` on ``topk``'s device; the call adds its totals of ``stats``
      (hits, misses, masked summed over the rows) to it.
    - ``out``: ``[R, K] int32``: written with ``rows`` and returned as ``result.rows`` (a
      caller-owned buffer, e.g. one per index group).
    - ``workspace``: a ``ResolveWorkspace`` on ``topk``'s device. The plan (``miss_src``,
      ``miss_dst``, ``miss_count``, ``stats``; and ``rows`` without ``out``) is written into
      it and returned as views of it, valid until the next call with the same workspace; the
      pre-call ``slot_host_rows`` / ``lru`` of every resolved batch row are kept in it, so that
      ``restore_resolve_state`` can undo the call.

    Semantics per column (``B = block_size``, ``st = state_rows[r]``):
    1. ``pos < 0``, ``pos >= seq_lens[st]`` or page ``pos // B >= P`` -> -1 (masked).
    2. ``resident_blocks[st, pos // B]`` in ``[1, num_device_blocks)`` -> device row
       ``block * B + pos % B`` (hit).
    3. else ``g = host_blocks[st, pos // B] * B + pos % B``; a host block outside
       ``[1, num_host_blocks)`` (0 = null) -> -1 (masked). A hot slot holding ``g`` -> hit,
       output that slot's device row.
    4. else miss: distinct misses, numbered in column order of first occurrence, take the
       evictable slots (every slot not hit this step) in LRU order, oldest first; duplicate
       columns share their first occurrence's slot (and count as hits).
    5. new LRU order = unused evictable slots (old order) + filled slots (miss order) + hit
       slots (old LRU order) [+ invalid LRU entries, see below]. A row with no hit slot and no
       filled slot (every column resident or masked) leaves its LRU untouched. Filled slots'
       ``slot_host_rows`` become their host row. Padding rows output -1, count zeros and touch
       no state.

    Outputs (see ``ResolveResult``): ``miss_src[r, m]`` / ``miss_dst[r, m]`` are the host row and
    the filled slot's device row of miss ``m < miss_count[r]``. ``stats[r] = (hits, misses,
    masked)``: ``masked`` = columns whose output is -1; ``misses`` = plan entries whose
    ``miss_dst`` is not -1 (distinct host rows actually gathered); ``hits`` = the rest (resident
    columns, hot-slot hits, duplicates of a miss column), so the three sum to ``K``.

    Corrupted input never makes this (or the kernel) read or write out of range; it resolves
    deterministically as follows (the kernel matches bit for bit):
    - a ``state_rows`` entry outside ``[0, S)`` is a padding row;
    - LRU position ``p`` is *valid* when ``lru[st, p]`` is in ``[0, H)`` and no earlier
      position names the same slot. Only slots named by a valid position take part (a slot
      missing from ``lru`` is never hit and never filled); invalid positions are neither hit
      nor evictable and move, raw values unchanged and in old order, to the end of the new LRU;
    - a slot whose ``slot_host_rows`` entry is outside ``[0, num_host_blocks * B)`` is empty;
      when several valid slots hold the same host row, the one at the earliest LRU position
      serves it and the others count as empty (evictable);
    - misses beyond the number of evictable slots (only possible with a corrupted ``lru``)
      output -1, count as masked and are left out of the plan;
    - a hot block outside ``[1, num_device_blocks)`` gives its slots device row -1: columns
      they serve output -1 (masked) and their plan entries have ``miss_dst == -1`` (counted in
      ``miss_count``, not in ``stats`` misses; a gather skips them).
    Shapes, dtypes and devices are validated (``ValueError`` / ``TypeError``) before any state
    is touched; validation never reads tensor values (this torch version does synchronise
    once, for the state write-back, when run on a GPU; the Triton kernel never does).
    """
    R, K, S, P, _, H = check_resolve_args(
        topk, state_rows, seq_lens, resident_blocks, host_blocks, hot_blocks, slot_host_rows,
        lru, block_size, num_device_blocks, num_host_blocks, counters, out, workspace)
    dev = topk.device
    B = block_size
    i64 = torch.int64
    if R == 0 or S == 0:
        empty = torch.zeros(R, H, dtype=torch.int32, device=dev)
        return emit_result(_padding_resolve_result(R, K, dev), torch.zeros(R, dtype=torch.int32,
                     device=dev), empty, empty, H, counters, out, workspace)

    st = state_rows.to(i64)
    row_ok = first_occurrences(state_rows, S)
    stc = torch.where(row_ok, st, 0)
    col = torch.arange(K, device=dev)
    slot_ids = torch.arange(H, device=dev)

    # Columns: masked / resident / host row g (rules 1-3).
    res, hok, device_row, g = classify_columns(
        topk, stc, row_ok, seq_lens, resident_blocks, host_blocks, block_size=B,
        num_device_blocks=num_device_blocks, num_host_blocks=num_host_blocks)
    rows = torch.where(res, device_row, -1)

    # Host columns sorted by (g, column): equal host rows form runs, first = first occurrence.
    skey, perm = torch.sort(torch.where(hok, g * K + col, _RESOLVE_KEY_SENTINEL + col), dim=1)
    sg = skey // K
    run_start = torch.ones_like(hok)
    run_start[:, 1:] = sg[:, 1:] != sg[:, :-1]
    # crun[r, c]: sorted index where column c's run (its host row's first occurrence) starts.
    crun = torch.empty_like(perm).scatter_(
        1, perm, torch.where(run_start, col, 0).cummax(1).values)

    # Slots in LRU order: valid positions, held host rows, serving positions.
    lru_raw = lru[stc]
    held_raw = slot_host_rows[stc]
    lr = lru_raw.to(i64)
    sv = row_ok[:, None] & (lr >= 0) & (lr < H)
    lrc = torch.where(sv, lr, 0)
    owner = torch.full((R, H), H, dtype=i64, device=dev).scatter_reduce(
        1, lrc, torch.where(sv, slot_ids, H), reduce="amin", include_self=True)
    valid = sv & (owner.gather(1, lrc) == slot_ids)
    held = held_raw.to(i64).gather(1, lrc)
    held_ok = valid & (held >= 0) & (held < num_host_blocks * B)
    run = torch.searchsorted(skey, torch.where(held_ok, held * K, 0)).clamp(max=K - 1)
    found = held_ok & (sg.gather(1, run) == held)
    run_pos = torch.full((R, K), H, dtype=i64, device=dev).scatter_reduce(
        1, run, torch.where(found, slot_ids, H), reduce="amin", include_self=True)
    serving = found & (run_pos.gather(1, run) == slot_ids)

    # Device row of every slot (-1 for a bad hot block).
    hot = hot_blocks[stc][:, slot_ids // B].to(i64)
    slot_dev = torch.where((hot >= 1) & (hot < num_device_blocks), hot * B + slot_ids % B, -1)

    # Columns: hit (a serving slot holds g) or miss; misses numbered in column order.
    srv_pos = run_pos.gather(1, crun)
    hit = hok & (srv_pos < H)
    hit_rows = slot_dev.gather(1, lrc.gather(1, srv_pos.clamp(max=H - 1)))
    first_col = skey.gather(1, crun) % K
    miss = hok & ~hit
    first_miss = miss & (first_col == col)
    miss_num = torch.cumsum(first_miss, 1) - 1
    col_miss_num = miss_num.gather(1, first_col)
    n_miss = first_miss.sum(1, keepdim=True)

    # LRU: evictables in old order take the misses; rewrite the order (rule 5).
    evict = valid & ~serving
    n_evict = evict.sum(1, keepdim=True)
    n_serving = serving.sum(1, keepdim=True)
    n_fill = torch.minimum(n_miss, n_evict)
    new_pos, filled, erank = lru_replacement(evict, serving, n_fill)
    new_lru = torch.empty_like(lru_raw).scatter_(1, new_pos, lru_raw)
    active = row_ok & ((n_serving + n_fill).squeeze(1) > 0)

    # The plan (column K of the scratch catches the entries that are not written).
    miss_src = torch.full((R, K + 1), -1, dtype=i64, device=dev).scatter_(
        1, torch.where(first_miss & (miss_num < n_fill), miss_num, K), g)[:, :K]
    miss_dst = torch.full((R, K + 1), -1, dtype=i64, device=dev).scatter_(
        1, torch.where(filled, erank, K), slot_dev.gather(1, lrc))[:, :K]
    miss_rows = torch.where(col_miss_num < n_fill,
                            miss_dst.gather(1, col_miss_num.clamp(0, K - 1)), -1)
    rows = torch.where(hit, hit_rows, torch.where(miss, miss_rows, rows))

    masked = (rows == -1).sum(1)
    misses = (miss_dst != -1).sum(1)
    stats = torch.stack([K - masked - misses, misses, masked], dim=1)
    stats = torch.where(row_ok[:, None], stats, 0)
    miss_count = torch.where(row_ok, n_fill.squeeze(1), 0)

    # State, in place (validated above; rows of padding batch rows are never written).
    fill_val = miss_src.gather(1, erank.clamp(0, K - 1))
    new_held = torch.cat([held_raw, torch.zeros(R, 1, dtype=torch.int32, device=dev)], 1)
    new_held = new_held.scatter_(1, torch.where(filled, lrc, H), fill_val.to(torch.int32))[:, :H]
    upd = torch.nonzero(row_ok).squeeze(1)
    slot_host_rows[st[upd]] = new_held[upd]
    upd = torch.nonzero(active).squeeze(1)
    lru[st[upd]] = new_lru[upd]

    i32 = torch.int32
    result = ResolveResult(rows.to(i32), miss_src.to(i32), miss_dst.to(i32),
                           miss_count.to(i32), stats.to(i32))
    return emit_result(result, row_ok.to(i32), held_raw, lru_raw, H, counters, out, workspace)
