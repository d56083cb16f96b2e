"""The hash resolve kernel: rows of up to 2,048 top-k columns against up to 4,096 hot slots.

Same contract, outputs and state as the sorted kernel (``kernels/resolve_sorted.py``) and the
torch reference, bit for bit; one launch, one program per row, no sort. ``kernels/resolve.py``
picks it by shape (``HASH_MAX_WIDTH`` / ``HASH_MAX_SLOTS``, host rows that fit int32).

How hits are found: a per-row open-addressing hash table in the workspace
(``ResolveBuffers.table``, ``3 x T`` int32 words per row, ``T = HASH_TABLE_FACTOR`` (16) ``x``
the top-k width rounded up to a power of two: a load factor of at most 1/16), keyed by the host
rows of the row's top-k columns (int32), with linear probing and a multiplicative hash (the top
``log2 T`` bits of ``g * 0x9E3779B1 mod 2**32``). Three arrays per row: ``key`` (the host row,
``EMPTY = INT32_MIN``; after the lookups, the entry's miss number), ``first`` (the first
column holding it, as ``atomic_max(-1 - column)`` so that a clean word is ``INT32_MIN`` too),
``srv`` (the valid LRU position holding it, ``p * 2**16 + slot``). The table is cleaned by the
call that used it (each column resets the words of its entry at the end), so a call never
clears the whole table, and every layout of the buffer (another call shape) sees it clean.
``ResolveWorkspace`` allocates it filled with ``INT32_MIN``.

Phases (``bar.sync`` between them; state row ``st``; ``p`` = LRU position):
1. Columns: classify (masked / resident / host row ``g``, as the sorted kernel; the host and
   resident block loads side by side); positions: snapshot ``lru`` and ``slot_host_rows``
   (for ``restore_resolve_state``), load each position's slot and the host row it holds,
   ``owner[slot] = p`` (plain stores). Insert the columns' host rows: every pending column
   tries ``atomic_cas(key[i], EMPTY, g)`` at its probe index ``i``; it is placed when the old
   word was ``EMPTY`` or ``g`` (duplicates share an entry), else it probes ``i + 1`` next
   round; ``FIRST_ROUNDS`` rounds unconditionally, then while a column is pending, at most
   ``PROBES``. Placed columns ``atomic_max(first[i], -1 - column)``. Every placed key sits
   fewer than ``rounds`` probes from its hash, so a lookup needs at most ``rounds``.
2. Positions read their slot's owner back: valid when it is them. Valid positions look their
   held row up (``rounds`` probes, ``LOOKUP`` independent loads per pass; a key is in one entry
   only, so a match is its entry) and store ``p * 2**16 + slot`` into ``srv``.
3. Columns read ``srv`` / ``first`` of their entry; positions read ``srv`` back (serving when
   it is theirs). **Fallback**: a column still pending after ``PROBES`` rounds (a degenerate
   hash, an adversarial set of host rows), an LRU naming a slot twice (not every position
   valid) or two valid positions holding one host row (corrupted states) resets the row's
   table entries and resolves the row with the sorted kernel's code (``_sorted_row``) in the
   same launch: results are always exact. Otherwise hits get their serving slot's device
   row; first misses in column order get their numbers (one ``tl.cumsum``), ``miss_src``.
4. The replacement policy (``_lru_replacement``, one tile): the new LRU order (one scatter),
   the filled slots' ``miss_dst`` and ``slot_host_rows``; miss columns read their number.
5. Miss columns read their slot's device row; every column's row is stored once; stats,
   counters; the row's table entries are reset.

Cost (``hisparse_triton/compile/sass_model.py``, the compile report's ``model``): about
11.5 us per call at 64 rows x top-k 2,048 x 4,096 slots, against 25 us for the sorted
kernel. The model assumes 3 insertion rounds (``compile/loop_trips.py``, ``MODEL_ROUNDS``:
a Python simulation of the parallel rounds on 2,048 random or block-contiguous host rows at
load 1/16 gives a median of 3, p95 4, max 5 of 200 rows); it counts the hash path only
(its model twin: the fallback runs on overflow and corrupted states, and costs the sorted
figure). Ordering: as the sorted kernel (``bar.sync``
orders the CTA's global accesses; every table word another thread wrote is read with a
``.cg`` load, from L2).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hisparse_triton.kernels.masks import _lanes
from hisparse_triton.kernels.resolve_policy import _lru_replacement
from hisparse_triton.kernels.resolve_sorted import _first_of_state, _padding_row, _sorted_row

__all__ = ["EMPTY", "HASH_MUL", "FIRST_ROUNDS", "LOOKUP", "PROBES"]

#: A clean table word (every array of the table).
EMPTY = -(2**31)
#: The multiplicative hash (Knuth's 2**32 / golden ratio); 0 sends every key to entry 0
#: (tests use it to force collisions and overflow).
HASH_MUL = 0x9E3779B1
#: Most insertion rounds before a row falls back to the sorted path.
PROBES = 16
#: Lookup probes issued together (one pass); ``rounds`` probes take ceil(rounds / LOOKUP)
#: passes.
LOOKUP = 3
#: Insertion rounds made without a loop test (the while loop then runs from there).
FIRST_ROUNDS = 2

_EMPTY_K = tl.constexpr(EMPTY)
_I32_MAX_K = tl.constexpr(2**31 - 1)


@triton.jit
def _hash(g, HASH_MUL: tl.constexpr, LOG2_T: tl.constexpr):
    """``[N] int32`` table index of host rows ``g`` (any int): the top ``LOG2_T`` bits of
    ``g * HASH_MUL mod 2**32``."""
    x = g.to(tl.int32) * (HASH_MUL - (1 << 32) if HASH_MUL >= (1 << 31) else HASH_MUL)
    return (x.to(tl.uint32, bitcast=True) >> (32 - LOG2_T)).to(tl.int32)


@triton.jit
def _slot_row32(hot_row, stride_hot_b, slot, mask, num_device_blocks,
                BLOCK_SIZE: tl.constexpr):
    """``_slot_device_row`` in int32 (``slot`` in ``[0, H)``): the low 32 bits of the int64
    row, which the int32 output keeps anyway; -1 for a bad hot block."""
    blk = tl.load(hot_row + (slot // BLOCK_SIZE).to(tl.int64) * stride_hot_b, mask=mask,
                  other=0)
    ok = mask & (blk >= 1) & (blk < num_device_blocks)
    return tl.where(ok, blk * BLOCK_SIZE + slot % BLOCK_SIZE, -1)


@triton.jit
def _resolve_hash_kernel(
    topk_ptr, state_rows_ptr, seq_lens_ptr, resident_ptr, host_ptr, hot_ptr, slot_rows_ptr,
    lru_ptr,
    rows_ptr, miss_src_ptr, miss_dst_ptr, miss_count_ptr, stats_ptr,
    touched_ptr, old_rows_ptr, old_lru_ptr, owner_ptr, cls_ptr, run_pos_ptr, colbuf_ptr,
    colm_ptr, keys_ptr, keys2_ptr, counters_ptr, table_ptr,
    K, S, P, H,
    stride_tk_r, stride_tk_c, stride_sr, stride_seq, stride_res_s, stride_res_p,
    stride_host_s, stride_host_p, stride_hot_s, stride_hot_b, stride_shr_s, stride_shr_h,
    stride_lru_s, stride_lru_h, stride_out_r, stride_out_c, stride_cnt,
    num_device_blocks, num_host_blocks,
    BLOCK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, LOG2_K: tl.constexpr,
    SORT: tl.constexpr, LOG2_SORT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
    KEY64: tl.constexpr, HAS_COUNTERS: tl.constexpr, IN_REGS: tl.constexpr,
    LOG2_T: tl.constexpr, PROBES: tl.constexpr, HASH_MUL: tl.constexpr,
    LOOKUP: tl.constexpr, FIRST_ROUNDS: tl.constexpr, FALLBACK: tl.constexpr,
    CLEAN_FIRST: tl.constexpr,
):
    r = tl.program_id(0)
    r64 = r.to(tl.int64)
    st = tl.load(state_rows_ptr + r64 * stride_sr)
    row_ok = _first_of_state(state_rows_ptr, stride_sr, r, st, S, BLOCK_R)
    rows_row = rows_ptr + r64 * stride_out_r
    plan = r64 * K
    if row_ok:
        st64 = st.to(tl.int64)
        lru_row = lru_ptr + st64 * stride_lru_s
        shr_row = slot_rows_ptr + st64 * stride_shr_s
        hot_row = hot_ptr + st64 * stride_hot_s
        scr_h = r64 * H
        num_host_rows = tl.cast(num_host_blocks, tl.int64) * BLOCK_SIZE
        tkey = table_ptr + r64 * (3 << LOG2_T)
        tfirst = tkey + (1 << LOG2_T)
        tsrv = tkey + (2 << LOG2_T)
        tmnum = tkey  # the key word holds the miss number once the lookups are done

        if CLEAN_FIRST:  # a one-off table (a call without a workspace): not clean yet
            # BLOCK_H (sized by the slots) need not divide the row's 3 T words (sized by the
            # top-k): masked, or the last tile clears the next row's table / past the buffer.
            for w0 in range(0, 3 << LOG2_T, BLOCK_H):
                w = w0 + tl.arange(0, BLOCK_H)
                tl.store(tkey + w, tl.full([BLOCK_H], _EMPTY_K, tl.int32),
                         mask=w < (3 << LOG2_T))
            tl.debug_barrier()

        # Phase 1: columns (classify, insert their host rows); positions (snapshot, slots,
        # held rows, slot owners by plain stores).
        c = tl.arange(0, BLOCK_K)
        cm = c < K
        c64 = c.to(tl.int64)
        seq = tl.load(seq_lens_ptr + st64 * stride_seq).to(tl.int64)
        pos = tl.load(topk_ptr + r64 * stride_tk_r + c64 * stride_tk_c, mask=cm,
                      other=-1).to(tl.int64)
        in_seq = cm & (pos >= 0) & (pos < seq)
        pos32 = tl.where(in_seq, pos, 0).to(tl.int32)  # < seq_lens: int32
        page = pos32 // BLOCK_SIZE
        off = pos32 % BLOCK_SIZE
        inr = in_seq & (page < P)
        page64 = page.to(tl.int64)
        rb = tl.load(resident_ptr + st64 * stride_res_s + page64 * stride_res_p, mask=inr,
                     other=0)
        res = inr & (rb >= 1) & (rb < num_device_blocks)
        hb = tl.load(host_ptr + st64 * stride_host_s + page64 * stride_host_p,
                     mask=inr, other=0)  # beside the resident load, not after it
        hok = inr & ~res & (hb >= 1) & (hb < num_host_blocks)
        g = tl.where(hok, hb * BLOCK_SIZE + off, 0)  # host rows fit int32 (the dispatch)
        out = tl.where(res, rb * BLOCK_SIZE + off, -1)  # int32 wrap = the int64 row's cast

        p = tl.max_contiguous(tl.arange(0, BLOCK_H), 1)
        pm = p < H
        p64 = p.to(tl.int64)
        slot = tl.load(lru_row + p64 * stride_lru_h, mask=pm, other=-1)
        tl.store(old_lru_ptr + scr_h + p64, slot, mask=pm)
        tl.store(old_rows_ptr + scr_h + p64, tl.load(shr_row + p64 * stride_shr_h, mask=pm),
                 mask=pm)
        sv = pm & (slot >= 0) & (slot < H)
        slot_c = tl.where(sv, slot, 0)
        held = tl.load(shr_row + slot_c.to(tl.int64) * stride_shr_h, mask=sv, other=-1)
        # Slot owners: one plain store per position; a slot named twice (a corrupted lru)
        # reads back another position's number and sends the row to the sorted path.
        tl.store(owner_ptr + scr_h + slot_c, p, mask=sv)
        tl.store(touched_ptr + r64, 1)

        idx = _hash(g, HASH_MUL, LOG2_T)
        ent = tl.full([BLOCK_K], -1, tl.int32)
        pending = hok
        for _first_round in tl.static_range(FIRST_ROUNDS):  # no loop test: most rows need them all
            old = tl.atomic_cas(tkey + idx, tl.where(pending, _EMPTY_K, -2), g, sem="relaxed")
            placed = pending & ((old == _EMPTY_K) | (old == g))
            ent = tl.where(placed, idx, ent)
            pending = pending & ~placed
            idx = tl.where(pending, (idx + 1) & ((1 << LOG2_T) - 1), idx)
        n_pend = tl.sum(pending.to(tl.int32), axis=0)
        rounds = r * 0 + FIRST_ROUNDS
        while (n_pend > 0) & (rounds < PROBES):
            # cmp -2 never matches a word (keys are >= 1, EMPTY < -2): settled lanes read only
            old = tl.atomic_cas(tkey + idx, tl.where(pending, _EMPTY_K, -2), g, sem="relaxed")
            placed = pending & ((old == _EMPTY_K) | (old == g))
            ent = tl.where(placed, idx, ent)
            pending = pending & ~placed
            idx = tl.where(pending, (idx + 1) & ((1 << LOG2_T) - 1), idx)
            n_pend = tl.sum(pending.to(tl.int32), axis=0)
            rounds += 1
        placed_any = ent >= 0
        ent_c = tl.where(placed_any, ent, 0)
        tl.atomic_max(tfirst + ent_c, -1 - c, mask=placed_any, sem="relaxed")
        tl.debug_barrier()

        # Phase 2: valid positions (every one, or the sorted path) look their held row up
        # and claim its entry (a plain store; two positions on one entry -> sorted path).
        first_p = tl.load(owner_ptr + scr_h + slot_c, cache_modifier=".cg")  # slot_c < H
        valid = sv & (first_p == p)
        hv = valid & (held >= 0) & (held < num_host_rows)
        hp = _hash(held, HASH_MUL, LOG2_T)
        ent_p = tl.full([BLOCK_H], -1, tl.int32)
        # A key is in the table at most once, fewer than ``rounds`` probes from its hash:
        # the probes of a pass are independent loads (one round trip per pass).
        # Unmasked: every probe index is in the table, and a key sits in one entry only,
        # so a match is the held row's entry whatever the probe number.
        for d0 in range(0, rounds, LOOKUP):
            for j in tl.static_range(LOOKUP):
                q = (hp + (d0 + j)) & ((1 << LOG2_T) - 1)
                kk = tl.load(tkey + q, cache_modifier=".cg")
                ent_p = tl.where(hv & (kk == held), q, ent_p)
        found = ent_p >= 0
        ent_pc = tl.where(found, ent_p, 0)
        mine = p * 65536 + slot_c
        tl.store(tsrv + ent_pc, mine, mask=found)
        tl.debug_barrier()

        # Phase 3: hits and misses of the columns; serving positions; the sorted path?
        v = tl.load(tsrv + ent_c, cache_modifier=".cg")  # (in range; unused outside the mask)
        f = tl.load(tfirst + ent_c, cache_modifier=".cg")
        vs = tl.load(tsrv + ent_pc, cache_modifier=".cg")
        serving = found & (vs == mine)
        # one reduction: valid positions (bits 0-15), serving ones (16-30)
        counts = tl.sum(valid.to(tl.int32) + (serving.to(tl.int32) << 16), axis=0)
        n_valid = counts & 0xFFFF
        n_serving = counts >> 16
        n_found = tl.sum(found.to(tl.int32), axis=0)
        if ((n_pend > 0) | (n_valid < H) | (n_found != n_serving)) & FALLBACK:
            # Probe overflow, a slot named twice or a host row held twice: reset the table
            # entries, resolve the row by sorting (exact, slower).
            clean = tl.full([BLOCK_K], _EMPTY_K, tl.int32)
            tl.store(tkey + ent_c, clean, mask=placed_any)
            tl.store(tfirst + ent_c, clean, mask=placed_any)
            tl.store(tsrv + ent_c, clean, mask=placed_any)
            tl.debug_barrier()
            _sorted_row(r, r64, st, rows_row, plan,
                        topk_ptr, state_rows_ptr, seq_lens_ptr, resident_ptr, host_ptr,
                        hot_ptr, slot_rows_ptr, lru_ptr, rows_ptr, miss_src_ptr, miss_dst_ptr,
                        miss_count_ptr, stats_ptr, touched_ptr, old_rows_ptr, old_lru_ptr,
                        owner_ptr, cls_ptr, run_pos_ptr, colbuf_ptr, colm_ptr, keys_ptr,
                        keys2_ptr, counters_ptr, K, S, P, H, stride_tk_r, stride_tk_c,
                        stride_sr, stride_seq, stride_res_s, stride_res_p, stride_host_s,
                        stride_host_p, stride_hot_s, stride_hot_b, stride_shr_s, stride_shr_h,
                        stride_lru_s, stride_lru_h, stride_out_r, stride_out_c, stride_cnt,
                        num_device_blocks, num_host_blocks, BLOCK_SIZE, BLOCK_K, LOG2_K,
                        SORT, LOG2_SORT, BLOCK_H, BLOCK_R, KEY64, HAS_COUNTERS, IN_REGS)
        else:
            hit = placed_any & (v != _EMPTY_K)  # placed_any == hok here (no overflow)
            dev_hit = _slot_row32(hot_row, stride_hot_b, v & 0xFFFF, hit, num_device_blocks,
                                  BLOCK_SIZE)
            miss = hok & ~hit
            first_miss = miss & ((-1 - f) == c)
            n_evict = H - n_serving
            mnum = tl.cumsum(first_miss.to(tl.int32), axis=0) - 1
            n_miss = tl.max(mnum, axis=0) + 1
            n_fill = tl.minimum(n_miss, n_evict)
            tl.store(tmnum + ent_c, mnum, mask=first_miss)
            tl.store(miss_src_ptr + plan + c, tl.full([BLOCK_K], -1, tl.int32),
                     mask=cm & (c >= n_fill))
            tl.store(miss_src_ptr + plan + mnum, g, mask=first_miss & (mnum < n_fill))
            tl.debug_barrier()

            # Phase 4: the replacement policy; fills; miss columns' numbers.
            cls = tl.where(pm, serving.to(tl.int32), 3)  # every position is valid here
            zero = r * 0
            new_pos, filled, erank, _, _ = _lru_replacement(cls, p, n_evict, n_serving, n_fill,
                                                            zero, zero)
            active = (n_serving + n_fill) > 0
            ok = pm & _lanes(active, p) & (new_pos >= 0) & (new_pos < H)
            tl.store(lru_row + new_pos.to(tl.int64) * stride_lru_h, slot, mask=ok)
            src = tl.load(miss_src_ptr + plan + erank, mask=filled, other=-1)
            dev_f = _slot_row32(hot_row, stride_hot_b, slot_c, filled, num_device_blocks,
                                BLOCK_SIZE)
            tl.store(miss_dst_ptr + plan + erank, dev_f, mask=filled)
            tl.store(shr_row + slot_c.to(tl.int64) * stride_shr_h, src, mask=filled)
            n_planned = tl.sum((filled & (dev_f != -1)).to(tl.int32), axis=0)
            tl.store(miss_dst_ptr + plan + c, tl.full([BLOCK_K], -1, tl.int32),
                     mask=cm & (c >= n_fill))
            m = tl.load(tmnum + ent_c, mask=miss, other=-1, cache_modifier=".cg")
            tl.debug_barrier()

            # Phase 5: the rows, stats, counters; reset the table entries of this row.
            dst = tl.load(miss_dst_ptr + plan + m, mask=miss & (m < n_fill), other=-1)
            out = tl.where(hit, dev_hit, tl.where(miss, dst, out))
            tl.store(rows_row + c64 * stride_out_c, out, mask=cm)
            n_masked = tl.sum((cm & (out == -1)).to(tl.int32), axis=0)
            hits = K - n_masked - n_planned
            tl.store(stats_ptr + r64 * 3, hits)
            tl.store(stats_ptr + r64 * 3 + 1, n_planned)
            tl.store(stats_ptr + r64 * 3 + 2, n_masked)
            tl.store(miss_count_ptr + r64, n_fill)
            if HAS_COUNTERS:
                tl.atomic_add(counters_ptr, hits.to(tl.int64), sem="relaxed")
                tl.atomic_add(counters_ptr + stride_cnt, n_planned.to(tl.int64), sem="relaxed")
                tl.atomic_add(counters_ptr + 2 * stride_cnt, n_masked.to(tl.int64),
                              sem="relaxed")
            clean = tl.full([BLOCK_K], _EMPTY_K, tl.int32)
            tl.store(tkey + ent_c, clean, mask=placed_any)
            tl.store(tfirst + ent_c, clean, mask=placed_any)
            tl.store(tsrv + ent_c, clean, mask=placed_any)
    else:
        _padding_row(r64, rows_row, stride_out_c, miss_src_ptr, miss_dst_ptr, miss_count_ptr,
                     stats_ptr, touched_ptr, plan, K, SORT)
