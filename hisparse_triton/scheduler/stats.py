"""``SchedulerStats`` and the scheduler's cumulative counters (no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from hisparse_triton.scheduler.block_pool import BlockPool
from hisparse_triton.scheduler.journal import Journal

#: Cumulative counters of ``SchedulerStats`` (zeroed by ``reset_stats``).
COUNTERS = ("unpinned_pages", "lost_pages", "readopted_pages", "prefix_hit_tokens",
            "prefix_query_tokens", "window_released_pages")


@dataclass(frozen=True)
class SchedulerStats:
    """Pool occupancy and residency counters of a scheduler (``HiSparseScheduler.stats()``).

    Occupancy now: ``*_blocks`` device blocks owned per kind (an unpinned page's block is
    free, not counted), ``host_blocks`` host blocks owned, ``cached_device_blocks`` free
    device blocks that still hold a readable page (unpinned or prefix-cached),
    ``device_blocks_total`` / ``host_blocks_total`` allocatable blocks,
    ``peak_device_blocks`` / ``peak_host_blocks`` the most ever owned, ``num_requests`` live
    requests, ``offloaded_requests`` those holding a hot region.

    Cumulative (``reset_stats`` zeroes them): ``unpinned_pages`` resident page blocks
    unpinned, ``lost_pages`` unpinned pages whose block went to another owner,
    ``readopted_pages`` GPU copies of resident pages adopted by a prefix hit instead of
    being read from the host, ``prefix_hit_tokens`` / ``prefix_query_tokens`` prompt
    tokens found cached / looked up, ``window_released_pages`` sliding-window pages
    released; ``steps`` plans emitted.
    """

    resident_blocks: int
    hot_blocks: int
    host_blocks: int
    indexer_blocks: int
    regular_blocks: int
    cached_device_blocks: int
    device_blocks_total: int
    host_blocks_total: int
    peak_device_blocks: int
    peak_host_blocks: int
    num_requests: int
    offloaded_requests: int
    unpinned_pages: int
    lost_pages: int
    readopted_pages: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    window_released_pages: int
    steps: int

    @property
    def device_blocks(self) -> int:
        """Device blocks owned over all groups."""
        return self.indexer_blocks + self.resident_blocks + self.hot_blocks + self.regular_blocks


class Counters:
    """The cumulative counters (``COUNTERS``) and the pools' peak use, journaled."""

    def __init__(self, journal: Journal) -> None:
        self._journal = journal
        self.values = dict.fromkeys(COUNTERS, 0)
        self.peak_device = 0
        self.peak_host = 0

    def add(self, name: str, amount: int) -> None:
        if amount:
            self._journal.setitem(self.values, name, self.values[name] + amount)

    def track_peaks(self, device_used: int, host_used: int) -> None:
        """Raise the peaks to the pools' current use."""
        j = self._journal
        if device_used > self.peak_device:
            j.setattr(self, "peak_device", device_used)
        if host_used > self.peak_host:
            j.setattr(self, "peak_host", host_used)

    def reset(self, device_used: int, host_used: int) -> None:
        """Zero the counters; peaks restart from the current use (not journaled)."""
        self.values = dict.fromkeys(COUNTERS, 0)
        self.peak_device, self.peak_host = device_used, host_used

    def stats(self, in_use: Mapping[str, int], device_pool: BlockPool, host_pool: BlockPool, *,
              num_requests: int, offloaded_requests: int, steps: int) -> SchedulerStats:
        """``SchedulerStats`` of these counters, the block references held per group kind
        (``in_use``) and the pools."""
        return SchedulerStats(
            resident_blocks=in_use["resident"], hot_blocks=in_use["hot"],
            host_blocks=host_pool.num_used, indexer_blocks=in_use["indexer"],
            regular_blocks=in_use["regular"], cached_device_blocks=device_pool.num_cached,
            device_blocks_total=device_pool.capacity, host_blocks_total=host_pool.capacity,
            peak_device_blocks=self.peak_device, peak_host_blocks=self.peak_host,
            num_requests=num_requests, offloaded_requests=offloaded_requests, steps=steps,
            **{name: self.values[name] for name in COUNTERS})

    def snapshot(self) -> tuple:
        return (sorted(self.values.items()), self.peak_device, self.peak_host)


__all__ = ["COUNTERS", "Counters", "SchedulerStats"]
