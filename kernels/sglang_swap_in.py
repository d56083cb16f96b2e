"""SGLang 0.5.23's HiSparse swap-in in SGLang's own state layout:
``load_cache_to_device_buffer_mla`` (one resolve launch, then one copy launch) and
``copy_cache_planned_mla`` (one copy launch).

Semantics: ``hisparse_triton.integrations.sglang_reference`` (the torch model these kernels
match bit for bit); this module says how the device computes them.

Resolve: grid ``(batch,)``, one program per row of ``top_k_tokens``; it reads SGLang's tables
where they are (``device_buffer_tokens`` / ``device_buffer_locs`` / ``lru_slots`` /
``host_cache_locs`` rows of ``req_pool_indices[row]``), so nothing is rebuilt on the host.
Padding rows (``row >= num_real_reqs[0]``) write -1; short rows (``seq_len <= H``) read
``device_buffer_locs`` at the positions. A long row:

1. the newest position's columns take slot H's locs; the other valid columns are sorted as
   keys ``position * W + column`` (``W``: top-k rounded up to a power of two; invalid columns
   get sentinel keys), one ``tl.sort``; the sorted keys go to the row's scratch, and each
   column's class (the first column of its position, a later duplicate, or ignored) to a
   column-indexed scratch;
2. per LRU position (tiles of ``BLOCK_H``): the slot's held position is binary-searched among
   the keys; a hit records its position in its column (``atomic_min``: the least recently
   used of two slots holding one position serves), evictable positions are ranked in LRU
   order (``tl.cumsum``) into a rank-indexed scratch;
3. per column: hits read their slot's locs; misses are numbered in column order
   (``tl.cumsum``), miss ``m`` takes the ``m``-th evictable slot (slot table, output, plan
   entry ``m``), the row's miss count is written;
4. the LRU is rewritten with one scatter per tile (stale evictables, filled slots, hits).

Phases hand data over through global scratch separated by ``tl.debug_barrier()``; the
atomically written class scratch is read with ``.cg`` loads. Every index is masked into its
tensor, in int64. The scratch is allocated per call from torch's caching allocator
(stream-ordered): ``batch * (W * (8 | 12) + H * 12)`` bytes, plus the miss plan
(``batch * (K * 12 + 4)`` bytes) when the caller records none.

Copy: grid-stride over work items of ``COLS`` plan columns of one plan row, numbered
column-chunk-major (the first columns of every row, where the misses are, spread over all
programs), the grid capped at ``GRID_PROGRAMS_PER_SM`` programs per SM so its parallelism
does not depend on the batch. Rows move as ``CHUNK`` words per step (int32 words, 16-byte
accesses when the rows and both pools are 16-byte aligned); a host row outside the host pool
zero-fills, a device row outside the device pool is skipped; only rows below
``num_real_reqs[0]`` and columns below their count move. The host pool is pinned CPU memory
on CUDA (checked once per tensor), read through unified addressing.

The launchers check arguments (``sglang_checks``, memoised per layout) and read no tensor
values: CUDA-graph safe.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from hisparse_triton.integrations.sglang_checks import (
    MAX_TOP_K,
    check_copy_planned,
    check_swap_in,
)
from hisparse_triton.integrations.vllm_checks import checked
from hisparse_triton.kernels.gather import (
    GRID_PROGRAMS_PER_SM,
    device_guard,
    sm_count,
    validate_pool,
)
from hisparse_triton.kernels.launch_config import (
    KernelLaunch,
    check_launch,
    current_target,
    resolve_launch_warps,
)
from hisparse_triton.kernels.lru_order import lru_positions
from hisparse_triton.kernels.resolve_sorted import _lower_bound  # noqa: F401 (jit helper)

__all__ = ["MAX_TOP_K", "copy_cache_planned_mla", "load_cache_to_device_buffer_mla",
           "planned_copy_launch", "swap_in_launches"]

#: Most LRU positions handled per step (the rank packing needs < 2**16).
MAX_BLOCK_H = 4096
_COLS = 8
_CHUNK_WORDS = 64

_BIG_K = tl.constexpr(2**31 - 1)   # class of a first column not (yet) hit
_DUP_K = tl.constexpr(-2)          # class of a later column repeating a position
_SENTINEL64_K = tl.constexpr(1 << 62)


@triton.jit
def _row_of(ptr, row, stride):
    return ptr + row.to(tl.int64) * stride


@triton.jit
def _swap_in_resolve_kernel(
    tk_ptr, stride_tk, stride_tk_c, out_ptr, stride_out, stride_out_c,
    dbt_ptr, stride_dbt, stride_dbt_c, dbl_ptr, stride_dbl, stride_dbl_c,
    hcl_ptr, stride_hcl, stride_hcl_c, lru_ptr, stride_lru, stride_lru_c,
    rpi_ptr, sl_ptr, nrr_ptr,
    src_ptr, stride_src, stride_src_c, dst_ptr, stride_dst, stride_dst_c, cnt_ptr,
    keys_ptr, cls_ptr, old_ptr, hit_ptr, evict_ptr,
    batch, K, H, S, width, context,
    W: tl.constexpr, LOG2_W: tl.constexpr, BLOCK_H: tl.constexpr, KEY64: tl.constexpr,
    HAS_NRR: tl.constexpr,
):
    b = tl.program_id(0)
    b64 = b.to(tl.int64)
    i = tl.arange(0, W)
    im = i < K
    out_at = _row_of(out_ptr, b, stride_out) + i.to(tl.int64) * stride_out_c
    neg = tl.full([W], -1, tl.int32)
    if HAS_NRR:
        real = tl.load(nrr_ptr)
    else:
        real = batch
    if b >= real:
        tl.store(out_at, neg, mask=im)
    else:
        rid = tl.load(rpi_ptr + b64).to(tl.int64)
        seq_len = tl.load(sl_ptr + b64).to(tl.int64)
        if (rid < 0) | (rid >= S):
            tl.store(out_at, neg, mask=im)
            tl.store(cnt_ptr + b64, 0)
        elif seq_len <= H:
            # Short row: slot p holds position p.
            t = tl.load(_row_of(tk_ptr, b, stride_tk) + i.to(tl.int64) * stride_tk_c,
                        mask=im, other=-1)
            ok = im & (i < seq_len) & (t >= 0) & (t < width)
            loc = tl.load(dbl_ptr + rid * stride_dbl + tl.where(ok, t, 0).to(tl.int64)
                          * stride_dbl_c, mask=ok, other=-1)
            tl.store(out_at, tl.where(ok, loc, -1), mask=im)
            tl.store(cnt_ptr + b64, 0)
        else:
            dbl_row = dbl_ptr + rid * stride_dbl
            dbt_row = dbt_ptr + rid * stride_dbt
            lru_row = lru_ptr + rid * stride_lru
            keys_row = keys_ptr + b64 * W
            cls_row = cls_ptr + b64 * W
            old_row = old_ptr + b64 * H
            hit_row = hit_ptr + b64 * H
            evict_row = evict_ptr + b64 * H
            # Phase 1: the newest position's columns; sort the other valid columns.
            t = tl.load(_row_of(tk_ptr, b, stride_tk) + i.to(tl.int64) * stride_tk_c,
                        mask=im, other=-1)
            newest = (seq_len - 1).to(tl.int32)
            is_new = im & (t == newest)
            newest_loc = tl.load(dbl_row + tl.cast(H, tl.int64) * stride_dbl_c)
            tl.store(out_at, newest_loc + tl.zeros([W], tl.int32), mask=is_new)
            valid = im & ~is_new & (t >= 0) & (t < context)
            if KEY64:
                key = tl.where(valid, t.to(tl.int64) * W + i, i.to(tl.int64) + _SENTINEL64_K)
                sentinel = _SENTINEL64_K
            else:
                key = tl.where(valid, t * W + i, i + (2147483648 - W))
                sentinel = 2147483648 - W
            key = tl.sort(key)
            tl.store(keys_row + i, key)
            prev = tl.gather(key, tl.maximum(i - 1, 0), 0)
            first = (i == 0) | ((prev >> LOG2_W) != (key >> LOG2_W))
            cls = tl.where(key < sentinel, tl.where(first, _BIG_K, _DUP_K), -1)
            tl.store(cls_row + (key & (W - 1)).to(tl.int32), cls.to(tl.int32))
            tl.debug_barrier()
            # Phase 2: LRU positions: hit (held position among the keys) or evictable.
            n_evict = b * 0
            for h0 in range(0, H, BLOCK_H):
                p = h0 + tl.arange(0, BLOCK_H)
                pm = p < H
                slot = tl.load(lru_row + p.to(tl.int64) * stride_lru_c, mask=pm,
                               other=-1).to(tl.int32)
                tl.store(old_row + p, slot, mask=pm)
                sok = pm & (slot >= 0) & (slot < width)
                held = tl.load(dbt_row + tl.where(sok, slot, 0).to(tl.int64) * stride_dbt_c,
                               mask=sok, other=-1)
                hok = sok & (held >= 0) & (held < context)
                if KEY64:
                    target = tl.where(hok, held, 0).to(tl.int64) * W
                else:
                    target = tl.where(hok, held, 0) * W
                lo = _lower_bound(target, keys_row, target, W, LOG2_W, False)
                found_key = tl.load(keys_row + lo)
                found = hok & (found_key < sentinel) & ((found_key >> LOG2_W) == held)
                tl.atomic_min(cls_row + (found_key & (W - 1)).to(tl.int32), p, mask=found,
                              sem="relaxed")
                tl.store(hit_row + p, found.to(tl.int32), mask=pm)
                ev = pm & ~found
                rank = n_evict + tl.cumsum(ev.to(tl.int32), axis=0) - 1
                tl.store(evict_row + tl.where(ev, rank, 0), slot, mask=ev)
                n_evict += tl.sum(ev.to(tl.int32), axis=0)
            tl.debug_barrier()
            # Phase 3: hits read their slot's locs; misses take evictable slots in order.
            cls = tl.load(cls_row + i, mask=im, other=-1, cache_modifier=".cg")
            served = im & (cls >= 0) & (cls != _BIG_K)
            miss = im & ((cls == _BIG_K) | (cls == _DUP_K))
            hit_slot = tl.load(old_row + tl.where(served, cls, 0), mask=served, other=-1,
                               cache_modifier=".cg")
            hit_loc = tl.load(dbl_row + tl.where(served, hit_slot, 0).to(tl.int64)
                              * stride_dbl_c, mask=served, other=-1)
            m = tl.cumsum(miss.to(tl.int32), axis=0) - 1
            n_miss = tl.sum(miss.to(tl.int32), axis=0)
            take = miss & (m < n_evict)
            victim = tl.load(evict_row + tl.where(take, m, 0), mask=take, other=-1,
                             cache_modifier=".cg")
            sok = take & (victim >= 0) & (victim < width)
            at = tl.where(sok, victim, 0).to(tl.int64)
            loc = tl.load(dbl_row + at * stride_dbl_c, mask=sok, other=-1)
            tl.store(dbt_row + at * stride_dbt_c, t, mask=sok)
            tl.store(out_at, tl.where(served, hit_loc, tl.where(take, loc, -1)),
                     mask=served | miss)
            mm = tl.where(take, m, 0).to(tl.int64)
            src = tl.load(hcl_ptr + rid * stride_hcl + tl.where(take, t, 0).to(tl.int64)
                          * stride_hcl_c, mask=take, other=-1)
            tl.store(_row_of(src_ptr, b, stride_src) + mm * stride_src_c, src, mask=take)
            tl.store(_row_of(dst_ptr, b, stride_dst) + mm * stride_dst_c, loc, mask=take)
            filled = tl.minimum(n_miss, n_evict)
            tl.store(cnt_ptr + b64, filled)
            tl.debug_barrier()
            # Phase 4: the new LRU order (stale evictables, filled slots, hits).
            ev_carry = b * 0
            hit_carry = b * 0
            for h0 in range(0, H, BLOCK_H):
                p = h0 + tl.arange(0, BLOCK_H)
                pm = p < H
                hit = pm & (tl.load(hit_row + p, mask=pm, other=0, cache_modifier=".cg") != 0)
                ev = pm & ~hit
                slot = tl.load(old_row + p, mask=pm, other=-1, cache_modifier=".cg")
                new_pos, ev_carry, hit_carry = lru_positions(ev, hit, ev_carry, hit_carry,
                                                             filled, n_evict)
                ok = pm & (new_pos >= 0) & (new_pos < H)
                tl.store(lru_row + tl.where(ok, new_pos, 0).to(tl.int64) * stride_lru_c,
                         slot.to(tl.int16), mask=ok)


@triton.jit
def _copy_planned_kernel(
    host_ptr, dev_ptr, src_ptr, stride_src, stride_src_c, dst_ptr, stride_dst, stride_dst_c,
    cnt_ptr, nrr_ptr, R, C, num_items, host_rows, device_rows, row_words,
    COLS: tl.constexpr, CHUNK: tl.constexpr, VEC: tl.constexpr, HAS_NRR: tl.constexpr,
):
    """Copy host row ``src[r, c]`` to device row ``dst[r, c]`` for ``r < num_real_reqs[0]``
    (and ``< R``) and ``c < cnt[r]`` (and ``< C``)."""
    if HAS_NRR:
        rows = tl.minimum(tl.load(nrr_ptr), R)
    else:
        rows = R
    col_offs = tl.arange(0, COLS)
    word_offs = tl.arange(0, CHUNK)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        row = item % R
        c = (item // R) * COLS + col_offs
        # row < R <= the counts' length: the load is in bounds; a padding row's count (stale)
        # is read and replaced by 0.
        count = tl.minimum(tl.maximum(tl.load(cnt_ptr + row), 0), C)
        live = c < tl.where(row < rows, count, 0)
        cc = c.to(tl.int64)
        src = tl.load(_row_of(src_ptr, row, stride_src) + cc * stride_src_c, mask=live,
                      other=-1)
        dst = tl.load(_row_of(dst_ptr, row, stride_dst) + cc * stride_dst_c, mask=live,
                      other=-1).to(tl.int64)
        ok = live & (dst >= 0) & (dst < device_rows)
        have = ok & (src >= 0) & (src < host_rows)
        src_word = tl.multiple_of(tl.where(have, src, 0) * row_words, VEC)
        dst_word = tl.multiple_of(tl.where(ok, dst, 0) * row_words, VEC)
        for w0 in range(0, row_words, CHUNK):
            w = w0 + word_offs
            wm = (w < row_words)[None, :]
            vals = tl.load(host_ptr + src_word[:, None] + w[None, :], mask=have[:, None] & wm,
                           other=0, cache_modifier=".cg")
            tl.store(dev_ptr + dst_word[:, None] + w[None, :], vals, mask=ok[:, None] & wm)


# --------------------------------------------------------------------------------- launchers


def _check_backend(device: torch.device) -> None:
    """Refuse CPU tensors outside Triton's interpreter."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"the SGLang swap-in Triton kernels need CUDA tensors (got "
                           f"{device}), or TRITON_INTERPRET=1 set before import to run on "
                           "the CPU")


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class _ResolveShape(NamedTuple):
    """Constexprs and scratch sizes of one ``(batch, K, H, context)`` call (memoised)."""

    constexprs: dict
    n32: int   # int32 scratch words (class, LRU copies, hit flags, ranks; int32 keys)
    n64: int   # int64 scratch words (int64 keys)


