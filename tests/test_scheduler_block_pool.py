"""BlockPool's readable-until-reused side: readers, cached blocks, the on_reuse hook, journal
undo of every change, invariants, and the per-block cost of its bookkeeping."""

import pytest

from hisparse_triton.errors import BlockPoolError, SchedulerStateError
from hisparse_triton.scheduler.block_pool import BlockPool
from hisparse_triton.scheduler.journal import Journal


def test_a_freed_block_with_readers_is_cached_until_reused():
    reused = []
    pool = BlockPool(5, "device", on_reuse=lambda b: (reused.append(b), pool.drop_reader(b)))
    a, b, c, d = pool.allocate(4)
    pool.add_reader(b)                      # someone reads b's page
    pool.free([b, a])
    assert pool.num_free == 2 and pool.num_cached == 1 and pool.num_truly_free == 1
    assert pool.is_cached(b) and not pool.is_cached(a)
    assert pool.allocate(1) == [b] and reused == [b]   # FIFO: b first; its readers are told
    assert pool.num_cached == 0 and pool.readers(b) == 0
    assert pool.allocate(1) == [a] and reused == [b]   # a had no reader: no call


def test_take_adopts_a_cached_block_with_its_readers():
    pool = BlockPool(4, on_reuse=lambda b: pytest.fail("take is no reuse"))
    (a,) = pool.allocate(1)
    pool.add_reader(a)
    pool.free([a])
    pool.share(a)                           # free: taken, page and readers kept
    assert pool.ref_count(a) == 1 and pool.readers(a) == 1 and pool.num_cached == 0
    pool.share(a)                           # owned: touched
    assert pool.ref_count(a) == 2
    pool.free([a, a])
    assert pool.num_cached == 1


def test_a_reuse_hook_that_keeps_reading_is_caught():
    pool = BlockPool(3, on_reuse=lambda b: None)
    (a,) = pool.allocate(1)
    pool.add_reader(a)
    pool.free([a])
    with pytest.raises(SchedulerStateError, match="still read its old page"):
        pool.allocate(2)


def test_drop_reader_of_an_unread_block_is_an_error():
    pool = BlockPool(3)
    with pytest.raises(BlockPoolError, match="no reader to drop"):
        pool.drop_reader(1)
    with pytest.raises(BlockPoolError, match="null block"):
        pool.add_reader(0)


def test_a_transaction_undoes_allocation_reuse_and_readers_exactly():
    journal = Journal()
    pool = BlockPool(6, "device", journal,
                     on_reuse=lambda b: pool.drop_reader(b))
    blocks = pool.allocate(4)
    for block in blocks[:2]:
        pool.add_reader(block)
    pool.free(blocks)                        # queue: 5, then 1..4 (1 and 2 cached)
    before = pool.snapshot()
    with pytest.raises(RuntimeError):
        with journal.transaction():
            assert pool.allocate(3) == [5, 1, 2]   # two cached blocks: readers dropped
            assert pool.num_cached == 0
            pool.add_reader(5)
            pool.take(4)
            raise RuntimeError("roll back")
    assert pool.snapshot() == before
    pool.check_invariants()


def test_check_invariants_catches_corrupt_counts():
    pool = BlockPool(6)
    pool.allocate(3)
    pool.check_invariants()
    pool._ref[2] = 0                         # block 2 "free" but not in the queue
    with pytest.raises(SchedulerStateError, match="free queue"):
        pool.check_invariants()
    pool._ref[2] = 1
    pool._num_cached = 1
    with pytest.raises(SchedulerStateError, match="num_cached"):
        pool.check_invariants()


def test_bookkeeping_costs_16_bytes_per_block():
    pool = BlockPool(100_000)
    arrays = (pool._ref_array, pool._readers_array, pool._free._next_array,
              pool._free._prev_array)
    assert sum(a.nbytes for a in arrays) == 16 * 100_000
    assert pool.allocate(3) == [1, 2, 3] and pool.num_free == 99_996
