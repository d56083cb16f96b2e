"""vLLM 0.33's hot-buffer state ops in vLLM's own form: ``hisparse_resolve_residency`` and
``hisparse_invalidate_written_slots``, one Triton launch each.

Semantics: ``hisparse_triton.integrations.vllm_reference`` (the torch model these kernels
match bit for bit); this module says how the device computes them.

Resolve: grid ``(R,)``, one program per row of ``global_indices``.
0. Every program finds its request (``request_ids[row]``) and state row
   (``request_state_indices[request]``) and scans the earlier rows: the first row of a request
   leads it; a request whose state row an earlier request uses, or whose state row is out of
   range, is padding (each of its rows writes its own -1 / 0); other rows exit (their leader
   writes them). The leader links its request's rows (``next`` scratch) in batch order, so
   rows need not be contiguous.
1. Per row of the request: translate the columns (source table by request, resident table by
   state row), write the resident / masked columns, and sort the keys ``g * W + column`` of
   the host-path columns (``W`` = top-k rounded up to a power of two; other columns get a
   sentinel key): one ``tl.sort`` of up to ``MAX_SORT_WIDTH`` keys, or sorted tiles merged in
   the row's scratch. No host-path column at all: nothing else happens.
2. Per LRU position: the slot's held host row is binary-searched among every request row's
   sorted keys (the union); a hit marks the runs it serves (``atomic_min`` of the position:
   the oldest serves) and the position's class; evictable slots are ranked in LRU order
   (``tl.cumsum``) into a rank-indexed scratch.
3. Per row of the request, in batch order, two walks of its sorted keys: (a) a run's first
   key that no earlier row of the request holds (binary search of the earlier rows) is a
   first reference; a first reference without a hit is a miss, flagged by column; the
   flags are numbered in (row, column) order (``tl.cumsum``, carried across rows); (c) miss
   ``m`` takes the ``m``-th evictable slot, updates ``device_global_indices`` and writes its
   plan entry into column ``m % K`` of the request's ``m // K``-th row; every run's first key
   holds the run's hot row (packed with a served bit; hits and runs of earlier rows were
   stored in (a)), which its other keys take from the tile (``tl.gather``) or carry over.
4. The LRU is rewritten with one scatter (stale evictables, filled slots, hits), swap counts
   and uint64 stats (``atomic_add``) are written.
Phases hand data over through global scratch separated by ``tl.debug_barrier()``; atomically
written tables are read with ``.cg`` loads. Every index is masked into its tensor, in int64.
The scratch is allocated per call from torch's caching allocator (stream-ordered, so calls on
different streams never share it): ``R * (W * (20 | 24) + H * 12) + 4 R`` bytes.

Invalidate: grid ``(tokens, cdiv(region_stride, BLOCK))``; each program compares its token's
written slot with a block of its state row's held host rows and clears the matches.

The launchers check arguments (``vllm_checks``) and read no tensor values: CUDA-graph safe.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from hisparse_triton.integrations.vllm_checks import (
    check_invalidate_written_slots,
    check_resolve_residency,
    checked,
)
from hisparse_triton.kernels.gather import device_guard
from hisparse_triton.kernels.masks import _lanes
from hisparse_triton.kernels.resolve import _lower_bound, _sorted_tile  # noqa: F401 (jit)
from hisparse_triton.ops.resolve.workspace import scratch_width

__all__ = ["MAX_SORT_WIDTH", "hisparse_invalidate_written_slots",
           "hisparse_resolve_residency"]

#: Most keys one ``tl.sort`` handles; wider rows merge sorted tiles in scratch.
MAX_SORT_WIDTH = 2048
#: Most LRU positions handled per step (the rank packing needs < 2**16).
MAX_BLOCK_H = 4096
_BLOCK_R = 128
_INVALIDATE_BLOCK = 1024

_I32_MAX_K = tl.constexpr(2**31 - 1)
_SENTINEL64_K = tl.constexpr(1 << 62)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _state_of(req, rsi_ptr, n_rsi, HAS_RSI: tl.constexpr):
    """State row of request ``req`` (-1 when outside ``request_state_indices``)."""
    if HAS_RSI:
        known = (req >= 0) & (req < n_rsi)
        st = tl.load(rsi_ptr + tl.where(known, req, 0).to(tl.int64), mask=known, other=-1)
    else:
        st = req
    return st


@triton.jit
def _keys_of(keys_ptr, keys2_ptr, row, W: tl.constexpr, IN_KEYS2: tl.constexpr):
    """Base of row ``row``'s sorted keys (the merge passes end in one of two buffers)."""
    if IN_KEYS2:
        base = keys2_ptr + row.to(tl.int64) * W
    else:
        base = keys_ptr + row.to(tl.int64) * W
    return base


