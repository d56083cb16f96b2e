"""Residency decisions: when a request offloads, which of its pages leave the GPU, which
requests to reclaim blocks from. Pure functions of the state they are given (no mutation,
no torch); the scheduler carries them out.

- *Pressure*: at or below ``free_block_watermark`` truly free device blocks (free and
  holding no readable page), or always with ``free_block_watermark=1.0``.
- A request *offloads* (takes its hot region) under pressure, or when it outgrows its
  admission window (``max_num_batched_tokens``: it keeps about one chunk of pages), once at
  least ``offload_threshold_pages`` of its pages can leave; from then on every durable
  page outside the last ``ACTIVE_TAIL_PAGES`` leaves (``release_range``).
- *Reclaim*: before an allocation that does not fit, offload the requests holding the most
  durable pages pinned until it fits (``plan_reclaim`` says who, and whether it will fit).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from hisparse_triton.config import ACTIVE_TAIL_PAGES
from hisparse_triton.scheduler.requests import Request
from hisparse_triton.specs import cdiv


def watermark_value(value: object) -> int | float:
    """``free_block_watermark`` as a plain ``int`` (a block count) or ``float`` (a fraction):
    numpy and other ``numbers`` integers and reals are accepted like Python ones, booleans
    are not."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"free_block_watermark must be a fraction in [0, 1] or a block "
                         f"count, got {value!r}.")
    if isinstance(value, numbers.Integral):
        return int(value)
    return float(value)


def watermark_blocks(value: object, capacity: int) -> int:
    """``free_block_watermark`` as a block count (a float: a fraction of ``capacity``)."""
    value = watermark_value(value)
    if isinstance(value, float):
        if not 0.0 <= value <= 1.0 or math.isnan(value):
            raise ValueError(f"free_block_watermark {value!r}: a float is a fraction of the "
                             f"device pool in [0, 1] (use an int for a block count).")
        return int(value * capacity)
    if value < 0:
        raise ValueError(f"free_block_watermark must be >= 0 blocks, got {value!r}.")
    return value


@dataclass(frozen=True)
class ReleaseRange:
    """Resident pages ``[first, limit)`` of a request leave the GPU (tail first); ``offload``:
    the request takes its hot region first."""

    first: int
    limit: int
    offload: bool


@dataclass(frozen=True)
class Reclaim:
    """What ``plan_reclaim`` decided: release these requests in order; ``available``: the
    device blocks available afterwards (``fits``: enough for the allocation)."""

    requests: tuple[Request, ...]
    available: int
    fits: bool
    freed: frozenset[int]   # blocks that become free


@dataclass(frozen=True)
class ResidencyPolicy:
    """The residency rules of one scheduler (see the module docstring)."""

    block_size: int
    watermark: int                  # truly free blocks at or below which pressure starts
    always_offload: bool            # free_block_watermark=1.0: pages leave at once
    offload_threshold_pages: int
    window_pages: Optional[int]     # pages a request keeps before it must offload

    @classmethod
    def from_settings(cls, free_block_watermark: object, capacity: int, *, block_size: int,
                      offload_threshold_pages: int,
                      window_tokens: Optional[int]) -> "ResidencyPolicy":
        """The policy of a scheduler's settings: ``free_block_watermark`` (a fraction of
        the ``capacity`` device blocks or a count; ``1.0``: always offload), the offload
        threshold, and the tokens a request may keep pinned (None: no window)."""
        value = watermark_value(free_block_watermark)
        return cls(block_size=block_size,
                   watermark=watermark_blocks(value, capacity),
                   always_offload=isinstance(value, float) and value >= 1.0,
                   offload_threshold_pages=offload_threshold_pages,
                   window_pages=(None if window_tokens is None
                                 else cdiv(window_tokens, block_size)))

    def under_pressure(self, truly_free_blocks: int) -> bool:
        return self.always_offload or truly_free_blocks <= self.watermark

    def releasable_limit(self, req: Request) -> int:
        """Resident pages ``[0, limit)`` are durable and outside the active tail."""
        B = self.block_size
        return min(req.committed_len // B, cdiv(req.seq_len, B) - ACTIVE_TAIL_PAGES)

    def releasable_limits(self, committed_len: np.ndarray, seq_len: np.ndarray) -> np.ndarray:
        """``releasable_limit`` of many requests at once (their lengths, ``int64``)."""
        B = self.block_size   # cdiv(seq_len, B) - tail = (seq_len + B - 1 - tail * B) // B
        return np.minimum(committed_len // B, (seq_len + (B - 1 - ACTIVE_TAIL_PAGES * B)) // B)

    def pinned_clean(self, req: Request) -> int:
        """Durable pages outside the active tail the request still owns."""
        return self.releasable_limit(req) - req.released_pages

    def should_offload(self, req: Request, pressure: bool) -> bool:
        if pressure:
            return True
        window = self.window_pages
        return window is not None and cdiv(req.reserved_tokens, self.block_size) > window

    def release_range(self, req: Request, pressure: bool) -> Optional[ReleaseRange]:
        """The pages of ``req`` that leave the GPU now, or None."""
        first, limit = req.released_pages, self.releasable_limit(req)
        if limit <= first:
            return None
        offload = req.hot is None
        if offload and (limit - first < self.offload_threshold_pages
                        or not self.should_offload(req, pressure)):
            return None
        return ReleaseRange(first=first, limit=limit, offload=offload)

    def plan_reclaim(self, requests: Iterable[Request], needed: int, available: int,
                     resident_blocks: Callable[[Request, int, int], Sequence[int]],
                     ref_count: Callable[[int], int],
                     kept: Optional[Callable[[int], bool]] = None) -> Reclaim:
        """Which requests to release (most pinned durable pages first) so that ``needed``
        blocks fit in ``available`` (+ what the releases free), and whether they will.

        ``resident_blocks(req, first, limit)``: the request's resident blocks of those
        pages (0 = none); ``ref_count(block)``: its pool reference count now; ``kept(block)``
        (optional): a block that, once free, stays out of reuse for now (the read holds: it
        frees nothing available). An offload takes reserved blocks only, so it changes
        nothing available; it needs them free, though, so with ``available`` below 0 (held
        blocks) a request that must offload first is passed over.
        """
        candidates = sorted((r for r in requests if self.pinned_clean(r) > 0),
                            key=lambda r: (-self.pinned_clean(r), r.row))
        released: dict[int, int] = {}   # block -> references the releases drop
        chosen: list[Request] = []
        for req in candidates:
            if needed <= available:
                break
            span = self.release_range(req, pressure=True)
            if span is not None and span.offload and available < 0:
                continue
            chosen.append(req)
            if span is None:
                continue
            for block in resident_blocks(req, span.first, span.limit):
                if block:
                    drops = released.get(block, 0) + 1
                    released[block] = drops
                    if drops == ref_count(block) and (kept is None or not kept(block)):
                        available += 1
        freed = frozenset(b for b, drops in released.items()
                          if drops == ref_count(b) and (kept is None or not kept(b)))
        return Reclaim(requests=tuple(chosen), available=available,
                       fits=needed <= available, freed=freed)


__all__ = ["Reclaim", "ReleaseRange", "ResidencyPolicy", "watermark_blocks", "watermark_value"]
