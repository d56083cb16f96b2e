"""The hash resolve kernel: rows of up to 2,048 top-k columns against up to 4,096 hot slots.

Same contract, outputs and state as the sorted kernel (``kernels/resolve_sorted.py``) and the
torch reference, bit for bit; one program per row, no sort. ``kernels/resolve.py`` picks it
by shape (``HASH_MAX_WIDTH`` / ``HASH_MAX_SLOTS``, host rows that fit int32) and launches it
with its **fallback launch** behind it: a row this kernel cannot resolve exactly by hashing
(a bucket overflow, an LRU naming a slot twice, two slots holding one host row) is left
untouched, flagged in ``ResolveBuffers.fallback``, and the second launch (the sorted kernel
with ``FLAGGED=True``, same grid) resolves the flagged rows and returns at once for the
others. No host synchronisation, fixed grids: the pair is CUDA-graph capturable, and the
hash path carries none of the sorted code (its registers, layouts or barriers).

How hits are found: a per-row bucketed hash table in the workspace (``ResolveBuffers.table``,
``hash_table_words`` int32 words per row), keyed by the host rows of the row's top-k
columns (int32): ``NB = 2 x`` the top-k width rounded up to a power of two buckets, each
``PROBES`` (8) key slots and ``PROBES`` aux words (64 bytes), then ``NB`` bucket counters. A
host row's bucket is the top ``log2 NB`` bits of ``g * 0x9E3779B1 mod 2**32``. At top-k
2,048: 4,096 buckets, 272 KiB per row (keys + aux + counters; 16 MiB at 64 rows, against 24
MiB for the earlier 16x linear-probing table), load <= 1/16.

- **Insert** (one round, whatever the keys): every host column takes a slot of its bucket with
  one ``atomic_add`` on the bucket's counter and stores its host row there. No loop: the
  insertion costs the same for every row, the slowest of a batch included. A column whose
  slot number is ``>= PROBES`` stores nothing; if no column of the same host row got a slot
  the row overflows (``compile/insertion.py``: about one batch of 64 rows in 1,000 on
  uniformly random host rows, none in the simulated DeepSeek-V3.2 batches).
- **Canonical entry**: equal host rows (duplicate columns) take one slot each; the entry of a
  host row is the lowest slot of its bucket holding it, which every reader finds by scanning
  the bucket's ``PROBES`` slots (independent loads: one round trip).
- **aux** word of an entry: ``(0x7FFF - first column) << 16`` kept by ``atomic_max`` (so the
  earliest column wins; a clean word is ``INT32_MIN``) and, in its low 16 bits, ``slot + 1``
  of the valid LRU position holding the row (``atomic_or``; two positions holding one row
  mix their bits, and at least one of them reads back another value: the row falls back).
- After the lookups the key word of an entry holds its miss number.

Every word of a clean table is ``INT32_MIN`` (a counter counts from it: ``old ^ INT32_MIN``);
``ResolveWorkspace`` allocates the table so and every call resets the words it used (its
columns' counters, slots and entries), so no call clears a whole table and another call
shape (another layout of the same buffer) finds it clean. A call without a workspace clears
its one-off table first (``CLEAN_FIRST``).

Phases (``bar.sync`` between them; state row ``st``; ``p`` = LRU position):
1. Columns: classify (masked / resident / host row ``g``; the resident and host block loads
   side by side), insert. Positions: snapshot ``lru`` and ``slot_host_rows`` (what
   ``restore_resolve_state`` writes back), load each position's slot and the host row it
   holds, ``owner[slot] = p`` (plain stores).
2. Columns find their entry and ``atomic_max`` its first column. Positions read their slot's
   owner back (valid when it is them); valid positions find their held row's entry and
   ``atomic_or`` their slot into it.
3. Columns read their entry (hit: the serving slot; first miss: the entry's first column is
   theirs), positions read theirs back (serving when it is their slot). One packed scan over
   the columns numbers the first misses and counts overflowed columns; one packed sum over
   the positions counts invalid or unserving-found positions and serving ones. **Fallback**:
   an overflow, an invalid position or a host row held twice flags the row, resets its table
   words and ends the program (the row's state untouched). Otherwise the misses' numbers go
   to the key words, ``miss_src``.
4. The replacement policy (``_lru_replacement``, one tile): the new LRU order (one scatter),
   the filled slots' ``miss_dst`` and ``slot_host_rows``; miss columns read their number.
5. Miss columns read their slot's device row; every column's row is stored once; stats,
   counters; the row's table words are reset.

Offsets: element offsets (column x stride, page x stride, position x stride) are int32 when
the launcher found that every one fits (``OFF64=False``: one ``IMAD.WIDE`` per address), int64
otherwise; row bases are int64. Masks: ``FULL_K`` / ``FULL_H`` (the width and the slots are
the tile's) drop the lane masks. Ordering: as the sorted kernel (``bar.sync`` orders the
CTA's global accesses; every table word another thread wrote is read with a ``.cg`` load,
from L2, where the atomics resolve).

Cost (``hisparse_triton/compile/sass_model.py``, the compile report's ``model``, which costs
both launches of the pair): see docs/resolve.md, "Cost model".
"""

