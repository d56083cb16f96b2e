"""The sorted resolve kernel (every width up to 32,768): ONE Triton launch, one program per row.

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
On AMD GPUs (gfx90a / gfx942 / gfx950) ``tl.debug_barrier()`` is a bare ``s_barrier``: the
hand-offs are then ordered by the workgroup memory model in non-threadgroup-split mode (the
waves share one CU's vector L1; LLVM lowers HIP's ``__syncthreads()`` to the same code), and a
threadgroup-split target is refused (``kernels/launch_config.py``). docs/kernels.md, "Memory
model", states the argument per hand-off for both vendors; no hint carries exactness (the hash
kernel, ``kernels/resolve_hash.py``, hands off the same way).

Safety: every access is masked to in-range indices computed in int64 (state rows outside
``[0, S)`` -> padding; pages ``< P``; slots ``< H``; new LRU positions are a bijection onto
``[0, H)`` and masked anyway). The launcher validates shapes, dtypes and devices only; it
never reads tensor values, so it is CUDA-graph capturable (with a workspace, a repeated call
allocates nothing).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hisparse_triton.kernels.masks import _lanes
from hisparse_triton.kernels.resolve_policy import _lru_replacement

_I32_MAX = 2**31 - 1
_SENTINEL64 = 1 << 62
# The same constants as seen inside @triton.jit bodies (jit globals must be tl.constexpr).
_I32_MAX_K = tl.constexpr(_I32_MAX)
_SENTINEL64_K = tl.constexpr(_SENTINEL64)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _key_at(tile, keys_row, idx, IN_REGS: tl.constexpr):
    """Sorted key number ``idx`` of the row: from the register tile that holds all of them,
    or from the row's key scratch."""
    if IN_REGS:
        return tl.gather(tile, idx, 0)
    else:
        return tl.load(keys_row + idx)


