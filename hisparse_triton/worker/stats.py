"""A worker's transfer counters: ``WorkerStats``, ``StatsSnapshot`` and reading them.

The resolve kernels accumulate three counters per index group on the device (``[G, 3]
int64``: hits, misses, masked); the worker counts the rest on the host (bytes mirrored,
plans applied). ``CounterReader`` turns both into a ``WorkerStats``: at once (one device
sync on CUDA) or through a ``StatsSnapshot`` that waits only for its own copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

__all__ = ["CounterReader", "GroupCounts", "StatsSnapshot", "WorkerStats"]


@dataclass(frozen=True)
class WorkerStats:
    """Transfer counters of a worker (``HiSparseWorker.stats()``).

    - ``hits``: resolved top-k columns served from a resident page or a hot slot;
      ``misses``: distinct host rows gathered (once per index group, however many follower
      layers copy them); ``masked``: columns that resolved to -1.
    - ``h2d_bytes``: bytes gathered host -> device (misses x row bytes x layers of the index
      group); ``d2h_bytes``: bytes this worker mirrored device -> host (0 on a rank that
      does not write a shared host pool).
    - ``plans``: plans applied.
    """

    hits: int
    misses: int
    masked: int
    h2d_bytes: int
    d2h_bytes: int
    plans: int

    @property
    def hit_rate(self) -> float:
        """``hits / (hits + misses)`` (1.0 when nothing was resolved)."""
        total = self.hits + self.misses
        return self.hits / total if total else 1.0


@dataclass(frozen=True)
class GroupCounts:
    """One index group's share of the transfer counters (``StatsSnapshot.groups()``):
    ``leader`` (the group's leader layer), ``hits``, ``misses``, ``masked`` as in
    ``WorkerStats``, and ``h2d_bytes`` (its misses x the bytes one miss gathers)."""

    leader: str
    hits: int
    misses: int
    masked: int
    h2d_bytes: int

    @property
    def miss_rate(self) -> float:
        """``misses / (hits + misses)`` (0.0 when nothing was resolved)."""
        total = self.hits + self.misses
        return self.misses / total if total else 0.0


class CounterReader:
    """Reads the device counters ``[G, 3] int64`` (hits, misses, masked per index group)
    and the host-side counts into ``WorkerStats``.

    ``bytes_per_miss[g]``: bytes one miss of index group ``g`` gathers (a row of every layer
    of the group), which turns misses into ``h2d_bytes``; ``d2h_bytes()`` / ``plans()``:
    the bytes mirrored and the plans applied so far. ``leaders``: the index groups' leader
    layers, in counter-row order (default ``group0``, ``group1``, ...), naming ``GroupCounts``.
    """

    def __init__(self, counters: torch.Tensor, bytes_per_miss: Sequence[int], *,
                 d2h_bytes: Callable[[], int], plans: Callable[[], int],
                 leaders: Optional[Sequence[str]] = None) -> None:
        if counters.dim() != 2 or counters.shape[1] != 3 or counters.dtype != torch.int64:
            raise ValueError(f"counters must be an int64 [groups, 3] tensor, got "
                             f"{counters.dtype} of shape {tuple(counters.shape)}.")
        if len(bytes_per_miss) != counters.shape[0]:
            raise ValueError(f"{len(bytes_per_miss)} bytes_per_miss values for "
                             f"{counters.shape[0]} index groups.")
        self.counters = counters
        self.bytes_per_miss = tuple(int(b) for b in bytes_per_miss)
        if leaders is not None and len(leaders) != counters.shape[0]:
            raise ValueError(f"{len(leaders)} leaders for {counters.shape[0]} index groups.")
        self.leaders = tuple(leaders) if leaders is not None else tuple(
            f"group{g}" for g in range(counters.shape[0]))
        self._d2h_bytes, self._plans = d2h_bytes, plans

    def stats_from(self, per_group: list[list[int]], *, d2h_bytes: int,
                   plans: int) -> WorkerStats:
        """``WorkerStats`` from counters already on the host (``[G][3]`` ints)."""
        hits, misses, masked = (sum(row[i] for row in per_group) for i in range(3))
        h2d = sum(row[1] * b for row, b in zip(per_group, self.bytes_per_miss))
        return WorkerStats(hits=hits, misses=misses, masked=masked, h2d_bytes=h2d,
                           d2h_bytes=d2h_bytes, plans=plans)

    def groups_from(self, per_group: list[list[int]]) -> tuple[GroupCounts, ...]:
        """``GroupCounts`` of every index group from counters already on the host."""
        return tuple(GroupCounts(leader, hits, misses, masked, misses * b)
                     for leader, (hits, misses, masked), b
                     in zip(self.leaders, per_group, self.bytes_per_miss))

    def read(self) -> WorkerStats:
        """The counters now (waits for the device on CUDA)."""
        return self.stats_from(self.counters.tolist(), d2h_bytes=self._d2h_bytes(),
                               plans=self._plans())

    def read_async(self) -> "StatsSnapshot":
        """Start copying the counters to the host on the current stream, after everything
        enqueued so far; the snapshot waits only for that copy (the host-side counts are
        taken now)."""
        d2h_bytes, plans = self._d2h_bytes(), self._plans()
        with torch.inference_mode(False), torch.no_grad():
            if self.counters.device.type == "cpu":
                return StatsSnapshot(self, self.counters.clone(), None, d2h_bytes, plans)
            host = torch.empty(self.counters.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(self.counters, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return StatsSnapshot(self, host, event, d2h_bytes, plans)

    def zero(self) -> None:
        """Zero the device counters."""
        self.counters.zero_()


class StatsSnapshot:
    """Counters being copied to the host (``HiSparseWorker.stats_async``)."""

    def __init__(self, reader: CounterReader, counters: torch.Tensor,
                 event: Optional["torch.cuda.Event"], d2h_bytes: int, plans: int) -> None:
        self._reader, self._counters, self._event = reader, counters, event
        self._d2h_bytes, self._plans = d2h_bytes, plans

    def ready(self) -> bool:
        """Whether ``result()`` would return without waiting."""
        return self._event is None or self._event.query()

    def result(self) -> WorkerStats:
        """The counters as of the ``stats_async`` call (waits for the copy only)."""
        if self._event is not None:
            self._event.synchronize()
        return self._reader.stats_from(self._counters.tolist(), d2h_bytes=self._d2h_bytes,
                                       plans=self._plans)

    def groups(self) -> tuple[GroupCounts, ...]:
        """Every index group's counters as of the ``stats_async`` call, from the same copy as
        ``result()`` (waits for that copy only; no other device read)."""
        if self._event is not None:
            self._event.synchronize()
        return self._reader.groups_from(self._counters.tolist())
