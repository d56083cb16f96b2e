"""The LRU rewrite both HiSparse residency rules share: after a step, the slots in LRU order
are the evictable slots no miss took (old order), then the evictable slots that took the
step's misses (miss order = their old LRU order), then the hit slots (old order).

``lru_positions`` is that rule for one tile of old LRU positions (a ``@triton.jit`` helper;
the kernels scatter each slot to its new position): ``kernels/sglang_swap_in.py``'s phase 4.
``kernels/vllm_residency.py``'s phase 4 computes the same positions inline.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["lru_positions"]


@triton.jit
def lru_positions(ev, hit, ev_carry, hit_carry, filled, n_evict):
    """New LRU positions (int32) of one tile of old positions: ``ev`` / ``hit`` (bool) class
    them (neither: outside the row); ``ev_carry`` / ``hit_carry`` count the evictable / hit
    positions of earlier tiles; the first ``filled`` of the row's ``n_evict`` evictable
    positions took misses. Returns the positions and the carries for the next tile. Tiles
    must hold fewer than 2**16 positions (both ranks share one ``tl.cumsum``)."""
    both = tl.cumsum(ev.to(tl.int32) + (hit.to(tl.int32) << 16), axis=0)
    erank = ev_carry + (both & 0xFFFF) - 1
    hrank = hit_carry + (both >> 16) - 1
    new_pos = tl.where(ev, tl.where(erank < filled, n_evict - filled + erank, erank - filled),
                       n_evict + hrank)
    return (new_pos, ev_carry + tl.sum(ev.to(tl.int32), axis=0),
            hit_carry + tl.sum(hit.to(tl.int32), axis=0))
