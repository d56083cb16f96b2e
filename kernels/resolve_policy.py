"""The replacement policy of resolve's hot buffers: the one phase that picks victims.

Every resolve kernel (``resolve_sorted``, ``resolve_hash``) decides *which* hot slots take the
row's misses and *where* every slot goes in the new order in one ``@triton.jit`` function,
``_lru_replacement``; its torch twin is ``hisparse_triton.ops.resolve.reference.
lru_replacement`` (the reference ``resolve`` calls it) and ``lru_replacement`` below launches
the kernel version on its own so that a test can compare the two bit for bit. Another policy
is another pair of functions with the same inputs and outputs (docs/resolve.md, "Replacement
policy", has the checklist).

Inputs, per LRU position ``p`` of a row (old order, least recently used first), a tile of
``BLOCK`` positions at a time: its class (0 = evictable: a valid slot that serves no hit this
step; 1 = serving a hit; 2 = invalid LRU entry; 3 = beyond ``H``), the row's totals
``n_evict`` / ``n_serving`` and ``n_fill`` (the misses that get a slot: ``min(misses,
n_evict)``), and the evictable / serving counts of the earlier tiles (carries).
Outputs: the position's new LRU index, whether it is *filled* (takes a miss) and its
evictable rank (the miss number it takes when filled). The LRU rule: the ``n_fill`` oldest
evictable slots take misses ``0 .. n_fill - 1``; the new order is unused evictable slots (old
order), filled slots (miss order), serving slots (old order), invalid entries (old order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["lru_replacement"]


@triton.jit
def _lru_replacement(cls, p, n_evict, n_serving, n_fill, ev_carry, hit_carry,
                     CARRIES: tl.constexpr):
    """LRU. ``cls``, ``p``: ``[BLOCK] int32`` classes and positions of a tile (positions in
    increasing order, the tiles in order); scalars as in the module docstring. Returns
    ``(new_pos, filled, erank, ev_carry, hit_carry)`` (``[BLOCK] int32``, ``[BLOCK] bool``,
    ``[BLOCK] int32`` and the carries for the next tile; with ``CARRIES=False``, a caller
    whose row is one tile, the carries come back unchanged: their two reductions, which a
    compiler cannot drop, are not made). ``BLOCK < 2**16``."""
    ev = cls == 0
    hit = cls == 1
    # One scan packs both ranks (the tile totals are two sums: ptxas schedules the sorted
    # kernel's wide rows better so than with one reduction of the packed scan).
    both = tl.cumsum(ev.to(tl.int32) + (hit.to(tl.int32) << 16), axis=0)
    erank = ev_carry + (both & 0xFFFF) - 1
    hrank = hit_carry + (both >> 16) - 1
    irank = (p + 1 - ev_carry - hit_carry) - (both & 0xFFFF) - (both >> 16) - 1
    filled = ev & (erank < n_fill)
    new_pos = tl.where(ev, tl.where(filled, n_evict - n_fill + erank, erank - n_fill),
                       tl.where(hit, n_evict + hrank, n_evict + n_serving + irank))
    if CARRIES:
        ev_carry += tl.sum(ev.to(tl.int32), axis=0)
        hit_carry += tl.sum(hit.to(tl.int32), axis=0)
    return new_pos, filled, erank, ev_carry, hit_carry


@triton.jit
def _lru_replacement_kernel(cls_ptr, n_fill_ptr, new_pos_ptr, filled_ptr, erank_ptr, H,
                            stride_r, BLOCK: tl.constexpr):
    """One program per row of ``cls [R, H]``: the policy alone (for the twin test)."""
    r = tl.program_id(0).to(tl.int64)
    n_evict = r.to(tl.int32) * 0
    n_serving = r.to(tl.int32) * 0
    for h0 in range(0, H, BLOCK):
        p = h0 + tl.arange(0, BLOCK)
        c = tl.load(cls_ptr + r * stride_r + p, mask=p < H, other=3)
        n_evict += tl.sum((c == 0).to(tl.int32), axis=0)
        n_serving += tl.sum((c == 1).to(tl.int32), axis=0)
    n_fill = tl.minimum(tl.load(n_fill_ptr + r), n_evict)
    ev_carry = r.to(tl.int32) * 0
    hit_carry = r.to(tl.int32) * 0
    for h0 in range(0, H, BLOCK):
        p = h0 + tl.arange(0, BLOCK)
        pm = p < H
        c = tl.load(cls_ptr + r * stride_r + p, mask=pm, other=3)
        new_pos, filled, erank, ev_carry, hit_carry = _lru_replacement(
            c, p, n_evict, n_serving, n_fill, ev_carry, hit_carry, True)
        tl.store(new_pos_ptr + r * stride_r + p, new_pos, mask=pm)
        tl.store(filled_ptr + r * stride_r + p, filled.to(tl.int32), mask=pm)
        tl.store(erank_ptr + r * stride_r + p, erank, mask=pm)


def lru_replacement(cls: torch.Tensor, misses: torch.Tensor, block: int = 16
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's policy on its own: ``cls [R, H] int32`` position classes (0 evictable,
    1 serving, 2 invalid), ``misses [R] int32`` distinct misses per row (``n_fill = min(misses,
    evictable)``) -> ``(new_pos, filled, erank)``, ``[R, H]`` int32 / bool / int32, as the
    torch twin ``reference.lru_replacement`` returns them. ``block``: positions per tile (a
    power of two >= 16; smaller than ``H`` exercises the carries)."""
    if cls.dim() != 2 or cls.dtype != torch.int32 or not cls.is_contiguous():
        raise ValueError(f"lru_replacement: cls must be a contiguous int32 [R, H] tensor, got "
                         f"{cls.dtype} {tuple(cls.shape)}")
    if misses.shape != (cls.shape[0],) or misses.dtype != torch.int32:
        raise ValueError(f"lru_replacement: misses must be int32 [{cls.shape[0]}], got "
                         f"{misses.dtype} {tuple(misses.shape)}")
    if block < 16 or block & (block - 1) or block >= 1 << 16:
        raise ValueError(f"lru_replacement: block must be a power of two in [16, 2**16), "
                         f"got {block}")
    R, H = cls.shape
    new_pos = torch.empty_like(cls)
    filled = torch.empty_like(cls)
    erank = torch.empty_like(cls)
    if R and H:
        _lru_replacement_kernel[(R,)](cls, misses, new_pos, filled, erank, H, cls.stride(0),
                                      BLOCK=block)
    return new_pos, filled.to(torch.bool), erank