@triton.jit
def _lower_bound(tile, keys_row, target, N: tl.constexpr, LOG2_N: tl.constexpr,
                 IN_REGS: tl.constexpr):
    """For each ``target``: the index in ``[0, N)`` of the first of ``N`` sorted keys that is
    ``>= target``, or ``N - 1`` when every key is smaller (callers check the key there)."""
    lo = tl.zeros_like(target).to(tl.int32)
    for i in tl.static_range(LOG2_N):
        step = (N // 2) >> i
        probe = _key_at(tile, keys_row, lo + (step - 1), IN_REGS)
        lo = tl.where(probe < target, lo + step, lo)
    return lo


@triton.jit
def _slot_device_row(hot_row, stride_hot_b, slot, mask, num_device_blocks,
                     BLOCK_SIZE: tl.constexpr):
    """Device row (int64) of hot slot ``slot`` of the row's hot region; -1 for a bad block."""
    slot64 = tl.where(mask, slot, 0).to(tl.int64)
    blk = tl.load(hot_row + (slot64 // BLOCK_SIZE) * stride_hot_b, mask=mask, other=0)
    blk = blk.to(tl.int64)
    ok = mask & (blk >= 1) & (blk < num_device_blocks)
    return tl.where(ok, blk * BLOCK_SIZE + slot64 % BLOCK_SIZE, -1)


@triton.jit
def _sorted_tile(tile, keys_row, run_pos_row, j0, carry, KEY64: tl.constexpr,
                 LOG2_K: tl.constexpr, BLOCK_K: tl.constexpr, SORT: tl.constexpr,
                 IN_REGS: tl.constexpr):
    """Sorted keys ``j0 .. j0 + SORT`` of the row: host path?, host row, column, first of its
    run?, sorted index where its run starts (``carry``: the run open at ``j0``), the run's
    serving LRU position (``INT32_MAX`` = none: a miss) and the carry for the next tile."""
    j = j0 + tl.arange(0, SORT)
    if IN_REGS:
        key = tile
    else:
        key = tl.load(keys_row + j)
    if KEY64:
        host = key < _SENTINEL64_K
    else:
        host = key < 2147483648 - BLOCK_K
    g = key >> LOG2_K
    col = (key & (BLOCK_K - 1)).to(tl.int32)
    prev = _key_at(tile, keys_row, tl.maximum(j - 1, 0), IN_REGS)
    start = host & ((j == 0) | ((prev >> LOG2_K) != g))
    run_at = tl.associative_scan(tl.where(start, j, -1), 0, _max_combine)
    run_at = tl.maximum(tl.maximum(run_at, carry), 0)
    srv = tl.load(run_pos_row + run_at, mask=host, other=_I32_MAX_K, cache_modifier=".cg")
    return host, g, col, start, run_at, srv, tl.max(run_at, axis=0)


@triton.jit
def _column_keys(topk_row, stride_tk_c, rows_row, stride_out_c, res_row, stride_res_p,
                 host_row, stride_host_p, seq, c0, K, P, num_device_blocks, num_host_blocks,
                 BLOCK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, SORT: tl.constexpr,
                 KEY64: tl.constexpr):
    """Columns ``c0 .. c0 + SORT``: write the rows of masked and resident columns, return
    their sort keys, sorted."""
    c = c0 + tl.arange(0, SORT)
    cm = c < K
    c64 = c.to(tl.int64)
    pos = tl.load(topk_row + c64 * stride_tk_c, mask=cm, other=-1).to(tl.int64)
    posc = tl.maximum(pos, 0)
    page = posc // BLOCK_SIZE
    off = posc % BLOCK_SIZE
    inr = cm & (pos >= 0) & (pos < seq) & (page < P)
    rb = tl.load(res_row + page * stride_res_p, mask=inr, other=0).to(tl.int64)
    res = inr & (rb >= 1) & (rb < num_device_blocks)
    hb = tl.load(host_row + page * stride_host_p, mask=inr & ~res, other=0).to(tl.int64)
    hok = inr & ~res & (hb >= 1) & (hb < num_host_blocks)
    tl.store(rows_row + c64 * stride_out_c, tl.where(res, rb * BLOCK_SIZE + off, -1).to(tl.int32),
             mask=cm)
    g = hb * BLOCK_SIZE + off
    if KEY64:
        key = tl.where(hok, g * BLOCK_K + c64, c64 + _SENTINEL64_K)
    else:
        key = tl.where(hok, (g * BLOCK_K + c64).to(tl.int32), c + (2147483648 - BLOCK_K))
    return tl.sort(key)


@triton.jit
def _first_of_state(state_rows_ptr, stride_sr, r, st, S, BLOCK_R: tl.constexpr):
    """Phase 0: whether batch row ``r`` resolves its state row ``st`` (in ``[0, S)`` and named
    by no earlier batch row; otherwise the row is padding)."""
    n_same = r * 0
    for r0 in range(0, r, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        prev = tl.load(state_rows_ptr + rr.to(tl.int64) * stride_sr, mask=rr < r, other=-1)
        n_same += tl.sum(((prev == st) & (rr < r)).to(tl.int32), axis=0)
    return (st >= 0) & (st < S) & (n_same == 0)


@triton.jit
def _padding_row(r64, rows_row, stride_out_c, miss_src_ptr, miss_dst_ptr, miss_count_ptr,
                 stats_ptr, touched_ptr, plan, K, SORT: tl.constexpr):
    """A padding row (or a repeated state row): -1 everywhere, zero counts, no state."""
    neg = tl.full([SORT], -1, tl.int32)
    for c0 in range(0, K, SORT):
        c = c0 + tl.arange(0, SORT)
        cm = c < K
        tl.store(rows_row + c.to(tl.int64) * stride_out_c, neg, mask=cm)
        tl.store(miss_src_ptr + plan + c, neg, mask=cm)
        tl.store(miss_dst_ptr + plan + c, neg, mask=cm)
    tl.store(stats_ptr + r64 * 3, 0)
    tl.store(stats_ptr + r64 * 3 + 1, 0)
    tl.store(stats_ptr + r64 * 3 + 2, 0)
    tl.store(miss_count_ptr + r64, 0)
    tl.store(touched_ptr + r64, 0)


@triton.jit
def _sorted_row(
    r, r64, st, rows_row, plan,
    topk_ptr, state_rows_ptr, seq_lens_ptr, resident_ptr, host_ptr, hot_ptr, slot_rows_ptr,
    lru_ptr,
    rows_ptr, miss_src_ptr, miss_dst_ptr, miss_count_ptr, stats_ptr,
    touched_ptr, old_rows_ptr, old_lru_ptr, owner_ptr, cls_ptr, run_pos_ptr, colbuf_ptr,
    colm_ptr, keys_ptr, keys2_ptr, counters_ptr,
    K, S, P, H,
    stride_tk_r, stride_tk_c, stride_sr, stride_seq, stride_res_s, stride_res_p,
    stride_host_s, stride_host_p, stride_hot_s, stride_hot_b, stride_shr_s, stride_shr_h,
    stride_lru_s, stride_lru_h, stride_out_r, stride_out_c, stride_cnt,
    num_device_blocks, num_host_blocks,
    BLOCK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, LOG2_K: tl.constexpr,
    SORT: tl.constexpr, LOG2_SORT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
    KEY64: tl.constexpr, HAS_COUNTERS: tl.constexpr, IN_REGS: tl.constexpr,
):
    """The sorted path of one batch row (phases 1-6 of the module docstring) whose
    state row ``st`` is in range and named first by this row (``r``)."""
    st64 = st.to(tl.int64)
    lru_row = lru_ptr + st64 * stride_lru_s
    shr_row = slot_rows_ptr + st64 * stride_shr_s
    hot_row = hot_ptr + st64 * stride_hot_s
    scr_k = r64 * BLOCK_K
    scr_h = r64 * H
    num_host_rows = tl.cast(num_host_blocks, tl.int64) * BLOCK_SIZE

    # Phase 1: classify columns, sort keys (register tile, or tiles merged in scratch).
    seq = tl.load(seq_lens_ptr + st64 * stride_seq).to(tl.int64)
    topk_row = topk_ptr + r64 * stride_tk_r
    res_row = resident_ptr + st64 * stride_res_s
    host_row = host_ptr + st64 * stride_host_s
    keys_row = keys_ptr + scr_k
    jt = tl.arange(0, SORT)
    if IN_REGS:
        tile = _column_keys(topk_row, stride_tk_c, rows_row, stride_out_c, res_row,
                            stride_res_p, host_row, stride_host_p, seq, 0, K, P,
                            num_device_blocks, num_host_blocks, BLOCK_SIZE, BLOCK_K, SORT,
                            KEY64)
        tl.store(run_pos_ptr + scr_k + jt, tl.full([SORT], _I32_MAX_K, tl.int32))
    else:
        for c0 in range(0, BLOCK_K, SORT):
            key = _column_keys(topk_row, stride_tk_c, rows_row, stride_out_c, res_row,
                               stride_res_p, host_row, stride_host_p, seq, c0, K, P,
                               num_device_blocks, num_host_blocks, BLOCK_SIZE, BLOCK_K,
                               SORT, KEY64)
            tl.store(keys_row + c0 + jt, key)
            tl.store(run_pos_ptr + scr_k + c0 + jt, tl.full([SORT], _I32_MAX_K, tl.int32))
        if KEY64:  # placeholder: only the register path reads the tile
            tile = tl.zeros([SORT], tl.int64)
        else:
            tile = tl.zeros([SORT], tl.int32)
        src_row = keys_row
        dst_row = keys2_ptr + scr_k
        for lvl in tl.static_range(LOG2_K - LOG2_SORT):  # merge runs of SORT << lvl keys
            tl.debug_barrier()
            for i0 in range(0, BLOCK_K, SORT):
                i = i0 + jt
                key = tl.load(src_row + i)
                run = i >> (LOG2_SORT + lvl)
                partner = src_row + (run ^ 1) * (SORT << lvl)
                lo = _lower_bound(tile, partner, key, SORT << lvl, LOG2_SORT + lvl, False)
                rank = lo + (tl.load(partner + lo) < key).to(tl.int32)
                dest = (run >> 1) * (SORT << (lvl + 1)) + (i & ((SORT << lvl) - 1)) + rank
                tl.store(dst_row + dest, key)
            src_row, dst_row = dst_row, src_row
        keys_row = src_row

    # Phase 2: snapshot the row's state, reset slot owners, then claim them.
    tl.store(touched_ptr + r64, 1)
    for h0 in range(0, H, BLOCK_H):
        p = h0 + tl.arange(0, BLOCK_H)
        pm = p < H
        p64 = p.to(tl.int64)
        tl.store(old_lru_ptr + scr_h + p64, tl.load(lru_row + p64 * stride_lru_h, mask=pm),
                 mask=pm)
        tl.store(old_rows_ptr + scr_h + p64, tl.load(shr_row + p64 * stride_shr_h, mask=pm),
                 mask=pm)
        tl.store(owner_ptr + scr_h + p64, tl.full([BLOCK_H], _I32_MAX_K, tl.int32), mask=pm)
    tl.debug_barrier()
    for h0 in range(0, H, BLOCK_H):
        p = h0 + tl.arange(0, BLOCK_H)
        pm = p < H
        slot = tl.load(old_lru_ptr + scr_h + p, mask=pm, other=-1)
        sv = pm & (slot >= 0) & (slot < H)
        tl.atomic_min(owner_ptr + scr_h + tl.where(sv, slot, 0), p, mask=sv, sem="relaxed")
    tl.debug_barrier()

    # Phase 3: valid positions search their held host row among the sorted keys.
    n_valid = r * 0
    for h0 in range(0, H, BLOCK_H):
        p = h0 + tl.arange(0, BLOCK_H)
        pm = p < H
        slot = tl.load(old_lru_ptr + scr_h + p, mask=pm, other=-1)
        sv = pm & (slot >= 0) & (slot < H)
        slot_c = tl.where(sv, slot, 0)
        first = tl.load(owner_ptr + scr_h + slot_c, mask=sv, other=-1, cache_modifier=".cg")
        valid = sv & (first == p)
        n_valid += tl.sum(valid.to(tl.int32), axis=0)
        held = tl.load(old_rows_ptr + scr_h + slot_c, mask=valid, other=-1).to(tl.int64)
        hv = valid & (held >= 0) & (held < num_host_rows)
        if KEY64:
            target = tl.where(hv, held, 0) * BLOCK_K
        else:
            target = (tl.where(hv, held, 0) * BLOCK_K).to(tl.int32)
        lo = _lower_bound(tile, keys_row, target, BLOCK_K, LOG2_K, IN_REGS)
        found = hv & ((_key_at(tile, keys_row, lo, IN_REGS) >> LOG2_K) == held)
        tl.atomic_min(run_pos_ptr + scr_k + lo, p, mask=found, sem="relaxed")
        tl.store(cls_ptr + scr_h + p, tl.where(valid, 0, 2), mask=pm)
    tl.debug_barrier()

    # Phase 4a: hit runs write their columns' rows and mark their serving position;
    # first columns of missed runs are flagged in column order.
    n_serving = r * 0
    carry = r * 0 - 1
    for j0 in range(0, BLOCK_K, SORT):
        host, g, col, start, run_at, srv, carry = _sorted_tile(
            tile, keys_row, run_pos_ptr + scr_k, j0, carry, KEY64, LOG2_K, BLOCK_K, SORT,
            IN_REGS)
        hit = host & (srv != _I32_MAX_K)
        n_serving += tl.sum((start & hit).to(tl.int32), axis=0)
        srv_c = tl.where(hit, srv, 0)
        tl.store(cls_ptr + scr_h + srv_c, tl.full([SORT], 1, tl.int32), mask=start & hit)
        srv_slot = tl.load(old_lru_ptr + scr_h + srv_c, mask=hit, other=-1)
        dev = _slot_device_row(hot_row, stride_hot_b, srv_slot, hit, num_device_blocks,
                               BLOCK_SIZE)
        tl.store(rows_row + col.to(tl.int64) * stride_out_c, dev.to(tl.int32), mask=hit)
        tl.store(colbuf_ptr + scr_k + col, (start & ~hit).to(tl.int32))
    tl.debug_barrier()
    # Phase 4b: number the missed runs in column order of their first column.
    n_miss = r * 0
    for c0 in range(0, BLOCK_K, SORT):
        c = c0 + jt
        flag = tl.load(colbuf_ptr + scr_k + c)
        num = n_miss + tl.cumsum(flag, axis=0) - 1
        n_miss += tl.sum(flag, axis=0)
        tl.store(colbuf_ptr + scr_k + c, tl.where(flag != 0, num, -1))
    tl.debug_barrier()
    # Phase 4c: the plan's host rows, and each miss column's miss number.
    carry = r * 0 - 1
    for j0 in range(0, BLOCK_K, SORT):
        host, g, col, start, run_at, srv, carry = _sorted_tile(
            tile, keys_row, run_pos_ptr + scr_k, j0, carry, KEY64, LOG2_K, BLOCK_K, SORT,
            IN_REGS)
        miss = host & (srv == _I32_MAX_K)
        first_col = (_key_at(tile, keys_row, run_at, IN_REGS) & (BLOCK_K - 1)).to(tl.int32)
        m = tl.load(colbuf_ptr + scr_k + first_col, mask=miss, other=-1)
        tl.store(miss_src_ptr + plan + m, g.to(tl.int32), mask=miss & start)
        tl.store(colm_ptr + scr_k + col, tl.where(miss, m, -1))
    tl.debug_barrier()

    # Phase 5: new LRU order (one scatter) and the fills of the evictable slots.
    n_evict = n_valid - n_serving
    n_fill = tl.minimum(n_miss, n_evict)
    active = (n_serving + n_fill) > 0
    ev_carry = r * 0
    hit_carry = r * 0
    for h0 in range(0, H, BLOCK_H):
        p = h0 + tl.arange(0, BLOCK_H)
        pm = p < H
        cls = tl.load(cls_ptr + scr_h + p, mask=pm, other=3)
        slot = tl.load(old_lru_ptr + scr_h + p, mask=pm, other=-1)
        new_pos, filled, erank, ev_carry, hit_carry = _lru_replacement(
            cls, p, n_evict, n_serving, n_fill, ev_carry, hit_carry, True)
        ok = pm & _lanes(active, p) & (new_pos >= 0) & (new_pos < H)
        tl.store(lru_row + new_pos.to(tl.int64) * stride_lru_h, slot, mask=ok)
        src = tl.load(miss_src_ptr + plan + erank, mask=filled, other=-1)
        dev = _slot_device_row(hot_row, stride_hot_b, slot, filled, num_device_blocks,
                               BLOCK_SIZE)
        tl.store(miss_dst_ptr + plan + erank, dev.to(tl.int32), mask=filled)
        tl.store(shr_row + tl.where(filled, slot, 0).to(tl.int64) * stride_shr_h, src,
                 mask=filled)
    tl.debug_barrier()

    # Phase 6: miss columns' rows, plan tails, counts.
    n_masked = r * 0
    n_planned = r * 0
    for c0 in range(0, K, SORT):
        c = c0 + jt
        cm = c < K
        c64 = c.to(tl.int64)
        m = tl.load(colm_ptr + scr_k + c, mask=cm, other=-1)
        is_miss = cm & (m >= 0)
        dst = tl.load(miss_dst_ptr + plan + m, mask=is_miss & (m < n_fill), other=-1)
        out = tl.load(rows_row + c64 * stride_out_c, mask=cm & ~is_miss, other=-1)
        out = tl.where(is_miss, dst, out)
        tl.store(rows_row + c64 * stride_out_c, out, mask=is_miss)
        n_masked += tl.sum((cm & (out == -1)).to(tl.int32), axis=0)
        tail = cm & (c >= n_fill)
        tl.store(miss_src_ptr + plan + c, tl.full([SORT], -1, tl.int32), mask=tail)
        tl.store(miss_dst_ptr + plan + c, tl.full([SORT], -1, tl.int32), mask=tail)
        planned = tl.load(miss_dst_ptr + plan + c, mask=cm & (c < n_fill), other=-1)
        n_planned += tl.sum((planned != -1).to(tl.int32), axis=0)
    hits = K - n_masked - n_planned
    tl.store(stats_ptr + r64 * 3, hits)
    tl.store(stats_ptr + r64 * 3 + 1, n_planned)
    tl.store(stats_ptr + r64 * 3 + 2, n_masked)
    tl.store(miss_count_ptr + r64, n_fill)
    if HAS_COUNTERS:
        tl.atomic_add(counters_ptr, hits.to(tl.int64), sem="relaxed")
        tl.atomic_add(counters_ptr + stride_cnt, n_planned.to(tl.int64), sem="relaxed")
        tl.atomic_add(counters_ptr + 2 * stride_cnt, n_masked.to(tl.int64), sem="relaxed")


@triton.jit
def _resolve_kernel(
    topk_ptr, state_rows_ptr, seq_lens_ptr, resident_ptr, host_ptr, hot_ptr, slot_rows_ptr,
    lru_ptr,
    rows_ptr, miss_src_ptr, miss_dst_ptr, miss_count_ptr, stats_ptr,
    touched_ptr, old_rows_ptr, old_lru_ptr, owner_ptr, cls_ptr, run_pos_ptr, colbuf_ptr,
    colm_ptr, keys_ptr, keys2_ptr, counters_ptr, fallback_ptr,
    K, S, P, H,
    stride_tk_r, stride_tk_c, stride_sr, stride_seq, stride_res_s, stride_res_p,
    stride_host_s, stride_host_p, stride_hot_s, stride_hot_b, stride_shr_s, stride_shr_h,
    stride_lru_s, stride_lru_h, stride_out_r, stride_out_c, stride_cnt,
    num_device_blocks, num_host_blocks,
    BLOCK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, LOG2_K: tl.constexpr,
    SORT: tl.constexpr, LOG2_SORT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
    KEY64: tl.constexpr, HAS_COUNTERS: tl.constexpr, IN_REGS: tl.constexpr,
    FLAGGED: tl.constexpr,
):
    r = tl.program_id(0)
    r64 = r.to(tl.int64)
    st = tl.load(state_rows_ptr + r64 * stride_sr)
    rows_row = rows_ptr + r64 * stride_out_r
    plan = r64 * K
    if FLAGGED:  # the hash kernel's fallback launch: only the rows it flagged, nothing else
        row_ok = tl.load(fallback_ptr + r64) != 0
    else:
        row_ok = _first_of_state(state_rows_ptr, stride_sr, r, st, S, BLOCK_R)
    if row_ok:
        _sorted_row(r, r64, st, rows_row, plan, topk_ptr, state_rows_ptr, seq_lens_ptr, resident_ptr, host_ptr, hot_ptr, slot_rows_ptr, lru_ptr, rows_ptr, miss_src_ptr, miss_dst_ptr, miss_count_ptr, stats_ptr, touched_ptr, old_rows_ptr, old_lru_ptr, owner_ptr, cls_ptr, run_pos_ptr, colbuf_ptr, colm_ptr, keys_ptr, keys2_ptr, counters_ptr, K, S, P, H, stride_tk_r, stride_tk_c, stride_sr, stride_seq, stride_res_s, stride_res_p, stride_host_s, stride_host_p, stride_hot_s, stride_hot_b, stride_shr_s, stride_shr_h, stride_lru_s, stride_lru_h, stride_out_r, stride_out_c, stride_cnt, num_device_blocks, num_host_blocks, BLOCK_SIZE, BLOCK_K, LOG2_K, SORT, LOG2_SORT, BLOCK_H, BLOCK_R, KEY64, HAS_COUNTERS, IN_REGS)
    elif not FLAGGED:
        _padding_row(r64, rows_row, stride_out_c, miss_src_ptr, miss_dst_ptr, miss_count_ptr,
                     stats_ptr, touched_ptr, plan, K, SORT)
