"""The scheduler checks its own bookkeeping against RAM before building any of it (#22)."""

import dataclasses
import tracemalloc

import pytest

from hisparse_triton import memory
from hisparse_triton.errors import HostMemoryError
from hisparse_triton.scheduler import HiSparseScheduler
from hisparse_triton.scheduler.bookkeeping import BYTES_PER_POOL_BLOCK, bookkeeping_items
from scheduler_plans import make_plan, make_scheduler


@pytest.mark.parametrize("field", ["num_blocks", "hisparse_host_num_blocks"])
def test_a_huge_plan_is_refused_before_any_bookkeeping_exists(field):
    plan = make_plan()
    kvc = dataclasses.replace(plan.kv_cache_config, **{field: 10**12})
    tracemalloc.start()
    try:
        with pytest.raises(HostMemoryError, match=r"the scheduler's bookkeeping \(device "
                                                  r"block pool .* exceeds 90% of the "
                                                  r"available RAM"):
            HiSparseScheduler(kvc, plan.config, max_num_seqs=3)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 10 << 20          # not gigabytes of tables first


def test_the_check_uses_the_ram_probe_and_the_fraction(monkeypatch):
    plan = make_plan()
    s = make_scheduler()
    items = bookkeeping_items(s.groups, s.layout, num_device_blocks=s.num_device_blocks,
                              num_host_blocks=s.num_host_blocks, max_num_seqs=3)
    needed = sum(n for _, n in items)
    monkeypatch.setattr(memory, "available_ram_bytes", lambda: needed)
    HiSparseScheduler(plan.kv_cache_config, plan.config, max_num_seqs=3, host_ram_fraction=1.0)
    with pytest.raises(HostMemoryError, match=r"exceeds 50% of the available RAM"):
        HiSparseScheduler(plan.kv_cache_config, plan.config, max_num_seqs=3,
                          host_ram_fraction=0.5)
    with pytest.raises(ValueError, match=r"host_ram_fraction must be in \(0, 1\]"):
        HiSparseScheduler(plan.kv_cache_config, plan.config, max_num_seqs=3,
                          host_ram_fraction=0)


def test_the_stated_cost_per_block_is_what_the_pools_hold():
    s = make_scheduler(device_blocks=500)
    for pool in (s.device_block_pool, s.host_block_pool):
        arrays = (pool._ref_array, pool._readers_array, pool._truly._next_array,
                  pool._truly._prev_array, pool._cached._next_array, pool._cached._prev_array)
        assert sum(a.nbytes for a in arrays) == BYTES_PER_POOL_BLOCK * pool.num_blocks