@triton.jit
def _find(keys_row, g, ok, W: tl.constexpr, LOG2_W: tl.constexpr, KEY64: tl.constexpr):
    """``(found, index)``: whether host row ``g`` (where ``ok``) has a key among a row's sorted
    keys, and the index of its run's first key."""
    if KEY64:
        target = tl.where(ok, g, 0) * W
    else:
        target = (tl.where(ok, g, 0) * W).to(tl.int32)
    lo = _lower_bound(target, keys_row, target, W, LOG2_W, False)
    key = tl.load(keys_row + lo)
    if KEY64:
        host = key < _SENTINEL64_K
    else:
        host = key < 2147483648 - W
    return ok & host & ((key >> LOG2_W) == g), lo


@triton.jit
def _hot_row(hbt_row, slot, mask, HBS: tl.constexpr):
    """Hot-cache row (int64) of a request's slot: its hot block * HBS + slot % HBS."""
    s = tl.where(mask, slot, 0).to(tl.int64)
    blk = tl.load(hbt_row + s // HBS, mask=mask, other=0).to(tl.int64)
    return blk * HBS + s % HBS


@triton.jit
def _attention_of(rows, abs_stride, HBS: tl.constexpr):
    return tl.where(rows < 0, -1, (rows // HBS) * abs_stride + rows % HBS)


@triton.jit
def _resolve_residency_kernel(
    gi_ptr, stride_gi, req_ptr, rsi_ptr, n_rsi,
    src_ptr, stride_src, SR, SC, sbs,
    res_ptr, stride_res, RR, RC, null_block,
    hbt_ptr, stride_hbt, dgi_ptr, lru_ptr, S,
    hot_ptr, attn_ptr, stride_attn, miss_ptr, resolved_ptr, valid_ptr, stride_valid,
    swap_host_ptr, swap_dev_ptr, swap_cnt_ptr, stats_ptr,
    scr32_ptr, scr64_ptr,
    R, K, H, host_rows, abs_stride,
    HBS: tl.constexpr, W: tl.constexpr, LOG2_W: tl.constexpr, SORT: tl.constexpr,
    LOG2_SORT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
    KEY64: tl.constexpr, MERGES: tl.constexpr, IN_KEYS2: tl.constexpr,
    HAS_REQ: tl.constexpr, HAS_RSI: tl.constexpr, HAS_SRC: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_ATTN: tl.constexpr, HAS_MISS: tl.constexpr,
    HAS_RESOLVED: tl.constexpr, HAS_VALID: tl.constexpr, HAS_SWAP: tl.constexpr,
    HAS_STATS: tl.constexpr,
):
    r = tl.program_id(0)
    r64 = r.to(tl.int64)
    # Scratch layout (``_ResolveShape``): int32 [keys?, keys2?, run_pos, colm: R*W each][next:
    # R][old_lru, cls, evict: R*H each]; int64 [keys?, keys2?, runval: R*W each].
    RW = tl.cast(R, tl.int64) * W
    RH = tl.cast(R, tl.int64) * H
    if KEY64:
        keys_ptr = scr64_ptr
        keys2_ptr = scr64_ptr + RW
        runval_ptr = scr64_ptr + (2 * RW if MERGES else RW)
        run_pos_ptr = scr32_ptr
    else:
        keys_ptr = scr32_ptr
        keys2_ptr = scr32_ptr + RW
        runval_ptr = scr64_ptr
        run_pos_ptr = scr32_ptr + (2 * RW if MERGES else RW)
    colm_ptr = run_pos_ptr + RW
    next_ptr = colm_ptr + RW
    old_lru_ptr = next_ptr + R
    cls_ptr = old_lru_ptr + RH
    evict_ptr = cls_ptr + RH
    if HAS_REQ:
        req = tl.load(req_ptr + r64)
    else:
        req = r
    st = _state_of(req, rsi_ptr, n_rsi, HAS_RSI)
    # Phase 0: the request's leader row, and a state row claimed by an earlier request.
    leader = r
    for r0 in range(0, r, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        rm = rr < r
        if HAS_REQ:
            q = tl.load(req_ptr + rr.to(tl.int64), mask=rm, other=-1)
            leader = tl.minimum(leader, tl.min(tl.where(rm & (q == req), rr, r), axis=0))
    conflict = r * 0
    for r0 in range(0, leader, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        rm = rr < leader
        if HAS_REQ:
            q = tl.load(req_ptr + rr.to(tl.int64), mask=rm, other=-1)
        else:
            q = rr
        sq = _state_of(q, rsi_ptr, n_rsi, HAS_RSI)
        conflict += tl.sum((rm & (sq == st) & (q != req)).to(tl.int32), axis=0)
    jt = tl.arange(0, SORT)
    if (st < 0) | (st >= S) | (conflict > 0):
        # Padding: this row's outputs only; no state touched.
        neg = tl.full([SORT], -1, tl.int32)
        for c0 in range(0, K, SORT):
            c = c0 + jt
            cm = c < K
            tl.store(hot_ptr + r64 * K + c, neg, mask=cm)
            if HAS_ATTN:
                tl.store(attn_ptr + r64 * stride_attn + c, neg, mask=cm)
            if HAS_RESOLVED:
                tl.store(resolved_ptr + r64 * K + c, neg, mask=cm)
        if HAS_VALID:
            tl.store(valid_ptr + r64 * stride_valid, 0)
        if HAS_SWAP:
            tl.store(swap_cnt_ptr + r64, 0)
    elif leader == r:
        st64 = st.to(tl.int64)
        hbt_row = hbt_ptr + req.to(tl.int64) * stride_hbt
        scr_h = r64 * H
        # Link the request's rows in batch order: next[row] = the request's next row.
        n_rows = r * 0
        prev = r * 0 - 1
        idx = tl.arange(0, BLOCK_R)
        for r0 in range(r, R, BLOCK_R):
            rr = r0 + idx
            if HAS_REQ:
                q = tl.load(req_ptr + rr.to(tl.int64), mask=rr < R, other=-1)
                same = (rr < R) & (q == req)
            else:
                same = rr == r
            v = tl.where(same, rr, -1)
            incl = tl.associative_scan(v, 0, _max_combine)
            excl = tl.where(idx == 0, -1, tl.gather(incl, tl.maximum(idx - 1, 0), 0))
            prior = tl.maximum(excl, prev)
            link = same & (prior >= 0)
            tl.store(next_ptr + tl.where(link, prior, 0).to(tl.int64), rr, mask=link)
            n_rows += tl.sum(same.to(tl.int32), axis=0)
            prev = tl.maximum(prev, tl.max(v, axis=0))
        tl.debug_barrier()

        # Phase 1: translate, write resident / masked columns, sort the host-path keys.
        n_host = r * 0
        row = r
        for i in range(0, n_rows):
            row64 = row.to(tl.int64)
            valid = r * 0
            keys_row = keys_ptr + row64 * W
            for c0 in range(0, W, SORT):
                c = c0 + jt
                cm = c < K
                pos = tl.load(gi_ptr + row64 * stride_gi + c, mask=cm, other=-1).to(tl.int64)
                if HAS_SRC:
                    page = tl.where(pos >= 0, pos // sbs, -1)
                    ok = cm & _lanes((req >= 0) & (req < SR), c) & (page >= 0) & (page < SC)
                    blk = tl.load(src_ptr + req.to(tl.int64) * stride_src + tl.where(ok, page, 0),
                                  mask=ok, other=0).to(tl.int64)
                    g = tl.where(ok & (blk > 0), blk * sbs + pos % sbs, -1)
                    if HAS_RES:
                        rpage = tl.where(pos >= 0, pos // HBS, -1)
                        rok = cm & _lanes(st < RR, c) & (rpage >= 0) & (rpage < RC)
                        rb = tl.load(res_ptr + st64 * stride_res + tl.where(rok, rpage, 0),
                                     mask=rok, other=0).to(tl.int64)
                        rok = rok & (rb != null_block) & (rb >= 0)
                        resident = tl.where(rok, rb * HBS + pos % HBS, -1)
                    else:
                        resident = tl.full([SORT], -1, tl.int64)
                else:
                    g = pos
                    resident = tl.full([SORT], -1, tl.int64)
                g = tl.where(g >= host_rows, -1, g)
                if HAS_RESOLVED:
                    tl.store(resolved_ptr + row64 * K + c, g.to(tl.int32), mask=cm)
                if HAS_MISS:
                    tl.store(miss_ptr + row64 * K + c, tl.zeros([SORT], tl.int32), mask=cm)
                valid += tl.sum((cm & ((resident >= 0) | (g >= 0))).to(tl.int32), axis=0)
                host = cm & (resident < 0) & (g >= 0)
                n_host += tl.sum(host.to(tl.int32), axis=0)
                value = tl.where(resident >= 0, resident, -1)
                tl.store(hot_ptr + row64 * K + c, value.to(tl.int32), mask=cm & ~host)
                if HAS_ATTN:
                    tl.store(attn_ptr + row64 * stride_attn + c,
                             _attention_of(value, abs_stride, HBS).to(tl.int32), mask=cm & ~host)
                if KEY64:
                    key = tl.where(host, g * W + c, c.to(tl.int64) + _SENTINEL64_K)
                else:
                    key = tl.where(host, (g * W + c).to(tl.int32), c + (2147483648 - W))
                tl.store(keys_row + c0 + jt, tl.sort(key))
                tl.store(run_pos_ptr + row64 * W + c0 + jt, tl.full([SORT], _I32_MAX_K, tl.int32))
            if HAS_VALID:
                tl.store(valid_ptr + row64 * stride_valid, valid)
            # Merge the sorted tiles of this row (when W > SORT).
            src_row = keys_row
            dst_row = keys2_ptr + row64 * W
            for lvl in tl.static_range(LOG2_W - LOG2_SORT):
                tl.debug_barrier()
                for i0 in range(0, W, SORT):
                    j = i0 + jt
                    key = tl.load(src_row + j)
                    run = j >> (LOG2_SORT + lvl)
                    partner = src_row + (run ^ 1) * (SORT << lvl)
                    lo = _lower_bound(key, partner, key, SORT << lvl, LOG2_SORT + lvl, False)
                    rank = lo + (tl.load(partner + lo) < key).to(tl.int32)
                    dest = (run >> 1) * (SORT << (lvl + 1)) + (j & ((SORT << lvl) - 1)) + rank
                    tl.store(dst_row + dest, key)
                src_row, dst_row = dst_row, src_row
            row = tl.load(next_ptr + row64, mask=i + 1 < n_rows, other=r)
        tl.debug_barrier()

        if n_host == 0:
            row = r
            for i in range(0, n_rows):
                if HAS_SWAP:
                    tl.store(swap_cnt_ptr + row.to(tl.int64), 0)
                row = tl.load(next_ptr + row.to(tl.int64), mask=i + 1 < n_rows, other=r)
        else:
            # Phase 2: LRU positions: hit (the slot holds a host row of the union) or
            # evictable (ranked in LRU order).
            n_evict = r * 0
            for h0 in range(0, H, BLOCK_H):
                p = h0 + tl.arange(0, BLOCK_H)
                pm = p < H
                slot = tl.load(lru_ptr + st64 * H + p, mask=pm, other=-1).to(tl.int32)
                tl.store(old_lru_ptr + scr_h + p, slot, mask=pm)
                sok = pm & (slot >= 0) & (slot < H)
                held = tl.load(dgi_ptr + st64 * H + tl.where(sok, slot, 0), mask=sok,
                               other=-1).to(tl.int64)
                hok = sok & (held >= 0) & (held < host_rows)
                hit = pm & (p < 0)
                row = r
                for i in range(0, n_rows):
                    keys_row = _keys_of(keys_ptr, keys2_ptr, row, W, IN_KEYS2)
                    found, lo = _find(keys_row, held, hok, W, LOG2_W, KEY64)
                    tl.atomic_min(run_pos_ptr + row.to(tl.int64) * W + lo, p, mask=found,
                                  sem="relaxed")
                    hit = hit | found
                    row = tl.load(next_ptr + row.to(tl.int64), mask=i + 1 < n_rows, other=r)
                ev = pm & ~hit
                erank = n_evict + tl.cumsum(ev.to(tl.int32), axis=0) - 1
                tl.store(evict_ptr + scr_h + tl.where(ev, erank, 0), slot, mask=ev)
                tl.store(cls_ptr + scr_h + p, hit.to(tl.int32), mask=pm)
                n_evict += tl.sum(ev.to(tl.int32), axis=0)
            tl.debug_barrier()

            # Phase 3: per row in batch order: first references, misses, values.
            n_miss = r * 0
            n_hits = r * 0
            n_served = r * 0
            row = r
            for i in range(0, n_rows):
                row64 = row.to(tl.int64)
                keys_row = _keys_of(keys_ptr, keys2_ptr, row, W, IN_KEYS2)
                run_row = run_pos_ptr + row64 * W
                colm_row = colm_ptr + row64 * W
                val_row = runval_ptr + row64 * W
                # (a) runs: hit, held by an earlier row, or a miss to number.
                carry = r * 0 - 1
                for j0 in range(0, W, SORT):
                    host, g, col, start, run_at, srv, carry = _sorted_tile(
                        jt, keys_row, run_row, j0, carry, KEY64, LOG2_W, W,
                        SORT, False)
                    hit = host & (srv != _I32_MAX_K)
                    lead = start & ~hit
                    earlier = lead & ~lead
                    e_val = tl.zeros([SORT], tl.int64)
                    erow = r
                    for t in range(0, i):
                        found, lo = _find(_keys_of(keys_ptr, keys2_ptr, erow, W, IN_KEYS2), g,
                                          lead & ~earlier, W, LOG2_W, KEY64)
                        v = tl.load(runval_ptr + erow.to(tl.int64) * W + lo, mask=found,
                                    other=0)
                        e_val = tl.where(found, v, e_val)
                        earlier = earlier | found
                        erow = tl.load(next_ptr + erow.to(tl.int64))
                    miss_first = lead & ~earlier
                    srv_slot = tl.load(old_lru_ptr + scr_h + tl.where(hit, srv, 0), mask=hit,
                                       other=-1)
                    hv = _hot_row(hbt_row, srv_slot, hit & start, HBS)
                    packed = tl.where(hit, (1 << 32) | (hv & 0xFFFFFFFF), e_val)
                    tl.store(val_row + j0 + jt, packed, mask=start & (hit | earlier))
                    tl.store(colm_row + col, miss_first.to(tl.int32))
                tl.debug_barrier()
                # (b) number the misses in column order (carried across rows).
                for c0 in range(0, W, SORT):
                    flag = tl.load(colm_row + c0 + jt)
                    num = n_miss + tl.cumsum(flag, axis=0) - 1
                    n_miss += tl.sum(flag, axis=0)
                    tl.store(colm_row + c0 + jt, tl.where(flag != 0, num, -1))
                tl.debug_barrier()
                # (c) misses take evictable slots (state, plan entries); then every host-path
                # column reads its run's value: a run's first key holds it ((a) or here), a
                # run still open at a tile's end carries it into the next tile.
                carry = r * 0 - 1
                open_run = r64 * 0
                for j0 in range(0, W, SORT):
                    host, g, col, start, run_at, srv, next_carry = _sorted_tile(
                        jt, keys_row, run_row, j0, carry, KEY64, LOG2_W, W, SORT, False)
                    m = tl.load(colm_row + col, mask=host & start, other=-1)
                    first = host & start & (m >= 0)
                    have = first & (m < n_evict)
                    slot = tl.load(evict_ptr + scr_h + tl.where(have, m, 0), mask=have, other=-1)
                    served = have & (slot >= 0) & (slot < H)
                    dev = tl.where(served, _hot_row(hbt_row, slot, served, HBS), -1)
                    tl.store(dgi_ptr + st64 * H + tl.where(served, slot, 0), g.to(tl.int32),
                             mask=served)
                    if HAS_MISS:
                        tl.store(miss_ptr + row64 * K + col, tl.full([SORT], 1, tl.int32),
                                 mask=served)
                    if HAS_SWAP:
                        seg = tl.where(first, m // K, 0)
                        prow = tl.full([SORT], 0, tl.int32) + r
                        for t in range(0, i):
                            step = tl.load(next_ptr + prow.to(tl.int64), mask=first & (t < seg),
                                           other=0)
                            prow = tl.where(first & (t < seg), step, prow)
                        at = prow.to(tl.int64) * K + m % K
                        tl.store(swap_host_ptr + at, g.to(tl.int32), mask=first)
                        tl.store(swap_dev_ptr + at, dev.to(tl.int32), mask=first)
                    n_served += tl.sum(served.to(tl.int32), axis=0)
                    mine = tl.where(served, (1 << 32) | (dev & 0xFFFFFFFF), 0xFFFFFFFF)
                    tl.store(val_row + j0 + jt, mine, mask=first)
                    stored = tl.load(val_row + j0 + jt, mask=host & start & ~first, other=0)
                    at_start = tl.where(first, mine, stored)
                    packed = tl.where(run_at >= j0,
                                      tl.gather(at_start, tl.maximum(run_at - j0, 0), 0),
                                      open_run)
                    open_run = tl.sum(tl.where(jt == SORT - 1, packed, 0), axis=0)
                    carry = next_carry
                    value = (packed & 0xFFFFFFFF).to(tl.int32).to(tl.int64)  # wraps like int32
                    is_served = host & ((packed >> 32) != 0)
                    n_hits += tl.sum((is_served & ~first).to(tl.int32), axis=0)
                    tl.store(hot_ptr + row64 * K + col, value.to(tl.int32), mask=host)
                    if HAS_ATTN:
                        tl.store(attn_ptr + row64 * stride_attn + col,
                                 _attention_of(value, abs_stride, HBS).to(tl.int32), mask=host)
                tl.debug_barrier()  # the next row's (a) reads this row's run values
                row = tl.load(next_ptr + row64, mask=i + 1 < n_rows, other=r)

            # Phase 4: new LRU order, swap counts, stats.
            n_take = tl.minimum(n_miss, n_evict)
            ev_carry = r * 0
            hit_carry = r * 0
            for h0 in range(0, H, BLOCK_H):
                p = h0 + tl.arange(0, BLOCK_H)
                pm = p < H
                hit = (tl.load(cls_ptr + scr_h + p, mask=pm, other=0) != 0) & pm
                ev = pm & ~hit
                slot = tl.load(old_lru_ptr + scr_h + p, mask=pm, other=-1)
                both = tl.cumsum(ev.to(tl.int32) + (hit.to(tl.int32) << 16), axis=0)
                erank = ev_carry + (both & 0xFFFF) - 1
                hrank = hit_carry + (both >> 16) - 1
                ev_carry += tl.sum(ev.to(tl.int32), axis=0)
                hit_carry += tl.sum(hit.to(tl.int32), axis=0)
                new_pos = tl.where(ev, tl.where(erank < n_take, n_evict - n_take + erank,
                                                erank - n_take), n_evict + hrank)
                ok = pm & (new_pos >= 0) & (new_pos < H)
                tl.store(lru_ptr + st64 * H + tl.where(ok, new_pos, 0), slot.to(tl.int16),
                         mask=ok)
            row = r
            for i in range(0, n_rows):
                if HAS_SWAP:
                    tl.store(swap_cnt_ptr + row.to(tl.int64),
                             tl.minimum(tl.maximum(n_miss - i * K, 0), K))
                row = tl.load(next_ptr + row.to(tl.int64), mask=i + 1 < n_rows, other=r)
            if HAS_STATS:
                tl.atomic_add(stats_ptr, n_hits.to(tl.int64), sem="relaxed")
                tl.atomic_add(stats_ptr + 1, n_served.to(tl.int64), sem="relaxed")


@triton.jit
def _invalidate_kernel(dgi_ptr, rsi_ptr, req_ptr, written_ptr, n_requests, S, region,
                       BLOCK: tl.constexpr):
    """Token ``program_id(0)``: clear the entries of block ``program_id(1)`` of its state
    row that hold its written host row."""
    t = tl.program_id(0).to(tl.int64)
    req = tl.load(req_ptr + t)
    known = (req >= 0) & (req < n_requests)
    st = tl.load(rsi_ptr + tl.where(known, req, 0).to(tl.int64), mask=known, other=-1)
    written = tl.load(written_ptr + t)
    if known & (st >= 0) & (st < S) & (written >= 0):
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        om = offs < region
        row = dgi_ptr + st.to(tl.int64) * region
        held = tl.load(row + offs, mask=om, other=-1)
        tl.store(row + offs, tl.full([BLOCK], -1, tl.int32),
                 mask=om & (held.to(tl.int64) == written))


# --------------------------------------------------------------------------------- launchers


def _check_backend(device: torch.device) -> None:
    import os

    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"the vLLM HiSparse Triton kernels need CUDA tensors (got {device}), "
                           "or TRITON_INTERPRET=1 set before import to run on the CPU")


def _check_host_cache(op: str, host_cache: torch.Tensor, device: torch.device) -> None:
    """A CUDA launch reads the host cache in place: it must be pinned CPU memory (or on
    ``device``). Refused with the ``RuntimeError`` vLLM's ops raise."""
    from hisparse_triton.kernels.gather import validate_pool

    try:
        validate_pool(host_cache, device)
    except ValueError as error:
        raise RuntimeError(f"{op}: host_cache must be pinned CPU memory: {error}") from None


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class _ResolveShape(NamedTuple):
    """Constexprs and scratch sizes of one ``(R, K, H, host_rows)`` call (memoised)."""

    constexprs: dict
    n32: int   # int32 scratch words
    n64: int   # int64 scratch words


def _resolve_shape(R: int, K: int, H: int, host_rows: int, hbs: int,
                   sort_width: Optional[int], block_h: Optional[int]) -> _ResolveShape:
    W = scratch_width(K)
    sort = min(W, sort_width or MAX_SORT_WIDTH)
    bh = min(_pow2(max(H, 16)), block_h or MAX_BLOCK_H)
    key64 = (host_rows + 1) * W > 2**31
    merges = W.bit_length() - sort.bit_length()
    tile = max(sort, bh)
    key_arrays = 2 if merges else 1
    n32 = R * W * (2 + (0 if key64 else key_arrays)) + R + 3 * R * H
    n64 = R * W * (1 + (key_arrays if key64 else 0))
    return _ResolveShape(dict(
        HBS=hbs, W=W, LOG2_W=W.bit_length() - 1, SORT=sort, LOG2_SORT=sort.bit_length() - 1,
        BLOCK_H=bh, BLOCK_R=_BLOCK_R, KEY64=key64, MERGES=merges > 0,
        IN_KEYS2=merges % 2 == 1, num_warps=16 if tile >= 2048 else 8 if tile >= 1024 else 4),
        n32, n64)


_SHAPES: dict[tuple, _ResolveShape] = {}


def hisparse_resolve_residency(
        host_cache, hot_cache, hot_block_table, global_indices, hot_indices,
        device_global_indices, lru_slots, request_state_indices, region_stride: int,
        max_union_rows: int, miss_mask=None, stats=None, attention_indices=None,
        attention_block_stride: int = 0, request_ids=None, source_block_table=None,
        source_block_size: int = 0, resolved_global_indices=None, valid_counts=None,
        swap_host_physical_rows=None, swap_device_physical_rows=None, swap_counts=None,
        resident_block_table=None, resident_block_size: int = 0,
        resident_null_block: int = 0, *, sort_width: Optional[int] = None,
        block_h: Optional[int] = None) -> None:
    """Triton ``hisparse_resolve_residency`` (vLLM's argument order; semantics of
    ``vllm_reference.hisparse_resolve_residency``). One launch, no host synchronisation.
    ``sort_width`` / ``block_h`` (powers of two) shrink the register tiles (tests use them
    to exercise the merge passes and several LRU steps)."""
    R, K, H, S, hbs, host_rows = checked(check_resolve_residency, (
        host_cache, hot_cache, hot_block_table, global_indices, hot_indices,
        device_global_indices, lru_slots, request_state_indices, region_stride,
        max_union_rows, miss_mask, stats, attention_indices, attention_block_stride,
        request_ids, source_block_table, source_block_size, resolved_global_indices,
        valid_counts, swap_host_physical_rows, swap_device_physical_rows, swap_counts,
        resident_block_table, resident_block_size, resident_null_block))
    if R == 0 or K == 0:
        return
    device = global_indices.device
    if device.type != "cuda":
        _check_backend(device)
    key = (R, K, H, host_rows, hbs, sort_width, block_h)
    shape = _SHAPES.get(key)
    if shape is None:
        shape = _SHAPES[key] = _resolve_shape(R, K, H, host_rows, hbs, sort_width, block_h)
    scr32 = torch.empty(shape.n32, dtype=torch.int32, device=device)
    scr64 = torch.empty(shape.n64, dtype=torch.int64, device=device)
    dummy = hot_indices
    src = source_block_table if source_block_table is not None else dummy
    res = resident_block_table if resident_block_table is not None else dummy
    attn = attention_indices if attention_indices is not None else dummy
    valid = valid_counts if valid_counts is not None else dummy
    has_swap = swap_counts is not None
    with device_guard(global_indices):
        _resolve_residency_kernel[(R,)](
            global_indices, global_indices.stride(0),
            request_ids if request_ids is not None else dummy,
            request_state_indices if request_state_indices is not None else dummy,
            request_state_indices.numel() if request_state_indices is not None else 0,
            src, src.stride(0), src.shape[0], src.shape[1] if src.dim() == 2 else 0,
            source_block_size,
            res, res.stride(0), res.shape[0], res.shape[1] if res.dim() == 2 else 0,
            resident_null_block,
            hot_block_table, hot_block_table.stride(0), device_global_indices, lru_slots, S,
            hot_indices, attn, attn.stride(0),
            miss_mask if miss_mask is not None else dummy,
            resolved_global_indices if resolved_global_indices is not None else dummy,
            valid, valid.stride(0),
            swap_host_physical_rows if has_swap else dummy,
            swap_device_physical_rows if has_swap else dummy,
            swap_counts if has_swap else dummy,
            stats.view(torch.int64) if stats is not None else scr64,
            scr32, scr64, R, K, H, host_rows, attention_block_stride,
            HAS_REQ=request_ids is not None, HAS_RSI=request_state_indices is not None,
            HAS_SRC=source_block_table is not None, HAS_RES=resident_block_table is not None,
            HAS_ATTN=attention_indices is not None, HAS_MISS=miss_mask is not None,
            HAS_RESOLVED=resolved_global_indices is not None,
            HAS_VALID=valid_counts is not None, HAS_SWAP=has_swap,
            HAS_STATS=stats is not None, **shape.constexprs)


def hisparse_invalidate_written_slots(device_global_indices, request_state_indices,
                                      req_id_per_token, written_slots) -> None:
    """Triton ``hisparse_invalidate_written_slots``: one launch over the tokens, no host
    synchronisation (semantics: ``vllm_reference.hisparse_invalidate_written_slots``)."""
    T = checked(check_invalidate_written_slots, (device_global_indices, request_state_indices,
                                                 req_id_per_token, written_slots))
    S, region = device_global_indices.shape
    if T == 0 or S == 0 or region == 0:
        return
    device = device_global_indices.device
    if device.type != "cuda":
        _check_backend(device)
    block = min(_INVALIDATE_BLOCK, _pow2(max(region, 16)))
    with device_guard(device_global_indices):
        _invalidate_kernel[(T, -(-region // block))](
            device_global_indices, request_state_indices, req_id_per_token, written_slots,
            request_state_indices.numel(), S, region, BLOCK=block,
            num_warps=4 if block >= 512 else 1)
