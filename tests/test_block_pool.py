"""BlockPool: null block, FIFO free queue, reference counts, all-or-nothing errors."""

import pytest
from hypothesis import given, settings, strategies as st

from hisparse_triton.scheduler.block_pool import NULL_BLOCK, BlockPool
from hisparse_triton.errors import BlockPoolError, CapacityError, HiSparseError


def test_null_block_is_never_handed_out():
    pool = BlockPool(5, "device")
    assert pool.capacity == 4 and pool.num_free == 4 and pool.num_used == 0
    blocks = pool.allocate(4)
    assert sorted(blocks) == [1, 2, 3, 4] and NULL_BLOCK not in blocks
    assert pool.num_free == 0 and pool.usage == 1.0


def test_exhaustion_raises_capacity_error_and_changes_nothing():
    pool = BlockPool(4, "host")
    pool.allocate(2)
    with pytest.raises(CapacityError, match=r"host pool cannot allocate 2 blocks for request "
                                            r"'r1': 1 of 3 are free") as info:
        pool.allocate(2, request_id="r1")
    assert info.value.needed == 2 and info.value.available == 1
    assert info.value.request_id == "r1"
    assert isinstance(info.value, HiSparseError) and isinstance(info.value, MemoryError)
    assert pool.num_free == 1
    assert pool.allocate(1) == [3]


def test_free_queue_is_fifo():
    pool = BlockPool(6)
    a = pool.allocate(5)
    pool.free([a[3], a[1]])
    assert pool.allocate(2) == [a[3], a[1]]


def test_touch_and_reference_counts():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.touch([b])
    assert pool.ref_count(b) == 2
    pool.free([b])
    assert pool.ref_count(b) == 1 and pool.num_free == 2
    pool.free([b])
    assert pool.ref_count(b) == 0 and pool.num_free == 3


def test_double_free_is_an_error_and_atomic():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    with pytest.raises(BlockPoolError, match=f"double free of block {a}"):
        pool.free([b, a, a])
    assert pool.ref_count(a) == 1 and pool.ref_count(b) == 1  # nothing released
    pool.free([a, b])
    with pytest.raises(BlockPoolError, match="double free"):
        pool.free([a])
    assert pool.num_free == 3


@pytest.mark.parametrize("bad", [0, -1, 4, 99, "1", 1.0, True])
def test_bad_ids(bad):
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(BlockPoolError):
        pool.free([bad])
    with pytest.raises(BlockPoolError):
        pool.touch([bad])
    assert pool.num_free == 0


def test_touch_of_free_block_is_an_error():
    pool = BlockPool(4)
    with pytest.raises(BlockPoolError, match="it is free"):
        pool.touch([2])


@pytest.mark.parametrize("bad", [0, -3, 1.5, None])
def test_bad_sizes(bad):
    with pytest.raises(ValueError):
        BlockPool(bad)


def test_bad_allocation_count():
    with pytest.raises(ValueError):
        BlockPool(4).allocate(-1)
    assert BlockPool(4).allocate(0) == []


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(1, 20),
       ops=st.lists(st.tuples(st.sampled_from(["alloc", "free", "touch"]),
                              st.integers(0, 6)), max_size=40))
def test_accounting_property(num_blocks, ops):
    """Any sequence of operations keeps free + referenced == capacity; no id twice."""
    pool = BlockPool(num_blocks)
    refs: dict[int, int] = {}
    for op, n in ops:
        if op == "alloc":
            if n > pool.num_free:
                with pytest.raises(CapacityError):
                    pool.allocate(n)
            else:
                for b in pool.allocate(n):
                    assert b not in refs and b != NULL_BLOCK
                    refs[b] = 1
        elif refs:
            block = sorted(refs)[n % len(refs)]
            if op == "touch":
                pool.touch([block])
                refs[block] += 1
            else:
                pool.free([block])
                refs[block] -= 1
                if refs[block] == 0:
                    del refs[block]
        assert pool.num_free + len(refs) == pool.capacity
        for block, count in refs.items():
            assert pool.ref_count(block) == count
    for block, count in list(refs.items()):
        pool.free([block] * count)
    assert pool.num_free == pool.capacity