from __future__ import annotations

import triton
import triton.language as tl

from hisparse_triton.kernels.masks import _lanes
from hisparse_triton.kernels.resolve_policy import _lru_replacement
from hisparse_triton.kernels.resolve_sorted import _first_of_state, _padding_row
from hisparse_triton.ops.resolve.workspace import HASH_BUCKET_SLOTS, HASH_EMPTY

__all__ = ["EMPTY", "HASH_MUL", "PROBES"]

#: A clean table word (keys, aux words and bucket counters).
EMPTY = HASH_EMPTY
#: The multiplicative hash (Knuth's 2**32 / golden ratio); 0 sends every key to bucket 0
#: (tests use it to force a bucket overflow).
HASH_MUL = 0x9E3779B1
#: Key slots per bucket: the most keys a bucket takes, and the probes of every lookup (the
#: workspace sizes the table for it).
PROBES = HASH_BUCKET_SLOTS

_EMPTY_K = tl.constexpr(EMPTY)


@triton.jit
def _bucket(g, HASH_MUL: tl.constexpr, LOG2_NB: tl.constexpr):
    """``[N] int32`` bucket of host rows ``g`` (int32): the top ``LOG2_NB`` bits of
    ``g * HASH_MUL mod 2**32``."""
    x = g * (HASH_MUL - (1 << 32) if HASH_MUL >= (1 << 31) else HASH_MUL)
    return (x.to(tl.uint32, bitcast=True) >> (32 - LOG2_NB)).to(tl.int32)


@triton.jit
def _at(base, idx, stride, OFF64: tl.constexpr):
    """``base + idx * stride`` with the element offset in int32 (the launcher checked that
    every one fits) or, with ``OFF64``, in int64."""
    if OFF64:
        return base + idx.to(tl.int64) * stride
    else:
        return base + idx * stride


@triton.jit
def _within(x, lo, hi):
    """``lo <= x < hi`` for int32 ``x`` and ``lo <= hi`` (one unsigned compare; ``lo`` and
    ``hi`` may be Python ints, as Triton passes an argument equal to 1)."""
    span = tl.zeros_like(x) + (hi - lo)  # a tensor even when both bounds are constants
    return (x - lo).to(tl.uint32, bitcast=True) < span.to(tl.uint32, bitcast=True)


