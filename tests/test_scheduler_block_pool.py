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
    # b was freed first, but a truly free block is reused before any cached one
    assert pool.allocate(1) == [a] and reused == []    # a had no reader: no call
    assert pool.allocate(1) == [b] and reused == [b]   # then b; its readers are told
    assert pool.num_cached == 0 and pool.readers(b) == 0


def test_no_cached_page_is_lost_while_truly_free_blocks_remain():
    """#22: an unpinned page was reused while 23 truly free blocks remained."""
    reused = []
    pool = BlockPool(30, "device", on_reuse=lambda b: (reused.append(b), pool.drop_reader(b)))
    blocks = pool.allocate(29)
    for block in blocks[:6]:
        pool.add_reader(block)
    pool.free(blocks)                       # cached ones first in free order
    truly = pool.num_truly_free
    assert truly == 23
    got = pool.allocate(truly)
    assert reused == [] and set(got) == set(blocks[6:]) and pool.num_cached == 6
    assert pool.allocate(2) == blocks[:2] and reused == blocks[:2]   # longest cached first


def test_a_block_moves_between_the_queues_with_its_readers_and_undo_restores_it():
    journal = Journal()
    pool = BlockPool(6, journal=journal)
    blocks = pool.allocate(5)
    pool.add_reader(blocks[1])
    pool.free(blocks)
    before = pool.snapshot()
    with pytest.raises(RuntimeError), journal.transaction():
        pool.drop_reader(blocks[1])         # now truly free, at the back
        assert list(pool._free)[-1] == blocks[1] and pool.num_cached == 0
        pool.add_reader(blocks[3])          # now cached
        assert pool.num_cached == 1
        raise RuntimeError
    assert pool.snapshot() == before
    pool.check_invariants()


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
    pool.free(blocks)                        # truly free: 5, 3, 4; cached: 1, 2
    before = pool.snapshot()
    with pytest.raises(RuntimeError):
        with journal.transaction():
            assert pool.allocate(5) == [5, 3, 4, 1, 2]   # two cached: readers dropped
            assert pool.num_cached == 0
            pool.free([4])
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
    with pytest.raises(SchedulerStateError, match="truly free queue"):
        pool.check_invariants()
    pool._ref[2] = 1
    pool._readers[4] = 1                     # a free block with a reader in the wrong queue
    with pytest.raises(SchedulerStateError, match="cached queue"):
        pool.check_invariants()


def test_bookkeeping_costs_24_bytes_per_block():
    pool = BlockPool(100_000)
    arrays = (pool._ref_array, pool._readers_array, pool._truly._next_array,
              pool._truly._prev_array, pool._cached._next_array, pool._cached._prev_array)
    assert sum(a.nbytes for a in arrays) == 24 * 100_000
    assert pool.allocate(3) == [1, 2, 3] and pool.num_free == 99_996
