"""Scheduler stats: occupancy per group kind, cumulative counters (journaled), peaks."""

import pytest

from hisparse_triton.scheduler import SchedulerStats
from hisparse_triton.scheduler.journal import Journal
from hisparse_triton.scheduler.stats import COUNTERS, Counters
from scheduler_plans import make_scheduler


def test_counters_are_journaled_and_reset():
    journal = Journal()
    c = Counters(journal)
    c.add("lost_pages", 2)
    c.track_peaks(5, 3)
    before = c.snapshot()
    with pytest.raises(RuntimeError):
        with journal.transaction():
            c.add("lost_pages", 1)
            c.track_peaks(9, 1)
            raise RuntimeError("roll back")
    assert c.snapshot() == before and c.peak_device == 5 and c.peak_host == 3
    c.reset(1, 2)
    assert c.values == dict.fromkeys(COUNTERS, 0) and (c.peak_device, c.peak_host) == (1, 2)


def test_occupancy_is_reported_per_group_kind():
    s = make_scheduler(full=True, watermark=1.0)
    s.add_request("a", 20, 4)
    s.append_slots("a", 20)
    s.step()
    s.step()
    stats = s.stats()
    assert isinstance(stats, SchedulerStats)
    assert stats.indexer_blocks == 5 and stats.regular_blocks == 5
    assert stats.resident_blocks == 2 * 2                      # two tail pages per group
    assert stats.hot_blocks == s.devices.hot_cost and stats.offloaded_requests == 1
    assert stats.device_blocks == s.device_block_pool.num_used
    assert stats.unpinned_pages == 2 * 3 and stats.steps == 2
    assert stats.peak_device_blocks >= stats.device_blocks
    s.reset_stats()
    assert s.stats().unpinned_pages == 0 and s.stats().peak_device_blocks == stats.device_blocks
