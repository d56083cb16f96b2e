"""The split gather's capacity rule: how many rows its exchange carries (no torch).

A split gather (``worker.split_gather``) exchanges a fixed number of rows per call, so that
its shapes are fixed and nothing waits for the device: a *capacity fraction* ``f`` of the
miss plan's columns (``f x R x K`` split rows for an ``[R, K]`` plan, pooled over the rows
of a chunk). Misses past the capacity are still gathered exactly, by every rank itself (the
overflow pass), so ``f`` trades bytes exchanged between the GPUs against bytes pulled again
over each GPU's own host link.

The rule, shared by the worker (``split_gather_fraction="auto"``) and ``hisparse-triton
advise --tp-split``: ``f = capacity_fraction(m)`` is the smallest of ``CAPACITY_LEVELS`` at
or above ``m x (1 + SPLIT_HEADROOM)``, where ``m`` is the miss fraction (misses / plan
columns). The worker observes ``m`` on its own device counters, over ``SPLIT_RETUNE_PLANS``
plans at a time, and moves ``f`` with ``retune``: up at once, down only when the target is
at least two levels lower (so a steady miss rate keeps one exchange shape).

Why a headroom over the mean rather than the mean: a slot of capacity that stays empty costs
its bytes over the GPU-to-GPU exchange (about 10x the speed of the host link), a miss past
the capacity costs a row over every rank's host link; with a 25% headroom a step's misses
rarely exceed the capacity, and the exchange carries about 1.3x the misses instead of the
1.9x of a fixed 25%-of-top-k capacity at a 13.4% miss rate.
"""

from __future__ import annotations

import math

__all__ = ["CAPACITY_LEVELS", "MIN_CHUNK_ROWS", "SPLIT_CHUNKS", "SPLIT_HEADROOM",
           "SPLIT_RETUNE_PLANS", "SPLIT_START_FRACTION", "capacity_fraction", "capacity_rows",
           "check_fraction", "chunk_rows", "retune"]

#: The capacity fractions an exchange may take: 1/64 steps up to 1/4, then coarser, so that
#: a deployment uses few exchange shapes (each keeps its buffers).
CAPACITY_LEVELS: tuple[float, ...] = (
    *(k / 64 for k in range(1, 17)), 5 / 16, 3 / 8, 7 / 16, 1 / 2, 5 / 8, 3 / 4, 7 / 8, 1.0)
#: Headroom of the capacity over the observed miss fraction.
SPLIT_HEADROOM = 0.25
#: The capacity fraction of ``"auto"`` before a miss rate was observed.
SPLIT_START_FRACTION = 0.25
#: Plans between two observations of the miss fraction (``"auto"``). At least the plan
#: staging ring's depth + 1 (``worker.tables.STAGING_SLOTS``), so that the counters read at
#: a plan were copied so long ago that reading them never waits for the device.
SPLIT_RETUNE_PLANS = 8
#: Chunks of a split gather: the host-link pull of chunk ``i + 1`` runs while chunk ``i`` is
#: exchanged.
SPLIT_CHUNKS = 2
#: The fewest plan rows a chunk holds (a smaller batch takes fewer chunks): a chunk's
#: capacity is pooled over its rows, so a new request's row (a first step that misses
#: almost all of its top-k) fits the headroom of the others instead of spilling.
MIN_CHUNK_ROWS = 16


def check_fraction(fraction: object) -> "float | str":
    """``fraction`` as ``split_gather_fraction`` takes it: ``"auto"``, or a number in
    ``(0, 1]``; ``ValueError`` naming it otherwise."""
    if fraction == "auto" and isinstance(fraction, str):
        return "auto"
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
            or not 0.0 < fraction <= 1.0:
        raise ValueError(f"split_gather_fraction must be 'auto' or a number in (0, 1], got "
                         f"{fraction!r}.")
    return float(fraction)


def capacity_fraction(miss_fraction: float, headroom: float = SPLIT_HEADROOM) -> float:
    """The smallest ``CAPACITY_LEVELS`` entry at or above ``miss_fraction x (1 +
    headroom)`` (1.0 when none is)."""
    if not math.isfinite(miss_fraction) or miss_fraction < 0:
        raise ValueError(f"miss_fraction must be a finite number >= 0, got {miss_fraction!r}.")
    if not math.isfinite(headroom) or headroom < 0:
        raise ValueError(f"headroom must be a finite number >= 0, got {headroom!r}.")
    target = miss_fraction * (1.0 + headroom)
    for level in CAPACITY_LEVELS:
        if level >= target - 1e-12:
            return level
    return 1.0


def retune(current: float, miss_fraction: float, headroom: float = SPLIT_HEADROOM) -> float:
    """The capacity fraction after observing ``miss_fraction`` at ``current``: the rule's
    target when it is higher than ``current`` or at least two levels lower, else
    ``current``."""
    target = capacity_fraction(miss_fraction, headroom)
    if target >= current:
        return target
    lower = [level for level in CAPACITY_LEVELS if level < current - 1e-12]
    return target if len(lower) >= 2 and target <= lower[-2] + 1e-12 else current


def chunk_rows(rows: int, chunks: int, min_rows: int = MIN_CHUNK_ROWS) -> tuple[int, int]:
    """``(rows per chunk, chunks)`` of a plan of ``rows`` rows cut into at most ``chunks``
    chunks of at least ``min_rows`` rows (one chunk when ``rows < 2 x min_rows``)."""
    n = max(1, min(chunks, rows // max(1, min_rows)))
    rpc = -(-rows // n)
    return rpc, -(-rows // rpc)


def capacity_rows(rows: int, cols: int, ranks: int, fraction: float) -> int:
    """Staging rows per rank of a chunk of ``rows`` plan rows of ``cols`` columns at
    ``fraction``: ``ceil(fraction x rows x cols / ranks)``, at least 1 and at most what the
    chunk can hold (``rows x ceil(cols / ranks)``, reached at fraction 1: every miss
    split)."""
    most = rows * -(-cols // ranks)
    if fraction >= 1.0:
        return most
    return min(most, max(1, math.ceil(fraction * rows * cols / ranks - 1e-9)))