_SHAPES: dict[tuple, _ResolveShape] = {}


def _resolve_shape(device: torch.device, batch: int, K: int, H: int, context: int,
                   block_h: Optional[int]) -> _ResolveShape:
    key = (device, current_target(device), batch, K, H, context, block_h)
    shape = _SHAPES.get(key)
    if shape is None:
        W = max(16, _pow2(K))
        bh = min(_pow2(max(H, 16)), block_h or MAX_BLOCK_H)
        key64 = (context + 1) * W > 2**31
        warps = resolve_launch_warps(max(W, bh), device=device)
        n32 = batch * W * (1 if key64 else 2) + 3 * batch * H
        shape = _SHAPES[key] = _ResolveShape(
            dict(W=W, LOG2_W=W.bit_length() - 1, BLOCK_H=bh, KEY64=key64, num_warps=warps),
            n32, batch * W if key64 else 0)
    return shape


def _resolve_launch(top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs,
                    top_k_device_locs, req_pool_indices, seq_lens, lru_slots, num_real_reqs,
                    g, miss_src, miss_dst, miss_count, block_h: Optional[int]) -> KernelLaunch:
    """The swap-in's resolve launch (its scratch allocated here), not yet made."""
    device = top_k_tokens.device
    shape = _resolve_shape(device, g.batch, g.top_k, g.hot, g.context, block_h)
    W = shape.constexprs["W"]
    scr32 = torch.empty(shape.n32, dtype=torch.int32, device=device)
    scr64 = torch.empty(shape.n64, dtype=torch.int64, device=device) if shape.n64 else None
    bw, bh = g.batch * W, g.batch * g.hot
    if scr64 is not None:
        keys, rest = scr64, scr32
    else:
        keys, rest = scr32[:bw], scr32[bw:]
    cls, old, hit, evict = rest[:bw], rest[bw:bw + bh], rest[bw + bh:bw + 2 * bh], \
        rest[bw + 2 * bh:]
    args = (
        top_k_tokens, top_k_tokens.stride(0), top_k_tokens.stride(1),
        top_k_device_locs, top_k_device_locs.stride(0), top_k_device_locs.stride(1),
        device_buffer_tokens, device_buffer_tokens.stride(0), device_buffer_tokens.stride(1),
        device_buffer_locs, device_buffer_locs.stride(0), device_buffer_locs.stride(1),
        host_cache_locs, host_cache_locs.stride(0), host_cache_locs.stride(1),
        lru_slots, lru_slots.stride(0), lru_slots.stride(1),
        req_pool_indices, seq_lens,
        num_real_reqs if num_real_reqs is not None else seq_lens,
        miss_src, miss_src.stride(0), miss_src.stride(1),
        miss_dst, miss_dst.stride(0), miss_dst.stride(1), miss_count,
        keys, cls, old, hit, evict,
        g.batch, g.top_k, g.hot, g.states, g.width, g.context)
    return KernelLaunch(_swap_in_resolve_kernel, (g.batch,), args,
                        dict(HAS_NRR=num_real_reqs is not None, **shape.constexprs))