@triton.jit
def _divmod(x, D: tl.constexpr):
    """``(x // D, x % D)`` of a non-negative int32 ``x`` (unsigned: a shift and a mask when
    ``D`` is a power of two)."""
    u = x.to(tl.uint32, bitcast=True)
    return (u // D).to(tl.int32, bitcast=True), (u % D).to(tl.int32, bitcast=True)


@triton.jit
def _slot_row32(hot_row, stride_hot_b, slot, mask, num_device_blocks,
                BLOCK_SIZE: tl.constexpr, OFF64: tl.constexpr):
    """Device row of hot slot ``slot`` (int32 in ``[0, H)`` where ``mask``) of the row's hot
    region: the low 32 bits of the int64 row, which the int32 output keeps anyway; -1 for a
    bad hot block."""
    blk_i, blk_off = _divmod(slot, BLOCK_SIZE)
    blk = tl.load(_at(hot_row, blk_i, stride_hot_b, OFF64), mask=mask, other=0)
    return tl.where(mask & _within(blk, 1, num_device_blocks), blk * BLOCK_SIZE + blk_off, -1)


@triton.jit
def _entry_of(table, kw, key, PROBES: tl.constexpr):
    """Per lane, the lowest slot ``j < PROBES`` of the bucket whose first key word is ``kw``
    (an int32 word index per lane) holding ``key``, else -1 (``PROBES`` independent loads)."""
    kb = table + kw
    ent = tl.full(key.shape, -1, tl.int32)
    for i in tl.static_range(PROBES):
        j = PROBES - 1 - i  # the last assignment (the lowest slot) wins
        kk = tl.load(kb + j, cache_modifier=".cg")
        ent = tl.where(kk == key, j, ent)
    return ent


@triton.jit
def _resolve_hash_kernel(
    topk_ptr, state_rows_ptr, seq_lens_ptr, resident_ptr, host_ptr, hot_ptr, slot_rows_ptr,
    lru_ptr,
    rows_ptr, miss_src_ptr, miss_dst_ptr, miss_count_ptr, stats_ptr,
    touched_ptr, old_rows_ptr, old_lru_ptr, owner_ptr, fallback_ptr, counters_ptr, table_ptr,
    K, S, P, H,
    stride_tk_r, stride_tk_c, stride_sr, stride_seq, stride_res_s, stride_res_p,
    stride_host_s, stride_host_p, stride_hot_s, stride_hot_b, stride_shr_s, stride_shr_h,
    stride_lru_s, stride_lru_h, stride_out_r, stride_out_c, stride_cnt, stride_table,
    num_device_blocks, num_host_blocks,
    BLOCK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr, HAS_COUNTERS: tl.constexpr, LOG2_NB: tl.constexpr,
    PROBES: tl.constexpr, HASH_MUL: tl.constexpr, FULL_K: tl.constexpr, FULL_H: tl.constexpr,
    POS64: tl.constexpr, OFF64: tl.constexpr, CLEAN_FIRST: tl.constexpr,
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
        num_host_rows = num_host_blocks * BLOCK_SIZE  # < 2**31 - 1 (the dispatch)
        tkey = table_ptr + r64 * stride_table      # bucket b: keys at b * 2P, aux at + P
        tcnt = tkey + ((2 * PROBES) << LOG2_NB)     # the bucket counters
        if CLEAN_FIRST:  # a one-off table (a call without a workspace): not clean yet
            for w0 in tl.static_range(0, (2 * PROBES + 1) << LOG2_NB, BLOCK_H):
                w = w0 + tl.arange(0, BLOCK_H)
                tl.store(tkey + w, tl.full([BLOCK_H], _EMPTY_K, tl.int32),
                         mask=w < ((2 * PROBES + 1) << LOG2_NB))
            tl.debug_barrier()

        # Phase 1: columns (classify, insert); positions (snapshot, slots, held rows,
        # slot owners by plain stores).
        c = tl.max_contiguous(tl.arange(0, BLOCK_K), 1)  # one layout for every column op
        if FULL_K:
            cm = tl.full([BLOCK_K], True, tl.int1)
        else:
            cm = c < K
        seq = tl.load(seq_lens_ptr + st64 * stride_seq)
        pos = tl.load(_at(topk_ptr + r64 * stride_tk_r, c, stride_tk_c, OFF64), mask=cm,
                      other=-1)
        if POS64:  # int64 / uint64 / uint32 positions: compared as int64
            pos = pos.to(tl.int64)
            in_seq = cm & (pos >= 0) & (pos < seq.to(tl.int64))
        else:
            pos = pos.to(tl.int32)
            in_seq = cm & (pos >= 0) & (pos < seq)
        page, off = _divmod(tl.where(in_seq, pos, 0).to(tl.int32), BLOCK_SIZE)
        inr = in_seq & (page < P)
        rb = tl.load(_at(resident_ptr + st64 * stride_res_s, page, stride_res_p, OFF64),
                     mask=inr, other=0)
        hb = tl.load(_at(host_ptr + st64 * stride_host_s, page, stride_host_p, OFF64),
                     mask=inr, other=0)  # beside the resident load, not after it
        res = inr & _within(rb, 1, num_device_blocks)
        hok = inr & ~res & _within(hb, 1, num_host_blocks)
        g = tl.where(hok, hb * BLOCK_SIZE + off, 0)  # host rows are >= 1: 0 matches no key
        # Resident and masked columns' rows now (a resident row is >= BLOCK_SIZE: the
        # contract keeps device rows in int32); host columns' in phase 5.
        tl.store(_at(rows_row, c, stride_out_c, OFF64), tl.where(res, rb * BLOCK_SIZE + off, -1),
                 mask=cm & ~hok)
        lost = cm & ~res & ~hok  # masked columns
        kw = _bucket(g, HASH_MUL, LOG2_NB) * (2 * PROBES)  # the bucket's first key word
        took = tl.atomic_add(tcnt + kw // (2 * PROBES), 1, mask=hok, sem="relaxed") ^ _EMPTY_K
        own = hok & (took < PROBES)
        own_w = kw + tl.where(own, took, 0)  # the column's own key word (where ``own``)
        tl.store(tkey + own_w, g, mask=own)

        p = tl.max_contiguous(tl.arange(0, BLOCK_H), 1)
        if FULL_H:
            pm = tl.full([BLOCK_H], True, tl.int1)
        else:
            pm = p < H
        slot = tl.load(_at(lru_row, p, stride_lru_h, OFF64), mask=pm, other=-1)
        tl.store(old_lru_ptr + scr_h + p, slot, mask=pm)
        tl.store(old_rows_ptr + scr_h + p, tl.load(_at(shr_row, p, stride_shr_h, OFF64),
                                                   mask=pm), mask=pm)
        sv = pm & _within(slot, 0, H)
        slot_s = tl.where(sv, slot, -1)  # the slot, -1: none (positions carry no predicate)
        held = tl.load(_at(shr_row, slot_s, stride_shr_h, OFF64), mask=sv, other=-1)
        # Slot owners: one plain store per position; a slot named twice (a corrupted lru)
        # reads back another position's number and sends the row to the fallback.
        tl.store(owner_ptr + scr_h + slot_s, p, mask=sv)
        tl.store(touched_ptr + r64, 1)
        tl.debug_barrier()

        # Phase 2: columns find their entry, keep its first column; valid positions find
        # their held row's entry and put their slot in it.
        ent = _entry_of(tkey, kw, g, PROBES)
        found_c = ent >= 0  # (only host columns: g = 0 matches no key)
        ew = kw + tl.where(found_c, ent, 0)  # the entry's key word; its aux word is + PROBES
        tl.atomic_max(tkey + ew + PROBES, (0x7FFF - c) << 16, mask=found_c, sem="relaxed")
        first_p = tl.load(owner_ptr + scr_h + tl.maximum(slot_s, 0), cache_modifier=".cg")
        slot_v = tl.where((slot_s >= 0) & (first_p == p), slot_s, -1)  # valid positions'
        hh = tl.where((slot_v >= 0) & _within(held, 0, num_host_rows), held, 0)
        kwp = _bucket(hh, HASH_MUL, LOG2_NB) * (2 * PROBES)
        ent_p = _entry_of(tkey, kwp, hh, PROBES)
        ewp = tl.where(ent_p >= 0, kwp + ent_p, -1)  # the held row's entry, -1: none
        tl.atomic_or(tkey + tl.maximum(ewp, 0) + PROBES, slot_v + 1, mask=ewp >= 0,
                     sem="relaxed")
        tl.debug_barrier()

        # Phase 3: hits and first misses of the columns; serving positions; fallback?
        aux = tl.load(tkey + ew + PROBES, cache_modifier=".cg")  # (in the table)
        srv = (aux & 0xFFFF) - 1                                   # the serving slot, -1: none
        hit = found_c & (srv >= 0)
        first_miss = found_c & (srv < 0) & ((0x7FFF - (aux >> 16)) == c)
        over = hok & ~found_c
        scan = tl.cumsum(first_miss.to(tl.int32) + (over.to(tl.int32) << 16), axis=0)
        aux_p = tl.load(tkey + tl.maximum(ewp, 0) + PROBES, cache_modifier=".cg")
        serving = (ewp >= 0) & ((aux_p & 0xFFFF) == slot_v + 1)
        bad = pm & ((slot_v < 0) | ((ewp >= 0) & ~serving))
        counts = tl.sum(bad.to(tl.int32) + (serving.to(tl.int32) << 16), axis=0)
        totals = tl.max(scan, axis=0)  # (the scan is non-decreasing)
        n_serving = counts >> 16
        fall = ((totals >> 16) > 0) | ((counts & 0xFFFF) > 0)
        tl.store(fallback_ptr + r64, fall.to(tl.int32))
        # A bucket overflow, a slot named twice or a host row held twice: the row is left to
        # the fallback launch (its state untouched); its table words are reset below.
        if fall == 0:
            srv_c = tl.where(hit, srv, 0)
            dev_hit = _slot_row32(hot_row, stride_hot_b, srv_c, hit, num_device_blocks,
                                  BLOCK_SIZE, OFF64)
            miss = found_c & ~hit  # found_c == hok here (no overflow)
            mnum = (scan & 0xFFFF) - 1
            n_miss = totals & 0xFFFF
            n_evict = H - n_serving  # every position is valid here
            n_fill = tl.minimum(n_miss, n_evict)
            gk = tl.load(tkey + ew, mask=first_miss, other=0, cache_modifier=".cg")  # == g
            tl.store(tkey + ew, mnum, mask=first_miss)  # the key word: the miss number
            tl.store(miss_src_ptr + plan + c, tl.full([BLOCK_K], -1, tl.int32),
                     mask=cm & (c >= n_fill))
            tl.store(miss_src_ptr + plan + mnum, gk, mask=first_miss & (mnum < n_fill))
            tl.debug_barrier()

            # Phase 4: the replacement policy; fills; miss columns' numbers.
            cls = tl.where(pm, serving.to(tl.int32), 3)
            zero = r * 0
            new_pos, filled, erank, _, _ = _lru_replacement(cls, p, n_evict, n_serving,
                                                            n_fill, zero, zero, False)
            active = (n_serving + n_fill) > 0
            ok = pm & _lanes(active, p) & (new_pos >= 0) & (new_pos < H)
            tl.store(_at(lru_row, new_pos, stride_lru_h, OFF64), slot_v, mask=ok)  # all valid
            src = tl.load(miss_src_ptr + plan + erank, mask=filled, other=-1)
            dev_f = _slot_row32(hot_row, stride_hot_b, slot_v, filled, num_device_blocks,
                                BLOCK_SIZE, OFF64)
            tl.store(miss_dst_ptr + plan + erank, dev_f, mask=filled)
            tl.store(_at(shr_row, slot_v, stride_shr_h, OFF64), src, mask=filled)
            tl.store(miss_dst_ptr + plan + c, tl.full([BLOCK_K], -1, tl.int32),
                     mask=cm & (c >= n_fill))
            m = tl.load(tkey + ew, mask=miss, other=-1, cache_modifier=".cg")
            tl.debug_barrier()

            # Phase 5: the rows, stats, counters.
            dst = tl.load(miss_dst_ptr + plan + m, mask=miss & (m < n_fill), other=-1)
            out = tl.where(hit, dev_hit, dst)
            tl.store(_at(rows_row, c, stride_out_c, OFF64), out, mask=hok)
            # a first miss with a device row is a planned miss (its entry's filled slot)
            counts = tl.sum((lost | (hok & (out == -1))).to(tl.int32)
                            + ((first_miss & (out != -1)).to(tl.int32) << 16), axis=0)
            n_masked = counts & 0xFFFF
            n_planned = counts >> 16
            hits = K - n_masked - n_planned
            tl.store(stats_ptr + r64 * 3, hits)
            tl.store(stats_ptr + r64 * 3 + 1, n_planned)
            tl.store(stats_ptr + r64 * 3 + 2, n_masked)
            tl.store(miss_count_ptr + r64, n_fill)
            if HAS_COUNTERS:
                tl.atomic_add(counters_ptr, hits.to(tl.int64), sem="relaxed")
                tl.atomic_add(counters_ptr + stride_cnt, n_planned.to(tl.int64),
                              sem="relaxed")
                tl.atomic_add(counters_ptr + 2 * stride_cnt, n_masked.to(tl.int64),
                              sem="relaxed")
        # Reset the row's table words, each by the column that owns the slot: its key and aux
        # words (every entry is an owned slot) and its bucket's counter (every bucket a
        # column reached has an owner: the column that took slot 0).
        clean = tl.full([BLOCK_K], _EMPTY_K, tl.int32)
        tl.store(tcnt + own_w // (2 * PROBES), clean, mask=own)
        tl.store(tkey + own_w, clean, mask=own)
        tl.store(tkey + own_w + PROBES, clean, mask=own)
    else:
        tl.store(fallback_ptr + r64, 0)
        _padding_row(r64, rows_row, stride_out_c, miss_src_ptr, miss_dst_ptr, miss_count_ptr,
                     stats_ptr, touched_ptr, plan, K, BLOCK_K)