def _byte_rows(pool: torch.Tensor, rows: int, item: int, word: int) -> torch.Tensor:
    flat = pool.reshape(-1).view(torch.uint8)[: rows * item]
    return flat.view(torch.int32) if word == 4 else flat


def planned_copy_launch(miss_src, miss_dst, miss_count, num_real_reqs, host_cache,
                        device_buffer, item: int, rows: int, columns: int, host_rows: int,
                        device_rows: int) -> Optional[KernelLaunch]:
    """The copy launch of a miss plan (the swap-in's and the follower replay's), not yet
    made; None when there is nothing to copy."""
    if rows == 0 or columns == 0 or device_rows == 0:
        return None
    device = miss_src.device
    if device.type == "cuda":
        validate_pool(host_cache, device)
    word = 4 if item % 4 == 0 and host_cache.data_ptr() % 4 == 0 \
        and device_buffer.data_ptr() % 4 == 0 else 1
    vec = 4 if word == 4 and item % 16 == 0 and host_cache.data_ptr() % 16 == 0 \
        and device_buffer.data_ptr() % 16 == 0 else 1
    row_words = item // word
    items = rows * -(-columns // _COLS)
    programs = GRID_PROGRAMS_PER_SM * sm_count(device)
    check_launch("copy_cache_planned", 4, device)
    host = _byte_rows(host_cache, max(host_rows, 1), item, word) if host_rows else \
        _byte_rows(device_buffer, 1, item, word)
    args = (host, _byte_rows(device_buffer, device_rows, item, word),
            miss_src, miss_src.stride(0), miss_src.stride(1),
            miss_dst, miss_dst.stride(0), miss_dst.stride(1), miss_count,
            num_real_reqs if num_real_reqs is not None else miss_count,
            rows, columns, items, host_rows, device_rows, row_words)
    return KernelLaunch(_copy_planned_kernel, (max(1, min(items, programs)),), args,
                        dict(COLS=_COLS, CHUNK=min(_CHUNK_WORDS, _pow2(row_words)), VEC=vec,
                             HAS_NRR=num_real_reqs is not None, num_warps=4))


def _launch(launch: Optional[KernelLaunch], like: torch.Tensor) -> None:
    """Make ``launch`` (None: nothing) on ``like``'s device."""
    if launch is not None:
        with device_guard(like):
            launch()


def load_cache_to_device_buffer_mla(
        top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache,
        device_buffer, top_k_device_locs, req_pool_indices, seq_lens, lru_slots,
        item_size_bytes: int, num_top_k: int, hot_buffer_size: int, page_size: int = 1,
        block_size: int = 256, num_real_reqs=None, miss_src=None, miss_dst=None,
        miss_count=None, skip_io: bool = False, *, block_h: Optional[int] = None) -> None:
    """Triton ``load_cache_to_device_buffer_mla`` (SGLang's argument order; semantics of
    ``sglang_reference.load_cache_to_device_buffer_mla``): one resolve launch and, unless
    ``skip_io``, one copy launch; no host synchronisation. ``block_h`` (a power of two)
    shrinks the LRU tile (tests use it to run several LRU steps)."""
    resolve, copy = swap_in_launches(
        top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache,
        device_buffer, top_k_device_locs, req_pool_indices, seq_lens, lru_slots,
        item_size_bytes, num_top_k, hot_buffer_size, page_size, block_size, num_real_reqs,
        miss_src, miss_dst, miss_count, skip_io, block_h=block_h)
    if resolve is None:
        return
    if top_k_tokens.device.type != "cuda":
        _check_backend(top_k_tokens.device)
    _launch(resolve, top_k_tokens)
    _launch(copy, top_k_tokens)


def swap_in_launches(
        top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache,
        device_buffer, top_k_device_locs, req_pool_indices, seq_lens, lru_slots,
        item_size_bytes: int, num_top_k: int, hot_buffer_size: int, page_size: int = 1,
        block_size: int = 256, num_real_reqs=None, miss_src=None, miss_dst=None,
        miss_count=None, skip_io: bool = False, *, block_h: Optional[int] = None
        ) -> tuple[Optional[KernelLaunch], Optional[KernelLaunch]]:
    """The ``(resolve, copy)`` launches ``load_cache_to_device_buffer_mla`` makes for these
    arguments (checked as it checks them; a miss plan allocated when none is given), not yet
    made: ``(None, None)`` for an empty batch, ``copy`` None with ``skip_io`` or nothing to
    copy."""
    g = checked(check_swap_in, (
        top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache,
        device_buffer, top_k_device_locs, req_pool_indices, seq_lens, lru_slots,
        item_size_bytes, num_top_k, hot_buffer_size, num_real_reqs, miss_src, miss_dst,
        miss_count))
    if g.top_k > MAX_TOP_K:
        raise ValueError(f"load_cache_to_device_buffer_mla: num_top_k={g.top_k} is over "
                         f"{MAX_TOP_K}, the most one sort of the Triton resolve handles")
    if g.batch == 0:
        return None, None
    device = top_k_tokens.device
    if not g.plan:
        plan32 = torch.empty(g.batch * (g.top_k + 1), dtype=torch.int32, device=device)
        miss_src = torch.empty(g.batch, g.top_k, dtype=torch.int64, device=device)
        miss_dst = plan32[: g.batch * g.top_k].view(g.batch, g.top_k)
        miss_count = plan32[g.batch * g.top_k:]
    copy = None if skip_io else planned_copy_launch(
        miss_src, miss_dst, miss_count, num_real_reqs, host_cache, device_buffer,
        item_size_bytes, g.batch, g.top_k, g.host_rows, g.device_rows)
    resolve = _resolve_launch(top_k_tokens, device_buffer_tokens, host_cache_locs,
                              device_buffer_locs, top_k_device_locs, req_pool_indices,
                              seq_lens, lru_slots, num_real_reqs, g, miss_src, miss_dst,
                              miss_count, block_h)
    return resolve, copy


def copy_cache_planned_mla(*, miss_src, miss_dst, miss_count, num_real_reqs, host_cache,
                           device_buffer, item_size_bytes: int, num_blocks: int = 4,
                           block_size: int = 1024, is_dsv4_layout: bool = False,
                           skip_io: bool = False) -> None:
    """Triton ``copy_cache_planned_mla`` (SGLang's keywords; semantics of
    ``sglang_reference.copy_cache_planned_mla``): one launch, none when ``skip_io``."""
    if is_dsv4_layout:
        raise ValueError("copy_cache_planned_mla: is_dsv4_layout=True (DeepSeek-V4's "
                         "page-padded rows) is SGLang's own kernel")
    g = checked(check_copy_planned, (miss_src, miss_dst, miss_count, num_real_reqs,
                                     host_cache, device_buffer, item_size_bytes))
    if skip_io:
        return
    if miss_src.device.type != "cuda":
        _check_backend(miss_src.device)
    _launch(planned_copy_launch(miss_src, miss_dst, miss_count, num_real_reqs, host_cache,
                                device_buffer, item_size_bytes, g.rows, g.columns, g.host_rows,
                                g.device_rows), miss_src)
